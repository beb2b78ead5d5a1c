"""The object tier's own behaviour against moto's server: where settings come from, multipart uploads
with parallel parts that are aborted on failure, read-ahead, clear errors."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest

from ckptd.config import override
from ckptd.errors import AlreadyCommittedError, ConfigError, NotFoundError, StorageError, TierMisconfiguredError
from ckptd.tiers import open_tier
from ckptd.tiers.object import ObjectTier
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3

_PART = 5 * 1024 * 1024


def _use_test_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_timeouts_and_retries_come_from_settings_and_options_win(s3_options):
    with override(s3_connect_timeout_s=3.0, s3_read_timeout_s=7.0, s3_retries=4, s3_concurrency=3):
        tier = ObjectTier("s3://bucket/prefix", storage_options=s3_options)
        explicit = ObjectTier("s3://bucket", storage_options={**s3_options, "config_kwargs": {"read_timeout": 1}})
    config = tier.lanes[0].config_kwargs
    assert (config["connect_timeout"], config["read_timeout"]) == (3.0, 7.0)
    assert config["retries"] == {"max_attempts": 5, "mode": "standard"} and tier.lanes[0].retries == 1
    assert tier.lanes[0].ckptd_budget().retries == 4, "s3_retries is the budget of one operation"
    assert explicit.lanes[0].config_kwargs["read_timeout"] == 1 and explicit.fs.config_kwargs["read_timeout"] == 1
    assert (tier.bucket, tier.prefix, explicit.prefix) == ("bucket", "prefix", "")


@pytest.mark.parametrize("variable", ["CKPTD_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_and_credentials_from_the_environment(variable, s3_server, s3_bucket, monkeypatch):
    _use_test_credentials(monkeypatch)
    monkeypatch.setenv(variable, s3_server.endpoint_url)
    tier = open_tier(f"s3://{s3_bucket}/env")
    tier.write_bytes("hello.bin", b"from the environment")
    assert tier.read_bytes("hello.bin") == b"from the environment"


def _wrap_calls(tier: ObjectTier, wrapper) -> None:
    """Route every client's S3 calls (data lanes and metadata) through ``wrapper(original, method, ...)``."""
    for lane in [*tier.lanes, tier.fs]:
        lane._call_s3 = functools.partial(wrapper, lane._call_s3)


def _record_calls(tier: ObjectTier) -> list[tuple[str, str | None]]:
    """(method, IfNoneMatch) of every S3 call the tier makes from now on, whichever client makes it."""
    sent: list[tuple[str, str | None]] = []
    tier.on_call(lambda method, params: sent.append((method, params.get("IfNoneMatch"))))
    return sent


def test_multipart_upload_sends_parts_in_parallel(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)
    active, peak = [0], [0]

    async def counting(original, method, *args, **kwargs):
        if method == "upload_part":
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            try:
                await asyncio.sleep(0.05)
                return await original(method, *args, **kwargs)
            finally:
                active[0] -= 1
        return await original(method, *args, **kwargs)

    _wrap_calls(tier, counting)
    data = os.urandom(4 * _PART + 10)
    with override(s3_part_bytes=_PART, s3_concurrency=4):
        tier.write_bytes("big.bin", data)
    assert peak[0] > 1, "parts go up concurrently"
    assert tier.read_bytes("big.bin") == data


def test_a_failed_multipart_upload_is_aborted(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)

    async def failing(original, method, *args, **kwargs):
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            raise ConnectionError("injected: part 2 lost")
        return await original(method, *args, **kwargs)

    _wrap_calls(tier, failing)
    with override(s3_part_bytes=_PART, s3_concurrency=2), pytest.raises(StorageError) as caught:
        tier.write_bytes("chunks/ab/doomed.raw", os.urandom(3 * _PART))
    assert "chunks/ab/doomed.raw" in str(caught.value) and "part 2 lost" in str(caught.value)
    assert tier.incomplete_uploads() == []
    assert not tier.exists("chunks/ab/doomed.raw")


def test_transfers_are_spread_over_the_io_threads(s3_bucket, s3_options):
    with override(s3_io_threads=3, s3_blocking_data=False):  # with it, single PUTs go on the caller's thread
        tier = object_tier(s3_bucket, s3_options)
    assert len({id(lane.loop) for lane in tier.lanes}) == 3
    used = []

    async def recording(original, method, *args, **kwargs):
        if method == "put_object":
            used.append(asyncio.get_running_loop())
        return await original(method, *args, **kwargs)

    _wrap_calls(tier, recording)
    for index in range(6):
        tier.write_bytes(f"chunks/0{index}/x.raw", b"x")
    assert len(set(map(id, used))) == 3


def test_read_ahead_serves_hinted_objects(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)
    payloads = {f"chunks/0{index}/object.raw": os.urandom(1000 + index) for index in range(6)}
    for path, data in payloads.items():
        tier.write_bytes(path, data)
    with override(s3_read_ahead=2):
        tier.read_ahead(list(payloads))
        assert [tier.read_bytes(path) for path in payloads] == list(payloads.values())
        tier.read_ahead(list(payloads)[:2])
        assert tier.read_bytes(list(payloads)[3]) == payloads[list(payloads)[3]], "unhinted reads still work"


def test_errors_name_the_tier_and_say_what_to_do(s3_bucket, s3_options):
    with pytest.raises(ConfigError, match="no bucket"):
        ObjectTier("s3://", storage_options=s3_options)
    missing = ObjectTier("s3://no-such-bucket-here/run", storage_options=s3_options)
    with pytest.raises(TierMisconfiguredError) as caught:
        missing.write_bytes("x.bin", b"x")
    assert "no-such-bucket-here" in str(caught.value) and "create it" in str(caught.value)
    with pytest.raises(TierMisconfiguredError, match="does not exist"):
        missing.committed_steps()
    with pytest.raises(NotFoundError):
        object_tier(s3_bucket, s3_options).read_bytes("step-00000001/absent.json")


def test_if_absent_is_a_conditional_put(s3_bucket, s3_options):
    tier = object_tier(s3_bucket, s3_options)
    sent = _record_calls(tier)
    assert tier.capabilities.conditional_put
    tier.write_bytes("step-00000001/manifest.json", b"one", if_absent=True)
    with pytest.raises(AlreadyCommittedError):
        tier.write_bytes("step-00000001/manifest.json", b"two", if_absent=True)
    assert ("put_object", "*") in sent and ("head_object", None) not in sent[:1]
    assert tier.read_bytes("step-00000001/manifest.json") == b"one"


def test_without_conditional_put_it_looks_up_then_writes(s3_bucket, s3_options):
    with override(s3_conditional_put=False):
        tier = object_tier(s3_bucket, s3_options)
    sent = _record_calls(tier)
    assert not tier.capabilities.conditional_put
    tier.write_bytes("step-00000001/manifest.json", b"one", if_absent=True)
    assert sent[:2] == [("head_object", None), ("put_object", None)]
    with pytest.raises(AlreadyCommittedError):
        tier.write_bytes("step-00000001/manifest.json", b"two", if_absent=True)
    assert tier.read_bytes("step-00000001/manifest.json") == b"one"


def test_a_store_that_refuses_conditional_writes_gets_look_up_then_write(s3_bucket, s3_options, caplog):
    """A store answering 501 NotImplemented to If-None-Match (a fault moto cannot produce: injected)."""
    from botocore.exceptions import ClientError

    tier = object_tier(s3_bucket, s3_options)
    tier.write_bytes("step-00000002/manifest.json", b"taken")

    def no_conditions(method, params):
        if params.get("IfNoneMatch"):
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "A header you provided implies "
                                         "functionality that is not implemented"},
                               "ResponseMetadata": {"HTTPStatusCode": 501}}, method)

    tier.on_call(no_conditions)
    tier.write_bytes("step-00000001/manifest.json", b"one", if_absent=True)
    assert not tier.capabilities.conditional_put and "If-None-Match" in caplog.text
    assert tier.read_bytes("step-00000001/manifest.json") == b"one"
    with pytest.raises(AlreadyCommittedError):
        tier.write_bytes("step-00000002/manifest.json", b"other", if_absent=True)
    assert tier.read_bytes("step-00000002/manifest.json") == b"taken"


def test_aiobotocore_only_config_keeps_every_request_on_the_lanes(s3_bucket, s3_options):
    # botocore's Config refuses aiobotocore's connector_args: the blocking client is not used, and nothing fails
    options = {**s3_options, "config_kwargs": {"connector_args": {"keepalive_timeout": 5}}}
    tier = object_tier(s3_bucket, options)
    try:
        assert tier._blocking is None
        tier.write_bytes("chunks/cc/lanes.raw", b"on the lanes")
        assert tier.read_bytes("chunks/cc/lanes.raw") == b"on the lanes"
    finally:
        tier.close()
    assert object_tier(s3_bucket, s3_options)._blocking is not None, "plain options use the blocking client"


def test_a_restore_from_the_object_tier_reads_each_metadata_file_once_and_looks_nothing_up(tmp_path, s3_bucket,
                                                                                          s3_options):
    # the read-ahead before the restore and the restore share one reader of manifests and indexes, and a
    # metadata read is one bounded GET (no HEAD for its size first): a listing, a manifest, an index, the chunks
    import collections

    import torch

    import ckptd
    from ckptd.promotion import promote_step
    from ckptd.tiers.local import LocalTier

    state = {"big": torch.randn(3 * 1024 * 1024), "small": torch.arange(10)}
    with override(chunk_bytes=4 * 1024 * 1024), ckptd.CheckpointManager(tmp_path / "writer", capture_rng=False) as m:
        m.save(1, state)
    remote = object_tier(s3_bucket, s3_options, prefix="once")
    promote_step(LocalTier(tmp_path / "writer"), remote, 1)
    with ckptd.CheckpointManager(tmp_path / "empty", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as reader:
        calls: list[tuple[str, str]] = []
        reader.remote.on_call(lambda method, params: calls.append((method, str(params.get("Key", "")))))
        target = {"big": torch.zeros(3 * 1024 * 1024), "small": torch.zeros(10, dtype=torch.long)}
        assert reader.restore(target) == 1
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["small"], state["small"])
    counted = collections.Counter(method for method, _ in calls)
    assert "head_object" not in counted, calls
    metadata = [key for method, key in calls if key.endswith(("manifest.json", ".index.json"))]
    assert sorted(metadata) == sorted(set(metadata)) and len(metadata) == 2, metadata


def test_a_metadata_file_past_the_limit_is_refused_naming_it(tmp_path, monkeypatch):
    from ckptd.errors import IntegrityError
    from ckptd.stepio import step_reader
    from ckptd.tiers.local import LocalTier

    from ckptd.format.layout import step_file

    tier = LocalTier(tmp_path, create=True)
    path = step_file(1, "manifest.json")
    tier.write_bytes(path, b"{" + b" " * 200 + b"}")
    monkeypatch.setattr(step_reader, "MAX_METADATA_BYTES", 100)
    with pytest.raises(IntegrityError) as caught:
        step_reader.load_step_manifest(tier, 1)
    assert "implausibly large" in str(caught.value) and "manifest.json" in str(caught.value)
    assert tier.read_bytes(path, 0, 1 << 40) == b"{" + b" " * 200 + b"}", "a bound past the size reads the file"
