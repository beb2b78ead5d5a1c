"""Writing one rank's share of a step to the local tier: its data file, then its index.

Call order (one thread): :meth:`RankWriter.add` for every tensor, then :meth:`RankWriter.finish`,
which commits the data file and the index atomically and returns the :class:`RankEntry` the manifest
needs; or :meth:`RankWriter.abort` on failure, which leaves nothing behind. The step becomes committed
only later, when the manifest is written (see :mod:`ckptd.manager.commit`).

Chunks with the same digest inside one rank are stored once (zeroed optimizer moments, tied values).

Performance: each chunk is hashed, encoded and written by a task on the shared ``ckptd-write`` thread
pool (:func:`io_pool`; xxhash, zstd and ``pwrite`` release the GIL): the task claims the next range of
the data file (:meth:`~ckptd.tiers.local.AtomicFile.reserve`) and writes it with ``pwrite``, so several
chunks reach the disk at once (on the development machine one 1 GiB stream took 3.5 s, four parallel
``pwrite`` streams 1.7 s). At most ``2 x CKPTD_IO_THREADS`` chunks are in flight. Chunks therefore lie
in the data file in completion order; each record says where. Nothing here issues collectives.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ckptd.config import settings

from ckptd.format import codecs
from ckptd.format.hashing import chunk_digest
from ckptd.format.layout import rank_data_name, rank_index_name, step_file
from ckptd.format.records import ChunkRecord, RankEntry, RankIndex, TensorRecord, dtype_name
from ckptd.tiers.local import AtomicFile, LocalTier


_pool_lock = threading.Lock()
_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}


def lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority by ``CKPTD_BACKGROUND_NICE`` (Linux: per-thread nice).

    Called by ckptd's background threads when they start; a no-op elsewhere or when not permitted.
    """
    increment = settings().background_nice
    if increment <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        thread_id = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + increment))
    except OSError:
        pass


def io_pool(purpose: str = "write") -> ThreadPoolExecutor:
    """The process-wide pool of ``CKPTD_IO_THREADS`` threads for ``purpose``: ``"write"`` (hashing and
    encoding behind a save, at lowered priority, see :func:`lower_thread_priority`) or ``"read"``
    (reading and verifying during a restore, which training waits for, at normal priority).
    Tasks submitted to a pool must never wait on other tasks of the same pool.
    """
    threads = max(1, settings().io_threads)
    with _pool_lock:
        pool = _pools.get((purpose, threads))
        if pool is None:
            initializer = lower_thread_priority if purpose == "write" else None
            pool = _pools[(purpose, threads)] = ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix=f"ckptd-{purpose}", initializer=initializer)
        return pool


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class RankWriter:
    """Writes one rank's tensors of one step as chunks into ``rank-NNNNN.data`` and its index."""

    def __init__(self, tier: LocalTier, step: int, rank: int, *, codec: str, chunk_bytes: int) -> None:
        self.tier, self.step, self.rank = tier, step, rank
        self.codec, self.chunk_bytes = codec, max(16, chunk_bytes - chunk_bytes % 16)
        self.data_name = rank_data_name(rank)
        self._file: AtomicFile | None = tier.open_file(step_file(step, self.data_name))
        self._tensors: dict[str, tuple[torch.dtype, tuple[int, ...], list[Future[ChunkRecord]]]] = {}
        self._written: dict[tuple[str, str], ChunkRecord] = {}
        self._lock = threading.Lock()
        self._in_flight: deque[Future[ChunkRecord]] = deque()
        self.raw_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a contiguous CPU tensor's chunks for writing. The tensor must not change until
        :meth:`finish` or :meth:`abort` returns. Raises the error of an earlier chunk, if any."""
        if self._file is None:
            raise RuntimeError("RankWriter is already finished")
        codec_id = codecs.codec_id_for(self.codec, floating=tensor.is_floating_point(),
                                       itemsize=tensor.element_size())
        data = tensor_bytes(tensor)
        pool, window = io_pool(), 2 * max(1, settings().io_threads)
        futures = []
        for start in range(0, len(data), self.chunk_bytes):
            while len(self._in_flight) >= window:
                self._in_flight.popleft().result()
            future = pool.submit(self._store_chunk, data[start:start + self.chunk_bytes], codec_id)
            self._in_flight.append(future)
            futures.append(future)
        self._tensors[name] = (tensor.dtype, tuple(tensor.shape), futures)
        self.raw_bytes += len(data)

    def _store_chunk(self, raw: memoryview, codec_id: str) -> ChunkRecord:
        """On a pool thread: hash, encode, and write the chunk unless an identical one is stored."""
        digest = chunk_digest(raw)
        with self._lock:
            known = self._written.get((digest, codec_id))
        if known is not None and known.raw_length == len(raw):
            return known
        stored = codecs.encode(codec_id, raw)
        with self._lock:
            known = self._written.get((digest, codec_id))
            if known is not None and known.raw_length == len(raw):
                return known
            offset = self._file.reserve(len(stored))  # type: ignore[union-attr]
            record = ChunkRecord(offset=offset, length=len(stored), raw_length=len(raw), codec=codec_id,
                                 digest=digest)
            self._written[(digest, codec_id)] = record
        self._file.write_at(offset, stored)  # type: ignore[union-attr]
        return record

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
        """Commit the data file, then write the index; returns the manifest's entry for this rank."""
        if self._file is None:
            raise RuntimeError("RankWriter is already finished")
        self._drain()
        tensors = {name: TensorRecord(dtype=dtype_name(dtype), shape=shape,
                                      chunks=tuple(f.result() for f in futures))
                   for name, (dtype, shape, futures) in self._tensors.items()}
        data_size = self._file.size
        self._file.commit()
        self._file = None
        index = RankIndex(step=self.step, rank=self.rank, data_file=self.data_name, data_size=data_size,
                          tensors=tensors, values=values)
        raw_index = index.to_json_bytes()
        index_name = rank_index_name(self.rank)
        self.tier.write_bytes(step_file(self.step, index_name), raw_index)
        return RankEntry(rank=self.rank, index_file=index_name, index_size=len(raw_index),
                         index_digest=chunk_digest(raw_index), data_file=self.data_name, data_size=data_size)

    def abort(self) -> None:
        """Wait for chunks still being written, then drop everything written so far."""
        try:
            self._drain()
        except BaseException:  # noqa: BLE001 - the caller is already handling the failure
            pass
        if self._file is not None:
            self._file.abort()
            self._file = None
