"""Where the object tier's connection settings come from, and the s3fs arguments made of them.

First match wins:

- endpoint: ``storage_options["endpoint_url"]`` or ``storage_options["client_kwargs"]["endpoint_url"]``,
  then ``CKPTD_S3_ENDPOINT_URL``, then botocore's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``;
- region: ``client_kwargs["region_name"]``, then ``CKPTD_S3_REGION``, then ``AWS_REGION`` / AWS config;
- credentials: ``key``/``secret``/``token`` (or ``profile``) in the options, otherwise botocore's chain
  (environment, ``~/.aws/credentials``, instance roles).

Two kinds of client are made from one set of options. Data clients (uploads, chunk reads) get
``s3_connect_timeout_s``, ``s3_read_timeout_s`` and a budget of ``s3_retries`` per operation: a transfer
that has started should ride out a slow or flaky store, but a dead endpoint is known in seconds. The
metadata client (listings, HEAD, deletes) gets the short ``s3_metadata_connect_timeout_s`` and
``s3_metadata_read_timeout_s`` and few ``s3_metadata_retries``, so that a store that cannot be reached or
does not answer is known within seconds and a restore moves on to the tiers that answer. Timeouts or
retries the caller puts in ``config_kwargs`` win over both. Data clients do not check the CRC32 a store
returns with a GET (``response_checksum_validation="when_required"``): ckptd verifies every chunk's
xxh3-128 after reading it, and botocore's check costs restore CPU on every byte. Retries are botocore's
(``standard`` mode: jittered exponential back-off); :func:`retry_budget` bounds them per operation
(:mod:`ckptd.tiers.s3_budget`), and s3fs adds none of its own.
"""

from __future__ import annotations

import os
from typing import Any

from ckptd.config import settings
from ckptd.errors import ConfigError
from ckptd.tiers.s3_budget import OperationBudget


def split_url(url: str) -> tuple[str, str]:
    """Bucket and prefix (no slashes at either end) of an ``s3://bucket/prefix`` URL."""
    if not url.startswith("s3://"):
        raise ConfigError(f"{url!r} is not an s3:// URL", hint="name the object tier as s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ConfigError(f"{url!r} names no bucket", hint="name the object tier as s3://bucket/prefix")
    return bucket, prefix.strip("/")


def s3fs_options(options: dict[str, Any] | None, *, metadata: bool = False) -> dict[str, Any]:
    """s3fs arguments: the caller's options plus ckptd's endpoint and region defaults, and the timeouts and
    retries of a data client (or, with ``metadata=True``, of the metadata client)."""
    tunables = settings()
    merged = dict(options or {})
    client_kwargs = dict(merged.pop("client_kwargs", None) or {})
    endpoint = merged.pop("endpoint_url", None) or client_kwargs.get("endpoint_url") \
        or os.environ.get("CKPTD_S3_ENDPOINT_URL")
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = client_kwargs.get("region_name") or os.environ.get("CKPTD_S3_REGION")
    if region:
        client_kwargs["region_name"] = region
    config_kwargs = dict(merged.pop("config_kwargs", None) or {})
    if metadata:
        connect, read = tunables.s3_metadata_connect_timeout_s, tunables.s3_metadata_read_timeout_s
        attempts = tunables.s3_metadata_retries
    else:
        connect, read, attempts = tunables.s3_connect_timeout_s, tunables.s3_read_timeout_s, 1 + tunables.s3_retries
    config_kwargs.setdefault("connect_timeout", connect)
    config_kwargs.setdefault("read_timeout", read)
    config_kwargs.setdefault("retries", {"max_attempts": max(1, attempts), "mode": "standard"})
    config_kwargs.setdefault("max_pool_connections", max(10, 2 * tunables.s3_concurrency))
    if not metadata:  # ckptd verifies every chunk's xxh3-128; botocore's CRC32 of each GET, in Python, is waste
        config_kwargs.setdefault("response_checksum_validation", "when_required")
    if not tunables.s3_upload_checksum.strip():  # a store that refuses checksum headers: send none
        config_kwargs.setdefault("request_checksum_calculation", "when_required")
    merged.setdefault("max_concurrency", max(1, tunables.s3_concurrency))
    merged.update(client_kwargs=client_kwargs, config_kwargs=config_kwargs, skip_instance_cache=True,
                  use_listings_cache=False)
    return merged


def s3fs_retries(*, metadata: bool = False) -> int:
    """Attempts s3fs itself makes of a call: one, since botocore retries within the operation's budget."""
    return 1


def retry_budget(*, metadata: bool = False) -> OperationBudget:
    """A fresh budget for one operation of a data client (or, with ``metadata=True``, the metadata one)."""
    tunables = settings()
    retries = max(0, tunables.s3_metadata_retries - 1) if metadata else max(0, tunables.s3_retries)
    return OperationBudget(retries=retries, connect_retries=min(retries, max(0, tunables.s3_connect_retries)))


def endpoint_of(options: dict[str, Any]) -> str | None:
    """The endpoint URL s3fs arguments name, or botocore's environment default (None: AWS)."""
    return (options.get("client_kwargs") or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") \
        or os.environ.get("AWS_ENDPOINT_URL")


def region_of(options: dict[str, Any]) -> str | None:
    """The region s3fs arguments name, or the environment's (None: botocore's configuration decides)."""
    return (options.get("client_kwargs") or {}).get("region_name") or os.environ.get("AWS_REGION") \
        or os.environ.get("AWS_DEFAULT_REGION")


__all__ = ["endpoint_of", "region_of", "retry_budget", "s3fs_options", "s3fs_retries", "split_url"]
