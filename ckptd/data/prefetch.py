"""Loading the next shards (fetch if needed, read, verify) while the current ones are read.

A :class:`Prefetcher` belongs to the one loading process that created it (the main process, or one
DataLoader worker) and owns one named background thread pool. Each queued shard is loaded in the
background by :meth:`~ckptd.data.fetch.VerifiedFetcher.load`, so downloading and hashing overlap the
training loop (xxhash and I/O release the GIL). The foreground takes the verified bytes with
:meth:`Prefetcher.take` when it needs the shard; an error raised in the background (corrupt, missing,
unreachable) is re-raised there, at the moment the shard is needed.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable

from ckptd.data.manifest import ShardRecord


class Prefetcher:
    """Runs ``load(record)`` in the background for shards that will be needed soon and keeps the
    results until they are taken. Call every method from the owning thread."""

    def __init__(self, load: Callable[[ShardRecord], bytes], threads: int = 1) -> None:
        self._load = load
        self._pool = concurrent.futures.ThreadPoolExecutor(max(threads, 1), thread_name_prefix="ckptd-prefetch")
        self._pending: dict[str, concurrent.futures.Future[bytes]] = {}
        self._closed = False

    def schedule(self, records: Iterable[ShardRecord]) -> None:
        """Queue shards that are not queued yet."""
        if self._closed:
            return
        for record in records:
            if record.path not in self._pending:
                self._pending[record.path] = self._pool.submit(self._load, record)

    def pending(self) -> int:
        """Shards queued or loaded and not taken yet."""
        return len(self._pending)

    def take(self, record: ShardRecord) -> bytes | None:
        """The verified bytes of a queued shard (waiting for its load), or None if it was not queued.
        Re-raises the error of a failed background load."""
        future = self._pending.pop(record.path, None)
        return None if future is None else future.result()

    def close(self) -> None:
        """Drop queued work and wait for running fetches. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
