"""The README demo end to end: a real SIGKILL, a resume, bit-for-bit equality; then 2 ranks under ``ckptd
launch`` with a warm spare, one SIGKILLed, only it replaced (by the spare), and the recovered run equal to the
uninterrupted one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_crashes_resumes_and_matches(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "ckptd.cli.main", "demo", "--steps", "24", "--crash-at", "13", "--every", "4",
         "--workdir", str(tmp_path)], capture_output=True, text=True, check=False, timeout=240)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "killed by signal 9" in completed.stdout
    assert "resumed from step" in completed.stdout and "read from object" in completed.stdout
    assert "result: resumed run vs uninterrupted run: samples, weights and RNG streams EQUAL, bit for bit" \
        in completed.stdout
    assert "ckptd launch: handed rank 1 to warm spare 0 (pid " in completed.stdout
    assert "the supervisor replaced only rank 1, by a warm spare (pid " in completed.stdout
    assert re.search(r"restored step 12: rank 1 from local \S+, rank 0 from memory; steps lost: 1; time to recover "
                     r"\(SIGKILL to the next completed step\): \d+\.\d\d s", completed.stdout), completed.stdout
    assert "result: elastic run with a killed rank vs uninterrupted run: samples, weights and optimizer state of " \
           "every rank EQUAL, bit for bit" in completed.stdout
    assert re.search(r"ckptd launch: rank 1 \(pid \d+\) killed by signal SIGKILL in generation 0 \(its last step 13\); "
                     r"restarting it alone in generation 1", completed.stdout), completed.stdout
