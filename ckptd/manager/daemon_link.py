"""The library's side of the node daemon's control socket.

:meth:`DaemonLink.find` locates this node's daemon for a local checkpoint directory: the socket named by
``CKPTD_DAEMON_SOCKET``, else the ``socket`` of the ``.ckptd-daemon.json`` the daemon writes into every root
it watches. It connects with a short deadline and says ``hello``; it returns None when no daemon answers or
the daemon does not watch that root. Every call of a link has a deadline and never raises: a daemon that
goes away makes the call return None (or False) and :attr:`DaemonLink.alive` False, once, with the reason in
:attr:`DaemonLink.failure`. The deadline bounds the whole request (connecting, sending and the answer), so a
daemon that answers a byte at a time is gone too. One request is in flight at a time (calls from several
threads take turns). A forked child (a DataLoader worker) never uses its parent's connection nor waits on
its parent's lock: its first request connects on its own. The protocol is described in
:mod:`ckptd.daemon.control_socket`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptd.config import settings

log = logging.getLogger("ckptd.manager")
#: The file a daemon writes into each local root it watches.
DAEMON_FILE_NAME = ".ckptd-daemon.json"
#: Environment variable naming the daemon's control socket (instead of the root's daemon file).
SOCKET_ENV = "CKPTD_DAEMON_SOCKET"
_MAX_ANSWER_BYTES = 4 * 1024 * 1024


def daemon_socket_path(local_root: Path, environ: Mapping[str, str] | None = None) -> Path | None:
    """The control socket of the daemon that watches ``local_root`` (``CKPTD_DAEMON_SOCKET``, else the root's
    ``.ckptd-daemon.json``), or None when neither names one."""
    environ = os.environ if environ is None else environ
    if environ.get(SOCKET_ENV):
        return Path(environ[SOCKET_ENV])
    try:
        document = json.loads((Path(local_root) / DAEMON_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = document.get("socket") if isinstance(document, dict) else None
    return Path(found) if isinstance(found, str) and found else None


class DaemonLink:
    """A connection to the node daemon's control socket for one local root (see the module docstring).

    Without ``local_root`` only :meth:`status` is of use (``ckptd status``)."""

    def __init__(self, socket_path: str | os.PathLike[str], local_root: str | os.PathLike[str] | None = None, *,
                 timeout_s: float | None = None) -> None:
        #: Deadline of one request, connecting included (default ``CKPTD_DAEMON_REQUEST_TIMEOUT_S``).
        self.timeout_s = settings().daemon_request_timeout_s if timeout_s is None else timeout_s
        self.socket_path = Path(socket_path)
        self.local_root = Path(local_root).resolve() if local_root is not None else None
        #: The daemon's hello answer (root_name, promotes, replicates, remote, peer_url), once :meth:`hello` worked.
        self.info: dict[str, Any] = {}
        #: Why the daemon stopped answering (None while it answers).
        self.failure: str | None = None
        #: The error the daemon answered to the latest ``committed`` it refused (None: it took the step).
        self.refusal: str | None = None
        self._socket: socket.socket | None = None
        self._buffer = b""
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @classmethod
    def find(cls, local_root: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
             timeout_s: float | None = None) -> DaemonLink | None:
        """The link to the daemon watching ``local_root``, or None when none answers ``hello`` for it."""
        path = daemon_socket_path(Path(local_root), environ)
        if path is None:
            return None
        link = cls(path, Path(local_root), timeout_s=timeout_s)
        answer = link.hello()
        if answer is None:
            log.info("no ckptd daemon answers on %s (%s): this process promotes its own steps", path, link.failure)
            link.close()
            return None
        if not answer.get("ok"):
            log.info("the ckptd daemon on %s does not take %s: %s", path, link.local_root, answer.get("error"))
            link.close()
            return None
        return link

    @property
    def alive(self) -> bool:
        """False once a request found no daemon answering."""
        return self.failure is None

    @property
    def promotes(self) -> bool:
        """Whether the daemon promotes this root to an object tier (from its hello answer)."""
        return bool(self.info.get("promotes"))

    @property
    def replicates(self) -> bool:
        """Whether the daemon replicates this root to a buddy node (from its hello answer)."""
        return bool(self.info.get("replicates"))

    # --- requests -------------------------------------------------------------------------------
    def hello(self) -> dict[str, Any] | None:
        """Ask the daemon whether it watches this root; its answer (``ok`` false: it does not), or None."""
        answer = self._ask({"op": "hello", "root": str(self.local_root)})
        if answer is not None and answer.get("ok"):
            self.info = {key: value for key, value in answer.items() if key != "ok"}
        return answer

    def committed(self, step: int) -> bool | None:
        """Tell the daemon that ``step`` is committed locally. True: it took the step; False: it answered
        that it does not promote or replicate it; None: no answer (or an error answer, logged)."""
        answer = self._ask({"op": "committed", "root": str(self.local_root), "step": step})
        if answer is None:
            return None
        if not answer.get("ok"):
            self.refusal = str(answer.get("error"))
            log.warning("the ckptd daemon refused the commit of step %d: %s", step, self.refusal)
            return None
        self.refusal = None
        return bool(answer.get("wanted", True))

    def report(self, step: int, *, save_stall_s: float | None, step_s: float | None) -> bool:
        """Report one save's stall and the step time (seconds) for the daemon's metrics; whether it answered."""
        answer = self._ask({"op": "report", "root": str(self.local_root), "step": step,
                            "save_stall_s": save_stall_s, "step_s": step_s})
        return answer is not None

    def status(self) -> dict[str, Any] | None:
        """The daemon's status document, or None (an answer without one: its error in :attr:`refusal`)."""
        answer = self._ask({"op": "status"})
        if answer is None:
            return None
        status = answer.get("status")
        if not answer.get("ok") or not isinstance(status, dict):
            self.refusal = str(answer.get("error") or "the answer holds no status document")
            return None
        return status

    def close(self) -> None:
        """Close the connection (a later request connects again)."""
        with self._lock:
            self._disconnect()

    # --- the wire -------------------------------------------------------------------------------
    def _ask(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Send one request and read its answer; on a broken connection, reconnect once and send it again
        (every request is idempotent). None, with :attr:`failure` set, when the daemon does not answer."""
        line = (json.dumps(request, separators=(",", ":")) + "\n").encode()
        self._after_fork()
        with self._lock:
            for attempt in (1, 2):
                try:
                    return self._exchange(line, time.monotonic() + self.timeout_s)
                except OSError as error:  # refused, closed, timed out, or an unreadable answer
                    self._disconnect()
                    if attempt == 2 or isinstance(error, TimeoutError):
                        self.failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                        return None
        return None  # pragma: no cover

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's connection and lock (a parent's thread may hold it)."""
        if self._pid != os.getpid():
            self._pid, self._lock = os.getpid(), threading.Lock()
            if self._socket is not None:  # closes this process's copy of the fd only: the parent's stays open
                try:
                    self._socket.close()
                except OSError:
                    pass
            self._socket, self._buffer = None, b""

    def _exchange(self, line: bytes, deadline: float) -> dict[str, Any]:
        if self._socket is None:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.settimeout(_remaining(deadline))
            try:
                connection.connect(str(self.socket_path))
            except OSError:
                connection.close()
                raise
            self._socket, self._buffer = connection, b""
        self._socket.settimeout(_remaining(deadline))
        self._socket.sendall(line)
        while b"\n" not in self._buffer:
            self._socket.settimeout(_remaining(deadline))
            received = self._socket.recv(65536)
            if not received:
                raise ConnectionError("the daemon closed the connection")
            self._buffer += received
            if len(self._buffer) > _MAX_ANSWER_BYTES:
                raise ConnectionError("the daemon's answer is too long")
        answer, _, self._buffer = self._buffer.partition(b"\n")
        try:
            decoded = json.loads(answer)
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise ConnectionError(f"unreadable answer: {error}") from error
        if not isinstance(decoded, dict):
            raise ConnectionError("the answer is not a JSON object")
        self.failure = None
        return decoded

    def _disconnect(self) -> None:
        if self._socket is not None:
            try:
                self._socket.close()
            except OSError:
                pass
        self._socket, self._buffer = None, b""

    def __repr__(self) -> str:
        root = None if self.local_root is None else str(self.local_root)
        return f"DaemonLink({str(self.socket_path)!r}, root={root!r})"


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``); TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left
