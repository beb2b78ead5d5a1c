"""Packed small chunks (format 3) on moto's S3 server over loopback.

A model of 200 small tensors and a few large frozen ones: a promoted step is a handful of objects (the
rank's index and pack, the manifest, and the large chunks the store lacks), counted on the bucket and in
the requests sent; restore from the object tier alone is bit for bit and reads the pack with one or a few
requests; step 2 uploads <= 5% of step 1's bytes. Steps of formats 1 and 2 still restore, an unknown
version is refused, a corrupt byte in a pack falls back to the local copy or fails naming the pack, and a
corrupt local pack is never uploaded.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.config import override, settings
from ckptd.errors import FormatVersionError, IntegrityError
from ckptd.format.layout import MANIFEST_NAME, rank_data_name, rank_index_name, step_dir, step_file
from ckptd.format.records import ChunkRecord
from ckptd.promotion.promoter import promote_step
from ckptd.promotion.lease import STEP_OWNERS_PREFIX
from ckptd.promotion.pull import pull_step
from ckptd.stepio.packs import PackReads, plan_ranges
from ckptd.stepio.step_reader import ChunkSource, StepReader, load_rank_index, load_step_manifest, verify_step
from ckptd.testing import tamper
from ckptd.tiers.chunk_health import bad_chunk_paths
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

from test_promotion_support import object_tier, s3_client, same_bytes, zero_like

SMALL_TENSORS = 200
LARGE_TENSORS = 4
LARGE_ELEMENTS = 512 * 1024  # 2 MiB of float32: above the pack threshold, one chunk each
PACK = rank_data_name(0, 0)


def model_state(step: int, *, small_elements: int = 256) -> dict[str, torch.Tensor]:
    """200 small tensors that change every step and a few large frozen ones (the same at every step)."""
    frozen = torch.Generator().manual_seed(0)
    trained = torch.Generator().manual_seed(1000 + step)
    state = {f"frozen.{i}": torch.randn(LARGE_ELEMENTS, generator=frozen) for i in range(LARGE_TENSORS)}
    state.update({f"layer.{i}.weight": torch.randn(small_elements, generator=trained) for i in range(SMALL_TENSORS)})
    return state


def save_steps(directory: Path, states: dict[int, dict[str, torch.Tensor]], **settings_: Any) -> LocalTier:
    with override(**settings_), ckptd.CheckpointManager(directory, capture_rng=False) as manager:
        for step, state in sorted(states.items()):
            manager.save(step, state)
    return LocalTier(directory)


def record_requests(tier: ObjectTier) -> list[tuple[str, str]]:
    """(S3 method, key relative to the tier root) of every call the tier makes from now on."""
    sent: list[tuple[str, str]] = []
    root = tier.key("")
    tier.on_call(lambda method, params: sent.append((method, str(params.get("Key", ""))[len(root):])))
    return sent


def bucket_keys(server: Any, bucket: str, prefix: str) -> set[str]:
    pages = s3_client(server).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return {item["Key"][len(prefix) + 1:] for page in pages for item in page.get("Contents", [])}


def uploads(requests: list[tuple[str, str]]) -> list[str]:
    """The keys uploaded, without the promoter's step owner record and claims (written first, deleted after
    the commit)."""
    return [key for method, key in requests if method in ("put_object", "create_multipart_upload")
            and not key.startswith(f"{STEP_OWNERS_PREFIX}/") and not key.rpartition("/")[2].startswith("claim-rank-")]


def test_a_step_of_200_small_tensors_is_a_handful_of_objects_and_restores_from_the_object_tier_alone(
        tmp_path, s3_server, s3_bucket, s3_options):
    states = {1: model_state(1), 2: model_state(2)}
    local = save_steps(tmp_path / "node-a", states)
    index = load_rank_index(local, load_step_manifest(local, 2), 0)
    assert index.format_version == 3 and index.data_files[0].packed
    assert all(index.in_pack(c) == name.startswith("layer.") for name, r in index.tensors.items() for c in r.chunks)
    remote = object_tier(s3_bucket, s3_options)
    requests = record_requests(remote)

    first = promote_step(local, remote, 1)
    step_one = bucket_keys(s3_server, s3_bucket, "run")
    # bound per step and rank: its index, its pack, the manifest, and the large chunks the store lacks
    assert {key for key in step_one if key.startswith(step_dir(1))} == {
        step_file(1, rank_index_name(0)), step_file(1, PACK), step_file(1, MANIFEST_NAME)}
    assert len([key for key in step_one if key.startswith("chunks/")]) == LARGE_TENSORS
    assert sorted(uploads(requests)) == sorted(step_one), "one upload per object, none per small tensor"
    assert first.packs_uploaded == 1 and first.chunks_uploaded == LARGE_TENSORS

    requests.clear()
    second = promote_step(local, remote, 2)
    assert bucket_keys(s3_server, s3_bucket, "run") - step_one == {
        step_file(2, rank_index_name(0)), step_file(2, PACK), step_file(2, MANIFEST_NAME)}
    assert sorted(uploads(requests)) == sorted([step_file(2, rank_index_name(0)), step_file(2, PACK),
                                                step_file(2, MANIFEST_NAME)])
    assert second.chunks_uploaded == 0, "the large frozen tensors are deduplicated"
    assert second.bytes_uploaded <= 0.05 * first.bytes_uploaded, (second.bytes_uploaded, first.bytes_uploaded)
    assert list(verify_step(remote, 2)) == []

    originals = {p.name: p.read_bytes() for p in (local.root / step_dir(2)).iterdir()}
    shutil.rmtree(local.root)
    restored = zero_like(states[2])
    with ckptd.CheckpointManager(tmp_path / "node-b", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        reads = record_requests(manager.remote)  # type: ignore[arg-type]
        assert manager.restore(restored) == 2
        assert manager.last_restore.tier == manager.remote.label
    assert same_bytes(restored, states[2])
    gets = [key for method, key in reads if method == "get_object"]
    assert gets.count(step_file(2, PACK)) == 1, f"the pack is read with one request: {gets}"
    assert len([key for key in gets if key.startswith("chunks/")]) == LARGE_TENSORS
    pull_step(remote, LocalTier(tmp_path / "node-b"), 2)
    pulled = tmp_path / "node-b" / step_dir(2)
    assert {p.name: p.read_bytes() for p in pulled.iterdir()} == originals, "re-populated byte for byte"


def test_each_rank_adds_its_index_and_its_pack_and_shares_the_large_chunks(tmp_path, s3_server, s3_bucket,
                                                                           s3_options):
    store = torch.distributed.HashStore()
    states = {rank: {**model_state(rank), "own": torch.full((1000,), float(rank))} for rank in (0, 1)}

    def save(rank: int) -> None:
        with ckptd.CheckpointManager(tmp_path / "shared", rank=rank, world_size=2, store=store,
                                     capture_rng=False) as manager:
            manager.save(9, states[rank])

    threads = [threading.Thread(target=save, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    remote = object_tier(s3_bucket, s3_options)
    report = promote_step(LocalTier(tmp_path / "shared"), remote, 9)
    keys = bucket_keys(s3_server, s3_bucket, "run")
    assert {key for key in keys if key.startswith(step_dir(9))} == {
        step_file(9, name) for rank in (0, 1) for name in (rank_index_name(rank), rank_data_name(rank, 0))
    } | {step_file(9, MANIFEST_NAME)}
    assert len([key for key in keys if key.startswith("chunks/")]) == LARGE_TENSORS, "frozen chunks stored once"
    assert report.packs_uploaded == 2 and list(verify_step(remote, 9)) == []
    for rank in (0, 1):
        index = load_rank_index(remote, load_step_manifest(remote, 9), rank)
        reader = StepReader([ChunkSource(remote, index)])
        assert same_bytes({name: reader.read_tensor(name) for name in states[rank]}, states[rank])


def test_a_large_pack_is_read_in_a_few_coalesced_ranges(tmp_path, s3_bucket, s3_options):
    state = model_state(3, small_elements=4096)  # 200 x 16 KiB: a pack of about 3.2 MiB
    local = save_steps(tmp_path / "local", {3: state})
    remote = object_tier(s3_bucket, s3_options)
    promote_step(local, remote, 3)
    index = load_rank_index(remote, load_step_manifest(remote, 3), 0)
    limit = 1024 * 1024
    planned = plan_ranges(index.packed_chunks(0), limit)
    assert 3 <= len(planned) <= 5 and all(end - start <= limit for start, end in planned)
    requests = record_requests(remote)
    with override(s3_part_bytes=limit):
        reader = StepReader([ChunkSource(remote, index)])
        restored = {name: reader.read_tensor(name, torch.zeros_like(tensor), defer=True)
                    for name, tensor in state.items()}
        reader.settle()
    assert same_bytes(restored, state)
    pack_gets = [key for method, key in requests if method == "get_object" and key == step_file(3, PACK)]
    assert len(pack_gets) == len(planned) == reader.sources[0].packs.requests, "one GET per planned range"
    assert len(pack_gets) < SMALL_TENSORS / 40


def test_ranges_cover_every_chunk_are_cut_between_chunks_and_stay_within_the_limit():
    chunks = [ChunkRecord(offset=o, length=n, raw_length=n, codec="raw", digest="0" * 32)
              for o, n in [(0, 100), (100, 300), (400, 50), (450, 1000), (1450, 10)]]
    assert plan_ranges(chunks, 400) == [(0, 400), (400, 450), (450, 1450), (1450, 1460)]
    assert plan_ranges(chunks, 10_000) == [(0, 1460)]
    assert plan_ranges(list(reversed(chunks)), 460) == [(0, 450), (450, 1450), (1450, 1460)]


def downgrade_to_version_2(root: Path, step: int) -> None:
    """Rewrite a step saved without a pack as format 2 wrote it (indexes, manifest, digests)."""
    tamper.rewrite_index(root, step, lambda body: body.update(format_version=2))
    tamper.rewrite_manifest(root, step, lambda body: body.update(format_version=2))


def test_format_2_steps_restore_locally_and_from_the_object_tier(tmp_path, s3_bucket, s3_options):
    state = model_state(4)
    local = save_steps(tmp_path / "local", {4: state}, pack_below_bytes=0)
    downgrade_to_version_2(local.root, 4)
    assert tamper.read_json(tamper.index_path(local.root, 4))["format_version"] == 2
    assert not any(len(item) > 2 for item in tamper.read_json(tamper.index_path(local.root, 4))["data_files"])
    assert list(verify_step(local, 4)) == []
    restored = zero_like(state)
    with ckptd.CheckpointManager(local.root, capture_rng=False) as manager:
        assert manager.restore(restored) == 4
    assert same_bytes(restored, state)

    remote = object_tier(s3_bucket, s3_options)
    report = promote_step(local, remote, 4)
    assert report.packs_uploaded == 0 and report.chunks == SMALL_TENSORS + LARGE_TENSORS, "format 2: by digest"
    reader = StepReader([ChunkSource(remote, load_rank_index(remote, load_step_manifest(remote, 4), 0))])
    from_remote = {name: reader.read_tensor(name) for name in state}
    assert same_bytes(from_remote, state)


def test_an_unknown_format_version_is_refused_naming_the_file(tmp_path):
    local = save_steps(tmp_path / "local", {5: model_state(5)})
    tamper.rewrite_manifest(local.root, 5, lambda body: body.update(format_version=5))
    with pytest.raises(FormatVersionError) as caught:
        load_step_manifest(local, 5)
    message = str(caught.value)
    assert "format version 5" in message and MANIFEST_NAME in message and "[1, 2, 3, 4]" in message


def corrupt_remote_pack(server: Any, bucket: str, step: int, offset: int) -> None:
    client = s3_client(server)
    key = f"run/{step_file(step, PACK)}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[offset] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_a_corrupt_byte_in_a_pack_falls_back_to_the_local_copy_or_fails_naming_the_pack(
        tmp_path, s3_server, s3_bucket, s3_options):
    state = model_state(6)
    local = save_steps(tmp_path / "local", {6: state})
    remote = object_tier(s3_bucket, s3_options)
    promote_step(local, remote, 6)
    index = load_rank_index(remote, load_step_manifest(remote, 6), 0)
    victim = "layer.7.weight"
    damaged = index.tensors[victim].chunks[0]
    corrupt_remote_pack(s3_server, s3_bucket, 6, damaged.offset + 5)

    local_index = load_rank_index(local, load_step_manifest(local, 6), 0)
    both = StepReader([ChunkSource(remote, index), ChunkSource(local, local_index)])
    restored = {name: both.read_tensor(name) for name in state}
    assert same_bytes(restored, state), "the bad chunk came from the local copy"
    assert [(event.tensor, event.tier) for event in both.events] == [(victim, remote.label)]
    assert step_file(6, PACK) in both.events[0].error
    assert bad_chunk_paths(remote) == {step_file(6, PACK)}, "recorded so that promotion uploads it again"

    alone = StepReader([ChunkSource(remote, index)])
    intact = "layer.8.weight"
    assert same_bytes({intact: alone.read_tensor(intact)}, {intact: state[intact]}), "other chunks still read"
    with pytest.raises(IntegrityError) as caught:
        alone.read_tensor(victim)
    error = caught.value
    assert error.path == step_file(6, PACK) and error.step == 6 and error.tier == remote.label
    assert step_file(6, PACK) in str(error) and "step 6" in str(error) and remote.label in str(error)
    problems = list(verify_step(remote, 6))
    assert [problem.path for problem in problems] == [step_file(6, PACK)]


def test_a_corrupt_local_pack_is_never_uploaded(tmp_path, s3_server, s3_bucket, s3_options):
    local = save_steps(tmp_path / "local", {7: model_state(7)})
    index = load_rank_index(local, load_step_manifest(local, 7), 0)
    chunk = index.tensors["layer.3.weight"].chunks[0]
    tamper.flip_bit(tamper.data_path(local.root, 7), chunk.offset + 2)
    remote = object_tier(s3_bucket, s3_options)
    with pytest.raises(IntegrityError) as caught:
        promote_step(local, remote, 7)
    assert caught.value.path == step_file(7, PACK) and caught.value.step == 7
    left = bucket_keys(s3_server, s3_bucket, "run")
    assert step_file(7, PACK) not in left and step_file(7, MANIFEST_NAME) not in left
    assert remote.committed_steps() == []


def test_pack_reads_fetch_each_range_once_and_drop_it_after_its_last_read(tmp_path):
    state = model_state(8)
    local = save_steps(tmp_path / "local", {8: state})
    index = load_rank_index(local, load_step_manifest(local, 8), 0)

    class CountingTier(LocalTier):
        reads = 0

        def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
            CountingTier.reads += 1
            return super().read_bytes(path, offset, length)

    tier = CountingTier(local.root)
    packs = PackReads()
    packed = [chunk for chunk in index.chunks if index.in_pack(chunk)]
    assert len(packed) == SMALL_TENSORS and settings().pack_below_bytes > state["layer.0.weight"].nbytes
    stored = [bytes(packs.stored_bytes(tier, index, chunk)) for chunk in packed]
    assert CountingTier.reads == 1 and packs.requests == 1
    pack_bytes = (local.root / step_dir(8) / PACK).read_bytes()
    assert stored == [pack_bytes[c.offset:c.offset + c.length] for c in packed]
    assert bytes(packs.stored_bytes(tier, index, packed[0])) == stored[0]
    assert CountingTier.reads == 2, "every reference was read: the range was dropped and is fetched again"


def test_pack_reads_fetch_again_after_an_interrupted_fetch(tmp_path):
    local = save_steps(tmp_path / "local", {9: model_state(9)})
    index = load_rank_index(local, load_step_manifest(local, 9), 0)

    class Interrupted(BaseException):
        pass

    class InterruptedOnce(LocalTier):
        interrupted = False

        def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
            if not InterruptedOnce.interrupted:
                InterruptedOnce.interrupted = True
                raise Interrupted()
            return super().read_bytes(path, offset, length)

    tier, packs = InterruptedOnce(local.root), PackReads()
    chunk = next(chunk for chunk in index.chunks if index.in_pack(chunk))
    with pytest.raises(Interrupted):
        packs.stored_bytes(tier, index, chunk)
    pack_bytes = (local.root / step_dir(9) / PACK).read_bytes()
    assert bytes(packs.stored_bytes(tier, index, chunk)) == pack_bytes[chunk.offset:chunk.offset + chunk.length]
    assert packs.requests == 1, "the interrupted fetch is not remembered: the next read fetches the range"
