"""The daemon's control socket and the trainer's hand-off, against a real ``ckptd daemon`` process.

The socket checks its client's UID (``SO_PEERCRED``): a forked child that drops to UID 65534 is refused
and its message is never processed; a client of the daemon's UID gets answers. Hand-off: with the daemon
present, a trainer process commits steps and sends no request of its own to S3 (its object tier's requests
are counted), the daemon promotes them and ``ckptd status --json`` shows them; the daemon SIGKILLed
mid-run: the trainer takes promotion back and its next steps still reach S3, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.manager.daemon_link import DaemonLink
from ckptd.stepio.step_reader import verify_step
from harness.daemon_process import DaemonProcess, run_trainer, wait_until, write_config
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier


#: A trainer: ``python -c TRAINER ROOT REMOTE ENDPOINT FIRST COUNT [PAUSE_AFTER]``. Saves steps FIRST.. and
#: prints one JSON line per commit with how many requests its own object tier sent (by method); with
#: PAUSE_AFTER it prints ``paused`` after that step and reads a line from stdin before going on. At the end it
#: waits for its own uploads and prints what it promoted itself.
TRAINER = """
import json, sys, collections, torch, ckptd
root, remote, endpoint, first, count = sys.argv[1:4] + [int(sys.argv[4]), int(sys.argv[5])]
pause_after = int(sys.argv[6]) if len(sys.argv) > 6 else None
options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
sent = collections.Counter()
with ckptd.CheckpointManager(root, remote=remote, storage_options=options, capture_rng=False,
                             policy=ckptd.Policy(keep_local=2)) as manager:
    manager.remote.on_request(lambda request, **_: sent.update([request.method]))
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(step)
        manager.save(step, {"weights": torch.randn(64 * 1024, generator=generator), "step": torch.tensor(step)})
        manager.wait()
        print(json.dumps({"committed": step, "sent": dict(sent), "daemon": manager.daemon_promotes}), flush=True)
        if step == pause_after:
            print("paused", flush=True)
            sys.stdin.readline()
    manager.wait_uploads()
    print(json.dumps({"uploaded": [report.step for report in manager.upload_reports], "sent": dict(sent),
                      "daemon": manager.daemon_promotes}), flush=True)
"""


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory every UID may enter (pytest's tmp_path is private to root, and AF_UNIX paths are short)."""
    directory = Path(tempfile.mkdtemp(prefix="ckptd-ctl-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path, socket_dir: Path, s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A real daemon watching ``root`` and promoting it to ``s3://<bucket>/run1``."""
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    remote = f"s3://{s3_bucket}/run1"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "remote": remote,
                                                      "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", socket=str(socket_dir / "d.sock"),
                          node_id="node-a", poll_interval_s=0.2, retry_backoff_s=0.2, scrub_interval_s=0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        yield {"daemon": daemon, "root": root, "remote": remote, "socket": socket_dir / "d.sock",
               "endpoint": s3_options["client_kwargs"]["endpoint_url"], "options": s3_options}


def _object_steps(node: dict[str, Any]) -> list[int]:
    return open_tier(node["remote"], storage_options=node["options"]).committed_steps()


def _ask_as(uid: int, path: Path, request: dict[str, Any]) -> bytes:
    """Fork a child that drops to ``uid``, connects to ``path``, sends ``request`` and returns what it read."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            client.connect(str(path))
            try:
                client.sendall(json.dumps(request).encode() + b"\n")
            except BrokenPipeError:  # refused already: the refusal is still there to read
                pass
            answer = b""
            while not answer.endswith(b"\n"):
                received = client.recv(4096)
                if not received:
                    break
                answer += received
            os.write(writer, answer or b"<closed>")
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(writer, f"<child failed: {error!r}>".encode())
        finally:
            os._exit(0)
    os.close(writer)
    chunks = []
    while True:
        chunk = os.read(reader, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(reader)
    os.waitpid(child, 0)
    return b"".join(chunks)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to fork a child of another UID (setuid 65534)")
@pytest.mark.s3
def test_a_client_of_another_uid_is_refused_and_its_message_never_processed(node):
    daemon = node["daemon"]
    answer = _ask_as(65534, node["socket"], {"op": "report", "root": str(node["root"].resolve()), "step": 7,
                                            "save_stall_s": 0.123, "step_s": 4.5})
    refusal = json.loads(answer)
    assert refusal["ok"] is False and "UID 65534" in refusal["error"], answer
    assert "refused a control connection from UID 65534" in daemon.log()
    assert oct(node["socket"].stat().st_mode & 0o777) == oct(0o666)  # refused by credentials, not by file mode
    link = DaemonLink(node["socket"])
    status = link.status()
    link.close()
    assert status is not None and status["roots"]["run1"]["trainer_report"] is None  # the report never landed


@pytest.mark.s3
def test_a_client_of_the_daemons_uid_gets_answers(node):
    link = DaemonLink.find(node["root"])
    assert link is not None, node["daemon"].log()
    try:
        assert link.info["root_name"] == "run1" and link.promotes and link.info["remote"] == node["remote"]
        assert link.report(3, save_stall_s=0.25, step_s=1.5)
        status = link.status()
        assert status["roots"]["run1"]["trainer_report"]["save_stall_s"] == 0.25
        assert link.committed(99) is None and link.alive  # not committed there: an error answer, not a dead link
    finally:
        link.close()
    other = DaemonLink(node["socket"], node["root"].parent)  # a directory the daemon does not watch
    answer = other.hello()
    other.close()
    assert answer is not None and answer["ok"] is False and "does not watch" in answer["error"]


def _trainer(node: dict[str, Any], first: int, count: int, pause_after: int | None = None) -> subprocess.Popen[str]:
    args = [str(node["root"]), node["remote"], node["endpoint"], str(first), str(count)]
    if pause_after is not None:
        args.append(str(pause_after))
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env.pop("CKPTD_DAEMON_SOCKET", None)
    return subprocess.Popen([sys.executable, "-c", TRAINER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _lines_until(trainer: subprocess.Popen[str], last: str) -> list[Any]:
    """The trainer's JSON lines up to (and including) the first line that starts with ``last``."""
    assert trainer.stdout is not None
    lines: list[Any] = []
    for line in trainer.stdout:
        if line.startswith("paused"):
            lines.append("paused")
        else:
            lines.append(json.loads(line))
        if line.startswith(last):
            return lines
    trainer.wait(30)
    raise AssertionError(f"the trainer exited ({trainer.returncode}) after {lines}: {trainer.stderr.read()}")


def _weights(step: int) -> torch.Tensor:
    return torch.randn(64 * 1024, generator=torch.Generator().manual_seed(step))


def _restored_weights(node: dict[str, Any], tmp_path: Path, step: int) -> torch.Tensor:
    """``weights`` of ``step`` restored from the object tier alone (an empty local directory, no daemon)."""
    import ckptd

    state = {"weights": torch.zeros(64 * 1024), "step": torch.tensor(0)}
    with ckptd.CheckpointManager(tmp_path / f"fresh-{step}", remote=node["remote"], storage_options=node["options"],
                                 capture_rng=False, daemon="off") as manager:
        assert manager.restore(state, step=step) == step
        assert manager.last_restore.tier == manager.remote.label
    return state["weights"]


@pytest.mark.s3
def test_with_the_daemon_the_trainer_uploads_nothing_and_the_daemon_promotes(node, tmp_path):
    trainer = _trainer(node, 1, 3)
    try:
        lines = _lines_until(trainer, '{"uploaded"')
        assert trainer.wait(60) == 0, trainer.stderr.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    commits, final = lines[:-1], lines[-1]
    assert [line["committed"] for line in commits] == [1, 2, 3]
    assert all(line["daemon"] for line in commits) and final["daemon"]
    assert final == {"uploaded": [], "sent": {}, "daemon": True}  # not one request of its own to S3
    wait_until(lambda: _object_steps(node) == [1, 2, 3], 60, "the daemon to promote steps 1-3")
    remote = open_tier(node["remote"], storage_options=node["options"])
    assert all(list(verify_step(remote, step)) == [] for step in (1, 2, 3))
    assert _restored_weights(node, tmp_path, 3).equal(_weights(3))

    def status_shows_them() -> dict[str, Any] | None:
        shown = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "status", "--local", str(node["root"]),
                                "--json"], capture_output=True, text=True)
        assert shown.returncode == 0, shown.stderr
        document = json.loads(shown.stdout)
        tiers = document["roots"]["run1"]["tiers"]
        return document if tiers["object"]["steps"] == [1, 2, 3] and tiers["local"]["steps"] == [2, 3] else None

    document = wait_until(status_shows_them, 30, "ckptd status to show steps 1-3 on the object tier")
    assert document["roots"]["run1"]["trainer_report"]["step"] == 3  # the trainer reported its timings


@pytest.mark.s3
def test_the_daemon_killed_mid_run_the_trainer_falls_back_and_its_steps_reach_s3(node, tmp_path):
    trainer = _trainer(node, 1, 6, pause_after=3)
    try:
        before = _lines_until(trainer, "paused")
        wait_until(lambda: _object_steps(node) == [1, 2, 3], 60, "the daemon to promote steps 1-3")
        node["daemon"].kill()
        assert trainer.stdin is not None
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        after = _lines_until(trainer, '{"uploaded"')
        assert trainer.wait(60) == 0, trainer.stderr.read()
        stderr = trainer.stderr.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert [line["committed"] for line in before[:-1]] == [1, 2, 3]
    assert all(line["daemon"] and line["sent"] == {} for line in before[:-1])
    commits, final = after[:-1], after[-1]
    assert [line["committed"] for line in commits] == [4, 5, 6] and not any(line["daemon"] for line in commits)
    assert final["sent"].get("PUT", 0) > 0 and 6 in final["uploaded"], final
    assert stderr.count("stopped answering") == 1, stderr  # one warning
    remote = open_tier(node["remote"], storage_options=node["options"])
    assert {1, 2, 3, 6} <= set(remote.committed_steps())
    for step in (3, 6):  # promoted by the daemon, then by the trainer itself: nothing lost on the way
        assert list(verify_step(remote, step)) == []
        assert _restored_weights(node, tmp_path, step).equal(_weights(step))


@pytest.mark.s3
def test_ckptd_status_tables_and_no_daemon(node):
    shown = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "status", "--socket", str(node["socket"])],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "node-a" in shown.stdout and "root run1" in shown.stdout and "lag (steps)" in shown.stdout
    node["daemon"].kill()  # its .ckptd-daemon.json stays behind, naming a socket nobody serves
    gone = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "status", "--local", str(node["root"])],
                          capture_output=True, text=True)
    assert gone.returncode == 3 and gone.stdout == ""
    assert gone.stderr.count("\n") == 1 and "no ckptd daemon answers" in gone.stderr


def test_daemon_modes_without_a_daemon(tmp_path, monkeypatch):
    import ckptd
    from ckptd.errors import ConfigError

    monkeypatch.delenv("CKPTD_DAEMON_SOCKET", raising=False)
    with pytest.raises(ConfigError, match="no ckptd daemon watches the local directory of rank"):
        ckptd.CheckpointManager(tmp_path / "a", daemon="require")
    with pytest.raises(ConfigError, match="daemon='sometimes' is not one of auto, off, require"):
        ckptd.CheckpointManager(tmp_path / "b", daemon="sometimes")
    monkeypatch.setenv("CKPTD_DAEMON", "require")
    with pytest.raises(ConfigError, match="daemon='require'"):
        ckptd.CheckpointManager(tmp_path / "c")
    with ckptd.CheckpointManager(tmp_path / "d", daemon="auto") as manager:  # the argument wins over the variable
        assert not manager.daemon_promotes and [tier.kind for tier in manager.tiers] == ["local"]


def _gone_already_or_raise(function: object, path: str, info: tuple) -> None:
    """rmtree's error handler: a file that vanished meanwhile is fine, anything else is raised."""
    if not isinstance(info[1], FileNotFoundError):
        raise info[1]


def test_a_wiped_local_root_restores_from_the_buddy_the_daemon_names(tmp_path, socket_dir, monkeypatch):
    token = "t0ken-for-this-test-0123456789abcdef"
    b_root, b_state = tmp_path / "b-root", tmp_path / "b-state"
    b_root.mkdir()
    b_config = write_config(tmp_path / "b.toml", [{"name": "other", "local": str(b_root)}], state_dir=str(b_state),
                            listen="127.0.0.1:0", node_id="node-b", peer_token=token, scrub_interval_s=0)
    a_root, a_state = tmp_path / "a-root", tmp_path / "a-state"
    a_root.mkdir()
    with DaemonProcess(b_config, b_state) as buddy:
        buddy_address = buddy.wait_ready()["http"]
        a_config = write_config(tmp_path / "a.toml", [{"name": "run1", "local": str(a_root)}], state_dir=str(a_state),
                                listen="127.0.0.1:0", node_id="node-a", peer_token=token,
                                buddy=f"peer://{buddy_address}", socket=str(socket_dir / "a.sock"),
                                poll_interval_s=0.2, retry_backoff_s=0.2, scrub_interval_s=0)
        with DaemonProcess(a_config, a_state) as daemon:
            daemon.wait_ready()
            assert run_trainer(a_root, 1, 2) == [1, 2]
            replicas = tmp_path / "b-state" / "replicas" / "node-a" / "run1"
            wait_until(lambda: LocalTier(replicas).committed_steps() == [1, 2] if replicas.is_dir() else None, 60,
                       f"node-a's steps replicated to node-b; log:\n{daemon.log()}")
            # node-a's NVMe is wiped (the daemon's socket is still named by the variable); a probe file the
            # running daemon removes meanwhile is gone already
            shutil.rmtree(a_root, onerror=_gone_already_or_raise)
            a_root.mkdir()
            monkeypatch.setenv("CKPTD_DAEMON_SOCKET", str(socket_dir / "a.sock"))
            monkeypatch.setenv("CKPTD_PEER_TOKEN", token)
            import ckptd

            state = {"weights": torch.zeros(256 * 1024), "bias": torch.zeros(1024), "step": torch.tensor(0)}
            with ckptd.CheckpointManager(a_root, capture_rng=False) as manager:
                assert [tier.kind for tier in manager.tiers] == ["local", "peer"]
                assert manager.tiers[1].label.endswith(f"peer://{buddy_address}/replicas/node-a/run1")
                assert manager.restore(state) == 2
                assert manager.last_restore.tier == manager.tiers[1].label
    generator = torch.Generator().manual_seed(2)  # the seeds of harness.daemon_process.TRAINER (seed 0)
    assert state["weights"].equal(torch.randn(256 * 1024, generator=generator))
    assert state["bias"].equal(torch.randn(1024, generator=generator)) and int(state["step"]) == 2


@pytest.mark.s3
def test_a_daemon_that_promotes_elsewhere_leaves_promotion_to_the_trainer(node, caplog):
    import ckptd

    other = node["remote"].rsplit("/", 1)[0] + "/other-run"
    with ckptd.CheckpointManager(node["root"], remote=other, storage_options=node["options"],
                                 capture_rng=False, policy=ckptd.Policy(every_steps=1000)) as manager:
        assert not manager.daemon_promotes and manager.uploader is not None and manager.uploader.running
        assert [tier.kind for tier in manager.tiers] == ["local", "object"]
        assert manager.remote.label.endswith(other)
    assert "not to remote=" + other in caplog.text
