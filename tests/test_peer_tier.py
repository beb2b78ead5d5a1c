"""The peer tier against a real peer server on loopback (the conformance suite runs for the ``peer`` scheme in
``test_tier_conformance.py``): ranged reads across request pieces, URLs and tokens, a peer that is gone, a
refused token, a write whose body fails midway. Every byte read is compared with what was written."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.daemon.peer_api import PeerLimits
from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.errors import ConfigError, IntegrityError, NotFoundError, StorageError, TierMisconfiguredError, \
    TierUnreachableError
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.manager.restoring import restore_state
from ckptd.config import override
from ckptd.promotion.replicate import replicate_step
from ckptd.testing.fault_proxy import FaultProxy
from harness.peer_server import PeerServer, served_replica_tier
from ckptd.tiers import open_tier
from ckptd.tiers import peer as peer_module
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier, peer_token
from time_limit import load_per_core

TOKEN = "peer-tier-test-token-42"
HANG_GUARD_S = 15.0  # a hang guard, not a speed claim


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PeerServer]:
    with PeerServer(PeerNamespaces({"run1": tmp_path / "root"}, tmp_path / "replicas"), token=TOKEN) as served:
        yield served


@pytest.fixture
def replica(server: PeerServer) -> Iterator[PeerTier]:
    tier = PeerTier(server.url("replicas/node-a/run1"), token=TOKEN)
    yield tier
    tier.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _commit(tier: PeerTier, step: int) -> None:
    """Commit a step with a stand-in manifest: the daemon serves the bytes of committed steps only."""
    tier.write_bytes(step_file(step, MANIFEST_NAME), b"{}")


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"weights": torch.randn(300_000, generator=generator), "bias": torch.randn(7, generator=generator)}


def test_ranged_reads_across_request_pieces(replica: PeerTier, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_module, "READ_PIECE_BYTES", 64 * 1024)  # many pieces per read, cheaply
    data = os.urandom(1024 * 1024 + 333)
    path = step_file(1, "rank-00000.data")
    replica.write_bytes(path, data)
    _commit(replica, 1)
    assert replica.read_bytes(path) == data
    for offset, length in [(0, 64 * 1024), (64 * 1024 - 1, 2), (100, 300_000), (1024 * 1024, 10_000),
                           (len(data) - 1, 1), (len(data), 5), (12345, None)]:
        expected = data[offset:] if length is None else data[offset:offset + length]
        assert replica.read_bytes(path, offset, length) == expected, (offset, length)
    target = bytearray(400_001)
    replica.read_into(path, 77, memoryview(target))
    assert bytes(target) == data[77:77 + len(target)]
    with pytest.raises(IntegrityError):
        replica.read_into(path, len(data) - 10, memoryview(bytearray(64 * 1024 + 5)))


def test_open_by_url_and_token_sources(server: PeerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = server.url("replicas/node-a/run1")
    monkeypatch.delenv("CKPTD_PEER_TOKEN", raising=False)
    monkeypatch.delenv("CKPTD_PEER_TOKEN_FILE", raising=False)
    with pytest.raises(ConfigError) as caught:
        open_tier(url)
    assert "CKPTD_PEER_TOKEN" in str(caught.value)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for options, environment in [({"token": TOKEN}, {}), ({"token_file": str(token_file)}, {}),
                                 ({}, {"CKPTD_PEER_TOKEN": TOKEN}), ({}, {"CKPTD_PEER_TOKEN_FILE": str(token_file)})]:
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        tier = open_tier(url, storage_options=options)
        assert isinstance(tier, PeerTier) and tier.kind == "peer" and tier.list_step_numbers() == []
        tier.close()
        for name in environment:
            monkeypatch.delenv(name)
    assert peer_token({}, {}) is None
    with pytest.raises(ConfigError):
        peer_token({"token_file": str(tmp_path / "missing")}, {})


@pytest.mark.parametrize("url", ["peer://127.0.0.1:1/roots", "peer://127.0.0.1:1/other/x", "peer://127.0.0.1:1/",
                                 "peer://u:pw@127.0.0.1:1/roots/a", "peer://127.0.0.1:1/roots/../x",
                                 "peer://127.0.0.1:1/replicas/a/%2e%2e", "peer://127.0.0.1:x/roots/a",
                                 "peer://127.0.0.1:1/roots/a?token=t"])
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PeerTier(url, token=TOKEN)
    assert "pw" not in str(caught.value), "credentials in a URL are never shown"


def test_unreachable_peer_raises_quickly_and_restore_skips_it(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    url = f"peer://127.0.0.1:{_closed_port()}/replicas/node-a/run1"
    gone = PeerTier(url, token=TOKEN)
    started = time.monotonic()
    for call in (gone.list_step_numbers, lambda: gone.read_bytes(step_file(1, "manifest.json")),
                 lambda: gone.write_bytes(step_file(1, "x.data"), b"x")):
        with pytest.raises(TierUnreachableError) as caught:
            call()
        assert url in str(caught.value) and TOKEN not in str(caught.value)
    assert time.monotonic() - started < HANG_GUARD_S * load_per_core()

    saved = _state(3)
    with ckptd.CheckpointManager(tmp_path / "other", capture_rng=False) as manager:  # the next tier holds it
        manager.save(3, saved)
        manager.wait()
    target = {name: torch.zeros_like(value) for name, value in saved.items()}
    with caplog.at_level(logging.WARNING):
        result = restore_state([gone, LocalTier(tmp_path / "other")], target, rank=0, world_size=1)
    assert result.step == 3 and all(torch.equal(target[name], saved[name]) for name in target)
    assert any(url in record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)


def test_a_peer_that_stops_is_unreachable(server: PeerServer, replica: PeerTier) -> None:
    replica.write_bytes(step_file(2, "rank-00000.data"), b"abc")
    assert replica.size(step_file(2, "rank-00000.data")) == 3  # a kept-alive connection exists
    server.stop()
    with pytest.raises(TierUnreachableError):
        replica.exists(step_file(2, "rank-00000.data"))


def test_a_wrong_token_is_a_clear_error_and_never_shown(server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "wrong-token-never-shown"
    tier = PeerTier(server.url("replicas/node-a/run1"), token=wrong)
    with caplog.at_level(logging.DEBUG), pytest.raises(TierMisconfiguredError) as caught:
        tier.list_step_numbers()
    assert "401" in str(caught.value) and "CKPTD_PEER_TOKEN" in str(caught.value)
    assert caught.value.exit_code == 2 and isinstance(caught.value, TierUnreachableError)
    assert wrong not in str(caught.value) and wrong not in repr(tier) and wrong not in tier.label
    assert all(wrong not in record.getMessage() and TOKEN not in record.getMessage() for record in caplog.records)


def test_roots_are_served_read_only_and_committed_only(server: PeerServer, tmp_path: Path) -> None:
    saved = _state(5)
    with ckptd.CheckpointManager(tmp_path / "root", capture_rng=False) as manager:
        manager.save(5, saved)
        manager.wait()
    (tmp_path / "root" / step_dir(6)).mkdir()
    (tmp_path / "root" / step_dir(6) / "rank-00000.data").write_bytes(b"in progress")
    tier = PeerTier(server.url("roots/run1"), token=TOKEN)
    assert tier.list_step_numbers() == [5] and tier.committed_steps() == [5]
    assert tier.list_files(6) == [] and not tier.exists(step_file(6, "rank-00000.data"))
    with pytest.raises(NotFoundError):
        tier.read_bytes(step_file(6, "rank-00000.data"))
    with pytest.raises(StorageError) as caught:
        tier.write_bytes(step_file(7, "rank-00000.data"), b"x")
    assert "read only" in str(caught.value) and not (tmp_path / "root" / step_dir(7)).exists()
    target = {name: torch.zeros_like(value) for name, value in saved.items()}
    assert restore_state([tier], target, rank=0, world_size=1).step == 5
    assert all(torch.equal(target[name], saved[name]) for name in target)
    with pytest.raises(NotFoundError):
        PeerTier(server.url("roots/unknown"), token=TOKEN).list_step_numbers()


def test_a_body_that_fails_midway_stores_nothing(replica: PeerTier, tmp_path: Path) -> None:
    path = step_file(4, "rank-00000.data")
    replica.write_bytes(path, b"earlier version")

    def failing() -> Iterator[bytes]:
        yield os.urandom(256 * 1024)
        raise IntegrityError("injected: a chunk fails its check", path=path)

    with pytest.raises(IntegrityError):
        replica.write_stream(path, 1024 * 1024, failing)
    directory = tmp_path / "replicas" / "node-a" / "run1" / step_dir(4)
    deadline = time.monotonic() + HANG_GUARD_S
    while len(os.listdir(directory)) > 1 and time.monotonic() < deadline:  # the server notices the cut body
        time.sleep(0.02)
    assert os.listdir(directory) == ["rank-00000.data"], "no temporary left"
    assert (directory / "rank-00000.data").read_bytes() == b"earlier version"
    replica.write_bytes(path, b"next version")  # the connection after the cut one works
    _commit(replica, 4)
    assert replica.read_bytes(path) == b"next version"


def test_files_larger_than_one_range_keep_their_size_and_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_module, "READ_PIECE_BYTES", 64 * 1024)
    with served_replica_tier(tmp_path / "replicas", limits=PeerLimits(max_range_bytes=64 * 1024)) as tier:
        data = os.urandom(300_000)
        path = step_file(1, "rank-00000.data")
        tier.write_bytes(path, data)
        _commit(tier, 1)
        assert tier.size(path) == len(data) and tier.exists(path)
        assert tier.read_bytes(path) == data and tier.read_bytes(path, 1000, 200_000) == data[1000:201_000]


def test_a_write_past_the_servers_limit_is_refused_clearly(tmp_path: Path) -> None:
    with served_replica_tier(tmp_path / "replicas", limits=PeerLimits(max_put_bytes=1024 * 1024)) as tier:
        path = step_file(1, "rank-00000.data")
        with pytest.raises(StorageError) as caught:
            tier.write_bytes(path, os.urandom(3 * 1024 * 1024))
        assert "413" in str(caught.value) and not isinstance(caught.value, TierUnreachableError)
        assert not tier.exists(path)
        tier.write_bytes(path, b"small")  # the tier goes on working
        _commit(tier, 1)
        assert tier.read_bytes(path) == b"small"


def test_a_reader_that_leaves_mid_answer_harms_no_one(server: PeerServer, replica: PeerTier,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(24 * 1024 * 1024)
    path = step_file(3, "rank-00000.data")
    replica.write_bytes(path, data)
    _commit(replica, 3)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
                raw.sendall(f"GET /v1/peer/replicas/node-a/run1/{path} HTTP/1.1\r\nHost: x\r\n"
                            f"Authorization: Bearer {TOKEN}\r\nRange: bytes=0-{len(data) - 1}\r\n\r\n".encode())
                assert raw.recv(4096).startswith(b"HTTP/1.1 206")
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        assert replica.read_bytes(path) == data
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], "no error logged"


def test_resets_and_cut_answers_lose_nothing(tmp_path: Path, server: PeerServer) -> None:
    saved = {step: _state(step) for step in (1, 2)}
    with ckptd.CheckpointManager(tmp_path / "node-a", capture_rng=False,
                                 policy=ckptd.Policy(keep_local=None)) as manager:
        for step, state in saved.items():
            manager.save(step, state)
        manager.wait()
    local = LocalTier(tmp_path / "node-a")
    # one request in five is reset after it reached the server, or answered with half its body
    with FaultProxy(f"http://127.0.0.1:{server.port}", fraction=0.2, kinds=("reset", "truncate"), seed=3) as proxy, \
            override(io_threads=1, read_threads=1):  # one request at a time: the faults hit the same requests
        port = int(proxy.endpoint_url.rpartition(":")[2])
        flaky = PeerTier(f"peer://127.0.0.1:{port}/replicas/node-a/run1", token=TOKEN)
        for step in saved:
            progress: list[int] = []
            report = replicate_step(local, flaky, step, progress=progress.append)
            manifest = (local.root / step_dir(step) / MANIFEST_NAME).stat().st_size
            assert sum(progress) == report.bytes_sent - manifest, "retried writes are not counted twice"
        target = {name: torch.zeros_like(value) for name, value in saved[2].items()}
        assert restore_state([flaky], target, rank=0, world_size=1).step == 2
        flaky.close()
    assert proxy.faults_injected >= 3, proxy.counts
    assert all(torch.equal(target[name], saved[2][name]) for name in target)
    replicas = tmp_path / "replicas" / "node-a" / "run1"
    for step in saved:
        names = sorted(os.listdir(local.root / step_dir(step)))
        assert sorted(os.listdir(replicas / step_dir(step))) == names, "no temporary and nothing missing"
        assert all((replicas / step_dir(step) / name).read_bytes() == (local.root / step_dir(step) / name).read_bytes()
                   for name in names)


def _client_sockets_to(port: int) -> int:
    """Open sockets of this process connected to ``port`` on loopback (from /proc: no timing involved)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if int(row[2].rpartition(":")[2], 16) == port and row[9] in inodes)


def test_connections_of_ended_threads_are_closed(server: PeerServer, replica: PeerTier) -> None:
    path = step_file(2, "rank-00000.data")
    replica.write_bytes(path, b"abc")
    sizes: list[int] = []
    for _ in range(20):  # a daemon runs each replication on a fresh pool of threads
        thread = threading.Thread(target=lambda: sizes.append(replica.size(path)))
        thread.start()
        thread.join()
    assert sizes == [3] * 20
    assert _client_sockets_to(server.port) <= 2, "one connection per live thread, not per thread ever"
    replica.close()
    assert _client_sockets_to(server.port) == 0
    assert replica.size(path) == 3, "a closed tier opens a connection again when used"
    replica.close()
    assert _client_sockets_to(server.port) == 0, "and closes that one too"


def test_a_forked_child_uses_its_own_connection(server: PeerServer, replica: PeerTier) -> None:
    path = step_file(2, "rank-00000.data")
    replica.write_bytes(path, b"abc")
    _commit(replica, 2)
    assert replica.read_bytes(path) == b"abc"  # the parent holds a kept-alive connection
    with replica._lock:  # another thread of the parent is inside the tier when the fork happens
        pid = os.fork()
        if pid == 0:  # the child: its own connection, and a lock that is not held
            code = 1
            try:
                code = 0 if replica.read_bytes(path) == b"abc" else 3
            finally:
                os._exit(code)
    deadline = time.monotonic() + HANG_GUARD_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child read without a hang"
    assert replica.read_bytes(path) == b"abc", "the parent's connection was not disturbed"


@pytest.mark.parametrize("token", ["k9SECRET-one\nk9SECRET-two", "k9SECRET one", "k9SECRET\tk9SECRET", "k9SECRET-ü"],
                         ids=["newline", "space", "tab", "non-ascii"])
def test_a_token_a_header_cannot_carry_is_a_config_error_that_never_shows_it(server: PeerServer, token: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PeerTier(server.url("replicas/node-a/run1"), token=token).list_step_numbers()
    shown = str(caught.value) + repr(caught.value)
    assert "HTTP header" in shown and "k9SECRET" not in shown


def test_progress_counts_each_byte_once_when_writes_are_retried(tmp_path: Path, server: PeerServer) -> None:
    saved = _state(9)
    with ckptd.CheckpointManager(tmp_path / "node-a", capture_rng=False) as manager:
        manager.save(1, saved)
        manager.wait()
    local = LocalTier(tmp_path / "node-a")
    # resets after the request reached the daemon: each such write is sent again
    with FaultProxy(f"http://127.0.0.1:{server.port}", fraction=0.2, kinds=("reset",), seed=2) as proxy, \
            override(io_threads=1):
        port = int(proxy.endpoint_url.rpartition(":")[2])
        flaky = PeerTier(f"peer://127.0.0.1:{port}/replicas/node-a/run1", token=TOKEN)
        progress: list[int] = []
        report = replicate_step(local, flaky, 1, progress=progress.append)
        flaky.close()
    assert proxy.faults_injected >= 2, proxy.counts
    files = {name: (local.root / step_dir(1) / name).read_bytes() for name in os.listdir(local.root / step_dir(1))}
    replicas = tmp_path / "replicas" / "node-a" / "run1" / step_dir(1)
    assert {name: (replicas / name).read_bytes() for name in os.listdir(replicas)} == files
    assert sum(progress) == report.bytes_sent - len(files[MANIFEST_NAME]) == sum(map(len, files.values())) - len(
        files[MANIFEST_NAME]), "every byte once, however often it was sent"


def test_an_endless_refusal_is_not_read_whole(tmp_path: Path) -> None:
    """A buddy (broken, or not a ckptd daemon) that answers 500 with a body of 100 MB that never ends: the
    refusal is reported from its first bytes, not read into memory until a timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            client.recv(65536)
            client.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100000000\r\n\r\n"
                           b'{"error": "broken"' + b" " * (1024 * 1024))
            held.append(client)  # and nothing more, the connection kept open

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with override(peer_read_timeout_s=3.0):
            tier = PeerTier(f"peer://127.0.0.1:{listener.getsockname()[1]}/replicas/node-a/run1", token=TOKEN)
            with pytest.raises(StorageError) as caught:
                tier.list_step_numbers()
            tier.close()
        assert "HTTP 500" in str(caught.value) and not isinstance(caught.value, TierUnreachableError)
    finally:
        stop.set()
        server.join(timeout=HANG_GUARD_S)
        for client in held:
            client.close()
        listener.close()
