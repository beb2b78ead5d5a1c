"""Who may ask the daemon's HTTP server what: tokens, their scopes, and the local UID rule.

One secret per cluster, the daemon's ``peer_token``, is the **admin** token: every route. Scoped tokens are
derived from it (HMAC-SHA256, so a daemon checks them without a list of tokens, and holding one never
reveals the secret); ``ckptd daemon --print-token SCOPE [--token-node-id ID]`` prints them:

- ``node.<node id>.<mac>``: what a daemon replicating here sends: reads of every peer namespace, writes and
  deletes only in ``replicas/<node id>/`` (a node cannot touch another node's replicas);
- ``read.<mac>``: peer reads (a restoring trainer), ``/status`` and ``/metrics``;
- ``scrape.<mac>``: ``/metrics`` only (give it to Prometheus).

Routes: ``/healthz`` and ``/readyz`` need nothing. ``/metrics`` needs a token with the ``scrape`` right
unless the daemon listens on loopback only. ``/status`` needs a token with the ``status`` right, or comes
over loopback from a process whose UID is in ``control_allowed_uids`` (the control socket's rule; the UID
of a loopback TCP connection is read from ``/proc/net/tcp``, Linux). The peer routes always need a token.
A token is compared in constant time; a request without one gets 401, a token without the right 403.

Tokens are at least :data:`MIN_TOKEN_CHARS` characters of at least :data:`MIN_DISTINCT_CHARS` kinds.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass

from ckptd.errors import ConfigError

#: Fewest characters a peer token may have (``secrets.token_hex(16)`` gives 32).
MIN_TOKEN_CHARS = 32
#: Fewest distinct characters in a token (refuses ``"a" * 32`` and the like).
MIN_DISTINCT_CHARS = 8
#: Scopes of derived tokens, and the rights each gives.
SCOPES = ("node", "read", "scrape")
_RIGHTS = {"admin": frozenset({"peer-read", "peer-write", "status", "scrape"}),
           "node": frozenset({"peer-read", "peer-write", "status", "scrape"}),
           "read": frozenset({"peer-read", "status", "scrape"}),
           "scrape": frozenset({"scrape"}),
           "local": frozenset({"status", "scrape"})}
_GENERATE = "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`"


def check_token_strength(token: str, where: str) -> None:
    """ConfigError naming ``where`` (never the token) when ``token`` is too short or too uniform."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where}: the peer token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are "
                          "needed", hint=_GENERATE)
    if len(set(token)) < MIN_DISTINCT_CHARS:
        raise ConfigError(f"{where}: the peer token repeats too few characters ({len(set(token))} distinct, at "
                          f"least {MIN_DISTINCT_CHARS} needed)", hint=_GENERATE)


def _mac(secret: str, purpose: str) -> str:
    return hmac.new(secret.encode(), f"ckptd-token:{purpose}".encode(), hashlib.sha256).hexdigest()


def derive_token(secret: str, scope: str, node_id: str | None = None) -> str:
    """The ``scope`` token (``node`` needs ``node_id``) that a daemon whose peer token is ``secret`` accepts."""
    if scope == "node":
        if not node_id:
            raise ConfigError("a node token names its node", hint="pass the node id (--node-id)")
        return f"node.{node_id}.{_mac(secret, 'node:' + node_id)}"
    if scope in ("read", "scrape"):
        return f"{scope}.{_mac(secret, scope)}"
    raise ConfigError(f"unknown token scope {scope!r}", hint=f"one of {', '.join(SCOPES)}")


@dataclass(frozen=True)
class Access:
    """Who asks: ``scope`` (admin, node, read, scrape, local) and, for a node token, its node."""

    scope: str
    node_id: str | None = None

    def may(self, right: str) -> bool:
        """Whether this access has ``right`` (peer-read, peer-write, status, scrape)."""
        return right in _RIGHTS.get(self.scope, frozenset())

    def may_write(self, namespace: tuple[str, ...]) -> bool:
        """Whether this access may write or delete in the peer namespace ``namespace``."""
        if self.scope == "admin":
            return True
        return (self.scope == "node" and len(namespace) >= 2 and namespace[0] == "replicas"
                and namespace[1] == self.node_id)


class Authenticator:
    """Checks bearer tokens against ``secret`` (None: no token is accepted) and loopback UIDs against
    ``allowed_uids``. ``loopback_only``: the server listens on loopback (``/metrics`` is then open)."""

    def __init__(self, secret: str | None, allowed_uids: frozenset[int], *, loopback_only: bool) -> None:
        self._secret = secret
        self.allowed_uids = frozenset(allowed_uids)
        self.loopback_only = loopback_only
        self._expected = f"Bearer {secret}".encode() if secret else b"Bearer -\x00"

    def identify(self, header: str | None) -> Access | None:
        """The access an ``Authorization`` header grants, or None."""
        given = (header or "").encode("utf-8", "surrogateescape")
        if self._secret is None:
            hmac.compare_digest(given, self._expected)  # the same work with or without a secret
            return None
        if hmac.compare_digest(given, self._expected):
            return Access("admin")
        if not given.startswith(b"Bearer "):
            return None
        token = given[len(b"Bearer "):].decode("utf-8", "replace")
        scope, _, rest = token.partition(".")
        if scope == "node":
            node_id, _, _ = rest.rpartition(".")
            expected = derive_token(self._secret, "node", node_id) if node_id else ""
            return Access("node", node_id) if expected and hmac.compare_digest(token, expected) else None
        if scope in ("read", "scrape"):
            return Access(scope) if hmac.compare_digest(token, derive_token(self._secret, scope)) else None
        return None

    def local_access(self, peer: tuple[str, int] | None, server: tuple[str, int] | None) -> Access | None:
        """``local`` access for a loopback connection from a process whose UID is allowed, else None."""
        if peer is None or server is None or not is_loopback(peer[0]):
            return None
        uid = tcp_peer_uid(peer, server)
        return Access("local") if uid is not None and uid in self.allowed_uids else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv4-mapped and scoped IPv6 included) is this machine's
    loopback: ``localhost``, 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _proc_address(host: str, port: int) -> tuple[str, str]:
    """``host:port`` as ``/proc/net/tcp`` (IPv4) or ``tcp6`` prints it: 32-bit words in host byte order."""
    address = ipaddress.ip_address(host.split("%")[0])
    packed = address.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    table = "tcp" if address.version == 4 else "tcp6"
    return table, "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def tcp_peer_uid(peer: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The UID owning the local TCP socket ``peer`` connected to ``server`` (Linux ``/proc/net/tcp``), or None
    when it cannot be told (not Linux, the client gone, another network namespace)."""
    try:
        table, local = _proc_address(peer[0], int(peer[1]))
        _, remote = _proc_address(server[0], int(server[1]))
    except (ValueError, IndexError, struct.error):
        return None
    tables = [table] + (["tcp"] if table == "tcp6" else [])
    for name in tables:
        try:
            with open(f"/proc/net/{name}", encoding="ascii") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                        return int(fields[7])
        except OSError:
            continue
    return None


__all__ = ["Access", "Authenticator", "MIN_DISTINCT_CHARS", "MIN_TOKEN_CHARS", "SCOPES", "check_token_strength",
           "derive_token", "tcp_peer_uid"]
