"""``ckptd promote``: copy committed local steps to the object tier, verified and deduplicated.

Safe to run again after a failure or a crash: what is already stored and verified is not uploaded
again, and a step already committed remotely is skipped. Exit code 0 when every step is committed on
the object tier; otherwise the error's exit code (4 corrupt local chunk, 5 commit, 6 storage).
"""

from __future__ import annotations

from dataclasses import asdict

import click

from ckptd.cli.options import byte_progress, json_option, open_cli_tier, print_json, s3_options
from ckptd.errors import ConfigError, NotFoundError


@click.command("promote")
@click.argument("path")
@click.option("--to", "target", required=True, envvar="CKPTD_REMOTE", metavar="s3://BUCKET/PREFIX",
              help="Object tier to promote to. [env: CKPTD_REMOTE]")
@click.option("--step", "steps", type=int, multiple=True,
              help="Promote only this step (repeatable; default: every committed step).")
@s3_options
@json_option
def promote(path: str, target: str, steps: tuple[int, ...], endpoint_url: str | None, region: str | None,
            as_json: bool) -> None:
    """Promote the committed steps of the local checkpoint directory PATH to an object tier."""
    from ckptd.promotion.promoter import Promoter
    from ckptd.stepio.step_reader import load_step_manifest

    local = open_cli_tier(path, endpoint_url, region)
    remote = open_cli_tier(target, endpoint_url, region)
    if not local.capabilities.node_local:
        raise ConfigError(f"{path!r} is not a local checkpoint directory", hint="promote from a local path")
    if not remote.capabilities.chunks_by_digest:
        raise ConfigError(f"--to {target!r} is not an object store URL", hint="pass --to s3://bucket/prefix")
    committed = local.committed_steps()
    chosen = list(steps) or committed
    for step in chosen:
        if step not in committed:
            raise NotFoundError("step is not committed locally", step=step, tier=local.label,
                                hint="`ckptd ls` lists the committed steps")
    promoter = Promoter(local, remote)
    reports = []
    try:
        for step in chosen:
            total = load_step_manifest(local, step).total_bytes
            with byte_progress(f"promoting step {step}", total, enabled=not as_json) as advance:
                reports.append(promoter.promote(step, progress=advance))
            if not as_json:
                report = reports[-1]
                state = "already committed" if report.already_committed else \
                    f"{report.chunks_uploaded} of {report.chunks} chunks uploaded ({report.bytes_uploaded} bytes)"
                click.echo(f"step {step}: {state} on {remote.label}")
    finally:
        remote.close()
        local.close()
    if as_json:
        print_json([asdict(report) for report in reports])
    elif not reports:
        click.echo("no committed steps to promote")
