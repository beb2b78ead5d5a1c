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


def _chunk_listings(remote) -> list[str]:
    """Record the prefixes of the chunk store's listings (every LIST of ``chunks/``) from now on."""
    listed: list[str] = []
    chunks = remote.key(remote.chunk_path(""))
    remote.on_call(lambda method, params: listed.append(str(params.get("Prefix", "")))
                   if method == "list_objects_v2" and str(params.get("Prefix", "")).startswith(chunks) else None)
    return listed


def test_a_step_of_new_chunks_lists_the_chunk_store_once_and_commits_what_it_uploaded(tmp_path, s3_server, s3_bucket,
                                                                                      s3_options):
    import torch

    from ckptd.promotion import promote_step
    from ckptd.promotion.contents import read_step_contents, read_stored_chunk
    from ckptd.tiers.local import LocalTier
    from test_promotion_support import s3_client

    with override(chunk_bytes=1024 * 1024), ckptd.CheckpointManager(tmp_path / "local", capture_rng=False) as m:
        for step in (1, 2):  # every chunk of step 2 differs from step 1's
            m.save(step, {"weights": torch.randn(1024 * 1024, generator=torch.Generator().manual_seed(step))})
    remote = object_tier(s3_bucket, s3_options, "new-chunks")
    local = LocalTier(tmp_path / "local")
    promote_step(local, remote, 1)
    listed = _chunk_listings(remote)
    report = promote_step(local, remote, 2)
    contents = read_step_contents(local, 2)
    assert report.chunks_uploaded == len(contents.unique_chunks()) == 4
    assert len(listed) == 1, f"one listing to decide, none to check what this promotion's PUTs stored: {listed}"
    client = s3_client(s3_server)
    for key, (share, chunk) in contents.unique_chunks().items():  # what was committed is what was saved
        body = client.get_object(Bucket=s3_bucket, Key=remote.key(remote.chunk_path(key)))["Body"].read()
        assert body == read_stored_chunk(local, share, chunk)
    assert remote.committed_steps() == [1, 2]


def test_a_kept_chunk_that_vanishes_before_the_commit_stops_the_commit(tmp_path, s3_server, s3_bucket, s3_options):
    # the chunks a step keeps from earlier uploads are listed again before its manifest is written: one
    # deleted behind ckptd's back meanwhile (a lifecycle rule, a stray collector) fails the promotion
    import torch

    from ckptd.errors import CommitError
    from ckptd.promotion import Promoter
    from ckptd.promotion.contents import read_step_contents
    from ckptd.tiers.local import LocalTier
    from test_promotion_support import s3_client

    frozen = torch.randn(1024 * 1024)
    with override(chunk_bytes=1024 * 1024), ckptd.CheckpointManager(tmp_path / "local", capture_rng=False) as m:
        for step in (1, 2):
            m.save(step, {"frozen": frozen, "trained": torch.full((1024 * 1024,), float(step))})
    remote = object_tier(s3_bucket, s3_options, "kept-vanishes")
    local = LocalTier(tmp_path / "local")
    Promoter(local, remote).promote(1)
    contents = read_step_contents(local, 2)
    kept = sorted(set(contents.unique_chunks()) & set(read_step_contents(local, 1).unique_chunks()))
    assert kept, "step 2 keeps the frozen chunks of step 1"
    client = s3_client(s3_server)

    def delete_a_kept_chunk(phase: str) -> None:
        if phase == "chunks":  # dedup has decided; the uploads have not started
            client.delete_object(Bucket=s3_bucket, Key=remote.key(remote.chunk_path(kept[0])))

    listed = _chunk_listings(remote)
    with pytest.raises(CommitError, match="missing on the object tier after upload") as caught:
        Promoter(local, remote, on_phase=delete_a_kept_chunk).promote(2)
    assert caught.value.step == 2 and kept[0] in str(caught.value)
    assert len(listed) == 2, "listed to decide and again to check the kept chunks"
    assert remote.committed_steps() == [1], "step 2 was not committed"
    report = Promoter(local, remote).promote(2)  # promoted again: the missing chunk is uploaded
    assert report.chunks_uploaded >= 1 and remote.committed_steps() == [1, 2]
