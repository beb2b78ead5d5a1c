"""Chunk codecs: how the raw bytes of a chunk are stored.

- ``raw``: stored as is (fastest; the default for the local tier).
- ``zstd``: zstandard at the configured level.
- ``byteplaneN``: for floating-point tensors with N-byte elements, the bytes are regrouped so that all
  first bytes of every element come first, then all second bytes, and so on, before zstd. The exponent
  bytes of nearby weights are similar, so the planes compress better than interleaved bytes.

A codec id is what a chunk record stores. Decoding never produces more than the raw length the index
states: a chunk that would inflate past it is refused as a decompression bomb.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import ConfigError, FormatError, IntegrityError

RAW = "raw"
ZSTD = "zstd"
BYTEPLANE = "byteplane"
#: Codec names a caller may choose for a checkpoint or tier.
CHECKPOINT_CODECS = (RAW, ZSTD, BYTEPLANE)
_BYTEPLANE_WIDTHS = (2, 4, 8)
#: Every codec id that may appear in a chunk record.
KNOWN_CODEC_IDS = frozenset([RAW, ZSTD] + [f"{BYTEPLANE}{w}" for w in _BYTEPLANE_WIDTHS])

_local = threading.local()


def _compressor(level: int | None = None) -> zstandard.ZstdCompressor:
    level = settings().zstd_level if level is None else level
    cached = getattr(_local, "compressor", None)
    if cached is None or _local.level != level:
        _local.compressor = zstandard.ZstdCompressor(level=level)
        _local.level = level
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    cached = getattr(_local, "decompressor", None)
    if cached is None:
        cached = _local.decompressor = zstandard.ZstdDecompressor()
    return cached


def chosen_codec(codec: str | None) -> str:
    """The codec a writer uses: ``codec``, or the ``CKPTD_CODEC`` setting when it is None.

    Raises :class:`~ckptd.errors.ConfigError` naming the codec, where it came from and the known ones,
    so that a misspelt codec fails when the writer is built rather than at the first chunk.
    """
    if codec is not None:
        _check_codec(codec, "codec")
        return codec
    configured = settings().codec
    _check_codec(configured, "CKPTD_CODEC")
    return configured


def _check_codec(codec: object, source: str) -> None:
    if codec not in CHECKPOINT_CODECS:
        raise ConfigError(f"unknown codec {codec!r} (from {source})",
                          hint=f"choose one of {', '.join(CHECKPOINT_CODECS)}")


def codec_id_for(codec: str, *, floating: bool, itemsize: int) -> str:
    """The codec id a chunk of a tensor gets when the checkpoint asks for ``codec``."""
    _check_codec(codec, "codec")
    if codec == BYTEPLANE:
        if floating and itemsize in _BYTEPLANE_WIDTHS:
            return f"{BYTEPLANE}{itemsize}"
        return ZSTD
    return codec


def encode(codec_id: str, raw: Buffer, *, level: int | None = None) -> Buffer:
    """Encode one chunk's raw bytes; ``raw`` may be returned unchanged (codec ``raw``). ``level`` is the
    zstd level (None: the ``CKPTD_ZSTD_LEVEL`` setting; writers pass the level of their save's settings,
    so that the environment is not read once per chunk)."""
    if codec_id == RAW:
        return raw
    if codec_id == ZSTD:
        return _compressor(level).compress(raw)
    width = _byteplane_width(codec_id)
    array = np.frombuffer(raw, dtype=np.uint8)
    if array.size % width:
        return _compressor(level).compress(raw)  # cannot happen for whole elements; stays decodable as zstd
    planes = np.ascontiguousarray(array.reshape(-1, width).T)
    return _compressor(level).compress(planes)


def decode(codec_id: str, stored: Buffer, raw_length: int, *, path: str | None = None) -> Buffer:
    """Decode one chunk, refusing to produce anything but exactly ``raw_length`` bytes."""
    if codec_id == RAW:
        if len(stored) != raw_length:
            raise IntegrityError("raw chunk has the wrong length", path=path,
                                 expected=str(raw_length), actual=str(len(stored)))
        return stored
    if codec_id not in KNOWN_CODEC_IDS:
        raise FormatError(f"unknown codec id {codec_id!r}", path=path,
                          hint="this checkpoint was written by a newer ckptd; upgrade ckptd to read it")
    inflated = _inflate(stored, raw_length, path)
    if codec_id == ZSTD:
        return inflated
    width = _byteplane_width(codec_id)
    if raw_length % width:
        return inflated
    planes = np.frombuffer(inflated, dtype=np.uint8).reshape(width, -1)
    return np.ascontiguousarray(planes.T).reshape(-1).data


def _inflate(stored: Buffer, raw_length: int, path: str | None) -> bytes:
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise IntegrityError("compressed chunk is not a zstd frame", path=path) from exc
    if declared not in (-1, raw_length):
        raise IntegrityError("compressed chunk declares a size other than its record (possible "
                             "decompression bomb)", path=path, expected=str(raw_length), actual=str(declared))
    try:
        with _decompressor().stream_reader(stored) as reader:
            out = reader.read(raw_length + 1)
            while len(out) <= raw_length:
                more = reader.read(raw_length + 1 - len(out))
                if not more:
                    break
                out += more
    except zstandard.ZstdError as exc:
        raise IntegrityError("compressed chunk does not decompress", path=path) from exc
    if len(out) != raw_length:
        raise IntegrityError("compressed chunk inflates to the wrong size (refused beyond the recorded "
                             "size)", path=path, expected=str(raw_length), actual=f">={len(out)}")
    return out


def _byteplane_width(codec_id: str) -> int:
    try:
        width = int(codec_id[len(BYTEPLANE):]) if codec_id.startswith(BYTEPLANE) else 0
    except ValueError:
        width = 0
    if width not in _BYTEPLANE_WIDTHS:
        raise FormatError(f"unknown codec id {codec_id!r}")
    return width
