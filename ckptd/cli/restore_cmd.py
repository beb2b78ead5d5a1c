"""``ckptd restore``: export one rank's share of a step to a plain ``torch.save`` file or to one safetensors
file (with the non-tensor values as JSON in its metadata). ``ckptd export`` writes the Hugging Face
layout of a whole sharded step instead.

Exit status: 0; 8 when the step is not committed there (the message lists the committed steps, and those a
restore set aside); 2 when PATH is a file or a folder inside a root (the message names the root); 4 when a
chunk read fails its digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckptd.cli.options import s3_options
from ckptd.cli.roots import open_root, set_aside_of
from ckptd.errors import ConfigError, NotFoundError

if TYPE_CHECKING:
    import torch


def _flatten_tensors(value: Any, prefix: str, tensors: dict[str, torch.Tensor], other: dict[str, Any], *,
                     unique: bool = True) -> None:
    """The leaves of a rebuilt state under dotted keys (as ``ckptd export`` names them). ``unique``:
    ConfigError when two entries get one key (``{"a.b": x, "a": {"b": y}}``), which one file of keys
    cannot hold."""
    import torch

    if unique and (isinstance(value, torch.Tensor) or not isinstance(value, (dict, list, tuple))):
        if prefix in tensors or prefix in other:
            raise ConfigError(f"two entries of the state export to the key {prefix!r}",
                              hint="keys are the state's paths joined with dots; rename one of the two entries, "
                                   "or restore with --format torch")
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.contiguous()
    elif isinstance(value, dict):
        for key, child in value.items():
            _flatten_tensors(child, f"{prefix}.{key}" if prefix else str(key), tensors, other, unique=unique)
    elif isinstance(value, (list, tuple)):
        for i, child in enumerate(value):
            _flatten_tensors(child, f"{prefix}.{i}" if prefix else str(i), tensors, other, unique=unique)
    else:
        other[prefix] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def write_rank_file(state: Any, out: Path, fmt: str, step: int) -> int:
    """Write a rebuilt state to ``out``; returns the number of tensors written."""
    import torch

    if fmt == "torch":
        torch.save(state, out)
        tensors: dict[str, torch.Tensor] = {}
        _flatten_tensors(state, "", tensors, {}, unique=False)
        return len(tensors)
    from ckptd.export import save_tensors

    tensors, other = {}, {}
    try:
        _flatten_tensors(state, "", tensors, other)
    except ConfigError as error:
        raise ConfigError(error.message, path=str(out), step=step, hint=error.hint) from None
    save_tensors(out, tensors, metadata={"format": "pt", "ckptd_step": str(step), "ckptd_values": json.dumps(other)})
    return len(tensors)


@click.command("restore")
@click.argument("path")
@click.option("--step", type=int, required=True, help="The step to export.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="File to write.")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors"]), default=None,
              help="Output format (default: from the file suffix; .safetensors or torch).")
@click.option("--rank", type=int, default=0, show_default=True, help="Which rank's share to export.")
@click.option("--allow-pickle", is_flag=True, help="Unpickle values saved with pickle (trusted files only).")
@click.option("--keep-rng", is_flag=True, help="Keep ckptd's saved RNG states in the export.")
@s3_options
def restore(path: str, step: int, out: Path, fmt: str | None, rank: int, allow_pickle: bool, keep_rng: bool,
            endpoint_url: str | None, region: str | None) -> None:
    """Export one step of PATH, verified, to a file usable without ckptd.

    \b
    Exit status: 0 written; 8 the step is not committed there (the message lists the steps that are);
    4 a chunk fails its digest; 2 PATH is a file or a folder inside a root."""
    from ckptd.state.rng import RNG_KEY
    from ckptd.state.tree import rebuild
    from ckptd.stepio.step_reader import ChunkSource, StepReader, load_rank_index, load_step_manifest
    from ckptd.tiers.atomicity import ranks_held

    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "torch")
    tier = open_root(path, endpoint_url, region)
    try:
        committed = tier.committed_steps()
        if step not in committed:
            aside = sorted({record.step for record in set_aside_of(tier)})
            raise NotFoundError(f"step {step} is not committed in {path}", step=step, tier=tier.label,
                                hint=f"committed steps there: {committed or 'none'}"
                                     + (f"; set aside by a restore: {aside} (`ckptd ls` says why)" if aside else ""))
        manifest = load_step_manifest(tier, step)
        held = ranks_held(tier, step, manifest)
        if rank not in held:
            raise NotFoundError(f"this directory holds ranks {list(held)} of step {step}, not rank {rank}",
                                step=step, tier=tier.label, hint="pass --rank, or export from that rank's node")
        reader = StepReader([ChunkSource(tier, load_rank_index(tier, manifest, rank))])
        state = rebuild(reader.index.values, reader.read_tensor, allow_pickle=allow_pickle)
    finally:
        tier.close()
    if isinstance(state, dict) and not keep_rng:
        state.pop(RNG_KEY, None)
    count = write_rank_file(state, out, fmt, step)
    click.echo(f"wrote step {step} rank {rank} ({count} tensors, verified) to {out} as {fmt}")
