"""Orchestrates the demo: an uninterrupted run, a run that crashes with SIGKILL, and its resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from ckptd.errors import CkptdError


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: total steps, the step after which it crashes, save interval, work directory."""

    steps: int = 60
    crash_at: int = 37
    every: int = 5
    workdir: Path | None = None


def _run_child(args: list[str], result: Path) -> tuple[int, dict[str, object] | None]:
    command = [sys.executable, "-m", "ckptd.demo.training", "--result", str(result), *args]
    completed = subprocess.run(command, check=False)
    data = json.loads(result.read_text()) if result.exists() else None
    return completed.returncode, data


def run_demo(options: DemoOptions) -> bool:
    """Run the three phases, print what happens, return whether the resumed run matches bit for bit."""
    if not 0 < options.crash_at < options.steps:
        raise CkptdError(f"--crash-at must lie between 1 and {options.steps - 1}")
    with tempfile.TemporaryDirectory(prefix="ckptd-demo-") as scratch:
        work = options.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = work / "checkpoints"
        common = ["--steps", str(options.steps), "--every", str(options.every)]

        click.echo(f"[1/3] training {options.steps} steps without interruption (the reference run)")
        code, reference = _run_child(common, work / "reference.json")
        if code != 0 or reference is None:
            raise CkptdError(f"the reference run failed with exit code {code}")
        click.echo(f"      final weights xxh3-128 {reference['weights_digest']}")

        click.echo(f"[2/3] training with ckptd (save every {options.every} steps) into {ckpt}; "
                   f"the process kills itself with SIGKILL after step {options.crash_at}")
        code, _ = _run_child(common + ["--ckpt", str(ckpt), "--crash-at", str(options.crash_at)],
                             work / "crashed.json")
        if code != -signal.SIGKILL:
            raise CkptdError(f"the crashing run ended with exit code {code}, not SIGKILL")
        committed = sorted(p.name for p in ckpt.glob("step-*") if (p / "manifest.json").exists())
        click.echo(f"      crashed (killed by signal {signal.SIGKILL}); committed on disk: {', '.join(committed)}")

        click.echo("[3/3] a new process restores the newest intact step and trains to the end")
        code, resumed = _run_child(common + ["--ckpt", str(ckpt)], work / "resumed.json")
        if code != 0 or resumed is None:
            raise CkptdError(f"the resumed run failed with exit code {code}")
        click.echo(f"      resumed from step {resumed['resumed_from']}; final weights xxh3-128 "
                   f"{resumed['weights_digest']}")

    equal = resumed["weights_digest"] == reference["weights_digest"] and \
        resumed["next_random"] == reference["next_random"]
    verdict = "EQUAL, bit for bit" if equal else "DIFFERENT"
    click.echo(f"result: resumed run vs uninterrupted run: weights and RNG streams {verdict}")
    return equal
