"""A fault-injecting HTTP proxy for tests: sits on loopback between an S3 client and an S3 endpoint.

Each request is forwarded unchanged to the upstream endpoint, except that a chosen fraction of requests
(drawn from a seeded random generator) gets one fault instead:

- ``"500"``: an ``InternalError`` response, the request never reaches the endpoint;
- ``"503"``: a ``SlowDown`` throttling response, the request never reaches the endpoint;
- ``"reset"``: the connection is reset (TCP RST) after the request was forwarded, so the client does
  not know whether it took effect;
- ``"stall"``: nothing is answered for ``stall_s`` seconds (set it past the client's read timeout),
  then the connection is closed;
- ``"truncate"``: the endpoint's response is sent with its full ``Content-Length`` but only half of
  its body (an empty body is announced as one byte), then the connection is reset; on HEAD, a reset;
- ``"cut"`` (only when asked for in ``kinds``): the connection is reset after ``cut_after_bytes`` bytes of
  the request body were received, so an upload (a part) dies mid-body and never reaches the endpoint;
  a request whose body is not longer than that is forwarded untouched.

With ``check_skew=True`` the proxy also does what AWS does and moto does not: a request whose signing
time (``X-Amz-Date``) is more than ``max_skew_s`` (15 minutes) from the proxy's clock gets
``403 RequestTimeTooSkewed`` and never reaches the endpoint (counted as ``"skewed"``).

With ``target`` (a predicate on a request's method, path with query, and body) only the requests it
accepts may get a fault (every kind but ``"cut"``, which is chosen before the body is read): e.g. 503 on
the DeleteObjects request that removes one chosen key.

Usage::

    with FaultProxy(s3_server.endpoint_url, fraction=0.2, seed=1) as proxy:
        options = proxy.storage_options(s3_server.storage_options)

Only loopback addresses are accepted, for both the proxy and the upstream.
"""

from __future__ import annotations

import calendar
import collections
import http.client
import random
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any

#: Every fault kind the proxy can inject.
FAULT_KINDS: tuple[str, ...] = ("500", "503", "reset", "stall", "truncate")
#: Fault kinds injected only when ``kinds`` names them.
EXTRA_KINDS: tuple[str, ...] = ("cut",)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "proxy-authorization",
               "te", "trailer", "upgrade", "content-length"}
_ERROR_BODIES = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 that injects faults into a fraction of the requests."""

    def __init__(self, upstream: str, *, fraction: float = 0.0, kinds: tuple[str, ...] = FAULT_KINDS,
                 stall_s: float = 2.0, seed: int = 0, upstream_timeout_s: float = 120.0,
                 cut_after_bytes: int = 1024, check_skew: bool = False, max_skew_s: float = 900.0,
                 target: Callable[[str, str, bytes], bool] | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or parsed.hostname not in _LOOPBACK or parsed.port is None:
            raise ValueError(f"upstream must be http://127.0.0.1:PORT, got {upstream!r}")
        unknown = set(kinds) - set(FAULT_KINDS) - set(EXTRA_KINDS)
        if unknown or not kinds:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {FAULT_KINDS + EXTRA_KINDS}")
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.kinds, self.stall_s, self.upstream_timeout_s = tuple(kinds), stall_s, upstream_timeout_s
        self.fraction = fraction
        self.cut_after_bytes = cut_after_bytes
        self.check_skew, self.max_skew_s = check_skew, max_skew_s
        self.target = target
        #: The proxy's clock, taken when it is built: a test that then skews this process's ``time.time``
        #: skews its client, not the store's side.
        self.clock = time.time
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        #: How many requests were seen, and how many got each fault.
        self.counts: collections.Counter[str] = collections.Counter()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        handler = type("_BoundHandler", (_Handler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="ckptd-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def storage_options(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` s3fs options with the endpoint pointed at this proxy."""
        options = dict(base)
        options["client_kwargs"] = dict(base.get("client_kwargs") or {}, endpoint_url=self.endpoint_url)
        return options

    # --- decisions --------------------------------------------------------------------------------
    def choose_fault(self) -> str | None:
        """The fault for the next request, or None to forward it untouched."""
        with self._lock:
            self.counts["requests"] += 1
            if self._random.random() >= self.fraction:
                return None
            kind = self._random.choice(self.kinds)
            self.counts[kind] += 1
            return kind

    def is_skewed(self, amz_date: str | None) -> bool:
        """Whether a request signed at ``amz_date`` (``YYYYMMDDTHHMMSSZ``) is refused as too skewed (and
        count it); a request without the header is let through (unsigned, or signed another way)."""
        if not self.check_skew or not amz_date:
            return False
        try:
            signed = calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))
        except ValueError:
            return False
        if abs(self.clock() - signed) <= self.max_skew_s:
            return False
        with self._lock:
            self.counts["skewed"] += 1
        return True

    def forgo(self, kind: str) -> None:
        """Uncount a chosen fault that did not apply (a ``"cut"`` of a body too short to cut)."""
        with self._lock:
            self.counts[kind] -= 1

    @property
    def faults_injected(self) -> int:
        return sum(count for kind, count in self.counts.items() if kind != "requests")


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        return

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The ``Date`` of the proxy's own answers, on the proxy's clock."""
        return super().date_time_string(self.proxy.clock() if timestamp is None else timestamp)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            pieces = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(pieces)
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        if self.proxy.is_skewed(self.headers.get("X-Amz-Date")):
            self._read_body()
            self._send_error(403, "RequestTimeTooSkewed", "The difference between the request time and the "
                             "current time is too large.")
            return
        fault = self.proxy.choose_fault()
        if fault == "cut":
            if int(self.headers.get("Content-Length") or 0) > self.proxy.cut_after_bytes:
                self.rfile.read(self.proxy.cut_after_bytes)
                self._reset()
                return
            self.proxy.forgo(fault)
            fault = None
        body = self._read_body()
        target = self.proxy.target
        if fault is not None and target is not None and not target(self.command, self.path, body):
            self.proxy.forgo(fault)
            fault = None
        if fault in _ERROR_BODIES:
            self._send_error(*_ERROR_BODIES[fault])
            return
        if fault == "stall":
            time.sleep(self.proxy.stall_s)
            self._reset()
            return
        try:
            status, reason, headers, answer = self._forward(body)
        except OSError:
            self._send_error(502, "BadGateway", "the upstream endpoint did not answer")
            return
        if fault == "reset":
            self._reset()
            return
        if fault == "truncate" and self.command == "HEAD":
            self._reset()  # no body to cut short
            return
        self.send_response(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        declared = max(len(answer), 1) if fault == "truncate" else len(answer)
        if self.command == "HEAD":  # a HEAD answer has no body and announces the size of the GET's
            declared = int(dict((name.lower(), value) for name, value in headers).get("content-length", 0))
        self.send_header("Content-Length", str(declared))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "truncate":  # an empty body is announced as one byte and never sent
            self.wfile.write(answer[: len(answer) // 2])
            self.wfile.flush()
            self._reset()
            return
        self.wfile.write(answer)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(self.proxy.upstream_host, self.proxy.upstream_port,
                                                timeout=self.proxy.upstream_timeout_s)
        try:
            headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
            return response.status, response.reason, response.getheaders(), answer
        finally:
            connection.close()

    def _send_error(self, status: int, code: str, message: str) -> None:
        payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                   f"</Message><RequestId>ckptd-fault-proxy</RequestId></Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _reset(self) -> None:
        """Abort the connection with a TCP RST."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
