"""``ckptd inspect``: a step's manifest, the job's layout (mesh, each rank's coordinates, ZeRO stage, the
pieces several ranks hold and who wrote each), the plain values it saved (step counters, a loader's
position, a config, learning rates), the bytes each rank wrote (and the busiest rank's against the mean) and
every tensor: name, dtype, shape, bytes, chunks, digest. Reads only the manifest and the rank indexes, never
a tensor's bytes."""

from __future__ import annotations

import json
from typing import Any

import click

from ckptd.cli.options import json_option, open_cli_tier, print_json, s3_options
from ckptd.errors import NotFoundError
from ckptd.format.hashing import chunk_digest
from ckptd.format.records import Manifest, RankIndex, TensorRecord
from ckptd.format.values import parse_values
from ckptd.state.saved_values import saved_values
from ckptd.tiers import StorageTier

#: Longest value shown in the text listing (``--json`` shows every value whole).
_VALUE_WIDTH = 72
#: Replicated pieces listed in the text listing (``--json`` lists all).
_REPLICAS_SHOWN = 20


def tensor_digest(record: TensorRecord) -> str:
    """One digest for a whole tensor: the chunk digest itself for one chunk, else xxh3-128 of the
    concatenated chunk digests (so equal tensors show equal digests across steps)."""
    if len(record.chunks) == 1:
        return record.chunks[0].digest
    return chunk_digest("".join(c.digest for c in record.chunks).encode())


def value_rows(index: RankIndex) -> list[dict[str, Any]]:
    """The plain values a rank saved, one row each (``rank``, ``path``, ``value``); a step written with
    ``dcp.save`` shows the non-tensor objects it saved."""
    values = parse_values(index.values, step=index.step)
    if values.skeleton is not None:
        found = [(value.path, value.value) for value in saved_values(values.skeleton)]
    else:
        # the DCP writer saves each object as the state {"value": object}
        found = [(fqn + value.path.removeprefix("value"), value.value)
                 for fqn, skeleton in sorted(values.objects.items()) for value in saved_values(skeleton)]
    return [{"rank": index.rank, "path": path, "value": value} for path, value in found]


def layout_summary(manifest: Manifest) -> dict[str, Any] | None:
    """The manifest's layout as ``inspect --json`` shows it (None for a step without one): the mesh, each
    rank's coordinates by dimension name, the ZeRO stage, and every replicated piece with its writer and
    holders, plus the bytes each rank wrote."""
    layout = manifest.layout
    if layout is None:
        return None
    dims = list(layout.mesh)
    return {"mesh": dict(layout.mesh), "source": layout.source, "zero_stage": layout.zero_stage,
            "ranks": [{"rank": entry.rank, "coordinates": dict(zip(dims, layout.coordinates[entry.rank])),
                       "data_bytes": entry.data_size, "wrote_for_others": len(entry.shared),
                       "read_from_others": len(entry.replicas)} for entry in manifest.ranks],
            "replicated": [{"name": p.name, "writer": p.writer, "holders": list(p.holders)}
                           for p in layout.replicated],
            "placements": dict(layout.placements)}


def bytes_per_rank(manifest: Manifest, indexes: list[RankIndex]) -> dict[str, Any]:
    """What each rank wrote, as ``inspect --json`` shows it: ``data_bytes`` (its data files, from the
    manifest, every rank) and ``tensor_bytes`` (its tensors before encoding, from its index; None for a rank
    whose index this directory does not hold), and the busiest rank's data bytes over the mean."""
    tensor_bytes = {index.rank: sum(record.nbytes for record in index.tensors.values()) for index in indexes}
    rows = [{"rank": entry.rank, "data_bytes": entry.data_size, "tensor_bytes": tensor_bytes.get(entry.rank)}
            for entry in sorted(manifest.ranks, key=lambda entry: entry.rank)]
    total = sum(row["data_bytes"] for row in rows)
    mean = total / len(rows) if rows else 0.0
    busiest = max(rows, key=lambda row: (row["data_bytes"], -row["rank"])) if rows else None
    return {"ranks": rows, "total_data_bytes": total, "mean_data_bytes": mean,
            "busiest_rank": None if busiest is None else busiest["rank"],
            "busiest_over_mean": busiest["data_bytes"] / mean if busiest is not None and mean else None}


def _echo_bytes(summary: dict[str, Any]) -> None:
    ratio = summary["busiest_over_mean"]
    click.echo(f"bytes per rank: {summary['total_data_bytes']} in all, mean {summary['mean_data_bytes']:.0f}"
               + ("" if ratio is None else f", busiest rank {summary['busiest_rank']} writes {ratio:.3f}x the mean"))
    click.echo(f"{'RANK':>4}  {'DATA BYTES':>12} {'TENSOR BYTES':>12} {'VS MEAN':>8}")
    for row in summary["ranks"]:
        tensors = "-" if row["tensor_bytes"] is None else str(row["tensor_bytes"])
        share = f"{row['data_bytes'] / summary['mean_data_bytes']:.3f}" if summary["mean_data_bytes"] else "-"
        click.echo(f"{row['rank']:>4}  {row['data_bytes']:>12} {tensors:>12} {share:>8}")


def _echo_layout(summary: dict[str, Any]) -> None:
    mesh = " x ".join(f"{name}={size}" for name, size in summary["mesh"].items())
    stage = "unknown" if summary["zero_stage"] is None else summary["zero_stage"]
    click.echo(f"layout: mesh {mesh} (from {summary['source']}), ZeRO stage {stage}, "
               f"{len(summary['replicated'])} replicated piece(s) written once")
    click.echo(f"{'RANK':>4}  {'COORDINATES':<24} {'DATA BYTES':>12} {'WROTE FOR OTHERS':>16} {'READ FROM OTHERS':>16}")
    for row in summary["ranks"]:
        coordinates = ",".join(f"{name}={value}" for name, value in row["coordinates"].items())
        click.echo(f"{row['rank']:>4}  {coordinates:<24} {row['data_bytes']:>12} {row['wrote_for_others']:>16} "
                   f"{row['read_from_others']:>16}")
    for piece in summary["replicated"][:_REPLICAS_SHOWN]:
        holders = ",".join(map(str, piece["holders"]))
        click.echo(f"  replica {piece['name']}: written by rank {piece['writer']}, held by ranks {holders}")
    left = len(summary["replicated"]) - _REPLICAS_SHOWN
    if left > 0:
        click.echo(f"  ... {left} more replicated piece(s) (--json lists every one)")


def _newest_step(tier: StorageTier) -> int:
    steps = tier.committed_steps()
    if not steps:
        raise NotFoundError("no committed step", tier=tier.label, hint="`ckptd ls` lists the steps and their state")
    return steps[-1]


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _VALUE_WIDTH else text[:_VALUE_WIDTH - 3] + "..."


@click.command("inspect")
@click.argument("path")
@click.option("--step", type=int, default=None, help="The step to inspect (default: the newest committed step).")
@click.option("--rank", type=int, default=None, help="Only this rank (default: every rank).")
@s3_options
@json_option
def inspect(path: str, step: int | None, rank: int | None, endpoint_url: str | None, region: str | None,
            as_json: bool) -> None:
    """Show the manifest of a step, the values it saved and every tensor of each rank."""
    from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
    from ckptd.tiers.atomicity import ranks_held

    tier = open_cli_tier(path, endpoint_url, region)
    try:
        step = _newest_step(tier) if step is None else step
        manifest = load_step_manifest(tier, step)
        held = ranks_held(tier, step, manifest)
        if rank is not None and rank not in held:
            raise NotFoundError(f"this directory holds ranks {list(held)} of step {step}, not rank {rank}",
                                step=step, tier=tier.label, hint="inspect the directory of that rank's node")
        ranks = list(held) if rank is None else [rank]
        indexes = [load_rank_index(tier, manifest, r) for r in ranks]
    finally:
        tier.close()
    rows = [
        {"rank": index.rank, "name": name, "dtype": record.dtype, "shape": list(record.shape),
         "bytes": record.nbytes, "chunks": len(record.chunks),
         "codecs": sorted({c.codec for c in record.chunks}), "digest": tensor_digest(record)}
        for index in indexes for name, record in index.tensors.items()
    ]
    values = [row for index in indexes for row in value_rows(index)]
    if as_json:
        print_json({"step": manifest.step, "world_size": manifest.world_size, "codec": manifest.codec,
                    "format_version": manifest.format_version, "ckptd_version": manifest.ckptd_version,
                    "created": manifest.created, "layout": layout_summary(manifest),
                    "bytes_per_rank": bytes_per_rank(manifest, indexes), "values": values, "tensors": rows})
        return
    click.echo(f"step {manifest.step}: {manifest.world_size} rank(s), codec {manifest.codec}, "
               f"format {manifest.format_version}, written by ckptd {manifest.ckptd_version}")
    summary = layout_summary(manifest)
    if summary is not None:
        _echo_layout(summary)
    _echo_bytes(bytes_per_rank(manifest, indexes))
    if values:
        width = max(len("PATH"), *(len(value["path"]) for value in values))
        click.echo(f"{'RANK':>4}  {'PATH':<{width}}  VALUE")
        for value in values:
            click.echo(f"{value['rank']:>4}  {value['path']:<{width}}  {_shown(value['value'])}")
    click.echo(f"{'RANK':>4}  {'DTYPE':<10} {'SHAPE':<20} {'BYTES':>12} {'CHUNKS':>6}  {'DIGEST':<32}  NAME")
    for row in rows:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        click.echo(f"{row['rank']:>4}  {row['dtype']:<10} {shape:<20} {row['bytes']:>12} {row['chunks']:>6}  "
                   f"{row['digest']:<32}  {row['name']}")
