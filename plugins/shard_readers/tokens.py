"""Token-array shards, Megatron/nanoGPT style: a flat array of token ids cut into fixed-length sequences.

A shard is either a raw little-endian array (``.bin``, the nanoGPT ``train.bin`` layout; its dtype comes
from the ``dtype`` option, ``uint16`` by default) or a ``.npy`` file (dtype from its header). Sample ``i``
is the numpy array ``tokens[i * seq_len : (i + 1) * seq_len]``; trailing tokens that do not fill a
sequence are not used. ``seq_len`` is a required option (``--option seq_len=2048``).
"""

from __future__ import annotations

import ast
import struct

import numpy as np

from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader
from ckptd.errors import ConfigError, FormatError

_NPY_MAGIC = b"\x93NUMPY"


def _npy_header(data: bytes, name: str) -> tuple[int, np.dtype]:
    """(offset of the array data, dtype) of a 1-D C-order ``.npy`` file."""
    major = data[6] if len(data) > 6 else 0
    if major == 1:
        (length,), start = struct.unpack_from("<H", data, 8), 10
    elif major in (2, 3):
        (length,), start = struct.unpack_from("<I", data, 8), 12
    else:
        raise FormatError(f"unsupported .npy version {major} in {name}", path=name)
    try:
        header = ast.literal_eval(data[start:start + length].decode("latin1"))
        dtype = np.dtype(header["descr"])
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        raise FormatError(f"unreadable .npy header in {name}", path=name) from exc
    if header.get("fortran_order") or len(header.get("shape", ())) != 1:
        raise FormatError(f"token shard {name} must hold a 1-D array", path=name,
                          hint="flatten the tokens with numpy before saving")
    return start + length, dtype


class _OpenTokens:
    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self._tokens = tokens
        self._seq_len = seq_len

    def __len__(self) -> int:
        return len(self._tokens) // self._seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        """A read-only view into the shard's bytes: the tensor collation stacks samples into a new array
        anyway, and :func:`ckptd.data.collate.list_batch` copies views, so no sample keeps a shard alive."""
        start = index * self._seq_len
        return self._tokens[start:start + self._seq_len]


class TokenArrayReader(ShardReader):
    """Fixed-length token sequences cut from flat ``.bin`` or ``.npy`` token files."""

    format_name = "tokens"
    suffixes = (".bin", ".npy")
    option_types = {"seq_len": int, "dtype": str}

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        if self.options.get("seq_len", 0) < 1:
            raise ConfigError("the tokens reader needs a sequence length of at least 1",
                              hint="pass --option seq_len=N (or reader_options={'seq_len': N})")
        self.options.setdefault("dtype", "uint16")

    def _array(self, data: bytes, name: str) -> np.ndarray:
        if data[:6] == _NPY_MAGIC:
            offset, dtype = _npy_header(data, name)
        else:
            offset, dtype = 0, np.dtype(self.options["dtype"]).newbyteorder("<")
        if (len(data) - offset) % dtype.itemsize:
            raise FormatError(f"token shard {name} holds {len(data) - offset} bytes, not a whole number of "
                              f"{dtype} tokens", path=name, hint="check the dtype option or the file")
        return np.frombuffer(data, dtype=dtype, offset=offset)

    def scan(self, data: bytes, name: str) -> ShardLayout:
        tokens = self._array(data, name)
        return ShardLayout(samples=len(tokens) // self.options["seq_len"],
                           locator={"tokens": len(tokens), "dtype": tokens.dtype.str})

    def open(self, data: bytes, layout: ShardLayout, name: str) -> OpenShard:
        tokens = self._array(data, name)
        if len(tokens) != layout.locator.get("tokens"):
            raise FormatError(f"token shard {name} does not match its manifest record", path=name,
                              hint="re-index the dataset with `ckptd data index`")
        return _OpenTokens(tokens, self.options["seq_len"])
