"""Where shards come from: an fsspec filesystem plus a root (local directory or object-store prefix).

One :class:`ShardSource` is made per process (fsspec clients do not survive a fork) and used from
several threads. It lists shards, tells which version of a file the store holds (for re-indexing),
and reads whole shards.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from ckptd.data.manifest import check_relative_path
from ckptd.errors import NotFoundError, StorageError


@dataclass(frozen=True)
class ListedFile:
    """A file found under the root: its relative path, size and version token."""

    path: str
    size: int
    version: str


def _version_token(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(key):
            return f"{key}:{str(info[key]).strip(chr(34))}"
    for key in ("mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return f"{key}:{info[key]}"
    return ""


class ShardSource:
    """Read access to the files under ``root`` (a path or fsspec URL) with ``storage_options``."""

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root_url = root
        try:
            self.fs, path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open the dataset root {root!r}: {exc}",
                               hint="install the fsspec backend for this URL (pip install 'ckptd[s3]' for "
                                    "s3://) or check the storage options") from exc
        self.root = path.rstrip("/")

    def full_path(self, relative: str) -> str:
        """Backend path of a shard given its manifest path (checked to stay under the root)."""
        return posixpath.join(self.root, check_relative_path(relative))

    def url(self, relative: str) -> str:
        """A readable name of a shard for messages (root URL + relative path)."""
        return f"{self.root_url.rstrip('/')}/{relative}"

    def is_file(self) -> bool:
        """Whether the root names one file rather than a directory or prefix."""
        try:
            return bool(self.fs.isfile(self.root))
        except OSError:
            return False

    def list_files(self, suffixes: tuple[str, ...] | None = None) -> Iterator[ListedFile]:
        """Every file under the root (whose name ends with one of ``suffixes``, when given), sorted by path."""
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError as exc:
            raise NotFoundError("the dataset root does not exist", path=self.root_url,
                                hint="check the URI and the storage options") from exc
        prefix = self.root + "/"
        for full in sorted(found):
            info = found[full]
            if info.get("type", "file") != "file" or not full.startswith(prefix):
                continue
            relative = full[len(prefix):]
            if suffixes is None or relative.endswith(suffixes):
                yield ListedFile(path=relative, size=int(info.get("size") or 0), version=_version_token(info))

    def read(self, relative: str) -> bytes:
        """The whole shard; NotFoundError if it is missing, StorageError if the store fails."""
        try:
            return bytes(self.fs.cat_file(self.full_path(relative)))
        except FileNotFoundError as exc:
            raise NotFoundError("shard is missing from the dataset source", path=self.url(relative),
                                hint="restore the file or re-index the dataset (`ckptd data index`)") from exc
        except OSError as exc:
            raise StorageError(f"reading the shard failed: {exc}", path=self.url(relative),
                               hint="check the storage endpoint and credentials; the read is retried") from exc
