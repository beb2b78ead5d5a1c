"""Orchestrates the demo: an uninterrupted run, a run that crashes with SIGKILL, and its resume; then the
elastic phase (:mod:`ckptd.demo.elastic_phase`): 2 ranks under ``ckptd launch``, one killed mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from ckptd.data import index_dataset
from ckptd.data.manifest import save_dataset_manifest
from ckptd.demo.elastic_phase import run_elastic_phase
from ckptd.demo.training import SEQ_LEN, VOCAB
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.errors import CkptdError

_SHARDS, _TOKENS_PER_SHARD = 6, 64 * SEQ_LEN


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: total steps, the step after which it crashes, save interval, work directory,
    and the object tier (an embedded S3 endpoint on loopback unless ``remote`` is given); ``elastic``: also
    run the elastic phase (2 ranks and ``spares`` warm spares under ``ckptd launch``, one rank killed after
    ``crash_at``)."""

    steps: int = 60
    crash_at: int = 37
    every: int = 5
    workdir: Path | None = None
    remote: str | None = None
    endpoint_url: str | None = None
    elastic: bool = True
    spares: int = 1


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
    save_dataset_manifest(result.manifest, manifest)
    return manifest


def _run_child(args: list[str], result: Path, env: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
    command = [sys.executable, "-m", "ckptd.demo.training", "--result", str(result), *args]
    completed = subprocess.run(command, check=False, env={**os.environ, **env})
    data = json.loads(result.read_text()) if result.exists() else None
    return completed.returncode, data


def run_demo(options: DemoOptions) -> bool:
    """Run the phases, print what happens, return whether the resumed run matches bit for bit."""
    if not 0 < options.crash_at < options.steps:
        raise CkptdError(f"--crash-at must lie between 1 and {options.steps - 1}")
    with contextlib.ExitStack() as stack:
        work = options.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptd-demo-")))
        work.mkdir(parents=True, exist_ok=True)
        remote, endpoint_url = options.remote, options.endpoint_url
        env: dict[str, str] = {}
        if remote is None:
            server = stack.enter_context(EmbeddedS3())
            server.create_bucket("ckptd-demo")
            remote, endpoint_url = "s3://ckptd-demo/run", server.endpoint_url
            env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
            click.echo(f"[0/4] started an embedded S3 endpoint (moto) at {endpoint_url}")
        manifest = prepare_dataset(work / "data")
        click.echo(f"[0/4] wrote {_SHARDS} token shards and indexed them (xxh3 per shard) into {manifest}")
        common = ["--steps", str(options.steps), "--every", str(options.every), "--data", str(manifest),
                  "--cache", str(work / "cache")]
        tiers = ["--remote", remote] + (["--endpoint-url", endpoint_url] if endpoint_url else [])
        reference, resumed = _run_phases(options, work, common, tiers, remote, env)
        equal = _compare(reference, resumed)
        if options.elastic:
            equal = run_elastic_phase(work / "elastic", manifest, steps=options.steps, kill_step=options.crash_at,
                                      every=options.every, spares=options.spares) and equal
    return equal


def _run_phases(options: DemoOptions, work: Path, common: list[str], tiers: list[str], remote: str,
                env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    ckpt = work / "checkpoints"
    click.echo(f"[1/4] training {options.steps} steps without interruption (the reference run)")
    code, reference = _run_child(common, work / "reference.json", env)
    if code != 0 or reference is None:
        raise CkptdError(f"the reference run failed with exit code {code}")
    click.echo(f"      final weights xxh3-128 {reference['weights_digest']}")

    click.echo(f"[2/4] training with ckptd: save every {options.every} steps to {ckpt}, promote to {remote}; "
               f"the process kills itself with SIGKILL after step {options.crash_at} (once its saves so far are on "
               "the object tier)")
    code, _ = _run_child(common + tiers + ["--ckpt", str(ckpt), "--crash-at", str(options.crash_at)],
                         work / "crashed.json", env)
    if code != -signal.SIGKILL:
        raise CkptdError(f"the crashing run ended with exit code {code}, not SIGKILL")
    committed = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / "manifest.json").exists())
    click.echo(f"      crashed (killed by signal {signal.SIGKILL}); steps committed on local disk: {committed}")

    shutil.rmtree(ckpt)
    click.echo("[3/4] the node lost its local disk: a new process on an empty local tier restores the newest "
               "intact step from the object tier and trains to the end")
    code, resumed = _run_child(common + tiers + ["--ckpt", str(ckpt)], work / "resumed.json", env)
    if code != 0 or resumed is None:
        raise CkptdError(f"the resumed run failed with exit code {code}")
    click.echo(f"      resumed from step {resumed['resumed_from']} (read from {resumed['restored_tier']}); "
               f"final weights xxh3-128 {resumed['weights_digest']}")
    return reference, resumed


def _compare(reference: dict[str, Any], resumed: dict[str, Any]) -> bool:
    start = int(resumed["resumed_from"])
    same_batches = resumed["batch_digests"] == reference["batch_digests"][start:]
    click.echo(f"      batches after the resume: {'the same samples in the same order' if same_batches else 'DIFFERENT'}"
               f" ({len(resumed['batch_digests'])} batches compared)")
    equal = same_batches and resumed["weights_digest"] == reference["weights_digest"] and \
        resumed["next_random"] == reference["next_random"]
    verdict = "EQUAL, bit for bit" if equal else "DIFFERENT"
    click.echo(f"result: resumed run vs uninterrupted run: samples, weights and RNG streams {verdict}")
    return equal
