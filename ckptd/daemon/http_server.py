"""The daemon's HTTP API on aiohttp: health, readiness, the status document, metrics, and the peer routes.

:class:`HttpServer` runs its own asyncio event loop on one named thread (``ckptd-http``), so that the
daemon's other threads stay plain threads. Routes:

- ``GET /healthz``: 200 while the process serves requests (nothing else is asked);
- ``GET /readyz``: 200 when ``daemon.is_ready()``, else 503 with a JSON ``why``;
- ``GET /status``: the JSON status document, ``daemon.status()``;
- ``GET /metrics``: the Prometheus text of ``daemon.metrics``;
- whatever ``peer_routes`` adds (the peer chunk API under ``/v1/peer/``, which has its own token check and
  limits).

Who may ask what is :mod:`ckptd.daemon.auth`'s rule: ``/healthz`` and ``/readyz`` are open; ``/metrics`` needs
a token with the scrape right unless the server listens on loopback only; ``/status`` (and any other route)
needs a token with the status right or a loopback connection from an allowed UID. A refusal is 401 (no
usable token) or 403 (a token without the right) and one log line naming the client address and the path.

``daemon.status()`` and ``daemon.is_ready()`` may do I/O: they run on the loop's executor, so a slow status
never holds ``/healthz``, and each gets :data:`ANSWER_TIMEOUT_S`: one that takes longer is a 503 with the
reason (a hung tier must not leave probes and scrapers waiting for ever). Request bodies are bounded
(``client_max_size``) and refused (413) on every route but the peer routes. Call order:
:meth:`HttpServer.start` once (returns the bound port), :meth:`HttpServer.stop` once, from any one thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from ckptd.background import OwnedThread, TaskPool, start_thread
from ckptd.daemon.auth import Access, Authenticator, is_loopback
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import CkptdError, ConfigError, StillRunningError

log = logging.getLogger("ckptd.daemon.http")
#: Largest request body the app reads (the peer routes stream larger uploads themselves).
MAX_BODY_BYTES = 64 * 1024
#: Path prefix of the peer routes: the only ones that accept a request body.
PEER_PREFIX = "/v1/peer/"
#: Longest wait for ``daemon.status()`` or ``daemon.is_ready()`` before the request is answered 503.
ANSWER_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0
_NOT_READY = "the daemon is not ready (starting or stopping); see /status"
#: Routes anyone may ask.
OPEN_ROUTES = frozenset({"/healthz", "/readyz"})


class ServedDaemon(Protocol):
    """What the HTTP server asks of the daemon (:class:`ckptd.daemon.service.Daemon` provides it)."""

    metrics: DaemonMetrics

    def status(self) -> dict[str, Any]: ...

    def is_ready(self) -> bool: ...


def _json(document: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(document, indent=1, sort_keys=True, default=str) + "\n", status=status,
                        content_type="application/json")


class HttpServer:
    """Serves ``daemon``'s HTTP API on ``host:port`` (port 0: the kernel picks one, :meth:`start` returns it)."""

    def __init__(self, daemon: ServedDaemon, host: str, port: int, *,
                 peer_routes: Callable[[web.Application], None] | None = None,
                 auth: Authenticator | None = None) -> None:
        self.daemon, self.host, self.port = daemon, host, port
        self.peer_routes = peer_routes
        #: Default: no token is accepted, loopback clients of this UID read /status.
        self.auth = auth or Authenticator(None, frozenset({os.geteuid()}), loopback_only=is_loopback(host))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: OwnedThread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and start serving on the ``ckptd-http`` thread; returns the bound port. A port in use or a host
        that cannot be bound raises ConfigError naming it."""
        if self._thread is not None:
            raise CkptdError("this HttpServer was started already")
        self._thread = start_thread("ckptd-http", self._serve)
        if not self._started.wait(_START_TIMEOUT_S):
            raise CkptdError(f"the HTTP server did not start on {self.host}:{self.port} within {_START_TIMEOUT_S:g} s")
        if self._start_error is not None:
            self._thread.join_within(_STOP_TIMEOUT_S)
            error = self._start_error
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {error}",
                              hint="pick a free port with `listen = \"HOST:PORT\"` (port 0 picks one)") from error
        return self.port

    def stop(self) -> None:
        """Stop serving (requests in flight get up to 10 s) and end the thread. Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.alive:
            return
        loop.call_soon_threadsafe(loop.stop)
        if not thread.join_within(_STOP_TIMEOUT_S):
            log.warning("the HTTP server thread did not stop within %g s", _STOP_TIMEOUT_S)

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        # run_in_executor(None, ...) and asyncio.to_thread (status answers, peer file reads) run here
        work = TaskPool("ckptd-http-work", min(32, (os.cpu_count() or 1) + 4))
        loop.set_default_executor(work.executor)
        try:
            try:
                loop.run_until_complete(self._bind())
            except BaseException as error:  # reported by start()
                self._start_error = error
                return
            finally:
                self._started.set()
            loop.run_forever()
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            try:
                work.close(_STOP_TIMEOUT_S)
            except StillRunningError as error:
                log.warning("the HTTP server's work did not end: %s", error)

    async def _bind(self) -> None:
        app = self.application()
        runner = web.AppRunner(app, access_log_class=_AccessLog,
                               access_log=logging.getLogger("ckptd.daemon.http.access"), handle_signals=False,
                               shutdown_timeout=_STOP_TIMEOUT_S / 2)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            self._runner = None
            raise
        self.port = runner.addresses[0][1]

    # --- the application ------------------------------------------------------------------------
    def application(self) -> web.Application:
        """The aiohttp application with every route (also used directly by tests of the routes)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard, _refuse_bodies])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        if self.peer_routes is not None:
            self.peer_routes(app)
        return app

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """The access rule of the module docstring (the peer routes check their own tokens)."""
        path = request.path
        if path in OPEN_ROUTES or path.startswith(PEER_PREFIX):
            return await handler(request)
        right = "scrape" if path == "/metrics" else "status"
        if right == "scrape" and self.auth.loopback_only:
            return await handler(request)
        header = request.headers.get("Authorization")
        access: Access | None = self.auth.identify(header) if header else None
        if access is None:
            transport = request.transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            server = transport.get_extra_info("sockname") if transport is not None else None
            access = await asyncio.get_running_loop().run_in_executor(
                None, self.auth.local_access, tuple(peer[:2]) if peer else None, tuple(server[:2]) if server else None)
        if access is not None and access.may(right):
            return await handler(request)
        client = request.remote or "?"
        if access is None:
            why = ("a token was given but is not valid" if header else "no token was given and the client is not a "
                   "local process of an allowed UID")
            log.warning("refused %s %s from %s: %s", request.method, path, client, why)
            self.daemon.metrics.error("http-auth")
            return _json({"error": f"{path} needs Authorization: Bearer <token> ({why}); see "
                                   "`ckptd daemon --print-token`"}, 401)
        log.warning("refused %s %s from %s: a %s token may not read it", request.method, path, client, access.scope)
        self.daemon.metrics.error("http-auth")
        return _json({"error": f"a {access.scope} token may not read {path}"}, 403)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            ready = await _in_executor(self.daemon.is_ready)
        except asyncio.TimeoutError:
            log.warning("the readiness check took longer than %g s", ANSWER_TIMEOUT_S)
            return _json({"ready": False, "why": f"the readiness check took longer than {ANSWER_TIMEOUT_S:g} s"}, 503)
        except Exception as error:  # a readiness check that fails means not ready, with the reason
            log.warning("the readiness check failed: %s", error)
            return _json({"ready": False, "why": f"the readiness check failed: {error}"}, 503)
        if ready:
            return _json({"ready": True})
        return _json({"ready": False, "why": _NOT_READY}, 503)

    async def _status(self, request: web.Request) -> web.Response:
        try:
            document = await _in_executor(self.daemon.status)
        except asyncio.TimeoutError:
            log.warning("the status document took longer than %g s", ANSWER_TIMEOUT_S)
            self.daemon.metrics.error("http")
            return _json({"error": f"the status document took longer than {ANSWER_TIMEOUT_S:g} s; try again"}, 503)
        except Exception as error:
            log.warning("the status document could not be made: %s", error)
            self.daemon.metrics.error("http")
            return _json({"error": f"the status document could not be made: {error}"}, 500)
        return _json(document)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.daemon.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})


async def _in_executor(question: Callable[[], Any]) -> Any:
    """``question()`` on the loop's executor, at most :data:`ANSWER_TIMEOUT_S` (asyncio.TimeoutError)."""
    return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, question), ANSWER_TIMEOUT_S)


class _AccessLog(AbstractAccessLogger):
    """One debug line per request (probes and scrapes come every few seconds; headers, and so tokens, are
    never logged)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.debug("%s %s %s %d %.1f ms", request.remote, request.method, request.path, response.status,
                          time * 1000)


@web.middleware
async def _refuse_bodies(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Only the peer routes take a request body; anything else that sends one gets 413 unread."""
    if request.body_exists and not request.path.startswith(PEER_PREFIX):
        return _json({"error": "this route takes no request body"}, 413)
    return await handler(request)
