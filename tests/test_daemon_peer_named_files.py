"""The peer route serves only what a committed manifest names, checked while it is served
(ckptd.daemon.peer_store), against a real daemon process and a real trainer's step.

A file from outside the root hard-linked into the step directory (under a name of its own, or in place of a
data file) never comes back: an unnamed file is 404 and logged; the chunks of a named file whose bytes do
not match the records are sent as zeros (a file of the wrong size is refused, 500), logged and counted in
``ckptd_verify_failures_total``. Named files come back
byte for byte, whole or by ranges that cut chunks.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ckptd.format.layout import MANIFEST_NAME, step_dir
from harness.daemon_process import DaemonProcess, run_trainer, write_config

TOKEN = "named-files-test-peer-token-0123456789abcdef"
SECRET = b"SECRET-" + os.urandom(24).hex().encode()


def _get(url: str, *, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture
def served(tmp_path: Path):
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    assert run_trainer(root, 1, 1, keep_local=None) == [1]
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root)}], state_dir=str(state),
                          listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2, scrub_interval_s=0,
                          peer_token=TOKEN)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        yield daemon, root / step_dir(1), f"{daemon.http}/v1/peer/roots/run1/{step_dir(1)}"


def _failures(daemon: DaemonProcess) -> float:
    return daemon.metrics().get(("ckptd_verify_failures_total", (("tier", "local"),)), 0.0)


def test_named_files_come_back_byte_for_byte_and_nothing_else(served, tmp_path: Path) -> None:
    daemon, directory, base = served
    named = sorted(name for name in os.listdir(directory))
    assert MANIFEST_NAME in named and any(name.endswith(".data") for name in named)
    outside = tmp_path / "outside-secret.txt"
    outside.write_bytes(SECRET)
    os.link(outside, directory / "leak.data")
    os.link(outside, directory / "rank-00000.index.json.bak")
    status, body = _get(base)
    assert status == 200 and json.loads(body)["files"] == named, "unnamed files are not listed"
    for name in ("leak.data", "rank-00000.index.json.bak"):
        status, body = _get(f"{base}/{name}")
        assert status == 404 and SECRET not in body, name
    for name in named:
        status, body = _get(f"{base}/{name}")
        assert status == 200 and body == (directory / name).read_bytes(), name
    data = next(name for name in named if name.endswith(".data"))
    content = (directory / data).read_bytes()
    for start, end in ((0, 10), (7, len(content) // 2 + 13), (len(content) - 5, len(content) - 1)):
        status, body = _get(f"{base}/{data}", headers={"Range": f"bytes={start}-{end}"})
        assert status == 206 and body == content[start:end + 1], (start, end)
    assert _failures(daemon) == 0
    assert "the step's manifest does not name it" in daemon.log()


def test_a_named_file_that_fails_its_check_is_refused_and_counted(served, tmp_path: Path) -> None:
    daemon, directory, base = served
    data = next(name for name in sorted(os.listdir(directory)) if name.endswith(".data"))
    size = (directory / data).stat().st_size
    impostor = tmp_path / "impostor.bin"
    impostor.write_bytes((SECRET * (size // len(SECRET) + 1))[:size])
    original = directory / data
    os.replace(original, tmp_path / "original.data")
    os.link(impostor, original)  # same name and size, other bytes: a hard link from outside
    for headers, expected in (({}, 200), ({"Range": "bytes=0-99"}, 206)):
        status, body = _get(f"{base}/{data}", headers=headers)
        assert status == expected and SECRET[:12] not in body, "no byte of the impostor leaves"
        assert body.strip(b"\0") == b"", "every chunk was withheld (sent as zeros)"
    daemon.wait_for(lambda: _failures(daemon) >= 2, 30, "two verify failures counted")
    assert "fails its check" in daemon.log()
    shorter = tmp_path / "shorter.bin"
    shorter.write_bytes(SECRET)
    os.unlink(original)
    os.link(shorter, original)  # the wrong size: refused whole
    status, body = _get(f"{base}/{data}")
    assert status == 500 and SECRET not in body and b"its records say" in body
