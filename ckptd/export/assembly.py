"""Reading an exported tensor whole: one stored piece, or every rank's piece copied into place.

Pieces are read through each rank's :class:`~ckptd.stepio.step_reader.StepReader`, so every chunk is
verified against its digest as it arrives (falling back chunk by chunk to the next tier that holds the
step). A piece whose place in the full tensor is contiguous (sharded along the first dimension, as
FSDP2 shards) is read straight into it; the pieces of one tensor are read in parallel.
:class:`TensorFeed` reads the tensors of an export one after the other into two reusable buffers,
the next while the caller writes the current one.

:func:`check_pieces` checks, from the metadata alone and before anything is read or written, that a
sharded tensor's pieces lie inside it, do not overlap and cover it.
"""

from __future__ import annotations

import math
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
    if sum(piece.numel for piece in pieces) != math.prod(tensor.shape):
        raise FormatError(f"the pieces of {tensor.key!r} do not cover its shape {list(tensor.shape)}; a rank's "
                          "share is missing from this step", step=step)


def _overlap(first: TensorPiece, second: TensorPiece) -> bool:
    return all(a < b + n and b < a + m
               for a, m, b, n in zip(first.offsets, first.shape, second.offsets, second.shape))


def start_reading(tensor: SavedTensor, readers: list[StepReader], out: torch.Tensor) -> None:
    """Start reading the whole tensor into ``out`` (its shape and stored dtype, contiguous, on the CPU):
    each piece's chunks go to the read pool; :func:`~ckptd.stepio.step_reader.settle_all` over
    ``readers`` waits for them (and raises a failed one). Pieces checked with :func:`check_pieces` first."""
    for piece in tensor.pieces:
        region = out
        for dim, (offset, size) in enumerate(zip(piece.offsets, piece.shape)):
            region = region.narrow(dim, offset, size)
        readers[piece.rank].read_tensor(piece.name, region, defer=True)


class TensorFeed:
    """Hands out the tensors of an export whole and verified, in order, reading the next one while the
    caller writes the current one.

    Tensors are read into two reusable buffers, taken in turn, so that fresh memory is not faulted in
    for every tensor; :meth:`take` returns the tensor at ``position`` (0, 1, 2, ... in order) and starts
    reading the one after it, unless that one is larger than ``prefetch_limit`` bytes. Memory holds at
    most the tensor being written and the next one, and never two tensors larger than ``prefetch_limit``. The returned tensor is valid until the next
    :meth:`take`. Call :meth:`close` when done or after a failure (it waits for reads in flight).
    Thread: one caller thread; the chunks are read on the ``ckptd-read`` pool."""

    def __init__(self, tensors: list[SavedTensor], readers: list[StepReader], *, prefetch_limit: int) -> None:
        self.tensors = tensors
        self.readers = readers
        self.prefetch_limit = prefetch_limit
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._started = -1  # the highest position whose reads were started

    def take(self, position: int) -> torch.Tensor:
        if position != self._started and position != self._started + 1:
            raise ValueError(f"TensorFeed.take({position}) out of order")
        try:
            if position > self._started:  # not read ahead (too large): the previous tensor's buffer goes first
                self._release_large((position + 1) % 2)
                self._start(position)
            settle_all(self.readers)
            following = position + 1
            if following < len(self.tensors) and self.tensors[following].nbytes <= self.prefetch_limit:
                self._start(following)
        except BaseException:
            self.close()
            raise
        return self._view(position)

    def close(self) -> None:
        """Wait until no read is in flight (failures are not raised) and release the buffers."""
        settle_all(self.readers, raise_errors=False)
        self._buffers = [None, None]

    def _release_large(self, slot: int) -> None:
        """Drop a buffer larger than the read-ahead limit, so that two large tensors in a row are never held
        at once (a small buffer is kept for reuse)."""
        buffer = self._buffers[slot]
        if buffer is not None and buffer.numel() > self.prefetch_limit:
            self._buffers[slot] = None

    def _start(self, position: int) -> None:
        buffer = self._buffers[position % 2]
        needed = self.tensors[position].nbytes
        if buffer is None or buffer.numel() < needed:
            self._buffers[position % 2] = None  # freed before the larger one is allocated
            import torch

            self._buffers[position % 2] = aligned_empty((needed,), torch.uint8)
        start_reading(self.tensors[position], self.readers, self._view(position))
        self._started = position

    def _view(self, position: int) -> torch.Tensor:
        tensor = self.tensors[position]
        buffer = self._buffers[position % 2]
        assert buffer is not None
        return buffer[:tensor.nbytes].view(tensor.dtype).view(tensor.shape)

