"""``ckptd verify``: re-hash every chunk of one or all committed steps; non-zero exit on any problem."""

from __future__ import annotations

from dataclasses import asdict

import click

from ckptd.cli.options import byte_progress, json_option, open_cli_tier, print_json, s3_options
from ckptd.errors import CkptdError, IntegrityError, NotFoundError
from ckptd.stepio.step_reader import VerifyProblem, load_step_manifest, load_rank_index, verify_step
from ckptd.tiers import StorageTier
from ckptd.tiers.atomicity import ranks_held


def _step_bytes(tier: StorageTier, step: int) -> int:
    try:
        manifest = load_step_manifest(tier, step)
        held = ranks_held(tier, step, manifest)
        return sum(load_rank_index(tier, manifest, rank).data_size for rank in held)
    except CkptdError:
        return 0


@click.command("verify")
@click.argument("path")
@click.option("--step", type=int, default=None, help="Verify only this step (default: every committed step).")
@s3_options
@json_option
def verify(path: str, step: int | None, endpoint_url: str | None, region: str | None, as_json: bool) -> None:
    """Re-hash everything in PATH and report each bad file and chunk (exit 4 when any is bad)."""
    tier = open_cli_tier(path, endpoint_url, region)
    try:
        steps = tier.list_step_numbers() if step is None else [step]
        if step is not None and step not in steps:
            raise NotFoundError("no such step", step=step, tier=tier.label, hint="`ckptd ls` lists the steps")
        problems: list[VerifyProblem] = []
        checked = 0
        total = sum(_step_bytes(tier, s) for s in steps)
        with byte_progress(f"verifying {tier.label}", total, enabled=not as_json) as advance:
            for candidate in steps:
                if not tier.is_committed(candidate):
                    continue
                problems.extend(verify_step(tier, candidate, progress=advance))
                checked += 1
    finally:
        tier.close()
    if as_json:
        print_json({"tier": tier.label, "steps_checked": checked, "problems": [asdict(p) for p in problems]})
    else:
        for problem in problems:
            rank = "-" if problem.rank is None else problem.rank
            click.echo(f"BAD step {problem.step} rank {rank}: {problem.error}")
        click.echo(f"{checked} committed step(s) checked on {tier.label}: "
                   f"{'all intact' if not problems else f'{len(problems)} problem(s)'}")
    if problems:
        raise click.exceptions.Exit(IntegrityError.exit_code)
