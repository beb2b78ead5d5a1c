"""The cluster harness's own tests (``tests/cluster/netns.py``): hosts reach one another over the bridge on
their 198.18.0.0/15 addresses, a partition cuts exactly its pair, a link down cuts a host off, killing a host
kills every process in it, and every namespace and link is removed on close, after a failure, at interpreter
exit and, for a harness process that was SIGKILLed, by the next run's sweep. Nothing is made in this machine's
own network namespace."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.daemon_process import wait_until as daemon_wait_until

from netns import SUBNET, Network, namespace_pids, namespaces, sweep_stale, unavailable_reason

pytestmark = pytest.mark.usefixtures("namespaces_available")

HERE = Path(__file__).parent
#: A TCP server on ADDRESS:PORT that accepts and closes connections until killed.
SERVER = ("import socket, sys\n"
          "server = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
          "print('listening', flush=True)\n"
          "while True:\n"
          "    server.accept()[0].close()\n")
#: Connects to ADDRESS:PORT within a deadline; prints ok, or the error's class name and exits 1.
PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
         "except OSError as error:\n"
         "    print(type(error).__name__); sys.exit(1)\n"
         "print('ok')\n")


def _reach(network: Network, source: str, target: str, timeout_s: float = 1.0) -> str:
    address = network.hosts[target].address if target in network.hosts else target
    result = network.run(source, [sys.executable, "-c", PROBE, address, "7000", str(timeout_s)])
    return result.stdout.strip()


def _serve(network: Network, host: str, tmp_path: Path, address: str | None = None) -> subprocess.Popen[bytes]:
    address = address or network.hosts[host].address
    log = tmp_path / f"server-{address}.log"
    process = network.popen(host, [sys.executable, "-c", SERVER, address, "7000"], log=log)
    deadline = time.monotonic() + 60
    while "listening" not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    return process


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_reach_each_other_and_faults_cut_exactly_what_they_name(tmp_path: Path) -> None:
    before = _root_links()
    with Network() as network:
        for name in ("a", "b", "c"):
            network.add_host(name)
        assert all(ipaddress.ip_address(host.address) in SUBNET for host in network.hosts.values())
        assert len({host.address for host in network.hosts.values()}) == 3
        _serve(network, "b", tmp_path)
        assert _reach(network, "a", "b") == "ok"
        network.partition("a", "b")
        assert _reach(network, "a", "b") == "TimeoutError"  # dropped silently, as in a real partition
        assert _reach(network, "c", "b") == "ok"
        network.heal("a", "b")
        assert _reach(network, "a", "b") == "ok"
        network.partition("a", "b", reject=True)
        assert _reach(network, "a", "b") != "ok"
        network.heal("a", "b")
        network.link_down("b")
        assert _reach(network, "a", "b") != "ok" and _reach(network, "c", "b") != "ok"
        network.link_up("b")
        assert _reach(network, "a", "b", timeout_s=10.0) == "ok"
        # a service on an address of its own is cut alone
        service = network.add_address("b")
        assert ipaddress.ip_address(service) in SUBNET
        _serve(network, "b", tmp_path, service)
        network.cut_from("a", service)
        assert _reach(network, "a", service) == "TimeoutError"
        assert _reach(network, "a", "b") == "ok" and _reach(network, "c", service) == "ok"
        network.reconnect("a", service)
        assert _reach(network, "a", service) == "ok"
        assert _root_links() == before, "the harness changed this machine's own network namespace"
    assert _root_links() == before


def test_killing_a_host_kills_every_process_in_it(tmp_path: Path) -> None:
    with Network() as network:
        network.add_host("a")
        network.add_host("b")
        survivor = network.popen("b", ["sleep", "600"])
        # a process that leaves a grandchild in a session of its own (no parent to take it down with it)
        network.popen("a", ["sh", "-c", "setsid sleep 600 & sleep 600"])
        namespace = network.hosts["a"].namespace
        deadline = time.monotonic() + 30
        while len(namespace_pids(namespace)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = namespace_pids(namespace)
        assert len(pids) >= 3
        killed = network.kill_host("a")
        assert set(pids) <= set(killed)
        assert namespace_pids(namespace) == []
        assert not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids)
        assert survivor.poll() is None, "killing host a killed a process of host b"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_everything_is_removed_after_a_failure_inside_the_with_block() -> None:
    before = set(namespaces())
    with pytest.raises(RuntimeError, match="scenario failed"):
        with Network() as network:
            network.add_host("a")
            sleeper = network.popen("a", ["sleep", "600"])
            made = set(namespaces()) - before
            assert len(made) == 2  # the switch and host a
            raise RuntimeError("scenario failed")
    assert set(namespaces()) == before
    assert sleeper.poll() is not None


def _harness_process(tail: str) -> subprocess.Popen[str]:
    script = (f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
              "from netns import Network\n"
              "network = Network(); network.add_host('a'); network.popen('a', ['sleep', '600'])\n"
              "print(' '.join(h.namespace for h in network.hosts.values()), network.switch, flush=True)\n" + tail)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_an_exit_without_close_removes_the_namespaces() -> None:
    process = _harness_process("")  # the script ends without closing: the atexit hook cleans up
    made = process.stdout.readline().split() if process.stdout else []
    assert process.wait(timeout=120) == 0
    assert made and not set(made) & set(namespaces())


def test_a_killed_harness_leaves_namespaces_that_the_next_sweep_removes() -> None:
    process = _harness_process("import time; time.sleep(600)\n")
    made = process.stdout.readline().split() if process.stdout else []
    assert made and set(made) <= set(namespaces())
    # `ip netns exec` enters the namespace a moment after popen returns: wait for it (a deadline, not a bound)
    sleepers = daemon_wait_until(lambda: [pid for name in made for pid in namespace_pids(name)], 60,
                                 "the harness's sleeper inside its namespace")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert set(made) <= set(namespaces()), "SIGKILL leaves no chance to clean up"
    removed = sweep_stale()
    assert set(made) <= set(removed)
    assert not set(made) & set(namespaces())
    assert not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in sleepers)


def test_the_reason_to_skip_names_root_for_an_unprivileged_user() -> None:
    # the system's Python: this run's may live where an unprivileged user cannot read (the module needs only
    # the standard library)
    python = next((path for path in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(path, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 an unprivileged user can run")
    script = (f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
              "from netns import unavailable_reason\nprint(unavailable_reason())\n")
    result = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60, user=65534,
                            env={"PATH": os.environ.get("PATH", "")}, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "root" in result.stdout
    assert unavailable_reason() is None  # this run could make them


def test_byte_counters_are_read_from_a_daemons_metrics() -> None:
    from ckptd.daemon.metrics import DaemonMetrics

    from cluster import parse_byte_counters

    metrics = DaemonMetrics()
    metrics.promoted("rank0", 100, 1.0)
    metrics.promoted("rank1", 50, 1.0)
    metrics.replicated("rank0", 30, 1.0)
    metrics.peer_served(7)
    counters = parse_byte_counters(metrics.render()[0].decode())
    assert counters == {"ckptd_promoted_bytes_total": 150.0, "ckptd_replicated_bytes_total": 30.0,
                        "ckptd_peer_served_bytes_total": 7.0}
