"""The daemon's scrub: a flipped bit in a stored chunk is found in one pass and mended from another tier,
byte for byte (also by a real ``ckptd daemon`` process on its own schedule, counted in its metrics); what
cannot be mended is reported and nothing else changes; the pacing holds its rate on a fake clock; a pass
stops between chunks when asked."""

from __future__ import annotations

import errno
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.config import override
from ckptd.daemon.scrub import ByteRateLimiter, Scrubber
from ckptd.errors import ConfigError, StorageError
from ckptd.format.layout import step_dir
from ckptd.promotion import promote_step
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest, verify_step
from harness.daemon_process import DaemonProcess, run_trainer, write_config
from ckptd.testing.tamper import chunk_location, flip_bit
from ckptd.tiers.chunk_health import bad_chunk_paths
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from test_promotion_support import model_state, object_tier, s3_client, save_local

pytestmark = pytest.mark.s3

STEPS = (1, 2)


@pytest.fixture
def tiers(tmp_path, s3_bucket, s3_options, monkeypatch):
    """Steps 1 and 2 committed locally (each tensor in 256 KiB chunks, no packs) and promoted to S3."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # what moto accepts, for `ckptd verify`
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    local = save_local(tmp_path / "local", {step: model_state(step) for step in STEPS})
    remote = object_tier(s3_bucket, s3_options)
    for step in STEPS:
        promote_step(local, remote, step)
    yield local, remote
    remote.close()


@pytest.fixture
def local_only(tmp_path) -> LocalTier:
    """Steps 1 and 2 committed locally only (for what needs no object tier)."""
    return save_local(tmp_path / "local", {step: model_state(step) for step in STEPS})


def _chunk_key(tier, step: int, tensor: str) -> str:
    manifest = load_step_manifest(tier, step)
    return load_rank_index(tier, manifest, 0).tensors[tensor].chunks[0].object_key


def _raw_bytes(tier, step: int) -> int:
    index = load_rank_index(tier, load_step_manifest(tier, step), 0)
    return sum(record.nbytes for record in index.tensors.values())


def _unique_raw_bytes(tier, steps) -> int:
    unique = {chunk.object_key: chunk.raw_length for step in steps
              for chunk in load_rank_index(tier, load_step_manifest(tier, step), 0).chunks}
    return sum(unique.values())


def _objects(server, bucket: str) -> dict[str, bytes]:
    client = s3_client(server)
    keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for item in page.get("Contents", [])]
    return {key: client.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


def _flip_object(server, bucket: str, key: str) -> None:
    client = s3_client(server)
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def _verify_cli(url: str, *extra: str):
    outcome = CliRunner().invoke(cli, ["verify", url, *extra, "--json"])
    return outcome.exit_code, json.loads(outcome.output)


def _endpoint(s3_options) -> list[str]:
    return ["--endpoint-url", s3_options["client_kwargs"]["endpoint_url"]]


def test_a_flipped_bit_in_a_chunk_object_is_found_and_repaired_from_the_local_tier(tiers, s3_server, s3_bucket,
                                                                                    s3_options):
    local, remote = tiers
    key = f"run/chunks/{_chunk_key(remote, 2, 'trained')}"
    intact = _objects(s3_server, s3_bucket)[key]
    _flip_object(s3_server, s3_bucket, key)
    assert _verify_cli(remote.url, *_endpoint(s3_options))[0] != 0, "the flipped bit is there"

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(remote, repair_from=[local])

    path = key.removeprefix("run/")
    assert report.steps == STEPS and report.bad == (path,) and report.repaired == (path,)
    assert report.unrepaired == () and not report.stopped
    assert report.bytes == _unique_raw_bytes(remote, STEPS) < sum(_raw_bytes(remote, step) for step in STEPS), \
        "every chunk object was read, those both steps share once"
    assert _objects(s3_server, s3_bucket)[key] == intact, "the object holds its original bytes again"
    assert bad_chunk_paths(remote) == set(), "its bad record is cleared"
    code, answer = _verify_cli(remote.url, *_endpoint(s3_options))
    assert code == 0 and answer["problems"] == [] and answer["steps_checked"] == 2


def _scrub_counts(daemon: DaemonProcess, tier: str) -> tuple[float, float]:
    """(bad files scrub found, bad files repaired) on tiers of kind ``tier``, from the daemon's /metrics."""
    samples = daemon.metrics()
    return (samples.get(("ckptd_scrub_failures_total", (("tier", tier),)), 0.0),
            samples.get(("ckptd_repairs_total", (("tier", tier),)), 0.0))


def test_a_daemon_finds_a_flipped_bit_in_its_scheduled_scrub_and_mends_it_from_s3(tmp_path, s3_bucket, s3_options):
    """A real ``ckptd daemon`` with a one-second scrub interval: a bit flipped in a chunk of a committed,
    promoted step on the local tier (a chunk no other local step holds) is found by the next scheduled pass
    and written back from the object tier's copy in that same pass, and ``/metrics`` counts one bad file and
    one repair."""
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1", "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=1.0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 2, keep_local=None) == [1, 2]

        def promoted_and_unpinned() -> bool:  # a pin is a hard link: a flip would change its bytes too
            run = daemon.get_json("/status")["roots"]["run1"]
            return run["tiers"]["object"]["steps"] == [1, 2] and run["pinned"] == []

        daemon.wait_for(promoted_and_unpinned, 60, "steps 1 and 2 promoted and unpinned")
        daemon.wait_for(lambda: daemon.metrics().get(("ckptd_scrubbed_bytes_total", (("tier", "local"),)), 0) > 0,
                        60, "a scrub pass over the intact local tier")
        found, repaired = _scrub_counts(daemon, "local")
        assert found == repaired == 0, "nothing was bad before the flip"
        data_file, offset, length = chunk_location(root, 2, "weights")  # seeded by the step: step 2's alone
        intact, inode = data_file.read_bytes(), data_file.stat().st_ino
        flip_bit(data_file, offset + length // 2, bit=6)
        assert data_file.read_bytes() != intact

        daemon.wait_for(lambda: _scrub_counts(daemon, "local")[1] >= 1, 60, "a scheduled scrub pass to repair it")

        assert _scrub_counts(daemon, "local") == (1.0, 1.0), "found once and mended in the pass that found it"
        assert data_file.read_bytes() == intact and data_file.stat().st_ino == inode, "mended in place"
        assert list(verify_step(LocalTier(root), 2)) == []
        errors = [error["error"] for error in daemon.get_json("/status")["recent_errors"] if error["where"] == "scrub"]
        assert errors and "1 bad file(s)" in errors[-1] and "1 repaired" in errors[-1], errors
        assert _scrub_counts(daemon, "object") == (0.0, 0.0), "the object tier's copy was only read"
        assert daemon.terminate() == 0
    remote = object_tier(s3_bucket, s3_options, prefix="run1")
    try:
        assert [list(verify_step(remote, step)) for step in (1, 2)] == [[], []]
    finally:
        remote.close()


def _replica_of(local: LocalTier, directory: Path) -> LocalTier:
    """A buddy's replica directory laid out like the local tier (what replication writes)."""
    for step in local.committed_steps():
        shutil.copytree(local.root / step_dir(step), directory / step_dir(step))
    return LocalTier(directory)


@pytest.mark.parametrize("kind", ["local-root", "replica-dir"])
def test_a_flipped_bit_in_a_data_file_is_mended_in_place_from_the_object_tier(tiers, tmp_path, s3_options, kind):
    local, remote = tiers
    tier = local if kind == "local-root" else _replica_of(local, tmp_path / "replicas" / "node-a" / "run1")
    data_file, offset, length = chunk_location(tier.root, 2, "trained")
    intact = data_file.read_bytes()
    inode = data_file.stat().st_ino
    flip_bit(data_file, offset + length // 2, bit=3)
    assert data_file.read_bytes() != intact

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(tier, repair_from=[remote])

    path = str(data_file.relative_to(tier.root))
    assert report.bad == (path,) and report.repaired == (path,) and report.unrepaired == ()
    assert data_file.read_bytes() == intact, "every byte of the data file is back"
    assert data_file.stat().st_ino == inode, "mended in place (a hard-linked pin is mended with it)"
    code, answer = _verify_cli(str(tier.root))
    assert code == 0 and answer["problems"] == []


def test_a_bad_local_chunk_is_mended_from_another_step_of_the_same_tier(local_only):
    local = local_only
    data_file, offset, _ = chunk_location(local.root, 2, "frozen")  # step 1 holds the same frozen bytes
    intact = data_file.read_bytes()
    flip_bit(data_file, offset + 7)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[])

    assert report.repaired == (str(data_file.relative_to(local.root)),) and report.unrepaired == ()
    assert data_file.read_bytes() == intact


def test_a_chunk_without_an_intact_copy_is_reported_and_nothing_else_changes(tiers, s3_server, s3_bucket):
    local, remote = tiers
    key = f"run/chunks/{_chunk_key(remote, 2, 'trained')}"  # step 2's own chunk: no other step holds it
    _flip_object(s3_server, s3_bucket, key)
    data_file, offset, length = chunk_location(local.root, 2, "trained")
    flip_bit(data_file, offset + length // 3)
    stored_before, local_before = _objects(s3_server, s3_bucket), _files(local.root)

    scrubber = Scrubber(bytes_per_s=math.inf)
    remote_report = scrubber.scrub_tier(remote, repair_from=[local])
    local_report = scrubber.scrub_tier(local, repair_from=[remote])

    path = key.removeprefix("run/")
    assert remote_report.bad == (path,) and remote_report.unrepaired == (path,) and remote_report.repaired == ()
    assert "no intact copy" in dict(remote_report.reasons)[path]
    assert json.loads(json.dumps(remote_report.to_json()))["unrepaired"] == [path]
    local_path = str(data_file.relative_to(local.root))
    assert local_report.bad == (local_path,) and local_report.unrepaired == (local_path,)
    assert "no intact copy" in dict(local_report.reasons)[local_path]
    stored_after = _objects(s3_server, s3_bucket)
    records = {name for name in stored_after if name.startswith("run/health/bad/")}
    assert records == {f"run/health/bad/{path}.bad.json"}, "recorded bad, so that nothing reuses it"
    assert {name: body for name, body in stored_after.items() if name not in records} == stored_before
    assert _files(local.root) == local_before, "no byte of the local tier changed"


def test_steps_that_are_not_committed_are_never_touched(local_only):
    local = local_only
    partial = local.root / step_dir(3)
    shutil.copytree(local.root / step_dir(2), partial)
    (partial / "manifest.json").unlink()  # a save in progress
    data_file, offset, _ = chunk_location(local.root, 3, "trained")
    flip_bit(data_file, offset)
    before = _files(partial)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[], steps=[2, 3])

    assert report.steps == (2,) and report.bad == ()
    assert _files(partial) == before


class FakeClock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_limiter_holds_its_rate_on_a_fake_clock():
    clock = FakeClock()
    limiter = ByteRateLimiter(1000.0, clock=clock, sleep=clock.sleep)
    start, spent = clock.now, 0
    for amount in [300, 700, 2500, 10, 990, 4000, 1]:
        limiter.spend(amount)
        spent += amount
        assert spent <= 1000.0 * (clock.now - start) + 1e-6, "never faster than the rate (it starts empty)"
    assert clock.now - start == pytest.approx(spent / 1000.0), "and never slower than needed"
    clock.now += 5.0  # idle time refills the bucket up to its burst (one second's worth), not beyond
    slept = len(clock.sleeps)
    limiter.spend(1000)
    assert len(clock.sleeps) == slept, "a burst after idle time"
    limiter.spend(500)
    assert clock.sleeps[slept:] == [pytest.approx(0.5)], "but only one second's worth"
    with pytest.raises(ConfigError, match="scrub rate"):
        ByteRateLimiter(0.0)


def test_a_scrub_pass_keeps_to_its_byte_rate(local_only):
    local = local_only
    clock = FakeClock()
    rate = 512 * 1024.0
    report = Scrubber(bytes_per_s=rate, clock=clock, sleep=clock.sleep).scrub_tier(local, repair_from=[])
    assert report.bytes > 4 * rate, "enough bytes that the pacing must act"
    elapsed = clock.now - 100.0
    assert elapsed == pytest.approx(report.bytes / rate), "exactly the pass's bytes at the rate"


def test_should_stop_stops_a_pass_between_chunks_and_the_rest_is_scrubbed_next(tiers):
    local, remote = tiers
    data_file, offset, _ = chunk_location(local.root, 1, "frozen")  # the first chunk the pass reads
    intact = data_file.read_bytes()
    flip_bit(data_file, offset + 1)
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) >= 3  # before step 1, after chunk 1, after chunk 2

    scrubber = Scrubber(bytes_per_s=math.inf)
    report = scrubber.scrub_tier(local, repair_from=[remote], should_stop=should_stop)

    assert report.stopped and report.chunks == 2 and report.steps == () and report.remaining == STEPS
    assert report.repaired == (str(data_file.relative_to(local.root)),), "what it found is still mended"
    assert data_file.read_bytes() == intact
    rest = scrubber.scrub_tier(local, repair_from=[remote], steps=report.remaining)
    assert rest.steps == STEPS and not rest.stopped and rest.bad == ()
    assert rest.chunks > report.chunks


@pytest.fixture
def packed_tiers(tmp_path, s3_bucket, s3_options):
    """Steps 1 and 2 with the small tensor in each rank's pack, committed locally and promoted."""
    local = save_local(tmp_path / "local", {step: model_state(step) for step in STEPS}, pack_below_bytes=64 * 1024)
    remote = object_tier(s3_bucket, s3_options)
    for step in STEPS:
        promote_step(local, remote, step)
    yield local, remote
    remote.close()


def _pack_name(tier, step: int) -> str:
    index = load_rank_index(tier, load_step_manifest(tier, step), 0)
    (name,) = [data_file.name for data_file in index.data_files if data_file.packed]
    return f"{step_dir(step)}/{name}"


def test_a_bad_pack_is_mended_on_either_tier(packed_tiers, s3_server, s3_bucket):
    local, remote = packed_tiers
    pack = _pack_name(remote, 2)
    stored = _objects(s3_server, s3_bucket)[f"run/{pack}"]
    _flip_object(s3_server, s3_bucket, f"run/{pack}")
    local_pack = local.root / pack
    intact = local_pack.read_bytes()
    flip_bit(local_pack, len(intact) // 2)
    scrubber = Scrubber(bytes_per_s=math.inf)

    remote_report = scrubber.scrub_tier(remote, repair_from=[local])  # the local copy is bad too: no source
    assert remote_report.bad == (pack,) and remote_report.unrepaired == (pack,)
    local_report = scrubber.scrub_tier(local, repair_from=[remote])  # nor is the object tier's
    assert local_report.bad == (pack,) and local_report.unrepaired == (pack,)

    _boto_put(s3_server, s3_bucket, f"run/{pack}", stored)  # the object tier's pack is intact again
    assert scrubber.scrub_tier(local, repair_from=[remote]).repaired == (pack,)
    assert local_pack.read_bytes() == intact
    _flip_object(s3_server, s3_bucket, f"run/{pack}")
    assert scrubber.scrub_tier(remote, repair_from=[local]).repaired == (pack,)
    assert _objects(s3_server, s3_bucket)[f"run/{pack}"] == stored


def _boto_put(server, bucket: str, key: str, body: bytes) -> None:
    s3_client(server).put_object(Bucket=bucket, Key=key, Body=body)


def test_a_copy_stored_in_another_codec_mends_a_raw_chunk(tmp_path):
    states = {step: model_state(step) for step in STEPS}
    local = save_local(tmp_path / "raw", states)
    with override(codec="zstd"):
        elsewhere = save_local(tmp_path / "zstd", states)  # another node's copy, compressed
    data_file, offset, length = chunk_location(local.root, 2, "trained")
    _, _, compressed_length = chunk_location(elsewhere.root, 2, "trained")
    assert compressed_length != length, "the copy is stored in another encoding"
    intact = data_file.read_bytes()
    flip_bit(data_file, offset + 3)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[elsewhere], steps=[2])

    assert report.repaired == (str(data_file.relative_to(local.root)),)
    assert data_file.read_bytes() == intact


def test_a_data_file_reached_through_a_link_out_of_the_root_is_never_written(tiers, tmp_path):
    local, remote = tiers
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    data_file, offset, _ = chunk_location(local.root, 2, "trained")
    linked = outside / data_file.name
    shutil.move(data_file, linked)
    data_file.symlink_to(linked)
    flip_bit(linked, offset)
    before = _files(outside)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[remote])

    path = str(data_file.relative_to(local.root))
    assert path in report.bad and path in report.unrepaired, report
    assert "symbolic link" in dict(report.reasons)[path]
    assert _files(outside) == before


def test_a_step_directory_that_is_a_link_out_of_the_root_is_not_a_step_and_never_written(tiers, tmp_path):
    local, remote = tiers
    outside = tmp_path / "elsewhere" / step_dir(2)
    shutil.move(local.root / step_dir(2), outside)
    (local.root / step_dir(2)).symlink_to(outside, target_is_directory=True)
    data_file, offset, _ = chunk_location(local.root, 2, "trained")
    flip_bit(data_file, offset)
    before = _files(outside.parent)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[remote])

    assert 2 not in local.committed_steps()
    assert not any(path.startswith(step_dir(2)) for path in report.bad + report.repaired), report
    assert _files(outside.parent) == before


class _FailingDisk(LocalTier):
    """The real local tier, except that reads of one step's data files fail as a dying disk's do (EIO),
    which the tier passes on as the OSError it is."""

    def __init__(self, root: Path, failing_step: int) -> None:
        super().__init__(root)
        self.failing = step_dir(failing_step)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        if path.startswith(f"{self.failing}/") and path.endswith(".data"):
            raise OSError(errno.EIO, "Input/output error")
        super().read_into(path, offset, buffer)


def test_a_read_the_disk_refuses_is_reported_and_the_pass_goes_on(local_only):
    tier = _FailingDisk(local_only.root, failing_step=1)
    before = _files(local_only.root)

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(tier, repair_from=[])

    assert report.steps == STEPS and report.bad == (step_dir(1),) and report.unrepaired == (step_dir(1),)
    assert "Input/output error" in dict(report.reasons)[step_dir(1)]
    assert report.bytes == _raw_bytes(local_only, 2), "step 2 was scrubbed whole"
    assert _files(local_only.root) == before


class _FlakyStore(ObjectTier):
    """The real object tier, except that the first read of one object fails as a store that does not
    answer does (StorageError, after the client's retries)."""

    def __init__(self, url: str, storage_options, flaky: str) -> None:
        super().__init__(url, storage_options=storage_options)
        self.flaky, self.failed = flaky, 0

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if path == self.flaky and not self.failed:
            self.failed += 1
            raise StorageError("the store did not answer", path=path, tier=self.label)
        return super().read_bytes(path, offset, length)

    def read_whole_into(self, path: str, buffer: memoryview) -> None:  # how uncompressed chunks are read
        if path == self.flaky and not self.failed:
            self.failed += 1
            raise StorageError("the store did not answer", path=path, tier=self.label)
        super().read_whole_into(path, buffer)


def test_a_read_the_store_fails_once_is_no_bad_object(tiers, s3_server, s3_bucket, s3_options):
    local, remote = tiers
    path = f"chunks/{_chunk_key(remote, 2, 'trained')}"
    flaky = _FlakyStore(remote.url, s3_options, path)
    stored_before = _objects(s3_server, s3_bucket)
    writes: list[str] = []
    flaky.on_request(lambda request, **_: writes.append(request.url) if request.method == "PUT" else None)
    try:
        report = Scrubber(bytes_per_s=math.inf).scrub_tier(flaky, repair_from=[local])
    finally:
        flaky.close()
    assert flaky.failed == 1 and report.bad == (path,) and report.intact == (path,)
    assert report.repaired == () and report.unrepaired == ()
    assert writes == [], "nothing recorded bad, nothing rewritten"
    assert _objects(s3_server, s3_bucket) == stored_before


def test_a_step_saved_again_during_the_pass_is_never_written_with_the_old_steps_bytes(local_only, tmp_path):
    local = local_only
    source = LocalTier(tmp_path / "copy")  # an intact copy of the first step 2: what a repair would take
    shutil.copytree(local.root / step_dir(2), source.root / step_dir(2))
    data_file, offset, _ = chunk_location(local.root, 2, "trained")
    flip_bit(data_file, offset + 3)
    chunks = len(load_rank_index(local, load_step_manifest(local, 2), 0).chunks)
    asked = []

    def should_stop() -> bool:  # once the pass has read step 2: the trainer deletes it and saves step 2 anew
        asked.append(1)
        if len(asked) == 1 + chunks:
            local.delete_step(2)
            save_local(local.root, {2: model_state(99)})
        return False

    report = Scrubber(bytes_per_s=math.inf).scrub_tier(local, repair_from=[source], steps=[2], should_stop=should_stop)

    assert len(asked) == 1 + chunks and report.bad and report.repaired == ()
    assert "saved again" in dict(report.reasons)[report.unrepaired[0]]
    assert list(verify_step(local, 2)) == [], "the new step 2 is intact"
    restored = {name: torch.zeros_like(tensor) for name, tensor in model_state(99).items()}
    import ckptd
    with ckptd.CheckpointManager(local.root, capture_rng=False) as manager:
        assert manager.restore(restored) == 2
    assert all(torch.equal(restored[name], tensor) for name, tensor in model_state(99).items())
