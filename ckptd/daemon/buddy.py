"""Which node's daemon this daemon replicates to: a fixed buddy, or one found in DNS.

``buddy = "peer://HOST:PORT"`` names the buddy once and for all. ``buddy = "dns://NAME:PORT"`` names every
node's daemon at once, as a Kubernetes headless Service does (``dns://ckptd-peer.ckptd.svc:9470`` lists the
pod IP of every ready daemon of the DaemonSet). The daemon then resolves NAME (every A or AAAA record of its
own address's family), adds its own address when DNS does not list it yet (a daemon becomes ready, hence
listed, after it starts), sorts the addresses and takes the one after its own, the last wrapping to the
first: ``peer://ADDR:PORT``. Every daemon computes the same ring, so each replicates to one node and receives
from one. Its own address is ``advertise`` when set, else the host of ``listen``.

NAME is resolved again every :data:`REFRESH_S` seconds on the ``ckptd-daemon-buddy`` thread, so that a
node joining or leaving moves the buddy; each change is logged and handed to ``on_change``. A daemon alone
in the ring has no buddy (replication idles, readiness is not affected). A failed lookup is logged and keeps
the buddy chosen before it: a DNS hiccup must not move replicas around.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.background import OwnedThread, start_thread

if TYPE_CHECKING:
    from ckptd.daemon.config import DaemonConfig

log = logging.getLogger("ckptd.daemon")

#: Seconds between two lookups of a ``dns://`` buddy's name.
REFRESH_S = 30.0
#: How long :meth:`BuddyDiscovery.start` waits for the first lookup before the daemon goes on without it.
FIRST_LOOKUP_WAIT_S = 5.0
#: How long :meth:`BuddyDiscovery.stop` waits for the refresh thread (a slow lookup) to end.
STOP_WAIT_S = 5.0

#: ``(name, port) -> addresses``: every address ``name`` resolves to (raises OSError when it does not).
Resolver = Callable[[str, int], Sequence[str]]
#: Called with the new buddy's ``peer://ADDR:PORT`` URL, or None when no node is left to replicate to.
BuddyHook = Callable[["str | None"], None]

def resolve_all(name: str, port: int) -> list[str]:
    """Every TCP address of ``name`` (A and AAAA records, ``/etc/hosts``), through ``socket.getaddrinfo``."""
    return [info[4][0] for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)]


@dataclass(frozen=True)
class BuddyUrl:
    """A parsed ``buddy`` option: ``scheme`` is ``peer`` (a fixed buddy) or ``dns`` (a ring found in DNS)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> BuddyUrl:
        """``peer://HOST:PORT`` or ``dns://NAME:PORT`` (IPv6 in brackets); ValueError otherwise (the daemon's
        config checks the option first, with a clearer message)."""
        scheme, separator, rest = url.partition("://")
        host, colon, port = rest.rstrip("/").rpartition(":")
        if scheme not in ("peer", "dns") or not separator or not colon or not host or not port.isdigit():
            raise ValueError(f"{url!r} is not peer://HOST:PORT nor dns://NAME:PORT")
        return cls(scheme, host.removeprefix("[").removesuffix("]"), int(port))


def peer_address(address: str, port: int) -> str:
    """``peer://ADDR:PORT``, an IPv6 address in brackets."""
    host = f"[{address}]" if ":" in address else address
    return f"peer://{host}:{port}"


def ring_of(addresses: Iterable[str], own: str) -> tuple[str, ...]:
    """The sorted ring of ``addresses`` plus ``own``: the addresses of ``own``'s family, each once."""
    own_ip = ipaddress.ip_address(own)
    members = {ip for ip in map(_ip, addresses) if ip is not None and ip.version == own_ip.version}
    return tuple(str(ip) for ip in sorted(members | {own_ip}))


def ring_successor(addresses: Iterable[str], own: str) -> str | None:
    """The address after ``own`` in :func:`ring_of` ``(addresses, own)``, the last one wrapping to the first;
    None when ``own`` is alone."""
    ring = ring_of(addresses, own)
    if len(ring) == 1:
        return None
    return ring[(ring.index(str(ipaddress.ip_address(own))) + 1) % len(ring)]


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class BuddyDiscovery:
    """The current buddy of one daemon (see the module docstring).

    Call order: :meth:`start` once (a ``dns://`` buddy: first lookup, then the refresh thread), read
    :attr:`current` from any thread, :meth:`stop` once. :meth:`refresh` may also be called directly (tests,
    or to react at once); ``on_change`` runs on the thread that refreshed, one change at a time."""

    def __init__(self, url: str | None, own_host: str | None, *, resolver: Resolver | None = None,
                 interval_s: float = REFRESH_S, on_change: BuddyHook | None = None) -> None:
        self.url = url
        self.spec = BuddyUrl.parse(url) if url else None
        self.own_host = own_host
        self.resolver: Resolver = resolver or resolve_all
        self.interval_s = interval_s
        self.on_change = on_change
        #: The addresses of the last successful lookup (this node's own included), sorted.
        self.members: tuple[str, ...] = ()
        #: The error of the last lookup, None when it worked.
        self.last_error: str | None = None
        self._current = url if self.spec is not None and self.spec.scheme == "peer" else None
        self._resolved = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: OwnedThread | None = None

    @classmethod
    def for_config(cls, config: DaemonConfig, **kwargs: Any) -> BuddyDiscovery:
        """The discovery of ``config.buddy``, this node being ``config.advertise`` or ``listen``'s host."""
        return cls(config.buddy, config.advertise or config.listen_host, **kwargs)

    @property
    def dynamic(self) -> bool:
        """Whether the buddy is found in DNS (and may change)."""
        return self.spec is not None and self.spec.scheme == "dns"

    @property
    def current(self) -> str | None:
        """``peer://ADDR:PORT`` of the buddy daemon now, or None (no buddy configured, alone, not resolved)."""
        return self._current

    def start(self, wait_s: float = FIRST_LOOKUP_WAIT_S) -> None:
        """For a ``dns://`` buddy, start the refresh thread and wait up to ``wait_s`` for its first lookup (a
        slow resolver does not hold the daemon's start; the buddy then comes with a later lookup)."""
        if not self.dynamic or self._thread is not None:
            return
        first = threading.Event()
        self._thread = start_thread("ckptd-daemon-buddy", self._run, first)
        if not first.wait(wait_s):
            log.warning("buddy: looking up %s takes more than %.0fs; the daemon starts without a buddy", self.url,
                        wait_s)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop the refresh thread, waiting at most ``timeout_s`` for it to end (a lookup in progress is then
        left to finish on its own)."""
        self._stop.set()
        if self._thread is not None and not self._thread.join_within(timeout_s):
            log.info("buddy: a lookup of %s is still in progress; it ends on its own", self.url)

    def refresh(self) -> str | None:
        """Look the name up once and move the buddy when the ring changed; returns the current buddy."""
        if not self.dynamic:
            return self._current
        assert self.spec is not None
        with self._lock:
            try:
                addresses = list(self.resolver(self.spec.host, self.spec.port))
                own = self._own_address(addresses)
            except (OSError, UnicodeError, ValueError) as error:
                self._lookup_failed(error)
                return self._current
            if self.last_error is not None:
                log.info("buddy: %s resolves again", self.url)
            self.last_error = None
            self.members = ring_of(addresses, own)
            successor = ring_successor(addresses, own)
            new = peer_address(successor, self.spec.port) if successor is not None else None
            first, self._resolved = not self._resolved, True
            if new == self._current and not first:
                return new
            old, self._current = self._current, new
            if new is None:
                log.info("buddy: this node (%s) is the only daemon behind %s: no buddy, replication waits for "
                         "another node", own, self.url)
            else:
                log.info("buddy: %s lists %d daemon(s) [%s]; this node (%s) now replicates to %s (before: %s)",
                         self.url, len(self.members), ", ".join(self.members), own, new, old or "none")
            if self.on_change is not None and new != old:
                try:
                    self.on_change(new)
                except Exception:  # noqa: BLE001 - the refresh thread must live on
                    log.exception("buddy: applying the change to %s failed", new)
            return new

    def describe(self) -> dict[str, Any]:
        """For the status document: the configured URL, the buddy now, the ring and the last lookup error."""
        return {"url": self.url, "current": self._current, "members": list(self.members), "error": self.last_error}

    def _own_address(self, listed: Sequence[str]) -> str:
        """This node's address: ``own_host`` when it is an IP address, else the one of its addresses that the
        ring lists (or its first)."""
        if not self.own_host:
            raise ValueError("this daemon has no address of its own (set advertise)")
        host = self.own_host.removeprefix("[").removesuffix("]")
        if _ip(host) is not None:
            return str(ipaddress.ip_address(host))
        assert self.spec is not None
        mine = sorted(set(self.resolver(host, self.spec.port)))
        if not mine:
            raise ValueError(f"this node's own name {host!r} resolves to no address")
        return next((address for address in mine if address in listed), mine[0])

    def _lookup_failed(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        keeping = f"keeping {self._current}" if self._current else "replication waits until it resolves"
        level = logging.WARNING if text != self.last_error else logging.DEBUG  # once per distinct error
        log.log(level, "buddy: cannot resolve %s (%s); %s, next try in %.0fs", self.url, text, keeping,
                self.interval_s)
        self.last_error = text

    def _run(self, first: threading.Event) -> None:
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - a bad answer is logged, the next lookup tries again
            log.exception("buddy: looking up %s failed", self.url)
        finally:
            first.set()
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001
                log.exception("buddy: looking up %s failed", self.url)
