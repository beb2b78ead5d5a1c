"""Capturing and restoring the random number generators a training step draws from.

The captured value is an ordinary state tree (tensors, tuples, ints) that :mod:`ckptd.state.tree`
saves like any other state, so a resumed run draws the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

#: Key under which the manager stores the RNG states next to the user's state.
RNG_KEY = "__ckptd_rng__"


def capture_rng_states() -> dict[str, Any]:
    """The current states of torch (CPU and CUDA when present), numpy's global RNG and ``random``."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=True),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set every generator captured by :func:`capture_rng_states`."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(tuple(states["numpy"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(states["cuda"]))
