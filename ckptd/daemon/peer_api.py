"""The peer endpoints of a daemon's HTTP server: ``/v1/peer/<namespace>/...`` (aiohttp).

What each request may do is decided by :class:`~ckptd.daemon.peer_store.PeerNamespaces`; the request
grammar is :mod:`ckptd.tiers.peer_paths`. Methods:

- ``GET .../steps`` -> ``{"steps": [...]}``; ``GET .../step-<N>`` -> ``{"files": [...]}``;
- ``GET`` / ``HEAD .../<file>``: the file, or one ``Range: bytes=a-b`` of it (206; 416 when the range
  starts at or past the end). ``GET`` serves only files of committed steps (404 otherwise, on every
  namespace); ``HEAD`` of a file of an uncommitted step answers on ``replicas/`` (its writer checks it);
- ``PUT .../<file>[?if_absent=1]``: the body (``Content-Length`` required) is streamed to a temporary
  file and renamed into place (201); 409 when the step is committed or the file exists;
- ``DELETE .../<file>`` and ``DELETE .../step-<N>`` on replica namespaces.

Every request needs ``Authorization: Bearer <token>``, compared in constant time (401 otherwise, and
always when no token is configured): the daemon's peer token, or a token derived from it
(:mod:`ckptd.daemon.auth`): a node token writes and deletes only in ``replicas/<its node id>/``, a read token
only reads; a token without the right gets 403. Bounds (:class:`PeerLimits`): requests in progress (503 beyond),
bytes of one PUT (413), bytes of one response (413: ask for a range), length of the request path (414);
the number of requests per connection is bounded by aiohttp's keep-alive handling. Errors are JSON
``{"error": "..."}``: what was refused and why, never a header, a token or a path of this machine.
Nothing is logged per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from ckptd.errors import (AlreadyCommittedError, CkptdError, ConfigError, DiskFullError, NotFoundError,
                          UnsafePathError)
from ckptd.daemon.auth import Access, Authenticator
from ckptd.daemon.peer_store import Namespace, PeerNamespaces
from ckptd.format.hashing import StreamingChunkDigest
from ckptd.tiers.peer_paths import PEER_PREFIX, PeerPath, parse_request_path

log = logging.getLogger("ckptd.daemon.peer")

#: Called with (namespace name, bytes) after a file was served or received.
ByteCounter = Callable[[str, int], None]
_RANGE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")
_IO_BLOCK = 1024 * 1024
#: Response header: how many chunks of the range failed their check here and were sent as zeros.
WITHHELD_HEADER = "X-Ckptd-Withheld-Chunks"
T = TypeVar("T")


@dataclass(frozen=True)
class PeerLimits:
    """Bounds of the peer endpoints (see the module docstring)."""

    max_concurrent: int = 16
    max_put_bytes: int = 64 * 1024 ** 3
    max_range_bytes: int = 64 * 1024 * 1024
    max_path_length: int = 1024
    #: Seconds a PUT may go without receiving a byte of its body before it is dropped (nothing is stored).
    body_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.max_concurrent, self.max_put_bytes, self.max_range_bytes, self.max_path_length,
               self.body_idle_timeout_s) <= 0:
            raise ConfigError(f"peer limits must be positive, got {self}")


def _refusal(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _status_of(error: CkptdError) -> int:
    if isinstance(error, UnsafePathError):
        return 400
    if isinstance(error, NotFoundError):
        return 404
    if isinstance(error, AlreadyCommittedError):
        return 409
    if isinstance(error, ConfigError):
        return 403
    if isinstance(error, DiskFullError):
        return 507
    return 500


def _message(error: CkptdError, asked: PeerPath | None) -> str:
    """What a refused peer is told: the reason and the path it asked for (paths of this machine, which
    errors of the local tier carry, are left out)."""
    where = asked.relative or asked.namespace_name if asked is not None else None
    text = error.message if where is None else f"{error.message} ({where})"
    return f"{text}; {error.hint}" if error.hint else text


class _PeerEndpoints:
    def __init__(self, namespaces: PeerNamespaces, auth: Authenticator, limits: PeerLimits,
                 on_served: ByteCounter | None, on_received: ByteCounter | None) -> None:
        self.namespaces, self.limits, self.auth = namespaces, limits, auth
        self._on_served, self._on_received = on_served, on_received
        self._active = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._active >= self.limits.max_concurrent:
            return _refusal(503, "too many peer requests in progress; try again", **{"Retry-After": "1"})
        self._active += 1
        try:
            return await self._handle(request)
        finally:
            self._active -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        access = self.auth.identify(request.headers.get("Authorization"))
        if access is None:
            return _refusal(401, "peer requests need Authorization: Bearer <the daemon's peer_token>",
                            **{"WWW-Authenticate": "Bearer"})
        raw_path = request.raw_path.partition("?")[0]
        if len(raw_path) > self.limits.max_path_length:
            return _refusal(414, f"the request path is longer than {self.limits.max_path_length} characters")
        asked = None
        try:
            asked = parse_request_path(raw_path)
            refused = _scope_refusal(access, request.method, asked)
            if refused is not None:
                return refused
            namespace = self.namespaces.namespace(asked.namespace)
            return await self._dispatch(request, asked, namespace)
        except CkptdError as error:
            return _refusal(_status_of(error), _message(error, asked))
        except OSError as error:  # the disk under a namespace failed (permissions, I/O error)
            where = asked.relative or asked.namespace_name if asked is not None else "?"
            log.warning("peer request for %s failed: %s", where, error.strerror or type(error).__name__)
            return _refusal(500, f"the daemon could not read or write {where}: {error.strerror or 'I/O error'}")

    async def _dispatch(self, request: web.Request, asked: PeerPath,
                        namespace: Namespace) -> web.StreamResponse:
        method = request.method
        if asked.kind == "steps" and method == "GET":
            return web.json_response({"steps": await _in_thread(self.namespaces.list_steps, namespace)})
        if asked.kind == "step" and method == "GET":
            assert asked.step is not None
            return web.json_response({"files": await _in_thread(self.namespaces.list_files, namespace, asked.step)})
        if asked.kind == "step" and method == "DELETE":
            assert asked.step is not None
            await _in_thread(self.namespaces.remove_step_dir, namespace, asked.step)
            return web.Response(status=204)
        if asked.kind == "file" and method in ("GET", "HEAD"):
            return await self._read(request, asked, namespace)
        if asked.kind == "file" and method == "PUT":
            return await self._write(request, asked, namespace)
        if asked.kind == "file" and method == "DELETE":
            await _in_thread(self.namespaces.delete, namespace, asked)
            return web.Response(status=204)
        return _refusal(405, f"{method} is not allowed here", Allow="GET, HEAD, PUT, DELETE")

    async def _read(self, request: web.Request, asked: PeerPath, namespace: Namespace) -> web.StreamResponse:
        served = await _in_thread(self.namespaces.open_served, namespace, asked, content=request.method == "GET")
        size = served.size
        try:
            span = _requested_range(request.headers.get("Range"), size)
            if span == "malformed":
                return _refusal(400, "one range of the form bytes=START-[END] is accepted")
            if span == "unsatisfiable":
                return _refusal(416, "the range starts at or past the end of the file",
                                **{"Content-Range": f"bytes */{size}"})
            start, end = span if span is not None else (0, size)
            if end - start > self.limits.max_range_bytes and request.method == "GET":
                return _refusal(413, f"a response holds at most {self.limits.max_range_bytes} bytes; read ranges")
            body: bytes | None = None
            withheld = 0
            if request.method == "GET" and served.content is not None:
                body = served.content[start:end]
            elif request.method == "GET" and served.kind == "data":
                body, withheld = await _in_thread(self.namespaces.verified_range, namespace, served, start, end)
            response = web.StreamResponse(status=206 if span is not None else 200)
            if withheld:
                response.headers[WITHHELD_HEADER] = str(withheld)
            response.headers["Accept-Ranges"] = "bytes"
            if span is not None:
                response.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            response.content_length = end - start
            if request.method == "HEAD":
                response.content_length = size
                await response.prepare(request)
                return response
            await response.prepare(request)
            try:
                if body is not None:
                    await response.write(body)
                else:
                    await _send_file(request, response, served.fd, start, end - start)
                await response.write_eof()
            except ConnectionError:  # the peer went away mid-answer; its connection is gone with it
                return response
        finally:
            os.close(served.fd)
        if self._on_served is not None:
            self._on_served(namespace.name, end - start)
        return response

    async def _write(self, request: web.Request, asked: PeerPath, namespace: Namespace) -> web.StreamResponse:
        length = request.content_length
        if length is None:
            return _refusal(411, "a peer write needs Content-Length")
        if length > self.limits.max_put_bytes:
            return _refusal(413, f"a peer write holds at most {self.limits.max_put_bytes} bytes")
        if_absent = request.query.get("if_absent") == "1"
        handle = await _in_thread(self.namespaces.begin_write, namespace, asked, if_absent=if_absent)
        hasher = StreamingChunkDigest()
        received = 0
        try:
            while received < length:
                try:
                    piece = await asyncio.wait_for(request.content.read(min(_IO_BLOCK, length - received)),
                                                   self.limits.body_idle_timeout_s)
                except asyncio.TimeoutError:
                    handle.abort()
                    return _refusal(408, f"no byte of the body came for {self.limits.body_idle_timeout_s:g} s")
                if not piece:
                    break
                received += len(piece)
                hasher.update(piece)
                await _in_thread(handle.write, piece)
            if received != length:
                handle.abort()
                return _refusal(400, f"the body held {received} bytes, not the {length} announced")
            await _in_thread(self.namespaces.finish_write, namespace, asked, handle, if_absent=if_absent,
                             digest=hasher.hexdigest())
        except BaseException:
            handle.abort()  # a client gone mid-body, a full disk: nothing is left behind
            raise
        if self._on_received is not None:
            self._on_received(namespace.name, length)
        return web.Response(status=201)


def _scope_refusal(access: Access, method: str, asked: PeerPath) -> web.Response | None:
    """403 when the token's scope does not cover ``method`` on ``asked`` (logged: a node writing into another
    node's replicas is a misconfiguration or an attack)."""
    if method in ("GET", "HEAD"):
        if access.may("peer-read"):
            return None
    elif access.may("peer-write") and access.may_write(asked.namespace):
        return None
    where = "/".join(asked.namespace)
    who = f"a {access.scope} token" + (f" of node {access.node_id}" if access.node_id else "")
    log.warning("refused peer %s in %s: %s may not", method, where, who)
    return _refusal(403, f"{who} may not {method} in {where}" + (
        "; a node writes only into replicas/<its own node id>/" if access.scope == "node" else ""))


async def _in_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(function, *args, **kwargs)


def _requested_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(start, end) of a ``Range`` header clipped to the file, None without one, or why it is refused."""
    if header is None:
        return None
    match = _RANGE.match(header.strip())
    if match is None:
        return "malformed"
    start = int(match.group(1))
    end = int(match.group(2)) + 1 if match.group(2) else size
    if end <= start:
        return "malformed"
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size)


async def _send_file(request: web.Request, response: web.StreamResponse, fd: int, offset: int, count: int) -> None:
    """Send ``count`` bytes of an open file from ``offset``: the kernel's sendfile where the transport
    allows it, else blocks read on a thread."""
    if count == 0:
        return
    transport = request.transport
    if transport is not None:
        with os.fdopen(os.dup(fd), "rb", buffering=0) as file:
            try:
                await asyncio.get_running_loop().sendfile(transport, file, offset, count)
                return
            except NotImplementedError:
                pass
    end = offset + count
    while offset < end:
        block = await asyncio.to_thread(os.pread, fd, min(_IO_BLOCK, end - offset), offset)
        if not block:
            raise ConnectionResetError("the file shrank while it was sent")
        await response.write(block)
        offset += len(block)


def add_peer_routes(app: web.Application, namespaces: PeerNamespaces, *, token: str | None,
                    limits: PeerLimits, on_served: ByteCounter | None = None,
                    on_received: ByteCounter | None = None, auth: Authenticator | None = None) -> None:
    """Add the peer endpoints (see the module docstring) to ``app``. ``on_served`` / ``on_received`` are
    called on the server's loop with (namespace name, bytes) after each file sent or stored (metrics).
    ``auth`` (default: one accepting ``token`` and the tokens derived from it) checks every request."""
    auth = auth or Authenticator(token, frozenset(), loopback_only=False)
    endpoints = _PeerEndpoints(namespaces, auth, limits, on_served, on_received)
    app.router.add_route("*", PEER_PREFIX + "{tail:.*}", endpoints.handle)


__all__ = ["ByteCounter", "PeerLimits", "PeerNamespaces", "add_peer_routes"]
