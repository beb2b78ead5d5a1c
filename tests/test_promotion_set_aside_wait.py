"""A committing share whose local step is set aside while it waits for the other ranks is never committed.

The cluster scenarios found it: node 0's daemon promoted rank 0's share of step N and waited for rank 2's; node 2
was lost; training went back to an older step (node 0's step N set aside) and replayed N; the replacement's
share of the replayed N then completed the older promotion, so the object tier held a step N made of shares of
two generations, and rank 0's own promotion of the replayed N was refused. The promoter now checks, while it
waits and just before it commits, that the local tier still holds the step it promotes (the daemon's promoter
has no other way to learn of the set-aside)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import override
from ckptd.errors import StepSetAsideError
from ckptd.format.layout import step_file
from ckptd.manager.set_aside import set_aside_step
from ckptd.promotion.promoter import Promoter, promoted_marker_name
from ckptd.stepio.step_reader import verify_step
from ckptd.tiers.local import LocalTier
from test_promotion_leftover_pins import earlier_run  # noqa: F401 - the fixture
from test_promotion_support import object_tier

pytestmark = pytest.mark.multirank
STEP = 3


def test_a_share_set_aside_while_waiting_for_the_other_rank_is_not_committed(
        earlier_run, tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:  # noqa: F811
    for node in ("node0", "node1"):
        shutil.copytree(earlier_run[0] / node, tmp_path / node)
    remote = object_tier(s3_bucket, s3_options, prefix="set-aside")
    outcome: list[BaseException | None] = []

    def promote_rank_0() -> None:
        try:
            with override(commit_timeout_s=600.0):  # a deadline only a hang trips
                Promoter(LocalTier(tmp_path / "node0"), remote).promote(STEP, ranks=[0])
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome.append(error)

    committing = threading.Thread(target=promote_rank_0)
    committing.start()
    try:
        deadline = time.monotonic() + 300
        while not remote.exists(step_file(STEP, promoted_marker_name(0))):
            assert time.monotonic() < deadline and committing.is_alive(), "rank 0 never waited for rank 1"
            time.sleep(0.05)
        set_aside_step(tmp_path / "node0", STEP, restored_step=STEP - 1)  # training went back to an older step
        Promoter(LocalTier(tmp_path / "node1"), remote).promote(STEP, ranks=[1])  # rank 1's share arrives
    finally:
        committing.join(660)
    assert not committing.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], StepSetAsideError), outcome
    assert outcome[0].step == STEP
    assert STEP not in remote.committed_steps(), "a share set aside was committed with the other rank's"

    # rank 0's step saved again (here: the same bytes, put back) is promoted and committed whole
    (tmp_path / "node0" / f"step-{STEP:012d}").mkdir()
    [moved] = [path for path in (tmp_path / "node0" / ".set-aside").glob(f"step-{STEP:012d}-*") if path.is_dir()]
    for file in moved.iterdir():
        shutil.copy2(file, tmp_path / "node0" / f"step-{STEP:012d}" / file.name)
    with override(commit_timeout_s=300.0):
        Promoter(LocalTier(tmp_path / "node0"), remote).promote(STEP, ranks=[0])
    assert STEP in remote.committed_steps() and list(verify_step(remote, STEP)) == []
