"""The worker side of ``ckptd launch``: :func:`run` forms the process group of the current generation, calls
the user's training function, and when a peer fails joins the next generation in the same process.

Call order, on every rank, on the main thread::

    def train(ctx: ckptd.elastic.WorkerContext) -> None:
        mgr = ctx.checkpoint_manager("/nvme/ckpt/run1", policy=ckptd.Policy(every_steps=100))
        start = mgr.restore(state)              # the step every rank agreed on, or None
        for step in range((start or 0) + 1, total + 1):
            train_step()                        # collectives on the default process group
            mgr.save(step, state)               # also a heartbeat
        mgr.close()

    ckptd.elastic.run(train)

What :func:`run` does for generation ``g`` (``CKPTD_GENERATION`` at start):

1. Waits until every rank is ready in ``g`` (a store barrier under ``gen{g}/``, with a deadline and
   progress logs), then ``init_process_group`` over ``PrefixStore("gen{g}/pg/", store)``.
2. Calls ``train_fn(ctx)``. A watcher thread follows the store's generation key: when the supervisor
   starts ``g + 1`` (a rank died or hung and is being replaced), the context's store view ends
   (:class:`~ckptd.elastic.generation_store.GenerationStore`), which releases any commit round waiting
   for the dead rank; a collective with the dead rank fails in gloo on its own (connection reset).
3. On such a failure (a gloo or store error, or the generation ended) the rank lets the writers of the
   managers the context made finish or fail their round, ``destroy_process_group()``, waits for the next
   generation and goes back to 1; the training function runs again, gets the same managers (moved to the
   new generation) and their ``restore`` agrees with every rank, the replacement included, on the newest
   step committed for all of them: a survivor whose last save is that step loads it from memory, the
   replacement from the nearest tier. Any other exception is this rank's own failure: it propagates, the
   process exits, and the supervisor replaces it.
4. When ``train_fn`` returns on every rank (a store barrier), the process group is destroyed and
   :func:`run` returns its value.

Every heartbeat (:func:`heartbeat`, each save) after the generation ended raises GenerationEndedError: a
rank leaves at its next step instead of entering a collective with a dead peer. When the job stops (a
supervisor got SIGTERM, or a budget is spent: ``elastic/stop``) a rank leaves the same way, lets its
managers finish or fail their round, closes them and exits with code 15 (``SystemExit``). Under ``ckptd launch
--checkpoint-on-stop`` it first saves the job's agreed stop step and closes its managers
(:mod:`ckptd.elastic.stop_checkpoint`).

The process group's timeout is ``CKPTD_ELASTIC_COLLECTIVE_TIMEOUT_S`` or, when longer,
:func:`collective_timeout_s` of the supervisor's hang timeout: a collective blocked on a hung peer lasts
until the supervisor kills that peer (its peers then see a connection reset), not until gloo gives up.

Before the first generation :func:`run` calls ``setup_fn`` (what does not depend on the rank: model,
optimizer, loader; ``ctx.setup`` holds its value) and freezes what exists then out of the garbage
collector. A survivor whose managers hold no committed step when a peer fails calls ``setup_fn`` again
before the next generation: that generation's restore finds nothing, and every rank, the replacement
included, starts from the initial state (only the failed rank is restarted, as when a step exists).
State that ``train_fn`` keeps outside ``ctx.setup`` and its own locals is not rebuilt. The same holds
when survivors do hold committed steps but no step is intact on every rank because a rank of the recovery
generation holds none on any tier (its node was lost before any of its steps left it): the managers'
restore sets every rank's committed local steps aside (kept), :func:`run` calls ``setup_fn`` again and then
``train_fn`` again in the same generation, and every rank starts from the initial state. A warm spare (``CKPTD_ELASTIC_SPARE`` set) then waits to be given a rank
(:func:`ckptd.elastic.spares.become_rank`) and goes on as that rank.

The managers of :meth:`WorkerContext.checkpoint_manager` keep the staged copies of their two newest saves
(a survivor restores from memory the step agreed when a peer died before the newest one committed): two
sets of staging buffers, so host memory holds two copies of the saved state, each set bounded by
``CKPTD_STAGING_BUDGET_BYTES`` (the budget is per set: set it to half the host memory meant for staging);
their ``restore`` runs a restore check with rollback (:mod:`ckptd.elastic.restore_check`).

Outside ``ckptd launch`` (no ``CKPTD_ELASTIC_STORE``) :func:`run` raises ConfigError;
:func:`heartbeat` does nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from ckptd.background import start_thread
from ckptd.config import settings
from ckptd.errors import CkptdError, ConfigError, GenerationEndedError, NoIntactCheckpointError, StillRunningError
from ckptd.elastic import keys
from ckptd.elastic.generation_store import GenerationStore
from ckptd.elastic.waiting import wait_for
from ckptd.elastic.restore_check import RestoreCheck, checked_restore, finite_tensors
from ckptd.elastic.spares import become_rank
from ckptd.elastic.stop_checkpoint import StopCheckpoint, close_timeout_s, stop_request
from ckptd.manager.commit import StoreCoordinator
from ckptd.manager.manager import CheckpointManager
from ckptd.manager.restoring import TierListings
from ckptd.manager.saving import MemoryCopy
from ckptd.state.staging import Stager

T = TypeVar("T")

log = logging.getLogger("ckptd.elastic")

#: Seconds between two looks of the watcher thread at the generation key.
_WATCH_S = 0.02


@dataclass(frozen=True)
class WorkerEnvironment:
    """What the supervisor tells a worker through its environment (torchrun's names plus ckptd's)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    store_host: str
    store_port: int
    generation: int
    restart_count: int
    #: The supervisor's hang timeout (0: none).
    hang_timeout_s: float = 0.0

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnvironment:
        env = dict(os.environ if environ is None else environ)
        if keys.ENV_STORE not in env:
            raise ConfigError(f"{keys.ENV_STORE} is not set: ckptd.elastic.run needs a rank started by "
                              "`ckptd launch`", hint="start the script with `ckptd launch --nproc-per-node N "
                              "script.py`")
        host, _, port = env[keys.ENV_STORE].rpartition(":")
        try:
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                       local_world_size=int(env["LOCAL_WORLD_SIZE"]), node_rank=int(env.get("GROUP_RANK", "0")),
                       store_host=host, store_port=int(port), generation=int(env[keys.ENV_GENERATION]),
                       restart_count=int(env.get(keys.ENV_RESTART_COUNT, "0")),
                       hang_timeout_s=float(env.get(keys.ENV_HANG_TIMEOUT, "0")))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"the launcher's environment is incomplete or malformed: {exc!r}",
                              hint="start the script with `ckptd launch`") from exc

    def connect(self) -> Any:
        """A client of the job's TCPStore."""
        return dist.TCPStore(self.store_host, self.store_port, None, False,
                             timeout=timedelta(seconds=settings().elastic_rejoin_timeout_s))


@dataclass
class WorkerContext:
    """What the training function gets in one generation: its rank, the generation's store view, and a
    factory for checkpoint managers that take part in the recovery."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    generation: int
    #: This generation's keys of the job store; hand it to anything that agrees through a store.
    store: GenerationStore
    #: How often the supervisor replaced this rank before this process started.
    restart_count: int
    #: Generations this process took part in before this one (0: the first one it joined).
    rejoined: int
    _beat: Callable[[int | None], None] = field(repr=False)
    #: The step to save before leaving a job stopping with a checkpoint, given the step being saved (None:
    #: no such stop), and how long closing may take then (see :mod:`ckptd.elastic.stop_checkpoint`).
    _stop_step: Callable[[int], int | None] = field(repr=False, default=lambda step: None)
    _stop_close_s: Callable[[], float] = field(repr=False, default=lambda: settings().elastic_rejoin_timeout_s)
    #: Whether every rank can start afresh, now, when no step is intact on every rank (in a recovery
    #: generation, with a ``setup_fn`` that rebuilds the initial state; see :func:`run`).
    _afresh: Callable[[], bool] = field(repr=False, default=lambda: False)
    _managers: _ManagerRegistry = field(repr=False, default_factory=lambda: _ManagerRegistry())
    #: What ``setup_fn`` returned (:func:`run`), built once per process before its rank was known (None
    #: without one). A survivor gets the same objects in every generation, trained on; restore loads into them.
    setup: Any = None

    def checkpoint_manager(self, local: str | os.PathLike[str], **options: Any) -> CheckpointManager:
        """A :class:`~ckptd.CheckpointManager` agreeing through this generation's store; every save is also
        a heartbeat. ``options`` are the manager's keyword arguments (``rank``, ``world_size`` and
        ``store`` are set here), plus ``restore_check`` (default :func:`~ckptd.elastic.finite_tensors`;
        None: no check), run after each restore of the newest step. In a later generation the same call (same directory, same options) in a
        surviving process returns the same manager, moved to the new generation, so that its ``restore``
        can load the staged copy of its last save (the memory tier) instead of reading the disk."""
        reserved = sorted({"rank", "world_size", "store"} & set(options))
        if reserved:
            raise ConfigError(f"checkpoint_manager() sets {', '.join(reserved)} itself from the launcher",
                              hint="leave them out: ckptd launch gives every rank its rank, world size and store")
        directory, described = str(Path(local).resolve()), repr(sorted(options.items()))
        kept = self._managers.take(directory)
        if kept is not None:
            if kept.options == described and kept.rejoin(self.store):
                self._managers.keep(directory, kept)
                return kept
            _ManagerRegistry.close(kept, self.rank, quietly=True)  # it holds the directory's lock
        manager = _BeatingManager(Path(local), beat=self._beat, stop_step=self._stop_step,
                                  stop_close_s=self._stop_close_s, described=described, rank=self.rank,
                                  afresh=self._afresh,
                                  world_size=self.world_size, store=self.store, **options)
        self._managers.keep(directory, manager)
        return manager

    def heartbeat(self, step: int | None = None) -> None:
        """Tell the supervisor this rank makes progress (see :func:`heartbeat`)."""
        self._beat(step)


class _BeatingManager(CheckpointManager):
    """A checkpoint manager for a ``ckptd launch`` rank: its ``save`` first beats the rank's heartbeat,
    naming the step (completed: its state is being saved); it keeps the staged copies of its two newest
    saves in memory (two sets of staging buffers, used in turn), so that a survivor restores from memory
    the step every rank agrees on even when a peer died before its newest save was committed; its
    ``restore`` runs the restore check and rolls back from a poisoned copy
    (:mod:`ckptd.elastic.restore_check`); and it can move to a new generation (:meth:`rejoin`)."""

    def __init__(self, local: Path, *, beat: Callable[[int | None], None], described: str,
                 stop_step: Callable[[int], int | None] = lambda step: None,
                 stop_close_s: Callable[[], float] = lambda: settings().elastic_rejoin_timeout_s,
                 afresh: Callable[[], bool] = lambda: False,
                 restore_check: RestoreCheck | None = finite_tensors, **options: Any) -> None:
        self._beat = beat
        self._afresh = afresh
        self._stop_step, self._stop_close_s = stop_step, stop_close_s
        self._close_called = False
        self._restore_check = restore_check
        #: The options it was made with, as :meth:`WorkerContext.checkpoint_manager` compares them.
        self.options = described
        super().__init__(local, **options)
        self.while_closing = _touch_heart  # a close waiting for the object tier is no hang
        #: The staging buffers not in use by the newest save: they hold the save before it.
        self._spare_stager = Stager(budget_bytes=self._saver.stager.budget_bytes, pin=self._saver.stager.pin)
        self._older: MemoryCopy | None = None  # the staged copy of the save before the newest
        self._committed_here: set[int] = set()  # steps this manager committed (writer thread adds)
        self._refused_memory: set[int] = set()  # steps whose staged copy failed the restore check
        self.add_commit_callback(self._committed_here.add)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        self._beat(step)
        stop_at = self._stop_step(step)
        if stop_at is not None and step >= stop_at:  # the job stops with a checkpoint: this step, then leave
            self._save_kept(step, state, force=True)
            self._leave_with_checkpoint(step)
        return self._save_kept(step, state, force=force)

    def _leave_with_checkpoint(self, step: int) -> None:
        """The final checkpoint of a stopping job is staged: wait for its local commit, close (the object tier
        or the daemon gets it within the stop's deadline), then leave the generation."""
        try:
            self.wait()
            uploader = self.uploader
            if uploader is not None and not uploader.wants(step) and step in self.committed_steps():
                uploader.submit(step, supersede=uploader.decides)  # every rank does: rank 0 announces it
            self.close(timeout_s=self._stop_close_s())
        except CkptdError as error:  # the committed steps stay; the rank leaves all the same
            log.warning("rank %d: the final checkpoint of the stopping job (step %d): %s", self.rank, step, error)
        else:
            log.warning("rank %d saved step %d before the job stops", self.rank, step)
        raise GenerationEndedError(f"rank {self.rank}: the job stops after its final checkpoint, step {step}")

    def _save_kept(self, step: int, state: Any, *, force: bool) -> bool:
        """:meth:`CheckpointManager.save`, keeping the staged copy of the save before."""
        before = self._saver.memory
        try:
            saved = super().save(step, state, force=force)
        except BaseException:
            staged = self._saver.memory
            if staged is not None and staged.step == step:  # staged and handed to the writer: the error is
                self._keep_older(before, step)               # an earlier save's, re-raised after it
            else:  # it may have staged part of the state over the older copy
                self._older = None
            raise
        if saved:
            self._keep_older(before, step)
        return saved

    def _keep_older(self, before: MemoryCopy | None, step: int) -> None:
        """``step`` is staged: the next save stages into the other buffers, these keep ``before`` until then."""
        self._older = before
        self._saver.stager, self._spare_stager = self._spare_stager, self._saver.stager
        kept = before.step if before is not None else step
        self._committed_here.difference_update([done for done in list(self._committed_here) if done < kept])

    def _memory_copies(self) -> tuple[MemoryCopy, ...]:
        older = self._older
        if older is not None and older.step in self._committed_here:
            older = MemoryCopy(older.step, older.values, older.staged, committed=True)
        copies = (*super()._memory_copies(), *((older,) if older is not None else ()))
        return tuple(copy for copy in copies if copy.step not in self._refused_memory)

    def restore(self, state: Any, step: int | None = None, *, keys: Sequence[str] | None = None) -> int | None:
        """:meth:`CheckpointManager.restore`; restoring the newest step (no ``step``, no ``keys``) also runs
        the restore check on every rank and rolls back from a poisoned copy (see
        :mod:`ckptd.elastic.restore_check`)."""
        if step is not None or keys is not None:
            restored = self.restore_unchecked(state, step, keys=keys)
        else:
            try:
                restored = self.restore_unchecked(state, None) if self._restore_check is None else \
                    checked_restore(self, state, self._restore_check)
            except NoIntactCheckpointError as error:
                self._start_afresh_or_raise(error)
                raise
        if restored is not None:  # the steps after it are set aside and saved again with new contents
            self._committed_here.difference_update([done for done in list(self._committed_here) if done > restored])
        if self._older is not None and (restored is None or self._older.step > restored):
            self._older = None
        self._refused_memory.clear()
        return restored

    def _start_afresh_or_raise(self, error: NoIntactCheckpointError) -> None:
        """Every rank, after the same NoIntactCheckpointError: when a rank of a recovery generation holds no
        step on any tier (its node was lost before any of its steps left it) and every rank can rebuild its
        initial state, every rank sets its committed local steps aside (kept) and raises _StartAfresh, so
        that :func:`run` builds the setup again and every rank starts from the initial state, as the
        replacement does. Otherwise returns (the caller re-raises ``error``)."""
        listings = TierListings(self.tiers)
        held = listings.all_committed()
        answers = self.coordinator.exchange("elastic-start-afresh", {
            "bare": not held and not listings.failed, "unlisted": sorted(listings.failed), "afresh": self._afresh()})
        bare = [rank for rank, answer in enumerate(answers) if answer["bare"]]
        if not bare or not all(answer["afresh"] for answer in answers) or any(answer["unlisted"] for answer in answers):
            return
        log.warning("rank %d: no step is intact on every rank and rank(s) %s hold none on any tier (%s): every rank "
                    "starts afresh from its setup; this rank's committed steps %s are set aside (kept)", self.rank,
                    bare, str(error).splitlines()[0], held or "none")
        self.set_aside_after(0)
        self._older = None
        raise _StartAfresh(f"no step is intact on every rank; rank(s) {bare} hold none: every rank starts afresh")

    def restore_unchecked(self, state: Any, step: int | None, *, keys: Sequence[str] | None = None) -> int | None:
        """:meth:`CheckpointManager.restore` without the restore check."""
        return super().restore(state, step, keys=keys)

    def refuse_memory(self, step: int) -> None:
        """Read ``step`` from the tiers behind memory from now on (its staged copy failed the check)."""
        self._refused_memory.add(step)

    def set_aside_after(self, step: int) -> None:
        """Set aside the committed local steps newer than ``step`` (every rank calls it)."""
        self._set_aside_newer_steps(step, frozenset(self.local.committed_steps()))

    def close(self, timeout_s: float | None = None) -> None:
        self._close_called = True
        try:
            super().close(timeout_s)
        finally:  # a writer still running reads its own save's buffers, never the spare ones
            self._older = None
            self._spare_stager.release()

    def rejoin(self, store: GenerationStore) -> bool:
        """Agree through ``store`` from now on; False when this manager cannot (closed, or not multi-rank).

        Call only when the writer is idle (:meth:`_ManagerRegistry.leave` waited for it), on the training
        thread. It runs the store protocol a new manager's constructor runs (join a coordinator
        generation, then the constructor's exchanges), so that it meets a replacement rank's new manager."""
        if self._close_called or not isinstance(self.coordinator, StoreCoordinator):
            return False
        self.coordinator.store = store
        self.coordinator.join()
        self._repeat_start_exchanges()
        return True


class _StartAfresh(Exception):
    """Raised by a manager's restore on every rank at once: :func:`run` builds the setup again and calls the
    training function again in the same generation; its restore then finds nothing and returns None."""


class _ManagerRegistry:
    """The checkpoint managers a process made, by directory, kept across generations."""

    def __init__(self) -> None:
        self._managers: dict[str, _BeatingManager] = {}

    def keep(self, directory: str, manager: _BeatingManager) -> None:
        self._managers[directory] = manager

    def take(self, directory: str) -> _BeatingManager | None:
        return self._managers.pop(directory, None)

    def leave(self, rank: int, generation: int) -> None:
        """After a failure (the generation's store view has ended): let each writer finish or fail its round;
        a manager whose writer does not stop in time is closed and forgotten."""
        for key, manager in list(self._managers.items()):
            try:
                manager.wait()
            except StillRunningError as error:
                log.warning("rank %d: a manager of generation %d still writes, closing it: %s", rank, generation,
                            error)
                del self._managers[key]
                self.close(manager, rank, quietly=True)
            except CkptdError as error:  # the save the failure interrupted: restore picks an older step
                log.info("rank %d: a save of generation %d failed: %s", rank, generation, error)

    def any_committed(self) -> bool:
        """Whether the local tier of some manager holds a committed step (one that cannot be listed counts
        as none)."""
        for manager in self._managers.values():
            try:
                if manager.committed_steps():
                    return True
            except CkptdError:
                continue
        return False

    def close_all(self, rank: int, *, quietly: bool, timeout_s: float | None = None) -> None:
        managers, self._managers = list(self._managers.values()), {}
        for manager in managers:
            self.close(manager, rank, quietly=quietly, timeout_s=timeout_s)

    @staticmethod
    def close(manager: CheckpointManager, rank: int, *, quietly: bool, timeout_s: float | None = None) -> None:
        """Close ``manager``; ``quietly``: log its errors, and give it ``timeout_s`` (default
        ``CKPTD_ELASTIC_REJOIN_TIMEOUT_S``)."""
        if quietly and timeout_s is None:
            timeout_s = settings().elastic_rejoin_timeout_s
        try:
            manager.close(timeout_s=timeout_s)
        except CkptdError as error:
            if not quietly:
                raise
            log.info("rank %d: closing a checkpoint manager: %s", rank, error)


class _Heart:
    """Writes the rank's heartbeat key (see :func:`ckptd.elastic.keys.beat`), on the training thread."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.generation, self.progress, self.sequence, self.step = -1, 0, 0, -1
        self._last_touch = 0.0
        self._view: GenerationStore | None = None
        #: This generation's stop step, with ``--checkpoint-on-stop`` (None: a stop makes the rank leave at once).
        self.stops: StopCheckpoint | None = None

    def enter(self, view: GenerationStore) -> None:
        self.generation, self.progress, self.step, self._view = view.generation, 0, -1, view
        if os.environ.get(keys.ENV_CHECKPOINT_ON_STOP) == "1":
            self.stops = StopCheckpoint(self.store, view.generation, self.rank)
        self._write()

    def stop_step(self, saving: int) -> int | None:
        """The step to save before leaving a job stopping with a checkpoint (None: no such stop)."""
        return self.stops.step(saving) if self.stops is not None else None

    def stop_close_s(self) -> float:
        """How long the final checkpoint's close may take (the stop's deadline, less a margin)."""
        request = self.stops.request if self.stops is not None else None
        return close_timeout_s(request, settings().elastic_rejoin_timeout_s)

    def beat(self, step: int | None = None) -> None:
        """The training made progress (``step``: it completed that step); raises GenerationEndedError once
        the generation has ended (the rank leaves it at this step)."""
        if self._view is not None:
            self._view.raise_if_ended()
        self.progress += 1
        if step is not None:
            self.step = step
        self._write()

    def finish(self) -> None:
        """The training function returned: no hang timeout from now on."""
        self.progress = -1
        self._write()

    def touch(self) -> None:
        """The rank is alive but waits for its peers (at most two writes a second)."""
        if time.monotonic() - self._last_touch >= 0.5:
            self._write()

    def _write(self) -> None:
        self.sequence += 1
        self._last_touch = time.monotonic()
        self.store.set(keys.beat(self.rank), f"{self.generation}:{self.progress}:{self.sequence}:{self.step}")


_heart: _Heart | None = None


def _touch_heart() -> None:
    """The rank is alive (a manager's close waits for its uploads): touch the heartbeat, if this is a launched rank."""
    if _heart is not None:
        _heart.touch()


def heartbeat(step: int | None = None) -> None:
    """Tell the supervisor this rank makes progress (``step``: the step it just completed); call it once per
    step (each save through a manager from :meth:`WorkerContext.checkpoint_manager` beats too, naming the
    step). A rank that beat in this generation and then stays silent for ``--hang-timeout`` seconds is
    killed and replaced; failures with no step completed in between count toward ``--crash-loop``. Raises
    GenerationEndedError once a peer failed or the job stops (:func:`run` handles it). Does nothing
    outside ``ckptd launch``."""
    if _heart is not None:
        _heart.beat(step)


class _GenerationWatcher:
    """A thread that ends ``view`` once the store's generation moves past it or the job stops, and writes the
    rank's :func:`~ckptd.elastic.keys.alive` key meanwhile (the supervisor's hang detection blames the rank
    whose process stopped running, not a peer waiting for it)."""

    def __init__(self, env: WorkerEnvironment, view: GenerationStore, *, checkpoints_on_stop: bool = False) -> None:
        self.env, self.view = env, view
        #: A stop that asks for a checkpoint does not end the generation: the ranks save its stop step first.
        self.checkpoints_on_stop = checkpoints_on_stop
        self._stop = threading.Event()
        self._store = env.connect()  # its own client: the training thread keeps the other
        self._thread = start_thread(f"ckptd-elastic-watch-rank{env.rank}", self._run)

    def _run(self) -> None:
        pid, count, next_alive, ended = os.getpid(), 0, 0.0, False
        while not self._stop.wait(_WATCH_S):
            try:
                if time.monotonic() >= next_alive:  # this process is scheduled (keys.alive)
                    count += 1
                    next_alive = time.monotonic() + keys.ALIVE_EVERY_S
                    self._store.set(keys.alive(self.env.rank), f"{pid}:{count}")
                if ended:  # the training thread may still be blocked in a collective of this generation
                    continue
                current = int(self._store.get(keys.GENERATION))
                stopping = self._store.check([keys.STOP])
            except Exception as error:  # noqa: BLE001 - the store is gone: the job is over
                if not ended:
                    self.view.end(f"the job store cannot be reached: {error}")
                return
            if stopping and not self._checkpoint_first():
                self.view.end("the job is stopping")
                ended = True
            elif current > self.view.generation:
                self.view.end(f"the supervisor started generation {current}")
                ended = True

    def _checkpoint_first(self) -> bool:
        if not self.checkpoints_on_stop:
            return False
        try:
            return bool((stop_request(self._store) or {}).get("checkpoint"))
        except Exception:  # noqa: BLE001 - unreadable: leave at once, as without a checkpoint
            return False

    def stop(self) -> None:
        self._stop.set()
        if not self._thread.join_within(5.0):
            log.warning("the generation watcher of rank %d did not stop within 5 s (a store call hangs); it ends "
                        "with the process", self.env.rank)


def _barrier(view: GenerationStore, name: Callable[[int], str], rank: int, world_size: int, what: str,
             beat: Callable[[], None]) -> None:
    view.set(name(rank), "1")
    everyone = [name(other) for other in range(world_size)]

    def missing() -> list[int]:
        return [other for other, key in enumerate(everyone) if not view.check([key])]

    def all_there() -> bool:
        return view.check(everyone)

    try:
        wait_for(all_there, what=f"every rank to {what} in generation {view.generation}",
                 timeout_s=settings().elastic_rejoin_timeout_s, on_poll=beat, poll_s=0.01,
                 hint="a rank may be stuck; its supervisor kills and replaces it after --hang-timeout")
    except CkptdError as error:
        if view.ended:
            raise
        raise type(error)(f"{error}; ranks {missing()} did not") from error


def _caused_by_peer(error: BaseException, view: GenerationStore) -> bool:
    """Whether ``error`` comes from another rank's failure (a gloo or store error, or the generation ended)
    rather than from this rank's own code."""
    if view.ended:
        return True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (GenerationEndedError, dist.DistError)):
            return True
        if type(current) is RuntimeError and ("gloo" in str(current) or "Connection" in str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _next_generation(store: Any, after: int, rank: int, *, beat: Callable[[], None], hang_timeout_s: float) -> int:
    """The generation after ``after``, once the supervisor starts it. The rank beats while it waits, so that
    the supervisor takes the silent peer, not this rank, for the hung one; and it waits out the supervisor's
    hang timeout too (a collective with a hung peer can time out long before the peer is found)."""

    def newer() -> int | None:
        if store.check([keys.STOP]):
            raise GenerationEndedError(f"rank {rank}: the job is stopping: {store.get(keys.STOP).decode()}")
        current = int(store.get(keys.GENERATION))
        return current if current > after else None

    return wait_for(newer, what=f"rank {rank}: the supervisor's generation after {after}",
                    timeout_s=settings().elastic_rejoin_timeout_s + hang_timeout_s, on_poll=beat, poll_s=0.01,
                    hint="the supervisor replaces a failed rank and raises the generation; is it running?")


def collective_timeout_s(configured_s: float, hang_timeout_s: float) -> float:
    """The process group's timeout: ``configured_s``, raised to one and a half times the supervisor's hang
    timeout plus 5 s (0: no hang timeout), so that the supervisor kills a hung peer before gloo times out."""
    return max(configured_s, hang_timeout_s * 1.5 + 5.0) if hang_timeout_s > 0 else configured_s


def _job_stopping(store: Any) -> bool:
    try:
        return bool(store.check([keys.STOP]))
    except Exception:  # noqa: BLE001 - the store is gone: not a stop this rank was told of
        return False


def _stop_cleanly(managers: _ManagerRegistry, rank: int, store: Any) -> None:
    """The job is stopping: close the managers (their committed steps stay) and exit with EXIT_STOPPED."""
    try:
        request = stop_request(store)
    except Exception:  # noqa: BLE001 - the store is gone: close as without a checkpoint
        request = None
    managers.close_all(rank, quietly=True, timeout_s=close_timeout_s(request, settings().elastic_rejoin_timeout_s))
    _destroy_group()
    try:
        reason = store.get(keys.STOP).decode()
    except Exception:  # noqa: BLE001 - only for the log line
        reason = "?"
    log.warning("rank %d stops with the job (%s); its committed steps are kept", rank, reason)
    raise SystemExit(keys.EXIT_STOPPED)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run(train_fn: Callable[[WorkerContext], T], *, setup_fn: Callable[[], Any] | None = None,
        backend: str = "gloo") -> T:
    """Run ``train_fn`` on this rank of a ``ckptd launch`` job, surviving the failure of other ranks; see
    the module docstring. Returns what ``train_fn`` returned in the generation that finished.

    ``setup_fn`` builds, once per process and before the rank is known, what does not depend on it (the
    model, the optimizer, the data loader); ``train_fn`` finds its value in ``ctx.setup``. Under
    ``ckptd launch --spares N`` a warm spare runs it ahead of time and then waits to be given a failed
    rank, so that recovery costs no process start, import or build."""
    global _heart
    if keys.ENV_STORE not in os.environ:
        WorkerEnvironment.from_environ()  # the ConfigError that says how to start it
    prepared = setup_fn() if setup_fn is not None else None
    # what exists now (torch, the setup's objects) lives as long as the process: left out of every later
    # collection, the one after a failure (below) scans only what training made since, in milliseconds
    # instead of a few hundred. No collection first: it found a few dozen objects after torch's import and
    # cost a replacement rank 0.1-0.5 s on its way to recovery
    gc.freeze()
    if keys.ENV_SPARE in os.environ:
        become_rank()
    env = WorkerEnvironment.from_environ()
    store = env.connect()
    heart = _heart = _Heart(store, env.rank)
    generation, rejoined = env.generation, 0
    options = settings()
    managers = _ManagerRegistry()
    while True:
        if rejoined:
            # the failed generation's process group, store client and the error that ended it hold one
            # another in reference cycles: free them (gloo threads, sockets) before forming the next group
            gc.collect()
        view = GenerationStore(store, generation)
        heart.enter(view)
        watcher = _GenerationWatcher(env, view, checkpoints_on_stop=heart.stops is not None)
        context = WorkerContext(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                                node_rank=env.node_rank, generation=generation, store=view,
                                restart_count=env.restart_count, rejoined=rejoined, _beat=heart.beat,
                                _stop_step=heart.stop_step, _stop_close_s=heart.stop_close_s,
                                _afresh=lambda: setup_fn is not None and heart.generation > 0,
                                _managers=managers, setup=prepared)
        try:
            _barrier(view, keys.ready, env.rank, env.world_size, "join", heart.touch)
            dist.init_process_group(backend, store=dist.PrefixStore("pg/", view.raw), rank=env.rank,
                                    world_size=env.world_size,
                                    timeout=timedelta(seconds=collective_timeout_s(
                                        options.elastic_collective_timeout_s, env.hang_timeout_s)))
            log.info("rank %d formed the process group of generation %d", env.rank, generation)
            try:
                result = train_fn(context)
            except _StartAfresh:
                prepared = setup_fn() if setup_fn is not None else None  # the managers checked it is not None
                context = dataclasses.replace(context, setup=prepared)
                result = train_fn(context)
            heart.finish()
            managers.close_all(env.rank, quietly=False)
            _barrier(view, keys.done, env.rank, env.world_size, "finish", heart.touch)
            _destroy_group()
            return result
        except Exception as error:
            if not _caused_by_peer(error, view):
                raise
            log.warning("rank %d leaves generation %d after a peer's failure: %s", env.rank, generation,
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
            view.end(f"rank {env.rank} left it")
            managers.leave(env.rank, generation)
            _destroy_group()
            if _job_stopping(store):
                _stop_cleanly(managers, env.rank, store)
            try:
                generation = _next_generation(store, generation, env.rank, beat=heart.touch,
                                              hang_timeout_s=env.hang_timeout_s)
            except GenerationEndedError:
                if _job_stopping(store):
                    _stop_cleanly(managers, env.rank, store)
                raise
            rejoined += 1
            if setup_fn is not None and not managers.any_committed():
                # no step committed here: the next restore finds none (a step is committed for every rank or
                # none) and every rank must start from the initial state, as the replacement does from its
                # setup, but this rank's setup objects were trained on (weights, sample position). Building
                # them again is safe whatever the restore finds: it loads over them
                log.warning("rank %d: no step was committed before the failure; it builds its setup again to "
                            "start afresh with the replacement", env.rank)
                prepared = setup_fn()
        finally:
            watcher.stop()
