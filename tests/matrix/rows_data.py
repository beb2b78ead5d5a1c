"""Fault-matrix row 37: exact resume of the verified data loader after a kill -9 at a random step.

A child process (forked from the crash injector's forkserver) trains over a small JSON-lines dataset with
one :class:`~ckptd.data.ShardLoader` per rank (1 or 2 ranks and the order's seed drawn from the run's
seed; no DataLoader workers: the injector's children are daemonic and may not start any, and a forked
child's workers outlive its SIGKILL for a while; ``tests/test_data_resume.py`` resumes with 2 workers),
saving every step with a real :class:`~ckptd.CheckpointManager` and reporting the sample ids of each step;
it is SIGKILLed a random delay after a random step, in the middle of later steps and their background
saves. This process then restores the newest committed step as a restarted job does and trains to the
end. L5: the ids the killed run saw up to the restored step, followed by those of the resumed run, equal
the ids of a golden run that never stopped (same configuration, in this process), step by step, and the
final state hash (the loader's state and a running mix of every id consumed, itself checkpointed) equals
the golden one. L1: the restored step is one the child committed.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from harness import invariants as inv
from harness.matrix import Outcome, RunContext, crash_injector, row

SIZES = [17, 23, 19, 21, 20, 18]  # 118 samples: 14 global steps of 8 per epoch
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = sum(SIZES) // GLOBAL_BATCH
TOTAL_STEPS = STEPS_PER_EPOCH + 6  # the runs cross an epoch boundary
_MIX_PRIME = 1_000_003
_MIX_MODULUS = 2**61 - 1

_dataset: dict[str, str] = {}


def _manifest_path() -> str:
    """A dataset manifest of :data:`SIZES` JSON-lines shards, written once per process."""
    if "manifest" not in _dataset:
        from ckptd.data import index_dataset, save_dataset_manifest
        from ckptd.data.testing import write_jsonl_shards

        base = Path(tempfile.mkdtemp(prefix="ckptd-matrix-data-"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
        write_jsonl_shards(base / "data", SIZES)
        save_dataset_manifest(index_dataset(str(base / "data"), "jsonl").manifest, base / "manifest.json")
        _dataset["manifest"] = str(base / "manifest.json")
    return _dataset["manifest"]


class _Job:
    """One ShardLoader per rank (every rank in this process: a loader's order depends only on its rank and
    the world size) and the checkpointed running mix of the ids consumed."""

    def __init__(self, manifest: str, cache: Path, seed: int, world: int, workers: int) -> None:
        from ckptd.data import ShardDataset, ShardLoader, load_dataset_manifest

        loaded = load_dataset_manifest(manifest)
        self.loaders = [ShardLoader(ShardDataset(loaded, global_batch_size=GLOBAL_BATCH, seed=seed, rank=rank,
                                                 world_size=world, cache_dir=cache), num_workers=workers)
                        for rank in range(world)]
        self._iterators: list[Iterator[Any] | None] = [None] * world
        self.state: dict[str, Any] = {"data": self.loaders[0], "mix": torch.zeros(1, dtype=torch.int64)}

    def _next(self, rank: int) -> list[str]:
        for _ in range(2):
            if self._iterators[rank] is None:
                self._iterators[rank] = iter(self.loaders[rank])
            try:
                return list(next(self._iterators[rank])["id"])  # type: ignore[arg-type]
            except StopIteration:
                self._iterators[rank] = None  # the epoch ended: the loader is at the next one
        raise RuntimeError("an epoch yielded no batch")

    def step(self) -> list[str]:
        """One global step: every rank's batch, in rank order; the ids go into the mix."""
        ids = [sample for rank in range(len(self.loaders)) for sample in self._next(rank)]
        mix = int(self.state["mix"][0])
        for sample in ids:
            mix = (mix * _MIX_PRIME + zlib.crc32(sample.encode())) % _MIX_MODULUS
        self.state["mix"][0] = mix
        return ids

    def after_restore(self) -> None:
        """Every rank takes the restored loader state (rank 0's, saved in the checkpoint)."""
        for loader in self.loaders[1:]:
            loader.load_state_dict(self.loaders[0].state_dict())

    def digest(self) -> str:
        return inv.state_digest({"loaders": [loader.state_dict() for loader in self.loaders],
                                 "mix": self.state["mix"]})

    def close(self) -> None:
        self._iterators = [None] * len(self.loaders)  # ends the DataLoader workers of a finished epoch


def train_until_killed(channel: Any, manifest: str, cache: str, checkpoints: str, seed: int, world: int,
                       workers: int, ready_after: int) -> None:
    """Crash-injector target: train every step, save it, report (step, ids); ``channel.ready()`` once step
    ``ready_after`` is saved (the parent's kill counts from there)."""
    from ckptd.manager.manager import CheckpointManager
    from ckptd.policy import Policy

    job = _Job(manifest, Path(cache), seed, world, workers)
    with CheckpointManager(checkpoints, capture_rng=False, policy=Policy(keep_local=3), daemon="off") as manager:
        for step in range(1, TOTAL_STEPS + 1):
            ids = job.step()
            manager.save(step, job.state, force=True)
            channel.report((step, ids))
            if step == ready_after:
                channel.ready()
            time.sleep(0.002)  # a step's compute: the kill lands between or inside steps and saves


def _golden(manifest: str, cache: Path, seed: int, world: int, workers: int) -> tuple[list[list[str]], str]:
    job = _Job(manifest, cache, seed, world, workers)
    try:
        return [job.step() for _ in range(TOTAL_STEPS)], job.digest()
    finally:
        job.close()


@row(37, "exact resume of the data loader after kill -9 at a random step", short_runs=2, long_runs=100)
def loader_resumes_exactly(ctx: RunContext) -> Outcome:
    from ckptd.manager.manager import CheckpointManager
    from ckptd.policy import Policy

    seed, world, workers = ctx.rng.randrange(10**6), ctx.rng.choice([1, 2]), 0
    ready_after = ctx.rng.randint(2, TOTAL_STEPS - 2)
    delay_s = ctx.rng.uniform(0.0, 0.03)
    manifest, cache, checkpoints = _manifest_path(), ctx.path("cache"), ctx.path("checkpoints")
    golden_ids, golden_digest = _golden(manifest, cache, seed, world, workers)
    child = crash_injector().run(train_until_killed, manifest, str(cache), str(checkpoints), seed, world, workers,
                                 ready_after, kill_after_s=delay_s)
    ctx.stopwatch.fault()
    seen = dict(child.reports)
    note = (f"seed {seed}, world {world}, workers {workers}, killed {delay_s * 1000:.0f} ms after step "
            f"{ready_after} (last reported {max(seen, default=None)})")
    if not child.killed:
        return inv.outcome([inv.Check("L5", False, f"the child was not killed: exit {child.exitcode} "
                                                   f"{child.error or ''}")], detail=note)
    job = _Job(manifest, cache, seed, world, workers)
    try:
        with CheckpointManager(checkpoints, capture_rng=False, policy=Policy(keep_local=3), daemon="off") as manager:
            restored = manager.restore(job.state)
        recovery_s = ctx.stopwatch.since_fault()
        job.after_restore()
        start = restored or 0
        resumed = []
        step_recovery_s = None
        for _ in range(start + 1, TOTAL_STEPS + 1):
            resumed.append(job.step())
            step_recovery_s = step_recovery_s if step_recovery_s is not None else ctx.stopwatch.since_fault()
        digest = job.digest()
    finally:
        job.close()
    checks = [inv.Check("L1", restored is None or restored in seen,
                        f"restored step {restored}, which the killed run never reached (it reported {sorted(seen)})")]
    before = [seen[step] for step in range(1, start + 1) if step in seen]
    checks.append(inv.check_same_run(golden_ids, before + resumed, golden_digest, digest))
    return inv.outcome(checks, recovery_s=recovery_s, step_recovery_s=step_recovery_s,
                       detail=f"{note}, restored step {restored}")
