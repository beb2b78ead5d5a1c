"""A rank that drops its share of a step unpromoted says so, and the committing rank stops waiting for it.

Soak findings F1 and F3: the committing rank of a multi-node step waited ``CKPTD_COMMIT_TIMEOUT_S`` (300 s) for
a share another rank had already dropped, so that a job hung in ``close()`` after a daemon loss (F1), and
lagging daemons, each capping its pins alone, committed almost nothing (F3). A rank (an in-process uploader or
a daemon) that drops a pin unpromoted now writes ``rank-NNNNN.released`` holding the digest of the step's
manifest, and the committing rank gives that step up at once.

- F1, two real gloo ranks with a node each and a daemon stand-in serving the real control socket: rank 0's
  daemon refuses step 2 (rank 0 turns to in-process promotion there), rank 1 hears of it only at step 3, which
  is then a leftover of an earlier hand-off for rank 1 and a live step for rank 0. Rank 1 settles it as lost
  and releases it; rank 0 announces it and (before the fix) waited for rank 1's share until its commit
  timeout, so that ``wait_uploads`` raised. Now step 3 is given up at once and the later steps reach S3 with
  both shares, byte-checked.
- F3, the promoter alone on one step of a two-rank job: the committing share stops with ShareReleasedError as
  soon as the other rank's marker appears, a rank that has not begun skips a step the other dropped, and a
  marker left for another step with the same number (other manifest bytes) stops nothing.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.config import override
from ckptd.errors import StorageError
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.promotion.promoter import Promoter, ShareReleasedError, announce_release, released_marker_name
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.testing import run_multirank
from ckptd.tiers import open_tier
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.local import LocalTier
from test_daemon_handoff_loss import _TwoNodes, nodes  # noqa: F401 - the fixture
from test_promotion_leftover_pins import earlier_run  # noqa: F401 - the fixture
from test_promotion_support import object_tier

pytestmark = [pytest.mark.s3, pytest.mark.multirank]


def _rank_zero_loses_first(daemon: _TwoNodes) -> None:
    """Make the stand-in answer every commit, except rank 0's step 2: refused (as a stopping daemon does) once
    rank 1 has sent its own step 2, so that rank 1 hands step 2 to its daemon and hears of the loss only at
    step 3."""

    def notice_commit(root_name: str, step: int) -> bool:
        if root_name == "a" and step == 2:
            deadline = time.monotonic() + 20
            while ("b", 2) not in daemon.commits and time.monotonic() < deadline:
                time.sleep(0.01)
            daemon.commits.append((root_name, step))
            raise StorageError("the daemon is stopping: the step is not journaled", step=step, tier="local")
        daemon.commits.append((root_name, step))
        return True

    daemon.notice_commit = notice_commit  # type: ignore[method-assign]


def _train(rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any],
           env: dict[str, str]) -> dict[str, Any]:
    import os

    import ckptd

    os.environ.update(env)
    with ckptd.CheckpointManager(roots[rank], remote=remote, storage_options=options, capture_rng=False,
                                 policy=ckptd.Policy(keep_local=None)) as manager:
        for step in range(1, 6):
            manager.save(step, {f"rank{rank}": torch.full((16 * 1024,), float(rank * 100 + step))})
            manager.wait()
        manager.wait_uploads()
        uploader = manager.uploader
        return {"uploaded": [report.step for report in manager.upload_reports],
                "released": sorted(uploader.released) if uploader is not None else None}


def test_a_share_dropped_as_a_leftover_is_given_up_at_once_by_the_committing_rank(nodes):  # noqa: F811
    _rank_zero_loses_first(nodes["daemon"])
    env = {"CKPTD_DAEMON_SOCKET": str(nodes["socket"]), "CKPTD_DAEMON_REQUEST_TIMEOUT_S": "30",
           "CKPTD_COMMIT_TIMEOUT_S": "25", "CKPTD_PIN_MAX_STEPS": "16"}
    roots = [str(nodes["roots"]["a"]), str(nodes["roots"]["b"])]
    results = run_multirank(_train, 2, roots, nodes["remote"], nodes["options"], env, timeout_s=150)
    remote = open_tier(nodes["remote"], storage_options=nodes["options"])
    if 3 in results[1]["released"]:  # the usual course: rank 1 settled its leftover step 3 as lost
        assert remote.exists(step_file(3, released_marker_name(1))), "rank 1 announced it"
        assert 3 not in remote.committed_steps() and 3 not in results[0]["uploaded"], results
    else:  # under load rank 1's uploader may find rank 0 holding step 3 too: then both shares reach S3
        assert 3 in results[1]["uploaded"] and 3 in results[0]["uploaded"], results
        assert 3 in remote.committed_steps(), results
    assert 5 in results[0]["uploaded"] and 5 in remote.committed_steps(), results
    assert ("b", 2) in nodes["daemon"].commits and ("b", 3) not in nodes["daemon"].commits, "the ranks' switch"
    for step in results[0]["uploaded"]:
        manifest = load_step_manifest(remote, step)
        assert set(ranks_held(remote, step, manifest)) == {0, 1}
        assert list(verify_step(remote, step)) == []


def _announce_later(bucket: str, options: dict[str, Any], prefix: str, step: int, manifest: bytes) -> None:
    remote = object_tier(bucket, options, prefix=prefix)
    deadline = time.monotonic() + 30
    while not remote.exists(step_file(step, "rank-00000.promoted")) and time.monotonic() < deadline:
        time.sleep(0.05)
    announce_release(remote, step, [1], manifest)


def test_the_committing_share_stops_once_the_other_rank_announces_it_dropped_its_share(
        earlier_run, s3_bucket: str, s3_options: dict[str, Any]) -> None:  # noqa: F811
    local = LocalTier(earlier_run[0] / "node0")
    manifest = local.read_bytes(step_file(3, MANIFEST_NAME))
    remote = object_tier(s3_bucket, s3_options, prefix="dropped")
    other = multiprocessing.get_context("spawn").Process(
        target=_announce_later, args=(s3_bucket, s3_options, "dropped", 3, manifest))
    other.start()
    try:
        with override(commit_timeout_s=120.0), pytest.raises(ShareReleasedError, match="rank 1 dropped its pin"):
            Promoter(local, remote).promote(3, ranks=[0])
    finally:
        other.join(30)
    assert remote.committed_steps() == [], "nothing is committed without rank 1's share"


def test_a_rank_skips_a_step_the_committing_rank_dropped_and_a_marker_of_another_step_stops_nothing(
        earlier_run, s3_bucket: str, s3_options: dict[str, Any]) -> None:  # noqa: F811
    base: Path = earlier_run[0]
    remote = object_tier(s3_bucket, s3_options, prefix="skipped")
    manifest = LocalTier(base / "node0").read_bytes(step_file(2, MANIFEST_NAME))
    announce_release(remote, 2, [0], manifest)
    with pytest.raises(ShareReleasedError, match="rank 0 dropped its pin"):
        Promoter(LocalTier(base / "node1"), remote).promote(2, ranks=[1])
    assert not remote.exists(step_file(2, "rank-00001.promoted")), "rank 1 uploaded nothing of it"
    announce_release(remote, 2, [1], b"another step 2's manifest")  # e.g. an earlier incarnation of step 2
    other = object_tier(s3_bucket, s3_options, prefix="skipped")
    other.delete_files([step_file(2, released_marker_name(0))])
    Promoter(LocalTier(base / "node1"), remote).promote(2, ranks=[1])
    with override(commit_timeout_s=60.0):
        Promoter(LocalTier(base / "node0"), remote).promote(2, ranks=[0])
    assert 2 in remote.committed_steps() and list(verify_step(remote, 2)) == []


def test_a_close_waiting_for_its_uploads_runs_while_closing_on_its_own_thread(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    """F1's second half: a close that waits for the object tier (here: a collector's GC lease holds the
    promotion) runs ``while_closing`` (a launched rank's heartbeat) on the closing thread until it ends."""
    import threading

    import ckptd
    from ckptd.promotion.lease import gc_lease

    collector = object_tier(s3_bucket, s3_options, prefix="closing")
    holding, done = threading.Event(), threading.Event()

    def collect() -> None:
        with gc_lease(collector):
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=collect)
    thread.start()
    assert holding.wait(30)
    beats: list[int] = []

    def beat() -> None:
        beats.append(threading.get_ident())
        if len(beats) >= 3:
            done.set()  # the collection ends: the promotion goes on

    weights = torch.arange(64 * 1024, dtype=torch.float32)
    try:
        with override(gc_lease_s=120.0):
            manager = ckptd.CheckpointManager(tmp_path / "root", remote=f"s3://{s3_bucket}/closing",
                                              storage_options=s3_options, capture_rng=False, daemon="off")
            manager.while_closing = beat
            assert manager.save(1, {"weights": weights})
            manager.close(timeout_s=60)
    finally:
        done.set()
        thread.join(30)
    assert len(beats) >= 3 and set(beats) == {threading.get_ident()}, beats
    assert collector.committed_steps() == [1] and list(verify_step(collector, 1)) == []
    restored = {"weights": torch.zeros_like(weights)}
    with ckptd.CheckpointManager(tmp_path / "empty", remote=f"s3://{s3_bucket}/closing", storage_options=s3_options,
                                 capture_rng=False, daemon="off") as reader:
        assert reader.restore(restored) == 1
    assert torch.equal(restored["weights"], weights), "S3's step 1 is the bytes saved"


def test_a_daemon_skips_at_once_the_steps_another_node_dropped_and_commits_the_one_both_hold(
        earlier_run, tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:  # noqa: F811
    """F3 on a real daemon process: node 0's daemon (rank 0's root of a two-node job, steps 1..6) promotes every
    step and commits each once rank 1's share is there. Node 1 dropped steps 1..5 under its pin cap (their
    markers) and promoted step 6: the daemon skips steps 1..5 at once, for good, and commits step 6 (before the
    fix it waited CKPTD_COMMIT_TIMEOUT_S for each dropped share, and S3 stayed behind)."""
    import shutil

    from harness.daemon_process import DaemonProcess, write_config

    base: Path = earlier_run[0]
    root, state = tmp_path / "node0", tmp_path / "state"
    shutil.copytree(base / "node0", root)
    remote = object_tier(s3_bucket, s3_options, prefix="run1")
    node1 = LocalTier(base / "node1")
    for step in range(1, 6):
        announce_release(remote, step, [1], node1.read_bytes(step_file(step, MANIFEST_NAME)))
    Promoter(node1, remote).promote(6, ranks=[1])
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1",
                                                      "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=0)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "CKPTD_COMMIT_TIMEOUT_S": "300"}
    with DaemonProcess(config, state, env=env) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: 6 in remote.committed_steps(), 60, f"step 6 committed; log:\n{daemon.log()}")
        promotes = {task["step"]: task for task in daemon.tasks() if task["kind"] == "promote"}
        assert all(promotes[step]["state"] == "skipped" and "dropped its pin" in promotes[step]["error"]
                   for step in range(1, 6)), promotes
        assert daemon.terminate() == 0
    assert remote.committed_steps() == [6]
    manifest = load_step_manifest(remote, 6)
    assert set(ranks_held(remote, 6, manifest)) == {0, 1} and list(verify_step(remote, 6)) == []
