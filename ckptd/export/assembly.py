"""Reading an exported tensor whole: one stored piece, or every rank's piece copied into place.

Pieces are read through each rank's :class:`~ckptd.stepio.step_reader.StepReader`, so every chunk is
verified against its digest as it arrives (falling back chunk by chunk to the next tier that holds the
step). A piece whose place in the full tensor is contiguous (sharded along the first dimension, as
FSDP2 shards) is read straight into it; the pieces of one tensor are read in parallel.

:func:`check_pieces` checks, from the metadata alone and before anything is read or written, that a
sharded tensor's pieces lie inside it, do not overlap and cover it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd.errors import ConfigError, FormatError
from ckptd.export.selection import SavedTensor, TensorPiece
from ckptd.stepio.step_reader import StepReader, settle_all
from ckptd.tiers.direct_io import aligned_empty

if TYPE_CHECKING:
    import torch


def check_pieces(tensor: SavedTensor, *, step: int, consolidate: bool) -> None:
    """Refuse a sharded tensor without ``consolidate``, and pieces that do not tile the tensor."""
    if not tensor.sharded:
        return
    if not consolidate:
        raise ConfigError(f"tensor {tensor.key!r} is stored in {len(tensor.pieces)} pieces (sharded over ranks); "
                          "an export without --consolidate writes whole tensors only", step=step,
                          hint="pass --consolidate to assemble the full tensors")
    total = 1
    for dim in tensor.shape:
        total *= dim
    for piece in tensor.pieces:
        if len(piece.offsets) != len(tensor.shape) or any(
                offset + size > bound for offset, size, bound in zip(piece.offsets, piece.shape, tensor.shape)):
            raise FormatError(f"a piece of {tensor.key!r} (rank {piece.rank}, offsets {list(piece.offsets)}, "
                              f"shape {list(piece.shape)}) lies outside its shape {list(tensor.shape)}", step=step)
    pieces = [piece for piece in tensor.pieces if piece.numel]
    for position, first in enumerate(pieces):
        for second in pieces[position + 1:]:
            if _overlap(first, second):
                raise FormatError(f"pieces of {tensor.key!r} on ranks {first.rank} and {second.rank} overlap",
                                  step=step)
    if sum(piece.numel for piece in pieces) != total:
        raise FormatError(f"the pieces of {tensor.key!r} do not cover its shape {list(tensor.shape)}; a rank's "
                          "share is missing from this step", step=step)


def _overlap(first: TensorPiece, second: TensorPiece) -> bool:
    return all(a < b + n and b < a + m
               for a, m, b, n in zip(first.offsets, first.shape, second.offsets, second.shape))


def read_whole(tensor: SavedTensor, readers: list[StepReader]) -> torch.Tensor:
    """The full tensor, verified (pieces checked with :func:`check_pieces` first)."""
    if not tensor.sharded:
        piece = tensor.pieces[0]
        return readers[piece.rank].read_tensor(piece.name)
    full = aligned_empty(tensor.shape, tensor.dtype)
    involved = {piece.rank: readers[piece.rank] for piece in tensor.pieces}
    try:
        for piece in tensor.pieces:
            region = full
            for dim, (offset, size) in enumerate(zip(piece.offsets, piece.shape)):
                region = region.narrow(dim, offset, size)
            readers[piece.rank].read_tensor(piece.name, region, defer=True)
    except BaseException:
        settle_all(involved.values(), raise_errors=False)
        raise
    settle_all(involved.values())
    return full
