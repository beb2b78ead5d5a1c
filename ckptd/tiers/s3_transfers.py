"""Moving bytes to and from S3: parallel ranged reads, multipart uploads, read-ahead of whole objects.

These coroutines run on an s3fs client's event loop (see :mod:`ckptd.tiers.s3_lanes`). Requests are
retried by botocore within the operation's budget (:mod:`ckptd.tiers.s3_budget`); a GET whose body
arrives truncated or stalls is repeated here, from the same budget. A
multipart upload that fails is aborted before the failure is raised, so it leaves no parts behind; one
in flight is vouched for by its owner record (:mod:`ckptd.tiers.upload_owners`). Uploads ask the store
to keep a CRC32 of each object (``s3_upload_checksum``), which promotion's dedup compares cheaply.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import ConfigError
from ckptd.tiers.s3_budget import OperationBudget, backoff_s, budgeted_filesystem_class, current_budget, within_budget
from ckptd.tiers.s3_errors import is_past_the_end
from ckptd.tiers.upload_owners import UploadOwner

_log = logging.getLogger("ckptd.tiers")

#: Smallest part S3 accepts in a multipart upload (except the last one).
MIN_PART_BYTES = 5 * 1024 * 1024


def part_bytes() -> int:
    """Size of multipart parts and of the pieces of a parallel read."""
    return max(MIN_PART_BYTES, settings().s3_part_bytes)


def object_size(response: dict[str, Any], fallback: int) -> int:
    """Object size from a ranged GET's ``Content-Range: bytes a-b/total``."""
    _, _, total = str(response.get("ContentRange") or "").rpartition("/")
    return int(total) if total.isdigit() else fallback


async def get_object(client: Any, bucket: str, key: str, offset: int = 0, length: int | None = None) -> bytes:
    """Bytes of an object from ``offset`` (``length`` None: to its end; past the end: empty). A read
    longer than ``s3_part_bytes`` becomes parallel ranged GETs (at most ``s3_concurrency`` at once)."""
    part = part_bytes()
    first, total = await get_range(client, bucket, key, offset, part if length is None else min(length, part))
    end = total if length is None else min(total, offset + length)
    if offset + len(first) >= end:
        return first
    gate = asyncio.Semaphore(max(1, settings().s3_concurrency))

    async def piece(start: int) -> bytes:
        async with gate:
            data, _ = await get_range(client, bucket, key, start, min(part, end - start))
            return data

    rest = await asyncio.gather(*[piece(start) for start in range(offset + len(first), end, part)])
    return b"".join([first, *rest])


def byte_range(start: int, length: int) -> str:
    """The ``Range`` header of ``length`` bytes from ``start``."""
    return f"bytes={start}-{start + length - 1}"


def ranged_answer(response: dict[str, Any], data: bytes, start: int) -> tuple[bytes, int]:
    """The body of a ranged GET read whole, and the object's size; ConnectionError when it came short (the
    caller fetches it again while its budget lasts)."""
    expected = response.get("ContentLength")
    if expected is not None and len(data) != expected:
        raise ConnectionError(f"body truncated: {len(data)} of {expected} bytes")
    return data, object_size(response, start + len(data))


async def get_range(client: Any, bucket: str, key: str, start: int, length: int) -> tuple[bytes, int]:
    """One ranged GET and the object's total size; a range past the end gives no bytes. A body that
    arrives truncated or stalls is retried while the operation's retry budget lasts."""
    attempt = 0
    while True:
        try:
            response = await client._call_s3("get_object", Bucket=bucket, Key=key, Range=byte_range(start, length))
        except OSError as exc:
            if is_past_the_end(exc):
                return b"", start
            raise
        body = response["Body"]
        try:
            return ranged_answer(response, bytes(await body.read()), start)
        except Exception:  # aiohttp/botocore streaming errors: retry the whole GET
            budget = current_budget()
            if budget is None or not budget.take(connect_failure=False):
                raise
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1
        finally:
            body.close()


def send_bodies_whole(client: Any) -> None:
    """Make a botocore client send a ``bytes`` body of PutObject and UploadPart as it is (idempotent).

    botocore wraps such a body in a ``BytesIO``, from which aiohttp takes a buffer (which unshares, i.e.
    copies, the whole body) and then reads it again in 64 KiB copies on the event loop. Without the
    wrapper the bytes go to the socket in one write; signing, checksums and retries handle bytes alike."""
    if getattr(client, "_ckptd_bodies_whole", False):
        return
    try:  # a botocore without this handler sends bodies its own way: slower, still whole
        from botocore.handlers import convert_body_to_file_like_object
        _whole_body_class()(b"")  # an aiohttp whose Payload wants more methods refuses here
    except (ImportError, TypeError) as exc:
        _log.warning("upload bodies go through botocore's own wrapper (this botocore/aiohttp: %r)", exc)
        client._ckptd_bodies_whole = True
        return
    for operation in ("PutObject", "UploadPart"):
        client.meta.events.unregister(f"before-parameter-build.s3.{operation}", convert_body_to_file_like_object)
        client.meta.events.register(f"before-send.s3.{operation}", _body_as_payload,
                                    unique_id=f"ckptd-whole-body-{operation}")
    client._ckptd_bodies_whole = True


def _body_as_payload(request: Any, **_: Any) -> None:
    """Hand aiohttp a signed bytes body as a payload of its own (aiohttp's payload for bytes warns of
    bodies over 1 MiB; the lanes' loops do nothing but I/O and can write them)."""
    if isinstance(request.body, (bytes, bytearray)):
        request.body = _whole_body_class()(request.body)


@functools.lru_cache(maxsize=1)
def _whole_body_class() -> type:
    from aiohttp.payload import Payload

    class WholeBody(Payload):  # type: ignore[misc]
        """Bytes written to the connection in one piece; reusable when botocore retries the request."""

        def __init__(self, value: bytes | bytearray) -> None:
            super().__init__(value, content_type="application/octet-stream")
            self._size = len(value)

        def seek(self, offset: int, whence: int = 0) -> int:
            """Rewinding (botocore does before a retry, which re-sends the whole body) is a no-op."""
            return 0

        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
            return bytes(self._value).decode(encoding, errors)

        async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
            return bytes(self._value)

        async def write(self, writer: Any) -> None:
            await writer.write(self._value)

        async def write_with_length(self, writer: Any, content_length: int | None) -> None:
            await writer.write(self._value if content_length is None else memoryview(self._value)[:content_length])

    return WholeBody


@functools.lru_cache(maxsize=1)
def data_filesystem_class() -> type:
    """The s3fs class of data clients: budgeted (:mod:`ckptd.tiers.s3_budget`), bodies sent whole."""

    class DataS3FileSystem(budgeted_filesystem_class()):  # type: ignore[misc]
        """s3fs for uploads and chunk reads."""

        async def set_session(self, *args: Any, **kwargs: Any) -> Any:
            client = await super().set_session(*args, **kwargs)
            send_bodies_whole(client)
            return client

    return DataS3FileSystem


def checksum_enabled() -> bool:
    """Whether uploads ask the store to keep a CRC32 of each object (``s3_upload_checksum``)."""
    algorithm = settings().s3_upload_checksum.strip().upper()
    if algorithm not in ("", "CRC32"):
        raise ConfigError(f"s3_upload_checksum={algorithm!r} is not supported",
                          hint="use CRC32 (computed by zlib), or an empty value for a store that refuses checksums")
    return algorithm == "CRC32"


def crc32_checksum(data: Buffer) -> str:
    """The CRC32 of ``data`` as S3 writes it (base64 of the 4 big-endian bytes)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode("ascii")


def put_arguments(data: Buffer) -> dict[str, str]:
    """Checksum arguments of a single PUT (or one part's upload) of ``data``."""
    return {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32_checksum(data)}


async def _keep_owner_fresh(client: Any, bucket: str, record_key: str, owner: UploadOwner) -> None:
    """Rewrite the owner record every third of its lease until cancelled. A refresh spends nothing of the
    upload's retry budget: one that fails waits for the next turn."""
    while True:
        await asyncio.sleep(max(0.05, owner.lease_s / 3))
        refresh = functools.partial(client._call_s3, "put_object", Bucket=bucket, Key=record_key,
                                    Body=owner.refreshed_now().to_json_bytes())
        with contextlib.suppress(Exception):
            await within_budget(OperationBudget(retries=0, connect_retries=0), refresh)


async def multipart_upload(client: Any, bucket: str, key: str, data: memoryview, *, part: int, concurrency: int,
                           condition: dict[str, str], owner_record: tuple[str, UploadOwner] | None = None,
                           checksum: bool | None = None) -> None:
    """Upload ``data`` in parts of ``part`` bytes, ``concurrency`` at once; completion carries
    ``condition`` (e.g. If-None-Match). On any failure the upload is aborted, then the failure raised.

    ``owner_record`` (record key, owner) is written before the upload is created, kept fresh while it
    runs and deleted after (:mod:`ckptd.tiers.upload_owners`). With checksums on, every part carries its
    CRC32 and the store keeps a full-object CRC32 of the result (``checksum`` None: ``s3_upload_checksum``)."""
    checksum = checksum_enabled() if checksum is None else checksum
    refresher = None
    if owner_record is not None:
        record_key, owner = owner_record
        await client._call_s3("put_object", Bucket=bucket, Key=record_key, Body=owner.to_json_bytes())
        refresher = asyncio.ensure_future(_keep_owner_fresh(client, bucket, record_key, owner))
    upload = _UploadState()
    try:
        await _upload_in_parts(client, bucket, key, data, part=part, concurrency=concurrency, condition=condition,
                               checksum=checksum, state=upload)
    finally:
        if refresher is not None:
            refresher.cancel()
            await asyncio.gather(refresher, return_exceptions=True)
        # The record goes only once the upload is closed: an upload whose abort did not land (cancelled,
        # refused) keeps its record, so a collector aborts it once this process is gone or the record
        # expired, instead of waiting ``gc_abandoned_s`` for an upload without a record.
        if owner_record is not None and not upload.open:
            with contextlib.suppress(Exception):  # a record left behind expires; GC removes it
                await client._call_s3("delete_object", Bucket=bucket, Key=owner_record[0])


@dataclass
class _UploadState:
    """Whether a multipart upload may still be open on the store: from before its creation (whose answer can
    be lost) until its completion or its abort was answered."""

    open: bool = False


async def _upload_in_parts(client: Any, bucket: str, key: str, data: memoryview, *, part: int, concurrency: int,
                           condition: dict[str, str], checksum: bool, state: _UploadState) -> None:
    whole = {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"} if checksum else {}
    state.open = True
    created = await client._call_s3("create_multipart_upload", Bucket=bucket, Key=key, **whole)
    upload_id = created["UploadId"]
    gate = asyncio.Semaphore(concurrency)

    async def upload_part(number: int, start: int) -> dict[str, Any]:
        async with gate:
            body = bytes(data[start:start + part])
            sums = put_arguments(body) if checksum else {}
            answer = await client._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                           PartNumber=number, Body=body, **sums)
            done = {"PartNumber": number, "ETag": answer["ETag"]}
            if checksum:
                done["ChecksumCRC32"] = sums["ChecksumCRC32"]
            return done

    tasks = [asyncio.ensure_future(upload_part(number, start))
             for number, start in enumerate(range(0, len(data), part), start=1)]
    try:
        parts = await asyncio.gather(*tasks)
        finish = {"ChecksumType": "FULL_OBJECT"} if checksum else {}
        await client._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                              MultipartUpload={"Parts": list(parts)}, **condition, **finish)
        state.open = False
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        spent = current_budget()
        cleanup = OperationBudget(spent.retries, spent.connect_retries) if spent is not None else None
        with contextlib.suppress(Exception):  # the abort gets a budget of its own: cleanup is not starved
            abort = functools.partial(client._call_s3, "abort_multipart_upload", Bucket=bucket, Key=key,
                                      UploadId=upload_id)
            await (within_budget(cleanup, abort) if cleanup is not None else abort())
            state.open = False
        raise


class ReadAhead:
    """Fetches whole objects ahead of the reader, a bounded window at a time, on the lanes' loops.

    ``fetch(path)`` returns a concurrent future of the object's bytes. Thread safety: every method may
    be called from any thread."""

    def __init__(self, fetch: Callable[[str], Future[bytes]]) -> None:
        self._fetch = fetch
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._fetching: dict[str, Future[bytes]] = {}

    def start(self, paths: list[str]) -> None:
        """Fetch ``paths`` ahead, in this order; replaces (and cancels) an earlier hint."""
        with self._lock:
            for future in self._fetching.values():
                future.cancel()
            self._fetching.clear()
            self._pending = list(dict.fromkeys(paths))
            self._top_up()

    def take(self, path: str) -> Future[bytes] | None:
        """The fetch of ``path`` when it was hinted and started, else None (the caller reads it itself)."""
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
            self._fetching[path] = self._fetch(path)



__all__ = ["MIN_PART_BYTES", "byte_range", "checksum_enabled", "crc32_checksum", "data_filesystem_class", "get_object",
           "get_range", "multipart_upload", "object_size", "part_bytes", "put_arguments", "ranged_answer", "ReadAhead",
           "send_bodies_whole"]
