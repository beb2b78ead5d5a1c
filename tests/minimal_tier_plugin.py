"""A third-party storage tier written against the small protocol only: ``blobdir://PATH``, a blob store kept as
plain files under a directory (what a plugin for a shared file system or a key-value store would write).

It implements the small protocol of :class:`ckptd.tiers.base.StorageTier` and nothing more: read, size, exists,
list (``list_objects``), write with conditional create, delete. It declares two capabilities: ``conditional_put``
(a create is a hard link, which fails when the name is taken) and ``chunks_by_digest`` (it lists, so it can hold
the object tier's content-addressed chunks and serve as a manager's remote tier). Everything else (the step
listings, ranged and whole reads into memory, streamed writes, commit checks, uploads in parts, clocks and ages)
comes from the base class's defaults. Registered through a
``ckptd.storage`` entry point by ``tests/test_tier_minimal_plugin.py``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from ckptd.errors import NotFoundError, StorageError, UnsafePathError
from ckptd.format.layout import TEMP_MARKER
from ckptd.tiers.base import StorageTier, StoredObject, TierCapabilities

SCHEME = "blobdir"


def write_all(handle: Any, data: memoryview) -> None:
    """Every byte of ``data`` to an open file (a module function, so a test can break it part-way)."""
    handle.write(data)


class BlobDirTier(StorageTier):
    """Blobs as files under a directory; a blob is created whole or not at all (temporary file, then rename
    or, for a conditional create, a hard link that fails when the name is taken)."""

    kind = SCHEME
    capabilities = TierCapabilities(conditional_put=True, chunks_by_digest=True)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.root = Path(url.removeprefix(f"{SCHEME}://"))
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 create: bool = False) -> BlobDirTier:
        return cls(url)

    def _file(self, path: str) -> Path:
        parts = PurePosixPath(path).parts
        if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
            raise UnsafePathError(f"{path!r} leaves the store", path=path, tier=self.label)
        return self.root.joinpath(*parts)

    def _missing(self, path: str) -> NotFoundError:
        return NotFoundError("no such blob", path=path, tier=self.label)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._file(path), "rb") as handle:
                handle.seek(offset)
                return handle.read() if length is None else handle.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as error:
            raise self._missing(path) from error

    def size(self, path: str) -> int:
        file = self._file(path)
        if not file.is_file():
            raise self._missing(path)
        return file.stat().st_size

    def exists(self, path: str) -> bool:
        return self._file(path).is_file()

    def list_objects(self, directory: str) -> list[StoredObject]:
        top = self._file(directory) if directory else self.root
        if not top.is_dir():
            return []
        found = []
        for folder, _, names in os.walk(top):
            for name in names:
                if TEMP_MARKER in name:
                    continue
                file = Path(folder, name)
                try:
                    stat = file.stat()
                except FileNotFoundError:  # deleted while listed
                    continue
                found.append(StoredObject(file.relative_to(self.root).as_posix(), stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda obj: obj.path)

    def write_bytes(self, path: str, data: Any, *, if_absent: bool = False) -> None:
        target = self._file(path)
        temporary = target.with_name(f"{target.name}{TEMP_MARKER}{uuid.uuid4().hex}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                write_all(handle, memoryview(data).cast("B"))
                handle.flush()
                os.fsync(handle.fileno())
            if not if_absent:
                os.replace(temporary, target)
                return
            try:
                os.link(temporary, target)
            except FileExistsError:
                self._refuse_unless_identical(path, data)
        except OSError as error:
            raise StorageError(f"could not write the blob: {error}", path=path, tier=self.label,
                               hint="check the store's directory and free space") from error
        finally:
            temporary.unlink(missing_ok=True)

    def delete_files(self, paths: list[str]) -> None:
        for path in paths:
            self._file(path).unlink(missing_ok=True)
