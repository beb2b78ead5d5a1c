"""Blocking data requests of the object tier: single GETs and PUTs through a plain botocore client on a
pool of threads, beside the event-loop lanes (:mod:`ckptd.tiers.s3_lanes`).

Measured on moto over loopback (2026-12-02, 256 MiB in 16 MiB chunk objects): reading the chunks through
aiobotocore's aiohttp cost the client 0.5-0.6 CPU-s and gave 0.44-0.55 GB/s, against 0.2 CPU-s and
1.1-1.4 GB/s for the same GETs from a botocore client on threads. aiohttp's parser copies every received
piece into a new object on the event loop and the body is joined again at the end, while urllib3 reads a
body of known length into one buffer with the GIL released; uploads likewise go out with one ``sendall``
per body instead of the loop's partial writes. So every GET of at most ``s3_part_bytes`` and every
single PUT goes through here; multipart uploads and the metadata requests stay on the lanes.

A client made of a process's first botocore loader parses the S3 model again (about 0.1 s); the
blocking clients share one loader, borrowed from the tier's metadata client where that was made first.
The client gets the same endpoint, region, credentials, timeouts and botocore config as the lanes' data
clients (:func:`ckptd.tiers.s3_options.s3fs_options`), and each request is one operation with its own
retry budget (:func:`ckptd.tiers.s3_budget.run_within_budget`). Options this path does not translate
(``s3_additional_kwargs``, ``requester_pays``, a ready ``session``...) make :func:`blocking_client_arguments`
return None, and the tier then keeps every request on the lanes.

Ownership: one :class:`BlockingRequests` belongs to one object tier; :meth:`BlockingRequests.close` shuts
its threads down, and the next request starts new ones.
"""

from __future__ import annotations

import http.client
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ckptd.background import start_thread
from ckptd.config import settings
from ckptd.errors import CkptdError, StorageError
from ckptd.tiers.s3_budget import OperationBudget, backoff_s, install_hooks, run_within_budget
from ckptd.tiers.s3_timestamps import use_fast_timestamps
from ckptd.tiers.s3_errors import is_past_the_end
from ckptd.tiers.s3_transfers import byte_range, object_size, ranged_answer

#: s3fs arguments that change nothing about a request, or that :func:`blocking_client_arguments` translates.
_TRANSLATED = frozenset({"key", "secret", "token", "profile", "anon", "use_ssl", "client_kwargs", "config_kwargs",
                         "max_concurrency", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                         "default_block_size", "default_fill_cache", "default_cache_type", "asynchronous", "loop"})
_names = itertools.count()
_CLOSE_TIMEOUT_S = 5.0
_PIECE_BYTES = 1 << 20
T = TypeVar("T")


def blocking_client_arguments(options: dict[str, Any]) -> dict[str, Any] | None:
    """What :func:`make_blocking_client` needs from the lanes' s3fs arguments, or None when they name
    something only s3fs or aiobotocore knows how to apply (``connector_args`` in ``config_kwargs``...)."""
    from botocore.config import Config

    if set(options) - _TRANSLATED or set(options.get("config_kwargs") or {}) - set(Config.OPTION_DEFAULTS):
        return None
    return dict(options)


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader(borrowed: Any = None) -> Any:
    """One botocore model loader for every blocking client of the process (``borrowed``, a loader an
    aiobotocore session already filled, on first use): a client's first load of the S3 model costs
    about 0.1 s of JSON parsing, a client made with a filled loader 0.05 s."""
    global _loader
    with _loader_lock:
        if _loader is None:
            from botocore.loaders import create_loader

            _loader = borrowed if borrowed is not None else create_loader()
        return _loader


def make_blocking_client(arguments: dict[str, Any], *, loader: Any = None) -> Any:
    """A botocore S3 client made from s3fs arguments, as s3fs makes its own (thread-safe). ``loader``:
    a botocore loader whose models it may reuse."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    session = botocore.session.Session(profile=arguments.get("profile"))
    session.register_component("data_loader", _shared_loader(loader))
    use_fast_timestamps(session)
    config_kwargs = dict(arguments.get("config_kwargs") or {})
    if arguments.get("anon"):
        config_kwargs["signature_version"] = UNSIGNED
    client_kwargs = dict(arguments.get("client_kwargs") or {})
    credentials = {"aws_access_key_id": arguments.get("key"), "aws_secret_access_key": arguments.get("secret"),
                   "aws_session_token": arguments.get("token")}
    credentials = {name: value for name, value in credentials.items() if value is not None and name not in client_kwargs}
    if "use_ssl" in arguments and "use_ssl" not in client_kwargs:
        client_kwargs["use_ssl"] = arguments["use_ssl"]
    return session.create_client("s3", config=Config(**config_kwargs), **credentials, **client_kwargs)


class BlockingRequests:
    """The blocking client and its threads (see the module docstring). ``budget()`` makes the retry
    budget of one request. Thread safety: every method may be called from any thread."""

    def __init__(self, arguments: dict[str, Any], budget: Callable[[], OperationBudget],
                 loader: Callable[[], Any] = lambda: None) -> None:
        self._arguments = arguments
        self._budget = budget
        self._loader = loader
        self._lock = threading.Lock()
        self._client: Any = None
        self._pool: _DaemonPool | None = None
        self._handlers: list[tuple[str, Callable[..., Any]]] = []

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                client = make_blocking_client(self._arguments, loader=self._loader())
                install_hooks(client, blocking=True)
                for event, handler in self._handlers:
                    client.meta.events.register(event, handler)
                self._client = client
            return self._client

    def on_event(self, event: str, handler: Callable[..., Any]) -> None:
        """Register ``handler`` for botocore's ``event`` on this client, and on the next one after a close."""
        with self._lock:
            self._handlers.append((event, handler))
            client = self._client
        if client is not None:
            client.meta.events.register(event, handler)

    def new_budget(self) -> OperationBudget:
        """A fresh retry budget for one operation."""
        return self._budget()

    def get(self, bucket: str, key: str, start: int, length: int,
            budget: OperationBudget | None = None) -> tuple[bytes, int]:
        """One ranged GET as one operation (spending from ``budget``, else a fresh one): the bytes and the
        object's total size (a range past the end: no bytes). A body that arrives short or stalls is
        fetched again while the budget lasts."""
        return self._ranged(bucket, key, start, length, budget, lambda response, body: ranged_answer(
            response, body.read(), start), past_the_end=(b"", start))

    def get_into(self, bucket: str, key: str, start: int, view: memoryview,
                 budget: OperationBudget | None = None) -> tuple[int, int]:
        """One ranged GET of ``len(view)`` bytes from ``start``, read straight into ``view``
        (:func:`read_body_into`): the bytes filled and the object's total size, as :meth:`get`. botocore's
        own checks of the body (length, a response checksum) are left out: the caller checks the bytes
        (promotion and restore compare every chunk's digest), and this method the length."""

        def into(response: dict[str, Any], body: Any) -> tuple[int, int]:
            announced = response.get("ContentLength")
            if announced is not None and announced > len(view):
                raise StorageError(f"the store answered a GET of {len(view)} bytes from {start} with {announced}",
                                   path=f"s3://{bucket}/{key}", hint="the store must honour Range requests (S3 does)")
            filled = read_body_into(body, view)
            if announced is not None and filled != announced:
                raise ConnectionError(f"body truncated: {filled} of {announced} bytes")
            return filled, object_size(response, start + filled)

        return self._ranged(bucket, key, start, len(view), budget, into, past_the_end=(0, start))

    def _ranged(self, bucket: str, key: str, start: int, length: int, budget: OperationBudget | None,
                consume: Callable[[dict[str, Any], Any], T], *, past_the_end: T) -> T:
        """One ranged GET whose answer ``consume(response, body)`` makes; a body that breaks off is
        fetched again while the budget lasts; ``past_the_end`` when the range starts past the object's end."""
        client = self.client
        budget = budget if budget is not None else self._budget()

        def attempt() -> T:
            retry = 0
            while True:
                try:
                    response = client.get_object(Bucket=bucket, Key=key, Range=byte_range(start, length))
                except Exception as exc:
                    if is_past_the_end(exc):
                        return past_the_end
                    raise
                body = response["Body"]
                try:
                    return consume(response, body)
                except CkptdError:
                    raise
                except Exception:
                    if not budget.take(connect_failure=False):
                        raise
                    time.sleep(backoff_s(retry))
                    retry += 1
                finally:
                    body.close()

        return run_within_budget(budget, attempt)

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """``call()`` on one of the pool's threads (``s3_concurrency`` of them; started again after a close).
        Queued under the lock, so that a close either cancels it or comes after it."""
        with self._lock:
            if self._pool is None:
                self._pool = _DaemonPool(max(1, settings().s3_concurrency), f"ckptd-s3-data-{next(_names)}")
            return self._pool.submit(call)

    def put(self, bucket: str, key: str, body: bytes | bytearray, **arguments: Any) -> dict[str, Any]:
        """One PUT of a whole object as one operation."""
        client = self.client
        return run_within_budget(self._budget(),
                                 lambda: client.put_object(Bucket=bucket, Key=key, Body=body, **arguments))

    def close(self) -> None:
        """Cancel the requests not started, wait up to 5 s for the threads to end after the ones running
        (which the timeouts and the retry budget bound) and close the idle connections."""
        with self._lock:
            pool, self._pool = self._pool, None
            client, self._client = self._client, None
        if pool is not None:
            pool.shutdown(_CLOSE_TIMEOUT_S)
        if client is not None:
            client.close()


def read_body_into(body: Any, view: memoryview) -> int:
    """Read a GET's streaming body into ``view`` until the body or the view ends; the bytes filled.

    A body of urllib3 over http.client without a content encoding (every body from S3, which stores the
    bytes as sent) is read by http.client straight into ``view``: no buffer of the body's size is made
    and copied, which costs a restore about half its CPU. Its connection goes back to the pool once the
    body is read to its end. Any other body is read piece by piece. A failure of the read raises what
    botocore's own read raises (ReadTimeoutError, ResponseStreamingError)."""
    raw = getattr(body, "_raw_stream", None)
    source = getattr(raw, "_fp", None)
    encoding = str(getattr(raw, "headers", {}).get("content-encoding", "") or "").lower()
    if not isinstance(source, http.client.HTTPResponse) or encoding not in ("", "identity"):
        return _read_pieces_into(body, view)
    from botocore import exceptions as boto

    filled = 0
    try:
        while filled < len(view):
            count = source.readinto(view[filled:])
            if not count:
                break
            filled += count
    except TimeoutError as exc:
        raise boto.ReadTimeoutError(endpoint_url=getattr(raw, "geturl", lambda: "")() or "", error=exc) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise boto.ResponseStreamingError(error=exc) from exc
    if source.isclosed():  # read to its end: the connection can serve the next request
        raw.release_conn()
    return filled


def _read_pieces_into(body: Any, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        piece = body.read(min(_PIECE_BYTES, len(view) - filled))
        if not piece:
            break
        view[filled:filled + len(piece)] = piece
        filled += len(piece)
    return filled


class _DaemonPool:
    """``count`` daemon threads (:func:`ckptd.background.start_thread`) running submitted calls. Not
    :class:`ckptd.background.TaskPool`: its :class:`~concurrent.futures.ThreadPoolExecutor` threads are
    joined at interpreter exit, so a GET stuck until its read timeouts would hold the exit."""

    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [start_thread(f"{name}_{index}", self._work) for index in range(count)]

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, call))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)

    def shutdown(self, timeout_s: float) -> None:
        """Cancel the calls not started, and wait up to ``timeout_s`` for the threads to end."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join_within(deadline - time.monotonic())


__all__ = ["BlockingRequests", "blocking_client_arguments", "make_blocking_client", "read_body_into"]
