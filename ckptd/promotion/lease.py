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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator

from ckptd.config import settings
from ckptd.errors import DeadlineError, LockedError, NotFoundError
from ckptd.tiers.base import StorageTier
from ckptd.tiers.upload_owners import process_exists, this_host

#: Object holding the lease, at the tier root (outside every step directory).
LEASE_PATH = "gc.lease"
_POLL_S = 0.2
_LOG_S = 10.0
log = logging.getLogger("ckptd.promotion")


def _owner_is_dead(body: dict[str, object]) -> bool:
    """Whether the lease's owner ran on this host and has exited (a pid reused since counts as alive)."""
    if body.get("host") != this_host() or not isinstance(body.get("pid"), int):
        return False
    return not process_exists(int(body["pid"]))  # type: ignore[call-overload]


def _lease_age(tier: StorageTier) -> float | None:
    """Seconds since the current lease was taken, or None when there is none, or its owner is dead.

    The age is the tier's (:meth:`~ckptd.tiers.StorageTier.age_s`: the store's clock now minus the lease
    object's last-modified time, both stamped by the store), so that a collector whose clock runs behind
    does not write a lease that a promoter takes for expired while the collection runs; the ``created``
    stamp (the collector's clock) counts only where the tier cannot tell."""
    try:
        body = json.loads(tier.read_bytes(LEASE_PATH))
        if _owner_is_dead(body):
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
    """Hold the GC lease of a tier; raises LockedError when another collector holds a fresh one."""
    if lease_is_fresh(tier):
        raise LockedError("another garbage collection is running on this tier", path=LEASE_PATH,
                          tier=tier.label, hint=f"wait for it, or delete {LEASE_PATH} if it crashed")
    owner = f"pid {os.getpid()} on {this_host()}"
    body = {"owner": owner, "host": this_host(), "pid": os.getpid(), "created": time.time()}
    tier.write_bytes(LEASE_PATH, json.dumps(body).encode())
    try:
        yield
    finally:
        tier.delete_files([LEASE_PATH])
