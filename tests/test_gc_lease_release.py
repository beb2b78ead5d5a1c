"""A GC lease whose removal failed (503 on its DeleteObjects for the whole of the client's retries, soak
finding F2) blocks neither its own process nor, once the store heals, anyone else's promotions: its
owner's next collection takes it over, and the release is retried in the background."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from ckptd.config import override
from ckptd.policy import KeepLatest
from ckptd.promotion import collect_garbage, promote_step
from ckptd.promotion.lease import LEASE_PATH, lease_is_fresh, release_pending
from ckptd.stepio.step_reader import verify_step
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.tiers.object import ObjectTier
from test_promotion_support import model_state, object_tier, save_local

pytestmark = pytest.mark.s3


def _deletes_the_lease(method: str, path: str, body: bytes) -> bool:
    return method == "POST" and "delete" in path and LEASE_PATH.encode() in body


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultProxy]:
    """A proxy answering 503 to every DeleteObjects of the lease while its ``fraction`` is 1."""
    with FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("503",), target=_deletes_the_lease) as running:
        yield running


def _tiers(s3_bucket, s3_options, proxy: FaultProxy, prefix: str) -> tuple[ObjectTier, ObjectTier]:
    """(the tier through the proxy, the same prefix reached directly)."""
    return (object_tier(s3_bucket, proxy.storage_options(s3_options), prefix),
            object_tier(s3_bucket, s3_options, prefix))


def _lease_body(tier: ObjectTier) -> dict[str, object]:
    return json.loads(tier.read_bytes(LEASE_PATH))


def _wait_until(condition, limit_s: float = 60.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_collector_that_could_not_remove_its_lease_takes_it_over_and_releases_it_once_s3_heals(
        tmp_path, s3_bucket, s3_options, proxy):
    local = save_local(tmp_path / "local", {step: model_state(step) for step in (1, 2, 3)})
    faulty, direct = _tiers(s3_bucket, s3_options, proxy, "f2")
    promote_step(local, faulty, 1)
    promote_step(local, faulty, 2)

    report = collect_garbage(faulty, retention=KeepLatest(1))  # the release gets 503s: not an error
    assert report.deleted_steps == (1,) and proxy.counts["503"] >= 1
    first = _lease_body(direct)
    assert first["token"] and release_pending(faulty), "the lease is left behind, its release owed"
    assert not lease_is_fresh(faulty), "its own process knows that collection ended"
    promote_step(local, faulty, 3)  # so its own promotions do not wait for it

    second = collect_garbage(faulty, retention=KeepLatest(1))  # its own lease: taken over, no LockedError
    assert second.deleted_steps == (2,) and direct.committed_steps() == [3]
    assert _lease_body(direct)["token"] != first["token"], "the second collection wrote a lease of its own"
    assert direct.exists(LEASE_PATH), "the window is still open: other processes still see a lease"

    proxy.fraction = 0.0  # the store heals
    assert _wait_until(lambda: not direct.exists(LEASE_PATH)), "the owed release was retried once S3 healed"
    assert _wait_until(lambda: not release_pending(faulty))
    assert list(verify_step(direct, 3)) == [], "the kept step is intact"


def test_the_background_release_never_deletes_a_lease_another_collector_took_since(
        tmp_path, s3_bucket, s3_options, proxy):
    local = save_local(tmp_path / "local", {1: model_state(1)})
    faulty, direct = _tiers(s3_bucket, s3_options, proxy, "other")
    promote_step(local, faulty, 1)
    collect_garbage(faulty, retention=KeepLatest(1))
    assert release_pending(faulty)
    # past our lease's expiry a collector elsewhere took the tier: its lease must survive our retry
    theirs = {"owner": "pid 1 on elsewhere", "host": "elsewhere", "pid": 1, "created": time.time(), "token": "theirs"}
    direct.write_bytes(LEASE_PATH, json.dumps(theirs).encode())
    # Deletes still fail until the retry has seen the new lease: a retry that read our lease just before it
    # was replaced cannot then delete theirs (read-then-delete is not atomic; in use another collector takes
    # the lease only once ours expired, when the retry has stopped: test_an_owed_release_gives_up...).
    assert _wait_until(lambda: not release_pending(faulty)), "the retry stops"
    proxy.fraction = 0.0
    assert _lease_body(direct) == theirs, "another collector's lease is left alone"
    assert lease_is_fresh(faulty), "and it holds this process's promoters back"


def test_an_owed_release_gives_up_when_the_lease_expires(tmp_path, s3_bucket, s3_options, proxy):
    local = save_local(tmp_path / "local", {1: model_state(1)})
    faulty, direct = _tiers(s3_bucket, s3_options, proxy, "expired")
    promote_step(local, faulty, 1)
    with override(gc_lease_s=0.5):
        collect_garbage(faulty, retention=KeepLatest(1))
        assert _wait_until(lambda: not release_pending(faulty)), "an expired lease is no longer chased"
    assert direct.exists(LEASE_PATH), "the store never healed: the lease stays, expired, for anyone to take"
