"""``ckptd ls``: the steps in one or more tiers, with time, size, ranks and state, and how far the object
tier is behind the local one.

Steps a restore set aside in a local root (``.set-aside/``, see :mod:`ckptd.manager.set_aside`) are listed
with state ``set-aside``, why and when; ``ckptd verify`` fails on them until ``ckptd gc --remove-set-aside``
deletes them.

Exit status: 0; 2 when a path is a file or a folder inside a checkpoint root (the message names the root
to pass instead); 8 when a local directory does not exist; 4 (:class:`~ckptd.errors.IntegrityError`'s
code) when some copy is corrupt (a manifest or index that does not parse or match, or with ``--verify`` a
bad chunk). An incomplete step (no manifest yet: a save being written, or one a crash interrupted) and a
set-aside step are listed but are no error.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from typing import Any

import click

from ckptd.cli.options import json_option, print_json, s3_options
from ckptd.cli.roots import holds_root, open_root, set_aside_of
from ckptd.errors import CkptdError, IntegrityError
from ckptd.manager.set_aside import SetAsideProblem, SetAsideRecord
from ckptd.tiers import StorageTier


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
    #: A set-aside step: when (Unix time), where (relative to the root), and what the restore found wrong.
    set_aside_at: float | None = None
    set_aside_as: str | None = None
    problems: tuple[SetAsideProblem, ...] | None = None


def set_aside_copy(tier: StorageTier, record: SetAsideRecord) -> StepCopy:
    """A step set aside in a local root, as ``ls`` reports it."""
    return StepCopy(record.step, tier.label, "set-aside", detail=record.describe(), set_aside_at=record.set_aside_at,
                    set_aside_as=record.name, problems=record.problems)


def describe_step(tier: StorageTier, step: int, *, verify: bool) -> StepCopy:
    """State of a step on a tier: committed, verified, corrupt or incomplete."""
    from ckptd.stepio.step_reader import load_step_manifest, verify_step
    from ckptd.tiers.atomicity import ranks_held

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


def _lag_of(tiers: list[StorageTier]) -> Any:
    """The promotion lag between the first node-local tier and the first object tier listed, or None
    unless both are."""
    local = next((tier for tier in tiers if tier.capabilities.node_local), None)
    remote = next((tier for tier in tiers if tier.capabilities.chunks_by_digest), None)
    if local is None or remote is None:
        return None
    from ckptd.promotion.lag import promotion_lag

    return promotion_lag(local, remote)


@click.command("ls")
@click.argument("paths", nargs=-1, required=True)
@click.option("--verify", is_flag=True, help="Re-hash every chunk of every copy (slow on large steps).")
@click.option("--lag", "lag_only", is_flag=True,
              help="Print only how far the object tier is behind the local one (PATHS: a local directory "
                   "and an s3:// URL).")
@s3_options
@json_option
def ls(paths: tuple[str, ...], verify: bool, lag_only: bool, endpoint_url: str | None, region: str | None,
       as_json: bool) -> None:
    """List steps in PATHS (directories or s3:// URLs, nearest tier first) and their state on each.

    Given a local directory and an object tier, also says how far the object tier is behind (steps and
    seconds between the newest committed step of each). Steps a restore set aside are listed as set-aside,
    with why and when.

    \b
    Exit status: 0 listed (set-aside and incomplete steps included); 4 a copy is corrupt;
    2 PATH is a file or a folder inside a checkpoint root (the message names the root); 8 no such directory."""
    copies: list[StepCopy] = []
    tiers: list[StorageTier] = []
    try:
        tiers.extend(open_root(path, endpoint_url, region) for path in paths)
        try:
            lag = _lag_of(tiers)
        except CkptdError as error:  # the listing below names the tier that fails
            if lag_only:
                raise
            lag, lag_error = None, str(error)
        else:
            lag_error = None
        if lag_only:
            if lag is None:
                raise click.UsageError("--lag needs a local directory and an object tier (s3://...) in PATHS")
            if as_json:
                print_json(asdict(lag))
            else:
                click.echo(lag.describe())
            return
        for tier in tiers:
            copies.extend(describe_step(tier, step, verify=verify) for step in tier.list_step_numbers())
            copies.extend(set_aside_copy(tier, record) for record in set_aside_of(tier))
        roots = [holds_root(tier) for tier in tiers]
    finally:
        for tier in tiers:
            tier.close()
    corrupt = any(copy.state == "corrupt" for copy in copies)
    if as_json:
        print_json([asdict(copy) for copy in copies])
    elif not copies:
        click.echo("no checkpoints" if any(roots) else
                   f"no checkpoints: no ckptd checkpoint root in {', '.join(paths)} (no step-* folders)")
    else:
        _print_table(copies)
        if lag is not None or lag_error is not None:
            click.echo(f"promotion: {lag.describe() if lag is not None else f'lag unknown: {lag_error}'}")
    if corrupt:
        raise click.exceptions.Exit(IntegrityError.exit_code)


def _print_table(copies: list[StepCopy]) -> None:
    click.echo(f"{'STEP':>10}  {'STATE':<10}  {'CREATED (UTC)':<19}  {'SIZE':>10}  {'RANKS':>5}  TIER")
    for copy in sorted(copies, key=lambda c: (c.step, c.tier)):
        created = "-" if copy.created is None else \
            datetime.datetime.fromtimestamp(copy.created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        ranks = "-" if copy.ranks is None else str(copy.ranks)
        if copy.ranks_here is not None:  # "1/2": this directory holds one of the step's two ranks
            ranks = f"{len(copy.ranks_here)}/{ranks}"
        click.echo(f"{copy.step:>10}  {copy.state:<10}  {created:<19}  {_human_bytes(copy.bytes):>10}  "
                   f"{ranks:>5}  {copy.tier}")
        if copy.set_aside_at is not None:
            when = datetime.datetime.fromtimestamp(copy.set_aside_at, datetime.timezone.utc)
            click.echo(f"{'':>10}  set aside {when:%Y-%m-%d %H:%M:%S} UTC as {copy.set_aside_as}")
        if copy.detail:
            click.echo(f"{'':>10}  {copy.detail}")
