"""Crash consistency by replay: record a real save, materialise the states a power loss could leave,
and check that a fresh start recovers from each (matrix row 4).

:func:`record_save` runs a real save of a :class:`SaveShape` (``CheckpointManager`` on a local directory,
one or several ranks as threads sharing an in-process c10d ``HashStore``) with the file-system recorder
installed (:mod:`harness.fs_recorder`), and checks that replaying the whole trace rebuilds the
directory the save left, byte for byte. :mod:`harness.crash_states` turns the trace into crash
states; :func:`check_state` writes one into a scratch directory and opens it the way a restarted job
would: a fresh ``CheckpointManager`` per rank (whose start removes temporaries), a restore, and a
listing with every committed step verified. A state holds when

- L1: the restore loads the newest committed step, bit-exact against the state that was saved;
- L2: every step whose commit was acknowledged before the crash point is present (a step the
  retention policy may delete once a newer one is acknowledged excepted);
- L3: every step listed as committed verifies chunk by chunk, nothing listed is a step that was never
  committed, and no temporary file is left after the start;

and then the job goes on: the next step, saved by fresh managers (into the directory a crashed attempt
left, when the crash interrupted that step), commits and verifies.

A commit counts as acknowledged at the fsync of the step directory that follows the manifest's link
into place: that is when ckptd reports the step committed (:class:`~ckptd.tiers.atomicity.DirectoryCommit`).
:func:`replay` checks every distinct state (all of them per crash point up to a cap, then samples).
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptd.config import override
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness import invariants
from ckptd.testing.compare import state_differences
from harness.crash_states import CrashModel, CrashState, replay_everything, tree_differences, tree_of
from harness.fs_recorder import Trace, record


@dataclass(frozen=True)
class SaveShape:
    """One kind of save to replay: ranks sharing the directory, steps saved before the recorded one,
    retention, settings (``ckptd.config.override`` values) and the state's tensors (name -> element
    count of float32; the values depend on step and rank). With ``fresh_root`` the recording starts
    before the managers are built, on a directory whose checkpoint root (``run/``) does not exist yet,
    so the root's creation and the managers' start are in the trace too. With ``leftover_step_directory``
    the recording starts with the ``mkdir`` of the recorded step's directory by an attempt killed before
    it fsynced the root (a process kill keeps the page cache: that entry is in the file system, not
    durable), and the save goes into that directory."""

    name: str
    step: int = 1
    previous_steps: tuple[int, ...] = ()
    world_size: int = 1
    keep_local: int = 2
    tensors: tuple[tuple[str, int], ...] = (("weight", 3000), ("bias", 40), ("moment", 1500))
    settings: tuple[tuple[str, Any], ...] = ()
    fresh_root: bool = False
    leftover_step_directory: bool = False

    def checkpoint_root(self, directory: Path) -> Path:
        """The managers' local root inside a recorded (or materialised) ``directory``."""
        return directory / RUN_DIRECTORY if self.fresh_root else directory

    def relative(self, path: str) -> str:
        """A path relative to the checkpoint root, as the trace names it (relative to the recorded one)."""
        return f"{RUN_DIRECTORY}/{path}" if self.fresh_root else path

    def state(self, step: int, rank: int) -> dict[str, Any]:
        """The state rank ``rank`` saves at ``step`` (every tensor distinct from step to step)."""
        generator = torch.Generator().manual_seed(step * 1009 + rank * 31 + 7)
        tensors = {name: torch.randn(count, generator=generator) for name, count in self.tensors}
        return {"model": tensors, "meta": {"step": step, "rank": rank}}

    def template(self) -> dict[str, Any]:
        """A live state of the same structure, zeroed, to restore into."""
        return {"model": {name: torch.zeros(count) for name, count in self.tensors}, "meta": None}


#: The checkpoint root inside the recorded directory of a ``fresh_root`` shape.
RUN_DIRECTORY = "run"
FIRST_STEP = SaveShape("first_step")
FRESH_ROOT = SaveShape("fresh_root", fresh_root=True)
LATER_STEP_RETENTION = SaveShape("later_step_retention", step=2, previous_steps=(1,), keep_local=1)
PACKED_AND_DIRECT = SaveShape(
    "packed_and_direct", step=3, previous_steps=(2,),
    tensors=(("embedding", 40960), ("bias", 300), ("norm", 700), ("scale", 9)),
    settings=(("pack_below_bytes", 16384), ("direct_io", True), ("direct_io_min_bytes", 16384),
              ("chunk_bytes", 65536), ("io_threads", 2)))
TWO_RANKS = SaveShape("two_ranks", step=2, previous_steps=(1,), world_size=2, keep_local=1)
LEFTOVER_STEP_DIRECTORY = SaveShape("leftover_step_directory", step=2, previous_steps=(1,), keep_local=1,
                                    leftover_step_directory=True)
SHAPES = {shape.name: shape for shape in (FIRST_STEP, FRESH_ROOT, LATER_STEP_RETENTION, PACKED_AND_DIRECT,
                                          TWO_RANKS, LEFTOVER_STEP_DIRECTORY)}


def in_ranks(world_size: int, work: Callable[[int, Any], Any]) -> list[Any]:
    """Run ``work(rank, store)`` for every rank, each on its own thread with one shared ``HashStore``
    (``store`` is None for one rank, run on the calling thread); re-raises the first rank's error."""
    if world_size == 1:
        return [work(0, None)]
    store = torch.distributed.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, store)
        except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(rank,), name=f"crash-replay-rank{rank}")
               for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


def _manager(shape: SaveShape, root: Path, rank: int, store: Any) -> CheckpointManager:
    ranks: dict[str, Any] = {} if shape.world_size == 1 else {"rank": rank, "world_size": shape.world_size,
                                                              "store": store}
    return CheckpointManager(shape.checkpoint_root(root), policy=Policy(keep_local=shape.keep_local),
                             capture_rng=False, daemon="off",
                             **ranks)


@dataclass
class Recording:
    """A recorded save: its shape, directory, trace and the op index of its acknowledged commit; its
    crash states keep each directory's entry changes in order unless ``ordered_entries`` is False (see
    :class:`~harness.crash_states.CrashModel`)."""

    shape: SaveShape
    root: Path
    trace: Trace
    acknowledged_at: int | None
    ordered_entries: bool = True

    @property
    def model(self) -> CrashModel:
        return CrashModel(self.trace, ordered_entries=self.ordered_entries)

    def committed_before(self) -> list[int]:
        """The steps committed when the recorded save began (after retention)."""
        return list(self.shape.previous_steps[-self.shape.keep_local:])

    def required(self, crash_point: int) -> set[int]:
        """Steps that must survive a crash at ``crash_point`` (L2)."""
        before = self.committed_before()
        if self.acknowledged_at is not None and self.acknowledged_at < crash_point:
            return set(sorted(before + [self.shape.step])[-self.shape.keep_local:])
        return set(before)


def acknowledged_commit(trace: Trace, step: int, shape: SaveShape | None = None) -> int | None:
    """The index of the op at which ckptd considers ``step`` committed: the first fsync of its directory
    after its manifest was linked (or renamed) into place."""
    directory = shape.relative(step_dir(step)) if shape is not None else step_dir(step)
    manifest = f"{directory}/{MANIFEST_NAME}"
    placed = None
    for op in trace.ops:
        if placed is None and op.kind in ("link", "rename") and op.target == manifest:
            placed = op.index
        elif placed is not None and op.kind == "dirsync" and op.path == directory:
            return op.index
    return None


def record_save(shape: SaveShape, root: Path) -> Recording:
    """Save ``shape.previous_steps`` unrecorded, then record the save of ``shape.step``; raises
    AssertionError when the trace does not replay to the directory the save left."""
    root.mkdir(parents=True, exist_ok=True)
    if shape.fresh_root and shape.previous_steps:
        raise ValueError("a fresh_root shape records from the start: it has no previous steps")
    with override(**dict(shape.settings)):
        def work(rank: int, store: Any) -> None:
            manager = _manager(shape, root, rank, store)
            try:
                for step in shape.previous_steps:
                    manager.save(step, shape.state(step, rank), force=True)
                    manager.wait()
                barrier(rank)
                manager.save(shape.step, shape.state(shape.step, rank), force=True)
                manager.wait()
                barrier(rank)
            except BaseException:
                barrier.abort()
                raise
            finally:
                manager.close()

        recording: dict[str, Any] = {}
        leftover = shape.checkpoint_root(root) / step_dir(shape.step) if shape.leftover_step_directory else None
        barrier = _RecordingBarrier(shape.world_size, root, recording, leftover)
        try:
            if shape.fresh_root:
                barrier.start()
            in_ranks(shape.world_size, work)
        finally:
            barrier.stop()
    trace = recording["trace"]
    differences = tree_differences(replay_everything(trace), recording["tree"])
    if differences:
        raise AssertionError("the recorded trace does not replay to the directory the save left: "
                             + "; ".join(differences[:5]))
    acknowledged = acknowledged_commit(trace, shape.step, shape)
    if acknowledged is None:  # the save returned, so its commit is in the trace: else L2 would check nothing
        raise AssertionError(f"no acknowledged commit of step {shape.step} in the trace ({trace.summary()})")
    return Recording(shape, root, trace, acknowledged)


class _RecordingBarrier:
    """Starts the recording when every rank has saved its previous steps, and stops it (keeping the
    tree the save left) when every rank's recorded save is done."""

    def __init__(self, parties: int, root: Path, out: dict[str, Any], leftover: Path | None = None) -> None:
        self._barrier = threading.Barrier(parties, action=self._toggle)
        self._root, self._out, self._leftover = root, out, leftover
        self._context: Any = None
        self._calls = 0

    def start(self) -> None:
        """Start recording now (before the managers are built) instead of at the first barrier."""
        self._context = record(self._root)
        self._out["trace"] = self._context.__enter__()
        if self._leftover is not None:
            os.mkdir(self._leftover)

    def stop(self) -> None:
        """Stop recording, if it still runs (a rank failed before the end of its save)."""
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)

    def abort(self) -> None:
        """Release the other ranks' waits (this rank failed)."""
        self._barrier.abort()

    def _toggle(self) -> None:
        self._calls += 1
        if self._calls == 1 and self._context is None:
            self.start()
        elif self._calls == 2:
            self._out["tree"] = tree_of(self._root)
            self.stop()

    def __call__(self, rank: int) -> None:
        self._barrier.wait(timeout=60)


@dataclass(frozen=True)
class Verdict:
    """What a fresh start made of one crash state."""

    held: bool
    problems: tuple[str, ...]
    committed: tuple[int, ...]
    restored: int | None
    recovery_s: float
    bytes_lost: int
    step_recovery_s: float | None = None


def _step_bytes(shape: SaveShape) -> int:
    """The tensor bytes of one step of ``shape`` (every rank's)."""
    return sum(count * 4 for _, count in shape.tensors) * shape.world_size


def check_state(recording: Recording, state: CrashState, directory: Path, *,
                on_written: Callable[[], None] | None = None, resume: bool = True) -> Verdict:
    """Write ``state`` into ``directory`` (absent or empty) and check L1-L3 on it (see the module
    docstring). ``on_written`` is called once the state is on disk (the moment of the power loss).

    With ``resume`` the job then goes on: fresh managers save the step after the newest committed one
    (for a step the crash interrupted, into the directory its attempt left), which must commit and
    verify; ``step_recovery_s`` is the time from the power loss to that commit, without the checks."""
    shape = recording.shape
    recording.model.materialise(state).write_to(directory)
    if on_written is not None:
        on_written()
    started = time.monotonic()
    problems: list[str] = []
    with override(**dict(shape.settings)):
        def work(rank: int, store: Any) -> tuple[int | None, dict[str, Any]]:
            manager = _manager(shape, directory, rank, store)
            try:
                template = shape.template()
                return manager.restore(template), template
            finally:
                manager.close()

        try:
            restored = in_ranks(shape.world_size, work)
        except Exception as error:  # noqa: BLE001 - a failed recovery is the finding, reported with its state
            restored = []
            problems.append(f"recovery raised {type(error).__name__}: {error}")
    recovery_s = time.monotonic() - started
    root = shape.checkpoint_root(directory)
    committed = tuple(invariants.advertised_steps(str(root)))
    for check in (invariants.check_nothing_partial(str(root), allowed=set(shape.previous_steps) | {shape.step}),
                  invariants.check_no_temporaries(root)):
        if not check.ok:
            problems.append(f"{check.invariant}: {check.detail}")
    required = recording.required(state.crash_point)
    missing = sorted(required - set(committed))
    lost = _step_bytes(shape) * len(missing)
    if missing:
        problems.append(f"L2: acknowledged step(s) {missing} lost (committed now: {list(committed)})")
    newest = max(committed) if committed else None
    for rank, outcome in enumerate(restored):
        step, live = outcome
        if step != newest:
            problems.append(f"L1: rank {rank} restored step {step}, the newest committed is {newest}")
        elif step is not None:
            differences = state_differences(live, shape.state(step, rank))
            if differences:
                problems.append(f"L1: rank {rank}'s restore of step {step} differs: {differences[:3]}")
    step_recovery_s = None
    if resume and not problems:
        resumed, save_s = _resume(shape, directory, (newest or 0) + 1)
        step_recovery_s = recovery_s + save_s
        problems += resumed
    return Verdict(not problems, tuple(problems), committed, newest, recovery_s, lost, step_recovery_s)


def _resume(shape: SaveShape, directory: Path, step: int) -> tuple[list[str], float]:
    """Save ``step`` with fresh managers (the next save of the restarted job); its problems and how long
    the start and the save took."""
    started = time.monotonic()
    with override(**dict(shape.settings)):
        def work(rank: int, store: Any) -> None:
            manager = _manager(shape, directory, rank, store)
            try:
                manager.save(step, shape.state(step, rank), force=True)
                manager.wait()
            finally:
                manager.close()

        try:
            in_ranks(shape.world_size, work)
        except Exception as error:  # noqa: BLE001 - reported as a finding
            return [f"the save of step {step} after recovery raised {type(error).__name__}: {error}"], 0.0
    elapsed = time.monotonic() - started
    root = shape.checkpoint_root(directory)
    problems = []
    if step not in invariants.advertised_steps(str(root)):
        problems.append(f"the save of step {step} after recovery is not committed")
    check = invariants.check_nothing_partial(str(root))
    if not check.ok:
        problems.append(f"after the save of step {step} following recovery: {check.detail}")
    return problems, elapsed


@dataclass(frozen=True)
class Failure:
    """A crash state recovery failed on: the state, its description (ops kept and dropped) and why."""

    state: CrashState
    description: str
    problems: tuple[str, ...]


@dataclass
class ReplayReport:
    """What :func:`replay` did: operations in the trace, crash points, states the model counts, states
    drawn (enumerated in full where a crash point has at most ``cap`` of them, else sampled), distinct
    trees checked, of those the states in which the recorded step was committed, and the failures."""

    shape: str
    ops: int
    crash_points: int
    states_in_model: int
    enumerated: int = 0
    sampled: int = 0
    checked: int = 0
    with_recorded_step: int = 0
    failures: list[Failure] = field(default_factory=list)
    worst_recovery_s: float = 0.0


def replay(recording: Recording, scratch: Path, rng: random.Random, *, cap: int = 16,
           stop_after_failures: int = 5, resume: bool = True, first_point: int = 0) -> ReplayReport:
    """Check every distinct crash state of the recording: per crash point (from ``first_point`` on) all
    states when there are at most ``cap``, else ``cap`` of them (see :meth:`CrashModel.states`); stops
    after ``stop_after_failures`` failures. ``resume``: see :func:`check_state`."""
    model = recording.model
    report = ReplayReport(recording.shape.name, len(recording.trace.ops), len(model.crash_points), model.total())
    seen: set[tuple[str, frozenset[int]]] = set()
    for point in model.crash_points[first_point:]:
        exhaustive = model.count(point) <= cap
        for state in model.states(point, rng, cap):
            if exhaustive:
                report.enumerated += 1
            else:
                report.sampled += 1
            key = (model.materialise(state).digest(), frozenset(recording.required(point)))
            if key in seen:
                continue
            seen.add(key)
            directory = scratch / f"state-{report.checked}"
            verdict = check_state(recording, state, directory, resume=resume)
            shutil.rmtree(directory, ignore_errors=True)
            report.checked += 1
            report.with_recorded_step += recording.shape.step in verdict.committed
            report.worst_recovery_s = max(report.worst_recovery_s, verdict.recovery_s)
            if not verdict.held:
                description = state.describe(recording.trace, ordered_entries=recording.ordered_entries)
                report.failures.append(Failure(state, description, verdict.problems))
                if len(report.failures) >= stop_after_failures:
                    return report
    return report
