"""DCP's ``Metadata`` derived from ckptd's rank indexes, so that nothing DCP-specific is pickled.

Every rank index lists its tensors with dtype, shape and, for pieces of larger tensors, their fqn,
global shape and offsets (:mod:`ckptd.format.values`). :func:`derive_metadata` turns the indexes of
all ranks of a step into the ``Metadata`` DCP's load planners need (one ``TensorStorageMetadata`` per
fqn with every stored piece as a chunk, ``BytesStorageMetadata`` for non-tensor values) and a map from
each piece to where it is stored. A piece stored by several ranks (replicated state) is read from the
lowest rank. DCP's ``planner_data`` is kept as JSON in the manifest's ``extra`` (tuples as lists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptd.dcp import quantized as quantization
from ckptd.format.values import parse_values
from ckptd.errors import FormatError
from ckptd.format.layout import rank_index_name, step_file
from ckptd.format.records import RankIndex

#: Key of DCP's own data in the manifest's ``extra``.
MANIFEST_KEY = "dcp"


@dataclass(frozen=True)
class StoredPiece:
    """Where one piece of the checkpoint lives: the rank whose files hold it and its name there.

    ``kind`` is ``tensor``, ``quantized`` (its integers; parameters in the index's values), ``object``
    (a JSON value), ``bytesio`` (the bytes of an ``io.BytesIO``) or
    ``pickled`` (DCP's bytes, opt-in only). It is also the ``storage_data`` of each item in DCP's
    ``Metadata`` (keyed by ``MetadataIndex``), as ``FileSystemWriter`` keeps its file and offsets there.
    """

    rank: int
    name: str
    kind: str = "tensor"


#: Lookup key of a piece: (fqn, offsets) for tensors, (fqn, None) for non-tensor values.
PieceKey = tuple[str, "tuple[int, ...] | None"]


def derive_metadata(indexes: list[RankIndex], extra: dict[str, Any], *, checkpoint_id: str | None = None,
                    manifest_version: int | None = None) -> tuple[Metadata, dict[PieceKey, StoredPiece]]:
    """Build DCP ``Metadata`` and the piece locations from every rank's index (ordered by rank).

    The metadata's ``storage_data`` maps each item's ``MetadataIndex`` to its :class:`StoredPiece`; its
    ``storage_meta`` names ``checkpoint_id`` and the save id the writer recorded. ``manifest_version``: the
    step's manifest format, against which the indexes' value keys are checked."""
    state: dict[str, Any] = {}
    pieces: dict[PieceKey, StoredPiece] = {}
    for index in indexes:
        path = step_file(index.step, rank_index_name(index.rank))
        values = parse_values(index.values, path=path, step=index.step, manifest_version=manifest_version)
        for name, record in index.tensors.items():
            if name in values.pickled or name in values.buffers:
                kind = "pickled" if name in values.pickled else "bytesio"
                _add_bytes(state, pieces, name, StoredPiece(index.rank, name, kind), path)
                continue
            fqn, placement = values.placement(name, record.shape)
            key = (fqn, placement.offsets)
            if key in pieces:
                continue
            dtype, kind = record.torch_dtype, "tensor"
            if name in values.quantized:
                dtype, kind = quantization.parse(values.quantized[name], name=name, stored_dtype=record.dtype,
                                                 path=path, step=index.step).torch_dtype, "quantized"
            existing = state.setdefault(fqn, TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(placement.global_shape), chunks=[]))
            if not isinstance(existing, TensorStorageMetadata) or tuple(existing.size) != placement.global_shape \
                    or existing.properties.dtype != dtype:
                raise FormatError(f"pieces of {fqn!r} disagree on dtype or global shape", path=path,
                                  step=index.step)
            existing.chunks.append(ChunkStorageMetadata(offsets=torch.Size(placement.offsets),
                                                        sizes=torch.Size(record.shape)))
            pieces[key] = StoredPiece(index.rank, name, kind)
        for fqn in values.objects:
            _add_bytes(state, pieces, fqn, StoredPiece(index.rank, fqn, "object"), path)
    saved = extra.get(MANIFEST_KEY, {}) if isinstance(extra, dict) else {}
    save_id = saved.get("save_id") if isinstance(saved.get("save_id"), str) else None
    storage_data = {MetadataIndex(fqn, offsets): piece
                    for (fqn, offsets), piece in pieces.items()}
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data_from_json(saved.get("planner_data")),
                        storage_data=storage_data, storage_meta=StorageMeta(checkpoint_id=checkpoint_id,
                                                                            save_id=save_id),
                        version=saved.get("version") if isinstance(saved.get("version"), str) else None)
    return metadata, pieces


def _add_bytes(state: dict[str, Any], pieces: dict[PieceKey, StoredPiece], fqn: str, piece: StoredPiece,
               path: str) -> None:
    if (fqn, None) in pieces:
        return
    if isinstance(state.get(fqn), TensorStorageMetadata):
        raise FormatError(f"{fqn!r} is stored both as a tensor and as a value", path=path)
    state[fqn] = BytesStorageMetadata()
    pieces[(fqn, None)] = piece


def planner_data_to_json(planner_data: Any) -> Any:
    """DCP's planner data (fqn -> path tuple for the default planners) as JSON, or None if it is not
    made of strings, ints and tuples."""
    if not isinstance(planner_data, dict):
        return None
    result = {}
    for fqn, path in planner_data.items():
        if not isinstance(fqn, str) or not isinstance(path, (tuple, list)) \
                or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
            return None
        result[fqn] = list(path)
    return result


def planner_data_from_json(value: Any) -> Any:
    if not isinstance(value, dict):
        return None
    return {fqn: tuple(path) for fqn, path in value.items() if isinstance(path, list)}
