"""The peer tier: checkpoints held by a buddy node, read and written through that node's daemon.

URL: ``peer://HOST:PORT/NAMESPACE``, where the namespace is ``roots/<root name>`` (the buddy's own
local root, read only) or ``replicas/<node id>/<root name>`` (what this node replicated to the buddy:
read and write). Node A replicates its root ``run1`` to buddy B through
``peer://B:9470/replicas/<A's node id>/run1``, and a restore on A whose local root is gone reads from
the same URL. The wire layout is in :mod:`ckptd.tiers.peer_paths`; the server is
:mod:`ckptd.daemon.peer_api`.

Every request carries ``Authorization: Bearer <token>``. The token comes from ``storage_options``
(``token``, or ``token_file``), else the environment (``CKPTD_PEER_TOKEN``, else
``CKPTD_PEER_TOKEN_FILE``); it is never logged nor put in an error.

Transport: the standard library's :mod:`http.client`, one keep-alive connection per thread, connect
and read timeouts from the ``peer_connect_timeout_s`` and ``peer_read_timeout_s`` settings. A request
that cannot reach the daemon (refused, reset, timed out, a stale keep-alive connection) is tried again a
few times with a short back-off, and then raises :class:`~ckptd.errors.TierUnreachableError` naming the
URL, so that a restore skips the tier and reads the next one. Answers map to the error tree: 401 ->
:class:`~ckptd.errors.TierMisconfiguredError` (a wrong or missing token: set ``CKPTD_PEER_TOKEN``; exit status
2), 403 -> TierMisconfiguredError too (a token whose scope does not cover the request), 404 ->
:class:`~ckptd.errors.NotFoundError`, 409 -> :class:`~ckptd.errors.AlreadyCommittedError`, 507 ->
:class:`~ckptd.errors.DiskFullError`.

Reads are ranged GETs of at most :data:`READ_PIECE_BYTES` each (the server bounds a range's length);
:meth:`PeerTier.read_into` reads the body straight into the caller's buffer. Writes are PUTs whose body
is streamed (:meth:`PeerTier.write_stream` sends pieces as they are produced); the server writes to a
temporary file and renames it into place, and ``if_absent`` is decided there atomically.

Thread safety: every method may be called from several threads; each thread uses its own connection,
closed when a later connection is opened after that thread has ended (so that short-lived pools of a
long-running daemon do not pile up sockets). A forked child opens its own connections.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import (AlreadyCommittedError, CkptdError, ConfigError, DiskFullError, IntegrityError,
                          NotFoundError, StorageError, TierMisconfiguredError, TierUnreachableError,
                          UnsafePathError)
from ckptd.format.layout import step_dir
from ckptd.tiers.base import StorageTier, TierCapabilities
from ckptd.tiers.peer_paths import STEPS_LISTING, parse_namespace, request_path

#: Port of a daemon's HTTP server when a peer URL names none.
DEFAULT_PEER_PORT = 9470
#: Largest range one GET asks for (the server's ``max_range_bytes`` must be at least this).
READ_PIECE_BYTES = 32 * 1024 * 1024
#: Environment variables that hold the peer token, or the path of a file holding it.
TOKEN_ENV, TOKEN_FILE_ENV = "CKPTD_PEER_TOKEN", "CKPTD_PEER_TOKEN_FILE"
#: Attempts of one request whose connection failed midway (reset, cut short, a stale keep-alive), of one
#: that could not connect at all (the daemon is down: known quickly), and the pauses between attempts.
_ATTEMPTS = 4
_CONNECT_ATTEMPTS = 2
_BACKOFF_S = (0.05, 0.25, 0.5)
#: Attempts when the daemon answers "busy" (503; about 20 s of waiting in all, so that a restore with many
#: reader threads waits for a busy buddy instead of leaving it for a farther tier).
_BUSY_ATTEMPTS = 24
#: Slowest disk write speed assumed of the buddy: a write waits this long per byte, on top of the read
#: timeout, for the daemon to make the file durable (fsync) and answer.
_SLOWEST_DISK_BYTES_PER_S = 50e6
#: What a request that got no answer raises (connection refused, reset or cut, timeouts, a stale keep-alive).
_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
_TOKEN_HINT = (f"set {TOKEN_ENV} (or {TOKEN_FILE_ENV}, or storage_options token / token_file) to the "
               "peer_token of the buddy's daemon")

#: Most bytes read of an answer that is not a file's bytes (a refusal, a write's answer) and of a listing;
#: a daemon's own are far smaller, and the rest of a longer one is left with its dropped connection.
_ANSWER_BYTES = 64 * 1024
_LISTING_BYTES = 16 * 1024 * 1024
#: What a token may hold: visible ASCII, which an HTTP header carries as it is.
_TOKEN_CHARACTERS = re.compile(r"[\x21-\x7e]+")

T = TypeVar("T")


def peer_token(storage_options: Mapping[str, Any] | None = None,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token for peer requests (see the module docstring), or None when none is set."""
    options = storage_options or {}
    environ = os.environ if environ is None else environ
    if options.get("token"):
        return str(options["token"]).strip()
    path = options.get("token_file") or (None if environ.get(TOKEN_ENV) else environ.get(TOKEN_FILE_ENV))
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the peer token file: {exc.strerror}", path=str(path),
                              hint=_TOKEN_HINT) from exc
        if not token:
            raise ConfigError("the peer token file is empty", path=str(path), hint=_TOKEN_HINT)
        return token
    token = environ.get(TOKEN_ENV, "").strip()
    return token or None


class _Connection(http.client.HTTPConnection):
    """A keep-alive connection with separate connect and read timeouts."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, read_timeout_s: float) -> None:
        super().__init__(host, port, timeout=connect_timeout_s)
        self.read_timeout_s = read_timeout_s
        #: Whether a connection was ever made (a request that fails before is known to find no daemon).
        self.reached = False

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), self.timeout)
        self.reached = True
        self.sock.settimeout(self.read_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PeerTier(StorageTier):
    """A namespace of a buddy's daemon (see the module docstring). Steps are laid out as on a local
    tier (per-rank data files), so the tier keeps no chunk store."""

    kind = "peer"
    capabilities = TierCapabilities(conditional_put=True, ranged_reads=True, reads_committed_only=True)

    def __init__(self, url: str, *, token: str | None = None) -> None:
        super().__init__(url)
        parsed = urllib.parse.urlsplit(url)
        if "@" in parsed.netloc:
            raise ConfigError("a peer URL carries no credentials", hint=_TOKEN_HINT)
        if parsed.scheme != "peer" or not parsed.hostname or parsed.query or parsed.fragment:
            raise ConfigError(f"{url!r} is not a peer URL", hint="write peer://HOST:PORT/roots/<root> or "
                              "peer://HOST:PORT/replicas/<node id>/<root> (the token goes in CKPTD_PEER_TOKEN)")
        try:
            self.port = parsed.port or DEFAULT_PEER_PORT
            self.namespace = parse_namespace(parsed.path)
        except (ValueError, UnsafePathError) as exc:
            raise ConfigError(f"{url!r} is not a peer URL: {exc}",
                              hint="the namespace is roots/<root> or replicas/<node id>/<root>") from exc
        self.host = parsed.hostname
        self.url = f"peer://{parsed.netloc}/{'/'.join(self.namespace)}"
        if not token:
            raise ConfigError("no token for the peer tier", tier=self.label, hint=_TOKEN_HINT)
        if not _TOKEN_CHARACTERS.fullmatch(token):  # http.client would raise an error that shows the token
            raise ConfigError("the peer token holds characters an HTTP header cannot carry (spaces, line breaks, "
                              "control or non-ASCII characters)", tier=self.label,
                              hint="use a token of visible ASCII characters, e.g. the output of `openssl rand -hex 32`")
        self._authorization = f"Bearer {token}"
        options = settings()
        self._connect_timeout_s = options.peer_connect_timeout_s
        self._read_timeout_s = options.peer_read_timeout_s
        self._local = threading.local()
        #: Every open connection and the thread that uses it.
        self._connections: list[tuple[weakref.ref[threading.Thread], _Connection]] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 create: bool = False) -> PeerTier:
        return cls(url, token=peer_token(storage_options))

    def __repr__(self) -> str:
        return f"PeerTier({self.url!r})"

    # --- transport -----------------------------------------------------------------------------
    def _connection(self) -> _Connection:
        if self._pid != os.getpid():  # a forked child never shares its parent's sockets, nor its lock's state
            self._local, self._connections, self._lock = threading.local(), [], threading.Lock()
            self._pid = os.getpid()
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = _Connection(self.host, self.port, self._connect_timeout_s, self._read_timeout_s)
            self._local.connection = connection
            with self._lock:  # close the connections of threads that have ended (pools come and go)
                kept = []
                for owner, other in self._connections:
                    thread = owner()
                    if thread is None or not thread.is_alive():
                        other.close()
                    else:
                        kept.append((owner, other))
                self._connections = [*kept, (weakref.ref(threading.current_thread()), connection)]
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None
            with self._lock:
                self._connections = [entry for entry in self._connections if entry[1] is not connection]

    def _request(self, method: str, relative: str, *, what: str, path: str | None,
                 handle: Callable[[http.client.HTTPResponse], T], headers: Mapping[str, str] | None = None,
                 query: str = "", body: Callable[[], Iterable[Buffer]] | None = None,
                 length: int = 0) -> T:
        """Send one request and hand its response to ``handle`` (which reads the body and returns the
        result, or raises), retrying what did not reach the daemon. ``body`` makes the pieces of the
        request body (called again on a retry); an error it raises is passed on and the connection
        dropped, so that the server never sees a complete body."""
        kind = "steps" if relative == STEPS_LISTING else "step" if "/" not in relative else "file"
        target = request_path(self.namespace, relative, kind=kind) + (f"?{query}" if query else "")
        busy = attempt = 0
        while True:
            connection = self._connection()
            response = None
            try:
                response = self._send(connection, method, target, headers or {}, body, length)
                if response.status == 503 and busy + 1 < _BUSY_ATTEMPTS:
                    _small_answer(response)
                    if not response.isclosed():
                        self._drop_connection()
                    busy += 1
                    time.sleep(random.uniform(0.5, 1.0) * min(1.0, 0.02 * 2 ** busy))
                    continue
                result = handle(response)
                if response.will_close or not response.isclosed():  # closed: the answer was read whole
                    self._drop_connection()
                return result
            except _TRANSPORT_ERRORS as failure:  # no answer: the daemon is gone, or the connection was stale
                self._drop_connection()
                attempt += 1
                if attempt >= (_ATTEMPTS if connection.reached else _CONNECT_ATTEMPTS):
                    raise TierUnreachableError(
                        f"the peer daemon cannot be reached while {what}: {failure or type(failure).__name__}",
                        path=path, tier=self.label,
                        hint="restore reads the other tiers; check that the buddy's daemon runs and listens "
                             f"on {self.host}:{self.port}") from failure
                time.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S)) - 1])
            except BaseException:
                if response is None or not response.isclosed() or response.will_close:
                    self._drop_connection()  # a request or an answer left half sent or half read
                raise

    def _send(self, connection: _Connection, method: str, target: str, headers: Mapping[str, str],
              body: Callable[[], Iterable[Buffer]] | None, length: int) -> http.client.HTTPResponse:
        connection.putrequest(method, target, skip_accept_encoding=True)
        connection.putheader("Authorization", self._authorization)
        for name, value in headers.items():
            connection.putheader(name, value)
        if body is not None or method in ("PUT", "POST"):
            connection.putheader("Content-Length", str(length))
        connection.endheaders()
        if body is not None:
            sent = 0
            pieces = iter(body())
            for piece in pieces:
                view = memoryview(piece).cast("B")
                if sent + len(view) == length:  # the piece that completes the body: only if nothing follows
                    sent += sum(len(memoryview(more).cast("B")) for more in pieces)
                if sent + len(view) > length:  # the daemon never gets a whole body, so it stores nothing
                    raise IntegrityError("the body of a peer write is longer than announced", path=target,
                                         tier=self.label, expected=str(length), actual=f"more than {length}")
                connection.send(view)
                sent += len(view)
            if sent != length:
                raise IntegrityError("the body of a peer write is shorter than announced", path=target,
                                     tier=self.label, expected=str(length), actual=str(sent))
            if connection.sock is not None:  # the answer comes once the daemon has the file on its disk
                connection.sock.settimeout(self._read_timeout_s + length / _SLOWEST_DISK_BYTES_PER_S)
        try:
            return connection.getresponse()
        finally:
            if connection.sock is not None:
                connection.sock.settimeout(self._read_timeout_s)

    def _error(self, response: http.client.HTTPResponse, what: str, path: str | None) -> CkptdError:
        """The error of a refused request (its body is read here)."""
        try:
            message = str(json.loads(_small_answer(response) or b"{}").get("error", ""))[:500]
        except (ValueError, AttributeError):
            message = ""
        status = response.status
        text = f"the peer daemon refused {what} (HTTP {status}{': ' + message if message else ''})"
        if status == 401:
            text = (f"the peer daemon does not accept this peer token for {what} (HTTP 401"
                    f"{': ' + message if message else ''}); a wrong token never starts to work by retrying")
            return TierMisconfiguredError(text, path=path, tier=self.label, hint=_TOKEN_HINT)
        if status == 404:
            return NotFoundError(text, path=path, tier=self.label)
        if status == 409:
            return AlreadyCommittedError(text, path=path, tier=self.label,
                                         hint="a committed step is immutable; save a new step")
        if status == 403:
            return TierMisconfiguredError(
                text, path=path, tier=self.label,
                hint="roots/ namespaces are read only, a node token writes only into replicas/<its node id>/ and a "
                     "read token only reads: use the token `ckptd daemon --print-token SCOPE` prints for this use")
        if status == 507:
            return DiskFullError(text, path=path, tier=self.label, hint="free space on the buddy node")
        if status == 503:
            return TierUnreachableError(text, path=path, tier=self.label, hint="the buddy's daemon is busy")
        return StorageError(text, path=path, tier=self.label)

    # --- reading -------------------------------------------------------------------------------
    def _ranged(self, path: str, offset: int, length: int,
                into: Callable[[http.client.HTTPResponse, int], T], empty: Callable[[], T]) -> tuple[T, int | None]:
        """GET ``length`` bytes of ``path`` from ``offset``; ``into`` reads a 206 body of that many bytes.
        Returns the result and the file's size (None when the range started at or past the end)."""
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}

        def handle(response: http.client.HTTPResponse) -> tuple[T, int | None]:
            if response.status == 416:
                _small_answer(response)
                return empty(), None
            if response.status != 206:
                raise self._error(response, "a read", path)
            total = _total_size(response.getheader("Content-Range", ""))
            return into(response, count=int(response.getheader("Content-Length", "0"))), total

        return self._request("GET", path, what=f"reading {path}", path=path, headers=headers, handle=handle)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            self.size(path)  # absent files raise NotFoundError, like on every tier
            return b""
        pieces: list[bytes] = []
        position = offset
        end = None if length is None else offset + length
        while end is None or position < end:
            wanted = READ_PIECE_BYTES if end is None else min(READ_PIECE_BYTES, end - position)
            data, total = self._ranged(path, position, wanted, _read_exactly, lambda: b"")
            pieces.append(data)
            position += len(data)
            if total is None or position >= total or not data:
                break
        return b"".join(pieces)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        if not len(view):
            self.size(path)
            return
        done = 0
        while done < len(view):
            piece = view[done:done + READ_PIECE_BYTES]

            def fill(response: http.client.HTTPResponse, count: int, piece: memoryview = piece) -> int:
                filled = 0
                while filled < min(count, len(piece)):
                    got = response.readinto(piece[filled:count])
                    if not got:
                        raise http.client.IncompleteRead(b"", count - filled)
                    filled += got
                return filled

            filled, _ = self._ranged(path, offset + done, len(piece), fill, lambda: 0)
            done += filled
            if filled < len(piece):
                break
        if done < len(view):
            raise IntegrityError("file is shorter than its index says", path=path, tier=self.label,
                                 expected=str(offset + len(view)), actual=str(offset + done))

    def _head(self, path: str) -> int | None:
        if not _is_file_path(path):
            return None

        def handle(response: http.client.HTTPResponse) -> int | None:
            _small_answer(response)
            if response.status == 404:
                return None
            if response.status != 200:
                raise self._error(response, "a size lookup", path)
            return int(response.getheader("Content-Length", "0"))

        return self._request("HEAD", path, what=f"looking up {path}", path=path, handle=handle)

    def size(self, path: str) -> int:
        found = self._head(path)
        if found is None:
            raise NotFoundError("file not found", path=path, tier=self.label)
        return found

    def exists(self, path: str) -> bool:
        return self._head(path) is not None

    def _listing(self, relative: str, key: str, missing: list[Any] | None) -> list[Any]:
        def handle(response: http.client.HTTPResponse) -> list[Any]:
            if response.status == 404 and missing is not None:
                _small_answer(response)
                return missing
            if response.status != 200:
                raise self._error(response, "a listing", relative)
            try:
                body = response.read(_LISTING_BYTES + 1)
                if len(body) > _LISTING_BYTES:
                    raise ValueError("the listing is too long")
                listed = json.loads(body)[key]
            except (ValueError, KeyError, TypeError) as exc:
                raise StorageError("the peer daemon sent a malformed listing", path=relative,
                                   tier=self.label) from exc
            if not isinstance(listed, list):
                raise StorageError("the peer daemon sent a malformed listing", path=relative, tier=self.label)
            return listed

        return self._request("GET", relative, what="listing", path=relative, handle=handle)

    def list_step_numbers(self) -> list[int]:
        return sorted(int(step) for step in self._listing(STEPS_LISTING, "steps", None))

    def list_files(self, step: int) -> list[str]:
        return sorted(str(name) for name in self._listing(step_dir(step), "files", []))

    # --- writing -------------------------------------------------------------------------------
    def write_bytes(self, path: str, data: Buffer, *, if_absent: bool = False) -> None:
        view = memoryview(data).cast("B")
        self.write_stream(path, len(view), lambda: [view], if_absent=if_absent)

    def write_stream(self, path: str, size: int, pieces: Callable[[], Iterable[Buffer]], *,
                     if_absent: bool = False) -> None:
        """Write a file of ``size`` bytes from the pieces ``pieces()`` yields, sent as they come (a large
        file never sits in memory whole). ``pieces`` is called again when the request is retried; an
        error it raises (a chunk that fails its check) stops the write and nothing is stored. Same
        contract as :meth:`write_bytes` otherwise."""

        def handle(response: http.client.HTTPResponse) -> None:
            if response.status not in (200, 201, 204):
                raise self._error(response, f"writing {path}", path)
            _small_answer(response)

        self._request("PUT", path, what=f"writing {path}", path=path, handle=handle, body=pieces, length=size,
                      query="if_absent=1" if if_absent else "")

    def _delete(self, relative: str) -> None:
        def handle(response: http.client.HTTPResponse) -> None:
            if response.status not in (200, 204, 404):
                raise self._error(response, f"deleting {relative}", relative)
            _small_answer(response)

        self._request("DELETE", relative, what=f"deleting {relative}", path=relative, handle=handle)

    def delete_files(self, paths: list[str]) -> None:
        for path in paths:
            self._delete(path)

    def remove_step_dir(self, step: int) -> None:
        self._delete(step_dir(step))

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
            self._local = threading.local()  # a later request opens a new, tracked connection
        for _, connection in connections:
            connection.close()


def _small_answer(response: http.client.HTTPResponse) -> bytes:
    """The body of an answer that carries no file, up to :data:`_ANSWER_BYTES` (a longer one is cut; the
    connection it leaves half read is then dropped)."""
    return response.read(_ANSWER_BYTES)


def _read_exactly(response: http.client.HTTPResponse, count: int) -> bytes:
    """``count`` bytes of a response body; a body cut short raises IncompleteRead (the request is retried)."""
    data = response.read(count)
    if len(data) != count:
        raise http.client.IncompleteRead(data, count - len(data))
    return data


def _is_file_path(path: str) -> bool:
    """Whether a tier path names a file (a step directory or a listing names none)."""
    return "/" in path


def _total_size(content_range: str) -> int | None:
    """The total of a ``Content-Range: bytes a-b/total`` header."""
    _, _, total = content_range.rpartition("/")
    return int(total) if total.isdigit() else None


__all__ = ["DEFAULT_PEER_PORT", "PeerTier", "READ_PIECE_BYTES", "TOKEN_ENV", "TOKEN_FILE_ENV", "peer_token"]
