"""The committing rank never commits a step over another rank's share left by another incarnation of the step.

Since the step directory's rank indexes and packs are written once (``If-None-Match``), what an interrupted
promotion of *other content* with the same step number left (a node lost mid-promotion, the step saved again
from an older one with other bytes) stays in place until GC removes it as abandoned. Rank 1's leftover index
and its ``rank-00001.promoted`` marker are such a leftover here. Before, the committing rank 0 took that marker
for rank 1's share of its own step and wrote the manifest: the object tier then held a committed step whose
rank 1 index was not the one the manifest names (it did not verify, and rank 1's new share could never be
written). Now rank 0 checks every other rank's stored index against its manifest before it commits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.errors import CommitError
from ckptd.format.layout import step_dir, step_file
from ckptd.promotion.promoter import Promoter, promoted_marker_name
from ckptd.stepio.step_reader import verify_step
from ckptd.tiers.local import LocalTier
from test_promotion_leftover_pins import earlier_run  # noqa: F401 - the fixture
from test_promotion_support import object_tier

pytestmark = [pytest.mark.s3, pytest.mark.multirank]

STEP = 3


def test_a_leftover_share_of_another_incarnation_of_the_step_is_not_committed_over(
        earlier_run, s3_bucket: str, s3_options: dict[str, Any]) -> None:  # noqa: F811
    base: Path = earlier_run[0]
    rank0, rank1 = LocalTier(base / "node0"), LocalTier(base / "node1")
    remote = object_tier(s3_bucket, s3_options, prefix="stale")
    index = step_file(STEP, "rank-00001.index.json")
    own = rank1.read_bytes(index)
    other = own.replace(b'"rank":1', b'"rank":1 ', 1)  # another incarnation's index: other bytes
    assert other != own
    remote.write_bytes(index, other)
    remote.write_bytes(step_file(STEP, promoted_marker_name(1)), b"")

    with pytest.raises(CommitError) as caught:
        Promoter(rank0, remote).promote(STEP, ranks=[0])
    message = str(caught.value)
    assert "rank 1" in message and "rank-00001.index.json" in message and f"step {STEP}" in message, message
    assert STEP not in remote.committed_steps(), "a step whose rank 1 index is another one's was committed"
    assert remote.read_bytes(index) == other, "the leftover is left to GC"
    # GC takes it once nothing in the step directory changed for gc_abandoned_s: a retry (a daemon retries
    # every few minutes) must not refresh the directory, else the leftover is never abandoned
    before = {obj.path: obj.modified for obj in remote.list_objects(step_dir(STEP))}
    time.sleep(1.1)  # the store stamps times to the second
    with pytest.raises(CommitError):
        Promoter(rank0, remote).promote(STEP, ranks=[0])
    after = {obj.path: obj.modified for obj in remote.list_objects(step_dir(STEP))}
    assert after == before, "a failing retry rewrote files of the step directory"
    # once GC removed the leftover, both shares go up and the step commits, bit-exact
    remote.delete_files([path for path in (step_file(STEP, name) for name in remote.list_files(STEP))
                         if "rank-00001" in path])
    Promoter(rank1, remote).promote(STEP, ranks=[1])
    Promoter(rank0, remote).promote(STEP, ranks=[0])
    assert STEP in remote.committed_steps() and list(verify_step(remote, STEP)) == []
