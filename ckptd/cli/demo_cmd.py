"""``ckptd demo``: train, crash for real, resume, and check bit-for-bit equality."""

from __future__ import annotations

from pathlib import Path

import click

from ckptd.demo.runner import DemoOptions, run_demo


@click.command("demo")
@click.option("--steps", type=int, default=60, show_default=True, help="Training steps in every run.")
@click.option("--crash-at", type=int, default=37, show_default=True, help="Step after which the run is killed.")
@click.option("--every", type=int, default=5, show_default=True, help="Save interval in steps.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep checkpoints and results here (default: a temporary directory).")
def demo(steps: int, crash_at: int, every: int, workdir: Path | None) -> None:
    """Run the crash-and-resume demo; exits 1 if the resumed run differs from the uninterrupted one."""
    if not run_demo(DemoOptions(steps=steps, crash_at=crash_at, every=every, workdir=workdir)):
        raise click.exceptions.Exit(1)
