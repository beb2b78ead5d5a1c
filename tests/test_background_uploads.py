"""The uploader's bounded waits: with the object tier down (a closed port) or hanging (a proxy that stalls
every request), saves keep committing locally and close() reports, within its timeout, the steps that
stayed unpromoted and pinned locally; a later start promotes them with the saved bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import BackgroundError, LockedError, StillRunningError, UnpromotedError
from ckptd.promotion.pinning import PIN_DIRECTORY
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.testing.multirank import free_port
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier, same_bytes, zero_like

pytestmark = pytest.mark.s3

#: Short client timeouts: a tier that does not answer fails fast.
DOWN_SETTINGS = {"s3_connect_timeout_s": 0.5, "s3_read_timeout_s": 1.0, "s3_retries": 1}


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(step))}


def _ckptd_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("ckptd-")}


def test_object_tier_down_close_lists_the_unpromoted_steps_and_a_restart_promotes_them(
        tmp_path: Path, s3_server, s3_bucket) -> None:
    down = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"}}
    url = f"s3://{s3_bucket}/run"
    timeout_s = 20.0
    before = _ckptd_threads()
    with override(**DOWN_SETTINGS):
        # keep_remote=KeepEvery(1): every step is one the object tier keeps, so none is superseded by a newer one
        manager = ckptd.CheckpointManager(tmp_path / "local", remote=url, storage_options=down, capture_rng=False,
                                          policy=ckptd.Policy(keep_local=1, keep_remote=ckptd.KeepEvery(1)))
        for step in (1, 2, 3):
            manager.save(step, _state(step))
            manager.wait()  # saving goes on: every step commits locally
        assert manager.committed_steps() == [3]
        with pytest.raises(BackgroundError) as every:  # one failure per step, not only the first
            manager.wait_uploads()
        failed = [(record.what, record.step) for record in every.value.failures if record.step is not None]
        assert failed == [("promotion", 1), ("promotion", 2), ("promotion", 3)], str(every.value)
        started = time.monotonic()
        with pytest.raises(UnpromotedError) as caught:
            manager.close(timeout_s=timeout_s)
        elapsed = time.monotonic() - started
    error = caught.value
    assert error.steps == (1, 2, 3), str(error)
    assert "step(s) 1, 2, 3" in str(error) and "pinned locally" in str(error) and url in str(error)
    assert elapsed < timeout_s + 10, f"close took {elapsed:.1f} s, past its {timeout_s} s deadline"
    pinned = LocalTier(tmp_path / "local" / PIN_DIRECTORY)
    assert pinned.committed_steps() == [1, 2, 3], "the unpromoted steps stay pinned locally"

    # the directory lock was released, and the next start promotes what stayed pinned
    with ckptd.CheckpointManager(tmp_path / "local", remote=url, storage_options=s3_server.storage_options,
                                 capture_rng=False, policy=ckptd.Policy(keep_local=1)) as manager:
        manager.wait_uploads()
    leaked = _ckptd_threads() - before
    assert not leaked, f"threads left after close: {sorted(thread.name for thread in leaked)}"
    remote = object_tier(s3_bucket, s3_server.storage_options)
    assert remote.committed_steps() == [1, 2, 3]
    for step in (1, 2, 3):
        restored = zero_like(_state(step))
        with ckptd.CheckpointManager(tmp_path / f"empty{step}", remote=url,
                                     storage_options=s3_server.storage_options, capture_rng=False) as reader:
            assert reader.restore(restored, step=step) == step
        assert same_bytes(restored, _state(step))


def test_hanging_upload_close_gives_up_in_time_keeps_the_lock_and_a_later_close_releases_it(
        tmp_path: Path, s3_server, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    with override(s3_connect_timeout_s=2.0, s3_read_timeout_s=8.0, s3_retries=1), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, stall_s=5.0, seed=3, kinds=("stall",)) as proxy:
        manager = ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False,
                                          storage_options=proxy.storage_options(s3_server.storage_options))
        manager.save(1, _state(1))
        manager.wait()
        with pytest.raises(UnpromotedError) as caught:
            manager.close(timeout_s=1.0)
        assert caught.value.steps == (1,) and "did not finish within" in str(caught.value)
        assert "step 1 is still being promoted" in str(caught.value)
        assert isinstance(caught.value.__cause__, StillRunningError)
        with pytest.raises(LockedError):  # the upload may still touch the pins: nobody else enters
            ckptd.CheckpointManager(tmp_path / "local", capture_rng=False)
        proxy.stop()  # the stalled request ends, new ones are refused: the uploader thread ends
        with pytest.raises(UnpromotedError):
            manager.close(timeout_s=60)
    assert LocalTier(tmp_path / "local" / PIN_DIRECTORY).committed_steps() == [1]
    with ckptd.CheckpointManager(tmp_path / "local", capture_rng=False) as reopened:  # the lock was released
        assert reopened.committed_steps() == [1]
