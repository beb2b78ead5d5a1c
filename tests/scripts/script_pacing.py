"""The tests' hook in the torchrun-style scripts of this folder (imported from the script's own directory, which
Python puts first on the path): a pace after each step, and a hold that keeps a rank the test will kill at the
step it is to be killed after."""

from __future__ import annotations

import os
import time


def pace(out: str, rank: int, step: int) -> None:
    """``STEP_SLEEP`` seconds, then a hold while ``OUT/hold-rank<r>-step<s>`` exists (a test that kills this rank
    after that step removes the file once it has killed it)."""
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    hold = os.path.join(out, f"hold-rank{rank}-step{step}")
    while os.path.exists(hold):
        time.sleep(0.01)
