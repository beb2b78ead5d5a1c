"""`ckptd verify` on a step with replicas written once (3 real gloo ranks, dp=3): an intact step verifies, and
a manifest in which a rank leaves a tensor to a holder that did not write it (what a buggy or hand-edited
manifest would say) is reported, naming the tensor, both ranks and the writer's index, with exit code 4."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

STEP = 2


def _save(rank: int, world_size: int, root: str) -> None:
    generator = torch.Generator().manual_seed(3)
    state = {"model": {f"w{i}": torch.randn(32 * (i + 1), generator=generator) for i in range(6)}}
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(root, layout=layout, write_replicas="once", capture_rng=False) as manager:
        assert manager.save(STEP, state, force=True)


def test_verify_reports_a_replica_that_its_writer_does_not_hold(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_multirank(_save, 3, str(root), timeout_s=90)
    tier = LocalTier(root)
    assert list(verify_step(tier, STEP)) == []
    manifest = load_step_manifest(tier, STEP)
    rank, (name, writer) = next((entry.rank, next(iter(sorted(entry.replicas.items()))))
                                for entry in manifest.ranks if entry.replicas)
    other = next(r for r in range(3) if r not in (rank, writer))  # holds the tensor, did not write it
    entries = tuple(dataclasses.replace(entry, replicas={**entry.replicas, name: other}) if entry.rank == rank
                    else entry for entry in manifest.ranks)
    (root / step_file(STEP, MANIFEST_NAME)).write_bytes(dataclasses.replace(manifest, ranks=entries).to_json_bytes())

    problems = list(verify_step(tier, STEP))
    assert [(p.rank, p.chunk) for p in problems] == [(rank, None)], problems
    assert f"tensor {name!r} of rank {rank} is a replica that rank {other} wrote" in problems[0].error
    assert problems[0].path == manifest.entry(other).index_file
    result = CliRunner().invoke(cli, ["verify", str(root)])
    assert result.exit_code == 4 and f"BAD step {STEP} rank {rank}" in result.output, result.output
