"""Who may ask a real daemon what (ckptd.daemon.auth), probed like an attacker would.

- Off loopback: the daemon listens on one end of a veth pair this test creates (198.18.0.0/15, the
  benchmarking range) and the probes come from a network namespace at the other end, a genuine remote
  client. Without a token or with a wrong one, only ``/healthz`` and ``/readyz`` answer; a scrape token
  reads ``/metrics`` only, a read token ``/status`` too; a node token writes only into its own replica
  namespace. Skipped with the reason where the machine cannot make the pair (not root, no ``ip``).
- On loopback: ``/status`` answers the daemon's own UID and refuses UID 65534 (``setpriv``), as the control
  socket does; ``/metrics`` stays open there.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.daemon.auth import MIN_TOKEN_CHARS, Authenticator, check_token_strength, derive_token
from ckptd.errors import ConfigError
from ckptd.format.layout import step_dir
from harness.daemon_process import DaemonProcess, write_config

TOKEN = "auth-test-peer-token-" + secrets.token_hex(12)
NOBODY = 65534


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=60, check=True)


@pytest.fixture
def veth() -> Iterator[tuple[str, str, str]]:
    """(namespace, daemon address, client address): a veth pair, one end in a new network namespace."""
    if os.geteuid() != 0:
        pytest.skip("a veth pair and a network namespace need root; the non-loopback probes are skipped")
    if shutil.which("ip") is None or shutil.which("curl") is None:
        pytest.skip("the non-loopback probes need the `ip` and `curl` commands")
    suffix = secrets.token_hex(3)
    namespace, outer, inner = f"ckptd-auth-{suffix}", f"cka{suffix}", f"ckb{suffix}"
    third, fourth = secrets.randbelow(256), 4 * secrets.randbelow(63)
    daemon_address, client_address = f"198.18.{third}.{fourth + 1}", f"198.18.{third}.{fourth + 2}"
    try:
        try:
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", namespace)
            _run("ip", "addr", "add", f"{daemon_address}/30", "dev", outer)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{client_address}/30", "dev", inner)
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", inner, "up")
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        except subprocess.CalledProcessError as error:
            pytest.skip(f"this machine cannot make a veth pair in a network namespace: {error.stderr.strip()}")
        yield namespace, daemon_address, client_address
    finally:
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=60)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=60)


def _curl(url: str, token: str | None = None, *, method: str = "GET", body: bytes | None = None,
          prefix: tuple[str, ...] = ()) -> tuple[int, bytes]:
    command = [*prefix, "curl", "-s", "-S", "--max-time", "20", "--connect-timeout", "10", "--retry", "5",
               "--retry-connrefused", "--retry-delay", "1", "-X", method, "-o", "-", "-w", "\n%{http_code}"]
    if token is not None:
        command += ["-H", f"Authorization: Bearer {token}"]
    if body is not None:
        command += ["--data-binary", "@-", "-H", "Content-Type: application/octet-stream"]
    result = subprocess.run([*command, url], input=body, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answer, _, code = result.stdout.rpartition(b"\n")
    return int(code), answer


def _daemon(tmp_path: Path, listen: str) -> tuple[Path, Path]:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir(exist_ok=True)
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root)}], state_dir=str(state),
                          listen=listen, node_id="node-a", poll_interval_s=0.2, scrub_interval_s=0,
                          peer_token=TOKEN)
    return config, state


def test_off_loopback_every_route_but_health_needs_a_token_with_the_right_scope(tmp_path: Path, veth) -> None:
    namespace, address, _ = veth
    remote = ("ip", "netns", "exec", namespace)
    config, state = _daemon(tmp_path, f"{address}:0")
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        base = daemon.http
        assert base.startswith(f"http://{address}:")
        assert _curl(base + "/healthz", prefix=remote)[0] == 200
        assert _curl(base + "/readyz", prefix=remote)[0] == 200
        for token in (None, "wrong-" + TOKEN, TOKEN[:-1], derive_token("another-cluster-secret-0123456789", "read")):
            for route in ("/status", "/metrics", "/v1/peer/roots/run1/steps", "/nothing-here"):
                status, body = _curl(base + route, token, prefix=remote)
                assert status == 401, (route, token, status)
                assert b"node-a" not in body and str(state).encode() not in body, "nothing about the node leaks"
        scrape, read = derive_token(TOKEN, "scrape"), derive_token(TOKEN, "read")
        assert _curl(base + "/metrics", scrape, prefix=remote)[0] == 200
        assert _curl(base + "/status", scrape, prefix=remote)[0] == 403
        assert _curl(base + "/v1/peer/roots/run1/steps", scrape, prefix=remote)[0] == 403
        for token in (read, TOKEN):
            status, body = _curl(base + "/status", token, prefix=remote)
            assert status == 200 and json.loads(body)["node_id"] == "node-a"
        assert _curl(base + "/v1/peer/roots/run1/steps", read, prefix=remote)[0] == 200

        # a node token writes into its own replica namespace only; a read token writes nowhere
        own = f"/v1/peer/replicas/node-b/run1/{step_dir(1)}/rank-00000.data"
        other = f"/v1/peer/replicas/node-c/run1/{step_dir(1)}/rank-00000.data"
        node_b = derive_token(TOKEN, "node", "node-b")
        assert _curl(base + own, node_b, method="PUT", body=b"replica bytes", prefix=remote)[0] == 201
        status, body = _curl(base + other, node_b, method="PUT", body=b"intruding bytes", prefix=remote)
        assert status == 403 and b"node-b" in body
        assert _curl(base + own.replace("node-b", "node-c"), node_b, method="DELETE", prefix=remote)[0] == 403
        assert _curl(base + own, read, method="DELETE", prefix=remote)[0] == 403
        assert _curl(base + own, read, method="PUT", body=b"x", prefix=remote)[0] == 403
        replicas = state / "replicas"
        assert (replicas / "node-b" / "run1" / step_dir(1) / "rank-00000.data").read_bytes() == b"replica bytes"
        assert not (replicas / "node-c").exists(), "a refused write stored nothing"
        log = daemon.log()
    assert "refused GET /status" in log and TOKEN not in log


def test_on_loopback_status_answers_allowed_uids_only(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("curl") is None:
        pytest.skip("probing from another UID needs root, setpriv and curl")
    config, state = _daemon(tmp_path, "127.0.0.1:0")
    nobody = ("setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups")
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        status, body = _curl(daemon.http + "/status")
        assert status == 200 and json.loads(body)["node_id"] == "node-a", "the daemon's own UID reads it"
        status, body = _curl(daemon.http + "/status", prefix=nobody)
        assert status == 401 and str(state).encode() not in body and b"node-a" not in body
        assert _curl(daemon.http + "/status", derive_token(TOKEN, "read"), prefix=nobody)[0] == 200
        assert _curl(daemon.http + "/metrics", prefix=nobody)[0] == 200, "metrics stay open on loopback"
        assert _curl(daemon.http + "/healthz", prefix=nobody)[0] == 200


def test_weak_tokens_are_refused_and_derived_tokens_are_scoped() -> None:
    for weak in ("abcde", "x" * 200, "0123456789" * 3):
        with pytest.raises(ConfigError, match="peer token") as caught:
            check_token_strength(weak, "peer_token in file daemon.toml")
        assert weak not in str(caught.value) and "daemon.toml" in str(caught.value)
    check_token_strength(TOKEN, "peer_token")
    assert len(TOKEN) >= MIN_TOKEN_CHARS
    auth = Authenticator(TOKEN, frozenset(), loopback_only=False)
    node = auth.identify(f"Bearer {derive_token(TOKEN, 'node', 'node.b-1')}")
    assert node is not None and node.scope == "node" and node.node_id == "node.b-1"
    assert node.may_write(("replicas", "node.b-1", "run1")) and not node.may_write(("replicas", "node-c", "run1"))
    assert not node.may_write(("roots", "run1"))
    forged = derive_token(TOKEN, "node", "node-b").replace("node-b", "node-c")
    assert auth.identify(f"Bearer {forged}") is None, "a node token names the node it was made for"
    assert auth.identify(f"Bearer {TOKEN}").scope == "admin"  # type: ignore[union-attr]
    assert auth.identify(None) is None and auth.identify("Bearer ") is None
    assert Authenticator(None, frozenset(), loopback_only=True).identify(f"Bearer {TOKEN}") is None
