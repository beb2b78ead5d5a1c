"""Running real ``ckptd daemon`` and trainer processes in tests.

- :func:`write_config`: a daemon TOML file from plain values;
- :class:`DaemonProcess`: ``python -m ckptd.cli.main daemon --config FILE`` (or, ``slow_writes_s`` set, the
  same command under :mod:`harness.slow_daemon`, whose tier writes sleep and announce themselves on
  stdout so that a test can SIGKILL the daemon in the middle of a copy), with its log in a file, the
  state files it writes, and the journal read directly;
- :func:`run_trainer`: a child process that commits steps with a real :class:`~ckptd.CheckpointManager`
  and prints ``committed N`` after each commit (:data:`TRAINER`), optionally SIGKILLed right after one.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

#: A trainer: ``python -c TRAINER DIR FIRST COUNT SEED KEEP_LOCAL``; saves steps FIRST.. with a seeded state
#: (:func:`trainer_state`), keeping KEEP_LOCAL steps locally ("all": every one), and prints ``committed N``
#: once each is committed locally.
TRAINER = """
import sys, ckptd
from harness.daemon_process import trainer_state
directory, first, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
keep_local = None if sys.argv[5] == "all" else int(sys.argv[5])
with ckptd.CheckpointManager(directory, capture_rng=False, policy=ckptd.Policy(keep_local=keep_local)) as manager:
    for step in range(first, first + count):
        manager.save(step, trainer_state(step, seed))
        manager.wait()
        print(f"committed {step}", flush=True)
"""


def trainer_state(step: int, seed: int = 0) -> dict[str, Any]:
    """The state :data:`TRAINER` saves at ``step``: a 1 MiB tensor (its own chunk), a small one (in the pack)."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + step)
    return {"weights": torch.randn(256 * 1024, generator=generator), "bias": torch.randn(1024, generator=generator),
            "step": torch.tensor(step)}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(key))} = {_toml_value(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_config(path: Path, roots: list[Mapping[str, Any]] | None = None, **options: Any) -> Path:
    """Write a daemon config: top-level ``options`` and one ``[[roots]]`` table per mapping of ``roots``
    (``storage_options`` becomes its inline table). Returns ``path``."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in options.items()]
    for root in roots or []:
        lines.append("")
        lines.append("[[roots]]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in root.items())
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)  # storage_options may hold the test server's credentials (the daemon refuses them otherwise)
    return path


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition: (name, sorted (label, value) pairs) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, *, interval_s: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


class DaemonProcess:
    """A ``ckptd daemon`` child process (see the module docstring)."""

    def __init__(self, config: Path, state_dir: Path, *, env: Mapping[str, str] | None = None,
                 slow_writes_s: float | None = None, args: tuple[str, ...] = ()) -> None:
        self.config, self.state_dir = config, state_dir
        self.log_path = state_dir.parent / f"{state_dir.name}-daemon-{time.monotonic_ns()}.log"
        module = "harness.slow_daemon" if slow_writes_s is not None else "ckptd.cli.main"
        environment = dict(os.environ, **(env or {}))
        environment.setdefault("AWS_ACCESS_KEY_ID", "testing")
        environment.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        if slow_writes_s is not None:
            environment["CKPTD_TEST_SLOW_WRITES_S"] = str(slow_writes_s)
        self._log: IO[bytes] = open(self.log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", module, "daemon", "--config", str(config), *args],
                                        stdout=subprocess.PIPE, stderr=self._log, env=environment)
        #: Lines the child printed on stdout (the slow wrapper's write events), read on a thread.
        self.events: list[str] = []
        self._events_changed = threading.Condition()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            with self._events_changed:
                self.events.append(raw.decode(errors="replace").rstrip("\n"))
                self._events_changed.notify_all()

    def wait_event(self, predicate: Callable[[str], bool], count: int = 1, timeout_s: float = 60.0) -> list[str]:
        """Block until ``count`` stdout lines match ``predicate``; returns them."""
        deadline = time.monotonic() + timeout_s
        with self._events_changed:
            while True:
                matched = [line for line in self.events if predicate(line)]
                if len(matched) >= count:
                    return matched
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"the daemon printed {len(matched)} of {count} expected events; "
                                         f"log:\n{self.log()}")
                self._events_changed.wait(min(left, 0.5))

    def wait_for(self, condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """:func:`wait_until`, with this daemon's log tail in the error."""
        try:
            return wait_until(condition, timeout_s, what)
        except AssertionError as error:
            raise AssertionError(f"{error}; journal: {self.tasks()}; log:\n{self.log()}") from None

    # --- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """``daemon.json`` when this process wrote it, else None."""
        try:
            document = json.loads((self.state_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return None
        return document if document.get("pid") == self.process.pid else None

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait for ``daemon.json``; AssertionError with the log when the daemon exits first."""
        def ready() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(f"the daemon exited with {self.process.returncode}; log:\n{self.log()}")
            return self.state()
        return wait_until(ready, timeout_s, "the daemon to start")

    @property
    def http(self) -> str:
        state = self.state()
        assert state is not None and state.get("http"), "the daemon serves no HTTP"
        return f"http://{state['http']}"

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=10) as response:
            return json.loads(response.read())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The daemon's ``/metrics`` now, as :func:`metric_samples`."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as response:
            return metric_samples(response.read().decode())

    def tasks(self) -> list[dict[str, Any]]:
        """Every journal row (read straight from SQLite), by id."""
        connection = sqlite3.connect(self.state_dir / "journal.sqlite3", timeout=30)
        try:
            connection.row_factory = sqlite3.Row
            return [dict(row) for row in connection.execute("SELECT * FROM tasks ORDER BY id")]
        except sqlite3.OperationalError:  # not created yet
            return []
        finally:
            connection.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    # --- ending ----------------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self._close()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        finally:
            self._close()

    def _close(self) -> None:
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.kill()
        else:
            self._close()


def run_trainer(directory: Path, first: int, count: int, *, seed: int = 0, kill_after: int | None = None,
                keep_local: int | None = 2, timeout_s: float = 120.0) -> list[int]:
    """Run :data:`TRAINER`; returns the steps it reported committed. With ``kill_after``, SIGKILL it right
    after it reports that step (the manager's close never runs). ``keep_local``: its local retention (None:
    every step kept)."""
    keep = "all" if keep_local is None else str(keep_local)
    child = subprocess.Popen([sys.executable, "-c", TRAINER, str(directory), str(first), str(count), str(seed), keep],
                             stdout=subprocess.PIPE, text=True)
    committed: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("committed "):
                committed.append(int(line.split()[1]))
                if kill_after is not None and committed[-1] == kill_after:
                    child.send_signal(signal.SIGKILL)
                    break
            if time.monotonic() > deadline:
                break
        child.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if kill_after is None and child.returncode != 0:
        raise AssertionError(f"the trainer exited with {child.returncode} after committing {committed}")
    return committed
