"""Writing one rank's share of a step to the local tier: its data files, then its index.

Call order (one thread): :meth:`RankWriter.add` for every tensor, then :meth:`RankWriter.finish`,
which commits the data files and the index atomically and returns the :class:`RankEntry` the manifest
needs; or :meth:`RankWriter.abort` on failure, which leaves nothing behind. The step becomes committed
only later, when the manifest is written (see :mod:`ckptd.manager.commit`).

Chunks with the same digest inside one rank are stored once (zeroed optimizer moments, tied values).

Settings are read once per writer: a :class:`RankWriter` takes a :class:`~ckptd.config.Settings`
snapshot (the caller's, or one read when it is built) and uses it for every chunk.

Performance: each chunk is hashed, encoded and written by a task on the shared ``ckptd-write`` thread
pool (xxhash, zstd and ``pwrite`` release the GIL). The writer holds a lease on that pool from
construction until :meth:`RankWriter.finish` or :meth:`RankWriter.abort` (see
:class:`ckptd.background.SharedPools`): a pool superseded by a change of ``CKPTD_IO_THREADS`` is shut
down once the last writer using it is done. The chunks of small tensors (fewer raw bytes than
``CKPTD_PACK_BELOW_BYTES``) go into the rank's first data file through the page cache. That file is
marked as the rank's pack in the index (format 3), so the object tier stores it as one object instead of
one object per chunk, while every chunk of a larger tensor, its last piece included, is stored there by
digest and shared by the steps that hold it. With ``CKPTD_PACK_BELOW_BYTES=0`` there is no pack: the
first file takes the chunks of fewer stored bytes than ``CKPTD_DIRECT_IO_MIN_BYTES`` instead (format 2
layout). Any other chunk's task takes a data file no other task is writing (opening another one, up to
``CKPTD_IO_THREADS`` of them, when all are busy), appends the chunk with direct I/O (see
:mod:`ckptd.tiers.direct_io`) and hands the file back. Measured on the development machine, 1 GiB of
16 MiB ``pwrite`` calls plus fsync: 1.25-3.9 s from four threads into one buffered file (buffered writes
to one file are serialised by its inode lock, and one file's fsync is one writeback stream), 0.68-2.2 s
into two or four buffered files, 0.42-0.49 s with direct I/O. Files are fsynced in parallel on commit.
At most ``2 x CKPTD_IO_THREADS`` chunks are in flight; chunks lie in completion order and each record
says which file and where. Nothing here issues collectives.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd._types import Buffer
from ckptd.background import PoolLease, TaskPool, shared_pools
from ckptd.config import Settings, settings
from ckptd.errors import DeadlineError

from ckptd.format import codecs
from ckptd.format.hashing import chunk_digest
from ckptd.format.layout import rank_data_name, rank_index_name, step_dir, step_file
from ckptd.format.records import ChunkRecord, DataFile, RankEntry, RankIndex, TensorRecord, dtype_name
from ckptd.tiers.local import AtomicFile, LocalTier

if TYPE_CHECKING:  # torch loads with the first tensor: listings and verification need none
    import torch


def lower_thread_priority(increment: int | None = None) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (default ``CKPTD_BACKGROUND_NICE``;
    Linux: per-thread nice).

    Called by ckptd's background threads when they start; a no-op elsewhere or when not permitted.
    """
    increment = settings().background_nice if increment is None else increment
    if increment <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        thread_id = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + increment))
    except OSError:
        pass


def _pool_shape(purpose: str, options: Settings) -> tuple[int, Any]:
    if purpose == "read":
        return max(1, options.read_threads), None
    if purpose == "remote-read":
        return max(1, options.read_threads, options.s3_concurrency), None
    nice = options.background_nice
    return max(1, options.io_threads), lambda: lower_thread_priority(nice)


def io_pool(purpose: str = "write", options: Settings | None = None) -> TaskPool:
    """The process-wide pool for ``purpose``: ``"write"`` (``CKPTD_IO_THREADS`` threads hashing, encoding
    and writing behind a save, at lowered priority, see :func:`lower_thread_priority`) or ``"read"``
    (``CKPTD_READ_THREADS`` threads reading and verifying during a restore, which training waits for,
    at normal priority) or ``"remote-read"`` (the same for reads from a tier over the network, at least
    ``CKPTD_S3_CONCURRENCY`` threads), sized by ``options`` (default: the current settings).

    For callers that take the pool per task: the pool lives until a change of its thread count
    supersedes it. A caller that keeps using one pool holds a lease instead (:func:`lease_io_pool`).
    Tasks submitted to a pool must never wait on other tasks of the same pool.
    """
    threads, initializer = _pool_shape(purpose, options or settings())
    return shared_pools.current(purpose, threads, initializer=initializer)


def lease_io_pool(purpose: str = "write", options: Settings | None = None) -> PoolLease:
    """A lease on the process-wide pool for ``purpose`` (see :func:`io_pool`), held until released."""
    threads, initializer = _pool_shape(purpose, options or settings())
    return shared_pools.lease(purpose, threads, initializer=initializer)


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes without torch: what the writer process writes from a shared-memory buffer.
    ``dtype`` is the stored dtype name (:func:`~ckptd.format.records.dtype_name`)."""

    data: memoryview
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    floating: bool


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class RankWriter:
    """Writes one rank's tensors of one step as chunks into its data files (``rank-NNNNN.data``,
    ``rank-NNNNN.1.data``, ...) and its index.

    ``options`` is the settings snapshot used for every chunk (default: the settings when the writer is
    built).
    """

    def __init__(self, tier: LocalTier, step: int, rank: int, *, codec: str, chunk_bytes: int,
                 options: Settings | None = None) -> None:
        self.tier, self.step, self.rank = tier, step, rank
        self.codec, self.chunk_bytes = codec, max(16, chunk_bytes - chunk_bytes % 16)
        self.options = options = options if options is not None else settings()
        self.max_parallel_files = max(1, options.io_threads)
        self.direct, self.direct_min_bytes = options.direct_io, options.direct_io_min_bytes
        self.pack_below = max(0, options.pack_below_bytes)
        self.zstd_level = options.zstd_level
        self.handoff_timeout_s = options.file_handoff_timeout_s
        self._window = 2 * max(1, options.io_threads)
        self._files: list[AtomicFile] = []
        self._open_next_file(direct=False)  # number 0: the small chunks (the pack, when packing)
        self._lease: PoolLease | None = lease_io_pool("write", options)
        self._pool = self._lease.pool
        self._free_files: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._open = True
        self._tensors: dict[str, tuple[str, tuple[int, ...], list[Future[ChunkRecord]]]] = {}
        self._written: dict[tuple[str, str], ChunkRecord] = {}
        self._lock = threading.Lock()
        self._in_flight: deque[Future[ChunkRecord]] = deque()
        self.raw_bytes = 0

    def add(self, name: str, tensor: torch.Tensor | RawTensor) -> None:
        """Queue a contiguous CPU tensor's (or a :class:`RawTensor`'s) chunks for writing. The tensor must not change until
        :meth:`finish` or :meth:`abort` returns. Raises the error of an earlier chunk, if any."""
        if not self._open:
            raise RuntimeError("RankWriter is already finished")
        if isinstance(tensor, RawTensor):
            codec_id = codecs.codec_id_for(self.codec, floating=tensor.floating, itemsize=tensor.itemsize)
            data, dtype, shape = tensor.data, tensor.dtype, tensor.shape
        else:
            codec_id = codecs.codec_id_for(self.codec, floating=tensor.is_floating_point(),
                                           itemsize=tensor.element_size())
            data, dtype, shape = tensor_bytes(tensor), dtype_name(tensor.dtype), tuple(tensor.shape)
        packed = len(data) < self.pack_below
        futures = []
        for start in range(0, len(data), self.chunk_bytes):
            while len(self._in_flight) >= self._window:
                self._in_flight.popleft().result()
            future = self._pool.submit(self._store_chunk, data[start:start + self.chunk_bytes], codec_id, packed)
            self._in_flight.append(future)
            futures.append(future)
        self._tensors[name] = (dtype, shape, futures)
        self.raw_bytes += len(data)

    def _store_chunk(self, raw: memoryview, codec_id: str, packed: bool) -> ChunkRecord:
        """On a pool thread: hash, encode, and write the chunk unless an identical one is stored (into the
        pack when ``packed``)."""
        digest = chunk_digest(raw)
        with self._lock:
            known = self._written.get((digest, codec_id))
        if known is not None and known.raw_length == len(raw):
            return known
        stored = codecs.encode(codec_id, raw, level=self.zstd_level)
        if packed or (not self.pack_below and len(stored) < self.direct_min_bytes):
            return self._append(0, stored, raw, digest, codec_id)
        number = self._take_file()
        try:
            return self._append(number, stored, raw, digest, codec_id)
        finally:
            self._free_files.put(number)

    def _append(self, number: int, stored: Buffer, raw: memoryview, digest: str,
                codec_id: str) -> ChunkRecord:
        """Store a chunk at the end of data file ``number``, unless an identical one was stored meanwhile."""
        with self._lock:
            known = self._written.get((digest, codec_id))
            if known is not None and known.raw_length == len(raw):
                return known
            offset = self._files[number].reserve(len(stored))
            record = ChunkRecord(offset=offset, length=len(stored), raw_length=len(raw), codec=codec_id,
                                 digest=digest, file=number)
            self._written[(digest, codec_id)] = record
        self._files[number].write_at(offset, stored)
        return record

    def _open_next_file(self, *, direct: bool) -> int:
        number = len(self._files)
        path = step_file(self.step, rank_data_name(self.rank, number))
        self._files.append(self.tier.open_file(path, direct=direct))
        return number

    def _take_file(self) -> int:
        """A parallel data file no other task is writing: a free one, a new one while fewer than
        ``max_parallel_files`` exist, or else the next one handed back."""
        try:
            return self._free_files.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._files) - 1 < self.max_parallel_files:
                return self._open_next_file(direct=self.direct)
        try:
            return self._free_files.get(timeout=self.handoff_timeout_s)
        except queue.Empty:
            raise DeadlineError(
                f"no data file of rank {self.rank} was handed back within {self.handoff_timeout_s:g} s for the "
                f"next chunk (all {self.max_parallel_files} parallel files are being written)",
                step=self.step, path=step_dir(self.step), tier=self.tier.label,
                hint="a write to the local tier may hang (check the disk); raise CKPTD_FILE_HANDOFF_TIMEOUT_S "
                "if it is only slow") from None

    def _drain(self) -> None:
        """Wait for every queued chunk; raises the first error after all have stopped."""
        first_error: BaseException | None = None
        while self._in_flight:
            future = self._in_flight.popleft()
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - re-raised below, after the rest stopped
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def finish(self, values: Any) -> RankEntry:
        """Commit the data files (fsynced in parallel), then write the index (whose commit fsyncs the
        directory); returns the manifest's entry for this rank."""
        if not self._open:
            raise RuntimeError("RankWriter is already finished")
        self._drain()
        tensors = {name: TensorRecord(dtype=dtype, shape=shape,
                                      chunks=tuple(f.result() for f in futures))
                   for name, (dtype, shape, futures) in self._tensors.items()}
        packing = self.pack_below > 0
        data_files = tuple(DataFile(name=handle.final.name, size=handle.size, packed=packing and number == 0)
                           for number, handle in enumerate(self._files))
        commits = [self._pool.submit(functools.partial(handle.commit, sync_directory=False))
                   for handle in self._files]
        self._open = False
        errors = [future.exception() for future in commits]
        self._release_pool()
        first_error = next((error for error in errors if error is not None), None)
        if first_error is not None:
            self._abort_files()
            raise first_error
        index = RankIndex(step=self.step, rank=self.rank, data_files=data_files, tensors=tensors, values=values)
        raw_index = index.to_json_bytes()
        index_name = rank_index_name(self.rank)
        self.tier.write_bytes(step_file(self.step, index_name), raw_index)
        return RankEntry(rank=self.rank, index_file=index_name, index_size=len(raw_index),
                         index_digest=chunk_digest(raw_index), data_files=data_files)

    def abort(self) -> None:
        """Wait for chunks still being written, then drop everything written so far."""
        try:
            self._drain()
        except BaseException:  # noqa: BLE001 - the caller is already handling the failure
            pass
        if self._open:
            self._open = False
            self._abort_files()
        self._release_pool()

    def _release_pool(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def _abort_files(self) -> None:
        """Delete every data file of this writer, renamed into place or not, unless the step is committed
        (a committed step's files are never deleted by a failed writer)."""
        committed = self.tier.is_committed(self.step)
        for handle in self._files:
            handle.abort()
            if not committed:
                handle.final.unlink(missing_ok=True)

