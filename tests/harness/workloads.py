"""Deterministic workloads for child processes of :mod:`harness.crash`.

Every function here is a crash-injector target: it takes a :class:`~harness.crash.Channel`
first and returns a picklable value. States are pure functions of their step (and size), so the parent
can rebuild exactly what a killed child was saving and compare bytes without keeping a copy.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptd.config import override
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness.crash import Channel

_MIX = 2654435761


def _synthetic_sizes(nbytes: int) -> tuple[int, int]:
    wide = max(1, (nbytes * 3 // 4) // 8)
    return wide, max(1, (nbytes - wide * 8) // 4)


def synthetic_state(step: int, nbytes: int) -> dict[str, Any]:
    """A state of about ``nbytes`` whose every chunk differs from step to step and from each other
    (no two chunks share a digest, so nothing is deduplicated)."""
    wide, narrow = _synthetic_sizes(nbytes)
    return {
        "wide": torch.arange(wide, dtype=torch.int64).mul_(_MIX).add_(step),
        "narrow": torch.arange(narrow, dtype=torch.float32).add_(step).div_(7.0),
        "meta": {"step": step, "name": f"state-{step}"},
    }


def synthetic_template(nbytes: int) -> dict[str, Any]:
    """A live state of the structure of :func:`synthetic_state` (zeroed tensors), to restore into."""
    wide, narrow = _synthetic_sizes(nbytes)
    return {"wide": torch.zeros(wide, dtype=torch.int64), "narrow": torch.zeros(narrow, dtype=torch.float32),
            "meta": None}


def save_steps(channel: Channel, directory: str, first_step: int, count: int, nbytes: int,
               keep_local: int | None = 1, hold: bool = False, settings: dict[str, Any] | None = None) -> list[float]:
    """Open a manager on ``directory`` and save synthetic states for ``count`` steps from ``first_step``.

    Calls ``channel.ready()`` just before the first save and reports ``(step, seconds the save took)``
    once a step is committed. With ``hold``, waits to be killed afterwards. Returns the seconds each
    save took.
    """
    with override(**(settings or {})):
        manager = CheckpointManager(directory, policy=Policy(keep_local=keep_local), capture_rng=False)
        states = [synthetic_state(step, nbytes) for step in range(first_step, first_step + count)]
        durations = []
        channel.ready()
        for step, state in zip(range(first_step, first_step + count), states):
            started = time.perf_counter()
            manager.save(step, state, force=True)
            manager.wait()
            durations.append(time.perf_counter() - started)
            channel.report((step, durations[-1]))
        if hold:
            while True:
                signal.pause()
        manager.close()
    return durations


def open_manager(channel: Channel, directory: str) -> str:
    """Try to open a manager on ``directory``; returns ``"opened"`` or ``"<ErrorType>: <message>"``."""
    try:
        manager = CheckpointManager(directory)
    except Exception as error:  # reported to the parent, which asserts on it
        return f"{type(error).__name__}: {error}"
    manager.close()
    return "opened"


class _ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                          torch.nn.Linear(32, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)


def train(channel: Channel, directory: str, total_steps: int, result_file: str, seed: int = 0) -> int | None:
    """A small training run that draws from torch (data, dropout), numpy (noise) and ``random`` (lr
    jitter), checkpointing every step with ckptd and resuming from the newest step when one exists.

    Reports each saved step; at the end writes, with ``torch.save`` to ``result_file``, the final
    model and optimizer state, every draw made after the resume point, and fresh draws from each RNG.
    Returns the step it resumed from (None on a fresh run).
    """
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = _ToyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optimizer}
    with CheckpointManager(directory, policy=Policy(every_steps=1, keep_local=2)) as manager:
        resumed = manager.restore(state)
        draws: dict[int, tuple[torch.Tensor, np.ndarray, float]] = {}
        for step in range((resumed or 0) + 1, total_steps + 1):
            inputs = torch.randn(16, 8)
            noise = np.random.standard_normal(16).astype(np.float32)
            jitter = random.random()
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 * (0.5 + jitter)
            target = inputs.sum(dim=1, keepdim=True) + torch.from_numpy(noise).unsqueeze(1)
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            draws[step] = (inputs, noise, jitter)
            manager.save(step, state)
            manager.wait()
            channel.report(step)
    after = (torch.rand(4), np.random.random_sample(4), [random.random() for _ in range(4)])
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "draws": draws, "after": after},
               Path(result_file))
    return resumed
