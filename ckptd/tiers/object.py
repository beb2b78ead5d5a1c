"""The object tier: S3 or any S3-compatible store (MinIO, moto, ...) through fsspec/s3fs.

Connection settings and timeouts: :mod:`ckptd.tiers.s3_options`. What a failure means:
:mod:`ckptd.tiers.s3_errors`. Parallel transfers and read-ahead: :mod:`ckptd.tiers.s3_transfers`, on the
tier's own event-loop lanes (:mod:`ckptd.tiers.s3_lanes`), which :meth:`ObjectTier.close` stops.

Commit protocol for object stores: a PUT (or a completed multipart upload) is atomic, so there are no
temporary names; a step's indexes and chunks are uploaded first and ``manifest.json`` last, with
``If-None-Match: *`` where the store supports conditional writes (``write_bytes(..., if_absent=True)``).
A step without its manifest is never listed as committed. A multipart upload that fails is aborted;
uploads left by a crashed process are removed by :meth:`ObjectTier.abort_incomplete_uploads` (GC calls it),
which knows them by their owner records (:mod:`ckptd.tiers.upload_owners`) and never aborts the upload of a
live writer on another host. Every upload asks the store to keep a CRC32 of the object
(:meth:`ObjectTier.stored_checksum`), which promotion's dedup compares with the local bytes.

Chunks live content-addressed under ``chunks/<2 hex>/<digest>.<codec>`` and are shared by steps and ranks,
except a rank's small chunks, which stay in its pack (one object in the step directory, read by range:
see :mod:`ckptd.stepio.packs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import AlreadyCommittedError, CkptdError, IntegrityError, NotFoundError, PluginError, StorageError
from ckptd.format.layout import MANIFEST_NAME, STEP_PREFIX, step_dir
from ckptd.tiers import s3_errors
from ckptd.tiers.base import (StorageTier, StoredObject, TierCapabilities, check_whole_size, repeated_keys,
                              step_files)
from ckptd.tiers.s3_blocking import BlockingRequests, blocking_client_arguments
from ckptd.tiers.s3_lanes import IoLanes
from ckptd.tiers.s3_budget import OperationBudget, budgeted_filesystem_class
from ckptd.tiers.s3_options import endpoint_of, region_of, retry_budget, s3fs_options, s3fs_retries, split_url
from ckptd.tiers.s3_transfers import (MIN_PART_BYTES, ReadAhead, checksum_enabled, data_filesystem_class, get_object,
                                     multipart_upload, part_bytes, put_arguments)
from ckptd.tiers.upload_owners import OWNERS_PREFIX, UploadOwner, key_directory, new_record_path

_log = logging.getLogger(__name__)
_DELETE_BATCH = 1000


class ObjectTier(StorageTier):
    """Checkpoints under an ``s3://bucket/prefix`` URL.

    Thread safety: every method may be called from several threads; requests run on the tier's I/O
    lanes, whose connection pools all callers share. :meth:`close` stops the lanes; a later call starts
    new ones.
    """

    kind = "object"

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.bucket, self.prefix = split_url(url)
        super().__init__(f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}")
        try:
            import s3fs  # noqa: F401  (the tier needs it; its subclass is made lazily)
        except ImportError as exc:
            raise PluginError("the object tier needs s3fs", hint="install it with: pip install 'ckptd[s3]'") \
                from exc
        data_options = s3fs_options(storage_options)
        metadata_options = s3fs_options(storage_options, metadata=True)
        self.endpoint, self.region = endpoint_of(data_options), region_of(data_options)
        data_retries, metadata_retries = s3fs_retries(), s3fs_retries(metadata=True)

        def make_client(loop: asyncio.AbstractEventLoop, metadata: bool) -> Any:
            filesystem = budgeted_filesystem_class() if metadata else data_filesystem_class()
            client = filesystem(loop=loop, **(metadata_options if metadata else data_options))
            client.retries = metadata_retries if metadata else data_retries
            client.ckptd_budget = functools.partial(retry_budget, metadata=metadata)
            return client

        self._lanes = IoLanes(settings().s3_io_threads, make_client)
        arguments = blocking_client_arguments(data_options) if settings().s3_blocking_data else None
        self._blocking = None if arguments is None else BlockingRequests(arguments, retry_budget, self._filled_loader)
        self._read_ahead = ReadAhead(self._fetch_ahead)
        self._conditional_put = settings().s3_conditional_put
        self._checksums = checksum_enabled()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 create: bool = False) -> ObjectTier:
        return cls(url, storage_options=storage_options)

    @property
    def capabilities(self) -> TierCapabilities:  # type: ignore[override]
        return TierCapabilities(chunks_by_digest=True, conditional_put=self._conditional_put,
                                multipart_uploads=True)

    # --- clients -------------------------------------------------------------------------------
    @property
    def lanes(self) -> list[Any]:
        """The s3fs client of every I/O lane; data transfers are spread over them."""
        return self._lanes.data_clients

    @property
    def fs(self) -> Any:
        """The s3fs client for listings, lookups and deletes (short connect timeout, few retries)."""
        return self._lanes.metadata_client

    def _filled_loader(self) -> Any:
        """The botocore model loader of the metadata client's session, once it has one (else None)."""
        session = getattr(self._lanes.started_metadata_client, "session", None)
        get_component = getattr(session, "get_component", None)
        return get_component("data_loader") if get_component is not None else None

    def key(self, path: str) -> str:
        """Object key of a path relative to the tier root."""
        return f"{self.prefix}/{path}" if self.prefix else path

    @contextlib.contextmanager
    def _errors(self, what: str, path: str) -> Iterator[None]:
        """Translate s3fs/botocore failures into ckptd errors naming the file and tier."""
        try:
            yield
        except CkptdError:
            raise
        except Exception as exc:  # botocore, aiohttp and asyncio errors share no useful base class
            raise s3_errors.classify(exc, what=what, path=path, tier=self.label, bucket=self.bucket,
                                     endpoint=self.endpoint, region=self.region,
                                     retries=settings().s3_retries) from exc

    def _call(self, client: Any, method: str, **arguments: Any) -> Any:
        """One S3 API call on a client, from a caller's thread (retried by botocore and s3fs)."""
        return self._lanes.run(client, lambda: client._call_s3(method, **arguments))

    def connect(self) -> None:
        """Open the client of every I/O lane now (the first request does it otherwise)."""
        for client in [*self.lanes, self.fs]:
            with self._errors("connecting", "/"):
                self._lanes.run(client, client.set_session)
        if self._blocking is not None:
            with self._errors("connecting", "/"):
                self._blocking.client  # noqa: B018 - made now, not on the first request

    def on_request(self, handler: Callable[..., Any]) -> None:
        """Call ``handler(request=..., event_name=..., **_)`` (botocore's ``before-send``) before every HTTP
        request any client of this tier sends from now on: how tests and benchmarks count requests."""
        self.connect()
        for client in [*self.lanes, self.fs]:
            client._s3.meta.events.register("before-send.s3", handler)
        if self._blocking is not None:
            self._blocking.on_event("before-send.s3", handler)

    def on_call(self, handler: Callable[[str, dict[str, Any]], None]) -> None:
        """Call ``handler(operation, params)`` (``"put_object"``, the call's parameters) before every S3 call
        any client of this tier makes from now on; an exception it raises fails that call before anything is
        sent. How tests inject faults and benchmarks count calls, whichever client makes them."""

        def before(model: Any, params: dict[str, Any], **_: Any) -> None:
            handler(_snake(model.name), params)

        self.connect()
        for client in [*self.lanes, self.fs]:
            client._s3.meta.events.register("before-parameter-build.s3", before)
        if self._blocking is not None:
            self._blocking.on_event("before-parameter-build.s3", before)

    def yield_while(self, busy: Callable[[], bool], *, limit_s: float, poll_s: float = 0.001) -> None:
        """Before every S3 call of this tier from now on, wait while ``busy()`` holds, at most ``limit_s``: on
        the tier's event loops without blocking them (their other calls go on), on a caller's thread by
        sleeping. How the in-process uploader yields to a save being written."""

        async def on_loop(**_: Any) -> None:
            deadline = time.monotonic() + limit_s
            while busy() and time.monotonic() < deadline:
                await asyncio.sleep(poll_s)

        def on_thread(**_: Any) -> None:
            deadline = time.monotonic() + limit_s
            while busy() and time.monotonic() < deadline:
                time.sleep(poll_s)

        self.connect()
        for client in [*self.lanes, self.fs]:
            client._s3.meta.events.register("before-parameter-build.s3", on_loop)
        if self._blocking is not None:
            self._blocking.on_event("before-parameter-build.s3", on_thread)

    # --- reading -------------------------------------------------------------------------------
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset == 0 and length is None:
            ahead = self._read_ahead.take(path)
            if ahead is not None:
                with self._errors("reading", path):
                    return ahead.result()
        if length == 0:
            return b""
        with self._errors("reading", path):
            return self._get(path, offset, length)

    def _get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes of ``path`` from ``offset`` (``length`` None: to its end, or a bound past it): one
        blocking GET of up to ``s3_part_bytes``, then the lanes' parallel ranged GETs for the rest."""
        part = part_bytes()
        if self._blocking is not None:
            budget = self._blocking.new_budget()  # one for the whole read, the lanes' part of it too
            first, total = self._blocking.get(self.bucket, self.key(path), offset,
                                              part if length is None else min(length, part), budget)
            end = total if length is None else min(total, offset + length)
            if offset + len(first) >= end:
                return first
            offset, length = offset + len(first), end - offset - len(first)
            return first + self._get_on_lanes(path, offset, length, budget)
        return self._get_on_lanes(path, offset, length)

    def read_whole_into(self, path: str, buffer: memoryview) -> None:
        """With the blocking client: ranged GETs of up to ``s3_part_bytes`` read straight into ``buffer``
        (the first on this thread, the rest in parallel on the client's threads; a caller must not be one
        of them), one retry budget for them all. A file being read ahead is taken from there."""
        view = memoryview(buffer).cast("B")
        ahead = self._read_ahead.take(path)
        if self._blocking is None or ahead is not None or not len(view):
            with self._errors("reading", path):
                data = ahead.result() if ahead is not None else self._get(path)
            check_whole_size(self, path, len(data), len(view))
            view[:] = data
            return
        blocking, key, part = self._blocking, self.key(path), part_bytes()
        with self._errors("reading", path):
            budget = blocking.new_budget()
            filled, total = blocking.get_into(self.bucket, key, 0, view[:part], budget)
            check_whole_size(self, path, total, len(view))
            starts = range(filled, total, part)
            rest = [blocking.submit(functools.partial(blocking.get_into, self.bucket, key, start,
                                                      view[start:start + part], budget)) for start in starts]
            try:
                wait(rest, return_when=FIRST_EXCEPTION)
            finally:
                for future in rest:
                    future.cancel()
                wait(rest)  # no GET writes into the buffer after this returns
            got = [(0, filled)] + [(start, future.result()[0]) for start, future in zip(starts, rest)]
            if any(count != min(part, total - start) for start, count in got):
                raise IntegrityError("object shorter than its listed size", path=path, tier=self.label)

    def _get_on_lanes(self, path: str, offset: int, length: int | None,
                      budget: OperationBudget | None = None) -> bytes:
        client = self._lanes.next_data_client()
        return self._lanes.run(client, lambda: get_object(client, self.bucket, self.key(path), offset, length),
                               budget)

    def _fetch_ahead(self, path: str) -> Future[bytes]:
        if self._blocking is not None:
            return self._blocking.submit(lambda: self._get(path))
        client = self._lanes.next_data_client()
        return self._lanes.submit(client, get_object(client, self.bucket, self.key(path)))

    def read_ahead(self, paths: list[str]) -> None:
        """Hint that whole files ``paths`` will be read in this order: fetch up to ``s3_read_ahead`` of
        them concurrently ahead of :meth:`read_bytes`. Replaces an earlier hint."""
        self._read_ahead.start(paths)

    def size(self, path: str) -> int:
        return int(self._head(path)["ContentLength"])

    def _head(self, path: str) -> dict[str, Any]:
        with self._errors("looking up", path):
            return self._call(self.fs, "head_object", Bucket=self.bucket, Key=self.key(path))

    def clock(self) -> float:
        """The store's time now: the ``Date`` of its answer to a HEAD of the bucket (this machine's clock
        if it sends none)."""
        with self._errors("reading the store's clock", "/"):
            answer = self._call(self.fs, "head_bucket", Bucket=self.bucket)
        return _answer_time(answer) or time.time()

    def age_s(self, path: str) -> float | None:
        """One HEAD: the store's ``Date`` minus the object's ``LastModified`` (both the store's clock)."""
        try:
            head = self._head(path)
        except NotFoundError:
            return None
        modified = head.get("LastModified")
        if not hasattr(modified, "timestamp"):
            return None
        return (_answer_time(head) or time.time()) - modified.timestamp()

    def exists(self, path: str) -> bool:
        try:
            self._head(path)
        except NotFoundError:
            return False
        return True

    def _list(self, prefix: str) -> list[StoredObject]:
        """Objects whose path relative to the root starts with ``prefix``: one paginated LIST."""
        return [StoredObject(path, size, stamp) for path, size, _, stamp in self._list_items(prefix)]

    def _list_items(self, prefix: str) -> list[tuple[str, int, str, float]]:
        """(path, size, ETag, modification time) of the objects under ``prefix``: one paginated LIST."""
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key(prefix)}
        skip = len(self.key(""))
        found = []
        with self._errors("listing", prefix or "/"):
            while True:
                page = self._call(self.fs, "list_objects_v2", **arguments)
                for item in page.get("Contents", []):
                    modified = item.get("LastModified")
                    stamp = modified.timestamp() if hasattr(modified, "timestamp") else time.time()
                    found.append((item["Key"][skip:], int(item.get("Size", 0)), str(item.get("ETag", "")), stamp))
                if not page.get("IsTruncated"):
                    return found
                arguments["ContinuationToken"] = page["NextContinuationToken"]

    def _step_files(self) -> dict[int, set[str]]:
        """Every step directory and the file names in it, from one listing (of the step directories only)."""
        return step_files(self._list(STEP_PREFIX))

    def list_step_numbers(self) -> list[int]:
        return sorted(self._step_files())

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending, from one listing (a step is committed when its manifest exists)."""
        return sorted(step for step, names in self._step_files().items() if MANIFEST_NAME in names)

    def list_objects(self, directory: str) -> list[StoredObject]:
        """Every object under ``directory`` (relative to the root), recursively, with size and time."""
        return self._list(f"{directory.rstrip('/')}/" if directory else "")

    def step_modified(self, step: int) -> float | None:
        return max((obj.modified for obj in self.list_objects(step_dir(step))), default=None)

    # --- writing -------------------------------------------------------------------------------
    def write_bytes(self, path: str, data: Buffer, *, if_absent: bool = False) -> None:
        """Upload a whole object: one PUT, or a multipart upload with parallel parts above
        ``s3_part_bytes``. Either way the object appears complete or not at all.

        With ``if_absent=True`` the PUT (or the multipart completion) carries ``If-None-Match: *``, which
        the store refuses with 412 when the key exists. Where the store does not support conditional
        writes (``s3_conditional_put`` off, or the store answers 501), the tier looks the key up first
        and then writes, which is not race-free between two writers."""
        view = memoryview(data).cast("B")
        if if_absent and not self._conditional_put:
            if self.exists(path):
                self._refuse_unless_identical(path, view)
                return
            if_absent = False
        try:
            self._upload(path, data, view, if_absent=if_absent)
        except AlreadyCommittedError:
            self._refuse_unless_identical(path, view)
        except StorageError as exc:
            if self._checksums and s3_errors.is_not_implemented(exc.__cause__):
                _log.warning("the object store of %s does not implement upload checksums; uploading without "
                             "them from now on (dedup then reads stored chunks back to check them; set "
                             "CKPTD_S3_UPLOAD_CHECKSUM= to skip this attempt)", self.label)
                self._checksums = False
                self.write_bytes(path, data, if_absent=if_absent)
                return
            if not (if_absent and s3_errors.is_not_implemented(exc.__cause__)):
                raise
            _log.warning("the object store of %s refused a conditional write (If-None-Match); writing "
                         "commit markers look-up-then-put from now on (not race-free between two writers)",
                         self.label)
            self._conditional_put = False
            self.write_bytes(path, data, if_absent=True)

    def _upload(self, path: str, data: Buffer, view: memoryview, *, if_absent: bool) -> None:
        part = part_bytes()
        condition = {"IfNoneMatch": "*"} if if_absent else {}
        with self._errors("uploading", path):
            if len(view) <= part:
                body = data if isinstance(data, (bytes, bytearray)) else bytes(view)  # sent as it is, no copy
                sums = put_arguments(view) if self._checksums else {}
                if self._blocking is not None:
                    self._blocking.put(self.bucket, self.key(path), body, **condition, **sums)
                else:
                    self._call(self._lanes.next_data_client(), "put_object", Bucket=self.bucket, Key=self.key(path),
                               Body=body, **condition, **sums)
            else:
                client = self._lanes.next_data_client()
                concurrency = max(1, settings().s3_concurrency)
                owner = (self.key(new_record_path(path)), UploadOwner.mine(path))
                self._lanes.run(client, lambda: multipart_upload(client, self.bucket, self.key(path), view,
                                                                 part=part, concurrency=concurrency,
                                                                 condition=condition, owner_record=owner,
                                                                 checksum=self._checksums))

    # --- checksums the store keeps (promotion's dedup compares them) -----------------------------
    def listed_tags(self, directory: str) -> dict[str, tuple[int, str]]:
        """Path -> (size, ETag) of every object under ``directory``, from one paginated listing."""
        return {path: (size, tag) for path, size, tag, _ in self._list_items(f"{directory.rstrip('/')}/")}

    def stored_checksum(self, path: str) -> tuple[int, str, str | None]:
        """(size, ETag, full-object CRC32 or None) the store keeps for an object: one HEAD asking for
        checksums. None when it was stored without one, or with a per-part (composite) one."""
        with self._errors("looking up", path):
            head = self._call(self.fs, "head_object", Bucket=self.bucket, Key=self.key(path), ChecksumMode="ENABLED")
        crc = head.get("ChecksumCRC32")
        if crc is not None and (head.get("ChecksumType") == "COMPOSITE" or "-" in str(crc)):
            crc = None
        return int(head["ContentLength"]), str(head.get("ETag", "")), crc

    def incomplete_uploads(self) -> list[tuple[str, str, float]]:
        """Multipart uploads under the root that were started and neither completed nor aborted:
        (path, upload id, start time)."""
        found: list[tuple[str, str, float]] = []
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key("")}
        root = self.key("")
        with self._errors("listing multipart uploads", "/"):
            while True:
                page = self._call(self.fs, "list_multipart_uploads", **arguments)
                for upload in page.get("Uploads", []):
                    started = upload.get("Initiated")
                    stamp = started.timestamp() if hasattr(started, "timestamp") else 0.0
                    found.append((upload["Key"][len(root):], upload["UploadId"], stamp))
                if not page.get("IsTruncated"):
                    return found
                arguments.update(KeyMarker=page.get("NextKeyMarker"),
                                 UploadIdMarker=page.get("NextUploadIdMarker"))

    def _owner_records(self) -> dict[str, list[tuple[str, UploadOwner | None, float]]]:
        """Records directory -> (record path, parsed record, last written on the store's clock) of every
        owner record of an upload."""
        found: dict[str, list[tuple[str, UploadOwner | None, float]]] = {}
        for obj in self._list(f"{OWNERS_PREFIX}/"):
            directory, _, _ = obj.path.rpartition("/")
            try:
                record = UploadOwner.from_json_bytes(self.read_bytes(obj.path))
            except NotFoundError:
                continue  # its upload finished meanwhile
            found.setdefault(directory, []).append((obj.path, record, obj.modified))
        return found

    def _uploads_with_owners(self) -> tuple[float, list[tuple[str, str, float, list[tuple[UploadOwner, bool]]]]]:
        """The store's time and every incomplete upload with the owner records of its key: (path, upload id,
        start time, [(record, whether its writer is alive)])."""
        uploads = self.incomplete_uploads()  # before the records: each upload's record was written before it
        records = self._owner_records()
        now = self.clock()  # the store's: records' and uploads' times are its own, whatever this clock says
        return now, [(path, upload_id, started, [(record, record.is_alive(age_s=now - written))
                                                 for _, record, written in records.get(key_directory(path), [])
                                                 if record is not None])
                     for path, upload_id, started in uploads]

    @staticmethod
    def _why_abandoned(owners: list[tuple[UploadOwner, bool]], age_s: float, older_than_s: float) -> str | None:
        if any(alive for _, alive in owners):
            return None
        if owners:
            return "its owner is gone (" + ", ".join(f"pid {owner.pid} on {owner.host}" for owner, _ in owners) + ")"
        if age_s >= older_than_s:
            return f"no owner record and started over {older_than_s:.0f}s ago"
        return None

    def abandoned_uploads(self, older_than_s: float = 0.0) -> list[tuple[str, str, str]]:
        """Incomplete multipart uploads no live writer owns: (path, upload id, why). An upload whose key
        has a live owner record (:mod:`ckptd.tiers.upload_owners`) is never listed, however old; one
        with no record at all counts as abandoned once started more than ``older_than_s`` ago."""
        now, uploads = self._uploads_with_owners()
        found = [(path, upload_id, self._why_abandoned(owners, now - started, older_than_s))
                 for path, upload_id, started, owners in uploads]
        return [(path, upload_id, why) for path, upload_id, why in found if why is not None]

    @staticmethod
    def _awaiting(uploads: list[tuple[str, str, float, list[tuple[UploadOwner, bool]]]]) -> list[str]:
        waiting = {path for path, _, _, owners in uploads
                   if any(alive for _, alive in owners) and not all(alive for _, alive in owners)}
        return sorted(waiting | set(repeated_keys([path for path, _, _, _ in uploads])))

    def uploads_awaiting_owners(self) -> list[str]:
        """Open uploads spared while their key has a live owner although a dead writer's record names the
        key too (a restarted writer re-sending what a dead one left half sent), and keys with two open
        uploads: worth another look as soon as the live owner is done."""
        return self._awaiting(self._uploads_with_owners()[1])

    def abort_incomplete_uploads(self, older_than_s: float = 0.0) -> int:
        """Abort the multipart uploads no live writer owns (see :meth:`abandoned_uploads`), then delete
        the owner records that are no longer alive, except those of a key with an upload still open (a
        dead writer's upload spared for a live owner of its key stays attributed to the dead one);
        returns how many uploads were aborted."""
        return self.sweep_incomplete_uploads(older_than_s)[0]

    def sweep_incomplete_uploads(self, older_than_s: float = 0.0) -> tuple[int, list[str]]:
        """:meth:`abort_incomplete_uploads` and :meth:`uploads_awaiting_owners` of what is left open, from
        one listing of the uploads and their records: (uploads aborted, paths awaiting their owners)."""
        count, left = 0, []
        now, uploads = self._uploads_with_owners()
        for upload in uploads:
            path, upload_id, started, owners = upload
            why = self._why_abandoned(owners, now - started, older_than_s)
            if why is None:
                left.append(upload)
                continue
            try:
                with self._errors("aborting a multipart upload", path):
                    self._call(self.fs, "abort_multipart_upload", Bucket=self.bucket, Key=self.key(path),
                               UploadId=upload_id)
            except NotFoundError:
                continue  # completed or aborted since it was listed
            _log.info("aborted an abandoned multipart upload of %s on %s: %s", path, self.label, why)
            count += 1
        still_open = {key_directory(path) for path, _, _, _ in left}
        now = self.clock()
        stale = [record_path for directory, entries in self._owner_records().items() if directory not in still_open
                 for record_path, record, written in entries
                 if record is None or not record.is_alive(age_s=now - written)]
        if stale:
            self.delete_files(stale)
        return count, self._awaiting(left)

    def delete_files(self, paths: list[str]) -> None:
        for start in range(0, len(paths), _DELETE_BATCH):
            batch = paths[start:start + _DELETE_BATCH]
            request = {"Objects": [{"Key": self.key(path)} for path in batch], "Quiet": True}
            with self._errors("deleting", batch[0]):
                answer = self._call(self.fs, "delete_objects", Bucket=self.bucket, Delete=request)
            failed = [error for error in answer.get("Errors", []) if error.get("Code") != "NoSuchKey"]
            if failed:
                raise StorageError(f"could not delete {len(failed)} object(s): {failed[0].get('Code')}",
                                   path=failed[0].get("Key"), tier=self.label, hint=s3_errors.RETRY_HINT)

    def remove_step_dir(self, step: int) -> None:
        """Delete what is left under the step's prefix (object stores have no directories)."""
        leftovers = [obj.path for obj in self.list_objects(step_dir(step))]
        if leftovers:
            self.delete_files(leftovers)

    def close(self) -> None:
        """Cancel read-ahead, close the connections and stop the tier's I/O threads."""
        self._read_ahead.start([])
        if self._blocking is not None:
            self._blocking.close()
        self._lanes.close()


def _snake(operation: str) -> str:
    """botocore's operation name as the client method's (``PutObject`` -> ``put_object``)."""
    return "".join(f"_{letter.lower()}" if letter.isupper() else letter for letter in operation).lstrip("_")


def _answer_time(answer: Any) -> float | None:
    """The store's clock when it answered: the ``Date`` header of a botocore response, if any."""
    headers = ((answer or {}).get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    return s3_errors.http_date(headers.get("date"))


__all__ = ["MIN_PART_BYTES", "ObjectTier", "StoredObject"]
