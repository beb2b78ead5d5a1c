"""Content-addressed dedup: a fine-tuning-like state (large frozen part, small trained part) uploads the
frozen bytes once across 5 steps; bytes uploaded per step are reported."""

from __future__ import annotations

import pytest

import ckptd
from ckptd.config import override
from ckptd.promotion import dedup
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
    try:
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
    finally:
        remote.close()


@pytest.mark.parametrize("mode", ["listing", "lookups"])
def test_a_kept_chunk_that_vanishes_before_the_commit_stops_the_commit(tmp_path, s3_server, s3_bucket, s3_options,
                                                                      mode, monkeypatch):
    # the chunks a step keeps from earlier uploads are looked for again before its manifest is written: one
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
    try:
        local = LocalTier(tmp_path / "local")
        Promoter(local, remote).promote(1)
        contents = read_step_contents(local, 2)
        kept = sorted(set(contents.unique_chunks()) & set(read_step_contents(local, 1).unique_chunks()))
        assert kept, "step 2 keeps the frozen chunks of step 1"
        client = s3_client(s3_server)

        def delete_a_kept_chunk(phase: str) -> None:
            if phase == "chunks":  # dedup has decided; the uploads have not started
                client.delete_object(Bucket=s3_bucket, Key=remote.key(remote.chunk_path(kept[0])))

        if mode == "lookups":
            monkeypatch.setattr(dedup, "LOOKUPS_ABOVE", 0)  # step 1's listing showed a store "large enough"
        listed = _chunk_listings(remote)
        with pytest.raises(CommitError, match="missing on the object tier after upload") as caught:
            Promoter(local, remote, on_phase=delete_a_kept_chunk).promote(2)
        assert caught.value.step == 2 and kept[0] in str(caught.value)
        assert len(listed) == (2 if mode == "listing" else 0), "looked for to decide and again to check the kept chunks"
        assert remote.committed_steps() == [1], "step 2 was not committed"
        report = Promoter(local, remote).promote(2)  # promoted again: the missing chunk is uploaded
        assert report.chunks_uploaded >= 1 and remote.committed_steps() == [1, 2]
        _assert_stored_as_saved(s3_server, s3_bucket, remote, local, 2)
    finally:
        remote.close()


def _assert_stored_as_saved(server, bucket: str, remote, local, step: int) -> None:
    """Every chunk and rank index of ``step`` on the object tier holds the bytes of the local copy."""
    from ckptd.format.layout import step_file
    from ckptd.promotion.contents import read_step_contents, read_stored_chunk
    from test_promotion_support import s3_client

    client = s3_client(server)
    contents = read_step_contents(local, step)
    for digest, (share, chunk) in contents.unique_chunks().items():
        stored = client.get_object(Bucket=bucket, Key=remote.key(remote.chunk_path(digest)))["Body"].read()
        assert stored == read_stored_chunk(local, share, chunk), (step, digest)
    for share in contents.shares:
        key = remote.key(step_file(step, share.index_name))
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == share.index_bytes, (step, key)


def _calls(remote) -> list[tuple[str, str]]:
    """Record (operation, key) of every S3 call of ``remote`` from now on."""
    seen: list[tuple[str, str]] = []
    remote.on_call(lambda method, params: seen.append((method, str(params.get("Key", params.get("Prefix", ""))))))
    return seen


def test_a_large_chunk_store_is_looked_up_chunk_by_chunk_and_dedup_still_checks_every_byte(
        tmp_path, s3_server, s3_bucket, s3_options, monkeypatch):
    import torch

    from ckptd.promotion import Promoter
    from ckptd.promotion.contents import read_step_contents, read_stored_chunk
    from ckptd.tiers.chunk_health import bad_chunk_paths
    from ckptd.tiers.local import LocalTier
    from test_promotion_support import s3_client

    frozen = torch.randn(2 * 1024 * 1024, generator=torch.Generator().manual_seed(0))
    with override(chunk_bytes=1024 * 1024), ckptd.CheckpointManager(tmp_path / "local", capture_rng=False,
                                                                     policy=ckptd.Policy(keep_local=None)) as m:
        for step in (1, 2, 3):
            m.save(step, {"frozen": frozen, "trained": torch.full((1024 * 1024,), float(step))})
    remote = object_tier(s3_bucket, s3_options, "lookups")
    try:
        local = LocalTier(tmp_path / "local")
        Promoter(local, remote).promote(1)  # lists the chunk store, and learns its size
        monkeypatch.setattr(dedup, "LOOKUPS_ABOVE", 0)  # from now on the store counts as large
        dedup.forget_verified()  # the frozen chunks are checked against the store's CRC32 again
        chunks = remote.key(remote.chunk_path(""))
        needed = read_step_contents(local, 2).unique_chunks()
        kept = set(needed) & set(read_step_contents(local, 1).unique_chunks())
        assert kept and len(needed) == len(kept) + 1, "step 2 keeps the frozen chunks and adds one of its own"

        seen = _calls(remote)
        report = Promoter(local, remote).promote(2)
        assert not [key for method, key in seen if method == "list_objects_v2" and key.startswith(chunks)], seen
        heads = [key for method, key in seen if method == "head_object" and key.startswith(chunks)]
        assert len(heads) == len(needed) + len(kept), f"a HEAD per chunk to decide, one per kept chunk: {heads}"
        assert report.chunks_uploaded == 1 and dedup.last_check.checked_by_checksum == len(kept), \
            "the CRC32s came with the HEADs"

        victim = sorted(kept)[0]  # a frozen chunk flipped behind ckptd's back, its size and the store's CRC32 kept
        client = s3_client(s3_server)
        key = remote.key(remote.chunk_path(victim))
        body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        body[len(body) // 2] ^= 0x01
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body), ChecksumAlgorithm="CRC32")
        report = Promoter(local, remote).promote(3)
        assert report.chunks_uploaded == 2, "step 3's own chunk and the flipped frozen one"
        assert bad_chunk_paths(remote) == set(), "the bad record made by dedup is cleared once the chunk is mended"
        assert remote.committed_steps() == [1, 2, 3]
        for step in (2, 3):  # every chunk each committed step names is stored intact
            for digest, (share, chunk) in read_step_contents(local, step).unique_chunks().items():
                stored = client.get_object(Bucket=s3_bucket, Key=remote.key(remote.chunk_path(digest)))["Body"].read()
                assert stored == read_stored_chunk(local, share, chunk), (step, digest)
    finally:
        remote.close()


def test_lookups_start_once_the_store_is_larger_than_the_chunks_looked_for(tmp_path, s3_bucket, s3_options,
                                                                           monkeypatch):
    from ckptd.promotion import collect_garbage

    remote = object_tier(s3_bucket, s3_options, "store-size")
    try:
        for index in range(8):
            remote.write_bytes(remote.chunk_path(f"{index:02x}/{index:064x}.raw"), bytes(10 + index))
        wanted = [f"{index:02x}/{index:064x}.raw" for index in (0, 1)]
        monkeypatch.setattr(dedup, "LOOKUPS_ABOVE", 4)
        seen = _calls(remote)
        assert dedup.stored_sizes(remote, wanted) == {wanted[0]: 10, wanted[1]: 11}
        assert [method for method, _ in seen] == ["list_objects_v2"], "the first look lists (and learns 8 objects)"
        seen.clear()
        assert dedup.stored_sizes(remote, wanted + ["ff/missing.raw"]) == {wanted[0]: 10, wanted[1]: 11}
        assert [method for method, _ in seen] == ["list_objects_v2"], "8 objects are not more than 4 per chunk of 3"
        seen.clear()
        assert dedup.stored_sizes(remote, wanted[:1]) == {wanted[0]: 10}
        assert [method for method, _ in seen] == ["head_object"], "8 objects are more than 4 per chunk of 1"
        seen.clear()
        dedup.mark_uploaded(remote, [f"{index:02x}/{index:064x}.raw" for index in range(2, 8)])  # counts uploads
        assert dedup.stored_sizes(remote, wanted + ["ff/missing.raw"]) == {wanted[0]: 10, wanted[1]: 11}
        chunks = remote.key(remote.chunk_path(""))
        assert not [key for method, key in seen if method == "list_objects_v2" and key.startswith(chunks)], seen
        assert [method for method, _ in seen if method == "head_object"] == ["head_object"] * 3, seen
        collect_garbage(remote)  # sweeps all 8 (no step names them): the store is small again
        seen.clear()
        assert dedup.stored_sizes(remote, wanted) == {}
        assert [method for method, _ in seen] == ["list_objects_v2"], "0 objects: listing is cheaper again"
    finally:
        remote.close()


def test_a_step_a_collector_took_for_abandoned_midway_is_not_committed(tmp_path, s3_server, s3_bucket, s3_options,
                                                                     monkeypatch):
    # a promotion that ran past gc_abandoned_s and past its owner lease (a promoter frozen longer than the
    # lease, so the collector sees no live owner: injected, a real lease cannot be made to lapse on demand): a
    # collector deletes the step's directory (its rank indexes) and then sweeps the chunks only that step named.
    # The step is all new chunks, so nothing of it is kept from earlier uploads: its own indexes tell the loss
    import torch

    import ckptd.promotion.gc as gc_module

    monkeypatch.setattr(gc_module, "live_step_owners", lambda tier, step: [])

    from ckptd.errors import CommitError
    from ckptd.promotion import Promoter, collect_garbage
    from ckptd.promotion.contents import read_step_contents
    from ckptd.tiers.local import LocalTier

    with override(chunk_bytes=1024 * 1024), ckptd.CheckpointManager(tmp_path / "local", capture_rng=False) as m:
        m.save(1, {"weights": torch.randn(1024 * 1024)})
    remote = object_tier(s3_bucket, s3_options, "abandoned-midway")
    local = LocalTier(tmp_path / "local")
    collected = []

    def collect(phase: str) -> None:
        if phase == "chunks" and not collected:  # dedup decided; the chunks go up after the collection
            collected.append(collect_garbage(remote, abandoned_after_s=0))

    try:
        with pytest.raises(CommitError, match="rank index is missing") as caught:
            Promoter(local, remote, on_phase=collect).promote(1)
        assert collected[0].abandoned_steps == (1,) and caught.value.step == 1
        assert remote.committed_steps() == []
        Promoter(local, remote).promote(1)  # promoted again: its indexes written anew, every chunk stored
        needed = read_step_contents(local, 1).unique_chunks()
        assert dedup.stored_sizes(remote, needed) == {key: chunk.length for key, (_, chunk) in needed.items()}
        assert remote.committed_steps() == [1]
        _assert_stored_as_saved(s3_server, s3_bucket, remote, local, 1)
    finally:
        remote.close()
