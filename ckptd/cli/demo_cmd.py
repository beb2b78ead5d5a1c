"""``ckptd demo``: train, crash for real, resume, and check bit-for-bit equality; then kill one of 2 ranks under
``ckptd launch`` and check the recovered run the same way."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option("--steps", type=int, default=60, show_default=True, help="Training steps in every run.")
@click.option("--crash-at", type=int, default=37, show_default=True, help="Step after which the run is killed.")
@click.option("--every", type=int, default=5, show_default=True, help="Save interval in steps.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep checkpoints and results here (default: a temporary directory).")
@click.option("--remote", default=None, help="Object tier URL, e.g. s3://bucket/prefix (default: an embedded "
              "S3 endpoint on 127.0.0.1).")
@click.option("--endpoint-url", envvar="CKPTD_S3_ENDPOINT_URL", default=None,
              help="S3-compatible endpoint for --remote. [env: CKPTD_S3_ENDPOINT_URL]")
@click.option("--elastic/--no-elastic", default=True, show_default=True,
              help="Also run the elastic phase: 2 ranks under `ckptd launch`, one killed after --crash-at.")
@click.option("--spares", type=int, default=1, show_default=True,
              help="Warm spares in the elastic phase (`ckptd launch --spares`; 0: a new process replaces the rank).")
def demo(steps: int, crash_at: int, every: int, workdir: Path | None, remote: str | None,
         endpoint_url: str | None, elastic: bool, spares: int) -> None:
    """Run the crash-and-resume demo; exits 1 if the resumed run differs from the uninterrupted one.

    Its elastic phase then kills one of 2 ranks under `ckptd launch` (with --spares warm spares) and
    compares the recovered run with an uninterrupted one the same way."""
    from ckptd.demo.runner import DemoOptions, run_demo

    options = DemoOptions(steps=steps, crash_at=crash_at, every=every, workdir=workdir, remote=remote,
                          endpoint_url=endpoint_url, elastic=elastic, spares=spares)
    if not run_demo(options):
        raise click.exceptions.Exit(1)
