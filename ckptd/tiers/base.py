"""The interface every storage tier implements.

A tier is a root (a directory or an object-store prefix) holding step directories laid out as
:mod:`ckptd.format.layout` says. All paths given to a tier are relative to its root and use ``/``.

Commit rule, on every tier: a step is committed exactly when its ``manifest.json`` exists. Writers
write everything else first and the manifest last; :meth:`StorageTier.delete_step` removes the manifest
first, so a half-deleted step is never listed as committed.

Thread safety: reads may run from several threads at once; a file is written by one thread.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from ckptd._types import Buffer
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file


class StorageTier(abc.ABC):
    """A place that holds checkpoints: the local directory, a peer's daemon, or object storage."""

    #: Short label used in logs and errors ("local", "peer", "object").
    kind: ClassVar[str] = "tier"
    #: True when chunks live content-addressed under ``chunks/`` instead of in per-rank data files.
    stores_chunks_by_digest: ClassVar[bool] = False

    def __init__(self, url: str) -> None:
        self.url = url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def label(self) -> str:
        """How errors and logs name this tier."""
        return f"{self.kind} {self.url}"

    # --- reading -----------------------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a file, or of ``length`` bytes from ``offset``. Raises NotFoundError if absent."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes of ``path`` from ``offset``."""
        data = self.read_bytes(path, offset, len(buffer))
        buffer[: len(data)] = data
        if len(data) != len(buffer):
            from ckptd.errors import IntegrityError

            raise IntegrityError("file is shorter than its index says", path=path, tier=self.label,
                                 expected=str(len(buffer)), actual=str(len(data)))

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of a file. Raises NotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    @abc.abstractmethod
    def list_step_numbers(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending."""

    @abc.abstractmethod
    def list_files(self, step: int) -> list[str]:
        """File names in a step directory (temporary files excluded)."""

    # --- writing -----------------------------------------------------------------------------
    @abc.abstractmethod
    def write_bytes(self, path: str, data: Buffer) -> None:
        """Write a whole file so that it appears complete or not at all, durably."""

    @abc.abstractmethod
    def delete_files(self, paths: list[str]) -> None:
        """Delete files; missing ones are ignored."""

    @abc.abstractmethod
    def remove_step_dir(self, step: int) -> None:
        """Remove what is left of a step directory (after its files are deleted)."""

    # --- content-addressed chunks (tiers with stores_chunks_by_digest) -------------------------
    def chunk_path(self, object_key: str) -> str:
        return f"chunks/{object_key}"

    # --- derived operations ------------------------------------------------------------------
    def is_committed(self, step: int) -> bool:
        return self.exists(step_file(step, MANIFEST_NAME))

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [step for step in self.list_step_numbers() if self.is_committed(step)]

    def delete_step(self, step: int) -> None:
        """Uncommit a step (manifest first), then delete its files and directory."""
        self.delete_files([step_file(step, MANIFEST_NAME)])
        self.delete_files([f"{step_dir(step)}/{name}" for name in self.list_files(step)])
        self.remove_step_dir(step)

    def close(self) -> None:
        """Release resources (locks, connections)."""
