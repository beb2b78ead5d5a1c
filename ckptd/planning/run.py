"""A training run's length, and what checkpointing costs over all of it.

A run is given as its length in days of training (without failures), or as tokens: by the usual estimate a
dense decoder's training takes ``6 x N x D`` floating-point operations for ``N`` parameters and ``D``
tokens (Kaplan et al. 2020; Hoffmann et al. 2022), so on ``G`` GPUs sustaining ``F`` FLOP/s each it
computes for ``6 N D / (G F)`` seconds. Over that time, a checkpoint every ``interval`` seconds of compute
that loses a fraction ``lost`` of wall time gives :class:`RunTotals`: the wall time
``compute / (1 - lost)``, the failures expected in it (wall time / MTBF), the hours lost, and the saves and
bytes each tier takes (saves repeated in recomputed work are not counted).

Pure arithmetic; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptd.errors import ConfigError

_DAY_S = 86400.0


def _positive(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"run length: {option} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RunLength:
    """The compute time of a run (no failures), and what it was computed from."""

    compute_s: float
    source: str
    tokens: float | None = None
    flops_per_gpu: float | None = None

    def __post_init__(self) -> None:
        _positive("the run's length", self.compute_s)

    @classmethod
    def from_days(cls, days: float) -> RunLength:
        """A run of ``days`` days of training."""
        return cls(compute_s=_positive("--run-days", days) * _DAY_S, source="days")

    @classmethod
    def from_tokens(cls, tokens: float, *, parameters: int, flops_per_gpu: float, gpus: int) -> RunLength:
        """A run over ``tokens`` tokens of a model of ``parameters`` parameters on ``gpus`` GPUs sustaining
        ``flops_per_gpu`` FLOP/s each: ``6 N D / (G F)`` seconds."""
        _positive("--tokens", tokens)
        _positive("--tflops-per-gpu", flops_per_gpu)
        _positive("the parameter count", parameters)
        _positive("the GPU count", gpus)
        return cls(compute_s=6.0 * parameters * tokens / (gpus * flops_per_gpu), source="tokens",
                   tokens=float(tokens), flops_per_gpu=float(flops_per_gpu))

    @property
    def compute_days(self) -> float:
        return self.compute_s / _DAY_S


@dataclass(frozen=True)
class RunTotals:
    """One way of checkpointing (async or sync, restoring from one tier) over a whole run."""

    saves: float
    bytes_written: float
    wall_s: float | None
    expected_failures: float | None
    lost_hours: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"saves": self.saves, "bytes_written": int(math.ceil(self.bytes_written)),
                "wall_days": None if self.wall_s is None else self.wall_s / _DAY_S,
                "expected_failures": self.expected_failures, "lost_hours": self.lost_hours}


def run_totals(run: RunLength, *, interval_s: float, lost_total: float, mtbf_s: float,
               bytes_per_save: float) -> RunTotals:
    """:class:`RunTotals` of checkpointing every ``interval_s`` of compute, losing ``lost_total`` of wall time,
    at ``mtbf_s``, writing ``bytes_per_save`` each time. A loss of all the time gives no wall time."""
    saves = run.compute_s / interval_s if interval_s > 0 else math.inf
    if lost_total >= 1.0:
        return RunTotals(saves=saves, bytes_written=saves * bytes_per_save, wall_s=None, expected_failures=None,
                         lost_hours=None)
    wall = run.compute_s / (1.0 - lost_total)
    return RunTotals(saves=saves, bytes_written=saves * bytes_per_save, wall_s=wall, expected_failures=wall / mtbf_s,
                     lost_hours=(wall - run.compute_s) / 3600.0)
