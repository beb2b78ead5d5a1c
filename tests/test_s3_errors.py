"""S3 failures are classified by botocore error codes, HTTP status and exception types, never by the
words of a message; each real failure mode (on loopback) becomes the error that says what to do."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError

from ckptd.errors import (AlreadyCommittedError, NotFoundError, StorageError, TierMisconfiguredError,
                          TierUnreachableError)
from harness.broken_s3 import (UNKNOWN_HOST, auth_enforcing_s3, closed_port_options, offline_resolver,
                                     options_without_credentials, unknown_host_options, without_credentials)
from ckptd.tiers import s3_errors
from ckptd.tiers.object import ObjectTier
from time_limit import load_per_core

_HANG_GUARD_S = 15.0  # a hang guard, not a speed claim


def _client_error(code: str, status: int, message: str = "whatever the store says", **extra: Any) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message, **extra},
                        "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": {}}}, "GetObject")


def _classify(exc: BaseException) -> Exception:
    return s3_errors.classify(exc, what="reading", path="step-00000001/manifest.json", tier="object s3://b/run",
                              bucket="b", endpoint="http://127.0.0.1:9", region="us-east-1", retries=5)


def _wrapped(error: BaseException) -> OSError:
    """What s3fs raises: an OSError made from the botocore error, with it as the cause."""
    translated = OSError(5, "translated by s3fs")
    translated.__cause__ = error
    return translated


@pytest.mark.parametrize(("error", "kind"), [
    (_client_error("NoSuchKey", 404), NotFoundError),
    (_client_error("404", 404, "Not Found"), NotFoundError),
    (_client_error("NoSuchBucket", 404), TierMisconfiguredError),
    (_client_error("AccessDenied", 403), TierMisconfiguredError),
    (_client_error("InvalidAccessKeyId", 403), TierMisconfiguredError),
    (_client_error("SignatureDoesNotMatch", 403), TierMisconfiguredError),
    (_client_error("PermanentRedirect", 301), TierMisconfiguredError),
    (_client_error("PreconditionFailed", 412), AlreadyCommittedError),
    (_client_error("InternalError", 500), StorageError),
    (_client_error("SlowDown", 503), StorageError),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), TierUnreachableError),
    (ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"), TierUnreachableError),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), TierUnreachableError),
    (ConnectionRefusedError(111, "Connection refused"), TierUnreachableError),
    (NoCredentialsError(), TierMisconfiguredError),
], ids=lambda value: type(value).__name__ if not isinstance(value, ClientError) else value.response["Error"]["Code"])
def test_each_failure_has_its_error(error: BaseException, kind: type) -> None:
    for raised in (error, _wrapped(error)):
        classified = _classify(raised)
        assert type(classified) is kind, (raised, classified)
        assert "step-00000001/manifest.json" in str(classified) and "s3://b/run" in str(classified)


def test_codes_win_over_the_words_of_messages() -> None:
    misleading = _client_error("NoSuchKey", 404, "The specified bucket does not exist; Credentials denied")
    assert type(_classify(misleading)) is NotFoundError
    plain = _client_error("InternalError", 500, "NoSuchBucket InvalidRange not satisfiable 404")
    assert type(_classify(plain)) is StorageError and not s3_errors.is_past_the_end(plain)
    assert s3_errors.is_past_the_end(_wrapped(_client_error("InvalidRange", 416, "")))


def test_unreachable_and_misconfigured_are_storage_errors_a_caller_can_tell_apart() -> None:
    unreachable = _classify(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    misconfigured = _classify(_client_error("NoSuchBucket", 404))
    assert isinstance(unreachable, StorageError) and isinstance(misconfigured, TierUnreachableError)
    assert "127.0.0.1:9" in str(unreachable) and "create it" in str(misconfigured)


def test_a_wrong_region_names_the_region_to_use() -> None:
    """moto serves every region from one endpoint, so this answer is built as AWS sends it."""
    error = _client_error("AuthorizationHeaderMalformed", 400, "the region 'us-east-1' is wrong; expecting "
                          "'eu-west-1'", Region="eu-west-1")
    classified = _classify(_wrapped(error))
    assert type(classified) is TierMisconfiguredError
    assert "eu-west-1" in str(classified) and "us-east-1" in str(classified) and "region_name" in str(classified)
    answer = {"HTTPStatusCode": 301, "HTTPHeaders": {"x-amz-bucket-region": "ap-south-1"}}
    redirect = ClientError({"Error": {"Code": "PermanentRedirect", "Message": "m"}, "ResponseMetadata": answer},
                           "ListObjectsV2")
    assert "ap-south-1" in str(_classify(redirect))


def _listing_fails(tier: ObjectTier, kind: type) -> Exception:
    started = time.monotonic()
    with pytest.raises(kind) as caught:
        tier.committed_steps()
    assert time.monotonic() - started < _HANG_GUARD_S * load_per_core()
    assert tier.url in str(caught.value)
    return caught.value


def test_closed_port_is_unreachable() -> None:
    tier = ObjectTier("s3://bucket/run", storage_options=closed_port_options())
    try:
        error = _listing_fails(tier, TierUnreachableError)
        assert "cannot be reached" in str(error) and "127.0.0.1" in str(error)
        assert not isinstance(error, TierMisconfiguredError)
    finally:
        tier.close()


def test_unknown_host_is_unreachable() -> None:
    with offline_resolver() as refused:
        tier = ObjectTier("s3://bucket/run", storage_options=unknown_host_options())
        try:
            error = _listing_fails(tier, TierUnreachableError)
            assert UNKNOWN_HOST in str(error) and UNKNOWN_HOST in refused
        finally:
            tier.close()


@pytest.mark.s3
def test_missing_bucket_is_misconfigured(s3_options: dict[str, Any]) -> None:
    tier = ObjectTier("s3://no-such-bucket-anywhere/run", storage_options=s3_options)
    try:
        error = _listing_fails(tier, TierMisconfiguredError)
        assert "no-such-bucket-anywhere" in str(error) and "create it or fix the URL" in str(error)
    finally:
        tier.close()


@pytest.mark.s3
def test_rejected_credentials_are_misconfigured() -> None:
    with auth_enforcing_s3() as server:
        tier = ObjectTier("s3://bucket/run", storage_options=server.storage_options)
        try:
            error = _listing_fails(tier, TierMisconfiguredError)
            assert "InvalidAccessKeyId" in str(error) and "AWS_ACCESS_KEY_ID" in str(error)
        finally:
            tier.close()


@pytest.mark.s3
def test_no_credentials_is_misconfigured(s3_server: Any, tmp_path: Any) -> None:
    with without_credentials(str(tmp_path)):
        tier = ObjectTier("s3://bucket/run", storage_options=options_without_credentials(s3_server.endpoint_url))
        try:
            error = _listing_fails(tier, TierMisconfiguredError)
            assert "no credentials" in str(error)
        finally:
            tier.close()
