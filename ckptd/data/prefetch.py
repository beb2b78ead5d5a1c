"""Loading the next shards (fetch if needed, read, verify) while the current ones are read.

A :class:`Prefetcher` belongs to the one loading process that created it (the main process, or one
DataLoader worker) and owns one named thread pool (a :class:`~ckptd.background.TaskPool`, threads
``ckptd-prefetch_<n>``) that its :meth:`~Prefetcher.close` shuts down. Each queued shard is loaded in the
background by :meth:`~ckptd.data.fetch.VerifiedFetcher.load`, so downloading and hashing overlap the
training loop (xxhash and I/O release the GIL). The foreground takes the verified bytes with
:meth:`Prefetcher.take` when it needs the shard; an error raised in the background (corrupt, missing,
unreachable) is re-raised there, at the moment the shard is needed.

Waits have deadlines: :meth:`Prefetcher.take` gives up after ``CKPTD_WAIT_TIMEOUT_S`` and
:meth:`Prefetcher.close` after ``CKPTD_CLOSE_TIMEOUT_S``, naming the shard still being loaded.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable

from ckptd.background import TaskPool, result_within
from ckptd.config import settings
from ckptd.data.manifest import ShardRecord


class Prefetcher:
    """Runs ``load(record)`` in the background for shards that will be needed soon and keeps the
    results until they are taken. Call every method from the owning thread.

    ``take_timeout_s`` and ``close_timeout_s`` default to ``CKPTD_WAIT_TIMEOUT_S`` and
    ``CKPTD_CLOSE_TIMEOUT_S``.
    """

    def __init__(self, load: Callable[[ShardRecord], bytes], threads: int = 1, *,
                 take_timeout_s: float | None = None, close_timeout_s: float | None = None) -> None:
        options = settings()
        self._load = load
        self.take_timeout_s = options.wait_timeout_s if take_timeout_s is None else take_timeout_s
        self.close_timeout_s = options.close_timeout_s if close_timeout_s is None else close_timeout_s
        self._pool = TaskPool("ckptd-prefetch", max(threads, 1))
        self._pending: dict[str, concurrent.futures.Future[bytes]] = {}
        self._closed = False

    def schedule(self, records: Iterable[ShardRecord]) -> None:
        """Queue shards that are not queued yet."""
        if self._closed:
            return
        for record in records:
            if record.path not in self._pending:
                self._pending[record.path] = self._pool.submit(self._load, record,
                                                               what=f"loading shard {record.path}")

    def pending(self) -> int:
        """Shards queued or loaded and not taken yet."""
        return len(self._pending)

    def take(self, record: ShardRecord) -> bytes | None:
        """The verified bytes of a queued shard (waiting for its load, at most ``take_timeout_s``), or None
        if it was not queued. Re-raises the error of a failed background load; raises DeadlineError
        naming the shard when its load outlasts the deadline."""
        future = self._pending.pop(record.path, None)
        if future is None:
            return None
        return result_within(future, self.take_timeout_s, f"shard {record.path} to be loaded in the background",
                             path=record.path, hint="the shard source may hang or be very slow; raise "
                             "CKPTD_WAIT_TIMEOUT_S if it is only slow")

    def close(self) -> None:
        """Drop queued work and wait for running loads (at most ``close_timeout_s``, then
        StillRunningError naming them; their threads end when the loads do). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.close(self.close_timeout_s)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
