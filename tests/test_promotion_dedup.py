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
