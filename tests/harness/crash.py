"""A crash injector: run work in a child process and SIGKILL it at a chosen moment or phase.

Two ways to choose the moment of the crash:

- **after a delay**: the child calls :meth:`Channel.ready` just before the work that should be cut
  (a save); the parent waits for that, sleeps ``kill_after_s`` and sends SIGKILL;
- **at a phase** (:class:`KillAt`): the child wraps the real local tier so that it sends SIGKILL to
  itself the n-th time it reaches a phase of a save (see :data:`PHASES`). Nothing is faked: the files
  are the real ones, written by the real code, and the kill is a real SIGKILL.

Children are forked from a ``forkserver`` that has imported torch and ckptd once, so each crash costs
milliseconds instead of the seconds a fresh interpreter needs to import torch. A target must therefore
be an importable module-level function (``harness.workloads`` holds the usual ones); it receives a
:class:`Channel` as first argument and returns a picklable value.

Example (a test)::

    injector = CrashInjector()
    # save step 5 (a 1 MiB state) and die just before its manifest is renamed into place
    result = injector.run(workloads.save_steps, directory, 5, 1, 2**20, kill_at=KillAt("manifest-commit"))
    assert result.killed
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Modules the forkserver imports once, so that children start fast.
PRELOAD = ("torch", "numpy", "ckptd", "harness.crash", "harness.workloads")

#: Phases of a save on the local tier at which a child can be killed:
#: ``data-write`` after a piece of a data file is written; ``data-commit``, ``index-commit`` and
#: ``manifest-commit`` when that file is complete but not yet renamed into place; ``committed`` right
#: after the manifest is renamed into place; ``retention`` after the first files of an old step are
#: deleted (its manifest) and before the rest.
PHASES = ("data-write", "data-commit", "index-commit", "manifest-commit", "committed", "retention")


@dataclass(frozen=True)
class KillAt:
    """Kill the child the ``occurrence``-th time it reaches ``phase`` (one of :data:`PHASES`)."""

    phase: str
    occurrence: int = 1

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; choose one of {', '.join(PHASES)}")
        if self.occurrence < 1:
            raise ValueError(f"occurrence must be >= 1, got {self.occurrence}")


@dataclass
class ChildResult:
    """How a child ended and what it said before."""

    exitcode: int | None
    #: Values the child sent with :meth:`Channel.report`, in order.
    reports: list[Any] = field(default_factory=list)
    #: Whether the child called :meth:`Channel.ready`.
    was_ready: bool = False
    #: The target's return value when it finished.
    value: Any = None
    #: The child's exception with its traceback, when the target raised.
    error: str | None = None

    @property
    def killed(self) -> bool:
        """Whether the child died of SIGKILL."""
        return self.exitcode == -signal.SIGKILL


class Channel:
    """The child's line to the parent."""

    def __init__(self, connection: multiprocessing.connection.Connection) -> None:
        self._connection = connection

    def ready(self) -> None:
        """Tell the parent that the part to be cut starts now (delayed kills count from here)."""
        self._connection.send(("ready", None))

    def report(self, value: Any) -> None:
        """Send a picklable value to the parent (it arrives even if the child is killed afterwards)."""
        self._connection.send(("report", value))


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kill_at: KillAt) -> None:
    """Wrap the real local tier of this (child) process so that it dies at ``kill_at``."""
    from ckptd.format.layout import MANIFEST_NAME
    from ckptd.tiers import local

    hits = 0

    def reached(phase: str) -> None:
        nonlocal hits
        if phase == kill_at.phase:
            hits += 1
            if hits == kill_at.occurrence:
                _kill_self()

    def kind(handle: local.AtomicFile) -> str:
        name = handle.final.name
        if name == MANIFEST_NAME:
            return "manifest"
        return "data" if name.endswith(".data") else "index"

    original_write, original_commit = local.AtomicFile.write, local.AtomicFile.commit
    original_delete = local.LocalTier.delete_files

    def write(self: local.AtomicFile, data: Any) -> int:
        offset = original_write(self, data)
        if kind(self) == "data":
            reached("data-write")
        return offset

    def commit(self: local.AtomicFile, **options: Any) -> None:
        reached(f"{kind(self)}-commit")
        original_commit(self, **options)
        if kind(self) == "manifest":
            reached("committed")

    def delete_files(self: local.LocalTier, paths: list[str]) -> None:
        original_delete(self, paths)
        if paths:
            reached("retention")

    original_write_at = local.AtomicFile.write_at

    def write_at(self: local.AtomicFile, offset: int, data: Any) -> None:
        original_write_at(self, offset, data)
        if kind(self) == "data":
            reached("data-write")

    local.AtomicFile.write = write  # type: ignore[method-assign]
    local.AtomicFile.write_at = write_at  # type: ignore[method-assign]
    local.AtomicFile.commit = commit  # type: ignore[method-assign]
    local.LocalTier.delete_files = delete_files  # type: ignore[method-assign]


def _child_main(connection: multiprocessing.connection.Connection, target: Callable[..., Any],
                args: tuple[Any, ...], kwargs: dict[str, Any], kill_at: KillAt | None) -> None:
    import torch

    torch.set_num_threads(1)
    if kill_at is not None:
        _arm(kill_at)
    try:
        value = target(Channel(connection), *args, **kwargs)
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    connection.send(("done", value))


class CrashInjector:
    """Runs targets in child processes and kills them (see the module docstring)."""

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(PRELOAD))

    def run(self, target: Callable[..., Any], *args: Any, kill_after_s: float | None = None,
            kill_at: KillAt | None = None, **kwargs: Any) -> ChildResult:
        """Run ``target(channel, *args, **kwargs)`` in a child and wait for it to end.

        With ``kill_after_s``, SIGKILL it that many seconds after it calls ``channel.ready()``; with
        ``kill_at``, it kills itself at that phase. Raises TimeoutError if it outlives ``timeout_s``.
        """
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_child_main, args=(sender, target, args, kwargs, kill_at),
                                        daemon=True, name=f"ckptd-crash-{getattr(target, '__name__', 'child')}")
        process.start()
        sender.close()
        result = ChildResult(exitcode=None)
        deadline = time.monotonic() + self.timeout_s
        try:
            if kill_after_s is not None:
                while not result.was_ready and self._receive(receiver, result, deadline):
                    pass
                if result.was_ready and process.is_alive():
                    time.sleep(kill_after_s)
                    os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            while self._receive(receiver, result, deadline):
                pass
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
                raise TimeoutError(f"child {process.name} still ran after {self.timeout_s} s; killed it")
        finally:
            receiver.close()
        result.exitcode = process.exitcode
        return result

    @staticmethod
    def _receive(receiver: multiprocessing.connection.Connection, result: ChildResult, deadline: float) -> bool:
        """Take one message into ``result``; False once the child closed its end or time ran out."""
        if not receiver.poll(max(0.0, deadline - time.monotonic())):
            return False
        try:
            kind, payload = receiver.recv()
        except EOFError:
            return False
        if kind == "ready":
            result.was_ready = True
        elif kind == "report":
            result.reports.append(payload)
        elif kind == "done":
            result.value = payload
        elif kind == "error":
            result.error = payload
        return True
