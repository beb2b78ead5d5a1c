"""Promotion at training cadence: saves that commit faster than they upload (a proxy that delays every
request to moto's server) never leave more than one step in flight and one queued; the newest step is
promoted in the end, every remote step is whole and restores bit for bit; the promotion lag, computed
from the tiers or known by the manager, says how far the object tier is behind."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.format.records import Manifest
from ckptd.policy import KeepEvery, Policy
from ckptd.promotion import promote_step
from ckptd.promotion.lag import PromotionLag, lag_between, promotion_lag
from ckptd.promotion.pinning import PIN_DIRECTORY
from ckptd.stepio.step_reader import verify_step
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier, same_bytes, save_local, zero_like

pytestmark = pytest.mark.s3


class DelayingProxy(FaultProxy):
    """The fault proxy, forwarding every request only after ``delay_s`` seconds (a slow object store)."""

    def __init__(self, upstream: str, *, delay_s: float) -> None:
        super().__init__(upstream, fraction=0.0)
        self.delay_s = delay_s

    def choose_fault(self) -> str | None:
        time.sleep(self.delay_s)
        return super().choose_fault()


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {f"layer{index}": torch.randn(8_192, generator=generator) for index in range(6)}


def test_saves_faster_than_uploads_keep_one_in_flight_and_one_queued(tmp_path: Path, s3_server, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    direct = object_tier(s3_bucket, s3_server.storage_options)  # behind the proxy's back
    pins = LocalTier(tmp_path / "local" / PIN_DIRECTORY)
    steps = range(1, 41)
    samples: list[tuple[int, list[int], int | None]] = []
    with DelayingProxy(s3_server.endpoint_url, delay_s=0.08) as proxy:
        with ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False,
                                     storage_options=proxy.storage_options(s3_server.storage_options),
                                     policy=Policy(keep_local=2)) as manager:
            uploader = manager.uploader
            for step in steps:
                manager.save(step, _state(step))
                manager.wait()
                remote_steps = direct.committed_steps()
                samples.append((step, pins.list_step_numbers(), remote_steps[-1] if remote_steps else None))
                assert len(uploader.unpromoted) <= 2, f"after step {step}: {uploader.unpromoted} wait for upload"
                lag = manager.promotion_lag
                assert lag is not None and lag.local_step == step and lag.steps_behind == step - (lag.remote_step or 0)
            manager.wait_uploads()
            superseded, promoted = list(uploader.superseded), [report.step for report in manager.upload_reports]
            final_lag = manager.promotion_lag
    for step, pinned, _ in samples:
        assert len(pinned) <= 2, f"after step {step} the local tier held {pinned} waiting for upload"
    newest_remote = [remote for _, _, remote in samples if remote is not None]
    assert newest_remote == sorted(newest_remote), "the object tier's newest step never goes back"
    assert superseded, "steps commit faster than they upload here, so queued steps must have been superseded"
    assert promoted[-1] == steps[-1], "the newest step is promoted in the end"
    assert sorted(set(promoted) | set(superseded)) == list(steps), "each step is promoted or superseded"
    assert not set(promoted) & set(superseded)
    assert final_lag == PromotionLag(steps[-1], steps[-1], 0, 0.0)
    assert pins.list_step_numbers() == [], "every pin is released once the newest step is promoted"

    committed = direct.committed_steps()
    assert committed == sorted(promoted)
    assert direct.list_step_numbers() == committed, "no step directory is left half-written on the object tier"
    for step in committed:
        assert list(verify_step(direct, step)) == []
        restored = zero_like(_state(step))
        with ckptd.CheckpointManager(tmp_path / f"reader{step}", remote=url, capture_rng=False,
                                     storage_options=s3_server.storage_options) as reader:
            assert reader.restore(restored, step=step) == step
        assert same_bytes(restored, _state(step)), f"step {step} restored from the object tier differs"


def test_steps_that_keep_remote_keeps_for_good_are_never_superseded(tmp_path: Path, s3_server, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    policy = Policy(keep_local=2, keep_remote=KeepEvery(5, latest=1))
    with DelayingProxy(s3_server.endpoint_url, delay_s=0.08) as proxy:
        with ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False, policy=policy,
                                     storage_options=proxy.storage_options(s3_server.storage_options)) as manager:
            for step in range(1, 16):
                manager.save(step, _state(step))
                manager.wait()
            manager.wait_uploads()
            superseded = list(manager.uploader.superseded)
    assert superseded and not {5, 10, 15} & set(superseded), superseded
    committed = object_tier(s3_bucket, s3_server.storage_options).committed_steps()
    assert {5, 10, 15} <= set(committed), committed


def test_which_queued_steps_may_be_superseded() -> None:
    assert all(Policy().may_supersede(step) for step in (1, 7, 1000)), "keep_remote=None keeps only by recency"
    assert Policy(keep_remote=3).may_supersede(9)
    milestones = Policy(every_steps=5, keep_remote=KeepEvery(100, latest=2))
    assert [step for step in range(5, 405, 5) if not milestones.may_supersede(step)] == [100, 200, 300, 400]
    sparse = Policy(every_steps=10, remote_every_steps=50, keep_remote=KeepEvery(1000))
    assert not sparse.may_supersede(1000) and sparse.may_supersede(1050)


def _created(tier: LocalTier, step: int) -> float:
    return Manifest.from_json_bytes(tier.read_bytes(step_file(step, MANIFEST_NAME)), path=MANIFEST_NAME).created


def test_promotion_lag_from_the_tiers(tmp_path: Path, s3_server, s3_bucket) -> None:
    remote = object_tier(s3_bucket, s3_server.storage_options)
    local = save_local(tmp_path / "local", {step: _state(step) for step in (2, 4, 6)})
    assert promotion_lag(local, remote) == PromotionLag(6, None, 6, None), "nothing promoted yet"
    promote_step(local, remote, 2)
    lag = promotion_lag(local, remote)
    assert (lag.local_step, lag.remote_step, lag.steps_behind) == (6, 2, 4)
    assert lag.seconds_behind == pytest.approx(_created(local, 6) - _created(local, 2))
    assert lag.behind and "4 step(s) behind" in lag.describe()
    promote_step(local, remote, 6)
    assert promotion_lag(local, remote) == PromotionLag(6, 6, 0, 0.0)
    assert promotion_lag(LocalTier(tmp_path / "empty"), remote) == PromotionLag(None, 6, 0, None)
    assert lag_between(3, 7) == PromotionLag(3, 7, 0, 0.0), "an object tier ahead is not behind"


def test_manager_promotion_lag_while_the_object_tier_refuses(tmp_path: Path, s3_server, s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    with override(s3_connect_timeout_s=0.5, s3_read_timeout_s=1.0, s3_retries=1, s3_metadata_retries=1), \
            FaultProxy(s3_server.endpoint_url, fraction=0.0, kinds=("500",)) as proxy:
        with ckptd.CheckpointManager(tmp_path / "local", remote=url, capture_rng=False,
                                     storage_options=proxy.storage_options(s3_server.storage_options)) as manager:
            assert manager.promotion_lag == PromotionLag(None, None, 0, None)
            manager.save(3, _state(3))
            manager.wait_uploads()
            assert manager.promotion_lag == PromotionLag(3, 3, 0, 0.0)
            proxy.fraction = 1.0  # every request now fails
            for step in (4, 5):
                manager.save(step, _state(step))
                with pytest.raises(ckptd.errors.CkptdError):
                    manager.wait_uploads()
            lag = manager.promotion_lag
            assert (lag.local_step, lag.remote_step, lag.steps_behind) == (5, 3, 2)
            assert lag.seconds_behind is not None and lag.seconds_behind > 0
            proxy.fraction = 0.0
            manager.save(6, _state(6))
            manager.wait_uploads()
            assert manager.promotion_lag == PromotionLag(6, 6, 0, 0.0)
    assert manager.promotion_lag.steps_behind == 0
    with ckptd.CheckpointManager(tmp_path / "plain", capture_rng=False) as plain:
        assert plain.promotion_lag is None


class _Writer:
    """A writer the tier yields to: ``busy()`` says whether it writes, and records which caller (the asyncio task
    on a tier's event loop, else the thread) asked, and what it was told."""

    def __init__(self, busy: bool) -> None:
        self.writing = busy
        self.polls: list[tuple[object, bool]] = []
        self.lock = threading.Lock()

    def busy(self) -> bool:
        try:
            caller: object = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread
            caller = threading.get_ident()
        with self.lock:
            answer = self.writing
            self.polls.append((caller, answer))
        return answer


class _Overlap(_Writer):
    """Writes until ``needed`` callers wait at the same time (each was told busy and has not been told idle
    since), then stops for good: the moment overlapping waits are seen, ``overlapped`` is set."""

    def __init__(self, needed: int) -> None:
        super().__init__(busy=True)
        self.needed, self.overlapped = needed, threading.Event()
        self.waiting: set[object] = set()

    def busy(self) -> bool:
        caller = asyncio.current_task()
        with self.lock:
            if self.writing:
                self.waiting.add(caller)
                if len(self.waiting) >= self.needed:
                    self.writing = False
                    self.overlapped.set()
        return super().busy()


def test_s3_calls_yield_while_a_save_is_written_without_blocking_each_other(s3_server, s3_bucket) -> None:
    # a call waits while the writer writes, at most its limit: this writer never stops, so only the limit ends it
    # (a limit long enough that no pause of a loaded machine between two polls spends it whole)
    limited = object_tier(s3_bucket, s3_server.storage_options, prefix="yield")
    endless = _Writer(busy=True)
    limited.yield_while(endless.busy, limit_s=0.5)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        call = pool.submit(limited.exists, "missing")
        try:
            assert call.result(timeout=60) is False, "a writer that never stops holds a call only its limit"
        finally:
            endless.writing = False  # a call that ignored its limit is let go
        assert time.monotonic() - started >= 0.5, "a call waits while the writer writes"
    assert len(endless.polls) > 1 and all(answer for _, answer in endless.polls), "it waited, polling the writer"

    # waits on the tier's event loop do not block it: eight calls from four threads, and the writer writes until
    # four of them wait at the same time (the limit is far past any test's length: only that ends the waits)
    remote = object_tier(s3_bucket, s3_server.storage_options, prefix="yield")
    writer = _Overlap(needed=4)
    remote.yield_while(writer.busy, limit_s=600)
    with ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(remote.exists, f"missing-{index}") for index in range(8)]
        overlapped = writer.overlapped.wait(60)
        with writer.lock:
            writer.writing = False  # waits that ran one after another are let go
        assert overlapped, f"the waits blocked the event loop: they ran one after another ({len(writer.waiting)})"
        assert [call.result(timeout=60) for call in calls] == [False] * 8

    # an idle writer is not waited for: each S3 call asks it once and goes on
    s3_calls: list[str] = []
    remote.on_call(lambda operation, _: s3_calls.append(operation))
    del writer.polls[:]
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(remote.exists, "missing").result(timeout=60) is False, "an idle writer is not waited for"
    assert s3_calls and len(writer.polls) == len(s3_calls), (writer.polls, s3_calls)
    assert not any(answer for _, answer in writer.polls)


def test_the_uploader_yields_to_a_writer_that_never_stops_and_still_promotes(
        tmp_path: Path, s3_server, s3_bucket) -> None:
    from ckptd.promotion import uploader as uploading

    local = save_local(tmp_path / "node", {1: _state(1)})
    remote = object_tier(s3_bucket, s3_server.storage_options, prefix="yield")
    calls: list[str] = []
    remote.on_call(lambda operation, _: calls.append(operation))
    uploader = uploading.BackgroundUploader(local, remote, policy=Policy(), writer_busy=lambda: True)
    started = time.monotonic()
    uploader.on_commit(1)
    uploader.wait(timeout_s=60)
    assert [report.step for report in uploader.reports] == [1]
    assert calls and time.monotonic() - started >= uploading._YIELD_TO_WRITER_S, calls
    assert list(verify_step(remote, 1)) == []
    uploader.close(timeout_s=10)
