"""Self-healing dedup: objects found bad on the object tier are recorded, never reused, uploaded again
by the next promotion and mended in older steps by ``ckptd verify --repair``."""

from __future__ import annotations

import pytest

from ckptd.errors import UnsafePathError
from ckptd.tiers.chunk_health import bad_chunk_paths, clear_bad_chunk, report_bad_chunk
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3


def test_bad_records_are_kept_outside_steps_and_chunks(s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    remote.write_bytes("chunks/ab/abcd.raw", b"x" * 10)
    report_bad_chunk(remote, "chunks/ab/abcd.raw", step=3, reason="digest mismatch")
    report_bad_chunk(remote, "step-000000000003/rank-00000.pack", step=3, reason="digest mismatch")
    assert bad_chunk_paths(remote) == {"chunks/ab/abcd.raw", "step-000000000003/rank-00000.pack"}
    assert remote.list_step_numbers() == [], "a record is not a step directory"
    assert [obj.path for obj in remote.list_objects("chunks")] == ["chunks/ab/abcd.raw"]
    clear_bad_chunk(remote, "chunks/ab/abcd.raw")
    clear_bad_chunk(remote, "chunks/ab/never-recorded.raw")
    assert bad_chunk_paths(remote) == {"step-000000000003/rank-00000.pack"}
    with pytest.raises(UnsafePathError, match="not a file under the tier root"):
        report_bad_chunk(remote, "../elsewhere/x", step=None, reason="scrub")
