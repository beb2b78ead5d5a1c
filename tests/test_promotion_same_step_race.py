"""Two promoters of one step number on one prefix (fault matrix row 14): a step directory's rank index and
pack are written once (``If-None-Match``), so the promoter that loses never replaces what the winner's
manifest names. Before, both wrote them unconditionally: the loser's index and pack landed under the
winner's manifest and the committed step no longer verified."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.errors import CommitError
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.promotion import Promoter
from ckptd.stepio.step_reader import verify_step
from ckptd.testing.fault_proxy import FaultProxy
from harness.invariants import SyntheticWorkload, check_newest_restores
from harness.s3_scenarios import look_behind, save_steps_locally
from ckptd.tiers.local import LocalTier
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3

JOB_A = SyntheticWorkload(256 * 1024)
JOB_B = SyntheticWorkload(256 * 1024, rank_stride=1000)  # other bytes at the same step number


def _local(directory: Path, workload: SyntheticWorkload) -> LocalTier:
    save_steps_locally(directory, workload, [1])
    return LocalTier(directory)


def test_a_second_job_promoting_the_same_step_number_midway_is_refused_and_the_first_commits(
        tmp_path: Path, s3_server, s3_bucket) -> None:
    first, second = _local(tmp_path / "a", JOB_A), _local(tmp_path / "b", JOB_B)
    remote = object_tier(s3_bucket, s3_server.storage_options)
    refused: list[BaseException] = []

    def second_job_runs(phase: str) -> None:
        if phase == "marked":  # the first job's index is up, its pack not yet
            with pytest.raises(CommitError) as caught:
                Promoter(second, remote).promote(1)
            refused.append(caught.value)

    report = Promoter(first, remote, on_phase=second_job_runs).promote(1)
    assert not report.already_committed and len(refused) == 1
    message = str(refused[0])
    assert "another promotion of step 1" in message and "rank-00000.index.json" in message
    assert remote.read_bytes(step_file(1, MANIFEST_NAME)) == first.read_bytes(step_file(1, MANIFEST_NAME))
    assert list(verify_step(remote, 1)) == [], "the committed step verifies: nothing of the second job in it"
    found = look_behind(s3_server.endpoint_url, remote.url, remote)
    assert found.clean, found.describe()
    restored = check_newest_restores(JOB_A, remote=remote.url, storage_options=s3_server.storage_options,
                                     expected_step=1, scratch=tmp_path)
    assert restored.ok, restored.detail
    assert list(verify_step(second, 1)) == [], "the second job's local step is untouched"


def test_the_same_step_promoted_twice_at_once_commits_once(tmp_path: Path, s3_server, s3_bucket) -> None:
    local = _local(tmp_path / "a", JOB_A)
    remote = object_tier(s3_bucket, s3_server.storage_options)
    reports = []

    def again(phase: str) -> None:
        if phase == "marked":
            reports.append(Promoter(local, remote).promote(1))

    reports.append(Promoter(local, remote, on_phase=again).promote(1))
    assert [report.step for report in reports] == [1, 1]
    assert remote.committed_steps() == [1] and list(verify_step(remote, 1)) == []


def test_written_once_objects_survive_answers_lost_after_the_write(tmp_path: Path, s3_server, s3_bucket) -> None:
    """A reset after the request was forwarded: the retried conditional PUT finds its own bytes (412 on
    identical content counts as written)."""
    local = _local(tmp_path / "a", JOB_A)
    with override(s3_retries=10, s3_metadata_retries=11, s3_backoff_base_s=0.01, s3_backoff_max_s=0.1), \
            FaultProxy(s3_server.endpoint_url, fraction=0.3, kinds=("reset",), seed=7) as proxy:
        remote = object_tier(s3_bucket, proxy.storage_options(s3_server.storage_options))
        Promoter(local, remote).promote(1)
        assert proxy.counts["reset"] > 0
    direct = object_tier(s3_bucket, s3_server.storage_options)
    assert direct.committed_steps() == [1] and list(verify_step(direct, 1)) == []
