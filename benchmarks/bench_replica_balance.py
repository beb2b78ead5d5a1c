"""Benchmark of replica balancing (not part of the test run): the busiest rank's bytes over the mean.

For DP x TP states (those of ``tests/test_replica_balance.py``: the layered state of
``tests/test_layout_replicas.py`` and Llama-style states whose token embedding every rank holds) on DP 2 x TP 2
and DP 4 x TP 2 meshes, three ways of choosing who writes each replicated piece are compared:

- ``per-group``: each group of holders balanced alone, as ckptd did before issue 32 (that code, restated);
- ``job-wide``: :func:`ckptd.state.replicas.assign_writers` (what ckptd does now);
- ``dcp``: DCP's own ``dedup_save_plans`` over the ranks' save plans (its default planner).

Also printed: a lower bound no assignment beats (``tests/test_replica_balance.lower_bound``). Pure
computation over the pieces' sizes, no process group: the sizes of every rank's shards come from
:func:`ckptd.state.replicas.describe_dtensor`, as each rank computes them.

Usage: ``python benchmarks/bench_replica_balance.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckptd.state.replicas import Piece, assign_writers, rank_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_replica_balance import LAYERS_STATE, _pieces, llama, lower_bound  # noqa: E402

STATES = {"layers": LAYERS_STATE, "llama-1": llama(1), "llama-2": llama(2), "llama-8": llama(8)}
MESHES = ((2, 2), (4, 2))


def per_group(pieces: list[Piece]) -> dict[int, int]:
    """The plan before issue 32: each group of holders alone, largest first to the holder with the fewest
    bytes of that group so far (ties: the holders rotated by a digest of the group)."""
    groups: dict[tuple[int, ...], list[Piece]] = defaultdict(list)
    written: dict[int, int] = defaultdict(int)
    for piece in pieces:
        if len(piece.holders) == 1:
            written[piece.holders[0]] += piece.nbytes
        else:
            groups[piece.holders].append(piece)
    for group, members in groups.items():
        turn = xxhash.xxh3_64_intdigest(",".join(map(str, group)).encode()) % len(group)
        order = {member: (i - turn) % len(group) for i, member in enumerate(group)}
        load = dict.fromkeys(group, 0)
        for piece in sorted(members, key=lambda p: (-p.nbytes, p.name)):
            chosen = min(group, key=lambda member: (load[member], order[member]))
            load[chosen] += piece.nbytes
        for member, size in load.items():
            written[member] += size
    return written


def job_wide(pieces: list[Piece], world: int) -> dict[int, int]:
    scopes = {tuple(range(world)): tuple(pieces)}
    return rank_bytes(scopes, assign_writers(scopes))


def dcp(pieces: list[Piece], world: int) -> dict[int, int]:
    """DCP's dedup over plans listing, per rank, the pieces it holds in the state's order."""
    index = {piece: MetadataIndex(piece.name, torch.Size([k])) for k, piece in enumerate(pieces)}
    plans = []
    for rank in range(world):
        items = [WriteItem(index=index[p], type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([p.nbytes // 4])),
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([p.nbytes // 4])))
            for p in pieces if rank in p.holders]
        plans.append(SavePlan(items))
    by_index = {value: piece for piece, value in index.items()}
    written: dict[int, int] = defaultdict(int)
    for rank, plan in enumerate(dedup_save_plans(plans)):
        for item in plan.items:
            written[rank] += by_index[item.index].nbytes
    return written


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for label, state in STATES.items():
        for dp, tp in MESHES:
            world = dp * tp
            pieces = _pieces(state, dp, tp)
            mean = sum(p.nbytes for p in pieces) / world
            row = {"state": label, "mesh": f"dp{dp}xtp{tp}", "mean_bytes": mean,
                   "bound": lower_bound(pieces, world) / mean}
            for name, written in (("per-group", per_group(pieces)), ("job-wide", job_wide(pieces, world)),
                                  ("dcp", dcp(pieces, world))):
                row[name] = max(written.values()) / mean
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("busiest rank's bytes / mean")
    print(f"{'STATE':<10} {'MESH':<9} {'PER-GROUP':>9} {'JOB-WIDE':>9} {'DCP':>7} {'BOUND':>7}")
    for row in rows:
        print(f"{row['state']:<10} {row['mesh']:<9} {row['per-group']:>9.3f} {row['job-wide']:>9.3f} "
              f"{row['dcp']:>7.3f} {row['bound']:>7.3f}")


if __name__ == "__main__":
    main()
