"""``ckptd plan``'s arithmetic: from a model, a state recipe, a layout, bandwidths, retention, a failure rate and
optionally the run's length to the bytes, times, storage, intervals and lost time of checkpointing that job.

:func:`make_plan` takes a :class:`PlanInputs` and returns a :class:`Plan`; :meth:`Plan.as_json` is the
``--json`` document; docs/plan.md explains the model and checks it against published figures. Every figure is
for the busiest rank and the busiest node (the one that writes the most), so the slowest writer sets the
times. What ranks and nodes write follows the replica mode, by default the one ``CheckpointManager`` picks
for the directory layout (:mod:`~ckptd.planning.layout`). The model of each tier (per node, bandwidths in
GB/s = 1e9 bytes/s):

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
reads what the node's ranks need: from the local tier (or the buddy's copy of it) what their own directory
holds, and, with replicas written ``once`` job-wide into per-node or per-rank directories, the pieces other
nodes wrote from the object tier (no tier serves another node's local directory); such a step is restorable
from the local tier only once the object tier has it (``restorable_seconds``). From the object tier the node
reads all its ranks hold.

The interval per tier is Daly's higher-order optimum for the staging stall as the checkpoint cost (ckptd saves
asynchronously; Young's ``sqrt(2 C M)`` is reported next to it), raised to what the tier can absorb (a save
finishes on a tier before the next reaches it). The lost fraction adds the stall's overhead, the expected
recomputation (half a segment plus the time until the step is restorable from the tier) and the restart
(``restart_s`` plus the restore from that tier), per failure; goodput is one minus it. ``sync`` is the same
tier written synchronously (``dcp.save``): the cost is the tier's durable time. With a run length
(:mod:`~ckptd.planning.run`), each gives the saves, bytes written, wall time, expected failures and hours
lost over the run. The job-wide upload rate the plan assumes (nodes x object, capped by object_job) is checked
against ``object_store_limit_gb_per_s``. Not modelled: compute slowed by background writes, compression, and
steps that share unchanged chunks.

JSON schema 2 (``Plan.as_json``; keys are stable, new keys may be added, removals bump ``schema``; 2
renamed schema 1's ``bandwidths_gbps``, whose values were GB/s and not the gigabits "Gbps" suggests)::

    schema: 2
    inputs: {parameters, expert_parameters, parameters_from,
             bytes_per_parameter: {weights, grads, master, moments, total}, state_preset,
             presets: {NAME: {bytes_per_parameter, note}},
             layout: {tp, pp, dp, ep, zero_stage, gpus_per_node, world_size, nodes},
             dedup, replicas: "once" | "once-per-directory" | "every-rank", replicas_from: "default" | "given",
             directories: "per-node" | "per-rank" | "job-shared",
             bandwidths_gb_per_s: {d2h, host_memcpy, disk, peer, object, object_job},
             bandwidth_sources: {same keys: "default" | "given" | "measured"}, object_store_limit_gb_per_s,
             retention: {keep_local, keep_peer, keep_remote},
             failures: {mtbf_hours, mtbf_from, per_gpu_failures_per_hour, restart_s}}
    run: null | {from: "tokens" | "days", tokens, flops_per_gpu, compute_seconds, compute_days,
                 failures_in_compute_time}
    checkpoint: {unique_bytes: {weights, grads, master, moments, total},
                 held_bytes_all_ranks: {...same...}, replication_factor, written_bytes_all_nodes}
    rank: {busiest, held_bytes: {...}, written_bytes: {...}, mean_written_bytes}
    node: {busiest, held_bytes: {...}, written_bytes: {...}, distinct_held_bytes: {...},
           restore_own_directory_bytes, restore_elsewhere_bytes}
    stages: [{stage, parameters, expert_parameters, rank_held_bytes, rank_written_bytes}]
    staging: {seconds, bound: "device-to-host" | "host-memory"}
    object_store: {assumed_job_gb_per_s, limit_gb_per_s, beyond_limit}
    tiers: {local|peer|object: {write_seconds, durable_seconds, restore_seconds, restore_from,
             restorable_seconds, storage_bytes_per_node, peak_bytes_per_node, storage_bytes_total, bytes_per_save,
             interval: {young_seconds, daly_seconds, seconds, formula: "daly", bound: "daly" | "tier"},
             lost_fraction: {overhead, recompute, restart, total}, goodput,
             run: null | {saves, bytes_written, wall_days, expected_failures, lost_hours},
             sync: {stall_seconds, interval: {...}, lost_fraction: {...}, goodput, run: null | {...}}}}
    warnings: [str]

Byte counts are integers; times are seconds; the object tier's per-node storage is null (it is shared);
``object_job`` is null without a job-wide limit; ``mtbf_from`` is ``"given"`` or ``"failures"``; ``per_gpu_failures_per_hour`` is null for a given MTBF; ``state_preset`` is
null when no preset was named; a run's ``wall_days``, ``expected_failures`` and ``lost_hours`` are null when
the job would lose all its time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import ConfigError
from ckptd.planning.failures import LostTime, daly_interval_s, lost_fraction, young_interval_s
from ckptd.planning.layout import (PRESET_NOTES, PRESETS, CheckpointSplit, Layout, StateBytes, default_replicas,
                                   split_checkpoint, whole_bytes)
from ckptd.planning.model import ParameterCount
from ckptd.planning.run import RunLength, RunTotals, run_totals

SCHEMA = 2
_GB = 1e9
#: Bandwidths used when neither given nor measured, GB/s (see docs/plan.md): one PCIe Gen4 x16
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
    """Everything ``ckptd plan`` computes from. ``replicas`` None: what ``CheckpointManager`` would choose for
    ``directories`` (:func:`~ckptd.planning.layout.default_replicas`); ``object_store_limit_gbps`` None: the
    ``plan_object_store_limit_gb_per_s`` setting."""

    parameters: ParameterCount
    parameters_from: str
    state: StateBytes
    layout: Layout
    mtbf_hours: float
    mtbf_from: str = "given"
    per_gpu_failures_per_hour: float | None = None
    restart_s: float = 600.0
    replicas: str | None = None
    directories: str = "per-node"
    state_preset: str | None = None
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    retention: Retention = field(default_factory=Retention)
    run: RunLength | None = None
    object_store_limit_gbps: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mtbf_hours, bool) or not isinstance(self.mtbf_hours, (int, float)) \
                or not math.isfinite(self.mtbf_hours) or self.mtbf_hours <= 0:
            raise ConfigError(f"failures: --mtbf-hours must be a positive number, got {self.mtbf_hours!r}")
        if not isinstance(self.restart_s, (int, float)) or not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise ConfigError(f"failures: the restart time (--restart-minutes) must be a finite number >= 0, got "
                              f"{self.restart_s!r} s")
        limit = self.object_store_limit_gbps
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not math.isfinite(limit) or limit <= 0):
            raise ConfigError(f"bandwidth: --object-store-limit-gb-per-s must be a positive number of GB/s, got "
                              f"{limit!r}")


@dataclass(frozen=True)
class Interval:
    young_s: float
    daly_s: float
    seconds: float
    bound: str


@dataclass(frozen=True)
class SyncPlan:
    """The same tier written synchronously (as ``dcp.save`` does): training waits until the step is durable
    there, so that wait is the checkpoint cost."""

    stall_s: float
    interval: Interval
    lost: LostTime
    run: RunTotals | None


@dataclass(frozen=True)
class TierPlan:
    """One tier: times of the busiest node, storage under retention, interval and lost time (asynchronous
    saves, ckptd's), the same for synchronous saves, and totals over the run."""

    write_s: float
    durable_s: float
    restore_s: float
    restore_from: str
    restorable_s: float
    storage_per_node: float | None
    peak_per_node: float | None
    storage_total: float
    bytes_per_save: float
    interval: Interval
    lost: LostTime
    run: RunTotals | None
    sync: SyncPlan


@dataclass(frozen=True)
class ObjectStoreLoad:
    """The job-wide upload rate into the object store the plan assumes, and the limit it is checked against."""

    assumed_gbps: float
    limit_gbps: float

    @property
    def beyond_limit(self) -> bool:
        return self.assumed_gbps > self.limit_gbps


@dataclass(frozen=True)
class Plan:
    """The result of :func:`make_plan`."""

    inputs: PlanInputs
    replicas: str
    split: CheckpointSplit
    staging_s: float
    staging_bound: str
    tiers: dict[str, TierPlan]
    object_store: ObjectStoreLoad
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
                "state_preset": i.state_preset,
                "presets": {name: {"bytes_per_parameter": state.total, "note": PRESET_NOTES[name]}
                            for name, state in PRESETS.items()},
                "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
                           "zero_stage": layout.zero_stage, "gpus_per_node": layout.gpus_per_node,
                           "world_size": layout.world_size, "nodes": layout.nodes},
                "dedup": self.replicas != "every-rank",
                "replicas": self.replicas, "replicas_from": "default" if i.replicas is None else "given",
                "directories": i.directories,
                "bandwidths_gb_per_s": {name: getattr(b, name) for name in DEFAULT_GBPS},
                "bandwidth_sources": {name: b.sources.get(name, "default") for name in DEFAULT_GBPS},
                "object_store_limit_gb_per_s": self.object_store.limit_gbps,
                "retention": {"keep_local": i.retention.keep_local, "keep_peer": i.retention.keep_peer,
                              "keep_remote": i.retention.keep_remote},
                "failures": {"mtbf_hours": i.mtbf_hours, "mtbf_from": i.mtbf_from,
                             "per_gpu_failures_per_hour": i.per_gpu_failures_per_hour, "restart_s": i.restart_s},
            },
            "run": None if i.run is None else {
                "from": i.run.source, "tokens": i.run.tokens, "flops_per_gpu": i.run.flops_per_gpu,
                "compute_seconds": i.run.compute_s, "compute_days": i.run.compute_days,
                "failures_in_compute_time": i.run.compute_s / (i.mtbf_hours * 3600.0)},
            "checkpoint": {"unique_bytes": s.unique.as_dict(), "held_bytes_all_ranks": s.held_all_ranks.as_dict(),
                           "replication_factor": s.held_all_ranks.total / s.unique.total,
                           "written_bytes_all_nodes": whole_bytes(s.job_written)},
            "rank": {"busiest": s.busiest_rank, "held_bytes": s.rank_held.as_dict(),
                     "written_bytes": s.rank_written.as_dict(), "mean_written_bytes": whole_bytes(s.mean_rank_written)},
            "node": {"busiest": s.busiest_node, "held_bytes": s.node_held.as_dict(),
                     "written_bytes": s.node_written.as_dict(), "distinct_held_bytes": s.busiest.needed.as_dict(),
                     "restore_own_directory_bytes": whole_bytes(s.busiest.local_read),
                     "restore_elsewhere_bytes": whole_bytes(s.busiest.remote_read)},
            "stages": [{"stage": stage.stage, "parameters": stage.parameters,
                        "expert_parameters": stage.expert_parameters,
                        "rank_held_bytes": stage.rank_held.as_dict()["total"],
                        "rank_written_bytes": stage.rank_written.as_dict()["total"]} for stage in s.stages],
            "staging": {"seconds": self.staging_s, "bound": self.staging_bound},
            "object_store": {"assumed_job_gb_per_s": self.object_store.assumed_gbps,
                             "limit_gb_per_s": self.object_store.limit_gbps,
                             "beyond_limit": self.object_store.beyond_limit},
            "tiers": {name: _tier_json(tier) for name, tier in self.tiers.items()},
            "warnings": list(self.warnings),
        }


def _interval_json(interval: Interval) -> dict[str, Any]:
    return {"young_seconds": interval.young_s, "daly_seconds": interval.daly_s, "seconds": interval.seconds,
            "formula": "daly", "bound": interval.bound}


def _tier_json(tier: TierPlan) -> dict[str, Any]:
    return {
        "write_seconds": tier.write_s, "durable_seconds": tier.durable_s, "restore_seconds": tier.restore_s,
        "restore_from": tier.restore_from, "restorable_seconds": tier.restorable_s,
        "storage_bytes_per_node": _bytes(tier.storage_per_node),
        "peak_bytes_per_node": _bytes(tier.peak_per_node),
        "storage_bytes_total": _bytes(tier.storage_total),
        "bytes_per_save": _bytes(tier.bytes_per_save),
        "interval": _interval_json(tier.interval),
        "lost_fraction": tier.lost.as_dict(), "goodput": 1.0 - tier.lost.total,
        "run": None if tier.run is None else tier.run.as_dict(),
        "sync": {"stall_seconds": tier.sync.stall_s, "interval": _interval_json(tier.sync.interval),
                 "lost_fraction": tier.sync.lost.as_dict(), "goodput": 1.0 - tier.sync.lost.total,
                 "run": None if tier.sync.run is None else tier.sync.run.as_dict()},
    }


def _bytes(value: float | None) -> int | None:
    return None if value is None else whole_bytes(value)


def _object_store_limit(given: float | None) -> float:
    if given is not None:
        return float(given)
    from ckptd.config import settings

    return settings().plan_object_store_limit_gb_per_s


def make_plan(inputs: PlanInputs) -> Plan:
    """The plan of checkpointing ``inputs``' job (see the module docstring for the model)."""
    layout, b, keep = inputs.layout, inputs.bandwidths, inputs.retention
    replicas = inputs.replicas if inputs.replicas is not None else default_replicas(layout, inputs.directories)
    split = split_checkpoint(inputs.parameters.stages(layout.pp), inputs.state, layout, replicas=replicas,
                             directories=inputs.directories)
    node = split.busiest
    rank_written, node_written = split.rank_written.total, node.written.total
    node_held = node.held.total
    d2h_s, host_s = rank_written / (b.d2h * _GB), node_written / (b.host_memcpy * _GB)
    staging_s = max(d2h_s, host_s)
    staging_bound = "device-to-host" if d2h_s >= host_s else "host-memory"
    job_written = split.job_written
    disk, peer = b.disk * _GB, min(b.peer, b.disk) * _GB
    object_rate = b.object * _GB
    local_write = node_written / disk
    object_write = node_written / object_rate
    object_restore = node_held / object_rate
    elsewhere = node.remote_read / object_rate
    if b.object_job is not None:
        job_rate = b.object_job * _GB
        object_write = max(object_write, job_written / job_rate)
        object_restore = max(object_restore, split.held_all_ranks.total / job_rate)
        elsewhere = max(elsewhere, node.remote_read * layout.nodes / job_rate)
    local_durable = staging_s + local_write
    object_durable = local_durable + object_write
    needs_object = node.remote_read > 0
    own = "own directory" if inputs.directories != "job-shared" else "shared directory"
    figures = {
        # tier: (write, durable, restore, restored from, kept steps per node, total, bytes per save)
        "local": (local_write, local_durable, max(node.local_read / disk, elsewhere),
                  own + (" + object tier" if needs_object else ""), keep.keep_local, keep.keep_local * job_written,
                  job_written),
        "peer": (node_written / peer, local_durable + node_written / peer, max(node.local_read / peer, elsewhere),
                 "buddy node" + (" + object tier" if needs_object else ""), keep.keep_peer,
                 keep.keep_peer * job_written, job_written),
        "object": (object_write, object_durable, object_restore, "object tier", None,
                   keep.keep_remote * split.unique.total, split.unique.total),
    }
    mtbf_s = inputs.mtbf_hours * 3600.0
    tiers: dict[str, TierPlan] = {}
    warnings: list[str] = []
    for name, (write_s, durable_s, restore_s, restore_from, kept, total, per_save) in figures.items():
        restorable_s = max(durable_s, object_durable) if needs_object and name != "object" else durable_s
        young, daly = young_interval_s(staging_s, mtbf_s), daly_interval_s(staging_s, mtbf_s)
        absorbed = max(local_write, write_s) - staging_s
        interval, bound = (daly, "daly") if daly >= absorbed else (absorbed, "tier")
        restart = inputs.restart_s + restore_s
        lost = lost_fraction(interval_s=interval, stall_s=staging_s, durable_lag_s=restorable_s - staging_s,
                             restart_s=restart, mtbf_s=mtbf_s)
        sync_interval = daly_interval_s(durable_s, mtbf_s)
        sync_lost = lost_fraction(interval_s=sync_interval, stall_s=durable_s, durable_lag_s=restorable_s - durable_s,
                                  restart_s=restart, mtbf_s=mtbf_s)
        run = sync_run = None
        if inputs.run is not None:
            run = run_totals(inputs.run, interval_s=interval, lost_total=lost.total, mtbf_s=mtbf_s,
                             bytes_per_save=per_save)
            sync_run = run_totals(inputs.run, interval_s=sync_interval, lost_total=sync_lost.total, mtbf_s=mtbf_s,
                                  bytes_per_save=per_save)
        sync = SyncPlan(stall_s=durable_s, interval=Interval(young_s=young_interval_s(durable_s, mtbf_s),
                                                             daly_s=sync_interval, seconds=sync_interval, bound="daly"),
                        lost=sync_lost, run=sync_run)
        per_node = node_written * kept if kept is not None else None
        peak = node_written * (kept + 1) if kept is not None else None
        tiers[name] = TierPlan(write_s=write_s, durable_s=durable_s, restore_s=restore_s, restore_from=restore_from,
                               restorable_s=restorable_s, storage_per_node=per_node, peak_per_node=peak,
                               storage_total=total, bytes_per_save=per_save,
                               interval=Interval(young_s=young, daly_s=daly, seconds=interval, bound=bound),
                               lost=lost, run=run, sync=sync)
        if durable_s >= mtbf_s:
            warnings.append(f"a checkpoint takes {durable_s:.0f} s to reach the {name} tier, longer than the job's "
                            f"MTBF ({mtbf_s:.0f} s): failures will mostly find no restorable step there")
        if lost.total >= 0.5:
            warnings.append(f"restoring from the {name} tier the job loses {lost.total:.0%} of its time: add "
                            "bandwidth, shard more (ZeRO, dedup) or reduce the failure rate")
    if needs_object:
        warnings.append(f"with --replicas once and a local directory {inputs.directories.replace('-', ' ')}, a node's "
                        f"directory lacks {node.remote_read / _GB:.3g} GB of its ranks' state, read from the object "
                        "tier at restore: a step restores only once the object tier has it (the manager's default "
                        "here, once-per-directory, restores from each directory alone)")
    aggregate = layout.nodes * b.object if b.object_job is None else min(layout.nodes * b.object, b.object_job)
    load = ObjectStoreLoad(assumed_gbps=aggregate, limit_gbps=_object_store_limit(inputs.object_store_limit_gbps))
    if load.beyond_limit:
        warnings.append(f"the plan assumes {layout.nodes} node(s) x {b.object:g} GB/s = {aggregate:.4g} GB/s into the "
                        f"object store at once, beyond {load.limit_gbps:g} GB/s (--object-store-limit-gb-per-s): "
                        "give --object-job-gb-per-s with what the store sustains for the whole job")
    if inputs.parameters.layers == 0 and layout.pp > 1:
        warnings.append("--params spreads the parameters evenly over pipeline stages; give --config to place the "
                        "embeddings and LM head on the first and last stage")
    if layout.ep > 1 and not inputs.parameters.expert:
        warnings.append(f"--ep {layout.ep} splits no expert parameters: give --expert-params or a mixture-of-experts "
                        "--config")
    if inputs.run is not None and inputs.run.source == "tokens" and inputs.parameters.expert:
        warnings.append("6ND counts every parameter, but a mixture-of-experts model computes with its active ones: "
                        "give --run-days for its length")
    if replicas != "once" and job_written > split.unique.total * (1 + 1e-9):
        warnings.append(f"with --replicas {replicas} the nodes write {job_written / split.unique.total:.2f}x the "
                        "unique bytes to their local tiers")
    return Plan(inputs=inputs, replicas=replicas, split=split, staging_s=staging_s, staging_bound=staging_bound,
                tiers=tiers, object_store=load, warnings=tuple(warnings))
