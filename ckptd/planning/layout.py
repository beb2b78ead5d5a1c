"""What a checkpoint holds per parameter, how a 3D-parallel layout spreads it, and the bytes each rank and node
holds and writes.

A checkpoint holds, per parameter, the bytes of four components (:class:`StateBytes`): the model's weights,
its gradients, the optimizer's fp32 master copy and its moments. :data:`PRESETS` names what frameworks save
(:data:`PRESET_NOTES` says where each figure comes from); the default, ``fsdp2``, is 12 bytes: fp32
parameters (4) and Adam's two fp32 moments (4 + 4), no gradients (a checkpoint is taken after the optimizer
step, so the gradients are not part of it).

A :class:`Layout` places ``tp x pp x dp`` ranks (``ep`` carved out of ``dp`` for experts). Each pipeline
stage's parameters split evenly over its tensor-parallel ranks (the replicated norm weights are well below
0.1% and are ignored); experts also split over ``ep``. Every shard is held by its ``dp`` data-parallel
replicas (experts by ``dp / ep``) until ZeRO shards a component over them: stage 1 the master weights and
moments, stage 2 also the gradients, stage 3 also the weights (FSDP's full sharding is stage 3).

What a rank *writes* depends on the replica mode, named as ``CheckpointManager(write_replicas=...)`` names
it (:data:`REPLICA_MODES`), and on which ranks share a local directory (:data:`DIRECTORY_LAYOUTS`):

- ``once``: each piece held by several replicas is written by one of them in the whole job, spread evenly,
  so every rank of a stage writes the stage's bytes divided by its ``tp x dp`` ranks;
- ``once-per-directory``: by one of its holders in each local directory, so every directory holds its
  ranks' whole state: a directory writes the union of what its ranks hold, spread evenly over them;
- ``every-rank``: every rank writes all it holds.

:func:`default_replicas` is the manager's choice: ``once`` when the job has one local directory (one rank,
one node, or a directory shared by the job), else ``once-per-directory``. Ranks are numbered
tensor-parallel fastest, then data-parallel, then pipeline (Megatron's order; an expert-parallel group is
``ep`` consecutive data-parallel ranks), and filled onto nodes ``gpus_per_node`` at a time.

Pure arithmetic; no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ckptd.errors import ConfigError

#: The components of a checkpoint, in report order.
COMPONENTS = ("weights", "grads", "master", "moments")
#: The ``ckptd plan`` option that sets each component's bytes per parameter.
_FLAGS = {"weights": "--weight-bytes", "grads": "--grad-bytes", "master": "--master-bytes",
          "moments": "--moment-bytes"}


def _check_non_negative(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class StateBytes:
    """Bytes stored per parameter for each component; the defaults are the ``fsdp2`` preset (12 bytes)."""

    weights: float = 4.0
    grads: float = 0.0
    master: float = 0.0
    moments: float = 8.0

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_non_negative("bytes per parameter", _FLAGS[field.name], getattr(self, field.name))
        if self.total <= 0:
            raise ConfigError("bytes per parameter: every component is 0, so a checkpoint would hold nothing")

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.moments

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COMPONENTS}


#: Named bytes-per-parameter recipes (``ckptd plan --state``); the first is the default.
PRESETS: dict[str, StateBytes] = {
    "fsdp2": StateBytes(4, 0, 0, 8),
    "megatron": StateBytes(2, 0, 4, 8),
    "deepspeed": StateBytes(2, 0, 4, 8),
    "adam-mixed": StateBytes(2, 2, 4, 8),
    "adam-mixed-no-grads": StateBytes(2, 0, 4, 8),
    "adam-fp32": StateBytes(4, 4, 0, 8),
    "sgd-momentum-mixed": StateBytes(2, 2, 4, 4),
}
DEFAULT_PRESET = "fsdp2"
#: What each preset stands for (``ckptd plan --help`` and docs/plan.md).
PRESET_NOTES: dict[str, str] = {
    "fsdp2": "torch-native FSDP2 / torchtitan: fp32 parameters 4 + two fp32 Adam moments 8",
    "megatron": "Megatron-LM distributed optimizer: bf16 weights 2 + fp32 main parameters 4 + two moments 8",
    "deepspeed": "DeepSpeed ZeRO 1/2 (bf16): 16-bit module weights 2 + fp32 partition 4 + two moments 8",
    "adam-mixed": "bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + two moments 8 (gradients saved)",
    "adam-mixed-no-grads": "bf16 weights 2 + fp32 master 4 + two moments 8",
    "adam-fp32": "fp32 weights 4 + fp32 gradients 4 + two moments 8",
    "sgd-momentum-mixed": "bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + one momentum 4",
}

#: How replicated pieces are written (``CheckpointManager(write_replicas=...)``'s names).
REPLICA_MODES = ("once", "once-per-directory", "every-rank")
#: Which ranks share a local-tier directory: each node's ranks (one NVMe per node), each rank alone, or the
#: whole job (a parallel file system).
DIRECTORY_LAYOUTS = ("per-node", "per-rank", "job-shared")


#: The components each ZeRO stage shards over data parallelism.
ZERO_SHARDED: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"master", "moments"}),
    2: frozenset({"master", "moments", "grads"}),
    3: frozenset({"master", "moments", "grads", "weights"}),
}


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"layout: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """A 3D-parallel layout: ``tp x pp x dp`` ranks, ``ep`` expert-parallel ranks inside each data-parallel
    group, a ZeRO stage (0-3) and the GPUs of one node."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    zero_stage: int = 0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "gpus_per_node"):
            _check_positive_int(f"--{name.replace('_', '-')}", getattr(self, name))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_SHARDED:
            raise ConfigError(f"layout: unknown ZeRO stage {self.zero_stage!r}; --zero-stage is 0, 1, 2 or 3")
        if self.dp % self.ep:
            raise ConfigError(f"layout: --ep {self.ep} does not divide --dp {self.dp}; expert parallelism is "
                              "carved out of the data-parallel ranks")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise ConfigError(f"layout: the world size {self.world_size} (tp x pp x dp) is not a multiple of "
                              f"--gpus-per-node {self.gpus_per_node}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None,
                  **others: int) -> Layout:
        """The layout of ``world_size`` ranks: ``dp`` is what ``tp x pp`` leaves, or checked against it."""
        _check_positive_int("--world-size", world_size)
        _check_positive_int("--tp", tp)
        _check_positive_int("--pp", pp)
        if world_size % (tp * pp):
            raise ConfigError(f"layout: tp x pp = {tp * pp} does not divide the world size {world_size}, so no "
                              "data-parallel size fits")
        if dp is not None and dp * tp * pp != world_size:
            raise ConfigError(f"layout: tp x pp x dp = {tp * pp * dp} but the world size is {world_size}; give "
                              "one of --dp and --world-size, or make them agree")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), **others)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.world_size)


@dataclass(frozen=True)
class ComponentBytes:
    """Bytes of each checkpoint component."""

    weights: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    moments: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.moments

    def plus(self, other: ComponentBytes) -> ComponentBytes:
        return ComponentBytes(*(getattr(self, name) + getattr(other, name) for name in COMPONENTS))

    def times(self, factor: float) -> ComponentBytes:
        return ComponentBytes(*(getattr(self, name) * factor for name in COMPONENTS))

    def as_dict(self) -> dict[str, int]:
        """Whole bytes per component and their ``total`` (rounded up: a byte is never split)."""
        values = {name: whole_bytes(getattr(self, name)) for name in COMPONENTS}
        values["total"] = whole_bytes(self.total)
        return values


def whole_bytes(value: float) -> int:
    """``value`` bytes as an integer: the nearest one when float arithmetic left it a hair off (relative
    1e-9), else rounded up (a byte is never split)."""
    rounded = round(value)
    return int(rounded) if abs(value - rounded) <= 1e-9 * max(1.0, abs(value)) else math.ceil(value)


@dataclass(frozen=True)
class StageBytes:
    """One pipeline stage: its parameters, what each of its ranks holds, and what its busiest rank writes."""

    stage: int
    parameters: int
    expert_parameters: int
    rank_held: ComponentBytes
    rank_written: ComponentBytes


@dataclass(frozen=True)
class NodeBytes:
    """One node's ranks together: what they hold, the distinct pieces among that, what they write, and the bytes
    a restore from the local tier reads from their own directories and from elsewhere (the object tier)."""

    node: int
    held: ComponentBytes
    needed: ComponentBytes
    written: ComponentBytes
    local_read: float
    remote_read: float


@dataclass(frozen=True)
class CheckpointSplit:
    """A checkpoint over a layout: the unique bytes, each stage's ranks, the busiest rank and node."""

    unique: ComponentBytes
    held_all_ranks: ComponentBytes
    stages: tuple[StageBytes, ...]
    busiest_stage: int
    busiest: NodeBytes
    ranks_per_stage: int
    replicas: str
    directories: str
    #: What every node writes for one checkpoint, together (the local tier's bytes per checkpoint).
    job_written: float

    @property
    def busiest_node(self) -> int:
        return self.busiest.node

    @property
    def node_held(self) -> ComponentBytes:
        return self.busiest.held

    @property
    def node_written(self) -> ComponentBytes:
        return self.busiest.written

    @property
    def busiest_rank(self) -> int:
        """The first rank of the stage whose busiest rank writes the most."""
        return self.busiest_stage * self.ranks_per_stage

    @property
    def rank_held(self) -> ComponentBytes:
        """What a rank of the busiest stage holds."""
        return self.stages[self.busiest_stage].rank_held

    @property
    def rank_written(self) -> ComponentBytes:
        """What the busiest rank writes (and so stages)."""
        return self.stages[self.busiest_stage].rank_written

    @property
    def mean_rank_written(self) -> float:
        return self.job_written / (len(self.stages) * self.ranks_per_stage)


def default_replicas(layout: Layout, directories: str = "per-node") -> str:
    """The replica mode ``CheckpointManager`` picks when not told: ``once`` when the job's ranks share one
    local directory (a single rank, a single node's directory, a job-wide file system), else
    ``once-per-directory`` (so that every directory restores without the others' files)."""
    _check_choice("--directories", directories, DIRECTORY_LAYOUTS)
    if layout.world_size == 1 or directories == "job-shared" or (directories == "per-node" and layout.nodes == 1):
        return "once"
    return "once-per-directory"


def _check_choice(option: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"layout: {option} {value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class _StageShares:
    """One stage: the parameters a rank's tensor-parallel (and expert-parallel) share holds, the stage's unique
    bytes and what each of its ranks holds."""

    dense_share: float
    expert_share: float
    unique: ComponentBytes
    held: ComponentBytes


def split_checkpoint(stage_parameters: list[tuple[int, int]], state: StateBytes, layout: Layout, *,
                     replicas: str = "once", directories: str = "per-node") -> CheckpointSplit:
    """The bytes of one checkpoint of a model whose pipeline stages hold ``stage_parameters`` ((dense,
    expert) each, one per stage of ``layout``), stored as ``state`` per parameter, over ``layout``, written
    in the ``replicas`` mode with local directories laid out as ``directories`` (see the module docstring)."""
    _check_choice("--replicas", replicas, REPLICA_MODES)
    _check_choice("--directories", directories, DIRECTORY_LAYOUTS)
    if len(stage_parameters) != layout.pp:
        raise ConfigError(f"layout: {len(stage_parameters)} pipeline stages of parameters for --pp {layout.pp}")
    sharded = ZERO_SHARDED[layout.zero_stage]
    per_parameter = state.as_dict()
    shares: list[_StageShares] = []
    unique = ComponentBytes()
    for dense, expert in stage_parameters:
        dense_share = dense / layout.tp
        expert_share = expert / (layout.tp * layout.ep)
        expert_replicas = layout.dp // layout.ep
        held = ComponentBytes(*(
            per_parameter[name] * (dense_share / (layout.dp if name in sharded else 1)
                                   + expert_share / (expert_replicas if name in sharded else 1))
            for name in COMPONENTS))
        stage_unique = ComponentBytes(*(per_parameter[name] * (dense + expert) for name in COMPONENTS))
        shares.append(_StageShares(dense_share, expert_share, stage_unique, held))
        unique = unique.plus(stage_unique)
    ranks_per_stage = layout.tp * layout.dp
    held_all = ComponentBytes()
    for share in shares:
        held_all = held_all.plus(share.held.times(ranks_per_stage))
    busiest_rank_written = [ComponentBytes() for _ in shares]
    nodes: list[NodeBytes] = []
    for node in range(layout.nodes):
        figures, rank_written = _node_bytes(node, shares, layout, per_parameter, sharded, replicas, directories)
        nodes.append(figures)
        for stage, written in rank_written.items():
            if written.total > busiest_rank_written[stage].total:
                busiest_rank_written[stage] = written
    stages = tuple(StageBytes(index, dense + expert, expert, share.held, busiest_rank_written[index])
                   for index, ((dense, expert), share) in enumerate(zip(stage_parameters, shares)))
    busiest_stage = max(range(len(stages)), key=lambda s: (stages[s].rank_written.total, -s))
    busiest = max(nodes, key=lambda entry: (entry.written.total, -entry.node))
    return CheckpointSplit(unique=unique, held_all_ranks=held_all, stages=stages, busiest_stage=busiest_stage,
                           busiest=busiest, ranks_per_stage=ranks_per_stage, replicas=replicas,
                           directories=directories, job_written=sum(entry.written.total for entry in nodes))


def _distinct(share: _StageShares, ranks: int, layout: Layout, per_parameter: dict[str, float],
              sharded: frozenset[str]) -> ComponentBytes:
    """The distinct bytes among ``ranks`` consecutive ranks of one stage: a sharded component's pieces are
    all different, a replicated one repeats every ``tp`` ranks (experts every ``tp x ep``)."""
    dense_copies = min(layout.tp, ranks)
    expert_copies = min(layout.tp * layout.ep, ranks)
    expert_replicas = layout.dp // layout.ep
    return ComponentBytes(*(
        per_parameter[name] * ((ranks * share.dense_share / layout.dp) if name in sharded
                               else dense_copies * share.dense_share)
        + per_parameter[name] * ((ranks * share.expert_share / expert_replicas) if name in sharded
                                 else expert_copies * share.expert_share)
        for name in COMPONENTS))


def _node_bytes(node: int, shares: list[_StageShares], layout: Layout, per_parameter: dict[str, float],
                sharded: frozenset[str], replicas: str,
                directories: str) -> tuple[NodeBytes, dict[int, ComponentBytes]]:
    """One node's :class:`NodeBytes` and what one of its ranks writes, per stage it has ranks of."""
    ranks_per_stage = layout.tp * layout.dp
    first, last = node * layout.ranks_per_node, (node + 1) * layout.ranks_per_node
    held, needed, written = ComponentBytes(), ComponentBytes(), ComponentBytes()
    remote = 0.0
    per_rank: dict[int, ComponentBytes] = {}
    for stage in range(first // ranks_per_stage, (last - 1) // ranks_per_stage + 1):
        share = shares[stage]
        low, high = stage * ranks_per_stage, (stage + 1) * ranks_per_stage
        count = min(last, high) - max(first, low)
        stage_held = share.held.times(count)
        stage_needed = _distinct(share, count, layout, per_parameter, sharded)
        spread = share.unique.times(1.0 / ranks_per_stage)
        if replicas == "every-rank" or (replicas == "once-per-directory" and directories == "per-rank"):
            rank = share.held
        elif replicas == "once-per-directory" and directories == "per-node":
            rank = stage_needed.times(1.0 / count)
        else:  # once, or once per a directory the whole job shares
            rank = spread
        per_rank[stage] = rank
        stage_written = rank.times(count)
        held, needed, written = held.plus(stage_held), needed.plus(stage_needed), written.plus(stage_written)
        if directories == "per-rank":
            remote += max(0.0, stage_held.total - stage_written.total)
        elif directories == "per-node":
            remote += max(0.0, stage_needed.total - stage_written.total)
    local_read = needed.total if directories == "job-shared" else written.total
    return NodeBytes(node, held, needed, written, local_read, remote), per_rank
