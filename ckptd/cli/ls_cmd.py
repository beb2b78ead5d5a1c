"""``ckptd ls``: the steps in one or more tiers, with time, size, ranks and state."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass

import click

from ckptd.cli.options import json_option, open_cli_tier, print_json, s3_options
from ckptd.errors import CkptdError
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.tiers import StorageTier
from ckptd.tiers.atomicity import ranks_held


@dataclass(frozen=True)
class StepCopy:
    """One tier's copy of one step, as ``ls`` reports it."""

    step: int
    tier: str
    state: str
    created: float | None = None
    bytes: int | None = None
    ranks: int | None = None
    detail: str | None = None
    #: The ranks whose files this copy holds, when it holds only some (a node-local directory).
    ranks_here: tuple[int, ...] | None = None


def describe_step(tier: StorageTier, step: int, *, verify: bool) -> StepCopy:
    """State of a step on a tier: committed, verified, corrupt or incomplete."""
    if not tier.is_committed(step):
        return StepCopy(step, tier.label, "incomplete")
    try:
        manifest = load_step_manifest(tier, step)
    except CkptdError as error:
        return StepCopy(step, tier.label, "corrupt", detail=str(error))
    state = "committed"
    detail = None
    try:
        held = ranks_held(tier, step, manifest)
    except CkptdError as error:
        return StepCopy(step, tier.label, "corrupt", detail=str(error))
    if verify:
        problems = list(verify_step(tier, step))
        state = "corrupt" if problems else "verified"
        detail = "; ".join(p.error for p in problems) or None
    partial = held if len(held) < manifest.world_size else None
    return StepCopy(step, tier.label, state, manifest.created, manifest.total_bytes, manifest.world_size, detail,
                    partial)


def _human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return str(count)


@click.command("ls")
@click.argument("paths", nargs=-1, required=True)
@click.option("--verify", is_flag=True, help="Re-hash every chunk of every copy (slow on large steps).")
@s3_options
@json_option
def ls(paths: tuple[str, ...], verify: bool, endpoint_url: str | None, region: str | None, as_json: bool) -> None:
    """List steps in PATHS (directories or s3:// URLs, nearest tier first) and their state on each."""
    copies = []
    for path in paths:
        tier = open_cli_tier(path, endpoint_url, region)
        try:
            copies.extend(describe_step(tier, step, verify=verify) for step in tier.list_step_numbers())
        finally:
            tier.close()
    if as_json:
        print_json([asdict(copy) for copy in copies])
        return
    if not copies:
        click.echo("no checkpoints")
        return
    click.echo(f"{'STEP':>10}  {'STATE':<10}  {'CREATED (UTC)':<19}  {'SIZE':>10}  {'RANKS':>5}  TIER")
    for copy in sorted(copies, key=lambda c: (c.step, c.tier)):
        created = "-" if copy.created is None else \
            datetime.datetime.fromtimestamp(copy.created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        ranks = "-" if copy.ranks is None else str(copy.ranks)
        if copy.ranks_here is not None:  # "1/2": this directory holds one of the step's two ranks
            ranks = f"{len(copy.ranks_here)}/{ranks}"
        click.echo(f"{copy.step:>10}  {copy.state:<10}  {created:<19}  {_human_bytes(copy.bytes):>10}  "
                   f"{ranks:>5}  {copy.tier}")
        if copy.detail:
            click.echo(f"{'':>10}  {copy.detail}")
