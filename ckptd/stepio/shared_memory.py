"""Shared-memory segments: staging buffers the trainer fills and the writer process reads.

A :class:`Segment` is a file in the RAM-backed ``/dev/shm`` (the temporary directory where that does not
exist), mapped into memory. The trainer's :class:`~ckptd.state.staging.Stager` allocates each staging
buffer of the writer process's mode in its own segment (:func:`shared_empty`); the writer process maps a
segment by name the first time a save names it (:class:`SegmentCache`). The trainer removes a segment's
file when it frees the buffer (a writer process started after a crash of the previous one maps it again by
name). When the trainer dies, its writer process sees its pipe close and removes the trainer's segment
files (:func:`remove_segments_of`); files left all the same are removed by the next writer process of the
machine (:func:`remove_orphans`), once the process that made them is gone.

Segments start on a page boundary, so the writer sends them to disk with direct I/O without a copy.
Training thread (allocation), writer process (mapping); no thread of its own.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Every segment's file name starts with it, then the creating process's id.
PREFIX = "ckptd-staging-"


def segment_directory() -> Path:
    """Where segments live: ``/dev/shm`` where it is a writable directory, else the temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


@dataclass
class Segment:
    """One mapped segment: its file name (in :func:`segment_directory`), size and mapping."""

    name: str
    size: int
    memory: mmap.mmap


def create_segment(size: int) -> Segment:
    """Create and map a new segment of ``size`` bytes (at least one page) in this process."""
    size = max(size, mmap.PAGESIZE)
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"
    path = segment_directory() / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Segment(name, size, memory)


def remove_segment_file(name: str) -> None:
    """Remove a segment's file (its memory stays mapped where it is mapped); missing is fine."""
    (segment_directory() / name).unlink(missing_ok=True)


def shared_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Segment]:
    """An uninitialised CPU tensor in a new segment of its own, and the segment. The tensor keeps the
    mapping alive; the segment's file stays until the writer process maps it (or :func:`remove_segment_file`)."""
    import math

    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    segment = create_segment(nbytes)
    tensor = torch.frombuffer(segment.memory, dtype=torch.uint8, count=nbytes) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return tensor.view(dtype).view(shape), segment


class SegmentCache:
    """The writer process's mappings, by segment name: mapped (and their files removed) on first use,
    dropped when a save no longer names them."""

    def __init__(self) -> None:
        self._mapped: dict[str, mmap.mmap] = {}

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` of segment ``name``, mapping it first if needed."""
        memory = self._mapped.get(name)
        if memory is None:
            memory = self._mapped[name] = self._map(name)
        return memoryview(memory)[offset:offset + length]

    @staticmethod
    def _map(name: str) -> mmap.mmap:
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a staging segment name: {name!r}")
        path = segment_directory() / name
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return memory

    def keep_only(self, names: set[str]) -> None:
        """Unmap every segment not in ``names`` (its buffer was dropped or replaced by the trainer)."""
        for name in [name for name in self._mapped if name not in names]:
            memory = self._mapped.pop(name)
            try:
                memory.close()
            except BufferError:  # a view still exists; the mapping goes with its last reference
                pass

    def close(self) -> None:
        self.keep_only(set())


def remove_segments_of(pid: int) -> None:
    """Remove every segment file made by process ``pid`` (the writer process, once its trainer is gone)."""
    directory = segment_directory()
    prefix = f"{PREFIX}{pid}-"
    try:
        names = [entry.name for entry in os.scandir(directory) if entry.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        (directory / name).unlink(missing_ok=True)


def remove_orphans() -> list[str]:
    """Remove segment files whose creating process is gone (it died before a writer mapped them);
    returns their names."""
    removed = []
    directory = segment_directory()
    try:
        names = [entry.name for entry in os.scandir(directory) if entry.name.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
        except (ValueError, PermissionError, OSError):
            continue
    return removed
