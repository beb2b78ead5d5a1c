"""``ckptd inspect``: every tensor of a step: name, dtype, shape, bytes, chunks, digest."""

from __future__ import annotations

import click

from ckptd.cli.options import json_option, open_cli_tier, print_json, s3_options
from ckptd.format.hashing import chunk_digest
from ckptd.format.records import TensorRecord
from ckptd.errors import NotFoundError
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.tiers.atomicity import ranks_held


def tensor_digest(record: TensorRecord) -> str:
    """One digest for a whole tensor: the chunk digest itself for one chunk, else xxh3-128 of the
    concatenated chunk digests (so equal tensors show equal digests across steps)."""
    if len(record.chunks) == 1:
        return record.chunks[0].digest
    return chunk_digest("".join(c.digest for c in record.chunks).encode())


@click.command("inspect")
@click.argument("path")
@click.option("--step", type=int, required=True, help="The step to inspect.")
@click.option("--rank", type=int, default=None, help="Only this rank (default: every rank).")
@s3_options
@json_option
def inspect(path: str, step: int, rank: int | None, endpoint_url: str | None, region: str | None,
            as_json: bool) -> None:
    """Show the manifest of a step and every tensor each rank saved."""
    tier = open_cli_tier(path, endpoint_url, region)
    try:
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
    if as_json:
        print_json({"step": manifest.step, "world_size": manifest.world_size, "codec": manifest.codec,
                    "format_version": manifest.format_version, "ckptd_version": manifest.ckptd_version,
                    "created": manifest.created, "tensors": rows})
        return
    click.echo(f"step {manifest.step}: {manifest.world_size} rank(s), codec {manifest.codec}, "
               f"format {manifest.format_version}, written by ckptd {manifest.ckptd_version}")
    click.echo(f"{'RANK':>4}  {'DTYPE':<10} {'SHAPE':<20} {'BYTES':>12} {'CHUNKS':>6}  {'DIGEST':<32}  NAME")
    for row in rows:
        shape = "x".join(map(str, row["shape"])) or "scalar"
        click.echo(f"{row['rank']:>4}  {row['dtype']:<10} {shape:<20} {row['bytes']:>12} {row['chunks']:>6}  "
                   f"{row['digest']:<32}  {row['name']}")
