"""Writing one rank's share of a step to the local tier: its data file, then its index.

Call order (one thread): :meth:`RankWriter.add` for every tensor, then :meth:`RankWriter.finish`,
which commits the data file and the index atomically and returns the :class:`RankEntry` the manifest
needs; or :meth:`RankWriter.abort` on failure, which leaves nothing behind. The step becomes committed
only later, when the manifest is written (see :mod:`ckptd.manager.commit`).

Chunks with the same digest inside one rank are stored once (zeroed optimizer moments, tied values).

Performance: the chunks of a tensor are hashed and encoded on the shared ``ckptd-write`` thread pool
(:func:`io_pool`; xxhash, zstd and ``os.write`` release the GIL), a bounded window ahead of the calling
thread, which appends them to the data file in order. Nothing here issues collectives.
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


def _hash_and_encode(raw: memoryview, codec_id: str) -> tuple[str, Any]:
    return chunk_digest(raw), codecs.encode(codec_id, raw)


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
        self._tensors: dict[str, TensorRecord] = {}
        self._written: dict[tuple[str, str], ChunkRecord] = {}
        self.raw_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> TensorRecord:
        """Append a contiguous CPU tensor as chunks; returns its record."""
        if self._file is None:
            raise RuntimeError("RankWriter is already finished")
        codec_id = codecs.codec_id_for(self.codec, floating=tensor.is_floating_point(),
                                       itemsize=tensor.element_size())
        data = tensor_bytes(tensor)
        chunks = []
        pieces = [data[start:start + self.chunk_bytes] for start in range(0, len(data), self.chunk_bytes)]
        if len(pieces) <= 1:
            chunks = [self._add_chunk(piece, *_hash_and_encode(piece, codec_id), codec_id) for piece in pieces]
        else:
            pool, window = io_pool(), 2 * max(1, settings().io_threads)
            pending: deque[tuple[memoryview, Future[tuple[str, Any]]]] = deque()
            for piece in pieces:
                pending.append((piece, pool.submit(_hash_and_encode, piece, codec_id)))
                if len(pending) >= window:
                    done, future = pending.popleft()
                    chunks.append(self._add_chunk(done, *future.result(), codec_id))
            while pending:
                done, future = pending.popleft()
                chunks.append(self._add_chunk(done, *future.result(), codec_id))
        record = TensorRecord(dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), chunks=tuple(chunks))
        self._tensors[name] = record
        self.raw_bytes += len(data)
        return record

    def _add_chunk(self, raw: memoryview, digest: str, stored: Any, codec_id: str) -> ChunkRecord:
        known = self._written.get((digest, codec_id))
        if known is not None and known.raw_length == len(raw):
            return known
        offset = self._file.write(stored)  # type: ignore[union-attr]
        record = ChunkRecord(offset=offset, length=len(stored), raw_length=len(raw), codec=codec_id,
                             digest=digest)
        self._written[(digest, codec_id)] = record
        return record

    def finish(self, values: Any) -> RankEntry:
        """Commit the data file, then write the index; returns the manifest's entry for this rank."""
        if self._file is None:
            raise RuntimeError("RankWriter is already finished")
        data_size = self._file.size
        self._file.commit()
        self._file = None
        index = RankIndex(step=self.step, rank=self.rank, data_file=self.data_name, data_size=data_size,
                          tensors=self._tensors, values=values)
        raw_index = index.to_json_bytes()
        index_name = rank_index_name(self.rank)
        self.tier.write_bytes(step_file(self.step, index_name), raw_index)
        return RankEntry(rank=self.rank, index_file=index_name, index_size=len(raw_index),
                         index_digest=chunk_digest(raw_index), data_file=self.data_name, data_size=data_size)

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._file is not None:
            self._file.abort()
            self._file = None
