"""An event simulation of a training job's failures and recoveries (``ckptd goodput``): goodput, lost work and
time to recover for ckptd against checkpoint-and-restart-everything, and the interval that maximises goodput.

**Failures.** A job on ``N`` GPUs fails at the per-GPU rate times ``N`` (its MTTF falls as ``1/N``; the rate
defaults to the Llama 3 405B fleet record ``ckptd plan`` uses). Failures arrive as a Poisson process in wall
time, independent of what the job is doing, and each is one of three kinds drawn by a mix
(:class:`FailureModel`): a **process** dies (the node lives), a **node** is lost with its local disk, or a
rank **hangs** (found only by a timeout). :func:`failure_trace` draws a seeded trace; every strategy and
interval is simulated on the same traces (common random numbers), so comparisons between them are not noise.

**A strategy** (:class:`Strategy`) is what one failure costs: the checkpoint's stall (training stops), the
commit window after the stall until the checkpoint is restorable for each kind of failure (a process failure
needs it on the local tier, a node loss on the buddy's), the time to find each kind of failure and the time
to recover from it (restart, re-form the process group, restore). :func:`strategies_from_plan` derives both
strategies from a ``ckptd plan`` (:class:`~ckptd.planning.plan.Plan`, whose bandwidths may be measured):

- **ckptd**: asynchronous saves (stall: the staging copy); a failed or hung rank is replaced in place (a warm
  spare or a new process) and restores from its node's local tier while the others keep their state in
  memory; a lost node is replaced (a spare node at once, otherwise after ``node_replace_s``) and restores
  from its buddy's peer tier.
- **restart-all**: synchronous saves to the object tier (stall: the tier's durable time, nothing in flight);
  every failure stops the whole job, which is requeued (``restart_s``) and restores from the object tier.

**The job** (:func:`simulate`) computes ``interval`` seconds, stalls ``stall`` seconds to checkpoint, and so
on. Checkpoint ``k`` after a (re)start at ``t0`` ends its stall at ``t0 + k (interval + stall)`` and is
restorable ``commit`` seconds later. A failure at ``t`` rolls progress back to the newest checkpoint
restorable at ``t`` (lost work: the compute done since), and the job runs again ``detect + recover`` seconds
later; a failure during that downtime starts the recovery again (the rolled-back progress is not lost twice).
Goodput is the compute progress kept at the end of the horizon divided by the horizon. The time to recover
of a failure is its downtime, and with the rework, the time until the job is back at the progress it had.

:func:`best_interval` simulates a geometric sweep of intervals and fits a parabola in ``log(interval)``
through the best point and its neighbours (the curve is flat at its top, a fit is steadier than the
sweep's largest value).

Pure arithmetic and :mod:`random` with a seed: the same inputs give the same figures. No torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import ConfigError

KINDS = ("process", "node", "hang")
_DAY_S = 86400.0


def _number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise ConfigError(f"goodput: {name} must be a {'positive' if positive else 'finite, non-negative'} number, "
                          f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FailureModel:
    """Failures of a job: the job's mean time to failure in seconds and the share of each kind.

    The default mix follows the Llama 3 405B report (about 78% of its unexpected interruptions were confirmed
    or suspected hardware issues, counted here as node losses); how the rest splits into process crashes and
    hangs is an assumption (``ckptd goodput --process-share --node-share --hang-share``)."""

    mttf_s: float
    process: float = 0.17
    node: float = 0.78
    hang: float = 0.05

    def __post_init__(self) -> None:
        _number("the job's MTTF", self.mttf_s, positive=True)
        for kind in KINDS:
            _number(f"--{kind}-share", getattr(self, kind))
        if abs(self.process + self.node + self.hang - 1.0) > 1e-6:
            raise ConfigError(f"goodput: the shares of process, node and hang failures must add up to 1, got "
                              f"{self.process:g} + {self.node:g} + {self.hang:g}")

    @classmethod
    def for_job(cls, per_gpu_failures_per_hour: float, gpus: int, **shares: float) -> FailureModel:
        """The failures of a job on ``gpus`` GPUs at a per-GPU rate: its MTTF is ``1 / (rate x gpus)``."""
        rate = _number("the per-GPU failure rate", per_gpu_failures_per_hour, positive=True)
        count = _number("the job's GPU count", gpus, positive=True)
        return cls(mttf_s=3600.0 / (rate * count), **shares)


@dataclass(frozen=True)
class Failure:
    """One failure: when (seconds of wall time from the job's start) and which kind."""

    at_s: float
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"goodput: a failure's kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        _number("a failure's time", self.at_s)


def failure_trace(model: FailureModel, horizon_s: float, *, seed: int | str) -> tuple[Failure, ...]:
    """A seeded Poisson trace of failures over ``horizon_s`` seconds, each of a kind drawn by ``model``'s mix."""
    rng = random.Random(f"ckptd-goodput:{seed}")
    failures = []
    at = rng.expovariate(1.0 / model.mttf_s)
    while at < horizon_s:
        draw = rng.random()
        kind = "process" if draw < model.process else "node" if draw < model.process + model.node else "hang"
        failures.append(Failure(at_s=at, kind=kind))
        at += rng.expovariate(1.0 / model.mttf_s)
    return tuple(failures)


@dataclass(frozen=True)
class Strategy:
    """What checkpointing and a failure of each kind cost (see the module docstring); times in seconds."""

    name: str
    stall_s: float
    commit_s: dict[str, float]
    detect_s: dict[str, float]
    recover_s: dict[str, float]

    def __post_init__(self) -> None:
        _number(f"{self.name}: the checkpoint stall", self.stall_s)
        for table in ("commit_s", "detect_s", "recover_s"):
            values = getattr(self, table)
            if set(values) != set(KINDS):
                raise ConfigError(f"goodput: {self.name}: {table} needs a time for each of {', '.join(KINDS)}")
            for kind, value in values.items():
                _number(f"{self.name}: {table}[{kind}]", value)

    def downtime_s(self, kind: str) -> float:
        return self.detect_s[kind] + self.recover_s[kind]

    def as_json(self) -> dict[str, Any]:
        return {"stall_seconds": self.stall_s, "commit_seconds": dict(self.commit_s),
                "detect_seconds": dict(self.detect_s), "recover_seconds": dict(self.recover_s)}


@dataclass(frozen=True)
class RecoveryTimes:
    """The times a recovery takes beyond what the plan computes (its restore times), in seconds.

    Defaults: ``ckptd launch``'s detection (a dead process within a poll; ``--node-timeout`` 30 s;
    ``--hang-timeout`` 300 s); a replacement rank's start (a warm spare takes a rank at once, measured 0.2 s
    end to end for a small model; without one a new process imports torch and builds its model and optimizer,
    taken as 30 s for a large model); re-forming the job's process group (60 s at thousands of GPUs); a lost
    node's replacement (a spare node joins at once, otherwise the scheduler provides one in 15 min). The
    restart-all baseline finds a hang by the collective's timeout (10 min, PyTorch's default for NCCL) and
    restarts the job in ``restart_s`` (``ckptd plan``'s ``--restart-minutes``)."""

    process_detect_s: float = 1.0
    node_detect_s: float = 30.0
    hang_detect_s: float = 300.0
    spares: bool = True
    spare_start_s: float = 1.0
    process_start_s: float = 30.0
    regroup_s: float = 60.0
    node_replace_s: float = 900.0
    baseline_hang_detect_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("process_detect_s", "node_detect_s", "hang_detect_s", "spare_start_s", "process_start_s",
                     "regroup_s", "node_replace_s", "baseline_hang_detect_s"):
            _number(name, getattr(self, name))


def strategies_from_plan(plan: Any, times: RecoveryTimes = RecoveryTimes()) -> tuple[Strategy, Strategy]:
    """(ckptd, restart-all) from a :class:`~ckptd.planning.plan.Plan`'s staging, commit and restore times and
    its restart time (see the module docstring)."""
    local, peer, remote = plan.tiers["local"], plan.tiers["peer"], plan.tiers["object"]
    staging = plan.staging_s
    start = times.spare_start_s if times.spares else times.process_start_s
    replace_node = 0.0 if times.spares else times.node_replace_s
    rank_recovery = start + times.regroup_s + local.restore_s
    ckptd = Strategy(
        name="ckptd", stall_s=staging,
        commit_s={"process": local.restorable_s - staging, "node": peer.restorable_s - staging,
                  "hang": local.restorable_s - staging},
        detect_s={"process": times.process_detect_s, "node": times.node_detect_s, "hang": times.hang_detect_s},
        recover_s={"process": rank_recovery, "hang": rank_recovery,
                   "node": replace_node + start + times.regroup_s + peer.restore_s})
    restart = plan.inputs.restart_s + remote.restore_s
    baseline = Strategy(
        name="restart-all", stall_s=remote.sync.stall_s, commit_s={kind: 0.0 for kind in KINDS},
        detect_s={"process": times.process_detect_s, "node": times.node_detect_s,
                  "hang": times.baseline_hang_detect_s},
        recover_s={"process": restart, "hang": restart, "node": replace_node + restart})
    return ckptd, baseline


@dataclass(frozen=True)
class Outcome:
    """What :func:`simulate` found over all its traces. Times are seconds summed over the traces; ``lost`` is
    the compute rolled back, ``downtime`` the time no rank trained after failures, ``stall`` the checkpoint
    stalls."""

    strategy: str
    interval_s: float
    horizon_s: float
    progress_s: float
    lost_s: float
    downtime_s: float
    stall_s: float
    failures: dict[str, int]
    goodputs: tuple[float, ...] = field(default=())

    @property
    def goodput(self) -> float:
        return self.progress_s / self.horizon_s if self.horizon_s else 0.0

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())

    @property
    def mean_downtime_s(self) -> float | None:
        """Mean time from a failure until training runs again."""
        return self.downtime_s / self.failure_count if self.failure_count else None

    @property
    def mean_recovery_s(self) -> float | None:
        """Mean time from a failure until the job is back at the progress it had (downtime plus rework)."""
        return (self.downtime_s + self.lost_s) / self.failure_count if self.failure_count else None

    def as_json(self, gpus: int) -> dict[str, Any]:
        ordered = sorted(self.goodputs)
        return {"interval_seconds": self.interval_s, "goodput": self.goodput,
                "goodput_p10": _quantile(ordered, 0.1), "goodput_p90": _quantile(ordered, 0.9),
                "failures": dict(self.failures), "lost_work_gpu_hours": self.lost_s * gpus / 3600.0,
                "lost_work_hours": self.lost_s / 3600.0, "downtime_hours": self.downtime_s / 3600.0,
                "checkpoint_stall_hours": self.stall_s / 3600.0, "mean_downtime_seconds": self.mean_downtime_s,
                "mean_recovery_seconds": self.mean_recovery_s}


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def simulate(strategy: Strategy, interval_s: float, traces: Sequence[Sequence[Failure]],
             horizon_s: float) -> Outcome:
    """Run the job of the module docstring once per trace (each over ``horizon_s`` seconds) with a checkpoint
    every ``interval_s`` seconds of compute, and sum what happened."""
    interval = _number("the checkpoint interval", interval_s, positive=True)
    horizon = _number("the horizon", horizon_s, positive=True)
    stall = strategy.stall_s
    segment = interval + stall

    def computed(elapsed: float) -> float:
        whole, rest = divmod(elapsed, segment)
        return whole * interval + min(rest, interval)

    def stalled(elapsed: float) -> float:
        whole, rest = divmod(elapsed, segment)
        return whole * stall + max(0.0, rest - interval)

    progress_total = lost_total = down_total = stall_total = 0.0
    counts = {kind: 0 for kind in KINDS}
    goodputs = []
    for trace in traces:
        progress, start, index = 0.0, 0.0, 0
        failures = sorted(trace, key=lambda failure: failure.at_s)
        while True:
            if index >= len(failures) or failures[index].at_s >= horizon:
                progress += computed(horizon - start)
                stall_total += stalled(horizon - start)
                break
            failure = failures[index]
            index += 1
            elapsed = max(0.0, failure.at_s - start)
            done = computed(elapsed)
            window = elapsed - strategy.commit_s[failure.kind]
            kept = math.floor(window / segment) * interval if window >= segment else 0.0
            lost_total += done - kept
            progress += kept
            stall_total += stalled(elapsed)
            counts[failure.kind] += 1
            resume = failure.at_s + strategy.downtime_s(failure.kind)
            while index < len(failures) and failures[index].at_s < min(resume, horizon):
                again = failures[index]  # a failure during the recovery starts it again
                index += 1
                counts[again.kind] += 1
                resume = max(resume, again.at_s + strategy.downtime_s(again.kind))
            down_total += min(resume, horizon) - failure.at_s
            if resume >= horizon:
                break
            start = resume
        progress_total += progress
        goodputs.append(progress / horizon)
    return Outcome(strategy=strategy.name, interval_s=interval, horizon_s=horizon * len(traces),
                   progress_s=progress_total, lost_s=lost_total, downtime_s=down_total, stall_s=stall_total,
                   failures=counts, goodputs=tuple(goodputs))


@dataclass(frozen=True)
class Sweep:
    """Goodput over a sweep of intervals and the interval that maximises it."""

    outcomes: tuple[Outcome, ...]
    best_interval_s: float

    @property
    def best(self) -> Outcome:
        """The simulated interval nearest the best one."""
        return min(self.outcomes, key=lambda outcome: abs(math.log(outcome.interval_s / self.best_interval_s)))


def best_interval(strategy: Strategy, traces: Sequence[Sequence[Failure]], horizon_s: float, *,
                  low_s: float, high_s: float, points: int = 41) -> Sweep:
    """Simulate ``points`` intervals spaced evenly in ``log`` between ``low_s`` and ``high_s`` and return them
    with the interval that maximises goodput (a parabola in ``log(interval)`` through the best point and its
    two neighbours; the best point itself at either end of the sweep)."""
    low, high = _number("the lowest interval", low_s, positive=True), _number("the highest interval", high_s,
                                                                                positive=True)
    if high <= low or points < 3:
        raise ConfigError(f"goodput: an interval sweep needs low < high and 3 points or more, got {low:g}, "
                          f"{high:g}, {points}")
    ratio = (high / low) ** (1.0 / (points - 1))
    outcomes = tuple(simulate(strategy, low * ratio ** index, traces, horizon_s) for index in range(points))
    top = max(range(points), key=lambda index: outcomes[index].goodput)
    best = outcomes[top].interval_s
    if 0 < top < points - 1:
        left, middle, right = (outcomes[top + offset].goodput for offset in (-1, 0, 1))
        curvature = left - 2.0 * middle + right
        if curvature < 0:
            best *= ratio ** (0.5 * (left - right) / curvature)
    return Sweep(outcomes=outcomes, best_interval_s=best)


@dataclass(frozen=True)
class GoodputReport:
    """``ckptd goodput``'s result: each strategy at its planned interval and at the best simulated one."""

    gpus: int
    days: float
    runs: int
    seed: int
    failure_model: FailureModel
    strategies: tuple[Strategy, ...]
    planned: tuple[Outcome, ...]
    sweeps: tuple[Sweep, ...]

    def as_json(self) -> dict[str, Any]:
        model = self.failure_model
        result: dict[str, Any] = {
            "schema": 1, "gpus": self.gpus, "days": self.days, "runs": self.runs, "seed": self.seed,
            "failures": {"job_mttf_hours": model.mttf_s / 3600.0,
                         "shares": {kind: getattr(model, kind) for kind in KINDS}},
            "strategies": {}}
        for strategy, planned, sweep in zip(self.strategies, self.planned, self.sweeps):
            result["strategies"][strategy.name] = {
                "costs": strategy.as_json(), "planned": planned.as_json(self.gpus),
                "best": {**sweep.best.as_json(self.gpus), "interval_seconds": sweep.best_interval_s,
                         "simulated_interval_seconds": sweep.best.interval_s}}
        return result


def goodput_report(strategies: Sequence[tuple[Strategy, float]], model: FailureModel, *, gpus: int, days: float,
                   runs: int = 20, seed: int = 0, points: int = 41) -> GoodputReport:
    """Simulate each (strategy, planned interval) over ``runs`` seeded traces of ``days`` days, at its planned
    interval and over a sweep from a fifth to five times it, for :class:`GoodputReport`."""
    horizon = _number("--job-days", days, positive=True) * _DAY_S
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ConfigError(f"goodput: --runs must be a positive integer, got {runs!r}")
    traces = [failure_trace(model, horizon, seed=f"{seed}:{run}") for run in range(runs)]
    planned, sweeps = [], []
    for strategy, interval in strategies:
        planned.append(simulate(strategy, interval, traces, horizon))
        sweeps.append(best_interval(strategy, traces, horizon, low_s=interval / 5.0, high_s=interval * 5.0,
                                    points=points))
    return GoodputReport(gpus=gpus, days=days, runs=runs, seed=seed, failure_model=model,
                         strategies=tuple(strategy for strategy, _ in strategies), planned=tuple(planned),
                         sweeps=tuple(sweeps))
