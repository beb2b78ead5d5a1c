"""What a shard-format reader implements, and helpers readers share.

A reader maps (shard bytes, sample index) to a sample, in two steps:

1. :meth:`ShardReader.scan` runs once per shard at index time (``ckptd data index``) and returns a
   :class:`ShardLayout`: the sample count and a JSON *locator* that is stored in the manifest;
2. :meth:`ShardReader.open` runs in the data-loading process each time a verified shard is opened and
   returns an :class:`OpenShard`, from which samples are taken by index in any order.

Readers are plugins: classes registered under the ``ckptd.shard_readers`` entry-point group (see
:mod:`ckptd.data.registry`). Both methods may run in several threads and processes at once; a reader
instance holds only its options. Errors about a malformed shard are :class:`~ckptd.errors.FormatError`
naming the shard.
"""

from __future__ import annotations

import abc
import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import zstandard

from ckptd.errors import ConfigError


@dataclass(frozen=True)
class ShardLayout:
    """What indexing learned about one shard: its sample count and how to find each sample."""

    samples: int
    locator: Mapping[str, Any] = field(default_factory=dict)


class OpenShard(Protocol):
    """A verified shard opened for reading; samples are taken by index, in any order."""

    def __len__(self) -> int:
        """Number of samples."""

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` (0 <= index < len)."""


class ShardReader(abc.ABC):
    """Base class of shard-format readers. Subclasses set :attr:`format_name` and :attr:`suffixes`."""

    #: Name of the format as used in manifests and on the command line.
    format_name: ClassVar[str] = ""
    #: File-name endings the indexer picks up when walking a directory or prefix.
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: Options the reader accepts, with their types (values from the CLI arrive as strings).
    option_types: ClassVar[Mapping[str, type]] = {}

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - set(self.option_types)
        if unknown:
            raise ConfigError(f"the {self.format_name} reader has no option(s) {', '.join(sorted(unknown))}",
                              hint=f"known options: {', '.join(sorted(self.option_types)) or 'none'}")
        self.options: dict[str, Any] = {}
        for name, value in options.items():
            try:
                self.options[name] = self.option_types[name](value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"option {name}={value!r} of the {self.format_name} reader is not a "
                                  f"valid {self.option_types[name].__name__}") from exc

    @abc.abstractmethod
    def scan(self, data: bytes, name: str) -> ShardLayout:
        """Index the bytes of shard ``name`` (raises FormatError naming it if they are malformed)."""

    @abc.abstractmethod
    def open(self, data: bytes, layout: ShardLayout, name: str) -> OpenShard:
        """Open verified shard bytes for sample access, using the layout :meth:`scan` produced."""


def pack_offsets(values: np.ndarray | list[int]) -> str:
    """Encode an integer array (offsets, sizes) compactly for a JSON manifest (delta, zstd, base64)."""
    array = np.asarray(values, dtype=np.int64)
    deltas = np.diff(array, prepend=np.int64(0)).astype("<i8")
    return base64.b64encode(zstandard.ZstdCompressor(level=3).compress(deltas.tobytes())).decode("ascii")


def unpack_offsets(text: str) -> np.ndarray:
    """Decode what :func:`pack_offsets` made."""
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(text))
    return np.cumsum(np.frombuffer(raw, dtype="<i8"))
