"""The elastic example of docs/elastic.md (moved there from the README), run from that page itself
(``tests/scripts/readme_elastic_example.py`` reads the code block and runs it as ``__main__``) under a real
``ckptd launch`` with 2 gloo ranks.

Its loader is built in ``setup()``, before the process group exists; it must take its rank and world size
when it starts iterating. Checked: every batch each rank trained on is its own half of the global batch of
that step (the ranks' slices are disjoint and together are the global batch a one-process loader gives),
in every generation, after a SIGKILL of a rank and after a node replaced on an empty root; and each run
ends with the weights of an uninterrupted run, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from ckptd.data import ShardDataset, ShardLoader, index_dataset, save_dataset_manifest
from harness.elastic_runs import Job, wait_until
from ckptd.testing.multirank import free_port
from harness.processes import process_state
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

SCRIPT = Path(__file__).parent / "scripts" / "readme_elastic_example.py"
#: The example's own constants (its global batch size, data seed and number of steps), read from it.
GLOBAL_BATCH, SEED, TOTAL = 8, 1, 40
WORLD = 2


def _dataset(directory: Path) -> Path:
    """48 samples ``{"id", "x", "y"}`` in 3 JSON-lines shards (y = 3x - 1 plus a wobble); the manifest's path."""
    data = directory / "data"
    data.mkdir(parents=True)
    sample = 0
    for shard in range(3):
        lines = []
        for _ in range(16):
            x = (sample % 11) / 10.0
            lines.append(json.dumps({"id": sample, "x": x, "y": 3.0 * x - 1.0 + ((sample * 7) % 5 - 2) / 50.0}))
            sample += 1
        (data / f"shard-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    manifest = directory / "manifest.json"
    save_dataset_manifest(index_dataset(str(data), "jsonl").manifest, manifest)
    return manifest


def _global_batches(manifest: Path) -> dict[int, list[int]]:
    """The ids of each step's global batch, as one process reading all of it sees them."""
    loader = ShardLoader(ShardDataset(manifest, global_batch_size=GLOBAL_BATCH, seed=SEED, rank=0, world_size=1),
                         steps=TOTAL)
    batches = {}
    for batch in loader:
        batches[loader.batches_taken] = [int(i) for i in batch["id"]]
    return batches


def _start(root: Path, manifest: Path, *, nodes: int = 1, settings: dict[str, str] | None = None,
           extra: tuple[str, ...] = ()) -> Job:
    out = root / "out"
    out.mkdir(parents=True)
    environment = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60",
                       CKPTD_DATA_CACHE_DIR=str(root / "cache"), README_EXAMPLE_OUT=str(out), **(settings or {}))
    endpoint = f"127.0.0.1:{free_port()}"
    commands = {}
    for node in range(nodes):
        placement = ["--nproc-per-node", str(WORLD)] if nodes == 1 else [
            "--nproc-per-node", str(WORLD // nodes), "--nnodes", str(nodes), "--node-rank", str(node),
            "--rdzv-endpoint", endpoint]
        commands[node] = [sys.executable, "-m", "ckptd.cli.main", "launch", *placement, "--max-restarts", "3",
                          "--hang-timeout", "60", *extra, str(SCRIPT), str(manifest), str(root / f"ckpt-node{node}")]
    job = Job(root, commands, environment)
    for node in range(nodes):
        job.start(node)
    return job


def _batches(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}-batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _check_slices(out: Path, expected: dict[int, list[int]]) -> dict[int, list[dict]]:
    """Every batch any process of each rank trained on is that rank's half of the step's global batch; the
    last process of each rank covered every step. Returns the records by rank."""
    half = GLOBAL_BATCH // WORLD
    records = {rank: _batches(out, rank) for rank in range(WORLD)}
    for rank, seen in records.items():
        assert seen, f"rank {rank} recorded no batch"
        for entry in seen:
            assert entry["world"] == WORLD, f"rank {rank} iterated as one of {entry['world']} ranks: {entry}"
            wanted = expected[entry["step"]][rank * half:(rank + 1) * half]
            assert entry["ids"] == wanted, (f"rank {rank} (pid {entry['pid']}, started in generation {entry['started_in']}) "
                                            f"trained step {entry['step']} on {entry['ids']}, its slice of the "
                                            f"global batch {expected[entry['step']]} is {wanted}")
        assert {entry["step"] for entry in seen} == set(expected), f"rank {rank} skipped steps"
    for step, ids in expected.items():  # the slices: disjoint, and together the global batch
        slices = [next(e["ids"] for e in reversed(records[rank]) if e["step"] == step) for rank in range(WORLD)]
        assert sorted(slices[0] + slices[1]) == sorted(ids) and not set(slices[0]) & set(slices[1]), (step, slices)
    return records


def _finals(out: Path) -> list[str]:
    return [(out / f"rank{rank}-final.json").read_text() for rank in range(WORLD)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[int]], list[str]]:
    """The manifest, each step's global batch, and the final weights of an uninterrupted run of the example."""
    root = tmp_path_factory.mktemp("readme-reference")
    manifest = _dataset(root)
    expected = _global_batches(manifest)
    assert len(expected) == TOTAL and len(set(map(tuple, expected.values()))) > 1, expected
    job = _start(root / "run", manifest)
    try:
        code = job.wait(240)
    finally:
        job.kill()
    assert code == 0, job.log()[-6000:]
    _check_slices(root / "run" / "out", expected)
    return manifest, expected, _finals(root / "run" / "out")


def test_the_readme_example_gives_each_rank_its_own_half_of_every_global_batch(
        reference: tuple[Path, dict[int, list[int]], list[str]]) -> None:
    _, _, weights = reference
    assert weights[0] == weights[1], "the ranks' replicas of the model differ"


def test_the_readme_example_recovers_a_sigkilled_rank_with_disjoint_slices_bit_for_bit(
        tmp_path: Path, reference: tuple[Path, dict[int, list[int]], list[str]]) -> None:
    manifest, expected, weights = reference
    job = _start(tmp_path, manifest, settings={"README_EXAMPLE_KILL": "1:13"})
    try:
        code = job.wait(240)
    finally:
        job.kill()
    log = job.log()
    assert code == 0, log[-6000:]
    assert "rank 1 (pid" in log and "killed by signal SIGKILL" in log, log[-4000:]
    records = _check_slices(tmp_path / "out", expected)
    assert len({entry["pid"] for entry in records[1]}) == 2, "rank 1 was not replaced"
    assert len({entry["pid"] for entry in records[0]}) == 1, "rank 0 did not keep its process"
    # the survivor went back to the agreed step and trained the steps after it again
    assert len(records[0]) > TOTAL, "rank 0 did not train again after the recovery"
    assert _finals(tmp_path / "out") == weights, "the recovered run's weights differ from an uninterrupted run's"


@pytest.mark.slow  # about a minute on a loaded 2-core machine; tests/test_elastic_fresh_start.py covers the recovery
def test_the_readme_example_survives_a_node_replaced_on_an_empty_root_with_disjoint_slices_bit_for_bit(
        tmp_path: Path, reference: tuple[Path, dict[int, list[int]], list[str]]) -> None:
    manifest, expected, weights = reference
    job = _start(tmp_path, manifest, nodes=2, settings={"README_EXAMPLE_STEP_SLEEP": "1:0.15"},
                 extra=("--node-timeout", "1.5"))
    out, survivor_root = tmp_path / "out", tmp_path / "ckpt-node0" / "rank0"
    try:
        wait_until(lambda: survivor_root.exists() and max(LocalTier(survivor_root).committed_steps(), default=0) >= 10,
                   "step 10 committed", 240)
        victim = _batches(out, 1)[-1]["pid"]
        job.supervisors[1].send_signal(signal.SIGKILL)
        job.supervisors[1].wait()
        wait_until(lambda: process_state(victim) is None, "node 1's rank to die with its supervisor")
        shutil.rmtree(tmp_path / "ckpt-node1")
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in job.log(), "node 0 to find node 1 lost", 60)
        job.start(1)
        code = job.wait(240)
    finally:
        job.kill()
    log = job.log()
    assert code == 0, log[-6000:]
    records = _check_slices(out, expected)
    assert len({entry["pid"] for entry in records[0]}) == 1, "rank 0 did not keep its process"
    assert "every rank starts afresh from its setup" in log, log[-4000:]
    assert _finals(out) == weights, "the run with a replaced node differs from an uninterrupted run"
    assert "Traceback" not in log, log[-4000:]
