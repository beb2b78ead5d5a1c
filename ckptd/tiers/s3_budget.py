"""One retry budget per object-tier operation, on top of botocore's own retry decisions.

botocore (``standard`` mode) knows which failures are worth repeating (connection errors, throttling,
5xx, transient codes); left alone, it gives every *request* its own attempts, so an operation made of
many requests (a multipart upload's parts, a large read's ranges) multiplies them, and s3fs repeats
whole calls on top. Here each operation (one :meth:`IoLanes.run` or ``submit``) gets one
:class:`OperationBudget`: a hook that runs before botocore's retry handler asks botocore's own retry
conditions whether a failure is retryable; if so, the retry spends from the budget and waits a
full-jitter exponential back-off (``s3_backoff_base_s`` doubling, capped at ``s3_backoff_max_s``); once
the budget is spent the failure is raised as it is (and :mod:`ckptd.tiers.s3_errors` classifies it).
Retries after a connection could not be made at all spend from a smaller allowance too, so a dead
endpoint is known within about two connect timeouts; a store that accepts connections and then stays
silent costs a read timeout per attempt of the budget (the metadata client's are short).

The budget lives in a context variable of the operation's task; the tasks it starts (the parts of a
multipart upload) inherit it. The hooks are installed on each botocore client the first time s3fs
creates it (:func:`budgeted_filesystem_class`). Requests made outside an operation keep botocore's
per-request limit.
"""

from __future__ import annotations

import contextvars
import functools
import random
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ckptd.config import settings
from ckptd.tiers.s3_timestamps import use_fast_timestamps

_current: contextvars.ContextVar[OperationBudget | None] = contextvars.ContextVar("ckptd_s3_budget", default=None)
_HOOKED = "_ckptd_budget_hooks"


@dataclass
class OperationBudget:
    """Retries left to one operation, and what it has sent so far (for logs and tests).

    Thread safety: used from one event loop; the lock only guards against a caller reading it."""

    retries: int
    connect_retries: int
    requests: int = 0
    retried: int = 0
    connect_retried: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, *, connect_failure: bool) -> bool:
        """Spend one retry; False when the operation has none left (the failure is then raised)."""
        with self._lock:
            if self.retried >= self.retries or (connect_failure and self.connect_retried >= self.connect_retries):
                return False
            self.retried += 1
            self.connect_retried += int(connect_failure)
            return True


def current_budget() -> OperationBudget | None:
    """The budget of the operation running in this task, if any."""
    return _current.get()


async def within_budget(budget: OperationBudget, factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``factory()`` as one operation spending from ``budget``."""
    token = _current.set(budget)
    try:
        return await factory()
    finally:
        _current.reset(token)


def run_within_budget(budget: OperationBudget, call: Callable[[], Any]) -> Any:
    """Run ``call()`` on this thread as one operation spending from ``budget`` (a blocking client's)."""
    token = _current.set(budget)
    try:
        return call()
    finally:
        _current.reset(token)


def _is_connect_failure(exc: BaseException | None) -> bool:
    """Whether no connection could be made (refused, connect timeout, unknown host). A connection reset
    mid-request (also an EndpointConnectionError to botocore) is not one: the store was there."""
    import socket

    from botocore import exceptions as boto

    if isinstance(exc, (boto.ConnectTimeoutError, boto.ProxyConnectionError)):
        return True
    if not isinstance(exc, boto.EndpointConnectionError):
        return False
    cause = getattr(exc, "kwargs", {}).get("error")
    return cause is None or isinstance(cause, socket.gaierror) or type(cause).__name__ in {
        "ClientConnectorError", "ClientConnectorDNSError", "ClientConnectorCertificateError",  # aiohttp
        "NewConnectionError", "NameResolutionError"}  # urllib3 (the blocking client)


@functools.lru_cache(maxsize=1)
def _conditions() -> Any:
    """botocore's own test of whether a failure is worth a retry (attempt limit aside), for aiobotocore."""
    from aiobotocore.retries.standard import AioStandardRetryConditions

    return AioStandardRetryConditions(max_attempts=1 << 30)


@functools.lru_cache(maxsize=1)
def _blocking_conditions() -> Any:
    """The same test for a blocking botocore client."""
    from botocore.retries.standard import StandardRetryConditions

    return StandardRetryConditions(max_attempts=1 << 30)


def backoff_s(retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (0-based) of an operation: full jitter, capped."""
    tunables = settings()
    return random.uniform(0.0, min(tunables.s3_backoff_max_s, tunables.s3_backoff_base_s * 2 ** retry))


def _retry_context(kwargs: dict[str, Any]) -> tuple[OperationBudget, Any] | None:
    budget = _current.get()
    if budget is None or (kwargs.get("response") is None and kwargs.get("caught_exception") is None):
        return None
    from botocore.retries.standard import RetryEventAdapter

    return budget, RetryEventAdapter().create_retry_context(**kwargs)


def _spend(budget: OperationBudget, kwargs: dict[str, Any]) -> float | bool:
    retry = budget.retried
    if not budget.take(connect_failure=_is_connect_failure(kwargs.get("caught_exception"))):
        return False
    return backoff_s(retry)


async def _retry_within_budget(**kwargs: Any) -> float | bool | None:
    """``needs-retry`` hook, run before botocore's own: for a failure botocore deems worth retrying, the
    jittered delay when the operation's budget pays for one more retry, False (raise it) when not."""
    found = _retry_context(kwargs)
    if found is None or not await _conditions().is_retryable(found[1]):
        return None  # botocore will not retry either
    return _spend(found[0], kwargs)


def _retry_within_budget_blocking(**kwargs: Any) -> float | bool | None:
    """:func:`_retry_within_budget` for a blocking botocore client."""
    found = _retry_context(kwargs)
    if found is None or not _blocking_conditions().is_retryable(found[1]):
        return None
    return _spend(found[0], kwargs)


def _count_request(**_: Any) -> None:
    budget = _current.get()
    if budget is not None:
        budget.requests += 1


def install_hooks(client: Any, *, blocking: bool = False) -> None:
    """Make a botocore S3 client (aiobotocore's, or with ``blocking=True`` a plain botocore one) spend from
    the current operation's budget (once per client)."""
    if getattr(client, _HOOKED, False):
        return
    events = client.meta.events
    events.register_first("needs-retry.s3", _retry_within_budget_blocking if blocking else _retry_within_budget,
                          unique_id="ckptd-retry-budget")
    events.register("before-send.s3", _count_request, unique_id="ckptd-request-count")
    setattr(client, _HOOKED, True)


@functools.lru_cache(maxsize=1)
def budgeted_filesystem_class() -> type:
    """``s3fs.S3FileSystem`` whose botocore clients spend from operation budgets."""
    import s3fs

    class BudgetedS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
        """s3fs with ckptd's retry-budget hooks on every client it creates."""

        async def set_session(self, *args: Any, **kwargs: Any) -> Any:
            client = await super().set_session(*args, **kwargs)
            if not getattr(client, _HOOKED, False):  # s3fs calls set_session before every request
                use_fast_timestamps(self.session)
                install_hooks(client)
            return client

    return BudgetedS3FileSystem


__all__ = ["OperationBudget", "backoff_s", "budgeted_filesystem_class", "current_budget", "install_hooks",
           "run_within_budget", "within_budget"]
