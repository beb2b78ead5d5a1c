"""The dataset manifest: one record per shard, written by the indexer and read by the dataset.

A manifest names the storage root it was made from (a local directory or an fsspec URL such as
``s3://bucket/prefix``), the shard format and its reader options, and for every shard its path relative
to the root, size, xxh3-64 digest, sample count and the reader's *layout* (what the reader needs to find
sample ``i`` without scanning the shard again).

The manifest's identity (:attr:`DatasetManifest.digest`) covers the format, the reader options and
every shard's path, size, digest and sample count, in order; it ignores the root and the source
versions, so a dataset moved to another bucket, or re-indexed without changes, keeps its identity.
A loader state records this digest, and resuming against another manifest is refused by default.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from ckptd.errors import FormatError, FormatVersionError, NotFoundError, StorageError, UnsafePathError
from ckptd.format.hashing import SHARD_DIGEST_ALGORITHM, chunk_digest
from ckptd.tiers.local import make_directory, write_file_atomically

#: Version written into every dataset manifest; readers refuse other versions.
MANIFEST_VERSION = 1
#: Value of the ``kind`` field that marks a JSON file as a ckptd dataset manifest.
MANIFEST_KIND = "ckptd-dataset-manifest"


def check_relative_path(path: str, *, manifest: str | None = None) -> str:
    """Return ``path`` if it is a safe relative POSIX path inside the dataset root, else raise."""
    normalized = posixpath.normpath(path) if path else ""
    if (not path or path.startswith("/") or "\\" in path or normalized != path
            or normalized == ".." or normalized.startswith("../") or "://" in path):
        raise UnsafePathError(f"shard path {path!r} is not a plain relative path inside the dataset root",
                              path=manifest, hint="re-create the manifest with `ckptd data index`")
    return path


@dataclass(frozen=True)
class ShardRecord:
    """One shard of a dataset: where it is, what its bytes hash to, and how to find its samples."""

    #: Path relative to the manifest's root, with ``/`` separators.
    path: str
    #: Size in bytes.
    size: int
    #: xxh3-64 of the whole shard, 16 hex digits.
    digest: str
    #: Number of samples in the shard.
    samples: int
    #: Reader-specific layout (JSON values) that locates each sample.
    layout: Mapping[str, Any] = field(default_factory=dict)
    #: What the storage said about this version of the file (mtime or ETag); used to skip re-hashing.
    source_version: str = ""

    def identity(self) -> dict[str, Any]:
        """The fields that define the shard's content (used by the manifest digest)."""
        return {"path": self.path, "size": self.size, "digest": self.digest, "samples": self.samples}

    def to_json(self) -> dict[str, Any]:
        return {**self.identity(), "layout": dict(self.layout), "source_version": self.source_version}

    @classmethod
    def from_json(cls, raw: Any, *, manifest: str | None = None) -> ShardRecord:
        if not isinstance(raw, Mapping):
            raise FormatError("a shard record is not a JSON object", path=manifest,
                              hint="re-create the manifest with `ckptd data index`")
        try:
            record = cls(path=check_relative_path(str(raw["path"]), manifest=manifest),
                         size=int(raw["size"]), digest=str(raw["digest"]), samples=int(raw["samples"]),
                         layout=dict(raw.get("layout") or {}),
                         source_version=str(raw.get("source_version", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"shard record {raw.get('path')!r} is malformed: {exc!r}", path=manifest,
                              hint="re-create the manifest with `ckptd data index`") from exc
        if record.size < 0 or record.samples < 0 or len(record.digest) != 16:
            raise FormatError(f"shard record {record.path!r} has a negative size/sample count or a bad "
                              f"digest {record.digest!r}", path=manifest,
                              hint="re-create the manifest with `ckptd data index`")
        return record


@dataclass(frozen=True)
class DatasetManifest:
    """Every shard of a dataset, in a fixed order, plus the format needed to read them."""

    #: Storage root the shard paths are relative to (local directory or fsspec URL).
    root: str
    #: Name of the shard reader (an entry point of the ``ckptd.shard_readers`` group).
    format: str
    shards: tuple[ShardRecord, ...]
    #: Options given to the reader (for example ``seq_len`` for token arrays).
    reader_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_samples(self) -> int:
        return sum(shard.samples for shard in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    @property
    def digest(self) -> str:
        """xxh3-128 over the canonical JSON of format, reader options and shard identities."""
        canonical = {"format": self.format, "reader_options": dict(self.reader_options),
                     "shards": [shard.identity() for shard in self.shards]}
        return chunk_digest(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode())

    def to_json(self) -> dict[str, Any]:
        return {"kind": MANIFEST_KIND, "version": MANIFEST_VERSION, "root": self.root,
                "format": self.format, "reader_options": dict(self.reader_options),
                "digest_algorithm": SHARD_DIGEST_ALGORITHM, "manifest_digest": self.digest,
                "total_samples": self.total_samples, "shards": [shard.to_json() for shard in self.shards]}

    @classmethod
    def from_json(cls, raw: Any, *, source: str | None = None) -> DatasetManifest:
        """Parse a manifest; ``source`` names the file in error messages."""
        hint = "re-create it with `ckptd data index`"
        if not isinstance(raw, Mapping) or raw.get("kind") != MANIFEST_KIND:
            raise FormatError("this is not a ckptd dataset manifest", path=source, hint=hint)
        if raw.get("version") != MANIFEST_VERSION:
            raise FormatVersionError(f"dataset manifest version {raw.get('version')!r} is not supported "
                                     f"(this ckptd reads version {MANIFEST_VERSION})", path=source,
                                     hint="upgrade ckptd or re-index the dataset")
        if raw.get("digest_algorithm", SHARD_DIGEST_ALGORITHM) != SHARD_DIGEST_ALGORITHM:
            raise FormatError(f"unknown shard digest algorithm {raw.get('digest_algorithm')!r}",
                              path=source, hint=hint)
        shards_raw = raw.get("shards")
        if not isinstance(shards_raw, Sequence) or isinstance(shards_raw, (str, bytes)):
            raise FormatError("the manifest has no list of shards", path=source, hint=hint)
        shards = tuple(ShardRecord.from_json(item, manifest=source) for item in shards_raw)
        paths = [shard.path for shard in shards]
        if len(set(paths)) != len(paths):
            raise FormatError("the manifest lists a shard twice", path=source, hint=hint)
        manifest = cls(root=str(raw.get("root", "")), format=str(raw.get("format", "")), shards=shards,
                       reader_options=dict(raw.get("reader_options") or {}))
        recorded = raw.get("manifest_digest")
        if recorded is not None and recorded != manifest.digest:
            raise FormatError(f"the manifest's recorded digest {recorded} does not match its content "
                              f"({manifest.digest}); it was edited by hand or damaged", path=source, hint=hint)
        return manifest

    def with_root(self, root: str) -> DatasetManifest:
        """The same manifest read from another storage root (the data was moved or mirrored)."""
        return DatasetManifest(root=root, format=self.format, shards=self.shards,
                               reader_options=self.reader_options)


def load_dataset_manifest(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
                  ) -> DatasetManifest:
    """Read a manifest from a local path or fsspec URL."""
    text = os.fspath(path)
    try:
        with fsspec.open(text, "rb", **dict(storage_options or {})) as handle:
            raw = json.loads(handle.read())
    except FileNotFoundError as exc:
        raise NotFoundError("dataset manifest not found", path=text,
                            hint="create it with `ckptd data index URI --format FORMAT --out FILE`") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"the dataset manifest is not valid JSON: {exc}", path=text,
                          hint="re-create it with `ckptd data index`") from exc
    return DatasetManifest.from_json(raw, source=text)


def save_dataset_manifest(manifest: DatasetManifest, path: str | os.PathLike[str]) -> None:
    """Write a manifest to a local path atomically (temporary file, fsync, rename, fsync of the directory).

    Failures raise :class:`~ckptd.errors.StorageError` naming the manifest's path; an existing manifest is
    never lost (see :func:`~ckptd.tiers.local.write_file_atomically`)."""
    target = Path(os.path.abspath(path))
    hint = "write the manifest to a writable local path (`ckptd data index URI --format FORMAT --out FILE`)"
    try:
        make_directory(target.parent)
    except OSError as exc:
        raise StorageError(f"cannot write the dataset manifest: creating its directory failed: "
                           f"{exc.strerror or exc}", path=str(target), hint=hint) from exc
    write_file_atomically(target, (json.dumps(manifest.to_json(), indent=1) + "\n").encode(),
                          what="dataset manifest", hint=hint)
