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
import numpy as np

from ckptd.data import index_dataset
from ckptd.data.manifest import save_manifest
from ckptd.demo.training import SEQ_LEN, VOCAB
from ckptd.errors import CkptdError

_SHARDS, _TOKENS_PER_SHARD = 6, 64 * SEQ_LEN


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: total steps, the step after which it crashes, save interval, work directory."""

    steps: int = 60
    crash_at: int = 37
    every: int = 5
    workdir: Path | None = None


def prepare_dataset(directory: Path) -> Path:
    """Write synthetic token shards (``.npy``), index them with ckptd, return the manifest path."""
    shards = directory / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(2024)
    for shard in range(_SHARDS):
        np.save(shards / f"tokens-{shard:03d}.npy",
                generator.integers(0, VOCAB, size=_TOKENS_PER_SHARD, dtype=np.uint16))
    result = index_dataset(str(shards), "tokens", reader_options={"seq_len": SEQ_LEN})
    manifest = directory / "manifest.json"
    save_manifest(result.manifest, manifest)
    return manifest


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
        manifest = prepare_dataset(work / "data")
        click.echo(f"[0/3] wrote {_SHARDS} token shards and indexed them (xxh3 per shard) into {manifest}")
        common = ["--steps", str(options.steps), "--every", str(options.every), "--data", str(manifest),
                  "--cache", str(work / "cache")]

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

    start = int(resumed["resumed_from"])  # type: ignore[arg-type]
    same_batches = resumed["batch_digests"] == reference["batch_digests"][start:]  # type: ignore[index]
    click.echo(f"      batches after the resume: {'the same samples in the same order' if same_batches else 'DIFFERENT'}"
               f" ({len(resumed['batch_digests'])} batches compared)")  # type: ignore[arg-type]
    equal = same_batches and resumed["weights_digest"] == reference["weights_digest"] and \
        resumed["next_random"] == reference["next_random"]
    verdict = "EQUAL, bit for bit" if equal else "DIFFERENT"
    click.echo(f"result: resumed run vs uninterrupted run: samples, weights and RNG streams {verdict}")
    return equal
