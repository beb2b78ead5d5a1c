"""The daemon's local control socket: trainers on this node say hello, report commits and timings.

:class:`ControlSocket` is an ``AF_UNIX`` stream server. One thread (``ckptd-control``) accepts; each
connection gets a thread of its own (``ckptd-control-conn``), at most :data:`MAX_CONNECTIONS` at once.
The socket file is created with mode ``0o666``: who may talk is decided by the peer's credentials, not by
the file's mode. Every connection's ``SO_PEERCRED`` UID is checked against ``allowed_uids`` before anything
is read; a refused client gets one error line, its UID is logged, and the connection is closed unread.

Protocol: one JSON object per line (at most :data:`MAX_LINE_BYTES`), one JSON line answered per request:

- ``{"op": "hello", "root": ABS}`` -> ``{"ok": true, **daemon.describe_root(name)}`` or ``{"ok": false,
  "error": ...}`` when this daemon does not watch that root;
- ``{"op": "committed", "root": ABS, "step": N}`` -> ``{"ok": true}`` (``"wanted": bool`` added when
  ``daemon.notice_commit`` says whether it journaled the step);
- ``{"op": "report", "root": ABS, "step": N, "save_stall_s": x, "step_s": y}`` -> ``{"ok": true}``;
- ``{"op": "status"}`` -> ``{"ok": true, "status": daemon.status()}``.

A bad request gets ``{"ok": false, "error": ...}`` and the connection stays open; a line too long or not
UTF-8 JSON closes it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any, Protocol

from ckptd.background import OwnedThread, start_thread
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import CkptdError, ConfigError

log = logging.getLogger("ckptd.daemon.control")
#: Longest request line read (bytes, newline included).
MAX_LINE_BYTES = 64 * 1024
#: Most connections served at once; more are answered with an error and closed.
MAX_CONNECTIONS = 64
#: A connection idle this long is closed (the library reconnects).
IDLE_TIMEOUT_S = 300.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_JOIN_TIMEOUT_S = 5.0


class ControlledDaemon(Protocol):
    """What the control socket asks of the daemon (:class:`ckptd.daemon.service.Daemon` provides it)."""

    metrics: DaemonMetrics

    def root_for(self, path: Path) -> Any: ...

    def describe_root(self, root_name: str) -> dict[str, Any]: ...

    def notice_commit(self, root_name: str, step: int) -> Any: ...

    def record_trainer_report(self, root_name: str, report: dict[str, Any]) -> None: ...

    def status(self) -> dict[str, Any]: ...


def peer_credentials(connection: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of an ``AF_UNIX`` connection (``SO_PEERCRED``)."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(raw)
    return pid, uid, gid


class ControlSocket:
    """Serves the control protocol (module docstring) for ``daemon`` on the ``AF_UNIX`` socket ``path``.

    Call order: :meth:`start` once (binds; a live daemon already on ``path`` is a ConfigError, a stale socket
    file is replaced), :meth:`stop` once (closes every connection and removes the socket file it made).
    """

    def __init__(self, daemon: ControlledDaemon, path: Path, *, allowed_uids: frozenset[int]) -> None:
        if not hasattr(socket, "SO_PEERCRED"):
            raise ConfigError("the control socket needs SO_PEERCRED to check its clients (Linux)",
                              hint="run the daemon on Linux")
        self.daemon, self.path, self.allowed_uids = daemon, Path(path), frozenset(allowed_uids)
        self._server: socket.socket | None = None
        self._accepting: OwnedThread | None = None
        self._connections: dict[socket.socket, OwnedThread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._inode: tuple[int, int] | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind ``path`` (mode 0o666) and start accepting on the ``ckptd-control`` thread."""
        self._remove_stale()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(self.path))
            os.chmod(self.path, 0o666)
            server.listen(MAX_CONNECTIONS)
        except OSError as error:
            server.close()
            raise ConfigError(f"cannot create the control socket {self.path}: {error.strerror or error}",
                              hint="check that its directory exists and is writable, or set `socket`") from error
        info = os.stat(self.path)
        self._inode = (info.st_dev, info.st_ino)
        self._server = server
        self._accepting = start_thread("ckptd-control", self._accept_loop)
        log.info("control socket %s accepts UID(s) %s", self.path, ", ".join(map(str, sorted(self.allowed_uids))))

    def stop(self) -> None:
        """Stop accepting, close every connection and remove the socket file. Safe to call twice."""
        if self._server is None or self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._server.close()
        with self._lock:
            connections = dict(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in [self._accepting, *connections.values()]:
            if thread is not None and not thread.join_within(_JOIN_TIMEOUT_S):
                log.warning("control socket thread %s did not stop within %g s", thread.name, _JOIN_TIMEOUT_S)
        self._remove_own_file()

    def _remove_stale(self) -> None:
        """A socket file left by a daemon that died is removed; one a live daemon answers on is a ConfigError."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"{self.path} exists and is not a socket", hint="remove it or set another `socket`")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink(missing_ok=True)
            return
        finally:
            probe.close()
        raise ConfigError(f"another daemon serves the control socket {self.path}",
                          hint="stop it, or give this daemon its own state_dir or `socket`")

    def _remove_own_file(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == self._inode:  # never the socket of a daemon that replaced ours
            self.path.unlink(missing_ok=True)

    # --- connections ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                connection, _ = self._server.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            self._admit(connection)

    def _admit(self, connection: socket.socket) -> None:
        try:
            pid, uid, _gid = peer_credentials(connection)
        except OSError as error:
            log.warning("refused a control connection whose credentials cannot be read: %s", error)
            connection.close()
            return
        if uid not in self.allowed_uids:
            log.warning("refused a control connection from UID %d (pid %d): not in control_allowed_uids", uid, pid)
            self.daemon.metrics.error("control")
            self._refuse(connection, f"UID {uid} may not use this control socket")
            return
        with self._lock:
            busy = len(self._connections) >= MAX_CONNECTIONS
            if not busy:  # the thread's own exit waits for this lock, so it is listed before it can leave
                self._connections[connection] = start_thread("ckptd-control-conn", self._serve, connection, uid)
        if busy:
            log.warning("refused a control connection from pid %d: %d connections open", pid, MAX_CONNECTIONS)
            self._refuse(connection, f"too many control connections ({MAX_CONNECTIONS}); try again later")

    @staticmethod
    def _refuse(connection: socket.socket, why: str) -> None:
        try:
            connection.settimeout(1.0)
            connection.sendall(_encode(_refusal(why)))
        except OSError:
            pass
        finally:
            connection.close()

    def _serve(self, connection: socket.socket, uid: int) -> None:
        try:
            connection.settimeout(IDLE_TIMEOUT_S)
            with connection.makefile("rb") as lines:
                while not self._stopping.is_set():
                    line = lines.readline(MAX_LINE_BYTES + 1)
                    if not line:
                        return
                    if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
                        connection.sendall(_encode(_refusal(f"request line longer than {MAX_LINE_BYTES} bytes")))
                        return
                    try:
                        request = json.loads(line)
                    except (ValueError, RecursionError):  # RecursionError: nested too deep
                        connection.sendall(_encode(_refusal("a request is one JSON object per line")))
                        return
                    connection.sendall(_encode(self.answer(request)))
        except OSError:  # the client went away, or idled past the timeout
            return
        finally:
            with self._lock:
                self._connections.pop(connection, None)
            connection.close()

    # --- requests -------------------------------------------------------------------------------
    def answer(self, request: Any) -> dict[str, Any]:
        """The answer to one decoded request (never raises)."""
        op = request.get("op") if isinstance(request, dict) else None
        try:
            if not isinstance(request, dict) or op not in _OPS:
                return _refusal(f"unknown op {op!r}: a request is a JSON object with op {', '.join(_OPS)}")
            if op == "status":
                return {"ok": True, "status": self.daemon.status()}
            root = request.get("root")
            if not isinstance(root, str) or not os.path.isabs(root) or "\x00" in root:
                return _refusal("'root' must be the absolute path of a local checkpoint directory")
            config = self.daemon.root_for(Path(root))
            if config is None:
                return _refusal(f"this daemon does not watch {root}")
            name = str(config.name)
            if op == "hello":
                return {"ok": True, **self.daemon.describe_root(name)}
            step = request.get("step")
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                return _refusal("'step' must be a step number (an integer >= 0)")
            if op == "committed":
                wanted = self.daemon.notice_commit(name, step)
                return {"ok": True} if not isinstance(wanted, bool) else {"ok": True, "wanted": wanted}
            timings = {key: request.get(key) for key in ("save_stall_s", "step_s")}
            bad = [key for key, value in timings.items() if value is not None and not _is_seconds(value)]
            if bad:
                return _refusal(f"{', '.join(map(repr, bad))} must be a number of seconds >= 0 or null")
            report = {"step": step, **{key: None if value is None else float(value) for key, value in timings.items()}}
            self.daemon.record_trainer_report(name, report)
            return {"ok": True}
        except CkptdError as error:
            log.warning("control request %s failed: %s", op, error)
            self.daemon.metrics.error("control")
            return _refusal(str(error))
        except Exception as error:  # a bug must not end the connection's thread silently
            log.exception("control request %s crashed", op)
            self.daemon.metrics.error("control")
            return _refusal(f"internal error: {error!r}")


#: The requests the control socket answers.
_OPS = ("hello", "committed", "report", "status")


def _refusal(why: str) -> dict[str, Any]:
    return {"ok": False, "error": why}


def _is_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _encode(answer: dict[str, Any]) -> bytes:
    return (json.dumps(answer, separators=(",", ":"), default=str) + "\n").encode()
