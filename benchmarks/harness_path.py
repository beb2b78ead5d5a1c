"""Makes the test harness (``tests/harness``) importable by a benchmark, and by the processes it starts.

Import it before anything from ``harness``: ``import harness_path  # noqa: F401``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import harness  # noqa: E402

harness.reach_from_subprocesses()
