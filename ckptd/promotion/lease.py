"""The GC lease: how a garbage collector and promoters on other processes avoid deleting a chunk that a
step being promoted right now is about to reference.

Protocol (S3 is strongly consistent for PUT, GET and LIST):

- a promoter first uploads its rank indexes (the step's *in-flight marker*), then checks for a fresh
  lease and waits while one exists, and only then decides which chunks are already stored;
- the collector first writes the lease, then lists chunk objects and reads every retained manifest and
  every in-flight index, then deletes unreferenced chunks, then removes the lease.

Either the collector's lease is visible to the promoter (which waits), or the promoter's marker was
written before the lease and is therefore seen by the collector's mark phase. A lease older than
``gc_lease_s`` (on the store's clock, see :func:`_lease_age`) belongs to a crashed collector and is
ignored; so is a lease whose owner ran on this host and is no longer alive (a collector killed with
SIGKILL must not hold up the restarted job's uploads).
The host is :func:`ckptd.tiers.upload_owners.this_host` (``CKPTD_HOST_ID`` or the host name), the same
identity that multipart uploads' owner records carry.

A collection that cannot remove its lease (the store answers 503 for the whole of its retries) leaves a
lease whose collection has ended. Its own process knows: each lease carries a token, and one naming this
process with a token of no collection running here is ignored by this process's promoters and taken over
by its next collection at once. Other processes cannot tell, so the release is retried in the background
(backing off to ``_RETRY_MAX_S``) until the lease is gone, replaced by another collection's, or expired;
promoters elsewhere wait only until the store heals, not for the lease's whole ``gc_lease_s``.

**The step owner lease** (:func:`step_owner_lease`) is the other direction: a promoter holds it on the step
it promotes, from before its first object of the step is written until the step is committed or the
promotion gave up. It is an owner record (:class:`~ckptd.tiers.upload_owners.UploadOwner`, the multipart
uploads' format) at ``step-owners/<step dir>/<host>-<pid>-<nonce>.json``, rewritten every third of
``s3_upload_owner_lease_s`` by a :class:`~ckptd.background.BackgroundWorker`, deleted at the end. A collector
never takes a step with a live owner for abandoned (:func:`live_step_owners`, judged on the store's clock
like the uploads' records: fresh, and on this host its process alive), however old its objects, so it
neither deletes its directory nor sweeps the chunks its rank indexes name. Because the record is written
before anything of the step, a collector that lists the step's directory finds its record too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptd.background import BackgroundWorker, start_thread
from ckptd.config import settings
from ckptd.errors import CkptdError, DeadlineError, LockedError, NotFoundError, StillRunningError
from ckptd.format.layout import step_dir
from ckptd.tiers.base import StorageTier
from ckptd.tiers.upload_owners import UploadOwner, process_exists, process_start, this_host

#: Object holding the lease, at the tier root (outside every step directory).
LEASE_PATH = "gc.lease"
#: Directory (at the tier root) of the owner records of steps being promoted.
STEP_OWNERS_PREFIX = "step-owners"
_OWNER_STOP_S = 10.0
_POLL_S = 0.2
_LOG_S = 10.0
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0
#: A lease older than this fraction of ``gc_lease_s`` is no longer released in the background: past its
#: expiry another collector may take the tier, and its lease must not be deleted in its place.
_RETRY_UNTIL = 0.9
log = logging.getLogger("ckptd.promotion")


@dataclass
class _PendingRelease:
    """A lease of this process whose collection ended but whose object could not be deleted."""

    token: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False


_state_lock = threading.Lock()
_running: set[str] = set()  # tokens of the collections running in this process
_pending: dict[str, _PendingRelease] = {}  # by tier label


def _ended_here(body: dict[str, object]) -> bool:
    """Whether the lease was taken by this process for a collection that is no longer running."""
    if body.get("host") != this_host() or body.get("pid") != os.getpid():
        return False
    with _state_lock:
        return body.get("token") not in _running


def _owner_is_dead(body: dict[str, object]) -> bool:
    """Whether the lease's owner ran on this host and has exited (a pid reused since by another process
    counts as exited when the lease names its owner's start; in older leases it counts as alive)."""
    if body.get("host") != this_host() or not isinstance(body.get("pid"), int):
        return False
    return not process_exists(int(body["pid"]), str(body.get("started") or ""))  # type: ignore[call-overload]


def _lease_age(tier: StorageTier) -> float | None:
    """Seconds since the current lease was taken, or None when there is none, or its owner is dead.

    The age is the tier's (:meth:`~ckptd.tiers.StorageTier.age_s`: the store's clock now minus the lease
    object's last-modified time, both stamped by the store), so that a collector whose clock runs behind
    does not write a lease that a promoter takes for expired while the collection runs; the ``created``
    stamp (the collector's clock) counts only where the tier cannot tell."""
    try:
        body = json.loads(tier.read_bytes(LEASE_PATH))
        if _owner_is_dead(body) or _ended_here(body):
            return None
        age = tier.age_s(LEASE_PATH)
        if age is None:
            age = time.time() - float(body["created"])
        return max(0.0, age)
    except NotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return 0.0  # mangled: treat as fresh; delete it by hand if no collector runs


def lease_is_fresh(tier: StorageTier) -> bool:
    """Whether a collector holds a lease that has not expired."""
    age = _lease_age(tier)
    return age is not None and age < settings().gc_lease_s


def wait_for_collector(tier: StorageTier) -> float:
    """Block while a fresh GC lease exists, at most ``gc_lease_s`` (a lease lives no longer; a mangled one
    stays "fresh": DeadlineError), logging the wait; returns the seconds waited."""
    started = logged = time.monotonic()
    limit = settings().gc_lease_s
    while lease_is_fresh(tier):
        now = time.monotonic()
        if now - started >= limit:
            raise DeadlineError(f"a garbage collection's lease stayed fresh for {limit:g} s", path=LEASE_PATH,
                                tier=tier.label, hint=f"delete {LEASE_PATH} if no collector runs (it may be "
                                "mangled), then promote again")
        if now - logged >= _LOG_S:
            logged = now
            log.info("waiting for a garbage collection on %s to finish before promoting (%.0f s so far)",
                     tier.label, now - started)
        time.sleep(_POLL_S)
    return time.monotonic() - started


@contextlib.contextmanager
def gc_lease(tier: StorageTier) -> Iterator[None]:
    """Hold the GC lease of a tier; raises LockedError when another collector holds a fresh one.

    A lease this process left behind (its release failed) is taken over. When the release at the end
    fails, the collection still ends normally: the release is retried in the background (see the module
    docstring; :func:`release_pending` says whether one is still owed)."""
    if lease_is_fresh(tier):
        raise LockedError("another garbage collection is running on this tier", path=LEASE_PATH,
                          tier=tier.label, hint=f"wait for it, or delete {LEASE_PATH} if it crashed")
    token = uuid.uuid4().hex
    body = {"owner": f"pid {os.getpid()} on {this_host()}", "host": this_host(), "pid": os.getpid(),
            "started": process_start(os.getpid()), "created": time.time(), "token": token}
    with _state_lock:
        _running.add(token)
        earlier = _pending.pop(tier.label, None)
    try:
        if earlier is not None:
            with earlier.lock:  # a background release in progress finishes before the lease is rewritten
                earlier.cancelled = True
        tier.write_bytes(LEASE_PATH, json.dumps(body).encode())
        yield
    finally:
        with _state_lock:
            _running.discard(token)
        _release(tier, token)


def release_pending(tier: StorageTier) -> bool:
    """Whether a lease of this process on ``tier`` is still being released in the background."""
    with _state_lock:
        return tier.label in _pending


def _release(tier: StorageTier, token: str) -> None:
    try:
        tier.delete_files([LEASE_PATH])
    except CkptdError as error:
        log.warning("could not remove the GC lease %s on %s (retrying in the background; until then other "
                    "processes' promotions wait for it): %s", LEASE_PATH, tier.label, error)
        pending = _PendingRelease(token)
        with _state_lock:
            _pending[tier.label] = pending
        start_thread("ckptd-gc-lease-release", _retry_release, tier, pending)


def _retry_release(tier: StorageTier, pending: _PendingRelease) -> None:
    delay = _RETRY_FIRST_S
    try:
        while True:
            time.sleep(delay)
            delay = min(2 * delay, _RETRY_MAX_S)
            with pending.lock:
                if pending.cancelled or _release_once(tier, pending.token):
                    return
    finally:
        with _state_lock:
            if _pending.get(tier.label) is pending:
                del _pending[tier.label]


def _release_once(tier: StorageTier, token: str) -> bool:
    """One attempt to delete this collection's lease; True when nothing is left to do."""
    try:
        body = json.loads(tier.read_bytes(LEASE_PATH))
        if not isinstance(body, dict) or body.get("token") != token:
            return True  # gone, or another collection's
        age = tier.age_s(LEASE_PATH)
        if age is None:
            age = time.time() - float(body["created"])
        if age >= _RETRY_UNTIL * settings().gc_lease_s:
            log.warning("gave up removing the GC lease on %s: it expires now (%s can go)", tier.label, LEASE_PATH)
            return True
        tier.delete_files([LEASE_PATH])
    except (NotFoundError, ValueError, KeyError, TypeError):
        return True  # gone, or not the lease this process wrote
    except CkptdError as error:
        log.debug("removing the GC lease on %s failed again: %s", tier.label, error)
        return False
    log.info("removed the GC lease %s on %s that an earlier attempt could not", LEASE_PATH, tier.label)
    return True


# --- the step owner lease ------------------------------------------------------------------------------
def _step_owners_directory(step: int) -> str:
    return f"{STEP_OWNERS_PREFIX}/{step_dir(step)}"


@contextlib.contextmanager
def step_owner_lease(tier: StorageTier, step: int) -> Iterator[None]:
    """Hold the owner lease of ``step`` on ``tier`` while the block runs (see the module docstring); a tier
    without content-addressed chunks (no collector sweeps it) needs none. Failing to write the record
    raises the tier's error before anything of the step is written."""
    if not tier.capabilities.chunks_by_digest:
        yield
        return
    host = "".join(char if char.isalnum() or char in "-_." else "_" for char in this_host())[:64]
    path = f"{_step_owners_directory(step)}/{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"
    owner = UploadOwner.mine(step_dir(step))
    tier.write_bytes(path, owner.to_json_bytes())
    stop = threading.Event()

    def refresh(_: None) -> None:
        while not stop.wait(owner.lease_s / 3):
            try:
                tier.write_bytes(path, owner.refreshed_now().to_json_bytes())
            except CkptdError as error:  # the next refresh tries again; the record stays valid meanwhile
                log.warning("could not refresh the owner record of step %d on %s: %s", step, tier.label, error)

    refresher: BackgroundWorker[None] = BackgroundWorker(
        "ckptd-step-owner", refresh, describe=lambda _: f"refreshing the owner lease of step {step}")
    refresher.submit(None)
    try:
        yield
    finally:
        stop.set()
        try:
            refresher.close(_OWNER_STOP_S, what="the owner lease's refresher")
        except StillRunningError as error:
            log.warning("%s", error)
        try:
            tier.delete_files([path])
        except CkptdError as error:  # it expires after s3_upload_owner_lease_s
            log.warning("could not remove the owner record of step %d on %s (it expires by itself): %s", step,
                        tier.label, error)


def live_step_owners(tier: StorageTier, step: int) -> list[UploadOwner]:
    """The live owners of ``step`` on ``tier`` (promoters holding :func:`step_owner_lease`)."""
    if not tier.capabilities.chunks_by_digest:
        return []
    try:
        listed = tier.list_objects(_step_owners_directory(step))
    except NotFoundError:
        return []
    if not listed:
        return []
    now = tier.clock()  # the store's: the records' times are its own
    owners = []
    for obj in listed:
        try:
            record = UploadOwner.from_json_bytes(tier.read_bytes(obj.path))
        except NotFoundError:
            continue  # its promotion ended meanwhile
        if record is not None and record.is_alive(age_s=max(0.0, now - obj.modified)):
            owners.append(record)
    return owners
