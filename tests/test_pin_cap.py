"""Bounded pins: while the object tier is down, the local disk holds at most ``pin_max_steps`` pinned steps
beyond what ``keep_local`` keeps (measured in bytes under the local root), the oldest pins are released
with a warning saying how far the object tier is behind, and once it answers again the newest step is
promoted. close() after several failed promotions names every one of them, within its deadline."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import CkptdError, ConfigError, StillRunningError, UnpromotedError
from ckptd.policy import KeepEvery, Policy
from ckptd.promotion.pinning import PIN_DIRECTORY, PinCap, pins_over_cap
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier, same_bytes, zero_like

pytestmark = pytest.mark.s3

#: A tier that refuses is known within a second or two.
FAIL_FAST = {"s3_connect_timeout_s": 0.5, "s3_read_timeout_s": 2.0, "s3_retries": 1, "s3_metadata_retries": 1}
STEP_BYTES = 4 * 65_536 * 4


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {f"w{index}": torch.randn(65_536, generator=generator) for index in range(4)}


def _disk_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once (a pin is a hard link until its step is deleted)."""
    seen: dict[tuple[int, int], int] = {}
    for directory, _, names in os.walk(root):
        for name in names:
            stat = os.lstat(os.path.join(directory, name))
            seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def test_pins_over_cap_releases_the_oldest_and_keeps_the_newest_and_the_one_in_flight() -> None:
    assert pins_over_cap({1: 0, 2: 0, 3: 0, 4: 0}, PinCap(2)) == [1, 2]
    assert pins_over_cap({1: 0, 2: 0, 3: 0, 4: 0}, PinCap(2), keep=[1]) == [2, 3]
    assert pins_over_cap({1: 50, 2: 50, 3: 50}, PinCap(10, max_bytes=60)) == [1, 2]
    assert pins_over_cap({1: 50, 2: 10, 3: 500}, PinCap(10, max_bytes=60)) == [1, 2], "the newest stays"
    assert pins_over_cap({1: 50, 2: 50}, PinCap(10, max_bytes=0)) == [], "0 bytes: no byte limit"
    assert pins_over_cap({}, PinCap(1)) == []
    assert pins_over_cap({1: 0, 2: 0, 3: 0, 4: 0, 5: 0}, PinCap(3), keep_if_possible=[2]) == [1, 3], \
        "a step keep_remote keeps for good goes after the others"
    assert pins_over_cap({1: 0, 2: 0, 3: 0, 4: 0}, PinCap(2), keep=[3], keep_if_possible=[1, 2]) == [1, 2], \
        "and only when the cap cannot be met otherwise"
    with pytest.raises(ConfigError, match="CKPTD_PIN_MAX_STEPS"):
        PinCap(0)
    with override(pin_max_steps=7, pin_max_bytes=123):
        assert PinCap.from_settings() == PinCap(7, 123)


def test_object_tier_down_for_ten_saves_stays_within_the_pin_cap_then_the_newest_is_promoted(
        tmp_path: Path, s3_server, s3_bucket, caplog: pytest.LogCaptureFixture) -> None:
    url, root, keep_local, cap = f"s3://{s3_bucket}/run", tmp_path / "local", 2, 3
    pins = LocalTier(root / PIN_DIRECTORY)
    caplog.set_level(logging.WARNING, logger="ckptd.promotion")
    with override(pin_max_steps=cap, **FAIL_FAST), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",)) as proxy:
        with ckptd.CheckpointManager(root, remote=url, capture_rng=False, policy=Policy(keep_local=keep_local),
                                     storage_options=proxy.storage_options(s3_server.storage_options)) as manager:
            uploader = manager.uploader
            most_bytes = 0
            for step in range(1, 11):
                manager.save(step, _state(step))
                with pytest.raises(CkptdError):  # each promotion fails before the next save: the pins pile up
                    manager.wait_uploads()
                most_bytes = max(most_bytes, _disk_bytes(root))
                assert len(pins.list_step_numbers()) <= cap, f"after step {step}: pinned {pins.list_step_numbers()}"
            assert 10 in pins.committed_steps(), "the newest pin is always kept"
            assert uploader.released, "ten unpromoted steps do not fit a cap of three"
            assert most_bytes <= (keep_local + cap) * STEP_BYTES * 1.1, \
                f"{most_bytes} bytes under the local root, past keep_local + pin cap"
            assert most_bytes < 10 * STEP_BYTES, "pins of every unpromoted step would hold ten steps"
            capped = [record.getMessage() for record in caplog.records if "pins capped" in record.getMessage()]
            assert capped and "behind" in capped[-1] and "remote none" in capped[-1], capped

            proxy.fraction = 0.0  # the object tier answers again
            manager.save(11, _state(11))
            manager.wait_uploads()
            lag = manager.promotion_lag
    remote = object_tier(s3_bucket, s3_server.storage_options)
    assert remote.committed_steps()[-1] == 11, "the newest step is promoted once the tier is back"
    assert lag is not None and lag.steps_behind == 0
    assert pins.list_step_numbers() == [], "the older failed pins are superseded by the promoted newest step"
    restored = zero_like(_state(11))
    with ckptd.CheckpointManager(tmp_path / "reader", remote=url, capture_rng=False,
                                 storage_options=s3_server.storage_options) as reader:
        assert reader.restore(restored) == 11
    assert same_bytes(restored, _state(11))


def test_close_names_every_failed_step_and_gives_up_in_time(tmp_path: Path, s3_server, s3_bucket) -> None:
    url, timeout_s = f"s3://{s3_bucket}/run", 2.0
    with override(pin_max_steps=2, **FAIL_FAST), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",), stall_s=20.0) as proxy:
        manager = ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False,
                                          storage_options=proxy.storage_options(s3_server.storage_options))
        for step in (1, 2, 3):
            manager.save(step, _state(step))
            with pytest.raises(CkptdError):  # each promotion fails (and is forgotten by wait) before the next save
                manager.wait_uploads()
        proxy.kinds = ("stall",)  # step 4 hangs on the object tier
        manager.save(4, _state(4))
        manager.wait()
        with pytest.raises(UnpromotedError) as caught:
            manager.close(timeout_s=timeout_s)
        text = str(caught.value)
        assert isinstance(caught.value.__cause__, StillRunningError)
        assert "3 failed promotion(s)" in text, text
        for step in (1, 2, 3):
            assert f"step {step}" in text, f"step {step} missing from: {text}"
        assert "pin since released" in text, "the pin cap of two released the oldest failed steps"
        # gave up at its deadline: step 4's upload, stalled ten times as long, had not ended
        assert 4 in caught.value.steps and "step 4 is still being promoted" in text
        proxy.stop()
        with pytest.raises(UnpromotedError):
            manager.close(timeout_s=60)


def test_a_restart_with_more_pins_than_the_cap_resumes_the_newest(tmp_path: Path, s3_server, s3_bucket) -> None:
    url, root = f"s3://{s3_bucket}/run", tmp_path / "local"
    with override(pin_max_steps=10, **FAIL_FAST), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",)) as proxy:
        manager = ckptd.CheckpointManager(root, remote=url, capture_rng=False, policy=Policy(keep_local=1),
                                          storage_options=proxy.storage_options(s3_server.storage_options))
        for step in range(1, 6):
            manager.save(step, _state(step))
            with pytest.raises(CkptdError):
                manager.wait_uploads()
        with pytest.raises(UnpromotedError) as caught:
            manager.close()
    assert caught.value.steps == (1, 2, 3, 4, 5)
    with override(pin_max_steps=2), \
            ckptd.CheckpointManager(root, remote=url, capture_rng=False, policy=Policy(keep_local=1),
                                    storage_options=s3_server.storage_options) as manager:
        manager.wait_uploads()
    committed = object_tier(s3_bucket, s3_server.storage_options).committed_steps()
    assert committed[-1] == 5 and len(committed) <= 3, committed  # the one started first, and the newest two
    assert LocalTier(root / PIN_DIRECTORY).list_step_numbers() == []
    restored = zero_like(_state(5))
    with ckptd.CheckpointManager(tmp_path / "reader", remote=url, capture_rng=False,
                                 storage_options=s3_server.storage_options) as reader:
        assert reader.restore(restored) == 5
    assert same_bytes(restored, _state(5))


def test_the_pin_cap_releases_steps_keep_remote_keeps_for_good_last(tmp_path: Path, s3_server, s3_bucket) -> None:
    url, root = f"s3://{s3_bucket}/run", tmp_path / "local"
    policy = Policy(keep_local=1, keep_remote=KeepEvery(3, latest=1))
    with override(pin_max_steps=3, **FAIL_FAST), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",)) as proxy:
        manager = ckptd.CheckpointManager(root, remote=url, capture_rng=False, policy=policy,
                                          storage_options=proxy.storage_options(s3_server.storage_options))
        for step in range(1, 8):
            manager.save(step, _state(step))
            with pytest.raises(CkptdError):
                manager.wait_uploads()
        pinned = LocalTier(root / PIN_DIRECTORY).committed_steps()
        assert pinned == [3, 6, 7], f"the milestones 3 and 6 outlive the other unpromoted pins: {pinned}"
        assert list(manager.uploader.released) == [1, 2, 4, 5]
        with pytest.raises(UnpromotedError) as caught:
            manager.close(timeout_s=30)
    assert caught.value.steps == (3, 6, 7)


def test_close_bounds_writes_and_uploads_together(tmp_path: Path, s3_server, s3_bucket) -> None:
    """A save still being written and an upload that hangs share one close() deadline: the uploads get
    what the write left, not a deadline of their own."""
    import threading

    from harness.write_faults import WriteFaults

    url, timeout_s, write_held_s = f"s3://{s3_bucket}/run", 6.0, 4.0
    with override(**dict(FAIL_FAST, s3_read_timeout_s=60.0)), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("stall",), stall_s=60.0) as proxy:
        manager = ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False,
                                          storage_options=proxy.storage_options(s3_server.storage_options))
        manager.save(1, _state(1))
        manager.wait()  # step 1's upload now hangs on the object tier
        given_to_uploads: list[float | None] = []
        close_saver, close_uploads = manager._saver.close, manager._remote_sync.close

        def saver_close(budget: float) -> None:
            # the held write goes on for write_held_s of the close() deadline, counted from its start
            threading.Timer(write_held_s, faults.release).start()
            close_saver(budget)

        def uploads_close(timeout: float | None, **keywords: object) -> None:
            given_to_uploads.append(timeout)
            close_uploads(timeout, **keywords)

        manager._saver.close, manager._remote_sync.close = saver_close, uploads_close
        with WriteFaults(hang_steps={2}) as faults:
            manager.save(2, _state(2))
            assert faults.entered.wait(30), "the write of step 2 was held"
            started = time.monotonic()
            with pytest.raises(UnpromotedError):
                manager.close(timeout_s=timeout_s)
            elapsed = time.monotonic() - started
        del manager._saver.close, manager._remote_sync.close  # the real ones again
        assert manager.local.committed_steps() == [1, 2], "the held write finished and committed within close()"
        assert len(given_to_uploads) == 1 and given_to_uploads[0] is not None
        assert given_to_uploads[0] <= timeout_s - write_held_s, \
            f"the uploads got {given_to_uploads[0]:.1f} s of a {timeout_s} s deadline a write held {write_held_s} s"
        # only a hang trips this: a close that waited for the hung upload would wait the 60 s of its stall
        assert elapsed < 40.0, f"close took {elapsed:.1f} s for a {timeout_s} s deadline"
        proxy.stop()
        with pytest.raises(UnpromotedError):
            manager.close(timeout_s=60)
