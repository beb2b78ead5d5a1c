"""Every rank and every replacement starts with fresh random state, as under torchrun (where each rank is a
new interpreter): torch's default generator, numpy's global state and :mod:`random` differ between the
ranks of one job, between two jobs, and between a rank's process and its replacement, under ``ckptd launch``
with its default ``--preload`` (ranks forked from one process) as under ``torchrun --standalone``.

The script is an unmodified torchrun-style one (no ckptd import, no seeding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

SCRIPT = '''
import json, os, random, signal, sys
import numpy, torch
rank, restart = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
drawn = {"torch_seed": torch.initial_seed(), "torch": torch.rand(2).tolist(), "numpy": numpy.random.rand(2).tolist(),
         "random": [random.random(), random.random()], "preloaded": PRELOADED}
with open(os.path.join(sys.argv[1], f"rank{rank}-restart{restart}.json"), "w") as out:
    json.dump(drawn, out)
if len(sys.argv) > 2 and rank == sys.argv[2] and restart == "0":
    import time
    deadline = time.monotonic() + 120  # the others' draws are written before the group restart ends them
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(sys.argv[1], f"rank{other}-restart0.json"))
            for other in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _script(directory: Path) -> Path:
    path = directory / "draw.py"
    path.write_text('import sys\nPRELOADED = "torch" in sys.modules\n' + SCRIPT)
    return path


def _run(launcher: list[str], out: Path, *script_args: str) -> dict[str, dict]:
    out.mkdir(parents=True)
    done = subprocess.run([*launcher, str(_script(out)), str(out), *script_args], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    return {path.stem: json.loads(path.read_text()) for path in out.glob("rank*.json")}


CKPTD = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", "2", "--max-restarts", "1",
         "--restart-backoff", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
FIELDS = ("torch_seed", "torch", "numpy", "random")


def _all_differ(draws: list[dict]) -> None:
    for field in FIELDS:
        values = [json.dumps(draw[field]) for draw in draws]
        assert len(set(values)) == len(values), f"{field} is the same in two processes: {values}"


def test_ranks_of_a_preloaded_launch_draw_different_numbers_as_under_torchrun(tmp_path: Path) -> None:
    torchrun = _run(TORCHRUN, tmp_path / "torchrun")
    _all_differ([torchrun["rank0-restart0"], torchrun["rank1-restart0"]])  # what torchrun does
    first = _run(CKPTD, tmp_path / "ckptd-1")
    second = _run(CKPTD, tmp_path / "ckptd-2")
    assert first["rank0-restart0"]["preloaded"] and first["rank1-restart0"]["preloaded"], "not forked preloaded"
    _all_differ([first["rank0-restart0"], first["rank1-restart0"], second["rank0-restart0"],
                 second["rank1-restart0"]])


def test_a_preloaded_replacement_draws_other_numbers_than_the_process_it_replaces(tmp_path: Path) -> None:
    draws = _run(CKPTD, tmp_path / "ckptd", "1")
    # the script does not use ckptd.elastic: the whole group restarts, as under torchrun (rank 0 too)
    assert {"rank0-restart0", "rank1-restart0", "rank1-restart1"} <= set(draws), sorted(draws)
    assert draws["rank1-restart1"]["preloaded"]
    _all_differ(list(draws.values()))
