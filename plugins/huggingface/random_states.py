"""The random number generators a Hugging Face training step draws from, as a state ckptd saves.

Both frameworks set these generators themselves on resume, at a moment of their choosing (the Trainer after
it skipped the batches already trained on), so restoring this object only holds the saved states;
:meth:`RandomStates.apply` sets the generators when the caller decides.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RandomStates:
    """``state_dict()`` captures the generators of ``random``, numpy, torch (CPU, and CUDA when in use);
    ``load_state_dict()`` keeps a saved capture in :attr:`saved` without touching the generators."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=True),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.random.get_rng_state_all()
        return states

    def load_state_dict(self, states: dict[str, Any]) -> None:
        version, internal, gauss = states["python"]
        kind, keys, position, has_gauss, cached = states["numpy"]
        self.saved = {
            "python": (version, tuple(internal), gauss),
            "numpy": (kind, np.asarray(keys), int(position), int(has_gauss), float(cached)),
            "cpu": states["cpu"],
        }
        if "cuda" in states:
            self.saved["cuda"] = list(states["cuda"])

    def apply(self) -> None:
        """Set every generator to the loaded states (nothing happens before a load)."""
        if self.saved is None:
            return
        random.setstate(self.saved["python"])
        np.random.set_state(self.saved["numpy"])
        torch.random.set_rng_state(self.saved["cpu"])
        if "cuda" in self.saved and torch.cuda.is_available():
            torch.cuda.random.set_rng_state_all(self.saved["cuda"])
