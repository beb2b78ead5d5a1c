"""A 2-rank job under ``torchrun --max-restarts``: one rank is SIGKILLed after a save, torchrun restarts the
job on the same store (its keys from the first attempt still there), the restarted attempt restores the
newest intact step and the job ends with the weights of an uninterrupted run, bit for bit.

The job (:mod:`harness.launched_training`) hands ckptd the launcher's unprefixed store, so ckptd meets
the previous attempt's keys under the names it used then."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank


def _torchrun(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "3", "--monitor-interval", "0.2",
               "-m", "harness.launched_training", "--root", str(root), "--out", str(out), *extra]
    environment = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_COMMIT_TIMEOUT_S="20")
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment, check=False)


def _final(out: Path) -> list[dict[str, str]]:
    return [json.loads((out / f"rank{rank}-final.json").read_text()) for rank in range(2)]


def test_torchrun_restart_restores_the_newest_step_and_ends_bit_for_bit(tmp_path: Path) -> None:
    reference = _torchrun(tmp_path / "reference-ckpt", tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]

    crashed = _torchrun(tmp_path / "ckpt", tmp_path / "run", "--kill-rank", "1", "--kill-after", "8")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    attempts = sorted(p.name for p in (tmp_path / "run").glob("rank1-attempt*.json"))
    assert attempts == ["rank1-attempt0.json", "rank1-attempt1.json"], attempts
    for rank in range(2):
        first = json.loads((tmp_path / "run" / f"rank{rank}-attempt0.json").read_text())
        second = json.loads((tmp_path / "run" / f"rank{rank}-attempt1.json").read_text())
        assert first["restored"] is None
        # steps 3 and 6 were committed before the kill after step 8; the store kept attempt 0's keys
        assert second == {"restored": 6, "generation": first["generation"] + 1}, (first, second)
    assert _final(tmp_path / "run") == _final(tmp_path / "reference")
