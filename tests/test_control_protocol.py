"""The control socket's own rules, on :class:`~ckptd.daemon.control_socket.ControlSocket` in this process.

A small stand-in answers the daemon's side (which root a path is, what it does with a commit); the socket,
the protocol and :class:`~ckptd.manager.daemon_link.DaemonLink` are the real ones. Bad requests get an error
answer and the connection stays open; a line too long or not JSON closes it; a stale socket file is
replaced and a live one refused; an idle connection the daemon closed is reopened by the link; a daemon
that does not answer within the deadline makes the link report it gone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon import control_socket
from ckptd.daemon.control_socket import MAX_LINE_BYTES, ControlSocket
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import ConfigError, NotFoundError
from ckptd.manager.daemon_link import DAEMON_FILE_NAME, DaemonLink


@dataclass(frozen=True)
class _Root:
    name: str


class _StandIn:
    """Answers for one root, ``root``; records what the socket handed it."""

    def __init__(self, root: Path) -> None:
        self.root, self.metrics = root.resolve(), DaemonMetrics()
        self.commits: list[tuple[str, int]] = []
        self.reports: list[tuple[str, dict[str, Any]]] = []
        self.hold = threading.Event()  # set: notice_commit blocks until released
        self.release = threading.Event()

    def root_for(self, path: Path) -> _Root | None:
        return _Root("run1") if Path(path).resolve() == self.root else None

    def describe_root(self, root_name: str) -> dict[str, Any]:
        return {"root_name": root_name, "promotes": True, "replicates": False, "peer_url": None}

    def notice_commit(self, root_name: str, step: int) -> bool:
        if self.hold.is_set():
            self.release.wait(10)
        if step == 13:
            raise NotFoundError("the step is not committed in the local root", step=step, tier="local")
        self.commits.append((root_name, step))
        return step % 2 == 0

    def record_trainer_report(self, root_name: str, report: dict[str, Any]) -> None:
        self.reports.append((root_name, report))

    def status(self) -> dict[str, Any]:
        return {"node_id": "stand-in", "commits": len(self.commits)}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ControlSocket, _StandIn, Path]]:
    directory = Path(tempfile.mkdtemp(prefix="ckptd-proto-"))
    root = tmp_path / "root"
    root.mkdir()
    stand_in = _StandIn(root)
    server = ControlSocket(stand_in, directory / "c.sock", allowed_uids=frozenset({os.geteuid()}))
    server.start()
    (root / DAEMON_FILE_NAME).write_text(json.dumps({"socket": str(directory / "c.sock")}))
    yield server, stand_in, root
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


def _raw(path: Path) -> tuple[socket.socket, Any]:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(str(path))
    return client, client.makefile("rb")


def _ask(client: socket.socket, lines: Any, payload: bytes) -> dict[str, Any] | None:
    client.sendall(payload)
    line = lines.readline()
    return json.loads(line) if line else None


def test_link_requests_reach_the_daemon(served, monkeypatch):
    server, stand_in, root = served
    monkeypatch.delenv("CKPTD_DAEMON_SOCKET", raising=False)
    link = DaemonLink.find(root)
    assert link is not None and link.promotes and not link.replicates and link.info["root_name"] == "run1"
    assert link.committed(4) is True and link.committed(5) is False  # the daemon's "wanted" answer
    assert link.committed(13) is None and link.alive  # an error answer: the daemon is still there
    assert link.report(4, save_stall_s=0.5, step_s=None)
    assert link.status() == {"node_id": "stand-in", "commits": 2}
    link.close()
    assert stand_in.commits == [("run1", 4), ("run1", 5)]
    assert stand_in.reports == [("run1", {"step": 4, "save_stall_s": 0.5, "step_s": None})]
    assert DaemonLink.find(root.parent) is None  # no daemon file there


@pytest.mark.parametrize(("request_", "words"), [
    ({"op": "launch"}, "unknown op 'launch'"),
    (["hello"], "unknown op None"),
    ({"op": "hello", "root": "relative/dir"}, "absolute path"),
    ({"op": "hello", "root": "/tmp/a\u0000b"}, "absolute path"),  # no path has a NUL byte
    ({"op": "hello", "root": "/nowhere/watched"}, "does not watch /nowhere/watched"),
    ({"op": "committed", "step": -1}, "'step' must be a step number"),
    ({"op": "committed", "step": True}, "'step' must be a step number"),
    ({"op": "report", "step": 1, "save_stall_s": "fast"}, "'save_stall_s' must be a number of seconds"),
    ({"op": "report", "step": 1, "step_s": -2.0}, "'step_s' must be a number of seconds"),
])
def test_a_bad_request_is_answered_and_the_connection_stays(served, request_, words):
    server, stand_in, root = served
    if isinstance(request_, dict) and request_.get("op") in ("committed", "report"):
        request_ = {**request_, "root": str(root)}
    client, lines = _raw(server.path)
    with client, lines:
        answer = _ask(client, lines, json.dumps(request_).encode() + b"\n")
        assert answer is not None and answer["ok"] is False and words in answer["error"], answer
        assert _ask(client, lines, b'{"op": "status"}\n')["ok"] is True  # still served
    assert stand_in.commits == [] and stand_in.reports == []


@pytest.mark.parametrize(("payload", "words"), [
    (b"x" * (MAX_LINE_BYTES + 10) + b"\n", "longer than"),
    (b"{not json\n", "one JSON object per line"),
    (b"[" * 60_000 + b"\n", "one JSON object per line"),  # nested past the decoder's recursion limit
])
def test_a_line_too_long_or_not_json_closes_the_connection(served, payload, words):
    server, stand_in, _ = served
    client, lines = _raw(server.path)
    with client, lines:
        answer = _ask(client, lines, payload)
        assert answer is not None and answer["ok"] is False and words in answer["error"]
        assert lines.readline() == b""  # closed


def test_a_stale_socket_is_replaced_and_a_live_one_refused(served, tmp_path):
    server, stand_in, _ = served
    with pytest.raises(ConfigError, match="another daemon serves the control socket"):
        ControlSocket(stand_in, server.path, allowed_uids=frozenset({0})).start()
    stale_dir = Path(tempfile.mkdtemp(prefix="ckptd-stale-"))
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(stale_dir / "s.sock"))
        stale.close()  # the file stays, nobody listens: what a SIGKILLed daemon leaves
        replacement = ControlSocket(stand_in, stale_dir / "s.sock", allowed_uids=frozenset({0}))
        replacement.start()
        replacement.stop()
        assert not (stale_dir / "s.sock").exists()  # removed on stop
        (stale_dir / "plain").write_text("not a socket")
        with pytest.raises(ConfigError, match="exists and is not a socket"):
            ControlSocket(stand_in, stale_dir / "plain", allowed_uids=frozenset({0})).start()
    finally:
        shutil.rmtree(stale_dir, ignore_errors=True)


def test_an_idle_connection_closed_by_the_daemon_is_reopened(served, monkeypatch):
    server, stand_in, root = served
    monkeypatch.setattr(control_socket, "IDLE_TIMEOUT_S", 0.2)
    link = DaemonLink(server.path, root)
    assert link.hello()["ok"]
    deadline = time.monotonic() + 30
    while server._connections and time.monotonic() < deadline:  # the daemon closes the idle connection
        threading.Event().wait(0.02)
    assert not server._connections, "the daemon never closed the idle connection"
    assert link.committed(2) is True and link.alive
    link.close()
    assert stand_in.commits == [("run1", 2)]


def test_a_daemon_that_does_not_answer_in_time_is_gone(served):
    server, stand_in, root = served
    link = DaemonLink(server.path, root, timeout_s=0.3)
    assert link.hello()["ok"]
    stand_in.hold.set()
    try:
        assert link.committed(2) is None
        assert not link.alive and "timed out" in (link.failure or "").lower()
    finally:
        stand_in.release.set()
        link.close()


def test_too_many_connections_are_refused_with_a_reason(served, monkeypatch):
    server, stand_in, _ = served
    monkeypatch.setattr(control_socket, "MAX_CONNECTIONS", 2)
    opened = [_raw(server.path) for _ in range(2)]
    try:
        for client, lines in opened:  # both admitted and served
            assert _ask(client, lines, b'{"op": "status"}\n')["ok"] is True
        client, lines = _raw(server.path)
        with client, lines:
            answer = json.loads(lines.readline())
            assert answer["ok"] is False and "too many control connections" in answer["error"]
    finally:
        for client, lines in opened:
            lines.close()
            client.close()


@pytest.mark.parametrize("pin_directory", [None, ".daemon-pins"])
def test_the_managers_pin_is_kept_for_a_daemon_that_shares_it_and_released_otherwise(served, monkeypatch,
                                                                                     pin_directory):
    import torch

    import ckptd
    from ckptd.promotion.pinning import PinnedSteps
    from ckptd.tiers.local import LocalTier

    server, stand_in, root = served
    monkeypatch.delenv("CKPTD_DAEMON_SOCKET", raising=False)
    described = stand_in.describe_root
    if pin_directory is not None:
        monkeypatch.setattr(stand_in, "describe_root", lambda name: {**described(name), "pin_directory": pin_directory})
    with ckptd.CheckpointManager(root, capture_rng=False, policy=ckptd.Policy(keep_local=None)) as manager:
        assert manager.daemon_promotes
        assert manager._pin_directories() == [".promoting"] + ([pin_directory] if pin_directory else [])
        for step in (1, 2):  # the stand-in takes even steps only
            manager.save(step, {"weights": torch.full((1024,), float(step))})
            manager.wait()
    assert stand_in.commits == [("run1", 1), ("run1", 2)]
    assert [report["step"] for _, report in stand_in.reports] == [1, 2]
    pinned = PinnedSteps(LocalTier(root)).pinned()
    assert pinned == ([2] if pin_directory is None else [])  # step 1, not taken, is released either way


class _TricklingDaemon:
    """A real AF_UNIX server that reads a request and answers it one byte at a time, never finishing the line
    (or, with ``answer``, sends that answer at once)."""

    def __init__(self, path: Path, answer: bytes | None = None) -> None:
        self.path, self.answer = path, answer
        self.finished = threading.Event()  # set once it stopped trickling (after 20 s, or at close)
        self._stop = threading.Event()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(4)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            connection, _ = self._server.accept()
        except OSError:
            return
        with connection:
            connection.recv(65536)
            if self.answer is not None:
                connection.sendall(self.answer)
                self._stop.wait(20)
            else:
                for _ in range(400):
                    if self._stop.wait(0.05):
                        break
                    connection.sendall(b" ")
        self.finished.set()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(10)


def test_a_daemon_that_answers_a_byte_at_a_time_is_gone_within_the_deadline(tmp_path):
    directory = Path(tempfile.mkdtemp(prefix="ckptd-trickle-"))
    daemon = _TricklingDaemon(directory / "t.sock")
    try:
        link = DaemonLink(daemon.path, tmp_path, timeout_s=0.5)
        assert link.committed(2) is None
        assert not daemon.finished.is_set(), "the link waited for the daemon to stop trickling"
        assert not link.alive and "timed out" in (link.failure or "").lower()
    finally:
        daemon.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_an_answer_nested_too_deep_is_no_answer_not_an_exception(tmp_path):
    directory = Path(tempfile.mkdtemp(prefix="ckptd-nested-"))
    daemon = _TricklingDaemon(directory / "n.sock", answer=b"[" * 200_000 + b"\n")
    try:
        link = DaemonLink(daemon.path, tmp_path, timeout_s=1)
        assert link.hello() is None and not link.alive  # asked again once, on a connection never answered
    finally:
        daemon.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_forked_child_talks_on_its_own_connection_while_the_parent_waits_for_an_answer(served):
    import time

    server, stand_in, root = served
    link = DaemonLink(server.path, root, timeout_s=30)
    assert link.hello()["ok"]
    stand_in.hold.set()  # the parent's next request waits inside the daemon, holding the link's lock
    answers: list[bool | None] = []
    parent = threading.Thread(target=lambda: answers.append(link.committed(2)))
    parent.start()
    while not stand_in.hold.is_set() or not link._lock.locked():
        threading.Event().wait(0.01)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker forked while the writer thread waits for the daemon
        try:
            os._exit(0 if link.report(7, save_stall_s=0.25, step_s=1.0) else 1)
        finally:
            os._exit(2)
    try:
        deadline = time.monotonic() + 30
        status = None
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
            threading.Event().wait(0.05)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0, "the child's request got no answer"
        assert [report["step"] for _, report in stand_in.reports] == [7]
    finally:
        stand_in.release.set()
        parent.join(30)
    assert answers == [True], "the parent's own answer reached the parent"
    assert link.alive
    link.close()


def test_ckptd_status_tells_a_daemon_that_answers_an_error_from_no_daemon(served, monkeypatch):
    from click.testing import CliRunner

    from ckptd.cli.main import cli

    server, stand_in, _ = served
    monkeypatch.delenv("CKPTD_DAEMON_SOCKET", raising=False)
    shown = CliRunner().invoke(cli, ["status", "--socket", str(server.path), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["node_id"] == "stand-in"

    def broken() -> dict[str, Any]:
        raise NotFoundError("the journal is gone")

    monkeypatch.setattr(stand_in, "status", broken)
    shown = CliRunner().invoke(cli, ["status", "--socket", str(server.path)])
    assert shown.exit_code == 1 and "answered without its status: the journal is gone" in shown.output
    server.stop()
    shown = CliRunner().invoke(cli, ["status", "--socket", str(server.path)])
    assert shown.exit_code == 3 and "no ckptd daemon answers" in shown.output
