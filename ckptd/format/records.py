"""The records of the checkpoint format and their JSON form.

Three records describe a step:

- :class:`ChunkRecord`: one stored piece of a tensor (which data file, where, how long, codec, digest of
  the raw bytes).
- :class:`RankIndex`: everything one rank saved: its data files, its tensors (each a list of chunks) and
  its JSON values.
- :class:`Manifest`: the commit record, written last: format version, step, world size, and for each rank
  the size and digest of its index and the names and sizes of its data files, so that a reader can check
  every byte.

Format version 2 lets a rank spread its chunks over several data files (:class:`DataFile`), written in
parallel; version 1 (one ``data_file`` per rank, chunk records without a file number) is still read.
Version 3 marks a data file as a *pack* (``[name, size, "packed"]``): it holds a rank's small chunks, and
tiers that store chunks by digest keep it whole in the step directory and read its chunks by range,
instead of storing each chunk as its own object. Steps of versions 1 and 2 have no packs.

Parsing validates everything a reader relies on, so the rest of ckptd can trust a parsed record: known
format version, safe file names, non-negative and non-overlapping extents inside each data file, sizes
that add up, known codecs and dtypes. Each failure is a :class:`~ckptd.errors.FormatError` naming the
file and step.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd._version import __version__
from ckptd.errors import FormatError, FormatVersionError, IntegrityError
from ckptd.format import codecs
from ckptd.format.hashing import CHUNK_DIGEST_ALGORITHM, chunk_digest
from ckptd.format.layout import safe_name
from ckptd.format.mesh_layout import SavedLayout

if TYPE_CHECKING:
    import torch

#: Version of the on-disk checkpoint format written by this ckptd.
FORMAT_VERSION = 3
#: Versions this ckptd can read.
READABLE_FORMAT_VERSIONS = frozenset({1, 2, 3})
#: Format version of a manifest that records the job's layout (:mod:`ckptd.format.mesh_layout`): its ranks
#: may hold pieces another rank wrote (replicas written once). Its rank indexes keep their own version.
LAYOUT_SINCE = 4
#: Versions of a manifest this ckptd can read (a rank index: READABLE_FORMAT_VERSIONS).
READABLE_MANIFEST_VERSIONS = READABLE_FORMAT_VERSIONS | {LAYOUT_SINCE}
#: Format version from which a data file may be a pack.
PACKED_FILES_SINCE = 3
_PACKED = "packed"
FORMAT_NAME = "ckptd-checkpoint"
#: Largest raw chunk a reader accepts (guards allocations driven by a corrupt index).
MAX_CHUNK_BYTES = 1 << 31
_DIGEST = re.compile(r"^[0-9a-f]{32}$")

#: dtype names as stored, and the bytes per element of each (parsing needs no torch).
DTYPE_ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}


@functools.cache
def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch  # on first use: reading manifests and listing steps (``ckptd ls``) need no torch

    by_name = {name: getattr(torch, name) for name in DTYPE_ITEMSIZES if hasattr(torch, name)}
    return by_name, {dtype: name for name, dtype in by_name.items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (stored name -> torch dtype) and ``DTYPE_NAMES`` (the reverse), built on first use."""
    if name == "DTYPES":
        return _torch_dtypes()[0]
    if name == "DTYPE_NAMES":
        return _torch_dtypes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """Stored name of a torch dtype."""
    try:
        return _torch_dtypes()[1][dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be stored by ckptd") from None


@dataclass(frozen=True)
class ChunkRecord:
    """One stored piece of a tensor: ``length`` stored bytes at ``offset`` in the rank's data file number
    ``file``. ``digest`` is the xxh3-128 of the raw (decoded) bytes."""

    offset: int
    length: int
    raw_length: int
    codec: str
    digest: str
    file: int = 0

    def to_json(self) -> list[Any]:
        return [self.offset, self.length, self.raw_length, self.codec, self.digest, self.file]

    @property
    def object_key(self) -> str:
        """Content address of this chunk on tiers that store chunks by digest."""
        return f"{self.digest[:2]}/{self.digest}.{self.codec}"


@dataclass(frozen=True)
class TensorRecord:
    """A tensor (or a shard of one) as stored: dtype, shape and its chunks in order."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @property
    def nbytes(self) -> int:
        return sum(chunk.raw_length for chunk in self.chunks)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[0][self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class DataFile:
    """One data file of a rank: its name inside the step directory and its size in bytes. A ``packed``
    file holds the rank's small chunks and is stored whole on every tier (see the module docstring)."""

    name: str
    size: int
    packed: bool = False

    def to_json(self) -> list[Any]:
        return [self.name, self.size, _PACKED] if self.packed else [self.name, self.size]


def total_size(data_files: tuple[DataFile, ...]) -> int:
    """Bytes in a rank's data files together."""
    return sum(data_file.size for data_file in data_files)


@dataclass(frozen=True)
class RankIndex:
    """Everything one rank saved at one step."""

    step: int
    rank: int
    data_files: tuple[DataFile, ...]
    tensors: dict[str, TensorRecord]
    values: Any = None
    format_version: int = FORMAT_VERSION

    @property
    def data_size(self) -> int:
        """Bytes in all data files together."""
        return total_size(self.data_files)

    def data_file(self, chunk: ChunkRecord) -> str:
        """Name of the data file that holds ``chunk``."""
        return self.data_files[chunk.file].name

    def in_pack(self, chunk: ChunkRecord) -> bool:
        """Whether ``chunk`` lies in a packed data file (read by range everywhere, never by digest)."""
        return self.data_files[chunk.file].packed

    def packed_chunks(self, number: int) -> list[ChunkRecord]:
        """The distinct chunks stored in data file ``number``, by offset."""
        placed = {(chunk.offset, chunk.length): chunk for chunk in self.chunks if chunk.file == number}
        return [placed[extent] for extent in sorted(placed)]

    def to_json_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "kind": "rank-index",
            "step": self.step,
            "rank": self.rank,
            "data_files": [data_file.to_json() for data_file in self.data_files],
            "tensors": {name: record.to_json() for name, record in self.tensors.items()},
            "values": self.values,
        }
        return json.dumps(body, separators=(",", ":"), allow_nan=True).encode()

    @property
    def chunks(self) -> list[ChunkRecord]:
        return [chunk for record in self.tensors.values() for chunk in record.chunks]

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, path: str, step: int, tier: str | None = None) -> RankIndex:
        body = _load_json(raw, path=path, step=step, tier=tier, kind="rank-index")
        problems = _Problems(path=path, step=step, tier=tier)
        version = body["format_version"]
        data_files = _parse_data_files(body, problems, step, version)
        tensors_json = body.get("tensors")
        if not isinstance(tensors_json, dict):
            problems.fail("'tensors' is not an object")
        tensors = {
            problems.text(name, "tensor name"): _parse_tensor(name, value, data_files, version, problems)
            for name, value in tensors_json.items()
        }
        _check_extents(tensors, problems)
        return cls(
            step=problems.non_negative_int(body.get("step"), "step"),
            rank=problems.non_negative_int(body.get("rank"), "rank"),
            data_files=data_files,
            tensors=tensors,
            values=body.get("values"),
            format_version=version,
        )


@dataclass(frozen=True)
class RankEntry:
    """The manifest's record of one rank: where its index and data are and how to check them."""

    rank: int
    index_file: str
    index_size: int
    index_digest: str
    data_files: tuple[DataFile, ...]
    #: The rank's mesh coordinates (a step with a layout), else None.
    coordinates: tuple[int, ...] | None = None
    #: Pieces this rank holds but another rank wrote: name -> the writer's rank.
    replicas: dict[str, int] = field(default_factory=dict)
    #: Pieces this rank wrote that other ranks hold too: name -> every holder's rank.
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Dtype and shape of each piece in ``replicas`` and ``shared`` (``"float32[4, 6]"``), sent to rank 0
    #: while the ranks agree on a commit so that holders of different tensors are caught; not in manifests.
    signatures: dict[str, str] = field(default_factory=dict)

    @property
    def data_size(self) -> int:
        return total_size(self.data_files)

    def matches_index(self, raw: bytes) -> bool:
        """Whether ``raw`` is the index file this entry names: the same size and xxh3-128 digest."""
        return len(raw) == self.index_size and chunk_digest(raw) == self.index_digest

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"rank": self.rank, "index_file": self.index_file, "index_size": self.index_size,
                                "index_digest": self.index_digest,
                                "data_files": [data_file.to_json() for data_file in self.data_files]}
        if self.coordinates is not None:
            body["coordinates"] = list(self.coordinates)
        if self.replicas:
            body["replicas"] = dict(self.replicas)
        if self.shared:
            body["shared"] = {name: list(holders) for name, holders in self.shared.items()}
        if self.signatures:
            body["signatures"] = dict(self.signatures)
        return body

    @classmethod
    def from_json(cls, item: Any, *, step: int, path: str, version: int = FORMAT_VERSION) -> RankEntry:
        """Parse and check an entry as :meth:`to_json` writes it (in a manifest of format ``version``)."""
        return _parse_entry(item, _Problems(path=path, step=step, tier=None), step, version)


@dataclass(frozen=True)
class Manifest:
    """The commit record of a step. A step is committed on a tier exactly when this exists there."""

    step: int
    world_size: int
    ranks: tuple[RankEntry, ...]
    codec: str
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    ckptd_version: str = __version__
    #: The job's layout (format version 4), None for steps without one.
    layout: SavedLayout | None = None

    @property
    def total_bytes(self) -> int:
        return sum(entry.data_size + entry.index_size for entry in self.ranks)

    def entry(self, rank: int) -> RankEntry:
        for candidate in self.ranks:
            if candidate.rank == rank:
                return candidate
        raise FormatError(f"manifest has no entry for rank {rank}", step=self.step)

    def to_json_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "kind": "manifest",
            "ckptd_version": self.ckptd_version,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "codec": self.codec,
            "digest_algorithm": CHUNK_DIGEST_ALGORITHM,
            "total_bytes": self.total_bytes,
            "ranks": [entry.to_json() for entry in self.ranks],
            "extra": self.extra,
        }
        if self.layout is not None:
            body["layout"] = self.layout.to_json()
        body["manifest_digest"] = chunk_digest(_canonical(body))
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, path: str, step: int | None = None,
                        tier: str | None = None) -> Manifest:
        body = _load_json(raw, path=path, step=step, tier=tier, kind="manifest")
        recorded = body.pop("manifest_digest", None)
        actual = chunk_digest(_canonical(body))
        if recorded != actual:
            raise IntegrityError("manifest digest does not match its content", path=path, step=step,
                                 tier=tier, expected=str(recorded), actual=actual,
                                 hint="the manifest is corrupt; restore an older step or another tier")
        problems = _Problems(path=path, step=step, tier=tier)
        manifest_step = problems.non_negative_int(body.get("step"), "step")
        if step is not None and manifest_step != step:
            problems.fail(f"manifest names step {manifest_step} but lies in the directory of step {step}")
        world_size = problems.non_negative_int(body.get("world_size"), "world_size")
        entries_json = body.get("ranks")
        if not isinstance(entries_json, list):
            problems.fail("'ranks' is not a list")
        entries = tuple(_parse_entry(item, problems, manifest_step, body["format_version"])
                        for item in entries_json)
        if world_size < 1 or world_size != len(entries) or sorted(e.rank for e in entries) != list(range(world_size)):
            problems.fail(f"ranks listed do not match world size {world_size}")
        extra = body.get("extra", {})
        if not isinstance(extra, dict):
            problems.fail("'extra' is not an object")
        created = body.get("created")
        if not isinstance(created, (int, float)):
            problems.fail("'created' is not a number")
        layout = None
        if body["format_version"] >= LAYOUT_SINCE and body.get("layout") is not None:
            layout = SavedLayout.from_json(body["layout"], world_size=world_size, path=path, step=manifest_step)
        return cls(
            step=manifest_step,
            world_size=world_size,
            ranks=tuple(sorted(entries, key=lambda e: e.rank)),
            codec=problems.text(body.get("codec"), "codec"),
            created=float(created),
            extra=extra,
            format_version=body["format_version"],
            ckptd_version=problems.text(body.get("ckptd_version"), "ckptd_version"),
            layout=layout,
        )


class _Problems:
    """Raises FormatError with the file, step and tier filled in."""

    def __init__(self, *, path: str, step: int | None, tier: str | None) -> None:
        self.path, self.step, self.tier = path, step, tier

    def fail(self, why: str) -> Any:
        raise FormatError(f"malformed checkpoint metadata: {why}", path=self.path, step=self.step,
                          tier=self.tier, hint="use an older step or another tier; `ckptd verify` lists "
                          "every bad file")

    def non_negative_int(self, value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.fail(f"{what} must be a non-negative integer, got {value!r}")
        return value

    def text(self, value: Any, what: str) -> str:
        if not isinstance(value, str):
            self.fail(f"{what} must be a string, got {value!r}")
        return value


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _load_json(raw: bytes, *, path: str, step: int | None, tier: str | None, kind: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{kind} is not valid JSON ({exc})", path=path, step=step, tier=tier,
                          hint="the file is corrupt; use an older step or another tier") from exc
    except RecursionError as exc:  # ckptd writes flat records: only a forged file nests this deep
        raise FormatError(f"{kind} nests its values too deeply to be a ckptd {kind}", path=path, step=step,
                          tier=tier, hint="the file is corrupt or forged; use an older step or another tier") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME or body.get("kind") != kind:
        raise FormatError(f"file is not a ckptd {kind}", path=path, step=step, tier=tier)
    version = body.get("format_version")
    readable = READABLE_MANIFEST_VERSIONS if kind == "manifest" else READABLE_FORMAT_VERSIONS
    if version not in readable:
        raise FormatVersionError(
            f"{kind} has format version {version!r}; this ckptd {__version__} reads versions "
            f"{sorted(readable)}", path=path, step=step, tier=tier,
            hint="upgrade ckptd to read it, or restore a step written by this version")
    return body


def _parse_entry(item: Any, problems: _Problems, step: int, version: int) -> RankEntry:
    if not isinstance(item, dict):
        problems.fail("a rank entry is not an object")
    digest = problems.text(item.get("index_digest"), "index_digest")
    if not _DIGEST.match(digest):
        problems.fail(f"index digest {digest!r} is not an xxh3-128 hex digest")
    return RankEntry(
        rank=problems.non_negative_int(item.get("rank"), "rank"),
        index_file=safe_name(item.get("index_file"), step=step, path=problems.path),
        index_size=problems.non_negative_int(item.get("index_size"), "index_size"),
        index_digest=digest,
        data_files=_parse_data_files(item, problems, step, version),
        **_parse_holdings(item, problems),
    )


def _parse_holdings(item: dict[str, Any], problems: _Problems) -> dict[str, Any]:
    """The layout fields of a rank entry (absent before format version 4)."""
    found: dict[str, Any] = {}
    coords = item.get("coordinates")
    if coords is not None:
        if not isinstance(coords, list):
            problems.fail("'coordinates' of a rank entry is not a list")
        found["coordinates"] = tuple(problems.non_negative_int(c, "coordinate") for c in coords)
    replicas = item.get("replicas") or {}
    shared = item.get("shared") or {}
    signatures = item.get("signatures") or {}
    if not isinstance(replicas, dict) or not isinstance(shared, dict) or not isinstance(signatures, dict) \
            or not all(isinstance(holders, list) for holders in shared.values()):
        problems.fail("'replicas', 'shared' or 'signatures' of a rank entry has the wrong type")
    found["signatures"] = {problems.text(name, "piece name"): problems.text(sig, "piece signature")
                           for name, sig in signatures.items()}
    found["replicas"] = {problems.text(name, "piece name"): problems.non_negative_int(writer, "writer rank")
                         for name, writer in replicas.items()}
    found["shared"] = {problems.text(name, "piece name"): tuple(problems.non_negative_int(r, "holder rank")
                                                                for r in holders)
                       for name, holders in shared.items()}
    return found


def _parse_data_files(body: dict[str, Any], problems: _Problems, step: int, version: int) -> tuple[DataFile, ...]:
    """The data files of a rank entry or index: ``data_files`` (version 2; from version 3 an entry may
    end in ``"packed"``) or ``data_file`` and ``data_size`` (version 1)."""
    if "data_files" not in body:
        return (DataFile(name=safe_name(body.get("data_file"), step=step, path=problems.path),
                         size=problems.non_negative_int(body.get("data_size"), "data_size")),)
    listed = body["data_files"]
    lengths = (2, 3) if version >= PACKED_FILES_SINCE else (2,)
    if not isinstance(listed, list) or not all(isinstance(item, list) and len(item) in lengths for item in listed):
        problems.fail("'data_files' is not a list of [name, size] pairs" if len(lengths) == 1 else
                      "'data_files' is not a list of [name, size] or [name, size, \"packed\"] entries")
    if any(len(item) == 3 and item[2] != _PACKED for item in listed):
        problems.fail("a data file is marked with something other than \"packed\"")
    files = tuple(DataFile(name=safe_name(item[0], step=step, path=problems.path),
                           size=problems.non_negative_int(item[1], "data file size"), packed=len(item) == 3)
                  for item in listed)
    if len({data_file.name for data_file in files}) != len(files):
        problems.fail("a data file is listed twice")
    return files


def _parse_tensor(name: str, value: Any, data_files: tuple[DataFile, ...], version: int,
                  problems: _Problems) -> TensorRecord:
    if not isinstance(value, dict):
        problems.fail(f"tensor {name!r} is not an object")
    dtype = value.get("dtype")
    if dtype not in DTYPE_ITEMSIZES:
        problems.fail(f"tensor {name!r} has unknown dtype {dtype!r}")
    shape_json = value.get("shape")
    if not isinstance(shape_json, list):
        problems.fail(f"tensor {name!r} has no shape list")
    shape = tuple(problems.non_negative_int(dim, f"dimension of {name!r}") for dim in shape_json)
    chunks_json = value.get("chunks")
    if not isinstance(chunks_json, list):
        problems.fail(f"tensor {name!r} has no chunk list")
    chunks = tuple(_parse_chunk(name, item, data_files, version, problems) for item in chunks_json)
    expected = math.prod(shape) * DTYPE_ITEMSIZES[dtype]
    record = TensorRecord(dtype=dtype, shape=shape, chunks=chunks)
    if record.nbytes != expected:
        problems.fail(f"tensor {name!r}: chunks hold {record.nbytes} bytes but dtype and shape need {expected}")
    return record


def _parse_chunk(name: str, item: Any, data_files: tuple[DataFile, ...], version: int,
                 problems: _Problems) -> ChunkRecord:
    if not isinstance(item, list) or len(item) != (5 if version == 1 else 6):
        problems.fail(f"tensor {name!r} has a malformed chunk record")
    offset, length, raw_length = (problems.non_negative_int(v, f"chunk extent of {name!r}") for v in item[:3])
    codec_id, digest = item[3], item[4]
    file = 0 if version == 1 else problems.non_negative_int(item[5], f"data file number of {name!r}")
    if file >= len(data_files):
        problems.fail(f"chunk of {name!r} names data file {file} but the rank has {len(data_files)}")
    data_file = data_files[file]
    if codec_id not in codecs.KNOWN_CODEC_IDS:
        problems.fail(f"tensor {name!r} uses unknown codec {codec_id!r}")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        problems.fail(f"tensor {name!r} has a malformed digest {digest!r}")
    if offset + length > data_file.size:
        problems.fail(f"chunk of {name!r} at {offset}+{length} ends past the size {data_file.size} of "
                      f"{data_file.name}")
    if raw_length > MAX_CHUNK_BYTES or (codec_id == codecs.RAW and raw_length != length):
        problems.fail(f"chunk of {name!r} has an impossible raw length {raw_length}")
    return ChunkRecord(offset=offset, length=length, raw_length=raw_length, codec=codec_id, digest=digest,
                       file=file)


def _check_extents(tensors: dict[str, TensorRecord], problems: _Problems) -> None:
    """Chunks may share an extent only when they are the same chunk (deduplicated); never overlap."""
    extents = sorted({(c.file, c.offset, c.length, c.digest) for r in tensors.values() for c in r.chunks})
    previous: tuple[int, int, int, str] | None = None
    previous_end = 0
    for file, offset, length, digest in extents:
        if previous is not None and previous[0] == file:
            if offset < previous_end and (offset, length) != previous[1:3]:
                problems.fail(f"chunk extents overlap at offset {offset} of data file {file}")
            if (offset, length) == previous[1:3] and digest != previous[3]:
                problems.fail(f"two chunks with different digests share offset {offset} of data file {file}")
        else:
            previous_end = 0
        previous_end = max(previous_end, offset + length)
        previous = (file, offset, length, digest)
