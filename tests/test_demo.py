"""The README demo end to end: a real SIGKILL, a resume, bit-for-bit equality."""

from __future__ import annotations

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
    assert "EQUAL, bit for bit" in completed.stdout
