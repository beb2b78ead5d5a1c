"""Background work: close() while a write hangs keeps the directory lock, every error reaches the caller
(both ranks, every step), every wait has a deadline that names what it waited for, and thread pools
have an owner (changing CKPTD_IO_THREADS leaks no thread)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.background import BackgroundWorker, FailureRecord, SharedPools
from ckptd.config import override, settings
from ckptd.data import ShardCache, VerifiedFetcher, index_dataset
from ckptd.data.cache import entry_name
from ckptd.data.source import ShardSource
from ckptd.data.testing import write_jsonl_shards
from ckptd.errors import (BackgroundError, CkptdError, DeadlineError, LockedError, StillRunningError, StorageError,
                          WorkerError)
from ckptd.format.layout import rank_data_name, step_dir
from ckptd.stepio.rank_writer import RankWriter
from ckptd.testing.compare import assert_same_state
from ckptd.testing.multirank import run_multirank
from harness.write_faults import WriteFaults
from ckptd.tiers.local import LocalTier


def _state(step: int, numel: int = 50_000) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(numel, generator=generator), "n": torch.arange(step, step + 64)}


def _zeros(numel: int = 50_000) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(numel), "n": torch.zeros(64, dtype=torch.int64)}


def _ckptd_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("ckptd-")}


# --- close() while a write hangs ---------------------------------------------------------------------

def test_close_while_a_write_hangs_raises_and_keeps_the_lock_until_the_write_ends(tmp_path: Path) -> None:
    policy = ckptd.Policy(keep_local=None)
    with WriteFaults(hang_steps={2}) as faults:
        manager = ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False)
        manager.save(1, _state(1))
        manager.wait()
        manager.save(2, _state(2))
        assert faults.entered.wait(30), "the write of step 2 never started"

        with pytest.raises(StillRunningError) as caught:
            manager.close(timeout_s=0.5)
        message = str(caught.value)
        assert "step 2 is still being written on rank 0" in message, message
        assert caught.value.step == 2 and "stays locked" in message

        with pytest.raises(LockedError):  # no second writer enters while the old thread may still write
            ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False)
        with pytest.raises(CkptdError, match="closed"):
            manager.save(3, _state(3))
        assert (tmp_path / step_dir(2)).is_dir() and not manager.local.is_committed(2)

        faults.release()
        manager.close(timeout_s=60)  # the held write finishes, step 2 commits, the lock goes
        manager.close()  # safe to call again

    with ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False) as reopened:
        assert reopened.committed_steps() == [1, 2]
        for step in (1, 2):
            live = _zeros()
            assert reopened.restore(live, step=step) == step
            assert_same_state(live, _state(step))


def test_wait_gives_up_after_its_deadline_naming_the_step_and_the_save_goes_on(tmp_path: Path) -> None:
    with WriteFaults(hang_steps={1}) as faults, \
            ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        manager.save(1, _state(1))
        assert faults.entered.wait(30)
        with override(wait_timeout_s=0.3), pytest.raises(StillRunningError) as caught:
            manager.wait()
        assert "step 1 is still being written on rank 0" in str(caught.value)
        assert "CKPTD_WAIT_TIMEOUT_S" in str(caught.value)
        faults.release()
        manager.wait()
        assert manager.committed_steps() == [1]
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as reopened:
        live = _zeros()
        assert reopened.restore(live) == 1
        assert_same_state(live, _state(1))


# --- every error reaches the caller ----------------------------------------------------------------

def _both_ranks_fail(rank: int, world_size: int, root: str) -> dict[str, Any]:
    policy = ckptd.Policy(keep_local=None)
    outcome: dict[str, Any] = {}
    with WriteFaults(fail_steps={2}):
        manager = ckptd.CheckpointManager(f"{root}/node{rank}", policy=policy, capture_rng=False)
        state = {"w": torch.full((4096,), float(rank))}
        for step in (1, 2, 3):
            state["w"].fill_(step * 10 + rank)
            manager.save(step, state)
            try:
                manager.wait()
            except WorkerError as error:
                outcome["error"] = str(error)
                outcome["failed_ranks"] = sorted(error.failures)
                outcome["step"] = error.step
        outcome["committed"] = manager.committed_steps()
        manager.close()
    return outcome


def test_write_errors_on_two_ranks_both_reach_the_caller(tmp_path: Path) -> None:
    outcomes = run_multirank(_both_ranks_fail, 2, str(tmp_path), timeout_s=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["failed_ranks"] == [0, 1] and outcome["step"] == 2, outcome
        message = outcome["error"]
        assert "step 2" in message
        for failed in (0, 1):  # each rank's own failure, naming its data file
            assert f"rank {failed}:" in message and rank_data_name(failed) in message, message
        assert outcome["committed"] == [1, 3]
        assert not (tmp_path / f"node{rank}" / step_dir(2)).exists(), "the failed step's files were kept"


def test_every_failure_is_kept_not_only_the_first() -> None:
    """Two jobs fail before the owner looks: both come back, with their steps, in one error."""
    gate = threading.Event()

    def handle(step: int) -> None:
        gate.wait(30)
        raise StorageError("injected failure", step=step, tier="local")

    worker: BackgroundWorker[int] = BackgroundWorker(
        "ckptd-test-worker", handle, describe=lambda step: f"step {step} is still running",
        failures=lambda step, error: [FailureRecord(f"job for step {step}", error, step=step, rank=3)])
    try:
        worker.submit(4)
        worker.submit(5)
        with pytest.raises(StillRunningError, match="step 4 is still running; step 5 is still running"):
            worker.wait(0.2)
        gate.set()
        worker.wait(30)
        with pytest.raises(BackgroundError) as caught:
            worker.raise_failures()
        assert [(r.step, r.rank) for r in caught.value.failures] == [(4, 3), (5, 3)]
        assert "step 4, rank 3" in str(caught.value) and "step 5, rank 3" in str(caught.value)
        assert isinstance(caught.value.__cause__, StorageError) and caught.value.__cause__.step == 4
        worker.raise_failures()  # raised once, then forgotten
    finally:
        gate.set()
        worker.close(30)
    assert not worker.alive


def test_one_failure_is_raised_as_itself_and_the_saver_keeps_working(tmp_path: Path) -> None:
    with WriteFaults(fail_steps={2}), \
            ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        with pytest.raises(StorageError) as caught:
            manager.wait()
        assert caught.value.step == 2 or step_dir(2) in str(caught.value)
        assert rank_data_name(0) in str(caught.value)
        manager.save(3, _state(3))
        manager.wait()
        assert manager.committed_steps() == [1, 3]


# --- deadlines on the hand-off of a data file and on the shard-cache lock --------------------------

def test_data_file_hand_off_gives_up_after_its_deadline(tmp_path: Path) -> None:
    with override(io_threads=1, file_handoff_timeout_s=0.2) as options:
        writer = RankWriter(LocalTier(tmp_path), 7, 0, codec="raw", chunk_bytes=1 << 20, options=options)
    try:
        held = writer._take_file()  # the only parallel data file, held by a write that never returns it
        assert held == 1
        with pytest.raises(DeadlineError) as caught:
            writer._take_file()
        message = str(caught.value)
        assert "no data file of rank 0 was handed back within 0.2 s" in message
        assert caught.value.step == 7 and step_dir(7) in message and "CKPTD_FILE_HANDOFF_TIMEOUT_S" in message
        writer._free_files.put(held)
        assert writer._take_file() == held  # handed back: taken again at once
    finally:
        writer.abort()
    assert not any((tmp_path / step_dir(7)).iterdir()), "abort left files behind"


_HOLD_LOCK = textwrap.dedent("""
    import fcntl, sys, time
    from pathlib import Path
    with open(sys.argv[1], "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        Path(sys.argv[2]).write_text("held")
        time.sleep(float(sys.argv[3]))
""")


def test_cache_lock_held_by_another_loader_gives_up_after_its_deadline(tmp_path: Path) -> None:
    write_jsonl_shards(tmp_path / "data", [6, 5], payload_bytes=20)
    manifest = index_dataset(str(tmp_path / "data"), "jsonl").manifest
    record = manifest.shards[1]
    cache = ShardCache(tmp_path / "cache", lock_timeout_s=0.3)
    fetcher = VerifiedFetcher(ShardSource(str(tmp_path / "data")), cache)
    entry = entry_name(record)
    marker = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path / "cache" / ".locks" / f"{entry}.lock"),
                               str(marker), "60"])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.02)
        with pytest.raises(DeadlineError) as caught:
            fetcher.load(record)
        message = str(caught.value)
        assert f"shard cache entry {entry}" in message and "another loader" in message
        assert "CKPTD_DATA_CACHE_LOCK_TIMEOUT_S" in message and f"{entry}.lock" in message
        assert not cache.contains(entry)
    finally:
        holder.kill()
        holder.wait(30)
    assert fetcher.load(record) == (tmp_path / "data" / record.path).read_bytes()  # free again: loads
    assert cache.read(entry) == (tmp_path / "data" / record.path).read_bytes()


def test_cache_lock_held_in_this_process_also_times_out(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", lock_timeout_s=0.2)
    with cache.lock("entry-a"):
        with pytest.raises(DeadlineError, match="shard cache entry entry-a"):
            with cache.lock("entry-a"):
                pass
        with cache.lock("entry-b", timeout_s=0.2):  # other entries are not blocked
            pass
    with cache.lock("entry-a"):
        pass


# --- pools with an owner --------------------------------------------------------------------------

def test_changing_io_threads_between_saves_leaks_no_pool_or_thread(tmp_path: Path) -> None:
    before = _ckptd_threads()
    numel = 1 << 20  # 4 MiB, cut into 64 KiB chunks, so that every pool runs all its threads
    with override(chunk_bytes=64 * 1024):
        manager = ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False)
        for step, threads in enumerate((1, 3, 2, 3), start=1):
            with override(io_threads=threads):
                manager.save(step, _state(step, numel))
                manager.wait()
                pool_threads = [t for t in _ckptd_threads() - before if t.name.startswith("ckptd-write_")]
                assert 1 <= len(pool_threads) <= threads, (threads, [t.name for t in pool_threads])
        manager.close()
    leaked = _ckptd_threads() - before
    assert not leaked, f"threads left after close: {sorted(t.name for t in leaked)}"
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as reopened:
        for step in (1, 4):
            live = _zeros(numel)
            assert reopened.restore(live, step=step) == step
            assert_same_state(live, _state(step, numel))


def test_writers_without_an_owner_hold_a_lease_and_leave_no_thread(tmp_path: Path) -> None:
    before = _ckptd_threads()
    tier = LocalTier(tmp_path)
    tensor = torch.randn(300_000)
    for step, threads in enumerate((2, 4, 1), start=1):
        with override(io_threads=threads, chunk_bytes=64 * 1024) as options:
            writer = RankWriter(tier, step, 0, codec="zstd", chunk_bytes=options.chunk_bytes, options=options)
            writer.add("t", tensor)
            writer.finish({})
    assert not _ckptd_threads() - before, "a standalone writer left pool threads behind"


def test_superseded_shared_pool_is_shut_down() -> None:
    pools = SharedPools()
    first = pools.current("read", 2)
    assert first.submit(lambda: 1).result(10) == 1
    lease = pools.lease("read", 2)
    assert lease.pool is first
    second = pools.current("read", 3)  # a changed setting: a new pool takes over
    assert second is not first and pools.pools() == {"read": second}
    assert not first.closed, "a leased pool must stay usable until its lease ends"
    assert first.submit(lambda: 2).result(10) == 2
    lease.release()
    assert first.closed
    with pytest.raises(RuntimeError):
        first.submit(lambda: 3)
    assert first.live_threads() == [], "the superseded pool's threads did not end"
    assert second.submit(lambda: 4).result(10) == 4
    pools.shutdown()
    assert second.closed and pools.pools() == {}


def test_settings_are_read_once_per_save_not_once_per_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save of 64 chunks reads the settings a bounded number of times, whatever its chunk count."""
    from ckptd import config
    from ckptd.format import codecs
    from ckptd.manager import saving
    from ckptd.stepio import rank_writer

    calls = {"n": 0}
    real = config.settings

    def counting() -> Any:
        calls["n"] += 1
        return real()

    for module in (config, codecs, saving, rank_writer):
        monkeypatch.setattr(module, "settings", counting)
    with override(chunk_bytes=16 * 1024):
        chunk_bytes = settings().chunk_bytes
        with ckptd.CheckpointManager(tmp_path, codec="zstd", capture_rng=False) as manager:
            for step, numel in ((1, 4096), (2, 64 * chunk_bytes // 4)):
                calls["n"] = 0
                manager.save(step, {"w": torch.randn(numel)})
                manager.wait()
                per_save = calls["n"]
                assert per_save <= 8, f"step {step}: {per_save} reads of the settings"
            assert per_save > 0


_HOLD_FOR = textwrap.dedent("""
    import fcntl, sys, time
    from pathlib import Path
    with open(sys.argv[1], "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        Path(sys.argv[2]).write_text("held")
        while not Path(sys.argv[3]).exists():
            time.sleep(0.02)
""")


def test_prefetched_shard_and_prefetcher_close_wait_with_deadlines(tmp_path: Path) -> None:
    """A shard whose load waits on another loader: take() and close() give up after their deadlines,
    naming the shard; once the other loader is done, the load ends and its thread with it."""
    from ckptd.data.prefetch import Prefetcher

    write_jsonl_shards(tmp_path / "data", [7], payload_bytes=10)
    record = index_dataset(str(tmp_path / "data"), "jsonl").manifest.shards[0]
    cache = ShardCache(tmp_path / "cache", lock_timeout_s=60)
    fetcher = VerifiedFetcher(ShardSource(str(tmp_path / "data")), cache)
    held, done = tmp_path / "held", tmp_path / "done"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_FOR,
                               str(tmp_path / "cache" / ".locks" / f"{entry_name(record)}.lock"), str(held), str(done)])
    before = _ckptd_threads()
    try:
        deadline = time.monotonic() + 30
        while not held.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.02)
        prefetcher = Prefetcher(fetcher.load, threads=1, take_timeout_s=0.3, close_timeout_s=0.3)
        prefetcher.schedule([record])
        with pytest.raises(DeadlineError, match=f"shard {record.path} to be loaded in the background"):
            prefetcher.take(record)
        with pytest.raises(StillRunningError, match=f"loading shard {record.path}"):
            prefetcher.close()
    finally:
        done.write_text("done")
        holder.wait(30)
    loading = [t for t in threading.enumerate() if t.name.startswith("ckptd-prefetch")]
    for thread in loading:
        thread.join(30)
    assert not _ckptd_threads() - before, "the prefetch thread did not end after its load"
    assert cache.read(entry_name(record)) == (tmp_path / "data" / record.path).read_bytes()
