"""Start-up time of the ``ckptd`` command line (not part of the test run).

Runs each command in a fresh process, alternating the commands round by round so that a slow moment
of the machine hits all of them alike, and reports the median wall time of each against
``python -c pass`` on the same interpreter. The commands: ``ckptd --help``, ``ckptd ls --help``,
``ckptd ls DIR`` and ``ckptd inspect DIR`` on a small checkpoint made first, and ``python -c "import
torch"`` for scale.

Usage: ``python benchmarks/bench_cli_start.py [--repeats 7] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _checkpoint(root: Path) -> Path:
    import torch

    import ckptd

    directory = root / "ckpt"
    with ckptd.CheckpointManager(directory) as manager:
        manager.save(1, {"model": torch.nn.Linear(64, 64), "step": 1, "config": {"name": "bench"}}, force=True)
    return directory


def _commands(directory: Path) -> dict[str, list[str]]:
    python = [sys.executable]
    cli = [*python, "-m", "ckptd.cli.main"]
    return {
        "python -c pass": [*python, "-c", "pass"],
        "ckptd --help": [*cli, "--help"],
        "ckptd ls --help": [*cli, "ls", "--help"],
        "ckptd ls DIR": [*cli, "ls", str(directory)],
        "ckptd inspect DIR": [*cli, "inspect", str(directory)],
        "python -c 'import torch'": [*python, "-c", "import torch"],
    }


def measure(repeats: int) -> dict[str, float]:
    """Median wall seconds of each command over ``repeats`` rounds (one warm-up round first)."""
    root = Path(tempfile.mkdtemp(prefix="ckptd-cli-start-"))
    try:
        commands = _commands(_checkpoint(root))
        times: dict[str, list[float]] = {name: [] for name in commands}
        for round_number in range(repeats + 1):
            for name, argv in commands.items():
                start = time.perf_counter()
                subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if round_number:  # round 0 warms the page cache
                    times[name].append(time.perf_counter() - start)
        return {name: statistics.median(values) for name, values in times.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    medians = measure(args.repeats)
    baseline = medians["python -c pass"]
    if args.json:
        print(json.dumps({"median_s": medians, "repeats": args.repeats}, indent=2))
        return
    print(f"{'command':<28} {'median':>9} {'minus python -c pass':>22}   ({args.repeats} runs each)")
    for name, seconds in medians.items():
        print(f"{name:<28} {seconds:>8.3f}s {seconds - baseline:>21.3f}s")


if __name__ == "__main__":
    main()
