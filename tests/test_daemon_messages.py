"""The daemon's messages say what happened (issue 29, item 9), against real processes.

- ``ckptd status`` run by a UID the control socket refuses says so (exit 2), not "no daemon answers";
- a wrong peer token is a :class:`~ckptd.errors.TierMisconfiguredError` (exit 2) that says the token is not
  accepted, names what to set and never shows the token; a token of another scope gets the same kind;
- a short token is refused by ``--check-config``;
- credentials written into ``[roots.storage_options]`` of a file other users can read are refused by
  ``--check-config`` (named by key, never shown); the same file at mode 600 passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ckptd.daemon.auth import derive_token
from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.errors import TierMisconfiguredError
from ckptd.format.layout import step_dir
from harness.daemon_process import DaemonProcess, write_config
from harness.peer_server import PeerServer
from ckptd.tiers.peer import PeerTier

TOKEN = "messages-test-peer-token-0123456789abcdef"
NOBODY = 65534


def _ckptd(*args: str, user: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*user, sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_status_as_a_refused_uid_says_the_daemon_refuses_this_user(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running `ckptd status` as another UID needs root and setpriv")
    socket_dir = Path(tempfile.mkdtemp(prefix="ckptd-msg-"))  # short, and enterable by every UID
    socket_dir.chmod(0o755)
    try:
        root, state = tmp_path / "root", tmp_path / "state"
        root.mkdir()
        config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root)}], state_dir=str(state),
                              listen="127.0.0.1:0", node_id="node-a", scrub_interval_s=0,
                              socket=str(socket_dir / "d.sock"))
        with DaemonProcess(config, state) as daemon:
            daemon.wait_ready()
            nobody = ("setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups")
            refused = _ckptd("status", "--socket", str(socket_dir / "d.sock"), user=nobody)
            assert refused.returncode == 2, refused.stderr
            assert "refuses this user" in refused.stderr and f"UID {NOBODY}" in refused.stderr, refused.stderr
            assert "no ckptd daemon answers" not in refused.stderr and "BrokenPipe" not in refused.stderr
            allowed = _ckptd("status", "--socket", str(socket_dir / "d.sock"), "--json")
            assert allowed.returncode == 0 and "node-a" in allowed.stdout
            assert daemon.terminate() == 0
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_wrong_peer_token_says_so_and_exits_2_without_showing_it(tmp_path: Path) -> None:
    replicas = tmp_path / "replicas"
    (replicas / "node-a" / "run1" / step_dir(1)).mkdir(parents=True)
    with PeerServer(PeerNamespaces({}, replicas), token=TOKEN) as server:
        wrong = "wrong-" + TOKEN
        tier = PeerTier(f"peer://127.0.0.1:{server.port}/replicas/node-a/run1", token=wrong)
        with pytest.raises(TierMisconfiguredError) as caught:
            tier.committed_steps()
        text = f"{caught.value} {caught.value.hint}"
        assert "does not accept this peer token" in text and "CKPTD_PEER_TOKEN" in text and wrong not in text
        assert caught.value.exit_code == 2
        reader = PeerTier(f"peer://127.0.0.1:{server.port}/replicas/node-a/run1", token=derive_token(TOKEN, "read"))
        assert reader.list_step_numbers() == [1]
        with pytest.raises(TierMisconfiguredError, match="HTTP 403") as scoped:
            reader.write_bytes(f"{step_dir(1)}/rank-00000.data", b"x")
        assert "read token only reads" in str(scoped.value.hint)


def test_short_tokens_and_readable_inline_credentials_are_refused_by_check_config(tmp_path: Path) -> None:
    root, state = tmp_path / "root", tmp_path / "state"
    short = write_config(tmp_path / "short.toml", [{"name": "run1", "local": str(root)}], state_dir=str(state),
                         peer_token="abcde")
    result = _ckptd("daemon", "--config", str(short), "--check-config")
    assert result.returncode == 2 and "at least 32" in result.stderr and "abcde" not in result.stderr
    secret = "inline-secret-key-0123456789"
    inline = write_config(tmp_path / "inline.toml", [{"name": "run1", "local": str(root), "remote": "s3://bucket-a/x",
                                                      "storage_options": {"key": "AKIDINLINE", "secret": secret}}],
                          state_dir=str(state))
    inline.chmod(0o644)
    result = _ckptd("daemon", "--config", str(inline), "--check-config")
    assert result.returncode == 2, result.stdout
    assert "hold credentials (key, secret)" in result.stderr and "mode 644" in result.stderr
    assert secret not in result.stderr and "AKIDINLINE" not in result.stderr
    inline.chmod(0o600)
    assert _ckptd("daemon", "--config", str(inline), "--check-config").returncode == 0


def test_a_restore_through_a_wrong_peer_token_says_to_fix_the_token_not_to_retry(tmp_path: Path) -> None:
    import ckptd
    from ckptd.errors import TierUnreachableError

    replicas = tmp_path / "replicas"
    (replicas / "node-a" / "run1" / step_dir(1)).mkdir(parents=True)
    with PeerServer(PeerNamespaces({}, replicas), token=TOKEN) as server:
        wrong = "wrong-" + TOKEN
        peer = f"peer://127.0.0.1:{server.port}/replicas/node-a/run1"
        manager = ckptd.CheckpointManager(str(tmp_path / "local"), peer=peer, storage_options={"peer_token": wrong})
        try:
            with pytest.raises(TierUnreachableError) as caught:
                manager.restore({"x": 1})
        finally:
            manager.close()
    error = caught.value
    assert isinstance(error, TierMisconfiguredError) and error.exit_code == 2, repr(error)
    assert "fix the configuration" in str(error.hint) and "restore again once the tier answers" not in str(error.hint)
    assert wrong not in f"{error} {error.hint}"
