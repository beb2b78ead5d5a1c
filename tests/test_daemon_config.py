"""``ckptd daemon`` configuration: bad input is one clear line and exit 2 (the real CLI in a child process),
and the sources stack file < CKPTD_DAEMON_* < flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ckptd.daemon.config import load_config
from ckptd.errors import ConfigError
from harness.daemon_process import write_config

_CLEAN_ENV = {key: value for key, value in os.environ.items()
              if not key.startswith(("CKPTD_DAEMON_", "CKPTD_PEER_TOKEN"))}


def _check(config: Path | None, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    arguments = [sys.executable, "-m", "ckptd.cli.main", "daemon", "--check-config", *flags]
    if config is not None:
        arguments[4:4] = ["--config", str(config)]
    return subprocess.run(arguments, capture_output=True, text=True, timeout=60, env={**_CLEAN_ENV, **(env or {})})


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ckptd: error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.stderr
    return lines[0]


#: A token strong enough for the daemon (ckptd.daemon.auth.check_token_strength).
STRONG = "0123456789abcdef-strong-enough-token"


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    return {"state": tmp_path / "state", "root": tmp_path / "root", "config": tmp_path / "daemon.toml"}


def test_valid_config_prints_one_line_and_creates_directories(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"]), "remote": "s3://bucket-a/run1"}],
                          state_dir=str(dirs["state"]), node_id="node-a", peer_token="s3cret-token-of-node-a-0123456789abcdef",
                          buddy="peer://127.0.0.1:9999")
    result = _check(config)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("config ok")
    assert "node node-a" in result.stdout and "s3://bucket-a/run1" in result.stdout
    assert "s3cret-token" not in result.stdout + result.stderr
    assert dirs["state"].is_dir() and dirs["root"].is_dir()


def test_unknown_key_names_it_and_suggests_the_closest(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), pol_interval_s=2)
    line = _refused(_check(config), "'pol_interval_s'", str(dirs["config"]), "did you mean 'poll_interval_s'")
    assert "roots" not in line
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"]), "remote_evry_steps": 5}],
                          state_dir=str(dirs["state"]))
    _refused(_check(config), "'remote_evry_steps'", "[[roots]] #1", "did you mean 'remote_every_steps'")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("remote", "http://bucket/run1", ["remote of root", "'http://bucket/run1'", "s3://bucket/prefix"]),
    ("remote", "s3://", ["not an object-store URL"]),
])
def test_bad_remote_url(dirs, key, value, words):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"]), key: value}],
                          state_dir=str(dirs["state"]))
    _refused(_check(config), *words)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("buddy", "http://10.0.0.2:9470", ["buddy in file", "peer://HOST:PORT"]),
    ("buddy", "peer://10.0.0.2", ["buddy in file", "peer://HOST:PORT"]),
    ("listen", "localhost", ["listen in file", "host:port"]),
    ("listen", "127.0.0.1:70000", ["port 70000 is out of range"]),
])
def test_bad_addresses(dirs, key, value, words):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), peer_token=STRONG, **{key: value})
    _refused(_check(config), *words)


def test_wrong_type_names_the_key_and_source(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), peer_max_concurrency="many")
    _refused(_check(config), "peer_max_concurrency in file", "expected an integer", "'many'")
    result = _check(None, "--state-dir", str(dirs["state"]), "--local", str(dirs["root"]),
                    env={"CKPTD_DAEMON_DRAIN_TIMEOUT_S": "soon"})
    _refused(result, "CKPTD_DAEMON_DRAIN_TIMEOUT_S", "expected a number")
    result = _check(None, "--state-dir", str(dirs["state"]), "--local", str(dirs["root"]), "--keep-local", "0")
    _refused(result, "--keep-local", "must be >= 1")


def test_non_loopback_listen_needs_a_token(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), listen="0.0.0.0:9470")
    _refused(_check(config), "listen in file", "'0.0.0.0:9470'", "no peer token")
    assert _check(config, env={"CKPTD_PEER_TOKEN": STRONG}).returncode == 0
    assert _check(config, "--listen", "127.0.0.1:9470").returncode == 0


def test_buddy_needs_a_token_and_an_unreadable_token_file_is_named(dirs, tmp_path):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), buddy="peer://127.0.0.1:9471")
    _refused(_check(config), "buddy in file", "needs a peer token")
    missing = tmp_path / "no-such-token"
    _refused(_check(config, "--peer-token-file", str(missing)), "--peer-token-file", str(missing), "cannot read")
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    _refused(_check(config, env={"CKPTD_PEER_TOKEN_FILE": str(empty)}), "CKPTD_PEER_TOKEN_FILE", "is empty")


def test_duplicate_root_names(dirs, tmp_path):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(tmp_path / "a")},
                                           {"name": "run1", "local": str(tmp_path / "b")}],
                          state_dir=str(dirs["state"]))
    _refused(_check(config), "root name 'run1' is used twice", "[[roots]] #1", "[[roots]] #2")


def test_state_dir_that_is_a_file_and_a_socket_path_too_long(dirs, tmp_path):
    not_a_directory = tmp_path / "plain-file"
    not_a_directory.write_text("")
    _refused(_check(None, "--state-dir", str(not_a_directory), "--local", str(dirs["root"])),
             "--state-dir", str(not_a_directory), "not a directory")
    long_socket = tmp_path / ("s" * 120) / "daemon.sock"
    _refused(_check(None, "--state-dir", str(dirs["state"]), "--local", str(dirs["root"]), "--socket", str(long_socket)),
             "--socket", "longer than the 107 bytes")


@contextmanager
def _unwritable_directory(path: Path) -> Iterator[Path]:
    """A directory this process cannot write: mode 0555, or (as root, whom modes do not stop) a read-only
    tmpfs mounted there."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True, timeout=30).returncode == 0
    if not mounted:
        pytest.skip("running as root and cannot mount a read-only tmpfs: no directory here is unwritable")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)


def test_unwritable_root_is_refused(dirs, tmp_path):
    with _unwritable_directory(tmp_path / "read-only-root") as root:
        config = write_config(dirs["config"], [{"name": "run1", "local": str(root)}], state_dir=str(dirs["state"]))
        _refused(_check(config), "local of root 'run1'", str(root), "not writable")


def test_precedence_file_then_environment_then_flags(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), listen="127.0.0.1:1001")
    env = {"CKPTD_DAEMON_LISTEN": "127.0.0.1:1002"}
    assert "listen 127.0.0.1:1001 " in _check(config).stdout
    assert "listen 127.0.0.1:1002 " in _check(config, env=env).stdout
    assert "listen 127.0.0.1:1003 " in _check(config, "--listen", "127.0.0.1:1003", env=env).stdout


def test_precedence_in_load_config(dirs, tmp_path):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"]), "remote": "s3://bucket-a/x",
                                            "remote_every_steps": 10}],
                          state_dir=str(dirs["state"]), poll_interval_s=5.0, node_id="from-file")
    env = {"CKPTD_DAEMON_POLL_INTERVAL_S": "3", "CKPTD_DAEMON_NODE_ID": "from-env",
           "CKPTD_DAEMON_REMOTE_EVERY_STEPS": "20"}
    assert load_config(config, {}, {}).poll_interval_s == 5.0
    from_env = load_config(config, {}, env)
    assert (from_env.poll_interval_s, from_env.node_id, from_env.roots[0].remote_every_steps) == (3.0, "from-env", 20)
    from_flags = load_config(config, {"poll_interval_s": "2", "remote_every_steps": "40", "node_id": None}, env)
    assert (from_flags.poll_interval_s, from_flags.node_id, from_flags.roots[0].remote_every_steps) == (2.0, "from-env", 40)
    assert from_flags.roots[0].name == "run1" and from_flags.roots[0].remote == "s3://bucket-a/x"
    # single-root flags make a root when the file has none, and refuse to guess among several
    only_flags = load_config(None, {"state_dir": str(dirs["state"]), "local": str(tmp_path / "solo"),
                                    "s3_endpoint_url": "http://127.0.0.1:1", "remote": "s3://bucket-b/y"}, {})
    assert only_flags.roots[0].name == "default"
    assert only_flags.roots[0].storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    two = write_config(tmp_path / "two.toml", [{"name": "a", "local": str(tmp_path / "a")},
                                               {"name": "b", "local": str(tmp_path / "b")}], state_dir=str(dirs["state"]))
    with pytest.raises(ConfigError, match="describe a single root"):
        load_config(two, {"remote": "s3://bucket-a/z"}, {})


def test_token_is_never_in_a_repr(dirs):
    config = load_config(None, {"state_dir": str(dirs["state"]), "local": str(dirs["root"]),
                                "peer_token": "very-secret-" + STRONG, "listen": "0.0.0.0:0"}, {})
    assert config.peer_token == "very-secret-" + STRONG
    assert "very-secret" not in repr(config) + config.describe()


def test_a_second_daemon_on_the_same_state_dir_or_root_is_refused(dirs, tmp_path):
    from harness.daemon_process import DaemonProcess

    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), listen="127.0.0.1:0")
    with DaemonProcess(config, dirs["state"]) as first:
        first.wait_ready()
        for name, state in (("same-state", dirs["state"]), ("same-root", tmp_path / "other-state")):
            second = write_config(tmp_path / f"{name}.toml", [{"name": "run1", "local": str(dirs["root"])}],
                                  state_dir=str(state), listen="127.0.0.1:0")
            result = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "daemon", "--config", str(second)],
                                    capture_output=True, text=True, timeout=60, env=_CLEAN_ENV)
            assert result.returncode == 1, (name, result.returncode, result.stderr)
            lines = [line for line in result.stderr.splitlines() if line.startswith("ckptd: error: ")]
            assert len(lines) == 1 and "another ckptd daemon" in lines[0], result.stderr
        assert first.state() is not None, "the refused daemon touched the first one's state file"
        assert first.terminate() == 0


def test_every_option_is_a_flag_whose_help_names_its_variable():
    from ckptd.daemon.config import OPTIONS, ROOT_OPTIONS

    result = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "daemon", "--help"], capture_output=True,
                            text=True, timeout=60, env={**_CLEAN_ENV, "COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # click wraps long help lines
    for key in [*OPTIONS, *ROOT_OPTIONS, "s3_endpoint_url"]:
        flag = "--" + key.replace("_", "-")
        match = re.search(rf"(?:^| ){re.escape(flag)} \S+ ((?:(?!\[env: ).)*)\[env: (CKPTD_DAEMON_[A-Z0-9_]+)\]", text)
        assert match is not None, f"{flag} is not in `ckptd daemon --help`, or its help names no variable"
        assert match.group(2) == f"CKPTD_DAEMON_{key.upper()}", (flag, match.group(2))
    assert "--check-config" in text


def test_a_peer_token_of_the_wrong_kind_is_refused_without_showing_it(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"])}],
                          state_dir=str(dirs["state"]), peer_token=918273645546372819)
    line = _refused(_check(config), "peer_token", str(dirs["config"]))
    assert "918273645546372819" not in line


def test_a_bad_bucket_name_is_named_as_such(dirs):
    config = write_config(dirs["config"], [{"name": "run1", "local": str(dirs["root"]), "remote": "s3://My_Bucket/run1"}],
                          state_dir=str(dirs["state"]))
    _refused(_check(config), "'My_Bucket'", "not an S3 bucket name", "remote of root 'run1'", str(dirs["config"]))
