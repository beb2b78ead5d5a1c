"""The object tier: S3 or any S3-compatible store (MinIO, moto, ...) through fsspec/s3fs.

Where the connection settings come from, first match wins:

- endpoint: ``storage_options["endpoint_url"]`` or ``storage_options["client_kwargs"]["endpoint_url"]``,
  then ``CKPTD_S3_ENDPOINT_URL``, then botocore's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``;
- region: ``client_kwargs["region_name"]``, then ``CKPTD_S3_REGION``, then ``AWS_REGION`` / AWS config;
- credentials: ``key``/``secret``/``token`` (or ``profile``) in the options, otherwise botocore's chain
  (environment, ``~/.aws/credentials``, instance roles).

Timeouts and retries come from :mod:`ckptd.config` (``s3_connect_timeout_s``, ``s3_read_timeout_s``,
``s3_retries``): botocore retries throttling, 5xx, connection errors and read timeouts, s3fs retries
what botocore lets through, and a GET whose body arrives truncated is repeated here. Parallel transfers
(``s3_concurrency`` requests, spread over ``s3_io_threads`` event-loop threads, each with its own s3fs
client) keep request signing and checksums of concurrent transfers off a single thread.

Commit protocol for object stores: a PUT (or a completed multipart upload) is atomic, so there are no
temporary names; a step's indexes and chunks are uploaded first and ``manifest.json`` last. A step
without its manifest is never listed as committed. A multipart upload that fails is aborted; uploads
left by a crashed process are removed by :meth:`ObjectTier.abort_incomplete_uploads` (GC calls it).

Chunks live content-addressed under ``chunks/<2 hex>/<digest>.<codec>`` and are shared by steps and ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import AlreadyCommittedError, CkptdError, ConfigError, NotFoundError, PluginError, StorageError
from ckptd.format.layout import MANIFEST_NAME, STEP_PREFIX, TEMP_MARKER, parse_step_dir, step_dir
from ckptd.tiers.base import StorageTier, TierCapabilities

_log = logging.getLogger(__name__)

#: Smallest part S3 accepts in a multipart upload (except the last one).
MIN_PART_BYTES = 5 * 1024 * 1024
_DELETE_BATCH = 1000
_RETRY_HINT = ("check the endpoint, credentials and network; CKPTD_S3_RETRIES and CKPTD_S3_READ_TIMEOUT_S "
               "raise the retry budget; nothing was committed by the failed call")


@dataclass(frozen=True)
class StoredObject:
    """An object listed under the tier root: its path relative to the root, size and modification time."""

    path: str
    size: int
    modified: float


def _storage_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """s3fs arguments: the caller's options plus ckptd's timeouts, retries and endpoint defaults."""
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
    config_kwargs.setdefault("connect_timeout", tunables.s3_connect_timeout_s)
    config_kwargs.setdefault("read_timeout", tunables.s3_read_timeout_s)
    config_kwargs.setdefault("retries", {"max_attempts": max(1, tunables.s3_retries), "mode": "standard"})
    config_kwargs.setdefault("max_pool_connections", max(10, 2 * tunables.s3_concurrency))
    merged.setdefault("max_concurrency", max(1, tunables.s3_concurrency))
    merged.update(client_kwargs=client_kwargs, config_kwargs=config_kwargs, skip_instance_cache=True,
                  use_listings_cache=False)
    return merged


_IO_LOOPS: list[asyncio.AbstractEventLoop] = []
_IO_LOOPS_LOCK = threading.Lock()


def _io_loops(count: int) -> list[asyncio.AbstractEventLoop]:
    """``count`` event loops, each running on its own daemon thread, shared by every object tier."""
    with _IO_LOOPS_LOCK:
        while len(_IO_LOOPS) < max(1, count):
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name=f"ckptd-s3-io-{len(_IO_LOOPS)}", daemon=True).start()
            _IO_LOOPS.append(loop)
        return _IO_LOOPS[:max(1, count)]


def _client_response(exc: BaseException | None) -> dict[str, Any] | None:
    """The parsed error response of the botocore ClientError in an exception's chain, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return response
        exc = exc.__cause__ or exc.__context__
    return None


def _error_code(exc: BaseException | None) -> str | None:
    response = _client_response(exc)
    return None if response is None else str(response["Error"].get("Code") or "") or None


def _http_status(exc: BaseException | None) -> int | None:
    response = _client_response(exc)
    status = None if response is None else response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _not_implemented(exc: BaseException | None) -> bool:
    return _error_code(exc) == "NotImplemented" or _http_status(exc) == 501


def _past_the_end(exc: BaseException) -> bool:
    """Whether a GET failed only because its range starts at or past the end of the object (HTTP 416)."""
    chain = [exc, exc.__cause__, exc.__context__]
    return any(link is not None and ("InvalidRange" in str(link) or "not satisfiable" in str(link))
               for link in chain)


def _total_size(response: dict[str, Any], fallback: int) -> int:
    """Object size from a ranged GET's ``Content-Range: bytes a-b/total``."""
    _, _, total = str(response.get("ContentRange") or "").rpartition("/")
    return int(total) if total.isdigit() else fallback


def _split_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise ConfigError(f"{url!r} is not an s3:// URL", hint="name the object tier as s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ConfigError(f"{url!r} names no bucket", hint="name the object tier as s3://bucket/prefix")
    return bucket, prefix.strip("/")


class ObjectTier(StorageTier):
    """Checkpoints under an ``s3://bucket/prefix`` URL.

    Thread safety: every method may be called from several threads; requests run on the shared I/O
    threads (see the module docstring), whose connection pools all callers share.
    """

    kind = "object"

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.bucket, self.prefix = _split_url(url)
        super().__init__(f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}")
        try:
            import s3fs
        except ImportError as exc:
            raise PluginError("the object tier needs s3fs", hint="install it with: pip install 'ckptd[s3]'") \
                from exc
        options = _storage_options(storage_options)
        #: One s3fs client per I/O thread; data transfers are spread over them (:meth:`_lane`), so
        #: request signing, checksums and socket work of parallel transfers do not queue on one thread.
        self.lanes = [s3fs.S3FileSystem(loop=loop, **options) for loop in _io_loops(settings().s3_io_threads)]
        for lane in self.lanes:
            lane.retries = max(1, settings().s3_retries)  # s3fs's own retries (truncated bodies, SlowDown)
        #: The client for listings and other small requests.
        self.fs = self.lanes[0]
        self._turn = itertools.count()
        self._read_ahead = _ReadAhead(self)
        self._conditional_put = settings().s3_conditional_put

    # --- naming --------------------------------------------------------------------------------
    def key(self, path: str) -> str:
        """Object key of a path relative to the tier root."""
        return f"{self.prefix}/{path}" if self.prefix else path

    @contextlib.contextmanager
    def _errors(self, what: str, path: str) -> Iterator[None]:
        """Translate s3fs/botocore failures into ckptd errors naming the file and tier."""
        try:
            yield
        except (NotFoundError, StorageError, AlreadyCommittedError):
            raise
        except Exception as exc:  # botocore, aiohttp and asyncio errors share no useful base class
            raise self._translate(exc, what, path) from exc

    def _translate(self, exc: Exception, what: str, path: str) -> CkptdError:
        if _error_code(exc) == "PreconditionFailed" or _http_status(exc) == 412:
            return AlreadyCommittedError("the object already exists and is never replaced", path=path,
                                         tier=self.label, hint="a committed step is immutable; save a new step")
        text = str(exc)
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            return NotFoundError(f"bucket {self.bucket!r} does not exist", path=path, tier=self.label,
                                 hint="create it or fix the URL")
        if isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "404" in text:
            return NotFoundError("object not found", path=path, tier=self.label)
        if isinstance(exc, PermissionError):
            return StorageError(f"access denied while {what}", path=path, tier=self.label,
                                hint="check the credentials and the bucket policy")
        if "Credentials" in type(exc).__name__:
            return StorageError(f"no credentials for the object store while {what}", path=path, tier=self.label,
                                hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
                                "key/secret in storage_options")
        return StorageError(f"{what} failed after the retry budget (s3_retries={settings().s3_retries}): "
                            f"{type(exc).__name__}: {exc}", path=path, tier=self.label, hint=_RETRY_HINT)

    def _lane(self) -> Any:
        """The client for the next data transfer (round robin over the I/O threads)."""
        return self.lanes[next(self._turn) % len(self.lanes)]

    def _call(self, lane: Any, method: str, **arguments: Any) -> Any:
        """One S3 API call on a lane, from a caller's thread (retried by botocore and s3fs)."""
        return self._sync(lane, lane._call_s3(method, **arguments))

    @staticmethod
    def _sync(lane: Any, coroutine: Any) -> Any:
        from fsspec.asyn import sync

        return sync(lane.loop, lambda: coroutine)

    def connect(self) -> None:
        """Open the client of every I/O thread now (the first request does it otherwise)."""
        for lane in self.lanes:
            with self._errors("connecting", "/"):
                self._sync(lane, lane.set_session())

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
            lane = self._lane()
            return self._sync(lane, self._get(lane, self.key(path), offset, length))

    async def _get(self, lane: Any, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of an object from ``offset`` (``length`` None: to its end; past the end: empty). A read
        longer than ``s3_part_bytes`` becomes parallel ranged GETs (at most ``s3_concurrency`` at once)."""
        part = max(MIN_PART_BYTES, settings().s3_part_bytes)
        first, total = await self._get_range(lane, key, offset, part if length is None else min(length, part))
        end = total if length is None else min(total, offset + length)
        if offset + len(first) >= end:
            return first
        gate = asyncio.Semaphore(max(1, settings().s3_concurrency))

        async def piece(start: int) -> bytes:
            async with gate:
                data, _ = await self._get_range(lane, key, start, min(part, end - start))
                return data

        rest = await asyncio.gather(*[piece(start) for start in range(offset + len(first), end, part)])
        return b"".join([first, *rest])

    async def _get_range(self, lane: Any, key: str, start: int, length: int) -> tuple[bytes, int]:
        """One ranged GET and the object's total size. The request is retried by botocore and s3fs; a
        body that arrives truncated or stalls is retried here, up to ``s3_retries`` times."""
        attempts = max(1, settings().s3_retries)
        for attempt in range(attempts):
            try:
                response = await lane._call_s3("get_object", Bucket=self.bucket, Key=key,
                                               Range=f"bytes={start}-{start + length - 1}")
            except OSError as exc:
                if _past_the_end(exc):
                    return b"", start
                raise
            body = response["Body"]
            try:
                data = await body.read()
                expected = response.get("ContentLength")
                if expected is not None and len(data) != expected:
                    raise ConnectionError(f"body truncated: {len(data)} of {expected} bytes")
                return bytes(data), _total_size(response, start + len(data))
            except Exception:  # aiohttp/botocore streaming errors: retry the whole GET
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
            finally:
                body.close()
        raise AssertionError("unreachable")

    def read_ahead(self, paths: list[str]) -> None:
        """Hint that whole files ``paths`` will be read in this order: fetch up to ``s3_read_ahead`` of
        them concurrently ahead of :meth:`read_bytes`. Replaces an earlier hint."""
        self._read_ahead.start(paths)

    def size(self, path: str) -> int:
        return int(self._head(path)["ContentLength"])

    def _head(self, path: str) -> dict[str, Any]:
        with self._errors("looking up", path):
            return self._call(self.fs, "head_object", Bucket=self.bucket, Key=self.key(path))

    def exists(self, path: str) -> bool:
        try:
            self._head(path)
        except NotFoundError:
            return False
        return True

    def _list(self, prefix: str) -> list[StoredObject]:
        """Objects whose path relative to the root starts with ``prefix``: one paginated LIST."""
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key(prefix)}
        skip = len(self.key(""))
        found = []
        with self._errors("listing", prefix or "/"):
            while True:
                page = self._call(self.fs, "list_objects_v2", **arguments)
                for item in page.get("Contents", []):
                    modified = item.get("LastModified")
                    stamp = modified.timestamp() if hasattr(modified, "timestamp") else time.time()
                    found.append(StoredObject(item["Key"][skip:], int(item.get("Size", 0)), stamp))
                if not page.get("IsTruncated"):
                    return found
                arguments["ContinuationToken"] = page["NextContinuationToken"]

    def _step_files(self) -> dict[int, set[str]]:
        """Every step directory and the file names in it, from one listing."""
        steps: dict[int, set[str]] = {}
        for obj in self._list(STEP_PREFIX):
            directory, _, name = obj.path.partition("/")
            step = parse_step_dir(directory)
            if step is not None and name and "/" not in name:
                steps.setdefault(step, set()).add(name)
        return steps

    def list_step_numbers(self) -> list[int]:
        return sorted(self._step_files())

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending, from one listing (a step is committed when its manifest exists)."""
        return sorted(step for step, names in self._step_files().items() if MANIFEST_NAME in names)

    def list_files(self, step: int) -> list[str]:
        directory = f"{step_dir(step)}/"
        names = (obj.path[len(directory):] for obj in self._list(directory))
        return sorted(name for name in names if name and "/" not in name and TEMP_MARKER not in name)

    def list_objects(self, directory: str) -> list[StoredObject]:
        """Every object under ``directory`` (relative to the root), recursively, with size and time."""
        return self._list(f"{directory.rstrip('/')}/" if directory else "")

    # --- writing -------------------------------------------------------------------------------
    @property
    def capabilities(self) -> TierCapabilities:  # type: ignore[override]
        return TierCapabilities(chunks_by_digest=True, conditional_put=self._conditional_put,
                                multipart_uploads=True)

    def write_bytes(self, path: str, data: Buffer, *, if_absent: bool = False) -> None:
        """Upload a whole object: one PUT, or a multipart upload with parallel parts above
        ``s3_part_bytes``. Either way the object appears complete or not at all.

        With ``if_absent=True`` the PUT (or the multipart completion) carries ``If-None-Match: *``, which
        the store refuses with 412 when the key exists. Where the store does not support conditional
        writes (``s3_conditional_put`` off, or the store answers 501), the tier looks the key up first
        and then writes, which is not race-free between two writers. An existing object holding exactly
        these bytes counts as written: a retried request whose first attempt landed looks like that."""
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
            if not (if_absent and _not_implemented(exc.__cause__)):
                raise
            _log.warning("the object store of %s refused a conditional write (If-None-Match); writing "
                         "commit markers look-up-then-put from now on (not race-free between two writers)",
                         self.label)
            self._conditional_put = False
            self.write_bytes(path, data, if_absent=True)

    def _upload(self, path: str, data: Buffer, view: memoryview, *, if_absent: bool) -> None:
        tunables = settings()
        part_bytes = max(MIN_PART_BYTES, tunables.s3_part_bytes)
        condition = {"IfNoneMatch": "*"} if if_absent else {}
        with self._errors("uploading", path):
            if len(view) <= part_bytes:
                body = data if isinstance(data, bytes) else bytes(view)  # no copy of bytes already whole
                self._call(self._lane(), "put_object", Bucket=self.bucket, Key=self.key(path), Body=body,
                           **condition)
            else:
                lane = self._lane()
                self._sync(lane, self._multipart(lane, self.key(path), view, part_bytes,
                                                 max(1, tunables.s3_concurrency), condition))

    async def _multipart(self, lane: Any, key: str, data: memoryview, part_bytes: int, concurrency: int,
                         condition: dict[str, str]) -> None:
        created = await lane._call_s3("create_multipart_upload", Bucket=self.bucket, Key=key)
        upload_id = created["UploadId"]
        gate = asyncio.Semaphore(concurrency)

        async def upload_part(number: int, start: int) -> dict[str, Any]:
            async with gate:
                body = bytes(data[start:start + part_bytes])
                answer = await lane._call_s3("upload_part", Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": answer["ETag"]}

        tasks = [asyncio.ensure_future(upload_part(number, start))
                 for number, start in enumerate(range(0, len(data), part_bytes), start=1)]
        try:
            parts = await asyncio.gather(*tasks)
            await lane._call_s3("complete_multipart_upload", Bucket=self.bucket, Key=key,
                                UploadId=upload_id, MultipartUpload={"Parts": list(parts)}, **condition)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await lane._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=key,
                                       UploadId=upload_id)
            raise

    def incomplete_uploads(self) -> list[tuple[str, str, float]]:
        """Multipart uploads under the root that were started and neither completed nor aborted:
        (path, upload id, start time)."""
        found: list[tuple[str, str, float]] = []
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key("")}
        with self._errors("listing multipart uploads", "/"):
            while True:
                page = self._call(self.fs, "list_multipart_uploads", **arguments)
                for upload in page.get("Uploads", []):
                    started = upload.get("Initiated")
                    stamp = started.timestamp() if hasattr(started, "timestamp") else 0.0
                    root = self.key("")
                    found.append((upload["Key"][len(root):], upload["UploadId"], stamp))
                if not page.get("IsTruncated"):
                    return found
                arguments.update(KeyMarker=page.get("NextKeyMarker"),
                                 UploadIdMarker=page.get("NextUploadIdMarker"))

    def abort_incomplete_uploads(self, older_than_s: float = 0.0) -> int:
        """Abort multipart uploads left by crashed writers (started more than ``older_than_s`` ago)."""
        count = 0
        for path, upload_id, started in self.incomplete_uploads():
            if time.time() - started < older_than_s:
                continue
            with self._errors("aborting a multipart upload", path):
                self._call(self.fs, "abort_multipart_upload", Bucket=self.bucket, Key=self.key(path),
                                UploadId=upload_id)
            count += 1
        return count

    def delete_files(self, paths: list[str]) -> None:
        for start in range(0, len(paths), _DELETE_BATCH):
            batch = paths[start:start + _DELETE_BATCH]
            request = {"Objects": [{"Key": self.key(path)} for path in batch], "Quiet": True}
            with self._errors("deleting", batch[0]):
                answer = self._call(self.fs, "delete_objects", Bucket=self.bucket, Delete=request)
            failed = [error for error in answer.get("Errors", []) if error.get("Code") != "NoSuchKey"]
            if failed:
                raise StorageError(f"could not delete {len(failed)} object(s): {failed[0].get('Message')}",
                                   path=failed[0].get("Key"), tier=self.label, hint=_RETRY_HINT)

    def remove_step_dir(self, step: int) -> None:
        """Delete what is left under the step's prefix (object stores have no directories)."""
        leftovers = [obj.path for obj in self.list_objects(step_dir(step))]
        if leftovers:
            self.delete_files(leftovers)

    def close(self) -> None:
        self._read_ahead.start([])


class _ReadAhead:
    """Fetches whole objects ahead of the reader, a bounded window at a time, on s3fs's event loop."""

    def __init__(self, tier: ObjectTier) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._fetching: dict[str, Future[bytes]] = {}

    def start(self, paths: list[str]) -> None:
        with self._lock:
            for future in self._fetching.values():
                future.cancel()
            self._fetching.clear()
            self._pending = list(dict.fromkeys(paths))
            self._top_up()

    def take(self, path: str) -> Future[bytes] | None:
        with self._lock:
            future = self._fetching.pop(path, None)
            if future is None and path in self._pending:
                self._pending.remove(path)
            self._top_up()
            return future

    def _top_up(self) -> None:
        window = settings().s3_read_ahead or settings().s3_concurrency
        while self._pending and len(self._fetching) < window:
            path = self._pending.pop(0)
            lane = self.tier._lane()
            coroutine = self.tier._get(lane, self.tier.key(path))
            self._fetching[path] = asyncio.run_coroutine_threadsafe(coroutine, lane.loop)
