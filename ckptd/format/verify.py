"""The one check every chunk passes when it is read: restore, ``ckptd verify``, promotion and pull.

A chunk's record holds its stored length, codec, raw length and the xxh3-128 digest of its raw bytes.
:func:`decode_verified` decodes stored bytes exactly as a reader does and checks them;
:func:`check_chunk_digest` checks raw bytes already in place (a raw chunk read straight into its
tensor). Both raise :class:`~ckptd.errors.IntegrityError` naming the file, step, tier, chunk and, when
known, the tensor and offset.
"""

from __future__ import annotations

from ckptd._types import Buffer
from ckptd.errors import FormatError, IntegrityError
from ckptd.format import codecs
from ckptd.format.hashing import chunk_digest
from ckptd.format.records import ChunkRecord

_HINT = "this copy is corrupt; use another tier's copy or an older step"


def _what(chunk: ChunkRecord, tensor: str | None) -> str:
    return f"chunk of tensor {tensor!r} at offset {chunk.offset}" if tensor else f"chunk at offset {chunk.offset}"


def decode_verified(chunk: ChunkRecord, stored: Buffer, *, path: str, step: int, tier: str,
                    tensor: str | None = None) -> Buffer:
    """The raw bytes of a chunk from its stored bytes, checked: stored length, decoding, digest."""
    if len(memoryview(stored).cast("B")) != chunk.length:
        raise IntegrityError(f"{_what(chunk, tensor)} has the wrong stored length", path=path, step=step,
                             tier=tier, chunk=chunk.digest, expected=str(chunk.length),
                             actual=str(len(memoryview(stored).cast("B"))), hint=_HINT)
    try:
        raw = codecs.decode(chunk.codec, stored, chunk.raw_length, path=path)
    except (FormatError, IntegrityError) as error:  # a bad frame, a wrong decoded length
        raise IntegrityError(f"{_what(chunk, tensor)} cannot be decoded: {error.message}", path=path, step=step,
                             tier=tier, chunk=chunk.digest, hint=_HINT) from error
    check_chunk_digest(chunk, raw, path=path, step=step, tier=tier, tensor=tensor)
    return raw


def check_chunk_digest(chunk: ChunkRecord, raw: Buffer, *, path: str, step: int, tier: str,
                       tensor: str | None = None) -> None:
    """Raise IntegrityError unless ``raw`` has the chunk's recorded digest."""
    actual = chunk_digest(raw)
    if actual != chunk.digest:
        raise IntegrityError(f"{_what(chunk, tensor)} fails its digest", path=path, step=step, tier=tier,
                             chunk=chunk.digest, expected=chunk.digest, actual=actual, hint=_HINT)
