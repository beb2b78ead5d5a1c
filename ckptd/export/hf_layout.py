"""The Hugging Face file layout of a model's weights: shards by size and the index that maps keys to them.

A model that fits in one shard is one ``model.safetensors``; a larger one is split, in key order, into
``model-00001-of-0000N.safetensors`` files of at most the maximum shard size each (a tensor larger than
that gets a file of its own) plus ``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {"<key>": "<file name>", ...}}

which is what ``transformers``' ``from_pretrained`` and other safetensors readers expect. Sizes follow
Hugging Face's convention: ``5GB`` is 5 * 10**9 bytes, ``5GiB`` 5 * 2**30; ``5Gb``, which Hugging Face
reads as gigabits, is refused rather than read another way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckptd.errors import ConfigError
from ckptd.export.safetensors_file import TensorSlot, aligned_order

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
#: The maximum shard size when none is given (Hugging Face's default).
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_shard_size(text: str | int) -> int:
    """Bytes of a size given as ``5GB``, ``500MB``, ``2GiB`` or a plain number of bytes."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.fullmatch(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{text!r} is not a size", hint="write it like 5GB, 500MB, 2GiB or a number of bytes")
        if match.group(2).endswith("b") and not match.group(2).lower().endswith("ib"):
            raise ConfigError(f"{text!r} ends in a lowercase b, which Hugging Face reads as bits (5Gb = 625MB)",
                              hint=f"write {match.group(1)}{match.group(2)[:-1].upper()}B for bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 1:
        raise ConfigError(f"the maximum shard size must be at least one byte, got {text!r}")
    return size


@dataclass(frozen=True)
class ShardFile:
    """One output file and the tensors it holds, in order."""

    name: str
    slots: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


def plan_shards(slots: Sequence[TensorSlot], max_shard_bytes: int) -> list[ShardFile]:
    """Split ``slots`` in order into files of at most ``max_shard_bytes`` tensor bytes each; each file's
    tensors in :func:`~ckptd.export.safetensors_file.aligned_order`."""
    groups: list[list[TensorSlot]] = [[]]
    size = 0
    for slot in slots:
        if groups[-1] and size + slot.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(slot)
        size += slot.nbytes
    if len(groups) == 1:
        return [ShardFile(SINGLE_FILE_NAME, tuple(aligned_order(groups[0])))]
    count = len(groups)
    return [ShardFile(f"model-{number:05d}-of-{count:05d}.safetensors", tuple(aligned_order(group)))
            for number, group in enumerate(groups, start=1)]


def index_bytes(shards: Sequence[ShardFile]) -> bytes:
    """The ``model.safetensors.index.json`` of a sharded layout (keys sorted, as Hugging Face writes it)."""
    weight_map = {slot.key: shard.name for shard in shards for slot in shard.slots}
    body = {"metadata": {"total_size": sum(shard.nbytes for shard in shards)},
            "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(body, indent=2) + "\n").encode()
