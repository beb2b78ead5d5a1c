"""Self-healing dedup: objects found bad on the object tier are recorded, never reused, uploaded again
by the next promotion and mended in older steps by ``ckptd verify --repair``."""

from __future__ import annotations

import json
import os
from collections import Counter

import boto3
import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.config import override
from ckptd.errors import IntegrityError, UnsafePathError
from ckptd.promotion import dedup, promote_step
from ckptd.promotion.contents import read_step_contents, read_stored_chunk, read_verified_pack
from ckptd.promotion.dedup import chunks_to_upload, forget_verified, mark_uploaded
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
from ckptd.tiers.chunk_health import bad_chunk_paths, clear_bad_chunk, report_bad_chunk
from ckptd.tiers.s3_transfers import crc32_checksum
from test_promotion_support import model_state, object_tier, same_bytes, save_local, zero_like

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


def test_a_record_naming_no_file_under_the_root_is_ignored(s3_server, s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    try:
        report_bad_chunk(remote, "chunks/ab/abcd.raw", step=3, reason="digest mismatch")
        for name in ("step-000000000003/../../elsewhere/rank-00000.pack", "chunks//ab.raw"):
            _boto(s3_server).put_object(Bucket=s3_bucket, Key=f"run/health/bad/{name}.bad.json", Body=b"{}")
        assert bad_chunk_paths(remote) == {"chunks/ab/abcd.raw"}, "repair never writes where such a record points"
    finally:
        remote.close()


# --- dedup: a stored chunk is reused only when the store's checksum matches the intact local copy --------

_BIG_CHUNK = 2 * 1024 * 1024  # above the pack threshold: content-addressed, shared by the steps


def _states() -> dict[int, dict[str, torch.Tensor]]:
    return {step: model_state(step, frozen_elements=1024 * 1024) for step in (1, 2)}


def _frozen_keys(contents) -> list[str]:
    return [chunk.object_key for chunk in contents.shares[0].index.tensors["frozen"].chunks]


def _count_requests(tier) -> Counter:
    """Requests every client of ``tier`` sends from now on, by operation."""
    sent: Counter = Counter()
    tier.on_request(lambda request, **_: sent.update([request.url.split("?")[0].rsplit("/", 1)[-1]
                                                      if request.method == "GET" else request.method]))
    return sent


def _boto(server, *, checksums: bool = True):
    """A plain boto3 client; ``checksums=False`` sends no checksum, so the store keeps none."""
    from botocore.config import Config

    config = Config(request_checksum_calculation="when_supported" if checksums else "when_required")
    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1", config=config)


def _tamper_same_size(server, bucket: str, key: str, *, with_checksum: bool = True) -> bytes:
    """Flip one byte of a chunk object behind ckptd's back (plain boto3); returns the tampered body."""
    client = _boto(server, checksums=with_checksum)
    body = bytearray(client.get_object(Bucket=bucket, Key=f"run/chunks/{key}")["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=f"run/chunks/{key}", Body=bytes(body))
    return bytes(body)


@pytest.mark.parametrize("with_checksum", [True, False], ids=["store-checksum", "no-store-checksum"])
def test_dedup_catches_a_same_size_tampered_chunk(tmp_path, s3_server, s3_bucket, s3_options, with_checksum):
    with override(chunk_bytes=_BIG_CHUNK):
        local = save_local(tmp_path / "local", _states(), chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(local, remote, 1)
        forget_verified()
        contents = read_step_contents(local, 2)
        needed = contents.unique_chunks()
        first = chunks_to_upload(remote, needed, local)
        assert {chunk.object_key for _, chunk in first} == set(needed) - set(_frozen_keys(contents)), \
            "only step 2's own chunks are missing"
        assert dedup.last_check.checked_by_checksum == 2 and dedup.last_check.mismatched == 0

        victim = _frozen_keys(contents)[0]
        _tamper_same_size(s3_server, s3_bucket, victim, with_checksum=with_checksum)
        sent = _count_requests(remote)
        second = chunks_to_upload(remote, needed, local)
        assert victim in {chunk.object_key for _, chunk in second}, "the tampered chunk is uploaded again"
        assert _frozen_keys(contents)[1] not in {chunk.object_key for _, chunk in second}
        assert bad_chunk_paths(remote) == {f"chunks/{victim}"}
        if with_checksum:
            assert dedup.last_check.checked_by_checksum == 1, "only the replaced object (new ETag) is checked"
            assert dedup.last_check.remembered == 1, "the untouched frozen chunk is remembered"
            chunk_reads = [name for name in sent if name.endswith((".raw", ".zst", ".bpz"))]
            assert not chunk_reads and sent["HEAD"] == 1, f"a HEAD, not a download: {dict(sent)}"
        else:
            assert dedup.last_check.checked_by_reading == 1, "no checksum kept: read back once and compared"

        for share, chunk in second:  # what the promoter does with the answer
            remote.write_bytes(remote.chunk_path(chunk.object_key), read_stored_chunk(local, share, chunk))
        mark_uploaded(remote, [chunk.object_key for _, chunk in second])
        assert bad_chunk_paths(remote) == set(), "the record is cleared once an intact copy is stored"
        assert chunks_to_upload(remote, needed, local) == []
        stored = remote.read_bytes(remote.chunk_path(victim))
        share, chunk = needed[victim]
        assert stored == read_stored_chunk(local, share, chunk), "the object tier holds the intact bytes again"
    finally:
        remote.close()


def test_uploads_ask_the_store_for_a_crc32_of_the_whole_object(s3_bucket, s3_options):
    remote = object_tier(s3_bucket, s3_options)
    try:
        small, large = os.urandom(1000), os.urandom(2 * 5 * 1024 * 1024 + 17)
        with override(s3_part_bytes=5 * 1024 * 1024):
            remote.write_bytes("chunks/aa/small.raw", small)
            remote.write_bytes("chunks/aa/large.raw", large)
        assert remote.stored_checksum("chunks/aa/small.raw")[2] == crc32_checksum(small)
        assert remote.stored_checksum("chunks/aa/large.raw")[2] == crc32_checksum(large), \
            "a multipart upload keeps a full-object CRC32, not a per-part one"
    finally:
        remote.close()
    with override(s3_upload_checksum=""):  # a store that refuses checksum headers gets none
        plain = object_tier(s3_bucket, s3_options)
        try:
            plain.write_bytes("chunks/aa/plain.raw", small)
            assert plain.stored_checksum("chunks/aa/plain.raw")[2] is None
        finally:
            plain.close()


# --- end to end: restore falls back, verify --repair mends, every remote step verifies ---------------------

@pytest.fixture
def cli_credentials(monkeypatch):
    """The credentials moto accepts, where the CLI and a fresh manager look for them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


def _run_states(last: int = 3) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1 to ``last``: a frozen tensor shared by every step, an adapter that changes at step 2 and then
    stays (its one chunk is shared by steps 2 to ``last``), and a small trained tensor that changes every
    step (its chunk belongs to its step alone)."""
    frozen = torch.randn(1024 * 1024, generator=torch.Generator().manual_seed(0))
    first = torch.randn(512 * 1024, generator=torch.Generator().manual_seed(1))
    settled = torch.randn(512 * 1024, generator=torch.Generator().manual_seed(2))
    return {step: {"frozen": frozen, "adapter": first if step == 1 else settled,
                   "trained": torch.randn(4096, generator=torch.Generator().manual_seed(100 + step))}
            for step in range(1, last + 1)}


def _chunk_key(tier, step: int, tensor: str = "adapter") -> str:
    """The content address of the one chunk of ``tensor`` (saved whole in one chunk) in ``step`` on ``tier``."""
    index = load_rank_index(tier, load_step_manifest(tier, step), 0)
    (chunk,) = index.tensors[tensor].chunks
    return chunk.object_key


def _verify_cli(remote, s3_options, *extra: str):
    endpoint = s3_options["client_kwargs"]["endpoint_url"]
    return CliRunner().invoke(cli, ["verify", remote.url, "--endpoint-url", endpoint, "--json", *extra])


def _restore_fresh(directory, remote, s3_options, like, step: int | None = None):
    """Restore the newest intact step (or ``step``) on a fresh node (an empty local directory, so from the
    object tier alone) into zeros shaped like ``like``: (step, restored state, RestoreResult)."""
    restored = zero_like(like)
    with ckptd.CheckpointManager(directory, remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        step = manager.restore(restored, step)
        return step, restored, manager.last_restore


def test_a_bad_shared_chunk_is_recorded_by_restore_and_mended_by_verify_repair(tmp_path, s3_server, s3_bucket,
                                                                                s3_options, cli_credentials):
    states = _run_states()
    local = save_local(tmp_path / "local", states, chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        for step in states:
            promote_step(local, remote, step)
        key = _chunk_key(remote, 3)
        assert key == _chunk_key(remote, 2), "steps 2 and 3 share the adapter's chunk"
        _tamper_same_size(s3_server, s3_bucket, key)

        step, restored, result = _restore_fresh(tmp_path / "fresh", remote, s3_options, states[1])
        assert step == 1 and same_bytes(restored, states[1]), "steps 3 and 2 are bad everywhere here: step 1"
        digest = key.split("/")[-1].split(".")[0]
        assert [reason.split(" on ")[0] for reason in result.skipped] == ["step 3", "step 2"], result.skipped
        assert all(f"chunk {digest}" in reason for reason in result.skipped), "the restore says which chunk"
        assert bad_chunk_paths(remote) == {f"chunks/{key}"}, "the restore recorded the bad object"

        outcome = _verify_cli(remote, s3_options)
        assert outcome.exit_code == IntegrityError.exit_code
        assert sorted({p["step"] for p in json.loads(outcome.output)["problems"]}) == [2, 3]

        without_copy = _verify_cli(remote, s3_options, "--repair")
        assert without_copy.exit_code == IntegrityError.exit_code, "no intact copy on the object tier alone"
        assert [item["path"] for item in json.loads(without_copy.output)["unrepairable"]] == [f"chunks/{key}"]

        repaired = _verify_cli(remote, s3_options, "--repair", "--from", str(tmp_path / "local"))
        assert repaired.exit_code == 0, repaired.output
        answer = json.loads(repaired.output)
        assert answer["repaired"] == [f"chunks/{key}"] and answer["problems"] == [] and answer["steps_checked"] == 3
        assert bad_chunk_paths(remote) == set(), "the record is cleared after the repair"

        assert _verify_cli(remote, s3_options).exit_code == 0, "every remote step verifies"
        contents = read_step_contents(local, 3)
        share, chunk = contents.unique_chunks()[key]
        assert remote.read_bytes(remote.chunk_path(key)) == read_stored_chunk(local, share, chunk)
        step, restored, _ = _restore_fresh(tmp_path / "fresh-again", remote, s3_options, states[3])
        assert step == 3 and same_bytes(restored, states[3])
    finally:
        remote.close()


def test_a_bad_pack_is_mended_whole_from_the_local_copy(tmp_path, s3_server, s3_bucket, s3_options, cli_credentials):
    states = _run_states()
    local = save_local(tmp_path / "local", states, chunk_bytes=_BIG_CHUNK, pack_below_bytes=1024 * 1024)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(local, remote, 2)
        contents = read_step_contents(remote, 2)
        ((share, number),) = contents.packs()
        pack = f"step-{2:012d}/{share.index.data_files[number].name}"
        _flip_object_byte(s3_server, s3_bucket, f"run/{pack}")
        outcome = _verify_cli(remote, s3_options, "--repair", "--from", str(tmp_path / "local"))
        assert outcome.exit_code == 0, outcome.output
        assert json.loads(outcome.output)["repaired"] == [pack]
        local_contents = read_step_contents(local, 2)
        assert remote.read_bytes(pack) == read_verified_pack(local, local_contents.shares[0], number)
    finally:
        remote.close()


def _flip_object_byte(server, bucket: str, key: str) -> None:
    client = _boto(server)
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_the_next_promotion_uploads_a_bad_chunk_again(tmp_path, s3_server, s3_bucket, s3_options, cli_credentials):
    """Through the promoter's wiring: ``Promoter.promote`` decides what to upload with
    :func:`ckptd.promotion.dedup.chunks_to_upload` and calls :func:`~ckptd.promotion.dedup.mark_uploaded`."""
    states = _run_states()
    local = save_local(tmp_path / "local", states, chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(local, remote, 2)
        key = _chunk_key(remote, 2)
        _tamper_same_size(s3_server, s3_bucket, key)  # no reader saw it: only dedup's checksum check can
        forget_verified()
        report = promote_step(local, remote, 3)
        assert report.chunks_uploaded >= 1 and bad_chunk_paths(remote) == set()
        contents = read_step_contents(local, 3)
        share, chunk = contents.unique_chunks()[key]
        assert remote.read_bytes(remote.chunk_path(key)) == read_stored_chunk(local, share, chunk), \
            "step 3's promotion stored the intact chunk again"
        assert _verify_cli(remote, s3_options).exit_code == 0, "so step 2, which shares it, verifies too"
        step, restored, _ = _restore_fresh(tmp_path / "fresh", remote, s3_options, states[3])
        assert step == 3 and same_bytes(restored, states[3])
    finally:
        remote.close()


def _chunk_puts(tier) -> Counter:
    """Uploads (single PUTs and multipart starts) every client of ``tier`` sends from now on, by object key."""
    puts: Counter = Counter()
    tier.on_call(lambda method, params: puts.update([str(params["Key"])])
                 if method in ("put_object", "create_multipart_upload") else None)
    return puts


def test_a_restore_records_a_bad_shared_chunk_the_next_promotion_uploads_it_and_repair_mends_the_rest(
        tmp_path, s3_server, s3_bucket, s3_options, cli_credentials, monkeypatch):
    """Issue 11's chain as one run. The adapter's chunk object (2 MiB, content-addressed, shared by steps 2, 3
    and the next step 4) flips a byte in S3 at its size; so does step 2's own trained chunk, which no later
    step holds. A restore on a fresh node falls back to step 1, says why and records the adapter's object as
    bad; promoting step 4 uploads that object again because of the record alone (dedup's checksum check is
    made to trust it here); ``verify --repair`` mends what step 4 did not hold; every step then verifies and
    restores bit for bit from S3 alone."""
    states = _run_states(last=4)
    local = save_local(tmp_path / "local", states, chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        for step in (1, 2, 3):
            promote_step(local, remote, step)
        shared, own = _chunk_key(remote, 3), _chunk_key(remote, 2, "trained")
        assert shared == _chunk_key(remote, 2) == _chunk_key(local, 4) != _chunk_key(remote, 1)
        intact = remote.read_bytes(remote.chunk_path(shared))
        assert len(_tamper_same_size(s3_server, s3_bucket, shared)) == len(intact)
        _tamper_same_size(s3_server, s3_bucket, own)

        step, restored, result = _restore_fresh(tmp_path / "fresh", remote, s3_options, states[1])
        assert step == 1 and same_bytes(restored, states[1]), "steps 3 and 2 are bad on S3: step 1"
        assert [reason.split(" on ")[0] for reason in result.skipped] == ["step 3", "step 2"], result.skipped
        assert f"chunk {shared.split('/')[-1].split('.')[0]}" in result.skipped[0], "the restore says which chunk"
        assert f"chunks/{shared}" in bad_chunk_paths(remote) <= {f"chunks/{shared}", f"chunks/{own}"}

        asked: list[str] = []
        checked_by_store = dedup._verdict

        def trusting(tier, local_tier, share, chunk, *looked_up) -> tuple[bool, str, int]:
            asked.append(chunk.object_key)  # as if the checksum matched
            if chunk.object_key == shared:
                return True, "checksum", 0
            return checked_by_store(tier, local_tier, share, chunk, *looked_up)

        forget_verified()
        puts = _chunk_puts(remote)
        with monkeypatch.context() as patched:
            patched.setattr(dedup, "_verdict", trusting)
            report = promote_step(local, remote, 4)
        assert shared not in asked, "a chunk recorded bad is not checked again: it is uploaded"
        assert dedup.last_check.recorded_bad == 1 and dedup.last_check.mismatched == 0, dedup.last_check
        assert puts[f"run/chunks/{shared}"] == 1 and report.chunks_uploaded == 2, (dict(puts), report)
        assert remote.read_bytes(remote.chunk_path(shared)) == intact, "the intact chunk is stored again"
        assert f"chunks/{shared}" not in bad_chunk_paths(remote), "its record is cleared"

        outcome = _verify_cli(remote, s3_options)
        assert outcome.exit_code == IntegrityError.exit_code
        assert {p["step"] for p in json.loads(outcome.output)["problems"]} == {2}, "step 3 was mended with it"
        repaired = _verify_cli(remote, s3_options, "--repair", "--from", str(tmp_path / "local"))
        assert repaired.exit_code == 0, repaired.output
        answer = json.loads(repaired.output)
        assert answer["repaired"] == [f"chunks/{own}"] and answer["problems"] == [] and answer["steps_checked"] == 4
        assert bad_chunk_paths(remote) == set()

        assert _verify_cli(remote, s3_options).exit_code == 0, "every remote step verifies"
        for step, state in states.items():
            restored_step, restored, result = _restore_fresh(tmp_path / f"fresh-{step}", remote, s3_options,
                                                             state, step)
            assert restored_step == step and same_bytes(restored, state) and not result.events, step
    finally:
        remote.close()


def test_gc_forgets_bad_records_of_the_objects_it_deletes(tmp_path, s3_bucket, s3_options):
    from ckptd.policy import KeepLatest
    from ckptd.promotion.gc import collect_garbage

    states = _run_states()
    local = save_local(tmp_path / "local", states, chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        for step in states:
            promote_step(local, remote, step)
        only_step_1 = f"chunks/{_chunk_key(remote, 1)}"
        shared = f"chunks/{_chunk_key(remote, 3)}"
        report_bad_chunk(remote, only_step_1, step=1, reason="test")
        report_bad_chunk(remote, shared, step=3, reason="test")
        report = collect_garbage(remote, retention=KeepLatest(2))
        assert report.deleted_steps == (1,) and report.deleted_chunks >= 1
        assert bad_chunk_paths(remote) == {shared}, "the record of a chunk still referenced is kept"
    finally:
        remote.close()


def test_verify_repair_clears_the_record_of_an_object_that_verifies_now(tmp_path, s3_bucket, s3_options,
                                                                        cli_credentials):
    local = save_local(tmp_path / "local", _run_states(), chunk_bytes=_BIG_CHUNK, pack_below_bytes=1024 * 1024)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(local, remote, 2)
        chunk = f"chunks/{_frozen_keys(read_step_contents(remote, 2))[0]}"
        ((share, number),) = read_step_contents(remote, 2).packs()
        pack = f"step-{2:012d}/{share.index.data_files[number].name}"
        for path in (chunk, pack):  # e.g. a read that went bad on its way: the objects themselves are intact
            report_bad_chunk(remote, path, step=2, reason="digest mismatch in transit")
        outcome = _verify_cli(remote, s3_options, "--repair")
        assert outcome.exit_code == 0, outcome.output
        answer = json.loads(outcome.output)
        assert sorted(answer["intact"]) == sorted([chunk, pack]) and answer["unrepairable"] == []
        assert bad_chunk_paths(remote) == set(), "so later promotions trust them again"
    finally:
        remote.close()


def test_a_chunk_stored_in_another_encoding_is_never_replaced(tmp_path, s3_server, s3_bucket, s3_options,
                                                              cli_credentials):
    """Another zstd level gives a frozen chunk another stored length under the same content address:
    promoting the new step must not replace the object the older step reads (it fails instead), and a
    repair takes no copy of the other length."""
    from ckptd.errors import CommitError

    frozen = (torch.arange(1024 * 1024) % 977).to(torch.float32)  # compressible: the level changes the length
    saved = {}
    for step, level in ((1, 1), (2, 19)):
        with override(codec="zstd", zstd_level=level):
            saved[step] = save_local(tmp_path / f"level-{level}", {step: {"frozen": frozen}}, chunk_bytes=_BIG_CHUNK)
    remote = object_tier(s3_bucket, s3_options)
    try:
        promote_step(saved[1], remote, 1)
        first = read_step_contents(remote, 1).unique_chunks()
        second = read_step_contents(saved[2], 2).unique_chunks()
        assert set(first) == set(second) and any(
            first[key][1].length != second[key][1].length for key in first), "same addresses, other lengths"
        before = {key: remote.read_bytes(remote.chunk_path(key)) for key in first}
        with pytest.raises(CommitError, match="another encoding"):
            promote_step(saved[2], remote, 2)
        assert {key: remote.read_bytes(remote.chunk_path(key)) for key in first} == before
        assert remote.committed_steps() == [1]

        victim = next(key for key in first if first[key][1].length != second[key][1].length)
        _tamper_same_size(s3_server, s3_bucket, victim)
        outcome = _verify_cli(remote, s3_options, "--repair", "--from", str(tmp_path / "level-19"),
                              "--from", str(tmp_path / "level-1"))
        assert outcome.exit_code == 0, outcome.output
        assert json.loads(outcome.output)["repaired"] == [f"chunks/{victim}"], "from the copy of step 1's length"
        assert remote.read_bytes(remote.chunk_path(victim)) == before[victim]
    finally:
        remote.close()
