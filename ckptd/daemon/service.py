"""The node daemon: watches local roots, journals promotion and replication of each committed step, runs it.

Threads (all named): the :class:`~ckptd.daemon.watcher.CommitWatcher`'s, one worker per kind of task
(``ckptd-daemon-promote``, ``ckptd-daemon-replicate``), ``ckptd-daemon-maintain`` (retention, the tier
probes and listings of the status document, the abandoned-upload abort, the pin cap and the gauges, every
pass), ``ckptd-daemon-scrub`` (a :class:`~ckptd.background.BackgroundWorker` running the bandwidth-limited
scrub passes the maintenance thread asks for, so that a pass of hours never holds up the rest of the
upkeep), plus the HTTP server's and the control socket's.

Life of a step (see ``docs``: the Sidecar daemon section of the design):

1. the watcher (or a trainer through the control socket, :meth:`Daemon.notice_commit`) reports a committed
   step; when its root's cadence wants it on the object tier and/or the buddy, the daemon pins it
   (:class:`~ckptd.promotion.pinning.PinnedSteps`, durable) and journals one task per tier;
2. the promote worker copies it with :class:`~ckptd.promotion.promoter.Promoter` (the library's code) from
   the pinned copy; the replicate worker with ``replicate_step`` to ``<buddy>/replicas/<node_id>/<root>``;
3. a task that fails is retried with exponential back-off (``retry_backoff_s``, doubling, at most
   :data:`MAX_BACKOFF_S`), its error kept in the journal and the status document; a tier that fails never
   holds the other one's worker; a task that cannot succeed (its source copy corrupt, its tier holding a
   different step with the number) is failed for good (kept with its error and its pin, tried once more at
   the next start);
4. when every task of the step is done (or skipped), the pin is dropped. The daemon's pins live in
   :data:`~ckptd.daemon.roots.DAEMON_PIN_DIRECTORY`, apart from the in-process uploader's.

A restarted daemon puts the tasks that were running back to pending (both copies are idempotent), journals
what was committed while it was down (the start rescan) and drops pins whose tasks are all finished.
:meth:`Daemon.stop` stops claiming, lets running tasks finish until the drain deadline and leaves the rest
journaled.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckptd.background import BackgroundWorker, OwnedThread, start_thread
from ckptd.config import settings
from ckptd.daemon.buddy import STOP_WAIT_S, BuddyDiscovery, Resolver
from ckptd.daemon.config import DaemonConfig, RootConfig
from ckptd.daemon.journal import Journal, Task
from ckptd.daemon.roots import DAEMON_PIN_DIRECTORY, RootRuntime, exclusive_lock
from ckptd.daemon.tier_health import TierHealth, probe_local
from ckptd.daemon.upkeep import Upkeep
from ckptd.daemon.watcher import CommitWatcher
from ckptd.errors import CkptdError, CommitError, IntegrityError, NotFoundError, StorageError
from ckptd.promotion.lag import lag_between, promotion_lag
from ckptd.promotion.pinning import PinCap, PinnedSteps, pins_over_cap
from ckptd.stepio.rank_writer import lower_thread_priority
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.base import StorageTier
from ckptd.manager.set_aside import set_aside_steps
from ckptd.tiers.local import LocalTier, write_file_atomically
from ckptd.tiers.registry import open_tier

log = logging.getLogger("ckptd.daemon")

#: Longest wait between two attempts of a failing task.
MAX_BACKOFF_S = 300.0
#: Attempts of a task whose source copy fails its checks before it is failed for good.
INTEGRITY_ATTEMPTS = 3
#: The file the daemon writes in its state_dir, and in every watched root.
STATE_FILE = "daemon.json"
ROOT_FILE = ".ckptd-daemon.json"
LOCK_FILE = "daemon.lock"
ROOT_LOCK_FILE = ".ckptd-daemon.lock"
#: How often the maintenance thread refreshes the tier listings of the status document.
_REFRESH_S = 10.0
_IDLE_WAIT_S = 0.5
#: Longest wait at start for the object tiers' clients to be made; past it the daemon starts anyway.
_CONNECT_WAIT_S = 60.0
_KEPT_ERRORS = 20
#: Worker threads run this much below ``background_nice`` (the in-process uploader's offset).
_EXTRA_NICE = 5

#: Called with (event, fields) at each step of a task (tests and debug logs).
EventHook = Callable[[str, dict[str, Any]], None]


class _NoMetrics:
    """Stands in for :class:`~ckptd.daemon.metrics.DaemonMetrics` when prometheus-client is missing."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name == "render":
            return lambda: (b"# prometheus-client is not installed\n", "text/plain")
        return lambda *args, **kwargs: None


def _metrics() -> Any:
    try:
        from ckptd.daemon.metrics import DaemonMetrics
    except ImportError:  # prometheus-client absent
        log.warning("prometheus-client is not installed: /metrics is empty (pip install 'ckptd[daemon]')")
        return _NoMetrics()
    return DaemonMetrics()


class Daemon:
    """One node's daemon over ``config`` (see the module docstring). Call order: :meth:`start` once, then
    :meth:`run_forever` (or your own wait), then :meth:`stop` once (any thread)."""

    def __init__(self, config: DaemonConfig, *, on_event: EventHook | None = None,
                 resolver: Resolver | None = None) -> None:
        self.config = config
        self.metrics: Any = _metrics()
        self.journal: Journal | None = None
        self.watcher: CommitWatcher | None = None
        self.http: Any = None
        self.control: Any = None
        self.http_port: int | None = None
        #: Called at each step of a task (journaled, task-start, promote-phase, task-done, task-failed); by
        #: default a debug log line.
        self.on_event = on_event or (lambda event, fields: log.debug("%s %s", event, fields))
        self._roots: dict[str, RootRuntime] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._wake = {kind: threading.Event() for kind in ("promote", "replicate")}
        self._workers: list[OwnedThread] = []
        self._announcing: list[OwnedThread] = []  # ckptd-daemon-release threads (announce_release)
        self._running: dict[str, Task] = {}
        self._commit_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._errors: list[dict[str, Any]] = []
        self._started_at: float | None = None
        self._lock_fds: list[int] = []
        self.upkeep = Upkeep(config, self.metrics, self._record_error, sleep=self._stopping.wait)
        #: Most pinned steps (and bytes only pins hold) per root: the ``pin_max_*`` settings.
        self.pin_cap = PinCap.from_settings()
        self._ready = False
        self._scrub_worker: BackgroundWorker[None] | None = None
        #: What the upkeep did (the status document's ``upkeep``): passes of the maintenance thread, scrubs.
        self._upkeep: dict[str, Any] = {"passes": 0, "last_pass": None, "last_pass_s": None, "scrub_running": False,
                                        "scrub_passes": 0, "scrub_started": None, "scrub_finished": None}
        #: The buddy replicated to: the configured peer:// one, or a dns:// ring's pick (``resolver``: tests).
        self.buddy = BuddyDiscovery.for_config(config, resolver=resolver, on_change=self._buddy_changed)

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the journal and the tiers, resume journaled work, start the watcher, the workers, the HTTP
        server and the control socket, and write ``daemon.json``. Raises ConfigError / StorageError."""
        config = self.config
        self._started_at = time.time()
        self._lock_state_dir()
        self.journal = Journal(config.journal_path)
        requeued = self.journal.requeue_running()
        if requeued:
            log.info("%d task(s) were running when the daemon last stopped: they run again", requeued)
        given_up = self.journal.retry_given_up()
        if given_up:
            log.info("%d task(s) that had failed for good get one more attempt", given_up)
        for root in config.roots:
            self._roots[root.name] = self._open_root(root)
        self.buddy.start()
        self._resume_pins()
        self._connect_remotes()
        self._start_servers()
        self.watcher = CommitWatcher({name: runtime.local.root for name, runtime in self._roots.items()},
                                     self._on_commit, mode=config.watch, poll_interval_s=config.poll_interval_s)
        self.watcher.start()
        for kind in ("promote", "replicate"):
            self._spawn(f"ckptd-daemon-{kind}", self._work, kind)
        self._scrub_worker = BackgroundWorker("ckptd-daemon-scrub", self._scrub_pass,
                                              describe=lambda _: "a scrub pass",
                                              on_start=lambda: _lower_priority(config.cpu_policy))
        self._spawn("ckptd-daemon-maintain", self._maintain)
        self._ready = True
        # Last: trainers and tests take daemon.json (and each root's file) to mean "watching and ready".
        self._write_state_files()
        log.info("daemon %s started (pid %d): %s", config.node_id, os.getpid(), config.describe())

    def _lock_state_dir(self) -> None:
        """One daemon per state_dir: an flock on ``daemon.lock``, held until the process ends."""
        self._lock_fds.append(exclusive_lock(self.config.state_dir / LOCK_FILE,
                                             "another ckptd daemon runs with this state_dir",
                                             "stop it, or give this daemon its own state_dir"))

    def _lock_root(self, root: RootConfig) -> None:
        """One daemon per root (two would copy every step twice): an flock on its ``.ckptd-daemon.lock``."""
        self._lock_fds.append(exclusive_lock(root.local / ROOT_LOCK_FILE,
                                             f"another ckptd daemon watches root {root.name!r}",
                                             "run one daemon per local root"))

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        self._workers.append(start_thread(name, target, *args))

    def _open_root(self, root: RootConfig) -> RootRuntime:
        local = LocalTier(root.local, create=True)  # never takes the trainer's writer lock
        self._lock_root(root)
        runtime = RootRuntime(config=root, local=local, pins=PinnedSteps(local, DAEMON_PIN_DIRECTORY))
        if root.remote is not None:
            runtime.remote = open_tier(root.remote, storage_options=dict(root.storage_options) or None)
        runtime.peer_url = self.config.peer_url(root, self.buddy.current)
        if runtime.peer_url is not None:
            try:
                runtime.peer = open_tier(runtime.peer_url, storage_options=self._peer_options())
            except CkptdError as error:  # replication stays journaled and retried; promotion goes on
                self._record_error("replicate", root.name, None, f"cannot open the peer tier: {error}")
        return runtime

    def _resume_pins(self) -> None:
        """Pins left by an earlier run: journal the tasks of those whose step has none, drop those whose
        tasks all finished, complete or drop incomplete ones."""
        assert self.journal is not None
        for name, runtime in self._roots.items():
            pinned = runtime.pins.pinned()
            for step in pinned:
                if not self.journal.tasks(root=name, step=step):
                    self._on_commit(name, step)
                if not self.journal.open_tasks(name, step):  # finished, or no tier wants it any more
                    self._unpin(runtime, step)
            for step in sorted(set(runtime.pins.tier.list_step_numbers()) - set(pinned)):
                # a pin a crash left half made or half dropped: completed while its step is still in the root
                # and has work left, else dropped (its files would hold disk for ever)
                try:
                    if self.journal.open_tasks(name, step) and runtime.local.is_committed(step):
                        runtime.pins.pin(step, runtime.local.list_files(step), durable=True)
                        continue
                except (CkptdError, OSError) as error:
                    log.warning("could not complete the pin of step %d of root %s: %s", step, name, error)
                self._unpin(runtime, step)

    def _start_servers(self) -> None:
        config = self.config
        try:
            from ckptd.daemon.http_server import HttpServer
        except ImportError as error:  # aiohttp missing
            log.warning("no HTTP API: %s (pip install 'ckptd[daemon]')", error)
        else:
            self.http = HttpServer(self, config.listen_host, config.listen_port, peer_routes=self._peer_routes(),
                                   auth=self.authenticator())
            self.http_port = self.http.start()
        try:
            from ckptd.daemon.control_socket import ControlSocket
        except ImportError as error:
            log.warning("no control socket: %s", error)
        else:
            self.control = ControlSocket(self, config.socket_path, allowed_uids=config.control_allowed_uids)
            self.control.start()

    def _peer_routes(self) -> Callable[[Any], None] | None:
        try:
            from ckptd.daemon.peer_api import PeerLimits, PeerNamespaces, add_peer_routes
        except ImportError as error:
            log.warning("the peer API is not available in this build: %s", error)
            return None
        config = self.config
        namespaces = PeerNamespaces({name: runtime.local.root for name, runtime in self._roots.items()},
                                    config.replica_path,
                                    on_verify_failure=lambda namespace: self.metrics.verify_failure(
                                        "local" if namespace.startswith("roots/") else "replica"))
        limits = PeerLimits(max_concurrent=config.peer_max_concurrency, max_put_bytes=config.peer_max_put_bytes)

        def served(namespace: str, count: int) -> None:
            self.metrics.peer_served(count)

        auth = self.authenticator()
        return lambda app: add_peer_routes(app, namespaces, token=config.peer_token, limits=limits, on_served=served,
                                           auth=auth)

    def authenticator(self) -> Any:
        """Who may ask the HTTP server what (:mod:`ckptd.daemon.auth`)."""
        from ckptd.daemon.auth import Authenticator, is_loopback

        config = self.config
        return Authenticator(config.peer_token, config.control_allowed_uids,
                             loopback_only=is_loopback(config.listen_host))

    def _peer_options(self) -> dict[str, Any]:
        """The replicating side's peer-tier options: this node's token (:func:`~ckptd.daemon.auth.derive_token`),
        which the buddy lets write only into ``replicas/<node_id>/``."""
        from ckptd.daemon.auth import derive_token

        token = self.config.peer_token
        return {"token": derive_token(token, "node", self.config.node_id) if token else None}

    def run_forever(self) -> None:
        """Block until :meth:`stop` has finished."""
        self._stopped.wait()

    def stop(self, drain_timeout_s: float | None = None) -> list[Task]:
        """Stop claiming tasks, let running ones finish until ``drain_timeout_s`` (default: the config's),
        stop the servers and remove the state files. Returns the tasks still running at the deadline (they
        stay journaled and run again at the next start)."""
        drain = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + drain
        self._ready = False
        self._stopping.set()
        self.buddy.stop(min(STOP_WAIT_S, drain))
        for event in self._wake.values():
            event.set()
        if self.watcher is not None:
            self.watcher.stop()
        with self._state_lock:
            announcing = list(self._announcing)
        for thread in [*self._workers, *announcing]:
            thread.join_within(deadline - time.monotonic())
        if self._scrub_worker is not None:  # a pass stops between chunks once stopping is set
            try:
                self._scrub_worker.close(max(0.0, deadline - time.monotonic()), what="the scrub pass")
            except CkptdError as error:
                log.warning("%s; it ends with the process", error)
        with self._state_lock:
            left = list(self._running.values())
        if left:
            log.warning("drain deadline passed with %d task(s) running: %s; they resume at the next start",
                        len(left), ", ".join(f"{task.kind} step {task.step} of {task.root}" for task in left))
        for server in (self.control, self.http):
            if server is not None:
                try:
                    server.stop()
                except Exception:  # noqa: BLE001 - stopping goes on
                    log.exception("stopping %s failed", type(server).__name__)
        self._remove_state_files()
        if not left and self.journal is not None:
            self.journal.close()
        if not left:
            for fd in self._lock_fds:
                os.close(fd)
            self._lock_fds = []
        self._stopped.set()
        log.info("daemon %s stopped", self.config.node_id)
        return left

    # --- state files --------------------------------------------------------------------------------
    def _state_document(self) -> dict[str, Any]:
        http = f"{self.config.listen_host}:{self.http_port}" if self.http_port is not None else None
        return {"pid": os.getpid(), "node_id": self.config.node_id, "http": http,
                "socket": str(self.config.socket_path) if self.control is not None else None}

    def _write_state_files(self) -> None:
        document = self._state_document()
        for name, runtime in self._roots.items():
            _write_json(runtime.local.root / ROOT_FILE, {**document, "root_name": name})
        # Last: clients and tests take the state_dir file as the sign that every root names this daemon.
        _write_json(self.config.state_dir / STATE_FILE, document)

    def _remove_state_files(self) -> None:
        paths = [self.config.state_dir / STATE_FILE] + [runtime.local.root / ROOT_FILE
                                                        for runtime in self._roots.values()]
        for path in paths:
            try:
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()
            except (OSError, ValueError):
                pass

    def _buddy_changed(self, buddy: str | None) -> None:
        """A dns:// buddy moved (a node joined or left): new steps replicate to ``buddy`` (None: to none; tasks
        for the former buddy are skipped as no longer configured), and each root's newest step is journaled for
        it at once, so that the new buddy holds a step to restore from."""
        newest: list[tuple[str, int]] = []
        with self._commit_lock:
            for name, runtime in self._roots.items():
                runtime.peer_url, runtime.peer = self.config.peer_url(runtime.config, buddy), None
                runtime.listings.pop("peer", None)
                try:
                    wanted = [step for step in runtime.local.committed_steps() if runtime.config.replicates(step)]
                except CkptdError:
                    wanted = []
                if wanted and runtime.peer_url is not None:
                    runtime.seen.discard(wanted[-1])
                    newest.append((name, wanted[-1]))
        for name, step in newest:
            self._on_commit(name, step)

    # --- commits ------------------------------------------------------------------------------------
    def notice_commit(self, root_name: str, step: int) -> bool:
        """A trainer says it committed ``step`` in root ``root_name``; returns whether the daemon promotes or
        replicates it (True only once its tasks are journaled and the step pinned: the trainer then drops its
        own pin). Raises NotFoundError when the step is not committed there, StorageError when the daemon
        could not take it (stopping, or pinning failed): the trainer keeps its pin."""
        runtime = self._roots.get(root_name)
        if runtime is None:
            raise NotFoundError(f"this daemon watches no root named {root_name!r}")
        if not runtime.local.is_committed(step) and step not in runtime.pins.pinned():
            raise NotFoundError("the step is not committed in the local root", step=step, tier=runtime.local.label)
        self._on_commit(root_name, step)
        targets = self._targets(runtime, step)
        if not targets:
            return False
        journal = self.journal
        journaled = {(task.kind, task.target) for task in journal.tasks(root=root_name, step=step)} if journal else set()
        if not set(targets) <= journaled or (journal is not None and journal.open_tasks(root_name, step)
                                             and step not in runtime.pins.pinned()):
            why = "the daemon is stopping" if self._stopping.is_set() else "the daemon could not pin it"
            raise StorageError(f"{why}: the step is not journaled", step=step, tier=runtime.local.label,
                               hint="keep promoting it in-process; the daemon's next rescan finds it if it is still "
                                    "in the root")
        return True

    def _targets(self, runtime: RootRuntime, step: int) -> list[tuple[str, str]]:
        """(kind, target URL) of the tasks a committed step of this root gets."""
        targets = []
        if runtime.config.promotes(step) and runtime.remote is not None:
            targets.append(("promote", runtime.config.remote or ""))
        if runtime.peer_url is not None and runtime.config.replicates(step):
            targets.append(("replicate", runtime.peer_url))
        return targets

    def _on_commit(self, root_name: str, step: int) -> None:
        """Pin and journal the tasks of a committed step (idempotent)."""
        runtime = self._roots[root_name]
        missing: list[tuple[str, str]] = []
        with self._commit_lock:
            if step in runtime.seen or self._stopping.is_set() or self.journal is None:
                return
            targets = self._targets(runtime, step)
            journaled = {(task.kind, task.target) for task in self.journal.tasks(root=root_name, step=step)}
            missing = [target for target in targets if target not in journaled]
            if missing:
                # every file of the step, durably (a trainer handing off may have pinned only its own, unsynced)
                try:
                    if runtime.local.is_committed(step):
                        runtime.pins.pin(step, runtime.local.list_files(step), durable=True)
                    elif step in runtime.pins.pinned():
                        runtime.pins.make_durable(step)
                    else:
                        return  # deleted before it could be pinned
                except (CkptdError, OSError) as error:  # retention deleted it while it was being pinned
                    log.warning("could not pin step %d of root %s (not journaled): %s", step, root_name, error)
                    return
                for kind, target in missing:
                    if self.journal.enqueue(kind, root_name, step, target):
                        self.on_event("journaled", {"kind": kind, "root": root_name, "step": step})
                        self._wake[kind].set()
                log.info("step %d of root %s committed: %s", step, root_name,
                         ", ".join(f"{kind} to {target}" for kind, target in missing))
            runtime.seen.add(step)
        if missing:
            self._apply_pin_cap(runtime)
            self._publish_depth()

    def _apply_pin_cap(self, runtime: RootRuntime) -> None:
        """While a tier is behind and local retention deletes steps, pins pile up: past :attr:`pin_cap` the
        oldest pins of deleted steps are released and their tasks not yet running skipped (never a step being
        copied, never the newest), as the library's uploader does."""
        assert self.journal is not None
        cap = self.pin_cap
        # a pin whose step is still in the root is a second name of its files: it costs nothing, and is not
        # counted (a daemon started on a root full of steps promotes them all)
        local = set(runtime.local.committed_steps())
        pinned = [step for step in runtime.pins.pinned() if step not in local]
        if len(pinned) <= 1:
            return
        with self._state_lock:
            busy = {task.step for task in self._running.values() if task.root == runtime.config.name}
        held = {step: runtime.pins.held_bytes(step) if cap.max_bytes else 0 for step in pinned}
        for step in pins_over_cap(held, cap, keep=busy):
            reason = (f"released by the pin cap (pin_max_steps={cap.max_steps}, pin_max_bytes={cap.max_bytes}): "
                      "its local copy is gone and newer steps wait too")
            skipped = self.journal.skip_open(runtime.config.name, step, reason)
            if self.journal.open_tasks(runtime.config.name, step):
                continue  # claimed meanwhile: it runs from its pin
            log.warning("step %d of root %s: %d task(s) skipped, %s", step, runtime.config.name, skipped, reason)
            self.metrics.pin_cap_skipped(runtime.config.name)
            self._announce_release(runtime, step)
            self._unpin(runtime, step)

    def _announce_release(self, runtime: RootRuntime, step: int) -> None:
        """A step this root holds only some ranks of (a multi-node job), dropped unpromoted by the pin cap: tell
        the object tier (:func:`~ckptd.promotion.promoter.announce_release`, on a thread of its own, so that a
        slow tier never holds up the watcher), so that the daemon committing it elsewhere stops waiting for
        these shares at once and the others skip it."""
        from ckptd.format.layout import MANIFEST_NAME, step_file
        from ckptd.promotion.promoter import announce_release

        remote = runtime.remote
        if remote is None:
            return
        try:
            manifest_bytes = runtime.pins.tier.read_bytes(step_file(step, MANIFEST_NAME))
            manifest = load_step_manifest(runtime.pins.tier, step)
            held = sorted(ranks_held(runtime.pins.tier, step, manifest))
        except CkptdError as error:
            log.debug("step %d of root %s: no release to announce: %s", step, runtime.config.name, error)
            return
        if len(held) == manifest.world_size:
            return

        def announce() -> None:
            try:
                announce_release(remote, step, held, manifest_bytes)  # type: ignore[arg-type]
            except CkptdError as error:
                log.warning("could not announce that root %s dropped its share of step %d: %s",
                            runtime.config.name, step, error)

        with self._state_lock:
            self._announcing = [thread for thread in self._announcing if thread.alive]
            self._announcing.append(start_thread("ckptd-daemon-release", announce))

    # --- workers ------------------------------------------------------------------------------------
    def _work(self, kind: str) -> None:
        assert self.journal is not None
        _lower_priority(self.config.cpu_policy)
        wake = self._wake[kind]
        while not self._stopping.is_set():
            try:
                task = self.journal.claim([kind])
            except Exception:  # noqa: BLE001 - the journal is busy or failing: wait and ask again
                log.exception("claiming a %s task failed", kind)
                task = None
            if task is None:
                wake.wait(_IDLE_WAIT_S)
                wake.clear()
                continue
            with self._state_lock:
                self._running[kind] = task
            try:
                self._run_task(task)
            except Exception as error:  # noqa: BLE001 - e.g. the journal failed: the worker must live on
                log.exception("the %s worker failed on step %d of root %s", kind, task.step, task.root)
                try:
                    self._failed(task, error)
                except Exception:  # noqa: BLE001 - left running: requeued at the next start
                    log.exception("could not journal the failure of %s of step %d", kind, task.step)
            finally:
                with self._state_lock:
                    self._running.pop(kind, None)
                self._publish_depth()

    def _connect_remotes(self) -> None:
        """Make the object tiers' clients at start (no request is sent): botocore loads its S3 model for each
        client, about a CPU-second in all, which would otherwise land on the trainer's first steps. It runs on
        a thread at the workers' priority, which the tiers' I/O threads it starts inherit."""
        thread = start_thread("ckptd-daemon-connect", self._connect_lowered)
        if not thread.join_within(_CONNECT_WAIT_S):
            log.warning("making the object tiers' clients takes more than %g s; the daemon starts meanwhile",
                        _CONNECT_WAIT_S)

    def _connect_lowered(self) -> None:
        _lower_priority(self.config.cpu_policy)
        for runtime in list(self._roots.values()):
            connect = getattr(runtime.remote, "connect", None)
            if connect is None:
                continue
            try:
                connect()
            except CkptdError as error:  # the first task tries again, and journals what fails
                log.info("could not open the clients of %s yet: %s", runtime.config.remote, error)

    def _run_task(self, task: Task) -> None:
        assert self.journal is not None
        runtime = self._roots.get(task.root)
        if runtime is None or (task.kind, task.target) not in self._targets(runtime, task.step):
            where = "root" if runtime is None else f"{task.kind} target"
            self.journal.skip(task.id, f"the {where} of this task is no longer configured ({task.target})")
            log.warning("%s of step %d of root %s to %s skipped: no longer configured", task.kind, task.step,
                        task.root, task.target)
            if runtime is not None:
                self._unpin_if_done(runtime, task.step)
            return
        self.on_event("task-start", {"kind": task.kind, "root": task.root, "step": task.step,
                                     "attempt": task.attempts})
        source: StorageTier | None = None
        try:
            source = self._source(runtime, task.step)
            if source is None:
                self.journal.skip(task.id, "the step is gone from the local root and from its pin")
                log.warning("%s of step %d of root %s skipped: the step is gone locally", task.kind, task.step,
                            task.root)
                self._unpin_if_done(runtime, task.step)
                return
            if task.kind == "promote":
                result = self._promote(runtime, source, task.step)
            else:
                result = self._replicate(runtime, source, task.step)
        except Exception as error:  # noqa: BLE001 - every failure is journaled and retried
            if _share_released(error):  # another node dropped its share: this step is never committed
                self.journal.skip(task.id, str(error))
                log.info("%s of step %d of root %s skipped: %s", task.kind, task.step, task.root, error)
                self._unpin_if_done(runtime, task.step)
                return
            if _set_aside(error):  # training went back: the step saved again with this number is promoted
                self.journal.fail(task.id, str(error), time.time() + self.config.retry_backoff_s)
                log.info("%s of step %d of root %s stopped, to be done again with what the root then holds: %s",
                         task.kind, task.step, task.root, error)
                return
            self._failed(task, error, source)
            return
        self.journal.finish(task.id, result)
        self.on_event("task-done", {"kind": task.kind, "root": task.root, "step": task.step})
        self._note_copied(runtime, "object" if task.kind == "promote" else "peer", task.step, source)
        self._unpin_if_done(runtime, task.step)

    def _source(self, runtime: RootRuntime, step: int) -> StorageTier | None:
        """The tier to copy a step from: its pin, or the local root when the pin is gone."""
        if runtime.pins.tier.is_committed(step):
            return runtime.pins.tier
        if runtime.local.is_committed(step):
            return runtime.local
        return None

    def _promote(self, runtime: RootRuntime, source: StorageTier, step: int) -> dict[str, Any]:
        from ckptd.promotion.promoter import Promoter

        assert runtime.remote is not None
        manifest = load_step_manifest(source, step)
        held = ranks_held(source, step, manifest)
        ranks = None if len(held) == manifest.world_size else list(held)

        def phase(name: str) -> None:
            self.on_event("promote-phase", {"root": runtime.config.name, "step": step, "phase": name})

        progress = self._progress(runtime.config.name, "object")
        try:
            report = Promoter(source, runtime.remote, on_phase=phase).promote(  # type: ignore[arg-type]
                step, ranks=ranks, progress=progress)
        finally:
            self.metrics.in_flight(runtime.config.name, "object", 0)
        self.metrics.promoted(runtime.config.name, report.bytes_uploaded, report.seconds)
        return asdict(report)

    def _progress(self, root: str, tier: str) -> Callable[[int], None]:
        """A progress hook that keeps ``ckptd_copy_in_flight_bytes{root,tier}`` at the bytes sent so far."""
        lock, sent = threading.Lock(), [0]
        self.metrics.in_flight(root, tier, 0)

        def count(bytes_: int) -> None:
            with lock:
                sent[0] += bytes_
                self.metrics.in_flight(root, tier, sent[0])

        return count

    def _replicate(self, runtime: RootRuntime, source: StorageTier, step: int) -> dict[str, Any]:
        from ckptd.promotion.replicate import replicate_step

        if runtime.peer is None:
            assert runtime.peer_url is not None
            runtime.peer = open_tier(runtime.peer_url, storage_options=self._peer_options())
        try:
            report = replicate_step(source, runtime.peer, step, progress=self._progress(runtime.config.name, "peer"))
        finally:
            self.metrics.in_flight(runtime.config.name, "peer", 0)
        self.metrics.replicated(runtime.config.name, report.bytes_sent, report.seconds)
        return asdict(report)

    def _failed(self, task: Task, error: BaseException, source: StorageTier | None = None) -> None:
        assert self.journal is not None
        delay = min(self.config.retry_backoff_s * 2 ** max(task.attempts - 1, 0), MAX_BACKOFF_S)
        text = str(error) if isinstance(error, CkptdError) else f"{type(error).__name__}: {error}"
        tier = "object" if task.kind == "promote" else "peer"
        self.metrics.error(task.kind)
        if isinstance(error, IntegrityError):  # a digest failed: of the copy read from, or of what the tier holds
            self.metrics.verify_failure(source.kind if source is not None and error.tier == source.label else tier)
        if _never_succeeds(error, source, task.attempts):
            text = f"failed for good (a restart tries once more): {text}"
            self.journal.give_up(task.id, text)
            self._record_error(task.kind, task.root, task.step, text)
            self.on_event("task-failed", {"kind": task.kind, "root": task.root, "step": task.step, "error": text,
                                          "for_good": True})
            log.error("%s of step %d of root %s %s", task.kind, task.step, task.root, text)
            return
        self.journal.fail(task.id, text, time.time() + delay)
        self.metrics.retry(tier, task.kind)
        self._record_error(task.kind, task.root, task.step, text)
        self.on_event("task-failed", {"kind": task.kind, "root": task.root, "step": task.step, "error": text})
        log.warning("%s of step %d of root %s failed (attempt %d, next in %.1fs): %s", task.kind, task.step,
                    task.root, task.attempts, delay, text, exc_info=not isinstance(error, CkptdError))

    def _unpin_if_done(self, runtime: RootRuntime, step: int) -> None:
        assert self.journal is not None
        if not self.journal.open_tasks(runtime.config.name, step):
            self._unpin(runtime, step)

    def _unpin(self, runtime: RootRuntime, step: int) -> None:
        try:
            runtime.pins.unpin(step)
        except CkptdError as error:
            log.warning("could not drop the pin of step %d of root %s: %s", step, runtime.config.name, error)

    def _record_error(self, where: str, root: str, step: int | None, text: str) -> None:
        with self._state_lock:
            self._errors.append({"where": where, "root": root, "step": step, "error": text, "when": time.time()})
            del self._errors[:-_KEPT_ERRORS]

    # --- maintenance: listings, retention, scrub ------------------------------------------------------
    def _maintain(self) -> None:
        _lower_priority(self.config.cpu_policy)
        while not self._stopping.wait(min(_REFRESH_S, self.config.poll_interval_s * 10)):
            try:
                self._maintain_once()
            except Exception:  # noqa: BLE001 - the next pass tries again
                log.exception("a maintenance pass failed")
                self.metrics.error("maintenance")

    def _maintain_once(self) -> None:
        began = time.monotonic()
        self.check_local_tiers()
        for runtime in list(self._roots.values()):
            for kind in ("object", "peer"):
                self._refresh_listing(runtime, kind)
            self.upkeep.apply_retention(runtime, self._protected(runtime))
            self.upkeep.abort_abandoned_uploads(runtime)
            self._apply_pin_cap(runtime)
            self._publish_pins(runtime)
        self.upkeep.apply_replica_retention()
        self._publish_depth()
        self._start_scrub_when_due()
        with self._state_lock:
            self._upkeep.update(passes=self._upkeep["passes"] + 1, last_pass=time.time(),
                                last_pass_s=time.monotonic() - began)
        self.metrics.upkeep_pass(time.time())

    def _start_scrub_when_due(self) -> None:
        """Hand a scrub pass to the scrub worker when ``scrub_interval_s`` has passed since the last one began
        and none runs (a pass that takes longer than the interval is followed by the next at once)."""
        worker, interval = self._scrub_worker, self.config.scrub_interval_s
        if worker is None:
            return
        for record in worker.take_failures():
            log.warning("a scrub pass failed: %s", record.describe())
            self.metrics.error("scrub")
            self._record_error("scrub", "*", None, record.describe())
        if interval <= 0 or self.journal is None or worker.pending or self._stopping.is_set():
            return
        last = self.journal.get_state("last_scrub", 0.0)  # kept across restarts
        if time.time() - last >= interval:
            self.journal.set_state("last_scrub", time.time())
            worker.submit(None)

    def _scrub_pass(self, _: None) -> None:
        with self._state_lock:
            self._upkeep.update(scrub_running=True, scrub_started=time.time())
        self.metrics.scrub_running(True)
        try:
            self.upkeep.scrub(list(self._roots.values()), self._stopping.is_set)
        finally:
            with self._state_lock:
                self._upkeep.update(scrub_running=False, scrub_finished=time.time(),
                                    scrub_passes=self._upkeep["scrub_passes"] + 1)
            self.metrics.scrub_running(False)

    def check_local_tiers(self) -> dict[str, TierHealth]:
        """Probe every root's local tier (see :mod:`ckptd.daemon.tier_health`); the verdicts go into the
        status document and the ``ckptd_tier_degraded`` gauge. The maintenance thread calls it each pass."""
        verdicts = {}
        for name, runtime in list(self._roots.items()):
            health = probe_local(runtime.local)
            if health.degraded and (runtime.health is None or not runtime.health.degraded):
                log.warning("the local tier of root %s is degraded: %s", name, health.reason)
            elif not health.degraded and runtime.health is not None and runtime.health.degraded:
                log.info("the local tier of root %s is healthy again", name)
            runtime.health = verdicts[name] = health
            self.metrics.tier_degraded(name, "local", health.degraded)
            try:
                self.metrics.steps_set_aside(name, len(set_aside_steps(runtime.local.root)))
            except CkptdError as error:
                log.debug("listing the set-aside steps of root %s failed: %s", name, error)
        return verdicts

    def _tier(self, runtime: RootRuntime, kind: str) -> StorageTier | None:
        return runtime.remote if kind == "object" else runtime.peer

    def _refresh_listing(self, runtime: RootRuntime, kind: str) -> None:
        """List the tier for the status document and the lag gauges. A tier that does not answer keeps a lag
        series that grows (counted from the newest step it last listed), is marked unreachable in the status
        document (``tiers.<kind>.reachable``) and degraded in ``ckptd_tier_degraded{tier=<kind>}``."""
        tier = self._tier(runtime, kind)
        if tier is None:
            return
        name = runtime.config.name
        try:
            steps = tier.committed_steps()
            lag = promotion_lag(runtime.local, tier)
            newest = (steps[-1], _created(tier, steps[-1])) if steps else None
        except CkptdError as error:
            log.debug("listing %s for the status failed: %s", tier.label, error)
            self._unreachable(runtime, kind, str(error))
            return
        if runtime.reachability.get(kind, {}).get("reachable") is False:
            log.info("the %s tier of root %s answers again", kind, name)
        runtime.reachability[kind] = {"reachable": True, "error": None, "since": None}
        self.metrics.tier_degraded(name, kind, False)
        if newest is not None:
            runtime.newest_listed[kind] = newest
        runtime.listings[kind] = (steps, lag)
        self.metrics.lag(name, kind, lag.steps_behind, lag.seconds_behind)

    def _unreachable(self, runtime: RootRuntime, kind: str, error: str) -> None:
        name = runtime.config.name
        earlier = runtime.reachability.get(kind, {})
        if earlier.get("reachable") is not False:
            log.warning("the %s tier of root %s does not answer: %s", kind, name, error)
        since = earlier.get("since") if earlier.get("reachable") is False else time.time()
        runtime.reachability[kind] = {"reachable": False, "error": error, "since": since}
        self.metrics.tier_degraded(name, kind, True)
        try:
            local_steps = sorted(set(runtime.local.committed_steps()) | set(runtime.pins.pinned()))
        except CkptdError:
            return
        if not local_steps:
            return
        local_newest = local_steps[-1]
        remote_newest, remote_created = runtime.newest_listed.get(kind, (None, None))
        source = runtime.local if runtime.local.is_committed(local_newest) else runtime.pins.tier
        lag = lag_between(local_newest, remote_newest, local_created=_created(source, local_newest),
                          remote_created=remote_created)
        self.metrics.lag(name, kind, lag.steps_behind, lag.seconds_behind)

    def _note_copied(self, runtime: RootRuntime, kind: str, step: int, source: StorageTier) -> None:
        """Add a step just committed on a tier to its listing and lag without asking the tier (the maintenance
        pass lists it again); the copy's manifest is the local one, so its creation time is known here."""
        if kind not in runtime.listings:  # never listed (just started): list it now rather than show a part
            self._refresh_listing(runtime, kind)
            return
        listed, _ = runtime.listings[kind]
        steps = sorted(set(listed) | {step})
        try:
            local_steps = runtime.local.committed_steps()
            local_newest = local_steps[-1] if local_steps else None
            local_created = _created(runtime.local, local_newest) if local_newest is not None else None
            remote_created = _created(source, steps[-1]) if steps[-1] == step else None
        except CkptdError:
            return
        lag = lag_between(local_newest, steps[-1], local_created=local_created, remote_created=remote_created)
        runtime.listings[kind] = (steps, lag)
        self.metrics.lag(runtime.config.name, kind, lag.steps_behind, lag.seconds_behind)

    def _publish_pins(self, runtime: RootRuntime) -> None:
        try:
            pinned = runtime.pins.pinned()
            local = set(runtime.local.committed_steps())
            held = sum(runtime.pins.held_bytes(step) for step in pinned if step not in local)
        except (CkptdError, OSError) as error:
            log.debug("counting the pins of root %s failed: %s", runtime.config.name, error)
            return
        self.metrics.pinned(runtime.config.name, len(pinned), held)

    def _publish_depth(self) -> None:
        """``ckptd_journal_depth`` of every kind (0 when none is open): after each pass, task and commit."""
        if self.journal is None:
            return
        try:
            depth = self.journal.depth()
        except Exception as error:  # noqa: BLE001 - the next call publishes it
            log.debug("reading the journal depth failed: %s", error)
            return
        for kind in ("promote", "replicate"):
            states = depth.get(kind, {})
            self.metrics.journal_depth(kind, sum(states.get(state, 0) for state in ("pending", "running", "failed")))

    def _protected(self, runtime: RootRuntime) -> set[int]:
        assert self.journal is not None
        return set(self.journal.open_steps(runtime.config.name)) | set(runtime.pins.pinned())

    # --- for the HTTP server and the control socket ---------------------------------------------------
    def is_ready(self) -> bool:
        """Started, not stopping, and the journal open."""
        return self._ready and not self._stopping.is_set()

    def root_for(self, path: Path) -> RootConfig | None:
        """The root watching the directory ``path`` (after resolving links), or None."""
        try:
            resolved = Path(path).resolve()
        except OSError:
            return None
        for runtime in self._roots.values():
            if runtime.local.root.resolve() == resolved:
                return runtime.config
        return None

    def describe_root(self, root_name: str) -> dict[str, Any]:
        """What the daemon does with a root (the control socket's hello answer)."""
        runtime = self._roots.get(root_name)
        if runtime is None:
            raise NotFoundError(f"this daemon watches no root named {root_name!r}")
        config = runtime.config
        return {"root_name": config.name, "promotes": runtime.remote is not None,
                "replicates": runtime.peer_url is not None, "remote": config.remote, "peer_url": runtime.peer_url,
                "remote_every_steps": config.remote_every_steps,
                "replicate_every_steps": config.replicate_every_steps, "node_id": self.config.node_id,
                "pin_directory": DAEMON_PIN_DIRECTORY}

    def record_trainer_report(self, root_name: str, report: dict[str, Any]) -> None:
        """Keep a trainer's save-stall and step-time report for the status document and metrics."""
        runtime = self._roots.get(root_name)
        if runtime is None:
            raise NotFoundError(f"this daemon watches no root named {root_name!r}")
        runtime.trainer_report = {**report, "received": time.time()}
        self.metrics.trainer_report(root_name, report.get("save_stall_s"), report.get("step_s"))

    def status(self) -> dict[str, Any]:
        """The status document (JSON-able): node, roots (steps and lag per tier), pending work, errors."""
        roots: dict[str, Any] = {}
        for name, runtime in self._roots.items():
            try:
                local_steps = runtime.local.committed_steps()
            except CkptdError:
                local_steps = []
            tiers: dict[str, Any] = {"local": {"url": str(runtime.local.root), "steps": local_steps,
                                               "health": runtime.health.to_json() if runtime.health else None}}
            for kind, url in (("object", runtime.config.remote), ("peer", runtime.peer_url)):
                if url is None:
                    continue
                steps, lag = runtime.listings.get(kind, (None, None))
                reach = runtime.reachability.get(kind, {})
                tiers[kind] = {"url": url, "steps": steps,
                               "lag_steps": None if lag is None else lag.steps_behind,
                               "lag_seconds": None if lag is None else lag.seconds_behind,
                               "reachable": reach.get("reachable"), "unreachable_since": reach.get("since"),
                               "error": reach.get("error")}
            roots[name] = {"local": str(runtime.local.root), "tiers": tiers, "pinned": runtime.pins.pinned(),
                           "trainer_report": runtime.trainer_report}
        replicas = {f"{tier.root.parent.name}/{tier.root.name}": tier.committed_steps()
                    for tier in self.upkeep.replica_tiers()}
        journal = self.journal
        depth = journal.depth() if journal is not None else {}
        errors = [asdict(error) for error in journal.recent_errors(10)] if journal is not None else []
        with self._state_lock:
            recent = list(self._errors[-10:])
            running = [{"kind": task.kind, "root": task.root, "step": task.step} for task in self._running.values()]
        started = self._started_at or time.time()
        with self._state_lock:
            upkeep = dict(self._upkeep)
        return {"upkeep": upkeep, "node_id": self.config.node_id, "pid": os.getpid(), "ready": self.is_ready(),
                "uptime_s": time.time() - started, "started": started, "roots": roots, "replicas": replicas,
                "pending": depth, "running": running, "errors": errors, "recent_errors": recent,
                "buddy": self.buddy.describe(),
                "watch": self.watcher.mode if self.watcher is not None else None, "http": self._state_document()["http"]}


def _never_succeeds(error: BaseException, source: StorageTier | None, attempts: int) -> bool:
    """Whether retrying cannot help: the copy read from failed its checks :data:`INTEGRITY_ATTEMPTS` times
    (a read racing a writer passes the next time; a corrupt chunk never does), or the target holds a
    different step with this number. Failures of the target are retried."""
    if isinstance(error, IntegrityError):
        return source is not None and error.tier == source.label and attempts >= INTEGRITY_ATTEMPTS
    return type(error) is CommitError and "different step" in error.message


def _share_released(error: BaseException) -> bool:
    """Whether a promotion stopped because another node dropped its share of the step (never committed)."""
    from ckptd.promotion.promoter import ShareReleasedError

    return isinstance(error, ShareReleasedError)


def _set_aside(error: BaseException) -> bool:
    """Whether a promotion stopped because the local copy of its step was set aside or saved again meanwhile."""
    from ckptd.errors import StepSetAsideError

    return isinstance(error, StepSetAsideError)


def _created(tier: StorageTier, step: int) -> float | None:
    try:
        return load_step_manifest(tier, step).created
    except CkptdError:
        return None


def _lower_priority(cpu_policy: str = "nice") -> None:
    """Copies and scrubs yield the CPU to the trainers of the node (and to peer reads, on the HTTP thread):
    the calling worker thread, and the copy threads it starts, run ``background_nice`` + 5 below normal,
    as the library's own uploader does (``CKPTD_BACKGROUND_NICE``; 0 leaves them alone). With
    ``cpu_policy="idle"`` they run at ``SCHED_IDLE`` too (Linux), taking only CPU no other thread wants:
    the least interference with a trainer, and the most lag (in /status and /metrics) on a saturated node."""
    nice = settings().background_nice
    lower_thread_priority(0 if nice <= 0 else nice + _EXTRA_NICE)
    if cpu_policy == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the calling thread, on Linux
        except OSError as error:
            log.warning("cpu_policy = 'idle': SCHED_IDLE refused (%s); the copy threads stay at nice", error)


def _write_json(path: Path, document: dict[str, Any]) -> None:
    write_file_atomically(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode(),
                          what="daemon state file",
                          hint="the daemon did not start: make its state_dir and every root writable for it")
