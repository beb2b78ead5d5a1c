"""What an S3 failure means, from botocore's error codes, HTTP status and exception types.

Every failure of an S3 request reaches the object tier as some exception: a botocore ``ClientError``
(the store answered with an error document), an exception s3fs made from one (with the ``ClientError``
as its cause), or a transport error (no connection, unknown host, timeout, missing credentials).
:func:`classify` turns each into one ckptd error that names the file and tier and says what to do:

=====================================================  =============================================
what the store or the transport said                   ckptd error
=====================================================  =============================================
NoSuchKey, NotFound, HTTP 404                          :class:`~ckptd.errors.NotFoundError`
NoSuchBucket                                           :class:`~ckptd.errors.TierMisconfiguredError`
AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch,
expired or invalid tokens, HTTP 403, no credentials    :class:`~ckptd.errors.TierMisconfiguredError`
PermanentRedirect, AuthorizationHeaderMalformed, 301   :class:`~ckptd.errors.TierMisconfiguredError`
  (the bucket lives in another region)                   naming the region to use
RequestTimeTooSkewed, RequestExpired, or HTTP 403 whose  :class:`~ckptd.errors.TierMisconfiguredError`
  ``Date`` is over 15 min from the signing clock           saying "check the clock", with the offset
PreconditionFailed, HTTP 412                           :class:`~ckptd.errors.AlreadyCommittedError`
no connection, unknown host, connect or read timeout   :class:`~ckptd.errors.TierUnreachableError`
anything else (throttling and 5xx past the retries)    :class:`~ckptd.errors.StorageError`
=====================================================  =============================================

Messages are never parsed: two stores (or two botocore versions) word the same failure differently.
A refusal for clock skew is recognised by its code, or, for a HEAD (whose error answer has no body, so
no code), by comparing the ``Date`` of the store's answer with the clock botocore signs requests with:
botocore does not retry a 403, so a skewed request fails on its first attempt with this error.
botocore is imported only when a failure is classified, so that importing the tier needs no S3 client.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime
import email.utils
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptd.errors import (AlreadyCommittedError, CkptdError, NotFoundError, StorageError, TierMisconfiguredError,
                          TierUnreachableError)

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})
_CREDENTIAL_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AllAccessDisabled", "AccountProblem",
    "InvalidSecurity", "403",
})
_CLOCK_CODES = frozenset({"RequestTimeTooSkewed", "RequestExpired", "RequestInTheFuture"})
#: How far a request's signing time may be from the store's clock (S3 allows 15 minutes).
MAX_CLOCK_SKEW_S = 900.0
_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException",
                           "301", "TemporaryRedirect"})
_CREDENTIALS_HINT = ("check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or key/secret "
                     "in storage_options) and the bucket policy")
RETRY_HINT = ("check the endpoint, credentials and network; CKPTD_S3_RETRIES and CKPTD_S3_READ_TIMEOUT_S raise "
              "the retry budget; nothing was committed by the failed call")


@dataclass(frozen=True)
class S3Failure:
    """What is known about one failed request: the S3 error code and HTTP status (None when the store
    never answered), the exception chain, and the region the store says the bucket is in."""

    code: str | None
    status: int | None
    chain: tuple[BaseException, ...]
    bucket_region: str | None = None
    #: The store's clock when it answered (its ``Date`` header), seconds since the epoch.
    store_time: float | None = None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def inspect(exc: BaseException) -> S3Failure:
    """The S3 error code, HTTP status and bucket region found anywhere in ``exc``'s chain."""
    chain = tuple(_chain(exc))
    for link in chain:
        response = getattr(link, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            error: dict[str, Any] = response["Error"]
            metadata: dict[str, Any] = response.get("ResponseMetadata") or {}
            status = metadata.get("HTTPStatusCode")
            headers = metadata.get("HTTPHeaders") or {}
            region = error.get("Region") or error.get("BucketRegion") or headers.get("x-amz-bucket-region")
            return S3Failure(str(error.get("Code") or "") or None, int(status) if status is not None else None,
                             chain, str(region) if region else None, http_date(headers.get("date")))
    return S3Failure(None, None, chain)


def http_date(value: Any) -> float | None:
    """An HTTP ``Date`` header as seconds since the epoch (None when absent or malformed). HTTP dates are
    UTC: one without a zone (the asctime format, or ``-0000``) is read as UTC, never as local time."""
    try:
        parsed = email.utils.parsedate_to_datetime(str(value)) if value else None
    except (TypeError, ValueError):
        return None
    if parsed is None:
        return None
    return (parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.timezone.utc)).timestamp()


def signing_clock() -> float:
    """Now, on the clock botocore signs requests with (seconds since the epoch)."""
    from botocore import auth

    now = auth.get_current_datetime()  # naive UTC, or aware
    return calendar.timegm(now.utctimetuple()) + now.microsecond / 1e6


def clock_skew_s(failure: S3Failure) -> float | None:
    """How far this machine's signing clock is ahead of the store's (negative: behind), from the store's
    answer; None when the store sent no ``Date``."""
    return None if failure.store_time is None else signing_clock() - failure.store_time


def error_code(exc: BaseException | None) -> str | None:
    """The S3 error code in ``exc``'s chain ("NoSuchKey", "PreconditionFailed", ...), if the store answered."""
    return None if exc is None else inspect(exc).code


def http_status(exc: BaseException | None) -> int | None:
    """The HTTP status of the store's error answer in ``exc``'s chain, if it answered."""
    return None if exc is None else inspect(exc).status


def is_past_the_end(exc: BaseException) -> bool:
    """Whether a ranged GET failed only because its range starts at or past the end (InvalidRange, 416)."""
    failure = inspect(exc)
    return failure.code == "InvalidRange" or failure.status == 416


def is_precondition_failed(exc: BaseException) -> bool:
    """Whether a conditional request was refused because its condition did not hold (412)."""
    failure = inspect(exc)
    return failure.code == "PreconditionFailed" or failure.status == 412


def is_not_implemented(exc: BaseException | None) -> bool:
    """Whether the store does not implement what the request asked (501), e.g. a conditional write."""
    if exc is None:
        return False
    failure = inspect(exc)
    return failure.code == "NotImplemented" or failure.status == 501


def _transport_kind(chain: tuple[BaseException, ...]) -> str | None:
    """"credentials" or "unreachable" when the request never got an answer from the store, else None."""
    from botocore import exceptions as boto

    for link in chain:
        if isinstance(link, (boto.NoCredentialsError, boto.PartialCredentialsError, boto.CredentialRetrievalError,
                             boto.NoAuthTokenError, boto.TokenRetrievalError)):
            return "credentials"
    if chain and (isinstance(chain[0], boto.ResponseStreamingError) or type(chain[0]).__name__ == "ProtocolError"):
        # the store answered and its body broke off (botocore's or urllib3's error for a body read; urllib3's
        # error before an answer reaches here as botocore's ConnectionClosedError): a failure of the store,
        # not of the way to it, as aiohttp's payload errors are on the event-loop clients
        return None
    for link in chain:
        if isinstance(link, (boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ReadTimeoutError,
                             boto.ConnectionClosedError, boto.ProxyConnectionError, socket.gaierror,
                             ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return "unreachable"
        if type(link).__name__ in {"FSTimeoutError", "ServerTimeoutError", "ClientConnectorError"}:
            return "unreachable"
    return None


def classify(exc: BaseException, *, what: str, path: str, tier: str, bucket: str, endpoint: str | None,
             region: str | None, retries: int) -> CkptdError:
    """The ckptd error for a failed S3 request (see the module docstring); the caller chains it."""
    if isinstance(exc, CkptdError):
        return exc
    failure = inspect(exc)
    code, status = failure.code, failure.status
    where = endpoint or "the default AWS endpoint"
    if code == "NoSuchBucket":
        return TierMisconfiguredError(f"bucket {bucket!r} does not exist at {where}", path=path, tier=tier,
                                      hint="create it or fix the URL")
    if code == "PreconditionFailed" or status == 412:
        return AlreadyCommittedError("the object already exists and is never replaced", path=path, tier=tier,
                                     hint="a committed step is immutable; save a new step")
    if code in _REGION_CODES or status == 301:
        actual = failure.bucket_region
        asked = region or "the default region"
        fix = (f"set region_name={actual!r} in storage_options['client_kwargs'] or CKPTD_S3_REGION={actual}"
               if actual else "set the bucket's region in storage_options['client_kwargs']['region_name'] or "
               "CKPTD_S3_REGION")
        return TierMisconfiguredError(f"bucket {bucket!r} is not in region {asked} while {what} ({code})",
                                      path=path, tier=tier, hint=fix)
    skew = clock_skew_s(failure) if code in _CLOCK_CODES or status == 403 else None
    if code in _CLOCK_CODES or (skew is not None and abs(skew) > MAX_CLOCK_SKEW_S):
        offset = "" if skew is None else \
            f"; this machine's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the store's"
        return TierMisconfiguredError(f"the object store at {where} refused a request while {what}: its time is "
                                      f"too far from the store's clock ({code or status}){offset}", path=path,
                                      tier=tier, hint="check the clock (NTP: timedatectl status, chronyc tracking); "
                                      f"the store refuses requests more than {MAX_CLOCK_SKEW_S / 60:.0f} minutes off; "
                                      "nothing was committed by the failed call")
    if code in _CREDENTIAL_CODES or status == 403:
        return TierMisconfiguredError(f"the store refused the credentials while {what} ({code or status})",
                                      path=path, tier=tier, hint=_CREDENTIALS_HINT)
    if code in _NOT_FOUND_CODES or status == 404:
        return NotFoundError("object not found", path=path, tier=tier)
    if code is None and any(isinstance(link, FileNotFoundError) for link in failure.chain):
        return NotFoundError("object not found", path=path, tier=tier)
    kind = None if code is not None else _transport_kind(failure.chain)
    if kind == "credentials":
        return TierMisconfiguredError(f"no credentials for the object store while {what}", path=path, tier=tier,
                                      hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
                                      "key/secret in storage_options")
    if kind == "unreachable":
        return TierUnreachableError(f"the object store at {where} cannot be reached while {what}: "
                                    f"{type(exc).__name__}: {exc}", path=path, tier=tier,
                                    hint="check the endpoint URL, the host name and the network; "
                                    "CKPTD_S3_CONNECT_TIMEOUT_S and CKPTD_S3_RETRIES set the patience")
    answered = f" ({code}, HTTP {status})" if code is not None else ""
    return StorageError(f"{what} failed after the retry budget (s3_retries={retries}){answered}: "
                        f"{type(exc).__name__}: {exc}", path=path, tier=tier, hint=RETRY_HINT)


__all__ = ["MAX_CLOCK_SKEW_S", "RETRY_HINT", "S3Failure", "classify", "clock_skew_s", "error_code", "http_date",
           "http_status", "inspect", "is_not_implemented", "is_past_the_end", "is_precondition_failed",
           "signing_clock"]
