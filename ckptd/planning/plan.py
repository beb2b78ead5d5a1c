"""``ckptd plan``'s arithmetic: from a model, a state recipe, a layout, bandwidths, retention and a failure rate
to the bytes, times, storage, intervals and lost time of checkpointing that job.

:func:`make_plan` takes a :class:`PlanInputs` and returns a :class:`Plan`; :meth:`Plan.as_json` is the
``--json`` document. Every figure is for the busiest rank and the busiest node (the one that writes the most),
so the slowest writer sets the times. The model of each tier (per node, bandwidths in GB/s = 1e9 bytes/s):

- **staging** (the only part that stalls training): the rank copies what it writes into host memory, bound
  by its own device-to-host link or by the node's host-memory bandwidth shared by its ranks, whichever is
  slower: ``max(rank_written / d2h, node_written / host_memcpy)``.
- **local**: the node's writes go to its disk after staging: durable at ``staging + node_written / disk``.
- **peer**: the node's local step is copied to its buddy node, whose disk also takes it: durable at
  ``local + node_written / min(peer, disk)``.
- **object**: the node's local step is uploaded: durable at ``local + max(node_written / object,
  job_written / object_job)`` (the second term only with a job-wide limit).

Storage per tier keeps ``keep`` committed steps (``peak`` counts the one being written too); the object tier
stores each chunk once (content addressing), so it needs ``keep_remote x unique bytes`` for the job. Restore
reads what each rank holds: from the local tier its own node's writes from disk and the pieces other replicas
wrote over the peer network. The interval per tier is Daly's higher-order optimum for the staging stall as
the checkpoint cost (ckptd saves asynchronously; Young's ``sqrt(2 C M)`` is reported next to it), raised to
what the tier can absorb (a save finishes on a tier before the next reaches it). The lost fraction adds the
stall's overhead, the expected recomputation (half a segment plus the tier's durable lag) and the restart
(``restart_s`` plus the restore from that tier), per failure. Not modelled: compute slowed by background
writes, compression, and steps that share unchanged chunks.

JSON schema 2 (``Plan.as_json``; keys are stable, new keys may be added, removals bump ``schema``; 2
renamed schema 1's ``bandwidths_gbps``, whose values were GB/s and not the gigabits "Gbps" suggests)::

    schema: 2
    inputs: {parameters, expert_parameters, parameters_from,
             bytes_per_parameter: {weights, grads, master, moments, total},
             layout: {tp, pp, dp, ep, zero_stage, gpus_per_node, world_size, nodes},
             dedup, bandwidths_gb_per_s: {d2h, host_memcpy, disk, peer, object, object_job},
             bandwidth_sources: {same keys: "default" | "given" | "measured"},
             retention: {keep_local, keep_peer, keep_remote},
             failures: {mtbf_hours, mtbf_from, per_gpu_failures_per_hour, restart_s}}
    checkpoint: {unique_bytes: {weights, grads, master, moments, total},
                 held_bytes_all_ranks: {...same...}, replication_factor}
    rank: {busiest, held_bytes: {...}, written_bytes: {...}, mean_written_bytes}
    node: {busiest, held_bytes: {...}, written_bytes: {...}}
    stages: [{stage, parameters, expert_parameters, rank_held_bytes, rank_written_bytes}]
    staging: {seconds, bound: "device-to-host" | "host-memory"}
    tiers: {local|peer|object: {write_seconds, durable_seconds, restore_seconds,
             storage_bytes_per_node, peak_bytes_per_node, storage_bytes_total,
             interval: {young_seconds, daly_seconds, seconds, formula: "daly", bound: "daly" | "tier"},
             lost_fraction: {overhead, recompute, restart, total}}}
    warnings: [str]

Byte counts are integers; times are seconds; the object tier's per-node storage is null (it is shared); ``object_job`` is null without a job-wide limit; ``mtbf_from``
is ``"given"`` or ``"failures"``; ``per_gpu_failures_per_hour`` is null for a given MTBF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import ConfigError
from ckptd.planning.failures import LostTime, daly_interval_s, lost_fraction, young_interval_s
from ckptd.planning.layout import CheckpointSplit, Layout, StateBytes, split_checkpoint, whole_bytes
from ckptd.planning.model import ParameterCount

SCHEMA = 2
_GB = 1e9
#: Bandwidths used when neither given nor measured, GB/s (see README "ckptd plan"): one PCIe Gen4 x16
#: link's pinned copy per GPU, a two-socket server's host memory, one NVMe drive, a 100 Gbit/s link to the
#: buddy node, 20 Gbit/s to object storage per node.
DEFAULT_GBPS: dict[str, float | None] = {"d2h": 25.0, "host_memcpy": 80.0, "disk": 5.0, "peer": 12.5,
                                         "object": 2.5, "object_job": None}
TIERS = ("local", "peer", "object")


@dataclass(frozen=True)
class Bandwidths:
    """GB/s: ``d2h`` per GPU, the rest per node, ``object_job`` for the whole job (None: no such limit)."""

    d2h: float = 25.0
    host_memcpy: float = 80.0
    disk: float = 5.0
    peer: float = 12.5
    object: float = 2.5
    object_job: float | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in DEFAULT_GBPS:
            value = getattr(self, name)
            if value is None and name == "object_job":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"bandwidth: --{name.replace('_', '-')}-gb-per-s must be a positive number of GB/s, "
                                  f"got {value!r}")


@dataclass(frozen=True)
class Retention:
    """Committed steps each tier keeps."""

    keep_local: int = 2
    keep_peer: int = 1
    keep_remote: int = 5

    def __post_init__(self) -> None:
        for name in ("keep_local", "keep_peer", "keep_remote"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"retention: --{name.replace('_', '-')} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``ckptd plan`` computes from."""

    parameters: ParameterCount
    parameters_from: str
    state: StateBytes
    layout: Layout
    mtbf_hours: float
    mtbf_from: str = "given"
    per_gpu_failures_per_hour: float | None = None
    restart_s: float = 600.0
    dedup: bool = True
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    retention: Retention = field(default_factory=Retention)

    def __post_init__(self) -> None:
        if isinstance(self.mtbf_hours, bool) or not isinstance(self.mtbf_hours, (int, float)) \
                or not math.isfinite(self.mtbf_hours) or self.mtbf_hours <= 0:
            raise ConfigError(f"failures: --mtbf-hours must be a positive number, got {self.mtbf_hours!r}")
        if not isinstance(self.restart_s, (int, float)) or not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise ConfigError(f"failures: the restart time (--restart-minutes) must be a finite number >= 0, got "
                              f"{self.restart_s!r} s")


@dataclass(frozen=True)
class Interval:
    young_s: float
    daly_s: float
    seconds: float
    bound: str


@dataclass(frozen=True)
class TierPlan:
    """One tier: times of the busiest node, storage under retention, interval and lost time."""

    write_s: float
    durable_s: float
    restore_s: float
    storage_per_node: float | None
    peak_per_node: float | None
    storage_total: float
    interval: Interval
    lost: LostTime


@dataclass(frozen=True)
class Plan:
    """The result of :func:`make_plan`."""

    inputs: PlanInputs
    split: CheckpointSplit
    staging_s: float
    staging_bound: str
    tiers: dict[str, TierPlan]
    warnings: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` document (schema in the module docstring)."""
        i, s, layout, b = self.inputs, self.split, self.inputs.layout, self.inputs.bandwidths
        return {
            "schema": SCHEMA,
            "inputs": {
                "parameters": i.parameters.total, "expert_parameters": i.parameters.expert,
                "parameters_from": i.parameters_from,
                "bytes_per_parameter": {**i.state.as_dict(), "total": i.state.total},
                "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
                           "zero_stage": layout.zero_stage, "gpus_per_node": layout.gpus_per_node,
                           "world_size": layout.world_size, "nodes": layout.nodes},
                "dedup": i.dedup,
                "bandwidths_gb_per_s": {name: getattr(b, name) for name in DEFAULT_GBPS},
                "bandwidth_sources": {name: b.sources.get(name, "default") for name in DEFAULT_GBPS},
                "retention": {"keep_local": i.retention.keep_local, "keep_peer": i.retention.keep_peer,
                              "keep_remote": i.retention.keep_remote},
                "failures": {"mtbf_hours": i.mtbf_hours, "mtbf_from": i.mtbf_from,
                             "per_gpu_failures_per_hour": i.per_gpu_failures_per_hour, "restart_s": i.restart_s},
            },
            "checkpoint": {"unique_bytes": s.unique.as_dict(), "held_bytes_all_ranks": s.held_all_ranks.as_dict(),
                           "replication_factor": s.held_all_ranks.total / s.unique.total},
            "rank": {"busiest": s.busiest_rank, "held_bytes": s.rank_held.as_dict(),
                     "written_bytes": s.rank_written.as_dict(), "mean_written_bytes": whole_bytes(s.mean_rank_written)},
            "node": {"busiest": s.busiest_node, "held_bytes": s.node_held.as_dict(),
                     "written_bytes": s.node_written.as_dict()},
            "stages": [{"stage": stage.stage, "parameters": stage.parameters,
                        "expert_parameters": stage.expert_parameters,
                        "rank_held_bytes": stage.rank_held.as_dict()["total"],
                        "rank_written_bytes": stage.rank_written.as_dict()["total"]} for stage in s.stages],
            "staging": {"seconds": self.staging_s, "bound": self.staging_bound},
            "tiers": {name: {
                "write_seconds": tier.write_s, "durable_seconds": tier.durable_s, "restore_seconds": tier.restore_s,
                "storage_bytes_per_node": _bytes(tier.storage_per_node),
                "peak_bytes_per_node": _bytes(tier.peak_per_node),
                "storage_bytes_total": _bytes(tier.storage_total),
                "interval": {"young_seconds": tier.interval.young_s, "daly_seconds": tier.interval.daly_s,
                             "seconds": tier.interval.seconds, "formula": "daly", "bound": tier.interval.bound},
                "lost_fraction": tier.lost.as_dict()} for name, tier in self.tiers.items()},
            "warnings": list(self.warnings),
        }


def _bytes(value: float | None) -> int | None:
    return None if value is None else whole_bytes(value)


def make_plan(inputs: PlanInputs) -> Plan:
    """The plan of checkpointing ``inputs``' job (see the module docstring for the model)."""
    layout, b, keep = inputs.layout, inputs.bandwidths, inputs.retention
    split = split_checkpoint(inputs.parameters.stages(layout.pp), inputs.state, layout, dedup=inputs.dedup)
    rank_written, node_written = split.rank_written.total, split.node_written.total
    node_held = split.node_held.total
    d2h_s, host_s = rank_written / (b.d2h * _GB), node_written / (b.host_memcpy * _GB)
    staging_s = max(d2h_s, host_s)
    staging_bound = "device-to-host" if d2h_s >= host_s else "host-memory"
    job_written = split.unique.total if inputs.dedup else split.held_all_ranks.total
    disk, peer = b.disk * _GB, min(b.peer, b.disk) * _GB
    local_write = node_written / disk
    object_write = node_written / (b.object * _GB)
    object_restore = node_held / (b.object * _GB)
    if b.object_job is not None:
        object_write = max(object_write, job_written / (b.object_job * _GB))
        object_restore = max(object_restore, split.held_all_ranks.total / (b.object_job * _GB))
    local_durable = staging_s + local_write
    figures = {
        # tier: (write, durable, restore, kept steps per node, total)
        "local": (local_write, local_durable, max(node_written / disk, (node_held - node_written) / (b.peer * _GB)),
                  keep.keep_local, keep.keep_local * job_written),
        "peer": (node_written / peer, local_durable + node_written / peer, node_held / peer, keep.keep_peer,
                 keep.keep_peer * job_written),
        "object": (object_write, local_durable + object_write, object_restore, None,
                   keep.keep_remote * split.unique.total),
    }
    mtbf_s = inputs.mtbf_hours * 3600.0
    tiers: dict[str, TierPlan] = {}
    warnings: list[str] = []
    for name, (write_s, durable_s, restore_s, kept, total) in figures.items():
        young, daly = young_interval_s(staging_s, mtbf_s), daly_interval_s(staging_s, mtbf_s)
        absorbed = max(local_write, write_s) - staging_s
        interval, bound = (daly, "daly") if daly >= absorbed else (absorbed, "tier")
        lost = lost_fraction(interval_s=interval, stall_s=staging_s, durable_lag_s=durable_s - staging_s,
                             restart_s=inputs.restart_s + restore_s, mtbf_s=mtbf_s)
        per_node = node_written * kept if kept is not None else None
        peak = node_written * (kept + 1) if kept is not None else None
        tiers[name] = TierPlan(write_s=write_s, durable_s=durable_s, restore_s=restore_s, storage_per_node=per_node,
                               peak_per_node=peak, storage_total=total,
                               interval=Interval(young_s=young, daly_s=daly, seconds=interval, bound=bound),
                               lost=lost)
        if durable_s >= mtbf_s:
            warnings.append(f"a checkpoint takes {durable_s:.0f} s to reach the {name} tier, longer than the job's "
                            f"MTBF ({mtbf_s:.0f} s): failures will mostly find no restorable step there")
        if lost.total >= 0.5:
            warnings.append(f"restoring from the {name} tier the job loses {lost.total:.0%} of its time: add "
                            "bandwidth, shard more (ZeRO, dedup) or reduce the failure rate")
    if inputs.parameters.layers == 0 and layout.pp > 1:
        warnings.append("--params spreads the parameters evenly over pipeline stages; give --config to place the "
                        "embeddings and LM head on the first and last stage")
    if layout.ep > 1 and not inputs.parameters.expert:
        warnings.append(f"--ep {layout.ep} splits no expert parameters: give --expert-params or a mixture-of-experts "
                        "--config")
    if not inputs.dedup and layout.dp > 1:
        warnings.append(f"without dedup every data-parallel replica writes its copy: "
                        f"{split.held_all_ranks.total / split.unique.total:.2f}x the unique bytes")
    return Plan(inputs=inputs, split=split, staging_s=staging_s, staging_bound=staging_bound, tiers=tiers,
                warnings=tuple(warnings))
