"""What a checkpoint holds per parameter, how a 3D-parallel layout spreads it, and the bytes each rank and node
holds and writes.

A checkpoint holds, per parameter, the bytes of four components (:class:`StateBytes`): the model's weights,
its gradients, the optimizer's fp32 master copy and its moments. The default (``adam-mixed``) is what the
issue counts, 16 bytes: bf16 weights (2) and gradients (2), fp32 master weights (4) and Adam's two fp32
moments (4 + 4). A checkpoint taken after the optimizer step does not need the gradients: ``grads=0`` gives
the 14-byte state that Megatron-style and FSDP checkpoints store.

A :class:`Layout` places ``tp x pp x dp`` ranks (``ep`` carved out of ``dp`` for experts). Each pipeline
stage's parameters split evenly over its tensor-parallel ranks (the replicated norm weights are well below
0.1% and are ignored); experts also split over ``ep``. Every shard is held by its ``dp`` data-parallel
replicas (experts by ``dp / ep``) until ZeRO shards a component over them: stage 1 the master weights and
moments, stage 2 also the gradients, stage 3 also the weights (FSDP's full sharding is stage 3).

What a rank *writes* depends on whether replicas are written once (``dedup``, ckptd's default since issue
16): then each piece held by several replicas is written by one of them, spread evenly, so every rank of a
stage writes the stage's bytes divided by its ``tp x dp`` ranks, whatever the ZeRO stage. Without it every
rank writes all it holds. Ranks are numbered tensor-parallel fastest, then data-parallel, then pipeline
(Megatron's order), and filled onto nodes ``gpus_per_node`` at a time.

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
    """Bytes stored per parameter for each component (see the module docstring)."""

    weights: float = 2.0
    grads: float = 2.0
    master: float = 4.0
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


#: Named bytes-per-parameter recipes (``ckptd plan --state``).
PRESETS: dict[str, StateBytes] = {
    "adam-mixed": StateBytes(2, 2, 4, 8),
    "adam-mixed-no-grads": StateBytes(2, 0, 4, 8),
    "adam-fp32": StateBytes(4, 4, 0, 8),
    "sgd-momentum-mixed": StateBytes(2, 2, 4, 4),
}


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

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of a global rank (tensor-parallel fastest, then data-parallel, then pipeline)."""
        return rank // (self.tp * self.dp)


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
    """One pipeline stage: its parameters and what each of its ranks holds and writes."""

    stage: int
    parameters: int
    expert_parameters: int
    rank_held: ComponentBytes
    rank_written: ComponentBytes


@dataclass(frozen=True)
class CheckpointSplit:
    """A checkpoint over a layout: the unique bytes, each stage's ranks, the busiest rank and node."""

    unique: ComponentBytes
    held_all_ranks: ComponentBytes
    stages: tuple[StageBytes, ...]
    busiest_stage: int
    busiest_node: int
    node_held: ComponentBytes
    node_written: ComponentBytes
    ranks_per_stage: int

    @property
    def busiest_rank(self) -> int:
        """The first rank of the stage whose ranks write the most (every rank of a stage writes alike)."""
        return self.busiest_stage * self.ranks_per_stage

    @property
    def rank_held(self) -> ComponentBytes:
        """What the busiest rank holds."""
        return self.stages[self.busiest_stage].rank_held

    @property
    def rank_written(self) -> ComponentBytes:
        """What the busiest rank writes (and so stages)."""
        return self.stages[self.busiest_stage].rank_written

    @property
    def mean_rank_written(self) -> float:
        return self.unique.total / (len(self.stages) * self.ranks_per_stage)


def split_checkpoint(stage_parameters: list[tuple[int, int]], state: StateBytes, layout: Layout, *,
                     dedup: bool = True) -> CheckpointSplit:
    """The bytes of one checkpoint of a model whose pipeline stages hold ``stage_parameters`` ((dense,
    expert) each, one per stage of ``layout``), stored as ``state`` per parameter, over ``layout``."""
    if len(stage_parameters) != layout.pp:
        raise ConfigError(f"layout: {len(stage_parameters)} pipeline stages of parameters for --pp {layout.pp}")
    sharded = ZERO_SHARDED[layout.zero_stage]
    per_parameter = state.as_dict()
    stages: list[StageBytes] = []
    unique = ComponentBytes()
    for index, (dense, expert) in enumerate(stage_parameters):
        dense_share = dense / layout.tp
        expert_share = expert / (layout.tp * layout.ep)
        expert_replicas = layout.dp // layout.ep
        held = ComponentBytes(*(
            per_parameter[name] * (dense_share / (layout.dp if name in sharded else 1)
                                   + expert_share / (expert_replicas if name in sharded else 1))
            for name in COMPONENTS))
        stage_unique = ComponentBytes(*(per_parameter[name] * (dense + expert) for name in COMPONENTS))
        written = stage_unique.times(1.0 / (layout.tp * layout.dp)) if dedup else held
        stages.append(StageBytes(index, dense + expert, expert, held, written))
        unique = unique.plus(stage_unique)
    ranks_per_stage = layout.tp * layout.dp
    held_all = ComponentBytes()
    for stage in stages:
        held_all = held_all.plus(stage.rank_held.times(ranks_per_stage))
    busiest_stage = max(range(len(stages)), key=lambda s: (stages[s].rank_written.total, -s))
    node_held, node_written, busiest_node = _busiest_node(stages, layout)
    return CheckpointSplit(unique=unique, held_all_ranks=held_all, stages=tuple(stages), busiest_stage=busiest_stage,
                           busiest_node=busiest_node, node_held=node_held, node_written=node_written,
                           ranks_per_stage=ranks_per_stage)


def _busiest_node(stages: list[StageBytes], layout: Layout) -> tuple[ComponentBytes, ComponentBytes, int]:
    """(held, written, node) of the node that writes the most (the first of equals)."""
    totals = [(*_node_bytes(stages, layout, node), node) for node in range(layout.nodes)]
    return max(totals, key=lambda entry: (entry[1].total, -entry[2]))


def _node_bytes(stages: list[StageBytes], layout: Layout, node: int) -> tuple[ComponentBytes, ComponentBytes]:
    """(held, written) of one node: the sum over its ranks, stage by stage."""
    ranks_per_stage = layout.tp * layout.dp
    first, last = node * layout.ranks_per_node, (node + 1) * layout.ranks_per_node
    held, written = ComponentBytes(), ComponentBytes()
    for stage in stages[first // ranks_per_stage:(last - 1) // ranks_per_stage + 1]:
        low, high = stage.stage * ranks_per_stage, (stage.stage + 1) * ranks_per_stage
        overlap = min(last, high) - max(first, low)
        held = held.plus(stage.rank_held.times(overlap))
        written = written.plus(stage.rank_written.times(overlap))
    return held, written
