"""Buddy discovery: a ``dns://NAME:PORT`` buddy is the daemon after this one in the sorted ring of NAME's
addresses (ckptd.daemon.buddy), re-resolved as nodes join and leave.

The ring tests use a stand-in resolver (a dict of names, changed by the test, raising socket.gaierror for a
name it does not know, as getaddrinfo does). The last test runs two real daemons, on 127.0.0.1 and
127.0.0.2 with the same port, both resolving the name through that stand-in (no /etc/hosts needed): a step
committed on the first is replicated to the second, found as its buddy, and restores equal from there.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptd
from ckptd.daemon.buddy import BuddyDiscovery, ring_successor
from ckptd.daemon.config import load_config
from ckptd.daemon.service import Daemon
from ckptd.errors import ConfigError
from ckptd.format.layout import step_dir
from ckptd.testing.compare import assert_same_state
from harness.daemon_process import DaemonProcess, trainer_state, wait_until, write_config
from ckptd.tiers.local import LocalTier

NAME = "ckptd-peer.ckptd.svc"
PORT = 9470
TOKEN = "token-of-the-buddy-tests-0123456789"


class FakeDns:
    """Stands in for DNS: ``records[name]`` are the addresses a lookup returns; an unknown name fails."""

    def __init__(self, records: dict[str, list[str]] | None = None) -> None:
        self.records = dict(records or {})
        self.lookups = 0
        self._lock = threading.Lock()

    def __call__(self, name: str, port: int) -> list[str]:
        with self._lock:
            self.lookups += 1
            if name not in self.records:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return list(self.records[name])


def _discovery(dns: FakeDns, own: str, changes: list[str | None] | None = None) -> BuddyDiscovery:
    hook = changes.append if changes is not None else None
    return BuddyDiscovery(f"dns://{NAME}:{PORT}", own, resolver=dns, on_change=hook)


# --- the ring --------------------------------------------------------------------------------------

def test_each_node_replicates_to_the_next_address_and_the_last_wraps_to_the_first() -> None:
    # numeric order (10.0.0.2 < 10.0.0.3 < 10.0.0.10), not text order; a duplicate and an IPv6 record of a
    # dual-stack pod do not count
    dns = FakeDns({NAME: ["10.0.0.10", "10.0.0.2", "10.0.0.3", "10.0.0.2", "fd00::7"]})
    picked = {own: _discovery(dns, own).refresh() for own in ("10.0.0.2", "10.0.0.3", "10.0.0.10")}
    assert picked == {"10.0.0.2": f"peer://10.0.0.3:{PORT}", "10.0.0.3": f"peer://10.0.0.10:{PORT}",
                      "10.0.0.10": f"peer://10.0.0.2:{PORT}"}
    assert len(set(picked.values())) == 3, "two nodes replicate to the same buddy: one receives nothing"
    discovery = _discovery(dns, "10.0.0.3")
    discovery.refresh()
    assert discovery.members == ("10.0.0.2", "10.0.0.3", "10.0.0.10")
    assert discovery.describe()["current"] == f"peer://10.0.0.10:{PORT}"
    assert ring_successor(["fd00::1", "fd00::3", "10.0.0.1"], "fd00::3") == "fd00::1"
    ipv6 = _discovery(FakeDns({NAME: ["fd00::1", "fd00::2"]}), "fd00::2")
    assert ipv6.refresh() == f"peer://[fd00::1]:{PORT}"


def test_a_node_joining_or_leaving_moves_the_buddy_and_each_change_is_logged(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ckptd.daemon")
    dns = FakeDns({NAME: ["10.0.0.1", "10.0.0.5"]})
    changes: list[str | None] = []
    discovery = _discovery(dns, "10.0.0.1", changes)
    assert discovery.refresh() == f"peer://10.0.0.5:{PORT}"
    assert discovery.refresh() == f"peer://10.0.0.5:{PORT}"
    assert len(changes) == 1, "an unchanged ring was handed on as a change"
    dns.records[NAME] = ["10.0.0.1", "10.0.0.3", "10.0.0.5"]  # a node joins between this one and its buddy
    assert discovery.refresh() == f"peer://10.0.0.3:{PORT}"
    dns.records[NAME] = ["10.0.0.1", "10.0.0.5"]  # and leaves again
    assert discovery.refresh() == f"peer://10.0.0.5:{PORT}"
    assert changes == [f"peer://10.0.0.5:{PORT}", f"peer://10.0.0.3:{PORT}", f"peer://10.0.0.5:{PORT}"]
    moves = [record.getMessage() for record in caplog.records if "now replicates to" in record.getMessage()]
    assert len(moves) == 3 and f"before: peer://10.0.0.5:{PORT}" in moves[1], moves


def test_a_daemon_alone_has_no_buddy_and_one_not_listed_yet_still_takes_its_place(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ckptd.daemon")
    changes: list[str | None] = []
    alone = _discovery(FakeDns({NAME: ["10.0.0.1"]}), "10.0.0.1", changes)
    assert alone.refresh() is None and alone.current is None
    assert changes == [], "no buddy before, none after: nothing changed"
    assert [record.getMessage() for record in caplog.records if "only daemon behind" in record.getMessage()], \
        "a daemon that starts alone does not say why it replicates nowhere"
    caplog.clear()
    dns = FakeDns({NAME: ["10.0.0.1", "10.0.0.2"]})
    pair = _discovery(dns, "10.0.0.1", changes)
    assert pair.refresh() == f"peer://10.0.0.2:{PORT}"
    dns.records[NAME] = ["10.0.0.1"]  # the other node left
    assert pair.refresh() is None and changes == [f"peer://10.0.0.2:{PORT}", None]
    assert any("only daemon behind" in record.getMessage() for record in caplog.records)
    # a daemon that is not ready yet is not in the headless Service's records: it takes its place anyway
    assert _discovery(FakeDns({NAME: ["10.0.0.2", "10.0.0.9"]}), "10.0.0.5").refresh() == f"peer://10.0.0.9:{PORT}"
    assert _discovery(FakeDns({NAME: []}), "10.0.0.5").refresh() is None


def test_an_unresolvable_name_is_logged_and_keeps_the_buddy_chosen_before(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="ckptd.daemon")
    dns = FakeDns()
    discovery = _discovery(dns, "10.0.0.1")
    assert discovery.refresh() is None and discovery.last_error and "gaierror" in discovery.last_error
    dns.records[NAME] = ["10.0.0.1", "10.0.0.2"]
    assert discovery.refresh() == f"peer://10.0.0.2:{PORT}" and discovery.last_error is None
    del dns.records[NAME]  # a DNS hiccup must not move replicas around
    assert discovery.refresh() == f"peer://10.0.0.2:{PORT}"
    assert discovery.refresh() == f"peer://10.0.0.2:{PORT}"
    warnings = [record.getMessage() for record in caplog.records
                if record.levelno == logging.WARNING and "cannot resolve" in record.getMessage()]
    assert len(warnings) == 2, f"one warning per failure that is news, got {warnings}"
    assert f"keeping peer://10.0.0.2:{PORT}" in warnings[1] and "waits until it resolves" in warnings[0]


def test_the_refresh_thread_survives_a_failing_resolver_and_picks_the_buddy_up_later(caplog) -> None:
    failures = iter([RuntimeError("resolver bug"), socket.gaierror(socket.EAI_AGAIN, "Temporary failure")])

    def resolver(name: str, port: int) -> list[str]:
        error = next(failures, None)
        if error is not None:
            raise error
        return ["10.0.0.1", "10.0.0.2"]

    discovery = BuddyDiscovery(f"dns://{NAME}:{PORT}", "10.0.0.1", resolver=resolver, interval_s=0.02)
    discovery.start(wait_s=10)
    try:
        assert any("looking up" in record.getMessage() for record in caplog.records)
        wait_until(lambda: discovery.current == f"peer://10.0.0.2:{PORT}", 10, "the buddy after two failed lookups")
    finally:
        discovery.stop()


def test_a_static_peer_buddy_is_kept_as_given_and_never_looked_up() -> None:
    dns = FakeDns({NAME: ["10.0.0.1", "10.0.0.2"]})
    static = BuddyDiscovery("peer://10.0.0.9:9470", "10.0.0.1", resolver=dns)
    static.start()
    assert static.refresh() == static.current == "peer://10.0.0.9:9470" and not static.dynamic
    assert dns.lookups == 0
    assert BuddyDiscovery(None, "10.0.0.1", resolver=dns).refresh() is None


def test_own_address_from_a_host_name_is_the_one_the_ring_lists() -> None:
    dns = FakeDns({NAME: ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "node-b.example": ["192.168.0.2", "10.0.0.2"]})
    assert _discovery(dns, "node-b.example").refresh() == f"peer://10.0.0.3:{PORT}"


# --- the option ------------------------------------------------------------------------------------

def _load(tmp_path: Path, **overrides: Any) -> Any:
    values = {"state_dir": str(tmp_path / "state"), "local": str(tmp_path / "root"), "peer_token": TOKEN,
              **overrides}
    return load_config(None, values, {})


def test_config_takes_a_dns_buddy_and_needs_an_address_of_its_own(tmp_path: Path) -> None:
    config = _load(tmp_path, listen="10.1.2.3:9470", buddy=f"dns://{NAME}:{PORT}/")
    assert config.buddy == f"dns://{NAME}:{PORT}" and f"buddy dns://{NAME}:{PORT}" in config.describe()
    assert config.peer_url(config.roots[0]) is None, "a dns:// URL is no peer tier"
    assert config.peer_url(config.roots[0], "peer://10.1.2.4:9470") == "peer://10.1.2.4:9470/replicas/" \
        f"{config.node_id}/default"
    assert BuddyDiscovery.for_config(config).own_host == "10.1.2.3"
    with pytest.raises(ConfigError, match="advertise"):
        _load(tmp_path, listen="0.0.0.0:9470", buddy=f"dns://{NAME}:{PORT}")
    advertised = _load(tmp_path, listen="0.0.0.0:9470", buddy=f"dns://{NAME}:{PORT}", advertise="10.1.2.3")
    assert BuddyDiscovery.for_config(advertised).own_host == "10.1.2.3"
    with pytest.raises(ConfigError, match="--advertise: 'not an/address' is not an IP address"):
        _load(tmp_path, advertise="not an/address")
    with pytest.raises(ConfigError, match=r"dns://NAME:PORT"):
        _load(tmp_path, buddy=f"srv://{NAME}:{PORT}")
    with pytest.raises(ConfigError, match="is not dns://HOST:PORT"):
        _load(tmp_path, buddy=f"dns://{NAME}")
    environment = {"CKPTD_DAEMON_BUDDY": f"dns://{NAME}:{PORT}", "CKPTD_DAEMON_ADVERTISE": "10.9.9.9"}
    from_env = load_config(None, {"state_dir": str(tmp_path / "state"), "local": str(tmp_path / "root"),
                                  "peer_token": TOKEN, "listen": "0.0.0.0:9470"}, environment)
    assert from_env.advertise == "10.9.9.9"


# --- two real daemons ------------------------------------------------------------------------------

def _free_port_on_both(hosts: tuple[str, ...]) -> int:
    """A port free on every one of ``hosts`` (both daemons listen on it: a dns:// buddy names one port)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as probe:
                    probe.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {hosts}")


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.stop(5.0)


def _start(started: list[Daemon], tmp_path: Path, node: str, address: str, port: int, dns: FakeDns) -> Daemon:
    config = load_config(None, {
        "state_dir": str(tmp_path / f"{node}-state"), "node_id": node, "listen": f"{address}:{port}",
        "buddy": f"dns://{NAME}:{port}", "peer_token": TOKEN, "watch": "poll", "poll_interval_s": 0.1,
        "retry_backoff_s": 0.05, "scrub_interval_s": 0, "name": "run1", "local": str(tmp_path / f"{node}-root")}, {})
    daemon = Daemon(config, resolver=dns)
    started.append(daemon)
    daemon.start()
    return daemon


def _save(root: Path, step: int) -> None:
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(step, trainer_state(step))
        manager.wait()


def _assert_same_files(local: LocalTier, replica: LocalTier, step: int) -> None:
    names = sorted(local.list_files(step))
    assert sorted(replica.list_files(step)) == names
    for name in names:
        path = f"{step_dir(step)}/{name}"
        assert replica.read_bytes(path) == local.read_bytes(path), f"{path} differs on the buddy"


def test_two_daemons_find_each_other_in_dns_and_a_committed_step_reaches_the_buddy(
        tmp_path: Path, daemons: list[Daemon], monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_PEER_TOKEN", TOKEN)
    port = _free_port_on_both(("127.0.0.1", "127.0.0.2"))
    dns = FakeDns({NAME: ["127.0.0.1"]})  # node B's daemon is not up yet
    daemon_a = _start(daemons, tmp_path, "node-a", "127.0.0.1", port, dns)
    a_root = LocalTier(daemon_a.config.roots[0].local)
    _save(a_root.root, 1)
    assert daemon_a.is_ready() and daemon_a.describe_root("run1")["replicates"] is False, "alone, yet a buddy"
    assert "peer" not in daemon_a.status()["roots"]["run1"]["tiers"]

    dns.records[NAME] = ["127.0.0.2", "127.0.0.1"]  # node B joins: its daemon is listed
    daemon_b = _start(daemons, tmp_path, "node-b", "127.0.0.2", port, dns)
    assert daemon_b.describe_root("run1")["peer_url"] == f"peer://127.0.0.1:{port}/replicas/node-b/run1"
    assert daemon_a.buddy.refresh() == f"peer://127.0.0.2:{port}"  # A's next lookup
    peer_url = f"peer://127.0.0.2:{port}/replicas/node-a/run1"
    assert daemon_a.describe_root("run1")["peer_url"] == peer_url and daemon_a.describe_root("run1")["replicates"]
    replica_dir = daemon_b.config.replica_path / "node-a" / "run1"

    def replicated() -> list[int]:
        return LocalTier(replica_dir).committed_steps() if replica_dir.is_dir() else []

    wait_until(lambda: replicated() == [1], 60, "step 1, committed while A was alone, replicated to its new buddy")
    _save(a_root.root, 2)
    wait_until(lambda: replicated() == [1, 2], 60, "step 2 replicated to node B")
    replica = LocalTier(replica_dir)
    for step in (1, 2):
        _assert_same_files(a_root, replica, step)
    assert daemon_a.status()["buddy"]["members"] == ["127.0.0.1", "127.0.0.2"]

    # node A loses its root: a restore through the peer URL its daemon names reads node B's replica
    empty = tmp_path / "fresh-root"
    state = {key: value.new_zeros(value.shape) for key, value in trainer_state(0).items()}
    with ckptd.CheckpointManager(empty, peer=peer_url, daemon="off", capture_rng=False) as manager:
        assert manager.restore(state) == 2 and manager.last_restore.tier.startswith("peer")
    assert_same_state(state, trainer_state(2))

    dns.records[NAME] = ["127.0.0.1"]  # node B leaves
    assert daemon_a.buddy.refresh() is None
    assert daemon_a.describe_root("run1")["peer_url"] is None and daemon_a.is_ready()


def test_a_real_daemon_whose_buddy_name_does_not_resolve_is_ready_says_why_and_stops_cleanly(tmp_path: Path) -> None:
    """The ``ckptd daemon`` process with the system resolver: ``.invalid`` never resolves (RFC 6761)."""
    state = tmp_path / "state"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(tmp_path / "root")}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", peer_token=TOKEN,
                          buddy="dns://ckptd-peer.invalid:9470", scrub_interval_s=0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: "buddy: cannot resolve dns://ckptd-peer.invalid:9470" in daemon.log()
                        or "buddy: looking up dns://ckptd-peer.invalid:9470 takes more" in daemon.log(), 30,
                        "the failed lookup in the log")
        with urllib.request.urlopen(daemon.http + "/readyz", timeout=10) as response:
            assert response.status == 200
        status = daemon.get_json("/status")
        assert status["buddy"]["url"] == "dns://ckptd-peer.invalid:9470" and status["buddy"]["current"] is None
        assert "peer" not in status["roots"]["run1"]["tiers"]
        assert daemon.terminate() == 0, daemon.log()
