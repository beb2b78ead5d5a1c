"""Fail fast: one retry budget per object-tier operation, short connect timeouts.

Requests are counted where they leave the client (botocore's ``before-send`` event) and where they
reach the store (the fault proxy). A multipart upload or a large ranged read spends one budget across
all its requests; a closed port is given up after ``1 + s3_connect_retries`` connection attempts."""

from __future__ import annotations

import os
import time

import pytest

from ckptd.config import override
from ckptd.errors import StorageError, TierUnreachableError
from harness.broken_s3 import closed_port_options
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.tiers.object import ObjectTier

pytestmark = pytest.mark.s3
_PART = 5 * 1024 * 1024
_FAST = {"s3_backoff_base_s": 0.01, "s3_backoff_max_s": 0.05, "s3_part_bytes": _PART, "s3_concurrency": 4}


def _count_sends(tier: ObjectTier) -> list[str]:
    """Every HTTP request any of the tier's clients sends from now on (operation names)."""
    sent: list[str] = []
    tier.on_request(lambda request, **_: sent.append(request.method))
    return sent


def test_a_closed_port_is_given_up_after_one_connection_retry():
    with override(**_FAST, s3_retries=6, s3_connect_retries=1, s3_connect_timeout_s=1.0,
                  s3_metadata_retries=3):
        tier = ObjectTier("s3://bucket/run", storage_options=closed_port_options())
        try:
            sent = _count_sends(tier)
            started = time.monotonic()
            with pytest.raises(TierUnreachableError, match="cannot be reached while uploading"):
                tier.write_bytes("chunks/aa/big.raw", os.urandom(3 * _PART))
            assert len(sent) == 2, f"one attempt and one connection retry, not {len(sent)}"
            sent.clear()
            with pytest.raises(TierUnreachableError, match="cannot be reached while reading"):
                tier.read_bytes("chunks/aa/big.raw")
            assert len(sent) == 2
            sent.clear()
            with pytest.raises(TierUnreachableError, match="cannot be reached while listing"):
                tier.committed_steps()
            assert len(sent) == 2
            print(f"closed port: three operations given up in {time.monotonic() - started:.2f}s")
        finally:
            tier.close()


def test_a_failing_upload_sends_one_attempt_plus_the_budget(s3_server, s3_bucket, s3_options):
    parts, retries = 4, 3
    data = os.urandom(parts * _PART)
    with override(**_FAST, s3_retries=retries), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",)) as proxy:
        tier = ObjectTier(f"s3://{s3_bucket}/run", storage_options=proxy.storage_options(s3_options))
        try:
            with pytest.raises(StorageError, match=f"s3_retries={retries}"):
                tier.write_bytes("chunks/aa/big.raw", data)
            assert proxy.counts["requests"] == 1 + retries, f"botocore x s3fs would send 25: {proxy.counts}"
        finally:
            tier.close()


def test_an_operation_that_meets_some_faults_still_completes_within_its_budget(s3_server, s3_bucket, s3_options):
    parts, retries = 4, 8
    data = os.urandom(parts * _PART)
    with override(**_FAST, s3_retries=retries), \
            FaultProxy(s3_server.endpoint_url, fraction=0.25, kinds=("500", "503"), seed=3) as proxy:
        tier = ObjectTier(f"s3://{s3_bucket}/run", storage_options=proxy.storage_options(s3_options))
        try:
            before = proxy.counts["requests"]
            tier.write_bytes("chunks/aa/big.raw", data)
            upload_requests = proxy.counts["requests"] - before
            assert upload_requests <= parts + 4 + retries, "record, create, parts, complete, record deleted, " \
                "plus at most the budget"
            before = proxy.counts["requests"]
            assert tier.read_bytes("chunks/aa/big.raw") == data
            read_requests = proxy.counts["requests"] - before
            assert read_requests <= parts + retries, "one GET per range, plus at most the budget"
            assert proxy.faults_injected > 0, "the proxy injected faults"
        finally:
            tier.close()


@pytest.mark.parametrize("seed", [1, 2, 5])
def test_parts_that_fail_together_never_exceed_the_operation_budget(seed, s3_server, s3_bucket, s3_options):
    parts, retries = 4, 2
    data = os.urandom(parts * _PART)
    with override(**_FAST, s3_retries=retries), \
            FaultProxy(s3_server.endpoint_url, fraction=0.5, kinds=("500", "503"), seed=seed) as proxy:
        tier = ObjectTier(f"s3://{s3_bucket}/run", storage_options=proxy.storage_options(s3_options))
        try:
            try:
                tier.write_bytes("chunks/aa/big.raw", data)
                stored = True
            except StorageError:
                stored = False
            # owner record, create, 4 parts, complete or abort, record deleted: 8 distinct requests, plus at
            # most the budget (and, when it failed, the abort's own: cleanup is never starved)
            bound = 1 + parts + 2 + 1 + retries + (0 if stored else retries)
            assert proxy.counts["requests"] <= bound, proxy.counts
        finally:
            tier.close()
    direct = ObjectTier(f"s3://{s3_bucket}/run", storage_options=s3_options)
    try:
        if stored:
            assert direct.read_bytes("chunks/aa/big.raw") == data
        else:
            assert not direct.exists("chunks/aa/big.raw"), "a failed upload leaves no object"
    finally:
        direct.close()


def test_a_store_that_never_answers_costs_one_read_timeout_per_attempt_of_the_budget(s3_server, s3_bucket,
                                                                                      s3_options):
    with override(**_FAST, s3_retries=2, s3_connect_retries=1, s3_read_timeout_s=0.5), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("stall",), stall_s=2.0) as proxy:
        tier = ObjectTier(f"s3://{s3_bucket}/run", storage_options=proxy.storage_options(s3_options))
        try:
            with pytest.raises(TierUnreachableError, match="cannot be reached while uploading"):
                tier.write_bytes("chunks/aa/small.raw", b"x" * 1000)
            assert proxy.counts["requests"] == 3, f"one attempt and the budget's two retries: {proxy.counts}"
        finally:
            tier.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking-client", "lanes"])
def test_a_read_longer_than_a_part_spends_one_budget_whichever_client_reads(s3_server, s3_bucket, s3_options,
                                                                             blocking: bool) -> None:
    # the blocking client reads the first part, the lanes the rest: both spend from the read's one budget
    import itertools
    import threading

    data = os.urandom(2 * _PART)
    with override(s3_part_bytes=_PART):
        writer = ObjectTier(f"s3://{s3_bucket}/one-budget", storage_options=s3_options)
        writer.write_bytes("chunks/aa/two-parts.raw", data)
        writer.close()
    counter, lock = itertools.count(1), threading.Lock()

    def failing_gets(method: str, path: str, body: bytes) -> bool:
        if method != "GET":
            return False
        with lock:
            return next(counter) in (1, 2, 4, 5)  # two failures on each part: four retries in all

    with override(**_FAST, s3_retries=2, s3_blocking_data=blocking), \
            FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("500",), target=failing_gets) as proxy:
        tier = ObjectTier(f"s3://{s3_bucket}/one-budget", storage_options=proxy.storage_options(s3_options))
        try:
            with pytest.raises(StorageError):
                tier.read_bytes("chunks/aa/two-parts.raw")
            assert proxy.faults_injected <= 3, "the read spent more than its budget of 2 retries"
        finally:
            tier.close()
