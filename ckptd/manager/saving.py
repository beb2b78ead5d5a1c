"""The save path: stage the state (blocking), then write, agree and commit in the background.

:class:`Saver` is used by :class:`~ckptd.manager.manager.CheckpointManager`. Call order on every rank,
from the training thread: :meth:`Saver.save` per saved step (same steps, same order on all ranks),
:meth:`Saver.wait` when the caller needs the step committed, :meth:`Saver.close` at the end.

:meth:`Saver.save` flattens the state and copies its tensors into the :class:`~ckptd.state.staging.
Stager`'s reusable host buffers, then returns; the state may be modified from then on. One named
writer thread per Saver (``ckptd-writer-rank<r>``) then hashes, encodes and writes the staged copy
(:class:`~ckptd.stepio.rank_writer.RankWriter`), agrees on the commit with the other ranks through the
c10d Store (never a collective), writes the manifest last and confirms it through the store.

With ``CKPTD_WRITER_MODE=process`` the staging buffers live in shared memory and the training thread sends
each save's plan to a writer process (:mod:`ckptd.stepio.writer_process`) as soon as it is staged; the
process hashes, encodes and writes, and with one rank commits too, outside this interpreter, so a training
loop that holds the GIL does not delay the commit. The writer thread then only waits for the process's
answer, agrees with the other ranks (the store stays here: it cannot be handed to another process in
general, and its waits release the GIL), has the process commit the agreed manifest, and runs the
callbacks. A dead writer process fails the step with :class:`~ckptd.errors.WriterProcessError`; the next
save starts another. See docs/saving.md.

:attr:`Saver.last_commit` (a :class:`CommitRecord`) is the window of the newest local commit: seconds from
``save()`` returning and steps elapsed. ``save(..., durable=True)`` returns only after the local commit.

Back-pressure: the buffers hold one copy of the state. When a save is requested while the previous one
is still being written, ``Policy.on_busy`` decides: ``"wait"`` blocks until the writer is done,
``"skip"`` skips the step (on every rank: the skipping rank reports it through the store).

The writer thread is a :class:`~ckptd.background.BackgroundWorker`. Every error raised on it is kept
(one record per failed step and rank) and re-raised on the training thread by the next
:meth:`Saver.save`, :meth:`Saver.wait` or :meth:`Saver.close`: one error as itself, several as a
:class:`~ckptd.errors.BackgroundError` listing them all; the save after that works normally. Callbacks
in ``on_commit`` run on the writer thread after a step is committed locally (retention, promotion); an
exception from one is kept like a write error.

Every wait has a deadline: :meth:`Saver.wait` (``CKPTD_WAIT_TIMEOUT_S``) and :meth:`Saver.close`
(``CKPTD_CLOSE_TIMEOUT_S``) raise :class:`~ckptd.errors.StillRunningError` naming the step still being
written. After a close that raised, the writer thread may still write: the Saver accepts no new saves,
and its owner keeps the directory lock until a later :meth:`Saver.close` succeeds. The Saver holds a
lease on the shared ``ckptd-write`` pool, renewed per save with that save's ``CKPTD_IO_THREADS`` and
released by :meth:`Saver.close`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ckptd.background import BackgroundWorker, FailureRecord, PoolLease
from ckptd.config import settings
from ckptd.format.values import SavedValues
from ckptd.errors import CkptdError, CommitError, ConfigError, WorkerError
from ckptd.format.layout import rank_files
from ckptd.stepio.rank_writer import RankWriter, lease_io_pool, lower_thread_priority
from ckptd.format.records import Manifest, RankEntry
from ckptd.manager.commit import SKIPPED, CommitCoordinator, SkippedStep, UndecidedCommitError
from ckptd.manager.directories import DirectorySharing
from ckptd.manager.holdings import Holdings, LayoutRecorder
from ckptd.policy import Policy
from ckptd.format.records import dtype_name
from ckptd.state.staging import StagedState, Stager, live_segments, prepare_state, shared_location
from ckptd.stepio.writer_process import WriterProcess
from ckptd.state import rng
from ckptd.state.tree import flatten
from ckptd.tiers.atomicity import DirectoryCommit
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.save")


@dataclass(frozen=True)
class _WriteJob:
    step: int
    staged: StagedState | None  # None: this rank skipped or failed the step and only reports it
    values: Any = None
    #: Why this rank could not stage the step (reported to the other ranks); None: skipped when busy.
    failure: str | None = None
    #: Where this rank sits in the job's layout and which replicated pieces it writes (None: no layout).
    holdings: Holdings | None = None
    #: ``time.monotonic()`` when the step was staged and handed over (``save()`` returns right after).
    handed_at: float = 0.0
    #: The writer process's request for this step, sent by the training thread: (its id, whether it commits
    #: too); None: not sent (thread mode, or the writer thread sends it).
    sent: tuple[int, bool] | None = None


@dataclass(frozen=True)
class CommitRecord:
    """The window of one save: how long after ``save()`` returned, and how many steps later, the step was
    committed on a tier (``"local"`` or the object tier's label)."""

    step: int
    #: Seconds from ``save()`` returning to the commit.
    seconds: float
    #: The newest step the training loop had reached at the commit, less ``step`` (0: committed before the
    #: loop moved on).
    steps_elapsed: int
    #: ``time.monotonic()`` of the commit.
    committed_at: float
    tier: str = "local"


@dataclass(frozen=True)
class MemoryCopy:
    """The memory tier: the staged copy of the last save, valid until the next save stages."""

    step: int
    values: SavedValues
    staged: StagedState
    committed: bool


def _written(tensors: dict[str, Any], holdings: Holdings | None) -> dict[str, Any]:
    """The tensors this rank stages and writes: all of them, less the replicas another rank writes."""
    if holdings is None:
        return tensors
    return {name: tensor for name, tensor in tensors.items() if holdings.plan.writes(name)}


class Saver:
    """Stages steps on the training thread and writes/commits them on its writer thread."""

    def __init__(self, local: LocalTier, coordinator: CommitCoordinator, *, policy: Policy, codec: str,
                 allow_pickle: bool, capture_rng: bool, stager: Stager | None = None,
                 sharing: DirectorySharing | None = None, layout: LayoutRecorder | None = None) -> None:
        self.local, self.coordinator, self.policy = local, coordinator, policy
        #: Records the job's layout in the manifest and writes each replicated piece once (see holdings).
        self.layout = layout or LayoutRecorder(coordinator.rank)
        #: Which ranks share this rank's directory; its owner commits, applies retention and cleans up.
        #: Default: one directory shared by the job (the CheckpointManager passes what the ranks found).
        self.sharing = sharing or DirectorySharing(coordinator.rank, ("job",) * coordinator.world_size)
        self._commit = DirectoryCommit(local)
        self.codec, self.allow_pickle, self.capture_rng = codec, allow_pickle, capture_rng
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        #: Where the write runs: ``"process"`` (a writer process) or ``"thread"`` (``CKPTD_WRITER_MODE``).
        self.mode = settings().writer_mode.strip().lower()
        if self.mode not in ("process", "thread"):
            raise ConfigError(f"CKPTD_WRITER_MODE={self.mode!r} is not one of process, thread",
                              hint="set it to thread (the default) or process (see docs/saving.md)")
        self.stager = stager or Stager(shared=self.mode == "process")
        self.on_commit: list[Callable[[int], None]] = []
        #: Steps this rank skipped because the previous save was still being written.
        self.skipped: list[int] = []
        #: The newest local commit (set on the writer thread), see :class:`CommitRecord`.
        self.last_commit: CommitRecord | None = None
        self._newest_step: int | None = None
        #: The newest object-tier commit reported through :meth:`note_promoted`.
        self.last_promotion: CommitRecord | None = None
        self._handed: dict[int, float] = {}  # step -> when save() handed it over (the newest few)
        self._process: WriterProcess | None = WriterProcess() if self.mode == "process" else None
        self._memory: MemoryCopy | None = None
        self._committed_steps: set[int] = set()
        self._closing = False
        self._closed = False
        self._pool_lease: PoolLease | None = None  # writer thread; released by close()
        # with a writer process the thread only waits and agrees: at normal priority it takes the GIL (and a
        # contended core) promptly when the process answers
        self._worker: BackgroundWorker[_WriteJob] = BackgroundWorker(
            f"ckptd-writer-rank{self.rank}", self._run, describe=self._describe, failures=self._failed,
            on_start=lower_thread_priority if self._process is None else None)

    # --- training thread ------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any], *, durable: bool = False) -> bool:
        """Stage ``state`` as ``step`` and hand it to the writer; returns False when skipped (busy).

        ``durable``: return only once the step is committed locally (as :meth:`wait`), e.g. for the last
        save before a planned stop.

        Raises the stored error of an earlier background write, if there is one: first with one rank; with
        several, only after this step was handed to the writer (or reported as failed to the other ranks),
        so that every rank takes part in every commit round in the same order whatever fails where.
        """
        self._check_open()
        self.note_step(step)
        if self.world_size == 1:
            self._raise_stored()
            saved = self._stage_and_enqueue(step, state)
        else:
            try:
                saved = self._stage_and_enqueue(step, state)
            except BaseException as error:
                self._enqueue(_WriteJob(step, None, failure=f"{type(error).__name__}: {error}"))
                raise
            self._raise_stored()
        if saved and durable:
            self.wait()
        return saved

    def note_step(self, step: int) -> None:
        """Record the newest step the training loop reached (for :attr:`last_commit`'s ``steps_elapsed``);
        the manager calls it for every step, saved or not. Training thread; no I/O."""
        self._newest_step = step
        if self._process is not None:
            self._process.note_step(step)

    def _stage_and_enqueue(self, step: int, state: MutableMapping[str, Any]) -> bool:
        if self.busy:
            if self.policy.on_busy == "skip":
                log.info("step %d skipped: the previous save is still being written", step)
                self.skipped.append(step)
                if self.world_size > 1:
                    self._enqueue(_WriteJob(step, None))
                return False
            self._wait_writes()
            if self.world_size == 1:
                self._raise_stored()
        flat = flatten(self._with_rng(state), allow_pickle=self.allow_pickle, step=step)
        self._memory = None
        holdings = self.layout.holdings(flat.tensors)
        staged = self.stager.stage(_written(flat.tensors, holdings))
        placements = dict(staged.placements) if holdings is None else holdings.placements(flat.tensors)
        shards = {name: (name, placement) for name, placement in placements.items()}
        values = SavedValues(skeleton=flat.skeleton, shards=shards)
        self._memory = MemoryCopy(step, values, staged, committed=False)
        job = _WriteJob(step, staged, values.to_json(), holdings=holdings)
        sent = self._send_to_process(job)
        handed_at = time.monotonic()
        self._handed[step] = handed_at
        for old in sorted(self._handed)[:-64]:
            del self._handed[old]
        self._enqueue(dataclasses.replace(job, handed_at=handed_at, sent=sent))
        return True

    def _send_to_process(self, job: _WriteJob) -> tuple[int, bool] | None:
        """Process mode: send the step's request to the writer process now (training thread; no job runs,
        since the buffers were free), so that the write starts whatever the training thread does next."""
        if self._process is None:
            return None
        request = self._write_request(job)
        if request is None:
            return None
        plan, commits = request
        sent = self._process.send(plan)
        return None if sent is None else (sent, commits)

    def _write_request(self, job: _WriteJob) -> tuple[dict[str, Any], bool] | None:
        """The writer process's ``write`` request for ``job`` and whether it commits the step too (None: the
        buffers are not in shared memory); takes the directory's write lock first."""
        plan = self._plan(job)
        if plan is None:
            return None
        commits = self._commits_in_process(job)
        if commits:
            plan["commit"] = {"ranks_here": list(self.sharing.ranks_here)}
        self.local._lock_before_writing()
        return dict(plan, op="write"), commits

    def _send_from_thread(self, job: _WriteJob) -> tuple[int, bool] | None:
        """Writer thread: send the request the training thread could not (the process had died: a new one is
        started). None: the buffers are not in shared memory (the thread writes the step)."""
        prepared = self._write_request(job)
        if prepared is None:
            return None
        plan, commits = prepared
        request = self._process.send(plan)
        if request is None:
            raise self._process.lost(f"writing step {job.step}", job.step)
        return request, commits

    def _commits_in_process(self, job: _WriteJob) -> bool:
        """Whether the writer process commits the step in the same request (one rank, nothing to agree)."""
        return self.world_size == 1 and job.holdings is None and self.sharing.is_owner

    def note_promoted(self, step: int, at: float | None = None, *, tier: str = "remote") -> None:
        """Record the object-tier commit of ``step`` at ``at`` (``time.monotonic()``, default now) as
        :attr:`last_promotion`. Any thread."""
        at = time.monotonic() if at is None else at
        handed = self._handed.get(step)
        newest = self._newest_step if self._newest_step is not None else step
        self.last_promotion = CommitRecord(step=step, seconds=max(0.0, at - handed) if handed is not None else 0.0,
                                           steps_elapsed=max(0, newest - step), committed_at=at, tier=tier)

    def prepare_staging(self, state: MutableMapping[str, Any]) -> int:
        """Prepare, in the background, the staging buffers of the tensors a save of ``state`` would stage
        on this rank (replicas another rank writes are left out); see :func:`~ckptd.state.staging.
        prepare_state`. Training thread."""
        return prepare_state(self.stager, state, allow_pickle=self.allow_pickle,
                             select=lambda tensors: _written(tensors, self.layout.holdings(tensors)))

    @property
    def busy(self) -> bool:
        """Whether a staged save is still being written (its buffers are in use)."""
        return self._worker.busy

    @property
    def memory(self) -> MemoryCopy | None:
        """The memory tier: the last staged save (committed or not), or None."""
        memory = self._memory
        if memory is not None and memory.step in self._committed_steps and not memory.committed:
            memory = self._memory = MemoryCopy(memory.step, memory.values, memory.staged, committed=True)
        return memory

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save is committed locally, at most ``timeout_s`` seconds (default
        ``CKPTD_WAIT_TIMEOUT_S``); re-raise the kept background errors.

        Raises :class:`~ckptd.errors.StillRunningError` naming the step still being written when the
        deadline passes (the save goes on; the kept errors are raised by a later call)."""
        self._check_open()
        timeout_s = settings().wait_timeout_s if timeout_s is None else timeout_s
        self._worker.wait(timeout_s, what=f"pending saves of rank {self.rank}",
                          hint="the local tier may hang; call wait() again or raise CKPTD_WAIT_TIMEOUT_S")
        self._raise_stored()

    @property
    def running(self) -> bool:
        """Whether the writer thread still runs (after a :meth:`close` that raised: it may still write)."""
        return self._worker.alive

    def close(self, timeout_s: float | None = None) -> None:
        """Let pending saves finish (at most ``timeout_s`` seconds, default ``CKPTD_CLOSE_TIMEOUT_S``), stop
        the writer thread, release the write pool, re-raise the kept background errors.

        When a save is still being written at the deadline, raises :class:`~ckptd.errors.StillRunningError`
        naming it; the Saver then accepts no new saves and the caller must keep what the writer needs (the
        directory lock) and call ``close`` again later. Safe to call twice."""
        if self._closed:
            return
        self._closing = True
        timeout_s = settings().close_timeout_s if timeout_s is None else timeout_s
        self._worker.close(timeout_s, what=f"closing the saver of rank {self.rank}",
                           hint="the checkpoint directory stays locked; call close() again once the write "
                                "ends, or raise CKPTD_CLOSE_TIMEOUT_S")
        self._closed = True
        if self.sharing.is_owner and self._committed_steps:
            # a retention policy may let a step go after the last commit (Lightning's save_top_k removes the
            # older checkpoint once the newest is saved): the writer has stopped, so this runs alone. Only
            # after a commit of this saver: a manager that only restored after a crash must not delete what a
            # step whose commit never finished (its directory entry not yet durable) would supersede
            try:
                self._apply_retention()
            except CkptdError as error:
                log.warning("rank %d: the retention pass at close failed (the steps stay; the next run's first "
                            "commit deletes them): %s", self.rank, error)
        if self._process is not None:  # the writer thread has stopped: nothing waits on the process any more
            self._process.close(settings().writer_stop_timeout_s)
        lease, self._pool_lease = self._pool_lease, None
        if lease is not None:
            lease.release()
        self._raise_stored()

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, job: _WriteJob) -> None:
        self._worker.submit(job, busy=job.staged is not None)

    def _wait_writes(self) -> None:
        """on_busy="wait": block until the staged buffers are free, at most ``CKPTD_WAIT_TIMEOUT_S``."""
        self._worker.wait(settings().wait_timeout_s, busy_only=True,
                          what=f"the previous save of rank {self.rank} (on_busy='wait')",
                          hint="the local tier may hang; raise CKPTD_WAIT_TIMEOUT_S if it is only slow")

    def _raise_stored(self) -> None:
        self._worker.raise_failures()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Saver is closed")
        if self._closing:
            raise CkptdError("this Saver is closing: a close() gave up while a save was still being written",
                             hint="call close() again; the checkpoint directory stays locked until it succeeds")

    def _with_rng(self, state: MutableMapping[str, Any]) -> dict[str, Any]:
        if rng.RNG_KEY in state:
            raise ConfigError(f"state key {rng.RNG_KEY!r} is reserved for ckptd")
        combined = dict(state)
        if self.capture_rng:
            combined[rng.RNG_KEY] = rng.capture_rng_states()
        return combined

    # --- writer thread --------------------------------------------------------------------------
    def _run(self, job: _WriteJob) -> None:
        """One job on the writer thread; an exception is kept by the worker (see :meth:`_failed`)."""
        if job.staged is not None:
            self._renew_pool_lease()
        try:
            self._write(job)
        except SkippedStep as skipped:
            log.info("%s", skipped)
        except WorkerError as failed:
            if job.failure is None:
                raise
            log.info("step %d failed on every rank, as reported: %s", job.step, failed)  # the caller has it

    def _renew_pool_lease(self) -> None:
        """Hold the write pool of this save's ``CKPTD_IO_THREADS``; a superseded one is released (and shut
        down once no writer uses it)."""
        options = settings()
        held = self._pool_lease
        if held is not None and held.pool.threads == max(1, options.io_threads) and not held.pool.closed:
            return
        self._pool_lease = lease_io_pool("write", options)
        if held is not None:
            held.release()

    def _describe(self, job: _WriteJob) -> str:
        if job.staged is None:
            return f"step {job.step} is still being reported as skipped on rank {self.rank}"
        return f"step {job.step} is still being written on rank {self.rank}"

    def _failed(self, job: _WriteJob, error: BaseException) -> list[FailureRecord]:
        """Writer thread: free the failed step's files; one record per failed rank of the step."""
        log.warning("save of step %d failed on rank %d: %s", job.step, self.rank, error)
        try:
            if not isinstance(error, UndecidedCommitError):  # else the step may be committed after all
                self._discard_uncommitted(job.step)
        except Exception as cleanup:  # noqa: BLE001 - the save's own error is what the caller needs
            log.warning("could not clean up failed step %d on rank %d: %s", job.step, self.rank, cleanup)
        if not isinstance(error, CkptdError):
            wrapped = CommitError(f"save failed on rank {self.rank}: {error!r}", step=job.step)
            wrapped.__cause__ = error
            error = wrapped
        ranks = sorted(error.failures) if isinstance(error, WorkerError) and error.failures else [self.rank]
        return [FailureRecord("save", error, step=job.step, rank=rank) for rank in ranks]

    def _write(self, job: _WriteJob) -> None:
        entry, error = None, (job.failure or SKIPPED) if job.staged is None else None
        sent = job.sent
        committed: dict[str, Any] | None = None  # the writer process's reply when it committed the step too
        if job.staged is not None:
            writer: RankWriter | None = None
            try:
                if sent is None and self._process is not None:  # the training thread could not send it
                    sent = self._send_from_thread(job)
                if sent is not None and sent[1]:  # one request writes and commits (one rank)
                    committed = self._process.receive(sent[0], what=f"writing and committing step {job.step}",
                                                      step=job.step)
                elif sent is not None:
                    reply = self._process.receive(sent[0], what=f"writing step {job.step}", step=job.step)
                    entry = RankEntry.from_json(reply["entry"], step=job.step,
                                                path=f"the writer process of rank {self.rank}")
                else:
                    self._commit.check_writable(job.step)
                    writer = RankWriter(self.local, job.step, self.rank, codec=self.codec,
                                        chunk_bytes=settings().chunk_bytes)
                    for name, tensor in job.staged.tensors.items():
                        writer.add(name, tensor)
                    entry = writer.finish(job.values)
                if job.holdings is not None and entry is not None:
                    entry = job.holdings.entry(entry)
            except Exception as exc:  # reported to every rank, so that none waits for this one in vain
                if writer is not None:
                    writer.abort()
                if self.world_size == 1:
                    raise
                error = str(exc) if isinstance(exc, CkptdError) else f"{type(exc).__name__}: {exc}"
        if committed is not None:
            self._local_commit_done(job, committed["committed_at"], committed.get("newest_step"))
            return
        manifest_bytes = self.coordinator.agree(job.step, entry, error,
                                                self._manifest_builder(job.step, job.holdings))
        if error is not None:  # the coordinator raises first; kept for coordinators that do not
            raise WorkerError(f"step {job.step} failed", {self.rank: error}, step=job.step)
        written: CkptdError | None = None
        committed_at: float | None = None
        newest: int | None = None
        if self.sharing.is_owner:  # one commit marker per directory, written by its owner
            try:
                if self._process is not None:
                    reply = self._process.request(
                        {"op": "commit", "root": str(self.local.root), "step": job.step,
                         "manifest": manifest_bytes.decode(), "world_size": self.world_size,
                         "ranks_here": list(self.sharing.ranks_here)},
                        what=f"committing step {job.step}", step=job.step)
                    committed_at, newest = reply["committed_at"], reply.get("newest_step")
                else:
                    self._commit.commit(job.step, manifest_bytes, world_size=self.world_size,
                                        ranks_here=self.sharing.ranks_here)
            except CkptdError as exc:
                written = exc
        failed = self.coordinator.confirm(job.step, None if written is None else str(written))
        if written is not None:
            if self.world_size == 1:
                raise written
            raise WorkerError(f"step {job.step} is committed on the other ranks but not in the directory of "
                              f"rank {self.rank}", failed, step=job.step) from written
        if self.sharing.owner in failed:
            raise WorkerError(f"step {job.step} is committed on the other ranks but not in the directory of "
                              f"rank {self.rank} (its owner, rank {self.sharing.owner}, could not commit it)",
                              failed, step=job.step)
        if failed:
            log.warning("step %d could not be committed locally on rank(s) %s: %s", job.step, sorted(failed),
                        failed)
        self._local_commit_done(job, committed_at, newest)

    def _plan(self, job: _WriteJob) -> dict[str, Any] | None:
        """The writer process's request for a staged job: where each buffer lies in shared memory. None when
        a buffer is not in shared memory (a stager of the thread mode): the thread writes that step."""
        assert job.staged is not None
        tensors = []
        for name, tensor in job.staged.tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            location = ("", 0, 0) if nbytes == 0 else shared_location(tensor)
            if location is None:
                return None
            tensors.append([name, *location, dtype_name(tensor.dtype), list(tensor.shape), tensor.element_size(),
                            tensor.is_floating_point()])
        return {"root": str(self.local.root), "step": job.step, "rank": self.rank, "codec": self.codec,
                "tensors": tensors, "segments": live_segments(), "values": job.values}

    @property
    def committed_any(self) -> bool:
        """Whether this saver committed a step."""
        return bool(self._committed_steps)

    def _local_commit_done(self, job: _WriteJob, committed_at: float | None, newest: int | None) -> None:
        """The step is committed in this rank's directory: record its window, then retention and callbacks."""
        committed_at = time.monotonic() if committed_at is None else committed_at
        newest = self._newest_step if newest is None else newest
        self.last_commit = CommitRecord(step=job.step, seconds=max(0.0, committed_at - job.handed_at),
                                        steps_elapsed=max(0, (newest if newest is not None else job.step) - job.step),
                                        committed_at=committed_at)
        self._committed_steps = {job.step}
        self._committed(job.step)

    def _discard_uncommitted(self, step: int) -> None:
        """Free the space of this rank's files of a step that failed before it was committed (a committed
        step is never touched)."""
        self._commit.discard(step, rank_files(self.local.list_files(step), self.rank))

    def _committed(self, step: int) -> None:
        if self.sharing.is_owner:
            self._apply_retention()
        for callback in self.on_commit:
            callback(step)

    def _manifest_builder(self, step: int, holdings: Holdings | None) -> Callable[[list[RankEntry]], Manifest]:
        def build(entries: list[RankEntry]) -> Manifest:
            manifest = Manifest(step=step, world_size=self.world_size, ranks=tuple(entries), codec=self.codec)
            return manifest if holdings is None else holdings.manifest(manifest)
        return build

    def _apply_retention(self) -> None:
        committed = self.local.committed_steps()
        for step in self.policy.local_retention.deletable(committed):
            self.local.delete_step(step)
        newest = committed[-1] if committed else None
        for step in self.local.list_step_numbers():
            if newest is not None and step < newest and step not in committed:
                self.local.delete_step(step)
