"""Object-tier GC with packs (format 3): a packed chunk is no object of its own, so the indexes that
pack it mark nothing under ``chunks/``; only content-addressed chunks are marked live."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd.policy import KeepLatest
from ckptd.promotion import Promoter, collect_garbage, promote_step, stored_chunks
from ckptd.promotion.contents import read_step_contents
from ckptd.stepio.step_reader import verify_step
from test_promotion_support import SMALL_CHUNK, object_tier, same_bytes, save_local, zero_like

pytestmark = pytest.mark.s3


class _Stop(Exception):
    """Ends a promotion once its indexes are up (an in-flight step)."""


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {"frozen": torch.randn(256 * 1024, generator=generator),  # 1 MiB: by digest in both layouts
            "bias": torch.randn(256, generator=generator)}  # 1 KiB: by digest unpacked, in the pack packed


def test_chunks_only_a_pack_references_are_swept_and_the_packed_steps_stay_whole(tmp_path, s3_bucket, s3_options):
    state = _state()
    unpacked = save_local(tmp_path / "unpacked", {1: state})
    packed = save_local(tmp_path / "packed", {2: state, 3: state}, pack_below_bytes=SMALL_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    promote_step(unpacked, remote, 1)
    promote_step(packed, remote, 2)

    def stop(phase: str) -> None:
        if phase == "marked":
            raise _Stop

    with pytest.raises(_Stop):
        Promoter(packed, remote, on_phase=stop).promote(3)  # step 3 in flight: its packed index is up
    step_1 = set(read_step_contents(remote, 1).unique_chunks())
    frozen = set(read_step_contents(remote, 2).unique_chunks())
    bias = step_1 - frozen
    assert len(bias) == 1 and set(stored_chunks(remote)) == step_1, "step 1 stored the small chunk by digest"

    rehearsal = collect_garbage(remote, retention=KeepLatest(1), dry_run=True)
    report = collect_garbage(remote, retention=KeepLatest(1))
    assert rehearsal.deleted_chunks == report.deleted_chunks == 1, "the packs of steps 2 and 3 keep no chunk alive"
    assert report.deleted_steps == (1,) and report.in_flight_steps == (3,)
    assert set(stored_chunks(remote)) == frozen
    assert list(verify_step(remote, 2)) == []
    target = zero_like(state)
    with ckptd.CheckpointManager(tmp_path / "reader", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        assert manager.restore(target) == 2
    assert same_bytes(target, state)
