"""Hosts on one machine, each a Linux network namespace with its own address, joined by a bridge.

:class:`Network` makes, for one test or demo:

- a *switch* namespace holding a bridge, so nothing is created in the machine's own network namespace;
- one namespace per host (``add_host``), joined to the bridge by a veth pair made inside the two namespaces,
  with an address in 198.18.0.0/15 (RFC 2544's range for benchmarking networks, never routed) on ``eth0``
  and its loopback up.

Processes run in a host with :meth:`Network.popen` (``ip netns exec``). Faults:

- :meth:`Network.kill_host`: SIGKILL every process in the host's namespace (whatever started it);
- :meth:`Network.link_down` / :meth:`Network.link_up`: the host's link to the bridge down or up (cut off from
  every other host);
- :meth:`Network.cut_from` / :meth:`Network.reconnect`: what one host sends to one address of another (a
  service on an address of its own, :meth:`Network.add_address`) dropped silently, the rest untouched;
- :meth:`Network.partition` / :meth:`Network.heal`: traffic between two hosts dropped silently both ways
  (in both namespaces, a route to the other through a neighbour that exists nowhere: packets leave and
  vanish, as in a real partition; ``reject=True``: unreachable routes, refused at once), the rest untouched.

:meth:`Network.close` kills every process left in its namespaces and deletes them (the veth pairs and the
bridge go with them); it runs on ``with`` exit, from an ``atexit`` hook when the process ends without it,
and :func:`sweep_stale` deletes the namespaces of a harness process that was SIGKILLed. Namespace names
start with ``ckptd-c<pid>-`` (the pid of the process that made them). :func:`unavailable_reason` says why
namespaces cannot be made here (not root, no ``ip``), or None.

Every wait has a deadline; every command's failure raises :class:`NetworkError` with its output.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

SUBNET = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "ckptd-c"
_NETNS_DIR = Path("/run/netns")
#: A neighbour no host has (the last address of the range, a locally administered MAC): the next hop of
#: routes that drop a partitioned host's packets silently.
_NOWHERE = str(SUBNET.broadcast_address - 1)
_NOWHERE_MAC = "02:00:00:c4:9d:01"
_counter = itertools.count()
_open_networks: weakref.WeakSet[Network] = weakref.WeakSet()


class NetworkError(RuntimeError):
    """A namespace, link or route could not be made, changed or removed."""


def _ip(*args: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (probed by making one)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); run as root or in a privileged " \
               "container"
    probe = f"{PREFIX}{os.getpid()}-probe{next(_counter)}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot make a network namespace: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose name starts with ``prefix``."""
    if not _NETNS_DIR.is_dir():
        return []
    return sorted(entry.name for entry in _NETNS_DIR.iterdir() if entry.name.startswith(prefix))


def namespace_pids(name: str) -> list[int]:
    """The processes in namespace ``name``."""
    result = _ip("netns", "pids", name, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _kill_all(name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pids := namespace_pids(name):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise NetworkError(f"processes {pids} in namespace {name} outlived SIGKILL for {timeout_s:g} s")
        time.sleep(0.05)


def _delete(name: str) -> None:
    _kill_all(name)
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of harness processes that are gone (SIGKILLed before their cleanup ran); their
    names."""
    removed = []
    for name in namespaces():
        owner = name[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete(name)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One namespace on the bridge: its role name, namespace, address and switch-side interface."""

    name: str
    namespace: str
    address: str
    port_name: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


class Network:
    """A bridge and hosts in namespaces (see the module docstring); use as a context manager."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._logs: list[IO[bytes]] = []
        self._partitions: set[tuple[str, str]] = set()
        self._addresses = 0
        self._closed = False
        _ip("netns", "add", self.switch)
        _open_networks.add(self)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except NetworkError:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """A new namespace joined to the bridge, with the next free address of 198.18.0.0/15 on ``eth0``."""
        if name in self.hosts:
            raise NetworkError(f"host {name} exists already")
        index = len(self.hosts)
        address = self._next_address()
        host = Host(name=name, namespace=f"{self.tag}-{name}", address=address, port_name=f"p{index}")
        _ip("netns", "add", host.namespace)
        self.hosts[name] = host
        _ip("-n", self.switch, "link", "add", host.port_name, "type", "veth", "peer", "name", "eth0", "netns",
            host.namespace)
        _ip("-n", self.switch, "link", "set", host.port_name, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.port_name, "up")
        _ip("-n", host.namespace, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        return host

    def _next_address(self) -> str:
        self._addresses += 1
        return str(SUBNET.network_address + 9 + self._addresses)

    def add_address(self, host: str) -> str:
        """Another address of 198.18.0.0/15 on ``host``'s ``eth0`` (for a service that a fault cuts alone)."""
        address = self._next_address()
        _ip("-n", self.hosts[host].namespace, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        return address

    # --- processes ---------------------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: Path | None = None, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host`` (stdout and stderr into ``log``, or discarded)."""
        sink: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            sink = open(log, "ab")
            self._logs.append(sink)
        process = subprocess.Popen(self.command(host, argv), stdout=sink, stderr=subprocess.STDOUT,
                                   env=dict(env) if env is not None else None, cwd=cwd)
        self.hosts[host].processes.append(process)
        return process

    def run(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host`` to its end (killed after ``timeout_s``); its output."""
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env) if env is not None else None)

    # --- faults ------------------------------------------------------------------------------------
    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process in ``host``'s namespace and wait until they are gone; their pids."""
        pids = namespace_pids(self.hosts[host].namespace)
        _kill_all(self.hosts[host].namespace)
        for process in self.hosts[host].processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired as error:
                raise NetworkError(f"a process of {host} outlived SIGKILL") from error
        return pids

    def link_down(self, host: str) -> None:
        """Cut ``host`` off from every other host (its port on the bridge down)."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].port_name, "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].port_name, "up")

    def partition(self, first: str, second: str, *, reject: bool = False) -> None:
        """Drop traffic between ``first`` and ``second`` both ways (``reject``: refuse it at once instead)."""
        for one, other in ((first, second), (second, first)):
            namespace, target = self.hosts[one].namespace, f"{self.hosts[other].address}/32"
            if reject:
                _ip("-n", namespace, "route", "add", "unreachable", target)
                continue
            # through a neighbour that exists nowhere: packets leave and vanish, no error on either side
            _ip("-n", namespace, "neigh", "replace", _NOWHERE, "lladdr", _NOWHERE_MAC, "dev", "eth0", "nud",
                "permanent")
            _ip("-n", namespace, "route", "add", target, "via", _NOWHERE, "dev", "eth0")
        self._partitions.add(tuple(sorted((first, second))))  # type: ignore[arg-type]

    def cut_from(self, host: str, address: str) -> None:
        """Drop, silently, everything ``host`` sends to ``address`` (one service of another host: its other
        addresses stay reachable)."""
        namespace = self.hosts[host].namespace
        _ip("-n", namespace, "neigh", "replace", _NOWHERE, "lladdr", _NOWHERE_MAC, "dev", "eth0", "nud", "permanent")
        _ip("-n", namespace, "route", "add", f"{address}/32", "via", _NOWHERE, "dev", "eth0")

    def reconnect(self, host: str, address: str) -> None:
        _ip("-n", self.hosts[host].namespace, "route", "del", f"{address}/32", check=False)

    def heal(self, first: str, second: str) -> None:
        for one, other in ((first, second), (second, first)):
            _ip("-n", self.hosts[one].namespace, "route", "del", f"{self.hosts[other].address}/32", check=False)
        self._partitions.discard(tuple(sorted((first, second))))  # type: ignore[arg-type]

    # --- end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the namespaces and delete them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for host in list(self.hosts.values()) + [None]:
            name = self.switch if host is None else host.namespace
            try:
                _delete(name)
            except (NetworkError, subprocess.SubprocessError, OSError) as error:
                errors.append(f"{name}: {error}")
            if host is not None:
                for process in host.processes:
                    if process.poll() is None:
                        process.kill()
                    try:
                        process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        errors.append(f"{name}: process {process.pid} did not end")
        for sink in self._logs:
            sink.close()
        _open_networks.discard(self)
        if errors:
            raise NetworkError("cleanup left: " + "; ".join(errors))

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@atexit.register
def _close_open_networks() -> None:
    for network in list(_open_networks):
        try:
            network.close()
        except NetworkError:
            pass
