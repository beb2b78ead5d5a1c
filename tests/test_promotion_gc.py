"""Retention and garbage collection on both tiers: mark and sweep from retained manifests, in-flight
steps protected, the GC lease, abandoned steps, dry runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ckptd.config import override
from ckptd.errors import LockedError
from ckptd.format.layout import step_dir, step_file
from ckptd.stepio.step_reader import verify_step
from ckptd.policy import KeepLatest
from ckptd.promotion import GcReport, Promoter, collect_garbage, promote_step, stored_chunks
from ckptd.promotion.contents import read_step_contents
from ckptd.promotion.lease import LEASE_PATH, gc_lease, lease_is_fresh
from test_promotion_support import model_state, object_tier, save_local

pytestmark = pytest.mark.s3


def _states(count: int) -> dict[int, dict[str, torch.Tensor]]:
    return {step: model_state(step) for step in range(1, count + 1)}


def test_retention_sweeps_only_unreferenced_chunks_and_dry_run_deletes_nothing(tmp_path, s3_bucket, s3_options):
    local = save_local(tmp_path / "local", _states(4))
    remote = object_tier(s3_bucket, s3_options)
    for step in range(1, 5):
        promote_step(local, remote, step)
    before = stored_chunks(remote)
    rehearsal = collect_garbage(remote, retention=KeepLatest(2), dry_run=True)
    assert stored_chunks(remote) == before and remote.committed_steps() == [1, 2, 3, 4]
    report = collect_garbage(remote, retention=KeepLatest(2))
    assert rehearsal.deleted_steps == report.deleted_steps == (1, 2)
    assert rehearsal.deleted_chunks == report.deleted_chunks == 2, "the trained chunks of steps 1 and 2"
    assert remote.committed_steps() == [3, 4]
    kept = set(read_step_contents(remote, 3).unique_chunks()) | set(read_step_contents(remote, 4).unique_chunks())
    assert set(stored_chunks(remote)) == kept
    assert [list(verify_step(remote, step)) for step in (3, 4)] == [[], []]
    assert not remote.exists("gc.lease")


def test_chunks_of_an_in_flight_step_survive_a_concurrent_gc(tmp_path, s3_bucket, s3_options):
    frozen_a, frozen_b = model_state(0)["frozen"], model_state(0)["frozen"] + 1
    states = {1: {"frozen": frozen_a, "trained": torch.ones(8)}, 2: {"frozen": frozen_b, "trained": torch.ones(8)},
              3: {"frozen": frozen_a, "trained": torch.zeros(8)}}
    local = save_local(tmp_path / "local", states)
    remote = object_tier(s3_bucket, s3_options)
    promote_step(local, remote, 1)
    promote_step(local, remote, 2)
    reports = []

    def collect_while_in_flight(phase: str) -> None:
        if phase == "marked":  # step 3's indexes are up, its chunks not yet checked
            reports.append(collect_garbage(remote, retention=KeepLatest(1)))

    report = Promoter(local, remote, on_phase=collect_while_in_flight).promote(3)
    assert reports[0].deleted_steps == (1,) and reports[0].in_flight_steps == (3,)
    assert report.chunks_uploaded == 1, "frozen_a was kept for the in-flight step, not uploaded again"
    assert remote.committed_steps() == [2, 3]
    assert list(verify_step(remote, 3)) == []


def test_the_gc_lease_excludes_a_second_collector_and_holds_promoters_back(tmp_path, s3_bucket, s3_options):
    local = save_local(tmp_path / "local", _states(1))
    remote = object_tier(s3_bucket, s3_options)
    done = []
    with gc_lease(remote):
        with pytest.raises(LockedError, match="another garbage collection"):
            collect_garbage(remote)
        worker = threading.Thread(target=lambda: done.append(promote_step(local, remote, 1)))
        worker.start()
        time.sleep(0.6)
        assert not done and remote.committed_steps() == [], "the promoter waits while the lease is held"
    worker.join(30)
    assert done and remote.committed_steps() == [1]
    with override(gc_lease_s=0.0), gc_lease(remote):
        collect_garbage(remote)  # an expired lease (crashed collector) does not block


def test_abandoned_uncommitted_steps_are_removed_after_their_age(tmp_path, s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    remote.write_bytes(step_file(8, "rank-00000.index.json"), b"{}")
    assert collect_garbage(remote).in_flight_steps == (8,)
    report = collect_garbage(remote, abandoned_after_s=0)
    assert report.abandoned_steps == (8,) and remote.list_step_numbers() == []


def test_local_gc_keeps_the_save_in_progress(tmp_path):
    local = save_local(tmp_path / "local", {1: model_state(1), 3: model_state(3)})
    for step in (2, 5):  # 2: abandoned (older than the newest commit), 5: a save in progress
        local.write_bytes(f"{step_dir(step)}/rank-00000.data", b"partial")
    old = time.time() - 7200
    for path in (local.root / step_dir(2) / "rank-00000.data", local.root / step_dir(2)):
        os.utime(path, (old, old))
    rehearsal = collect_garbage(local, retention=KeepLatest(1), abandoned_after_s=3600, dry_run=True)
    assert local.list_step_numbers() == [1, 2, 3, 5]
    report = collect_garbage(local, retention=KeepLatest(1), abandoned_after_s=3600)
    assert rehearsal == GcReport(**{**report.to_json(), "dry_run": True})
    assert report.deleted_steps == (1,) and report.abandoned_steps == (2,) and report.in_flight_steps == (5,)
    assert local.list_step_numbers() == [3, 5] and local.committed_steps() == [3]


_HOLD_LEASE = """
import json, sys, time
from ckptd.promotion.lease import LEASE_PATH, gc_lease, lease_is_fresh
from ckptd.tiers.object import ObjectTier
remote = ObjectTier(sys.argv[1], storage_options=json.loads(sys.argv[2]))
with gc_lease(remote):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_lease_left_by_a_killed_collector_on_this_host_does_not_block(s3_bucket, s3_options):
    """A collector SIGKILLed while holding the lease leaves it behind; its own host sees the owner is
    gone and promotes without waiting for the lease to expire."""
    url = f"s3://{s3_bucket}/lease"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LEASE, url, json.dumps(s3_options)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        remote = object_tier(s3_bucket, s3_options, "lease")
        assert lease_is_fresh(remote), "a live collector's lease holds promoters back"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert remote.exists(LEASE_PATH), "the killed collector left its lease behind"
        assert not lease_is_fresh(remote)
    finally:
        holder.kill()
