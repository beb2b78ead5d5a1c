"""The object tier's I/O lanes: event loops on named threads, each with its own s3fs client.

Data transfers are spread over the lanes round robin, so request signing, checksums and socket work of
parallel transfers do not queue on one thread. One more client, on the first lane's loop, makes the
small metadata requests with short timeouts (see :mod:`ckptd.tiers.s3_options`).

Ownership: one :class:`IoLanes` belongs to one object tier. It starts its threads when first used,
and :meth:`IoLanes.close` closes the clients' connections, stops the loops and joins the threads. The
lanes of a tier that is garbage collected without ``close()`` are stopped by a finalizer, so changing a
setting (another ``s3_io_threads``) and opening a new tier never leaves loops running behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from ckptd.background import OwnedThread, start_thread
from ckptd.tiers.s3_budget import OperationBudget, within_budget

_log = logging.getLogger(__name__)
_CLOSE_TIMEOUT_S = 5.0
_names = itertools.count()


class _Loop:
    """An event loop running forever on its own daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = start_thread(name, self.loop.run_forever)

    def stop(self, clients: list[Any]) -> None:
        for client in clients:
            _close_client(client, self.loop)
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread.join_within(_CLOSE_TIMEOUT_S):
            self.loop.close()


def _close_client(client: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Close an s3fs client's connections on its own loop (best effort: the loop may be stuck)."""
    creator = getattr(client, "_s3creator", None)
    if creator is None or not loop.is_running():
        return
    try:
        asyncio.run_coroutine_threadsafe(creator.__aexit__(None, None, None), loop).result(_CLOSE_TIMEOUT_S)
    except Exception as exc:  # closing must not fail the caller; the sockets die with the loop
        _log.debug("closing an S3 client: %r", exc)
    client._s3 = None
    client._s3creator = None


def _stop_all(loops: list[_Loop], clients: list[list[Any]]) -> None:
    for loop, on_loop in zip(loops, clients):
        loop.stop(on_loop)


def _budget_of(client: Any) -> OperationBudget:
    """A fresh retry budget for one operation on ``client`` (made by its ``ckptd_budget`` factory)."""
    factory = getattr(client, "ckptd_budget", None)
    return factory() if factory is not None else OperationBudget(retries=0, connect_retries=0)


class IoLanes:
    """Event loops and the s3fs clients on them, owned by one object tier (see the module docstring).

    ``make_client(loop, metadata)`` builds an s3fs client bound to ``loop``; its ``ckptd_budget``
    attribute, when set, makes the retry budget of each operation. Thread safety: every method
    may be called from any thread; :meth:`close` waits for nothing but the loops' own shutdown.
    """

    def __init__(self, count: int, make_client: Callable[[asyncio.AbstractEventLoop, bool], Any]) -> None:
        self.count = max(1, count)
        self._make_client = make_client
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._loops: list[_Loop] = []
        self._data: list[Any] = []
        self._metadata: Any = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        with self._lock:
            if self._loops:
                return
            prefix = f"ckptd-s3-io-{next(_names)}"
            loops = [_Loop(f"{prefix}-{index}") for index in range(self.count)]
            self._data = [self._make_client(loop.loop, False) for loop in loops]
            self._metadata = self._make_client(loops[0].loop, True)
            clients = [[client] for client in self._data]
            clients[0].append(self._metadata)
            self._loops = loops
            self._finalizer = weakref.finalize(self, _stop_all, loops, clients)

    @property
    def data_clients(self) -> list[Any]:
        """The data clients, one per lane (starting the lanes if needed)."""
        self._start()
        return list(self._data)

    @property
    def metadata_client(self) -> Any:
        """The client for listings, lookups, deletes and commit markers."""
        self._start()
        return self._metadata

    def next_data_client(self) -> Any:
        """The client for the next data transfer (round robin over the lanes)."""
        clients = self.data_clients
        return clients[next(self._turn) % len(clients)]

    def run(self, client: Any, coroutine_factory: Callable[[], Coroutine[Any, Any, Any]],
            budget: OperationBudget | None = None) -> Any:
        """Run a coroutine on ``client``'s loop from a caller's thread and return its result: one
        operation, whose requests share one retry budget (:mod:`ckptd.tiers.s3_budget`): ``budget``, or a
        fresh one."""
        from fsspec.asyn import sync

        return sync(client.loop, within_budget, budget if budget is not None else _budget_of(client),
                    coroutine_factory)

    def submit(self, client: Any, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Schedule a coroutine on ``client``'s loop as one operation; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(within_budget(_budget_of(client), lambda: coroutine), client.loop)

    @property
    def started_metadata_client(self) -> Any:
        """The metadata client if the lanes are running, else None (starts nothing)."""
        return self._metadata

    @property
    def running(self) -> bool:
        return bool(self._loops)

    def threads(self) -> list[OwnedThread]:
        """The lanes' threads (empty before first use and after :meth:`close`)."""
        return [loop.thread for loop in self._loops]

    def close(self) -> None:
        """Close every client, stop the loops, join their threads. Using the lanes again starts new ones."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
            self._loops, self._data, self._metadata = [], [], None
        if finalizer is not None:
            finalizer()


__all__ = ["IoLanes"]
