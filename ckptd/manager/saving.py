"""The save path: stage the state (blocking), then write, agree and commit in the background.

:class:`Saver` is used by :class:`~ckptd.manager.manager.CheckpointManager`. Call order on every rank,
from the training thread: :meth:`Saver.save` per saved step (same steps, same order on all ranks),
:meth:`Saver.wait` when the caller needs the step committed, :meth:`Saver.close` at the end.

:meth:`Saver.save` flattens the state and copies its tensors into the :class:`~ckptd.state.staging.
Stager`'s reusable host buffers, then returns; the state may be modified from then on. One named
writer thread per Saver (``ckptd-writer-rank<r>``) then hashes, encodes and writes the staged copy
(:class:`~ckptd.stepio.rank_writer.RankWriter`), agrees on the commit with the other ranks through the
c10d Store (never a collective), writes the manifest last and confirms it through the store.

Back-pressure: the buffers hold one copy of the state. When a save is requested while the previous one
is still being written, ``Policy.on_busy`` decides: ``"wait"`` blocks until the writer is done,
``"skip"`` skips the step (on every rank: the skipping rank reports it through the store).

Errors raised on the writer thread are stored and re-raised on the training thread by the next
:meth:`Saver.save`, :meth:`Saver.wait` or :meth:`Saver.close`; the save after that works normally.
Callbacks in ``on_commit`` run on the writer thread after a step is committed locally (retention,
promotion); an exception from one is stored like a write error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ckptd.config import settings
from ckptd.format.values import SavedValues
from ckptd.errors import CkptdError, CommitError, ConfigError, WorkerError
from ckptd.format.layout import MANIFEST_NAME, rank_files, step_file
from ckptd.stepio.rank_writer import RankWriter, lower_thread_priority
from ckptd.format.records import Manifest, RankEntry
from ckptd.manager.commit import SKIPPED, CommitCoordinator, SkippedStep
from ckptd.policy import Policy
from ckptd.state.staging import StagedState, Stager
from ckptd.state import rng
from ckptd.state.tree import flatten
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.save")


@dataclass(frozen=True)
class _WriteJob:
    step: int
    staged: StagedState | None  # None: this rank skipped the step and only reports it
    values: Any = None


@dataclass(frozen=True)
class MemoryCopy:
    """The memory tier: the staged copy of the last save, valid until the next save stages."""

    step: int
    values: SavedValues
    staged: StagedState
    committed: bool


class Saver:
    """Stages steps on the training thread and writes/commits them on its writer thread."""

    def __init__(self, local: LocalTier, coordinator: CommitCoordinator, *, policy: Policy, codec: str,
                 allow_pickle: bool, capture_rng: bool, stager: Stager | None = None) -> None:
        self.local, self.coordinator, self.policy = local, coordinator, policy
        self.codec, self.allow_pickle, self.capture_rng = codec, allow_pickle, capture_rng
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self.stager = stager or Stager()
        self.on_commit: list[Callable[[int], None]] = []
        #: Steps this rank skipped because the previous save was still being written.
        self.skipped: list[int] = []
        #: (step, time.monotonic()) of the newest local commit, set on the writer thread.
        self.last_commit: tuple[int, float] | None = None
        self._queue: queue.Queue[_WriteJob | None] = queue.Queue()
        self._idle = threading.Condition()
        self._writes_pending = 0
        self._jobs_pending = 0
        self._error: BaseException | None = None
        self._memory: MemoryCopy | None = None
        self._committed_steps: set[int] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ckptd-writer-rank{self.rank}", daemon=True)
        self._thread.start()

    # --- training thread ------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any]) -> bool:
        """Stage ``state`` as ``step`` and hand it to the writer; returns False when skipped (busy).

        Raises the stored error of an earlier background write first, if there is one.
        """
        self._check_open()
        self._raise_stored()
        if self.busy:
            if self.policy.on_busy == "skip":
                log.info("step %d skipped: the previous save is still being written", step)
                self.skipped.append(step)
                if self.world_size > 1:
                    self._enqueue(_WriteJob(step, None))
                return False
            self._wait_writes()
            self._raise_stored()
        flat = flatten(self._with_rng(state), allow_pickle=self.allow_pickle)
        self._memory = None
        staged = self.stager.stage(flat.tensors)
        shards = {name: (name, placement) for name, placement in staged.placements.items()}
        values = SavedValues(skeleton=flat.skeleton, shards=shards)
        self._memory = MemoryCopy(step, values, staged, committed=False)
        self._enqueue(_WriteJob(step, staged, values.to_json()))
        return True

    @property
    def busy(self) -> bool:
        """Whether a staged save is still being written (its buffers are in use)."""
        with self._idle:
            return self._writes_pending > 0

    @property
    def memory(self) -> MemoryCopy | None:
        """The memory tier: the last staged save (committed or not), or None."""
        memory = self._memory
        if memory is not None and memory.step in self._committed_steps and not memory.committed:
            memory = self._memory = MemoryCopy(memory.step, memory.values, memory.staged, committed=True)
        return memory

    def wait(self) -> None:
        """Block until every pending save is committed locally; re-raise a stored background error."""
        self._check_open()
        with self._idle:
            while self._jobs_pending:
                self._idle.wait()
        self._raise_stored()

    def close(self) -> None:
        """Wait for pending writes, stop the writer thread, re-raise a stored error. Safe to call twice."""
        if self._closed:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._jobs_pending == 0, timeout=settings().close_timeout_s)
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=settings().close_timeout_s)
        self._raise_stored()

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, job: _WriteJob) -> None:
        with self._idle:
            self._jobs_pending += 1
            if job.staged is not None:
                self._writes_pending += 1
        self._queue.put(job)

    def _wait_writes(self) -> None:
        with self._idle:
            while self._writes_pending:
                self._idle.wait()

    def _raise_stored(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Saver is closed")

    def _with_rng(self, state: MutableMapping[str, Any]) -> dict[str, Any]:
        if rng.RNG_KEY in state:
            raise ConfigError(f"state key {rng.RNG_KEY!r} is reserved for ckptd")
        combined = dict(state)
        if self.capture_rng:
            combined[rng.RNG_KEY] = rng.capture()
        return combined

    # --- writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except SkippedStep as skipped:
                log.info("%s", skipped)
            except BaseException as error:  # stored, re-raised on the training thread
                log.warning("save of step %d failed on rank %d: %s", job.step, self.rank, error)
                self._discard_uncommitted(job.step)
                self._error = error if isinstance(error, CkptdError) else CommitError(
                    f"save failed on rank {self.rank}: {error!r}", step=job.step)
                if not isinstance(error, CkptdError):
                    self._error.__cause__ = error
            finally:
                with self._idle:
                    self._jobs_pending -= 1
                    if job.staged is not None:
                        self._writes_pending -= 1
                    self._idle.notify_all()

    def _write(self, job: _WriteJob) -> None:
        entry, error = None, SKIPPED if job.staged is None else None
        if job.staged is not None:
            writer: RankWriter | None = None
            try:
                writer = RankWriter(self.local, job.step, self.rank, codec=self.codec,
                                    chunk_bytes=settings().chunk_bytes)
                for name, tensor in job.staged.tensors.items():
                    writer.add(name, tensor)
                entry = writer.finish(job.values)
            except Exception as exc:  # reported to every rank, so that none waits for this one in vain
                if writer is not None:
                    writer.abort()
                if self.world_size == 1:
                    raise
                error = str(exc) if isinstance(exc, CkptdError) else f"{type(exc).__name__}: {exc}"
        manifest_bytes = self.coordinator.agree(job.step, entry, error, self._manifest_builder(job.step))
        if error is not None:  # the coordinator raises first; kept for coordinators that do not
            raise WorkerError(f"step {job.step} failed", {self.rank: error}, step=job.step)
        written: CkptdError | None = None
        try:
            self.local.write_bytes(step_file(job.step, MANIFEST_NAME), manifest_bytes)
        except CkptdError as exc:
            written = exc
        failed = self.coordinator.confirm(job.step, None if written is None else str(written))
        if written is not None:
            if self.world_size == 1:
                raise written
            raise WorkerError(f"step {job.step} is committed on the other ranks but not on rank {self.rank}",
                              failed, step=job.step) from written
        if failed:
            log.warning("step %d could not be committed locally on rank(s) %s: %s", job.step, sorted(failed),
                        failed)
        self.last_commit = (job.step, time.monotonic())
        self._committed_steps = {job.step}
        self._committed(job.step)

    def _discard_uncommitted(self, step: int) -> None:
        """Free the space of this rank's files of a step that failed before it was committed."""
        if self.local.is_committed(step):
            return
        own = [step_file(step, name) for name in rank_files(self.local.list_files(step), self.rank)]
        try:
            self.local.delete_files(own)
        except CkptdError as error:
            log.warning("could not delete the files of failed step %d: %s", step, error)

    def _committed(self, step: int) -> None:
        if self.rank == 0:
            self._apply_retention()
        for callback in self.on_commit:
            callback(step)

    def _manifest_builder(self, step: int) -> Callable[[list[RankEntry]], Manifest]:
        def build(entries: list[RankEntry]) -> Manifest:
            return Manifest(step=step, world_size=self.world_size, ranks=tuple(entries), codec=self.codec)
        return build

    def _apply_retention(self) -> None:
        committed = self.local.committed_steps()
        for step in self.policy.local_retention.deletable(committed):
            self.local.delete_step(step)
        newest = committed[-1] if committed else None
        for step in self.local.list_step_numbers():
            if newest is not None and step < newest and step not in committed:
                self.local.delete_step(step)
