"""Content-addressed dedup: a fine-tuning-like state (large frozen part, small trained part) uploads the
frozen bytes once across 5 steps; bytes uploaded per step are reported."""

from __future__ import annotations

import pytest

import ckptd
from ckptd.config import override
from test_promotion_support import model_state, object_tier

pytestmark = pytest.mark.s3


def test_frozen_bytes_are_uploaded_once_across_five_steps(tmp_path, s3_bucket, s3_options, record_property):
    url = f"s3://{s3_bucket}/finetune"
    frozen_elements, trained_elements = 2 * 1024 * 1024, 16 * 1024  # 8 MiB frozen, 64 KiB trained
    with override(chunk_bytes=1024 * 1024):
        with ckptd.CheckpointManager(tmp_path / "local", remote=url, storage_options=s3_options, capture_rng=False,
                                     policy=ckptd.Policy(keep_local=1)) as manager:
            for step in range(1, 6):
                manager.save(step, model_state(step, frozen_elements=frozen_elements,
                                               trained_elements=trained_elements))
                manager.wait_uploads()  # each step uploaded before the next is saved: none is superseded
            reports = manager.upload_reports
    uploaded = {report.step: report.bytes_uploaded for report in reports}
    record_property("bytes_uploaded_per_step", uploaded)
    print(f"bytes uploaded per step: {uploaded}")
    assert sorted(uploaded) == [1, 2, 3, 4, 5]
    frozen_bytes = frozen_elements * 4
    assert uploaded[1] >= frozen_bytes + trained_elements * 4
    for step in range(2, 6):
        assert uploaded[step] <= 0.05 * uploaded[1], f"step {step} re-uploaded frozen bytes: {uploaded}"
        assert uploaded[step] >= trained_elements * 4, "the trained part changes every step"
    assert object_tier(s3_bucket, s3_options, "finetune").committed_steps() == [1, 2, 3, 4, 5]


def test_a_step_whose_chunks_are_all_stored_lists_the_bad_chunk_records_once(tmp_path, s3_bucket, s3_options):
    # the usual step at training cadence: the frozen chunks are deduplicated and only the pack changes, so
    # there is no re-uploaded chunk whose bad record could need clearing, and no second listing of them
    import torch

    from ckptd.promotion import promote_step
    from ckptd.tiers.chunk_health import BAD_PREFIX
    from ckptd.tiers.local import LocalTier

    frozen = torch.randn(2 * 1024 * 1024)
    with override(chunk_bytes=1024 * 1024), ckptd.CheckpointManager(tmp_path / "local", capture_rng=False) as m:
        for step in (1, 2):
            m.save(step, {"frozen": frozen, "trained": torch.full((100,), float(step))})
    remote = object_tier(s3_bucket, s3_options, "cadence-dedup")
    local = LocalTier(tmp_path / "local")
    promote_step(local, remote, 1)
    listed: list[str] = []
    remote.on_call(lambda method, params: listed.append(str(params.get("Prefix", "")))
                   if method == "list_objects_v2" else None)
    report = promote_step(local, remote, 2)
    assert report.chunks_uploaded == 0, "the frozen chunks were deduplicated"
    assert sum(prefix.rstrip("/").endswith(BAD_PREFIX.rstrip("/")) for prefix in listed) == 1, listed
    assert remote.committed_steps() == [1, 2]
