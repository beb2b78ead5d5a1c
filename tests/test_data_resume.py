"""Exact resume: a run interrupted at a random step, checkpointed with CheckpointManager and resumed in
a new process sees exactly the samples of an uninterrupted run, with 0 or 2 DataLoader workers, when
world size 4 comes back as 2 or 1, and across an epoch boundary.

Ranks are separate loader objects with explicit ``rank``/``world_size`` in one process (the loader never
talks to other ranks; its order only depends on those two numbers). The resumed half of every scenario
runs in one child process started from this file.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd import CheckpointManager
from ckptd.data import DatasetManifest, ShardDataset, ShardLoader, index_dataset, save_dataset_manifest
from ckptd.data.testing import write_jsonl_shards

SIZES = [17, 23, 19, 21, 20, 18]  # 118 samples: 14 global steps of 8 per epoch, 6 samples dropped
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = sum(SIZES) // GLOBAL_BATCH
TOTAL_STEPS = 2 * STEPS_PER_EPOCH + 5
SEED = 1234


@dataclass(frozen=True)
class Scenario:
    name: str
    stop_at: int
    world_before: int
    world_after: int
    workers: int


def _scenarios() -> list[Scenario]:
    rng = random.Random(20261130)
    middle = rng.randint(2, STEPS_PER_EPOCH - 2)
    return [
        Scenario("workers0", middle, 1, 1, 0),
        Scenario("workers2", rng.randint(2, STEPS_PER_EPOCH - 2), 1, 1, 2),
        Scenario("world4to2", rng.randint(2, STEPS_PER_EPOCH - 2), 4, 2, 0),
        Scenario("world4to1", middle, 4, 1, 0),
        Scenario("epoch_end", STEPS_PER_EPOCH, 2, 2, 0),
        Scenario("next_epoch", STEPS_PER_EPOCH + rng.randint(1, 4), 1, 2, 2),
    ]


class _Ranks:
    """One ShardLoader per rank; ``step()`` returns the union (rank order) of one global step's ids."""

    def __init__(self, manifest: DatasetManifest, cache: Path, world: int, workers: int) -> None:
        self.loaders = [ShardLoader(ShardDataset(manifest, global_batch_size=GLOBAL_BATCH, seed=SEED, rank=r,
                                                 world_size=world, cache_dir=cache), num_workers=workers)
                        for r in range(world)]
        self._iterators: list[Iterator[Any] | None] = [None] * world

    def _next(self, rank: int) -> list[Any]:
        for _ in range(2):
            if self._iterators[rank] is None:
                self._iterators[rank] = iter(self.loaders[rank])
            try:
                return next(self._iterators[rank])  # type: ignore[arg-type]
            except StopIteration:
                self._iterators[rank] = None  # epoch done: the loader moved to the next epoch
        raise AssertionError("an epoch yielded no batch")

    def step(self) -> list[str]:
        return [sample_id for rank in range(len(self.loaders)) for sample_id in self._next(rank)["id"]]


def _train(ranks: _Ranks, steps: range, manager: CheckpointManager | None, stop_at: int | None
           ) -> list[list[str]]:
    model = torch.nn.Linear(2, 2)
    state: dict[str, Any] = {"model": model, "data": ranks.loaders[0]}
    seen = []
    for step in steps:
        seen.append(ranks.step())
        if manager is not None and step == stop_at:
            states = [loader.state_dict() for loader in ranks.loaders]
            if any(s != states[0] for s in states):
                raise RuntimeError(f"ranks disagree on the loader state: {states}")
            manager.save(step, state, force=True)
    return seen


def _resume(config: dict[str, Any]) -> dict[str, list[list[str]]]:
    """The child process: restore each scenario's checkpoint and run to the end."""
    manifest = DatasetManifest.from_json(json.loads(Path(config["manifest"]).read_text()))
    results = {}
    for raw in config["scenarios"]:
        scenario = Scenario(**raw)
        ranks = _Ranks(manifest, Path(config["cache"]), scenario.world_after, scenario.workers)
        with CheckpointManager(Path(config["checkpoints"]) / scenario.name, capture_rng=False) as manager:
            state: dict[str, Any] = {"model": torch.nn.Linear(2, 2), "data": ranks.loaders[0]}
            restored = manager.restore(state)
        if restored != scenario.stop_at:
            raise RuntimeError(f"{scenario.name}: restored step {restored}, expected {scenario.stop_at}")
        for loader in ranks.loaders[1:]:
            loader.load_state_dict(ranks.loaders[0].state_dict())
        results[scenario.name] = _train(ranks, range(scenario.stop_at + 1, TOTAL_STEPS + 1), None, None)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume")
    write_jsonl_shards(root / "data", SIZES)
    manifest = index_dataset(str(root / "data"), "jsonl").manifest
    save_dataset_manifest(manifest, root / "manifest.json")
    reference = _train(_Ranks(manifest, root / "cache", 1, 0), range(1, TOTAL_STEPS + 1), None, None)
    before = {}
    for scenario in _scenarios():
        ranks = _Ranks(manifest, root / "cache", scenario.world_before, scenario.workers)
        with CheckpointManager(root / "checkpoints" / scenario.name, capture_rng=False) as manager:
            before[scenario.name] = _train(ranks, range(1, scenario.stop_at + 1), manager, scenario.stop_at)
    config = {"manifest": str(root / "manifest.json"), "cache": str(root / "cache"),
              "checkpoints": str(root / "checkpoints"), "out": str(root / "after.json"),
              "scenarios": [asdict(s) for s in _scenarios()]}
    subprocess.run([sys.executable, __file__, json.dumps(config)], check=True, timeout=240)
    after = json.loads((root / "after.json").read_text())
    return {"reference": reference, "before": before, "after": after}


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda s: s.name)
def test_resumed_run_sees_the_uninterrupted_samples(runs: dict[str, Any], scenario: Scenario) -> None:
    reference = runs["reference"]
    combined = runs["before"][scenario.name] + runs["after"][scenario.name]
    assert len(combined) == TOTAL_STEPS
    assert combined == reference


def test_reference_run_crosses_epochs_without_repeats(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    first_epoch = [i for step in reference[:STEPS_PER_EPOCH] for i in step]
    second_epoch = [i for step in reference[STEPS_PER_EPOCH:2 * STEPS_PER_EPOCH] for i in step]
    assert len(set(first_epoch)) == len(first_epoch) == STEPS_PER_EPOCH * GLOBAL_BATCH
    assert len(set(second_epoch)) == len(second_epoch)
    assert first_epoch != second_epoch
    assert all(len(step) == GLOBAL_BATCH for step in reference)


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    Path(settings["out"]).write_text(json.dumps(_resume(settings)))
