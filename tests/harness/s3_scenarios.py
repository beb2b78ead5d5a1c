"""Helpers for the fault-matrix rows about the object tier: what is stored, seen behind ckptd's back.

The rows (``tests/matrix/rows_s3.py``, ``rows_concurrency.py``) save steps locally through the real
manager, promote them through a :class:`~ckptd.testing.fault_proxy.FaultProxy` in front of moto's server,
and then look at the bucket with a plain boto3 client (:func:`stored_keys`, :func:`open_uploads`), so that
a key ckptd's own listing would hide (a partial object, a stray multipart upload) is still seen.

:func:`promote_when_released` is a :class:`~harness.crash.CrashInjector` target: a second process that
promotes a step the moment a start file appears, so that two promoters race on one step for real.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.config import override
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.tiers.upload_owners import OWNERS_PREFIX


@functools.lru_cache(maxsize=8)
def s3_client(endpoint_url: str) -> Any:
    """A plain boto3 client on a loopback endpoint (moto's credentials), for looking behind ckptd's back
    (one per endpoint and process: boto3 clients are thread-safe, and making one costs more than a request)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _bucket_and_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def stored_keys(endpoint_url: str, url: str) -> dict[str, int]:
    """Key (relative to the prefix of ``url``) -> size of every object under it, from boto3's listing."""
    bucket, prefix = _bucket_and_prefix(url)
    client = s3_client(endpoint_url)
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix) + 1 if prefix else 0:]] = int(item["Size"])
    return found


def open_uploads(endpoint_url: str, url: str) -> list[str]:
    """Keys of the multipart uploads under ``url`` that were started and neither completed nor aborted."""
    bucket, prefix = _bucket_and_prefix(url)
    answer = s3_client(endpoint_url).list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return [upload["Key"] for upload in answer.get("Uploads", [])]


def expected_keys(tier: Any, steps: list[int]) -> dict[str, int]:
    """Key -> size of everything the committed ``steps`` of an object tier reference: manifest, rank
    indexes, packs and content-addressed chunks (read through ckptd's manifests)."""
    from ckptd.promotion.contents import pack_path, read_step_contents

    wanted: dict[str, int] = {}
    for step in steps:
        contents = read_step_contents(tier, step)
        wanted[f"{step_dir(step)}/{MANIFEST_NAME}"] = len(contents.manifest_bytes)
        for share in contents.shares:
            wanted[f"{step_dir(step)}/{share.index_name}"] = len(share.index_bytes)
        for share, number in contents.packs():
            wanted[pack_path(share, number)] = share.index.data_files[number].size
        for key, (_, chunk) in contents.unique_chunks().items():
            wanted[tier.chunk_path(key)] = chunk.length
    return wanted


@dataclass(frozen=True)
class BucketFindings:
    """What a boto3 look at a prefix found beyond (or short of) what its committed steps reference."""

    stray: dict[str, int]
    wrong_size: dict[str, tuple[int, int]]
    missing: list[str]
    uploads: list[str]
    owner_records: list[str]

    @property
    def clean(self) -> bool:
        """No stray or partial key, none missing, no multipart upload left open."""
        return not (self.stray or self.wrong_size or self.missing or self.uploads)

    def describe(self) -> str:
        parts = [f"{what}: {value}" for what, value in (
            ("keys no committed step references", sorted(self.stray)[:5]), ("keys of the wrong size", self.wrong_size),
            ("referenced keys missing", self.missing[:5]), ("open multipart uploads", self.uploads)) if value]
        return "; ".join(parts) or "bucket clean"


def look_behind(endpoint_url: str, url: str, tier: Any, *, allowed_prefixes: tuple[str, ...] = ()) -> BucketFindings:
    """Compare the bucket under ``url`` (boto3) with what ``tier``'s committed steps reference. Upload owner
    records are listed apart (they are bookkeeping that GC removes, never data); keys under
    ``allowed_prefixes`` are ignored."""
    listed = stored_keys(endpoint_url, url)
    wanted = expected_keys(tier, tier.committed_steps())
    owners = sorted(key for key in listed if key.startswith(f"{OWNERS_PREFIX}/"))
    stray = {key: size for key, size in listed.items() if key not in wanted and key not in owners
             and not key.startswith(allowed_prefixes or ("\0",))}
    wrong = {key: (listed[key], size) for key, size in wanted.items() if key in listed and listed[key] != size}
    missing = sorted(key for key in wanted if key not in listed)
    return BucketFindings(stray, wrong, missing, open_uploads(endpoint_url, url), owners)


def save_steps_locally(directory: str | os.PathLike[str], workload: Any, steps: list[int],
                       **settings: Any) -> None:
    """Save ``workload.state(step)`` for each step to a local tier through the real manager (no object
    tier), everything kept, then close it."""
    from ckptd.manager.manager import CheckpointManager
    from ckptd.policy import Policy

    with override(**settings), CheckpointManager(directory, capture_rng=False, policy=Policy(keep_local=None),
                                                 daemon="off") as manager:
        for step in steps:
            manager.save(step, workload.state(step), force=True)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def warnings_logged(logger: str = "ckptd") -> Iterator[list[logging.LogRecord]]:
    """Collect the WARNING (and worse) records ``logger`` and its children emit in the block."""
    handler = _Records()
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield handler.records
    finally:
        target.removeHandler(handler)


@contextmanager
def blackhole_endpoint() -> Iterator[str]:
    """An ``http://127.0.0.1:PORT`` endpoint that never accepts a connection: a listening socket whose
    accept queue (backlog 0) is already filled by one connection nobody accepts, so the kernel drops every
    new SYN and a client's connect times out (no root, no firewall rule)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        filler.close()
        listener.close()


def promote_when_released(channel: Any, local: str, url: str, storage_options: dict[str, Any], step: int,
                          start_file: str, settings: dict[str, Any] | None = None) -> str:
    """Crash-injector target: once connected, create ``<start_file>.ready-<pid>``, wait (at most 60 s) for
    ``start_file``, then promote ``step`` of ``local`` to ``url``. Returns ``"committed"``,
    ``"already committed"`` or ``"<ErrorType>: <message>"``."""
    from ckptd.errors import CkptdError
    from ckptd.promotion.promoter import promote_step
    from ckptd.tiers.local import LocalTier
    from ckptd.tiers.object import ObjectTier

    with override(**(settings or {})):
        remote = ObjectTier(url, storage_options=storage_options)
        remote.connect()
        source = LocalTier(local, create=False)
        channel.ready()
        Path(f"{start_file}.ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 60.0
        while not Path(start_file).exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            report = promote_step(source, remote, step)
        except CkptdError as error:
            return f"{type(error).__name__}: {error}"
        finally:
            remote.close()
    return "already committed" if report.already_committed else "committed"


def release_racers(start_file: str | os.PathLike[str], count: int, timeout_s: float = 60.0) -> bool:
    """Wait until ``count`` :func:`promote_when_released` children are ready, then let them all go at once;
    False when they were not all ready in time (they are released anyway)."""
    start = Path(start_file)
    deadline = time.monotonic() + timeout_s
    ready = False
    while time.monotonic() < deadline:
        if len(list(start.parent.glob(f"{start.name}.ready-*"))) >= count:
            ready = True
            break
        time.sleep(0.005)
    start.touch()
    return ready


__all__ = ["BucketFindings", "blackhole_endpoint", "expected_keys", "look_behind", "open_uploads",
           "promote_when_released", "release_racers", "s3_client", "save_steps_locally", "stored_keys",
           "warnings_logged"]
