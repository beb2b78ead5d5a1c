"""A peer server for tests: the daemon's real peer endpoints (:func:`ckptd.daemon.peer_api.add_peer_routes`)
on an aiohttp server bound to 127.0.0.1, running its own event loop on a thread of the test process.

Usage::

    with PeerServer(PeerNamespaces({"run1": root}, replica_dir), token="secret") as server:
        tier = PeerTier(server.url("replicas/node-a/run1"), token="secret")

The daemon itself serves the same routes from its HTTP server; this helper lets the peer tier and the
endpoints be tested without a daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from aiohttp import web

from ckptd.daemon.peer_api import ByteCounter, PeerLimits, add_peer_routes
from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.tiers.peer import PeerTier

_START_TIMEOUT_S = 30.0


class PeerServer:
    """Serves ``namespaces`` on 127.0.0.1 (a free port, or ``port``) until :meth:`stop`."""

    def __init__(self, namespaces: PeerNamespaces, *, token: str | None, limits: PeerLimits | None = None,
                 port: int = 0, on_served: ByteCounter | None = None,
                 on_received: ByteCounter | None = None) -> None:
        self.namespaces, self.token, self.limits = namespaces, token, limits or PeerLimits()
        self.port = port
        self._counters = (on_served, on_received)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def url(self, namespace: str) -> str:
        """The peer URL of a namespace on this server."""
        return f"peer://127.0.0.1:{self.port}/{namespace}"

    def start(self) -> int:
        """Start serving; returns the bound port."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._open())
            except BaseException as error:  # handed to start(), which raises it
                failure.append(error)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=serve, name="ckptd-test-peer-server", daemon=True)
        self._thread.start()
        if not started.wait(_START_TIMEOUT_S):
            raise TimeoutError("the test peer server did not start")
        if failure:
            raise failure[0]
        return self.port

    async def _open(self) -> None:
        app = web.Application()
        on_served, on_received = self._counters
        add_peer_routes(app, self.namespaces, token=self.token, limits=self.limits, on_served=on_served,
                        on_received=on_received)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        """Stop serving and close every connection (a stopped server refuses connections)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_START_TIMEOUT_S)
        self._thread = None

    def __enter__(self) -> PeerServer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


@contextlib.contextmanager
def served_replica_tier(directory: Path, *, token: str = "test-peer-token", node: str = "node-a",
                        root: str = "run1", limits: PeerLimits | None = None) -> Iterator[PeerTier]:
    """A :class:`PeerTier` on the replica namespace ``replicas/<node>/<root>`` of a test server that keeps
    its replicas under ``directory`` (a fresh, empty tier when the directory is)."""
    with PeerServer(PeerNamespaces({}, directory), token=token, limits=limits) as server:
        tier = PeerTier(server.url(f"replicas/{node}/{root}"), token=token)
        try:
            yield tier
        finally:
            tier.close()


__all__ = ["PeerServer", "served_replica_tier"]
