"""The peer endpoints refuse what they must, with raw HTTP requests against a real aiohttp server on loopback:
no or a wrong token, paths that try to leave the served roots (``..``, absolute, percent-encoded, backslash,
NUL, symbolic links), uncommitted steps, oversized writes and ranges, writes to read-only roots, too many
requests at once. A secret file lies outside every root: its bytes must never come back."""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.daemon.peer_api import PeerLimits
from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.errors import ConfigError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from harness.daemon_process import wait_until
from harness.peer_server import PeerServer

TOKEN = "the-right-token-0123456789"
SECRET = b"SECRET-BYTES-" + os.urandom(16).hex().encode()
COMMITTED, UNCOMMITTED, LINKED = 1, 2, 3
LIMITS = PeerLimits(max_concurrent=2, max_put_bytes=1024 * 1024, max_range_bytes=64 * 1024, max_path_length=512)


class _Node:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "roots" / "run1"
        self.replicas = tmp_path / "replicas"
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret.txt").write_bytes(SECRET)
        (outside / MANIFEST_NAME).write_bytes(b"{}")
        self.secret = outside / "secret.txt"
        committed = self.root / step_dir(COMMITTED)
        committed.mkdir(parents=True)
        (committed / "rank-00000.data").write_bytes(b"committed data " * 1000)
        (committed / "rank-00000.1.data").write_bytes(os.urandom(LIMITS.max_range_bytes + 1000))
        (committed / MANIFEST_NAME).write_bytes(b"{}")
        os.symlink(self.secret, committed / "leak.data")
        uncommitted = self.root / step_dir(UNCOMMITTED)
        uncommitted.mkdir()
        (uncommitted / "rank-00000.data").write_bytes(b"UNCOMMITTED-BYTES")
        os.symlink(outside, self.root / step_dir(LINKED))  # a step directory that is a link to elsewhere
        (self.replicas / "node-a" / "run1" / step_dir(COMMITTED)).mkdir(parents=True)
        os.symlink(outside, self.replicas / "node-a" / "linked")  # a replica namespace that is a link
        os.symlink(self.secret, self.replicas / "node-a" / "run1" / step_dir(COMMITTED) / "leak.data")
        os.symlink(outside, self.replicas / "node-a" / "run1" / step_dir(LINKED))
        self.server = PeerServer(PeerNamespaces({"run1": self.root}, self.replicas), token=TOKEN, limits=LIMITS)

    def request(self, method: str, path: str, *, token: str | None = TOKEN, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        try:
            connection.putrequest(method, path, skip_accept_encoding=True)
            if token is not None:
                connection.putheader("Authorization", f"Bearer {token}")
            for name, value in (headers or {}).items():
                connection.putheader(name, value)
            if body is not None and "Content-Length" not in (headers or {}):
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[_Node]:
    served = _Node(tmp_path)
    with served.server:
        yield served


FILE = f"/v1/peer/roots/run1/{step_dir(COMMITTED)}/rank-00000.data"
BIG_FILE = f"/v1/peer/roots/run1/{step_dir(COMMITTED)}/rank-00000.1.data"


def test_the_right_token_is_served(node: _Node) -> None:
    status, body = node.request("GET", FILE)
    assert status == 200 and body == b"committed data " * 1000
    status, body = node.request("GET", FILE, headers={"Range": "bytes=15-29"})
    assert (status, body) == (206, b"committed data ")


@pytest.mark.parametrize("token", [None, "", "wrong-token", TOKEN[:-1], TOKEN + "x", TOKEN.upper()],
                         ids=["none", "empty", "wrong", "prefix", "longer", "case"])
def test_without_the_right_token_401(node: _Node, token: str | None) -> None:
    for method, path in (("GET", FILE), ("HEAD", FILE), ("GET", "/v1/peer/roots/run1/steps"),
                         ("PUT", f"/v1/peer/replicas/node-a/run1/{step_dir(5)}/x.data"),
                         ("DELETE", f"/v1/peer/replicas/node-a/run1/{step_dir(5)}/x.data")):
        status, body = node.request(method, path, token=token, body=b"x" if method == "PUT" else None)
        assert status == 401, (method, path, status)
        assert b"committed data" not in body and (not token or token.encode() not in body)
    assert not (node.replicas / "node-a" / "run1" / step_dir(5)).exists(), "a refused write stored nothing"


def test_no_token_configured_refuses_everyone(tmp_path: Path) -> None:
    served = _Node(tmp_path)
    served.server = PeerServer(PeerNamespaces({"run1": served.root}, served.replicas), token=None)
    with served.server:
        for token in (None, "", "None", TOKEN):
            assert served.request("GET", FILE, token=token)[0] == 401


ESCAPES = [
    "/v1/peer/roots/run1/../../outside/secret.txt",
    "/v1/peer/roots/run1/step-000000000001/../../../outside/secret.txt",
    "/v1/peer/roots/run1/%2e%2e/%2e%2e/outside/secret.txt",
    "/v1/peer/roots/run1/step-000000000001/%2e%2e%2f%2e%2e%2f%2e%2e%2foutside%2fsecret.txt",
    "/v1/peer/roots/run1/step-000000000001/..%2F..%2F..%2Foutside%2Fsecret.txt",
    "/v1/peer/roots/%2e%2e/outside/secret.txt",
    "/v1/peer/roots/run1/step-000000000001/%252e%252e%252fsecret.txt",
    "/v1/peer/roots/run1/step-000000000001/..%5c..%5c..%5coutside%5csecret.txt",
    "/v1/peer/roots/run1/step-000000000001/secret.txt%00.data",
    "/v1/peer/roots/run1//outside/secret.txt",
    "/v1/peer/roots/run1/%2foutside%2fsecret.txt",
    "/v1/peer/roots/run1/step-000000000001/%2foutside%2fsecret.txt",
    "/v1/peer/roots//tmp/secret.txt",
    "/v1/peer//etc/passwd",
    "/v1/peer/roots/run1/step-000000000001/leak.data",
    "/v1/peer/roots/run1/step-000000000003/secret.txt",
    "/v1/peer/roots/run1/step-000000000003/manifest.json",
    "/v1/peer/replicas/node-a/linked/step-000000000001/secret.txt",
    "/v1/peer/replicas/node-a/linked/secret.txt",
    "/v1/peer/replicas/node-a/%2e%2e/outside/secret.txt",
    "/v1/peer/roots/run1/step-000000000001/.hidden",
    "/v1/peer/roots/run1/step-000000000001/rank-00000.data.tmp-abc",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_paths_leaving_the_roots_get_4xx_and_no_bytes(node: _Node, path: str) -> None:
    for method in ("GET", "HEAD"):
        status, body = node.request(method, path)
        assert 400 <= status < 500, (method, path, status)
        assert SECRET not in body and b"committed data" not in body
    status, _ = node.request("PUT", path.replace("roots/run1", "replicas/node-a/run1"), body=b"overwrite")
    assert 400 <= status < 500
    assert node.secret.read_bytes() == SECRET, "nothing outside the roots was written"


def test_listings_show_only_committed_real_steps(node: _Node) -> None:
    status, body = node.request("GET", "/v1/peer/roots/run1/steps")
    assert status == 200 and json.loads(body) == {"steps": [COMMITTED]}
    status, body = node.request("GET", f"/v1/peer/roots/run1/{step_dir(COMMITTED)}")
    assert status == 200 and json.loads(body) == {"files": [MANIFEST_NAME, "rank-00000.1.data",
                                                                   "rank-00000.data"]}, "links not listed"
    for step in (UNCOMMITTED, LINKED):
        status, body = node.request("GET", f"/v1/peer/roots/run1/{step_dir(step)}")
        assert 400 <= status < 500 and SECRET not in body and b"secret" not in body
    assert 400 <= node.request("GET", "/v1/peer/replicas/node-a/linked/steps")[0] < 500
    assert node.request("GET", "/v1/peer/roots/unknown/steps")[0] == 404


def test_an_uncommitted_step_is_not_served(node: _Node) -> None:
    for method in ("GET", "HEAD"):
        status, body = node.request(method, f"/v1/peer/roots/run1/{step_dir(UNCOMMITTED)}/rank-00000.data")
        assert status == 404 and b"UNCOMMITTED" not in body


def test_bytes_of_an_uncommitted_replica_step_are_never_served(node: _Node) -> None:
    """On replicas/ the writer sees what it has put in an uncommitted step (listings, sizes), never the bytes;
    a chunk, in no step, is never served either. The bytes come once the step is committed."""
    namespace = node.replicas / "node-a" / "run1"
    directory = namespace / step_dir(UNCOMMITTED)
    directory.mkdir()
    (directory / "rank-00000.data").write_bytes(b"UNCOMMITTED-REPLICA-BYTES")
    (namespace / "chunks" / "ab").mkdir(parents=True)
    (namespace / "chunks" / "ab" / "chunk.raw").write_bytes(b"UNCOMMITTED-CHUNK-BYTES")
    file = f"/v1/peer/replicas/node-a/run1/{step_dir(UNCOMMITTED)}/rank-00000.data"
    for path in (file, "/v1/peer/replicas/node-a/run1/chunks/ab/chunk.raw"):
        for headers in ({}, {"Range": "bytes=0-5"}):
            status, body = node.request("GET", path, headers=headers)
            assert status == 404 and b"UNCOMMITTED-" not in body and b"committed steps" in body, (path, status)
    assert node.request("HEAD", file)[0] == 200, "the writer may check what it wrote"
    status, body = node.request("GET", f"/v1/peer/replicas/node-a/run1/{step_dir(UNCOMMITTED)}")
    assert status == 200 and json.loads(body) == {"files": ["rank-00000.data"]}
    assert UNCOMMITTED in json.loads(node.request("GET", "/v1/peer/replicas/node-a/run1/steps")[1])["steps"]
    (directory / MANIFEST_NAME).write_bytes(b"{}")
    assert node.request("GET", file) == (200, b"UNCOMMITTED-REPLICA-BYTES"), "served once committed"


def test_writes_to_roots_are_refused(node: _Node) -> None:
    target = f"/v1/peer/roots/run1/{step_dir(7)}/rank-00000.data"
    status, body = node.request("PUT", target, body=b"new bytes")
    assert status == 403 and b"read only" in body
    assert not (node.root / step_dir(7)).exists()
    assert node.request("DELETE", FILE)[0] == 403
    assert (node.root / step_dir(COMMITTED) / "rank-00000.data").exists()


def test_oversized_requests_are_refused(node: _Node) -> None:
    target = f"/v1/peer/replicas/node-a/run1/{step_dir(7)}/rank-00000.data"
    status, body = node.request("PUT", target, body=b"",
                                headers={"Content-Length": str(LIMITS.max_put_bytes + 1)})
    assert status == 413 and b"at most" in body
    assert not (node.replicas / "node-a" / "run1" / step_dir(7)).exists()
    status, body = node.request("GET", BIG_FILE, headers={"Range": f"bytes=0-{LIMITS.max_range_bytes}"})
    assert status == 413 and len(body) < 1000
    assert node.request("GET", BIG_FILE)[0] == 413, "a whole file larger than a range is refused too"
    assert node.request("HEAD", BIG_FILE)[0] == 200, "its size is not refused"
    status, body = node.request("GET", BIG_FILE, headers={"Range": f"bytes=10-{LIMITS.max_range_bytes + 9}"})
    assert status == 206 and body == (node.root / step_dir(COMMITTED) / "rank-00000.1.data").read_bytes()[10:][
        :LIMITS.max_range_bytes]
    assert node.request("GET", FILE, headers={"Range": "bytes=0-1,5-9"})[0] == 400
    assert node.request("GET", FILE + "/" + "a" * LIMITS.max_path_length)[0] == 414


def test_a_body_shorter_than_announced_stores_nothing(node: _Node) -> None:
    target = f"/v1/peer/replicas/node-a/run1/{step_dir(8)}/rank-00000.data"
    with socket.create_connection(("127.0.0.1", node.server.port), timeout=30) as raw:
        raw.sendall(f"PUT {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Length: 100000\r\n\r\n".encode() + b"x" * 5000)
        raw.shutdown(socket.SHUT_WR)
        raw.recv(65536)
    directory = node.replicas / "node-a" / "run1" / step_dir(8)
    assert not (directory / "rank-00000.data").exists(), "no partial file under the final name"
    # the server may drop the connection before its handler has removed the temporary
    wait_until(lambda: not directory.exists() or os.listdir(directory) == [], 10, "the temporary to be removed")
    assert node.request("HEAD", target)[0] == 404


def test_requests_beyond_the_concurrency_limit_get_503(node: _Node) -> None:
    held = []
    target = f"/v1/peer/replicas/node-a/run1/{step_dir(9)}/rank-00000.data"
    for _ in range(LIMITS.max_concurrent):  # writes that wait for the rest of their body
        raw = socket.create_connection(("127.0.0.1", node.server.port), timeout=30)
        raw.sendall(f"PUT {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Length: 10\r\n\r\n12345".encode())
        held.append(raw)
    try:
        statuses = set()
        for _ in range(200):  # until both held writes are being handled
            status, body = node.request("GET", f"/v1/peer/roots/run1/{step_dir(COMMITTED)}")
            statuses.add(status)
            if status == 503:
                assert b"too many" in body
                break
        assert 503 in statuses, statuses
    finally:
        for raw in held:
            raw.sendall(b"67890")
            assert b" 201 " in raw.recv(65536).split(b"\r\n")[0] + b" "
            raw.close()
    assert node.request("GET", f"/v1/peer/roots/run1/{step_dir(COMMITTED)}")[0] == 200


def test_a_body_that_stops_coming_is_dropped(tmp_path: Path) -> None:
    served = _Node(tmp_path)
    limits = PeerLimits(max_concurrent=1, body_idle_timeout_s=0.3)
    served.server = PeerServer(PeerNamespaces({"run1": served.root}, served.replicas), token=TOKEN, limits=limits)
    target = f"/v1/peer/replicas/node-a/run1/{step_dir(8)}/rank-00000.data"
    with served.server, socket.create_connection(("127.0.0.1", served.server.port), timeout=30) as raw:
        raw.sendall(f"PUT {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Length: 100000\r\n\r\n".encode() + b"x" * 5000)  # and then nothing
        answer = raw.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"no byte of the body" in answer
        assert served.request("HEAD", target)[0] == 404, "nothing stored, and the slot is free again"
        directory = served.replicas / "node-a" / "run1" / step_dir(8)
        assert not directory.exists() or os.listdir(directory) == []


@pytest.mark.parametrize("layout", ["replicas-in-root", "root-in-replicas", "same", "through-a-link"])
def test_a_replica_directory_overlapping_a_root_is_refused(tmp_path: Path, layout: str) -> None:
    """With replica_dir above a root, replicas/<a>/<b> would be that root: a token holder could write (and
    commit) steps the trainer restores. Refused when the namespaces are built, before anything is served."""
    root = tmp_path / "data" / "run1"
    root.mkdir(parents=True)
    os.symlink(tmp_path / "data", tmp_path / "link")
    replica_dir = {"replicas-in-root": root / "replicas", "root-in-replicas": tmp_path,
                   "same": root, "through-a-link": tmp_path / "link"}[layout]
    with pytest.raises(ConfigError) as caught:
        PeerNamespaces({"run1": root}, replica_dir)
    assert "overlap" in str(caught.value) and "run1" in str(caught.value)
    PeerNamespaces({"run1": root}, tmp_path / "state" / "replicas")  # apart: fine
