"""Real ranks: two gloo processes take rank and world size from torch.distributed, read their slices,
save the loader with CheckpointManager (commits agreed through the c10d store), and a new two-rank job
resumes from that checkpoint; per global step, the union of both ranks' samples equals a one-process
run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.data import ShardDataset, ShardLoader, index_dataset, save_dataset_manifest
from ckptd.data.testing import write_jsonl_shards

SIZES = [13, 16, 11, 15]
GLOBAL_BATCH = 6
STOP_AT = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(config: dict[str, Any], phase: str, world: int) -> None:
    port = _free_port()
    children = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        children.append(subprocess.Popen([sys.executable, __file__, phase, json.dumps(config)], env=env))
    codes = [child.wait(timeout=180) for child in children]
    assert codes == [0] * world, f"ranks of phase {phase} exited with {codes}"


def _rank_main(phase: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist

    from ckptd import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = ShardDataset(config["manifest"], global_batch_size=GLOBAL_BATCH, seed=3,
                           cache_dir=config["cache"])
    loader = ShardLoader(dataset)
    state = {"data": loader}
    with CheckpointManager(config["checkpoints"], capture_rng=False) as manager:
        if phase == "resume" and manager.restore(state) != STOP_AT:
            raise RuntimeError("the resumed job did not restore the saved step")
        seen = []
        for batch in loader:
            seen.append(list(batch["id"]))
            if phase == "first" and len(seen) == STOP_AT:
                manager.save(STOP_AT, state, force=True)
                break
    Path(config["out"]).joinpath(f"{phase}-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.multirank
def test_two_gloo_ranks_resume_exactly(tmp_path: Path) -> None:
    write_jsonl_shards(tmp_path / "data", SIZES)
    manifest = index_dataset(str(tmp_path / "data"), "jsonl").manifest
    save_dataset_manifest(manifest, tmp_path / "manifest.json")
    config = {"manifest": str(tmp_path / "manifest.json"), "cache": str(tmp_path / "cache"),
              "checkpoints": str(tmp_path / "ckpt"), "out": str(tmp_path)}
    reference = [list(batch["id"])
                 for batch in ShardLoader(ShardDataset(manifest, global_batch_size=GLOBAL_BATCH, seed=3,
                                                       cache_dir=tmp_path / "cache"))]
    _launch(config, "first", 2)
    _launch(config, "resume", 2)
    per_rank = [json.loads((tmp_path / f"first-{r}.json").read_text()) +
                json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(2)]
    assert len(reference) == sum(SIZES) // GLOBAL_BATCH
    assert [a + b for a, b in zip(*per_rank)] == reference


if __name__ == "__main__":
    _rank_main(sys.argv[1], json.loads(sys.argv[2]))
