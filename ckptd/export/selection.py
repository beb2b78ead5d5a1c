"""Which tensors a step holds, under which key, stored in which pieces on which ranks.

Keys are dotted paths, as ``torch.distributed.checkpoint`` flattens a state: a CheckpointManager step
that saved ``{"model": model, "optim": optim}`` holds ``model.<parameter name>`` and ``optim.state.0.
exp_avg``; a step written by ``dcp.save`` holds the fqns DCP chose. A tensor that was sharded when
saved (a DTensor, or a DCP write item of part of a tensor) is a set of pieces, one per rank that held
a part, each with its offsets in the global tensor; a tensor every rank saved whole (replicated state)
is read from the lowest rank that wrote it (a rank may leave a replicated piece to another holder: its
state names the tensor, its index does not). ckptd's own RNG states are never exported.

Everything here reads only the rank indexes (metadata); no tensor bytes are read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.errors import ConfigError, FormatError, NotFoundError
from ckptd.format.layout import rank_index_name, step_file
from ckptd.format.records import RankIndex
from ckptd.format.values import parse_values
from ckptd.state.rng import RNG_KEY

if TYPE_CHECKING:
    import torch

#: How many offending keys an error names.
_KEYS_NAMED = 5


@dataclass(frozen=True)
class TensorPiece:
    """One stored piece of an exported tensor: which rank's index holds it under which name, and where
    it sits in the global tensor."""

    rank: int
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of the step by its key, with its stored dtype, global shape and pieces."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[TensorPiece, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor in its stored dtype."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def sharded(self) -> bool:
        """Whether the tensor is stored in more than one piece (not whole on any one rank)."""
        return len(self.pieces) != 1 or self.pieces[0].shape != self.shape


@dataclass(frozen=True)
class StepContents:
    """What a step holds: its tensors by key (in the order rank 0 saved them) and the keys of its
    non-tensor values (numbers, strings, arrays, pickled objects)."""

    step: int
    tensors: dict[str, SavedTensor]
    other_keys: tuple[str, ...]


def step_contents(indexes: list[RankIndex]) -> StepContents:
    """The tensors and non-tensor keys of a step, from the indexes of all its ranks (ordered by rank)."""
    step = indexes[0].step
    groups: dict[str, list[tuple[Any, TensorPiece]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    other: dict[str, None] = {}
    unlisted: dict[str, str] = {}
    for index in indexes:
        path = step_file(index.step, rank_index_name(index.rank))
        values = parse_values(index.values, path=path, step=index.step)
        if values.skeleton is not None:
            leaves = list(_skeleton_leaves(values.skeleton))
        else:  # written by dcp.save: tensors by fqn; values in "objects", pickled, bytes of an io.BytesIO, or
            # the integers of a quantized tensor (safetensors has no quantized dtypes): all refused by select
            not_tensors = values.pickled | values.buffers | set(values.quantized)
            leaves = [(name, name if name not in not_tensors else None) for name in index.tensors]
            leaves += [(fqn, None) for fqn in values.objects]
        here: dict[tuple[str, tuple[int, ...] | None], str | None] = {}
        for key, name in leaves:
            if name is None:
                _claim(here, (key, None), name, path)
                other[key] = None
                continue
            record = index.tensors.get(name)
            if record is None:  # a replicated piece this rank left to another holder, which wrote it
                unlisted.setdefault(key, path)
                continue
            fqn, placement = values.placement(name, record.shape)
            key = key if values.skeleton is not None else fqn
            _claim(here, (key, placement.offsets), name, path)
            piece = TensorPiece(index.rank, name, placement.offsets, record.shape)
            pieces = groups.setdefault(key, [])
            if any(known.offsets == piece.offsets for _, known in pieces):
                continue  # replicated: the lowest rank's copy is read
            if key in shapes and (shapes[key] != placement.global_shape or pieces[0][0] != record.torch_dtype):
                raise FormatError(f"the pieces of {key!r} disagree on dtype or global shape", path=path,
                                  step=index.step)
            shapes[key] = placement.global_shape
            pieces.append((record.torch_dtype, piece))
    for key, path in unlisted.items():
        if key not in groups:
            raise FormatError(f"the state refers to tensor {key!r}, which no rank's index lists", path=path,
                              step=step, hint="the step is incomplete; export another step or another tier")
    tensors = {key: SavedTensor(key, pieces[0][0], shapes[key], tuple(piece for _, piece in pieces))
               for key, pieces in groups.items()}
    clashes = [key for key in other if key in tensors]
    if clashes:
        raise ConfigError(f"{clashes[0]!r} names both a tensor and a non-tensor value of the state", step=step,
                          hint="keys are the state's paths joined with dots; rename one of the two entries")
    return StepContents(step, tensors, tuple(other))


def _claim(here: dict[tuple[str, tuple[int, ...] | None], str | None], spot: tuple[str, tuple[int, ...] | None],
           name: str | None, path: str) -> None:
    """Record that ``name`` (None: a non-tensor value) exports to ``spot`` (key, offsets) on one rank;
    ConfigError when another entry of that rank already does (``{"a.b": x, "a": {"b": y}}``)."""
    if spot in here and here[spot] != name:
        raise ConfigError(f"two entries of the state export to the key {spot[0]!r}", path=path,
                          hint="keys are the state's paths joined with dots; rename one of the two entries")
    here[spot] = name


def _skeleton_leaves(skeleton: Any) -> Iterator[tuple[str, str | None]]:
    """(dotted key, stored tensor name or None for a non-tensor value) of every leaf of a manager
    skeleton (:mod:`ckptd.state.tree`), ckptd's RNG states left out."""

    def walk(node: Any, parts: tuple[str, ...]) -> Iterator[tuple[str, str | None]]:
        if not isinstance(node, dict) or not node:
            raise FormatError(f"malformed state skeleton at {'.'.join(parts)!r}")
        kind = next(iter(node))
        if kind == "tensor":
            yield ".".join(parts), str(node["tensor"])
        elif kind == "dict":
            for key, child in node["dict"]:
                if parts or key != RNG_KEY:
                    yield from walk(child, (*parts, str(key)))
        elif kind in ("list", "tuple"):
            for position, child in enumerate(node[kind]):
                yield from walk(child, (*parts, str(position)))
        elif kind == "stateful":
            yield from walk(node["stateful"], parts)
        else:  # a JSON value, array, bytes, pickled object, ...
            yield ".".join(parts), None

    yield from walk(skeleton, ())


def select(contents: StepContents, key_prefix: str | None, exclude: tuple[str, ...] = ()) -> list[SavedTensor]:
    """The tensors under ``key_prefix`` (a sub-tree such as ``model`` or ``model.``) with the prefix
    stripped from their keys, leaving out the sub-trees named in ``exclude`` (full keys, e.g.
    ``optimizer``); every tensor when neither is given. Raises ConfigError when the selection holds a
    non-tensor value, NotFoundError when it holds no tensor at all."""
    prefix = _subtree(key_prefix) if key_prefix else ""
    dropped = tuple(_subtree(item) for item in exclude if item)

    def wanted(key: str) -> bool:
        return key.startswith(prefix) and not any(key.startswith(item) or f"{key}." == item for item in dropped)

    chosen = [SavedTensor(key[len(prefix):], tensor.dtype, tensor.shape, tensor.pieces)
              for key, tensor in contents.tensors.items() if wanted(key)]
    others = [key for key in contents.other_keys if wanted(key)]
    hint = ("pick the model's weights with --key-prefix, or leave sub-trees out with --exclude "
            f"(top-level keys: {_top_level(contents)})")
    if others:
        raise ConfigError(f"the exported keys hold {len(others)} non-tensor value(s), which safetensors cannot "
                          f"hold: {_named(others)}", step=contents.step, hint=hint)
    if not chosen:
        raise NotFoundError(f"no tensor of the step has a key under {prefix!r}" if prefix
                            else "the selection holds no tensors", step=contents.step, hint=hint)
    return chosen


def _subtree(prefix: str) -> str:
    return prefix if prefix.endswith(".") else f"{prefix}."


def _top_level(contents: StepContents) -> str:
    heads = dict.fromkeys(key.split(".", 1)[0] for key in [*contents.tensors, *contents.other_keys])
    return _named(list(heads))


def _named(keys: list[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:_KEYS_NAMED])
    return named + (f" and {len(keys) - _KEYS_NAMED} more" if len(keys) > _KEYS_NAMED else "")
