"""Corruption stays visible: a step a restore sets aside keeps a record of why and when, ``ckptd ls`` lists it,
``ckptd verify`` fails on it until ``ckptd gc --remove-set-aside`` deletes it; and the CLI says what a path is
when it is not a checkpoint root (a file, a step's folder, a directory without a root) or a step is missing.

Real checkpoints on disk, a real flipped bit, the CLI through click's runner and, once, as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.errors import IntegrityError, NotFoundError
from ckptd.manager.set_aside import SET_ASIDE_DIRECTORY, RECORD_FORMAT, remove_set_aside, set_aside_step, \
    set_aside_steps
from ckptd.testing.tamper import chunk_location, flip_bit

NUMEL = 2048


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((NUMEL,), float(step)), "b": torch.arange(16, dtype=torch.float32) + step}


def _manager(root: Path) -> ckptd.CheckpointManager:
    return ckptd.CheckpointManager(root, policy=ckptd.Policy(keep_local=None), capture_rng=False)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


@pytest.fixture
def flipped(tmp_path: Path) -> tuple[Path, str, str]:
    """Steps 1-3 saved, one bit of step 3's tensor ``w`` flipped, then a restore that falls back to step 2;
    returns the root and the chunk's digest before and after the flip."""
    from ckptd.format.hashing import chunk_digest

    root = tmp_path / "ckpt"
    with _manager(root) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    path, offset, length = chunk_location(root, 3, "w")
    expected = chunk_digest(path.read_bytes()[offset:offset + length])
    flip_bit(path, offset + 11)
    actual = chunk_digest(path.read_bytes()[offset:offset + length])
    live = {"w": torch.zeros(NUMEL), "b": torch.zeros(16)}
    with _manager(root) as manager:
        assert manager.restore(live) == 2
        assert manager.committed_steps() == [1, 2]
    assert torch.equal(live["w"], _state(2)["w"])
    return root, expected, actual


def test_a_set_aside_step_keeps_a_record_of_why_and_when(flipped: tuple[Path, str, str]) -> None:
    root, expected, actual = flipped
    (record,) = set_aside_steps(root)
    assert record.step == 3 and record.recorded and record.restored_step == 2 and record.corrupt
    assert (root / record.name / "manifest.json").is_file(), "every byte of the step is kept"
    (problem,) = record.problems
    assert (problem.rank, problem.file, problem.expected, problem.actual) == \
        (0, "step-000000000003/rank-00000.data", expected, actual)
    assert problem.chunk == expected and problem.tier is not None and problem.tier.startswith("local")
    body = json.loads((root / f"{record.name}.json").read_text())
    assert body["format"] == RECORD_FORMAT and body["reason"].startswith("bad bytes found by the restore")
    assert abs(body["set_aside_at"] - record.set_aside_at) < 1e-6
    assert not [p for p in (root / SET_ASIDE_DIRECTORY).iterdir() if ".tmp-" in p.name], "written atomically"


def test_ls_shows_the_set_aside_step_and_verify_fails_until_gc_removes_it(flipped: tuple[Path, str, str]) -> None:
    root, expected, actual = flipped
    code, output = invoke("ls", str(root))
    assert code == 0, output
    assert "set-aside" in output and "set aside 20" in output and "bad bytes found by the restore" in output
    code, output = invoke("ls", str(root), "--json")
    rows = {(row["step"], row["state"]): row for row in json.loads(output)}
    assert set(rows) == {(1, "committed"), (2, "committed"), (3, "set-aside")}
    aside = rows[3, "set-aside"]
    assert aside["set_aside_at"] > 0 and aside["set_aside_as"].startswith(f"{SET_ASIDE_DIRECTORY}/step-000000000003-")
    assert [(p["chunk"], p["expected"], p["actual"]) for p in aside["problems"]] == [(expected, expected, actual)]

    code, output = invoke("verify", str(root))
    assert code == IntegrityError.exit_code, output
    assert "SET-ASIDE step 3" in output and "rank-00000.data" in output and expected in output and actual in output
    assert "--remove-set-aside" in output
    code, output = invoke("verify", str(root), "--json")
    assert code == IntegrityError.exit_code
    answer = json.loads(output)
    assert answer["problems"] == [] and [record["step"] for record in answer["set_aside"]] == [3]
    assert invoke("verify", str(root), "--step", "3")[0] == IntegrityError.exit_code
    assert invoke("verify", str(root), "--step", "2")[0] == 0, "--step 2 has nothing set aside"

    code, output = invoke("gc", str(root), "--remove-set-aside", "--dry-run")
    assert code == 0 and "would delete set-aside steps [3]" in output, output
    assert len(set_aside_steps(root)) == 1
    code, output = invoke("gc", str(root), "--remove-set-aside", "--json")
    assert code == 0 and [r["step"] for r in json.loads(output)["set_aside_removed"]] == [3], output
    assert set_aside_steps(root) == [] and list((root / SET_ASIDE_DIRECTORY).iterdir()) == []
    code, output = invoke("verify", str(root))
    assert code == 0 and "all intact" in output, output
    assert [row["step"] for row in json.loads(invoke("ls", str(root), "--json")[1])] == [1, 2]


def test_verify_run_as_a_process_exits_non_zero_naming_the_set_aside_step(flipped: tuple[Path, str, str]) -> None:
    root, _, _ = flipped
    completed = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", str(root)], capture_output=True,
                               text=True, check=False, timeout=120)
    assert completed.returncode == IntegrityError.exit_code, completed.stderr
    assert "SET-ASIDE step 3" in completed.stdout and "Traceback" not in completed.stderr


def test_plain_gc_keeps_set_aside_steps(flipped: tuple[Path, str, str]) -> None:
    root, _, _ = flipped
    code, output = invoke("gc", str(root), "--keep", "1")
    assert code == 0, output
    assert [record.step for record in set_aside_steps(root)] == [3]
    assert invoke("verify", str(root))[0] == IntegrityError.exit_code


def test_a_set_aside_directory_without_record_is_still_listed_and_fails_verify(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with _manager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    set_aside_step(root, 2, reason="test")
    (record,) = set_aside_steps(root)
    (root / f"{record.name}.json").unlink()  # as a ckptd that kept no records left it
    (record,) = set_aside_steps(root)
    assert not record.recorded and "no record of why" in record.reason and record.step == 2
    assert abs(record.set_aside_at - time.time()) < 600, "the time of its name (UTC)"
    code, output = invoke("verify", str(root))
    assert code == IntegrityError.exit_code and "no record of why" in output
    # a record whose directory was never moved (a crash between the two) is ignored, and removed by gc
    (root / SET_ASIDE_DIRECTORY / "step-000000000009-20260101T000000-abcdef.json").write_text("{}")
    assert [r.step for r in set_aside_steps(root)] == [2]
    assert [r.step for r in remove_set_aside(root)] == [2]
    assert list((root / SET_ASIDE_DIRECTORY).iterdir()) == []


def test_a_step_set_aside_only_for_being_newer_says_so(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with _manager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    set_aside_step(root, 2, restored_step=1)
    (record,) = set_aside_steps(root)
    assert record.reason == "newer than the restored step 1" and not record.corrupt and record.problems == ()
    # no bad bytes: listed by verify, but not a failure (every elastic recovery would otherwise fail it)
    code, output = invoke("verify", str(root))
    assert code == 0 and "SET-ASIDE (no bad bytes) step 2" in output, output


def test_verify_on_a_directory_without_a_root_fails_saying_so(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    code, output = invoke("verify", str(tmp_path / "plain"))
    assert code == NotFoundError.exit_code and "holds no ckptd checkpoint root" in output, output
    with _manager(tmp_path / "fresh"):  # a root made by a manager that saved nothing yet: nothing wrong
        pass
    code, output = invoke("verify", str(tmp_path / "fresh"))
    assert code == 0 and "0 committed step(s)" in output, output
    code, output = invoke("ls", str(tmp_path / "plain"))
    assert code == 0 and "no ckptd checkpoint root" in output, output


def test_ls_and_verify_of_a_file_or_a_step_folder_name_the_root_to_pass(flipped: tuple[Path, str, str]) -> None:
    root, _, _ = flipped
    (record,) = set_aside_steps(root)
    cases = {root / "step-000000000001": "the folder of step 1",
             root / "step-000000000001" / "manifest.json": "a file",
             root / SET_ASIDE_DIRECTORY: "the folder of set-aside steps",
             root / record.name: "a step set aside by a restore"}
    for path, what in cases.items():
        for command in ("ls", "verify", "gc"):
            code, output = invoke(command, str(path))
            assert code == 2, (command, path, output)
            assert what in output and f"pass the checkpoint root that holds it: {root}" in output, (command, output)
    loose = root.parent / "loose.bin"
    loose.write_bytes(b"1234")
    code, output = invoke("ls", str(loose))
    assert code == 2 and "is a file, not a checkpoint root" in output and "pass a checkpoint root" in output


def test_restore_of_a_missing_step_lists_the_steps_there(flipped: tuple[Path, str, str], tmp_path: Path) -> None:
    root, _, _ = flipped
    for step in ("3", "7"):
        code, output = invoke("restore", str(root), "--step", step, "--out", str(tmp_path / "out.pt"))
        assert code == NotFoundError.exit_code, output
        assert f"step {step} is not committed" in output and "committed steps there: [1, 2]" in output, output
        assert "set aside by a restore: [3]" in output
    code, output = invoke("verify", str(root), "--step", "7")
    assert code == NotFoundError.exit_code and "committed steps there: [1, 2]" in output, output
    assert invoke("restore", str(root), "--step", "2", "--out", str(tmp_path / "out.pt"))[0] == 0


def test_the_daemon_counts_set_aside_steps_in_its_metrics(tmp_path: Path) -> None:
    from ckptd.daemon.config import load_config
    from ckptd.daemon.service import Daemon

    root = tmp_path / "root"
    with _manager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    config = load_config(None, {"state_dir": str(tmp_path / "state"), "node_id": "node-a", "listen": "127.0.0.1:0",
                                "watch": "poll", "poll_interval_s": 10.0, "scrub_interval_s": 0, "name": "run1",
                                "local": str(root), "remote": None}, {})
    daemon = Daemon(config)
    daemon.start()
    try:
        daemon.check_local_tiers()
        assert 'ckptd_steps_set_aside{root="run1"} 0.0' in daemon.metrics.render()[0].decode()
        set_aside_step(root, 2, restored_step=1)
        daemon.check_local_tiers()
        assert 'ckptd_steps_set_aside{root="run1"} 1.0' in daemon.metrics.render()[0].decode()
        remove_set_aside(root)
        daemon.check_local_tiers()
        assert 'ckptd_steps_set_aside{root="run1"} 0.0' in daemon.metrics.render()[0].decode()
    finally:
        daemon.stop(5.0)


@pytest.mark.parametrize("command", ["ls", "verify", "gc", "restore"])
def test_the_help_of_each_command_documents_its_exit_codes(command: str) -> None:
    code, output = invoke(command, "--help")
    assert code == 0 and "Exit status: 0" in output and " 2 PATH is a file or a folder inside" in output, output
