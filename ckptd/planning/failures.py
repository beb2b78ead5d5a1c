"""Failure rates, the checkpoint interval that minimises lost time, and the fraction of time a job loses.

- :func:`job_mtbf_hours`: a fleet's record (``failures`` unexpected interruptions in ``days`` on ``gpus``
  GPUs) gives a per-GPU rate, ``failures / (days x 24 x gpus)`` per GPU-hour; a job on ``job_gpus`` GPUs
  fails when any of them does, so its MTBF is ``1 / (rate x job_gpus)`` hours (failures independent).
- :func:`young_interval_s`: Young (1974), ``sqrt(2 C M)`` for checkpoint cost ``C`` and MTBF ``M``.
- :func:`daly_interval_s`: Daly (2006), the higher-order optimum
  ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, else ``M``. Both give the
  compute time between the ends of two checkpoints; ``ckptd plan`` recommends Daly's.
- :func:`lost_fraction`: the expected share of wall time that does not advance training, to first order
  in ``interval / M``: the stall per segment (``C / (interval + C)``), plus per failure the recomputation
  of half a segment and the work the tier had not made durable yet, plus the restart.

Pure arithmetic; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptd.errors import ConfigError


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"failures: {name} must be a positive number, got {value!r}")


def per_gpu_failures_per_hour(failures: float, days: float, gpus: int) -> float:
    """Unexpected interruptions per GPU-hour from a fleet's record."""
    _positive("--failures", failures)
    _positive("--days", days)
    _positive("--gpus", gpus)
    return failures / (days * 24.0 * gpus)


def job_mtbf_hours(failures: float, days: float, gpus: int, job_gpus: int) -> float:
    """The mean time between failures, in hours, of a job on ``job_gpus`` GPUs of that fleet."""
    _positive("the job's GPU count", job_gpus)
    return 1.0 / (per_gpu_failures_per_hour(failures, days, gpus) * job_gpus)


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 x cost x MTBF)`` seconds."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (see the module docstring); ``mtbf_s`` when the cost reaches ``2 x MTBF``."""
    cost = max(cost_s, 0.0)
    if cost >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost / (2.0 * mtbf_s)
    return max(0.0, math.sqrt(2.0 * cost * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost)


@dataclass(frozen=True)
class LostTime:
    """Expected shares of wall time lost, each a fraction of 1 (their sum is capped at 1)."""

    overhead: float
    recompute: float
    restart: float

    @property
    def total(self) -> float:
        return min(1.0, self.overhead + self.recompute + self.restart)

    def as_dict(self) -> dict[str, float]:
        return {"overhead": self.overhead, "recompute": self.recompute, "restart": self.restart, "total": self.total}


def lost_fraction(*, interval_s: float, stall_s: float, durable_lag_s: float, restart_s: float,
                  mtbf_s: float) -> LostTime:
    """The expected fraction of time lost when a checkpoint stalls training ``stall_s`` every ``interval_s``
    of compute and becomes restorable ``durable_lag_s`` after its stall ends; a failure costs the work since
    the newest restorable checkpoint and ``restart_s`` (see the module docstring)."""
    segment = interval_s + stall_s
    if segment <= 0:
        raise ConfigError("failures: the checkpoint interval and stall are both 0")
    overhead = stall_s / segment
    recompute = (segment / 2.0 + max(durable_lag_s, 0.0)) / mtbf_s
    return LostTime(overhead=overhead, recompute=recompute, restart=restart_s / mtbf_s)
