"""Writing one safetensors file tensor by tensor, so that the file is never held in memory whole.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range in the data that follows, and the tensors' raw bytes back to back. The
header depends only on names, dtypes and shapes, so it is written first from a plan
(:class:`TensorSlot`); then each tensor is produced by the caller, written and dropped. Data is laid out
as the safetensors library lays it out (:func:`aligned_order`: larger elements first, so that every
tensor starts at a multiple of its element size and a reader may map it without copying); bytes are
little-endian, so a big-endian host is refused. The
``safetensors`` package's own writers take every tensor of the file at once, which is why ckptd
writes the (small, stable) format itself; files are read back with the ``safetensors`` package in the
tests.

The file is written under a temporary name and renamed into place after an fsync
(:class:`~ckptd.tiers.local.AtomicFile`), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.errors import ConfigError
from ckptd.tiers.local import AtomicFile

if TYPE_CHECKING:
    import torch

#: safetensors dtype names by torch dtype name (what ``safetensors.torch`` reads back).
_SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
}
#: The header is padded with spaces to a multiple of this, as the safetensors library does.
_HEADER_ALIGNMENT = 8


def safetensors_dtype(dtype: torch.dtype, *, key: str, step: int | None = None) -> str:
    """The safetensors name of a torch dtype; ConfigError naming ``key`` (and ``step``) when safetensors
    cannot hold it."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ConfigError(f"tensor {key!r} has dtype {name}, which safetensors cannot hold", step=step,
                          hint="cast it with --dtype (floating tensors only), or leave it out with --exclude "
                               "or --key-prefix") from None


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a file as planned: its name in the file, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def aligned_order(slots: Iterable[TensorSlot]) -> list[TensorSlot]:
    """``slots`` in the order a file stores their data: larger elements first, otherwise as given. The
    data starts at a multiple of 8 and element sizes are powers of two, so every tensor then starts at a
    multiple of its element size, as the safetensors library writes files."""
    return sorted(slots, key=lambda slot: -slot.dtype.itemsize)


def header_bytes(slots: Iterable[TensorSlot], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and padded JSON header of a file holding ``slots`` in this order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for slot in slots:
        if slot.key in header:
            raise ConfigError(f"tensor name {slot.key!r} appears twice in one safetensors file")
        end = offset + slot.nbytes
        header[slot.key] = {"dtype": safetensors_dtype(slot.dtype, key=slot.key), "shape": list(slot.shape),
                            "data_offsets": [offset, end]}
        offset = end
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(path: Path, slots: list[TensorSlot], produce: Callable[[TensorSlot], torch.Tensor],
                      metadata: Mapping[str, str] | None = None, *, sync_directory: bool = True,
                      progress: Callable[[int], None] | None = None) -> int:
    """Write a safetensors file of ``slots``, in order, calling ``produce(slot)`` for each tensor just
    before its bytes are written (a tensor of the slot's dtype and shape). Returns the file's size.
    ``sync_directory=False``: the caller fsyncs the directory once after writing several files."""
    import torch

    if sys.byteorder != "little":
        raise ConfigError("safetensors files are little-endian and this host is big-endian; ckptd writes "
                          "tensors' bytes as they are in memory", path=str(path),
                          hint="export on a little-endian machine")
    output = AtomicFile(Path(path))
    try:
        output.write(header_bytes(slots, metadata))
        for slot in slots:
            tensor = produce(slot)
            if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                raise ConfigError(f"tensor {slot.key!r} came out as {tensor.dtype} {list(tensor.shape)}, "
                                  f"planned as {slot.dtype} {list(slot.shape)}")
            if slot.nbytes:
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                output.write(memoryview(data))
                del data
            if progress is not None:
                progress(slot.nbytes)
            del tensor  # before the next is produced: the producer may free or reuse its memory
        size = output.size
        output.commit(sync_directory=sync_directory)
    except BaseException:
        output.abort()
        raise
    return size


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors already in memory to one safetensors file (atomically); returns the file's size."""
    slots = aligned_order(TensorSlot(key, tensor.dtype, tuple(tensor.shape)) for key, tensor in tensors.items())
    return write_safetensors(path, slots, lambda slot: tensors[slot.key], metadata)
