"""Who owns a multipart upload: owner records, so that a collector aborts only abandoned uploads.

A multipart upload in flight is invisible except in the store's list of incomplete uploads, which says
only the key and when it was started (and some stores, moto among them, do not even say that
truthfully). Before it creates the upload, the uploader writes an owner record at
``uploads/<sha256 of the key, 32 hex>/<host>-<pid>-<nonce>.json`` holding its host identity, pid, when
it last refreshed the record and how long the record stays valid (``s3_upload_owner_lease_s``). It
rewrites the record every third of that while its parts go up, and deletes it once the upload is
completed or aborted.

An upload is **abandoned** when no record for its key is alive; a record is alive while it is fresh and,
when it was written on this host, its process still exists (the same start of it: a pid reused by a
later process, such as the restarted daemon itself, does not keep a dead writer's upload alive).
Freshness is judged on the store's clock: the age of a record is the store's time now (the ``Date`` of
its answer) minus the record object's ``LastModified``, both stamped by the store, so neither the
writer's nor the collector's wall clock (skewed by minutes, or stepped by NTP) makes a live upload look
abandoned. The ``refreshed`` stamp in the record (the writer's clock) is only shown, never compared. So
a collector never aborts the upload of a live promoter on another host, aborts at once an upload whose
owner on this host was killed, and aborts any upload whose owner stopped refreshing (a dead host). An
upload with no record at all (written by an older ckptd) falls back to its ``Initiated`` time.

The host identity is ``CKPTD_HOST_ID`` (``host_id`` setting) or the host name with the pid namespace
(two containers with one host name cannot see each other's pids, so each counts as another host); tests
give a second process another identity to stand in for another host. Records live outside step directories and
``chunks/``, so step and chunk listings never see them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from ckptd.config import settings

#: Directory (relative to the tier root) holding the owner records of multipart uploads.
OWNERS_PREFIX = "uploads"


@functools.cache
def _pid_namespace() -> str:
    """This process's pid namespace (Linux), or "" where there is none to tell."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return ""


def this_host() -> str:
    """This machine's identity in owner records and leases: ``CKPTD_HOST_ID``, or the host name and pid
    namespace (containers that share a host name judge only the pids they can see)."""
    configured = settings().host_id
    if configured:
        return configured
    namespace = _pid_namespace()
    return f"{socket.gethostname()} (pid namespace {namespace})" if namespace else socket.gethostname()


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """Which start of the process ``pid`` this is: the boot id and the start time in clock ticks since boot
    (Linux ``/proc``), "" where that cannot be read. A pid reused by a later process gives another value."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()
        return f"{_boot_id()}:{fields[19]}"  # field 22 of proc(5): starttime; fields[0] is field 3
    except (OSError, IndexError):
        return ""


def process_exists(pid: int, started: str = "") -> bool:
    """Whether the process ``pid`` exists on this host (one owned by another user counts). With ``started``
    (its :func:`process_start` when it wrote a record), a process that reused the pid since does not count:
    a restarted daemon often gets its dead predecessor's pid back (a container's pid 1, a small pid_max)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if started:
        now = process_start(pid)
        return not now or now == started
    return True


@dataclass(frozen=True)
class UploadOwner:
    """The owner record of one multipart upload (or of several of one key by one writer)."""

    key: str
    host: str
    pid: int
    refreshed: float
    lease_s: float
    #: The writer's :func:`process_start` ("" in records of older ckptd versions: the pid alone counts).
    started: str = ""

    @classmethod
    def mine(cls, key: str) -> UploadOwner:
        return cls(key=key, host=this_host(), pid=os.getpid(), refreshed=time.time(),
                   lease_s=settings().s3_upload_owner_lease_s, started=process_start(os.getpid()))

    def refreshed_now(self) -> UploadOwner:
        return UploadOwner(self.key, self.host, self.pid, time.time(), self.lease_s, self.started)

    def to_json_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> UploadOwner | None:
        """The record, or None when it is mangled (a mangled record protects nothing)."""
        try:
            body = json.loads(raw)
            return cls(key=str(body["key"]), host=str(body["host"]), pid=int(body["pid"]),
                       refreshed=float(body["refreshed"]), lease_s=float(body["lease_s"]),
                       started=str(body.get("started") or ""))
        except (ValueError, KeyError, TypeError):
            return None

    def is_alive(self, now: float | None = None, *, age_s: float | None = None) -> bool:
        """Fresh, and (when written on this host) its process still runs. ``age_s``: the record's age on the
        store's clock (now minus the record object's last-modified time, both the store's), which a skewed
        clock of the writer or of the judge cannot distort; without it, ``now`` (default this machine's
        clock) minus the writer's own ``refreshed`` stamp."""
        age = ((time.time() if now is None else now) - self.refreshed) if age_s is None else age_s
        if age >= self.lease_s:
            return False
        return self.host != this_host() or process_exists(self.pid, self.started)


def key_directory(key: str) -> str:
    """The records directory (relative to the tier root) of an object key."""
    return f"{OWNERS_PREFIX}/{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def new_record_path(key: str) -> str:
    """A fresh record path for one upload of ``key`` by this process."""
    host = "".join(char if char.isalnum() or char in "-_." else "_" for char in this_host())[:64]
    return f"{key_directory(key)}/{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"


__all__ = ["OWNERS_PREFIX", "UploadOwner", "key_directory", "new_record_path", "process_exists", "process_start",
           "this_host"]
