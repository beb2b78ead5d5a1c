"""DDP-style replicas on real gloo processes: every rank holds the same full state, the layout marks it
replicated across ``dp``, and each tensor is written by exactly one rank, the bytes spread over the ranks.
(:mod:`test_replica_node_roots` runs it with one directory per node.)
The step restores at dp=2 too. ``write_replicas="every-rank"`` keeps the old behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ckptd
from ckptd.errors import NoIntactCheckpointError
from ckptd.state.rng import RNG_KEY
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
from ckptd.testing import run_multirank
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier

pytestmark = pytest.mark.multirank

STEP = 3
WORLD = 4
POLICY = ckptd.Policy(keep_local=None, remote_every_steps=1)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(48 + 16 * i, 48 + 16 * (i + 1)) for i in range(6)]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEP):
        inputs = torch.randn(8, 48, generator=torch.Generator().manual_seed(step + 100 * torch.distributed.get_rank()))
        model(inputs).pow(2).mean().backward()  # DDP all-reduces the gradients: every replica stays equal
        optimizer.step()
        optimizer.zero_grad()
    # DDP keeps the replicas equal only up to rounding: in about one CI run of ten the first layer's weights
    # differed in their last bits on one rank (each rank computes its Adam step itself). A replicated state
    # is what this test needs, so rank 0's is made everyone's.
    for tensor in [*model.state_dict().values(),
                   *(value for moments in optimizer.state_dict()["state"].values() for value in moments.values())]:
        torch.distributed.broadcast(tensor, 0)
    return model, optimizer


def _fresh() -> dict[str, Any]:
    torch.manual_seed(99)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(48 + 16 * i, 48 + 16 * (i + 1)) for i in range(6)]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.zeros(1, 48)).sum().backward()
    optimizer.step()  # creates the moments, so that the live optimizer has the saved structure
    optimizer.zero_grad()
    return {"model": model, "optim": optimizer}


def _bytes(state: dict[str, Any]) -> dict[str, bytes]:
    found = {f"model/{k}": v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
             for k, v in state["model"].state_dict().items()}
    for index, moments in state["optim"].state_dict()["state"].items():
        for key, value in moments.items():
            found[f"optim/{index}/{key}"] = value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return found


def mismatch(found: dict[str, bytes], expected: dict[str, bytes]) -> str:
    """What differs between restored and expected tensor bytes, by name ('' when nothing does): for each
    differing tensor whether its bytes are another expected tensor's (pieces swapped), all zeros, or other."""
    problems = [f"missing {sorted(expected.keys() - found.keys())}"] if expected.keys() - found.keys() else []
    problems += [f"unexpected {sorted(found.keys() - expected.keys())}"] if found.keys() - expected.keys() else []
    by_bytes = {value: name for name, value in expected.items()}
    for name in sorted(expected.keys() & found.keys()):
        got = found[name]
        if got != expected[name]:
            kind = (f"holds {by_bytes[got]}'s bytes" if got in by_bytes else
                    "all zeros" if not any(got) else f"{sum(a != b for a, b in zip(got, expected[name]))} bytes differ")
            problems.append(f"{name}: {kind}")
    return "; ".join(problems)


def _save(rank: int, world_size: int, roots: list[str], remote: str | None, options: dict[str, Any],
          write_replicas: str | None) -> dict[str, bytes]:
    model, optimizer = _trained()
    state = {"model": model, "optim": optimizer}
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(roots[rank], layout=layout, write_replicas=write_replicas, remote=remote,
                                 storage_options=options, policy=POLICY, codec="raw") as manager:
        assert manager.save(STEP, state, force=True)
    return _bytes(state)


def _restore(rank: int, world_size: int, roots: list[str], remote: str | None,
             options: dict[str, Any]) -> dict[str, Any]:
    state = _fresh()
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(roots[rank], layout=layout, remote=remote, storage_options=options,
                                 policy=POLICY) as manager:
        try:
            step = manager.restore(state)
        except NoIntactCheckpointError as error:
            return {"error": str(error)}
        result = manager.last_restore
    return {"step": step, "bytes": _bytes(state), "chunks_by_tier": result.chunks_by_tier}


def _written(root: Path) -> dict[int, dict[str, int]]:
    """Tensor bytes each rank held here wrote (its RNG states left out), by rank and name."""
    tier = LocalTier(root)
    manifest = load_step_manifest(tier, STEP)
    return {rank: {name: record.nbytes for name, record in load_rank_index(tier, manifest, rank).tensors.items()
                   if not name.startswith(RNG_KEY)} for rank in ranks_held(tier, STEP, manifest)}


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, bytes]]]:
    root = str(tmp_path_factory.mktemp("ddp") / "shared")
    return root, run_multirank(_save, WORLD, [root] * WORLD, None, {}, "once", timeout_s=120)


def test_ddp_replicas_are_written_once_overall_and_restore_bit_for_bit(
        saved_once: tuple[str, list[dict[str, bytes]]]) -> None:
    root, saved = saved_once
    assert not any(mismatch(saved[rank], saved[0]) for rank in range(WORLD)), \
        f"DDP keeps every replica equal: {[mismatch(saved[rank], saved[0]) for rank in range(WORLD)]}"
    written = _written(Path(root))
    names = [name for by_name in written.values() for name in by_name]
    assert len(names) == len(set(names)), "a replicated tensor was written by two ranks"
    one_replica = sum(len(value) for value in saved[0].values())
    per_rank = [sum(by_name.values()) for by_name in written.values()]
    assert sum(per_rank) == one_replica, f"{per_rank} add up to {sum(per_rank)}, one replica is {one_replica}"
    assert max(per_rank) <= 1.25 * one_replica / WORLD, f"busiest rank {max(per_rank)} of {per_rank}"
    manifest = load_step_manifest(LocalTier(root), STEP)
    assert manifest.layout.source == "given" and manifest.layout.mesh == {"dp": WORLD}
    assert all(piece.holders == (0, 1, 2, 3) for piece in manifest.layout.replicated)

    restored = run_multirank(_restore, WORLD, [root] * WORLD, None, {}, timeout_s=120)
    for rank, result in enumerate(restored):
        assert result["step"] == STEP, f"rank {rank}: {result}"
        assert not mismatch(result["bytes"], saved[0]), f"rank {rank}: {mismatch(result['bytes'], saved[0])}"


def test_every_rank_writes_its_whole_state_when_asked(tmp_path: Path) -> None:
    root = str(tmp_path / "shared")
    saved = run_multirank(_save, 2, [root] * 2, None, {}, "every-rank", timeout_s=120)
    one_replica = sum(len(value) for value in saved[0].values())
    assert [sum(by_name.values()) for by_name in _written(Path(root)).values()] == [one_replica] * 2
    assert load_step_manifest(LocalTier(root), STEP).layout.replicated == ()


def _restore_at_dp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _fresh()
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(root, layout=layout) as manager:
        step = manager.restore(state)
        resharded = manager.last_restore.resharded
    return {"step": step, "bytes": _bytes(state), "resharded": resharded}


def test_replicas_written_once_at_dp_4_restore_at_dp_2(saved_once: tuple[str, list[dict[str, bytes]]]) -> None:
    root, saved = saved_once
    for rank, result in enumerate(run_multirank(_restore_at_dp, 2, root, timeout_s=120)):
        assert result["step"] == STEP and result["resharded"], f"rank {rank}"
        assert not mismatch(result["bytes"], saved[0]), \
            f"rank {rank}: every replica comes from the rank that wrote it: {mismatch(result['bytes'], saved[0])}"

