"""The writer process (``CKPTD_WRITER_MODE=process``) and the visible commit window: durable saves, the
``last_commit`` record, a writer process killed mid-save, and a trainer killed a few steps after a save.

The writer process is held with SIGSTOP where a test needs a save to be in flight, so no test here depends
on how fast anything runs (the one that does, a trainer killed three steps after a save beside busy
cores, is in the slow group: see its docstring)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import ConfigError, WriterProcessError
from ckptd.format.layout import step_dir
from ckptd.stepio import writer_process
from ckptd.stepio.shared_memory import OWNER_PREFIX, PREFIX, create_segment, remove_orphans, remove_segments_of


@pytest.fixture(params=["process", "thread"])
def writer_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    with override(writer_mode=request.param):
        yield request.param


@pytest.fixture
def process_mode() -> Iterator[None]:
    with override(writer_mode="process"):
        yield


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_durable_save_is_committed_when_save_returns(tmp_path: Path, writer_mode: str) -> None:
    state = {"w": torch.randn(256, 256), "n": 7}
    policy = ckptd.Policy(durable_every_steps=3, keep_local=None)
    with ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False) as manager:
        assert manager.save(1, state, durable=True)
        assert (tmp_path / step_dir(1) / "manifest.json").is_file()
        assert manager.committed_steps() == [1]
        assert manager.last_commit is not None and manager.last_commit.step == 1
        manager.save(2, state)
        assert manager.save(3, state)  # a multiple of durable_every_steps: committed on return
        assert 3 in manager.committed_steps()
        assert manager.last_commit.step == 3 and manager.last_commit.steps_elapsed == 0
        restored = {"w": torch.zeros(256, 256), "n": 0}
        assert manager.restore(restored) == 3
    assert torch.equal(restored["w"], state["w"]) and restored["n"] == 7


def test_policy_refuses_a_bad_durable_interval() -> None:
    with pytest.raises(ckptd.ConfigError, match="durable_every_steps"):
        ckptd.Policy(durable_every_steps=0)


def test_last_commit_records_the_window_of_a_held_save(tmp_path: Path, process_mode: None) -> None:
    state = {"w": torch.randn(1024)}
    # every step is due (every_steps=1), so steps 5-7 are refused only because step 4 is still in flight
    policy = ckptd.Policy(every_steps=1, on_busy="skip")
    with ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False) as manager:
        assert manager.last_commit is None
        manager.save(0, state, durable=True)  # the writer process is up
        first = manager.last_commit
        assert first is not None and first.step == 0 and first.tier == "local" and first.seconds >= 0
        writer = manager._saver._process
        os.kill(writer.pid, signal.SIGSTOP)  # the save of step 4 stays in flight while the loop goes on
        try:
            assert manager.save(4, state)
            returned = time.monotonic()
            for step in (5, 6, 7):
                assert not manager.save(step, state)  # busy: skipped
            assert manager._saver.skipped[-3:] == [5, 6, 7]
            assert manager.last_commit is first
            released = time.monotonic()
        finally:
            os.kill(writer.pid, signal.SIGCONT)
        manager.wait()
        record = manager.last_commit
    assert record.step == 4
    assert record.steps_elapsed == 3  # the loop had reached step 7 when step 4 was committed
    assert record.committed_at >= released and record.seconds >= released - returned


def test_a_killed_writer_process_fails_the_save_and_leaves_committed_steps_alone(
        tmp_path: Path, process_mode: None) -> None:
    state = {"w": torch.randn(128, 1024), "b": torch.arange(100)}
    with ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        manager.save(1, state, durable=True)
        before = _digests(tmp_path / step_dir(1))
        writer = manager._saver._process
        pid = writer.pid
        os.kill(pid, signal.SIGSTOP)  # hold it with step 2 handed over, then kill it
        state["w"].add_(1.0)
        assert manager.save(2, state)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WriterProcessError, match="killed by signal 9") as raised:
            manager.wait()
        assert raised.value.step == 2 and isinstance(raised.value, ckptd.CkptdError)
        assert manager.committed_steps() == [1]
        assert _digests(tmp_path / step_dir(1)) == before
        state["w"].add_(1.0)
        manager.save(3, state, durable=True)  # a new writer process takes over
        assert writer.pid != pid and writer.starts == 2
        assert manager.committed_steps() == [1, 3]
        restored = {"w": torch.zeros(128, 1024), "b": torch.zeros(100, dtype=torch.long)}
        assert manager.restore(restored, step=3) == 3
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
    assert _digests(tmp_path / step_dir(1)) == before


def test_close_stops_the_writer_process(tmp_path: Path, process_mode: None) -> None:
    manager = ckptd.CheckpointManager(tmp_path, capture_rng=False)
    manager.save(1, {"w": torch.randn(64)}, durable=True)
    process = manager._saver._process._process
    manager.close()
    assert process.poll() is not None  # close() waited for it (CKPTD_WRITER_STOP_TIMEOUT_S, then a kill)
    assert manager._saver._process.pid is None


def test_an_error_in_the_writer_process_comes_back_typed(tmp_path: Path, process_mode: None) -> None:
    state = {"w": torch.randn(64)}
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        manager.save(1, state, durable=True)
        (tmp_path / step_dir(2)).write_text("a file where the step directory belongs")
        manager.save(2, state)
        with pytest.raises(ckptd.CkptdError) as raised:
            manager.wait()
        assert raised.value.step == 2 and not isinstance(raised.value, WriterProcessError)
        (tmp_path / step_dir(2)).unlink()
        manager.save(3, state, durable=True)  # the same writer process goes on
        assert manager.committed_steps()[-1] == 3


def test_a_writer_process_alive_after_its_pipe_broke_is_killed_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipe broke but the process lives on (here: stopped): waiting for its exit times out, so it is killed
    and the step fails with WriterProcessError (not subprocess.TimeoutExpired)."""
    monkeypatch.setattr(writer_process, "_DIED_WAIT_S", 0.3)
    writer = writer_process.WriterProcess()
    try:
        process = writer._process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        error = writer.lost("the write of step 3", 3)
        assert isinstance(error, WriterProcessError) and error.step == 3
        assert "was killed" in str(error) and "during the write of step 3" in str(error)
        assert process.poll() == -signal.SIGKILL and writer.pid is None
    finally:
        writer.close(1.0)


_SEGMENT_HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ckptd.stepio.shared_memory import create_segment
    segments = [create_segment(8192, directory=Path(sys.argv[1])) for _ in range(2)]
    print(" ".join(segment.name for segment in segments), flush=True)
    sys.stdin.read()  # lives until the test closes its stdin or kills it
""")


def test_orphan_removal_spares_segments_of_live_processes_whatever_their_pid(tmp_path: Path) -> None:
    """/dev/shm shared across PID namespaces: a segment whose pid names no process here (another container's
    live trainer) is kept while its creator lives (its owner lock is held), and removed once it is gone."""
    holder = subprocess.Popen([sys.executable, "-c", _SEGMENT_HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        mine, renamed = holder.stdout.readline().split()
        # as seen from another PID namespace: the creator's pid is not a process here
        absent = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
        with pytest.raises(ProcessLookupError):
            os.kill(absent, 0)
        token, suffix = renamed[len(PREFIX):].split("-")[1:]
        foreign = f"{PREFIX}{absent}-{token}-{suffix}"
        (tmp_path / renamed).rename(tmp_path / foreign)
        own = create_segment(4096, directory=tmp_path)  # this process's, live as well
        assert remove_orphans(directory=tmp_path) == []
        assert remove_segments_of(absent, directory=tmp_path) == []
        assert remove_segments_of(holder.pid, directory=tmp_path) == []
        assert remove_segments_of(os.getpid(), directory=tmp_path) == []
        present = set(os.listdir(tmp_path))
        assert {mine, foreign, own.name, f"{OWNER_PREFIX}{token}"} <= present
    finally:
        holder.kill()
        holder.wait()
    assert sorted(remove_orphans(directory=tmp_path)) == sorted([mine, foreign])
    left = sorted(os.listdir(tmp_path))
    assert left == sorted([own.name, *(name for name in left if name.startswith(OWNER_PREFIX))])
    assert f"{OWNER_PREFIX}{token}" not in left  # the dead owner's file went with its segments
    assert remove_orphans(directory=tmp_path) == [] and own.name in os.listdir(tmp_path)


_SMALL_TMPFS = textwrap.dedent("""
    import os, subprocess, sys
    from pathlib import Path
    directory = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)], check=True)
    from ckptd.errors import ConfigError
    from ckptd.stepio.shared_memory import create_segment
    small = create_segment(256 * 1024, directory=directory)
    small.memory[:] = b"x" * small.size
    try:
        big = create_segment(4 * 1024 * 1024, directory=directory)
    except ConfigError as error:
        print("ConfigError:", error, flush=True)
    else:
        big.memory[:] = b"x" * big.size  # a mapping larger than the tmpfs: SIGBUS at the first page past it
        print("no error", flush=True)
    print(" ".join(sorted(os.listdir(directory))), flush=True)
""")


def test_a_segment_larger_than_its_tmpfs_raises_a_config_error_not_sigbus(tmp_path: Path) -> None:
    """A 1 MiB tmpfs (Docker's 64 MiB /dev/shm in small), mounted in a mount namespace of the child's own:
    a 4 MiB segment fails when created, with the fix named, instead of killing the process with SIGBUS."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (unshare --mount)")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not allowed here: {probe.stderr.strip()}")
    directory = tmp_path / "shm"
    directory.mkdir()
    child = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _SMALL_TMPFS,
                            str(directory)], capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0, f"status {child.returncode}: {child.stderr[-2000:]}"
    said, listed = child.stdout.splitlines()
    assert said.startswith("ConfigError:"), said
    assert str(directory) in said and "4194304 bytes" in said
    assert "--shm-size" in said and "CKPTD_WRITER_MODE=thread" in said
    names = listed.split()  # the failed segment's file is gone; the small one and the owner file stay
    assert len(names) == 2 and sum(name.startswith(PREFIX) for name in names) == 1
    assert issubclass(ConfigError, ckptd.CkptdError)


_GIL_TRAINER = textwrap.dedent("""
    import os, signal, sys
    import torch
    import ckptd
    root, kill_after, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(seed)
    state = {"w": torch.randn(512 * 1024)}  # 2 MB
    # on_busy="skip": a save never waits for the previous one, so the loop runs at its own pace and the
    # window between save() and the commit is what it is (with "wait", saving every step, the next save
    # would wait for the commit)
    policy = ckptd.Policy(keep_local=None, on_busy="skip")
    manager = ckptd.CheckpointManager(root, policy=policy, capture_rng=False)
    manager.save(0, state, durable=True)  # the writer process is up before the measured loop
    saved = None
    for step in range(1, 60):
        state["w"][step] = float(step)
        if manager.save(step, state) and saved is None and step >= kill_after:
            saved = step
            print("saved", step, flush=True)
        if saved is not None and step == saved + 3:
            os.kill(os.getpid(), signal.SIGKILL)
        total = 0
        for i in range(300_000):  # pure-Python work that holds the GIL between steps
            total += i * i
""")


def _burners(count: int) -> list[subprocess.Popen[bytes]]:
    code = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_a_trainer_killed_three_steps_after_a_save_keeps_that_save(tmp_path: Path, seed: int) -> None:
    """A GIL-holding loop saving 2 MB every step (``on_busy="skip"``: a save never waits), beside a CPU-bound
    process at normal priority, SIGKILLed three steps after the first save accepted at or after a seeded
    step: that save is committed. Slow group: whether the commit
    lands within three steps depends on the machine's speed and load (the goal it checks is a latency, see
    benchmarks/bench_commit_latency.py); the default run covers the mechanism (durable saves, the window
    record, a killed writer)."""
    kill_after = random.Random(seed).randrange(3, 30)
    root = tmp_path / "ckpt"
    burners = _burners(max(1, (os.cpu_count() or 2) - 1))
    try:
        env = dict(os.environ, CKPTD_WRITER_MODE="process")
        child = subprocess.run([sys.executable, "-c", _GIL_TRAINER, str(root), str(kill_after), str(seed)],
                               env=env, capture_output=True, timeout=240)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    saved = int(child.stdout.decode().split("saved", 1)[1].split()[0])
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        committed = manager.committed_steps()
        state = {"w": torch.zeros(512 * 1024)}
        restored = manager.restore(state)
    assert saved in committed, f"step {saved}, saved three steps before the kill, was lost: committed {committed}"
    assert restored is not None and restored >= saved
    assert state["w"][saved].item() == float(saved)
