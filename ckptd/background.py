"""Background work with an owner: named threads, every failure kept, a deadline on every wait.

ckptd's saver, uploader and shard prefetcher run work off the training thread. They share the parts
here, so that each of them behaves the same way:

- :class:`BackgroundWorker` owns one named thread that runs submitted jobs in order. Every failure is
  kept as a :class:`FailureRecord` (one per step and rank, not only the first) and raised to the caller
  by :meth:`BackgroundWorker.raise_failures` (the saver calls it on its next ``save``, ``wait`` or
  ``close``). :meth:`BackgroundWorker.wait` and :meth:`BackgroundWorker.close` take a deadline; when it
  passes while a job still runs, they raise :class:`~ckptd.errors.StillRunningError` naming the job
  (``"step 12 is still being written on rank 1"``) and leave the thread alone: the owner keeps whatever
  the job needs (the directory lock) and may call ``close`` again later.
- :class:`TaskPool` is a thread pool with an owner that closes it, with named threads and a close that
  gives up after a deadline, naming the tasks still running.
- :func:`start_thread` starts any other named daemon thread (a server's loop, a watcher, a connection)
  as an :class:`OwnedThread`, whose owner stops it its own way (an event, closing a socket) and then
  waits for it with a deadline: :meth:`OwnedThread.join_within` says whether it ended,
  :meth:`OwnedThread.stop_within` raises :class:`~ckptd.errors.StillRunningError` naming it.
- :class:`SharedPools` hands out the process-wide pools by purpose (``"write"``, ``"read"``). A caller
  holds a :class:`PoolLease` while it uses one; when the wanted thread count changes
  (``CKPTD_IO_THREADS``), a new pool takes over and the superseded one is shut down as soon as its last
  lease is released, so that changing a setting never leaks threads.

Thread rules: :class:`BackgroundWorker` methods other than the job itself are called from the owning
(training) thread; :class:`SharedPools`, :class:`TaskPool` and :class:`OwnedThread` are thread-safe.

No other module of ckptd starts a thread or a pool itself (``tests/test_thread_ownership.py`` checks it): an
asyncio loop's executor is a :class:`TaskPool` (:attr:`TaskPool.executor`). The one thread a library starts for
ckptd is watchdog's observer (``daemon/watcher.py``), which its owner stops and joins with a deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ckptd.errors import BackgroundError, CkptdError, DeadlineError, StillRunningError

log = logging.getLogger("ckptd.background")

Job = TypeVar("Job")
Result = TypeVar("Result")


@dataclass(frozen=True)
class FailureRecord:
    """One failure of background work: what failed, for which step and on which rank (None: not known
    or not about a step), and the error itself."""

    what: str
    error: BaseException
    step: int | None = None
    rank: int | None = None

    def describe(self) -> str:
        where = [part for part in (f"step {self.step}" if self.step is not None else "",
                                   f"rank {self.rank}" if self.rank is not None else "") if part]
        return f"{self.what} ({', '.join(where)}): {self.error}" if where else f"{self.what}: {self.error}"


def raise_failures(records: Sequence[FailureRecord]) -> None:
    """Raise the failures of ``records``: the error itself when they share one error (one failure, or one
    error reported for several ranks), else a :class:`~ckptd.errors.BackgroundError` listing every record,
    chained to the first error."""
    if not records:
        return
    distinct: list[BaseException] = []
    for record in records:
        if not any(record.error is seen for seen in distinct):
            distinct.append(record.error)
    if len(distinct) == 1:
        raise distinct[0]
    raise BackgroundError(f"{len(distinct)} background failures", records) from distinct[0]


def deadline_after(timeout_s: float | None) -> float | None:
    """The ``time.monotonic()`` deadline ``timeout_s`` from now (None: no deadline)."""
    return None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative; None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def result_within(future: concurrent.futures.Future[Result], timeout_s: float, what: str, *,
                  hint: str | None = None, step: int | None = None, path: str | None = None) -> Result:
    """``future.result()``, raising :class:`~ckptd.errors.DeadlineError` naming ``what`` after ``timeout_s``."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise DeadlineError(f"gave up after {timeout_s:g} s waiting for {what}", step=step, path=path,
                            hint=hint) from None


def run_jobs(jobs: Sequence[Callable[[], None]], *, threads: int, thread_name_prefix: str) -> None:
    """Run ``jobs`` on at most ``threads`` threads and wait for all of them; the first failure (in job
    order) is raised once the jobs not started yet are cancelled."""
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs))),
                                               thread_name_prefix=thread_name_prefix) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


class OwnedThread:
    """A named daemon thread started by :func:`start_thread`. Its owner stops it the way its target
    expects (an event, closing its socket; the ``stop`` given to :func:`start_thread`), then waits for it
    with a deadline. Thread-safe."""

    def __init__(self, name: str, target: Callable[..., object], args: tuple[Any, ...],
                 stop: Callable[[], None] | None) -> None:
        self._stop = stop
        self._thread = threading.Thread(target=target, args=args, name=name, daemon=True)

    @property
    def name(self) -> str:
        """The thread's name (what logs and ``threading.enumerate()`` show)."""
        return self._thread.name

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def join_within(self, timeout_s: float | None) -> bool:
        """Wait at most ``timeout_s`` seconds (None: until it ends) for the thread to end; returns whether
        it has. Returns False at once when called from the thread itself (it cannot wait for itself)."""
        if self._thread is threading.current_thread():
            return False
        self._thread.join(timeout=None if timeout_s is None else max(0.0, timeout_s))
        return not self._thread.is_alive()

    def stop_within(self, timeout_s: float | None, *, what: str | None = None, hint: str | None = None) -> None:
        """Ask the thread to stop (the ``stop`` given to :func:`start_thread`, if any), then wait at most
        ``timeout_s`` seconds for it to end; raises :class:`~ckptd.errors.StillRunningError` naming it
        (or ``what``) when it has not. The thread is left alone: it may still end later."""
        if self._stop is not None:
            self._stop()
        if self.join_within(timeout_s):
            return
        running = what or f"thread {self.name}"
        waited = "" if timeout_s is None else f" within {timeout_s:g} s"
        raise StillRunningError(f"{running} did not stop{waited}", running=running, hint=hint)

    def _start(self) -> OwnedThread:
        self._thread.start()
        return self


def start_thread(name: str, target: Callable[..., object], *args: Any,
                 stop: Callable[[], None] | None = None) -> OwnedThread:
    """Start ``target(*args)`` on a daemon thread called ``name`` and return it. ``stop`` is how
    :meth:`OwnedThread.stop_within` asks the thread to end (None: the owner does it before it waits)."""
    return OwnedThread(name, target, args, stop)._start()


class BackgroundWorker(Generic[Job]):
    """One named daemon thread that runs ``handle(job)`` for every submitted job, in order.

    ``describe(job)`` says what a job is doing, for deadline errors (``"step 12 is still being written on
    rank 1"``). ``failures(job, error)`` turns a job's exception into the records kept for the caller
    (default: one record without step or rank); ``step_of(job)`` is the step a deadline error names
    (default: the job's ``step`` attribute). ``on_start`` runs first on the thread, ``on_idle`` after
    a job when no other job is queued; their failures are kept like a job's. A job submitted with
    ``busy=True`` counts towards :attr:`busy` until it ends (the saver: its staged buffers are in use).
    """

    def __init__(self, name: str, handle: Callable[[Job], None], *, describe: Callable[[Job], str],
                 failures: Callable[[Job, BaseException], list[FailureRecord]] | None = None,
                 step_of: Callable[[Job], int | None] | None = None,
                 on_start: Callable[[], None] | None = None, on_idle: Callable[[], None] | None = None) -> None:
        self.name = name
        self._handle, self._describe = handle, describe
        self._failures_of = failures
        self._step_of = step_of or (lambda job: getattr(job, "step", None))
        self._on_start, self._on_idle = on_start, on_idle
        self._queue: queue.SimpleQueue[tuple[Job, bool] | None] = queue.SimpleQueue()
        self._state = threading.Condition()
        self._waiting: deque[tuple[Job, bool]] = deque()  # submitted, not started (mirror of the queue)
        self._current: Job | None = None
        self._running = False
        self._pending = 0
        self._busy = 0
        self._dropped = 0  # queued jobs to skip (drop_queued), counted down by the thread
        self._records: list[FailureRecord] = []
        self._stopping = False
        self._thread = start_thread(name, self._run)

    # --- owning thread -------------------------------------------------------------------------
    def submit(self, job: Job, *, busy: bool = False) -> None:
        """Queue a job. Refused with CkptdError once :meth:`close` has begun."""
        with self._state:
            if self._stopping:
                raise CkptdError(f"background worker {self.name} is closing; no new work is accepted")
            self._pending += 1
            self._busy += int(busy)
            self._waiting.append((job, busy))
        self._queue.put((job, busy))

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished (running or queued)."""
        with self._state:
            return self._pending

    @property
    def busy(self) -> bool:
        """Whether a job submitted with ``busy=True`` has not finished."""
        with self._state:
            return self._busy > 0

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (it stops only after :meth:`close`)."""
        return self._thread.alive

    def unfinished(self) -> list[Job]:
        """Jobs not finished: the running one first, then the queued ones in order."""
        with self._state:
            return ([self._current] if self._running and self._current is not None else []) + \
                [job for job, _ in self._waiting]

    def describe_unfinished(self) -> str:
        """What is still running or queued, in words (empty when nothing is)."""
        return "; ".join(self._describe(job) for job in self.unfinished())

    def wait(self, timeout_s: float | None, *, busy_only: bool = False, what: str = "background work",
             hint: str | None = None) -> None:
        """Block until no job is pending (``busy_only``: no busy job), at most ``timeout_s`` seconds;
        then raise :class:`~ckptd.errors.StillRunningError` naming what still runs. Does not raise the
        kept failures (see :meth:`raise_failures`)."""
        def done() -> bool:
            return (self._busy if busy_only else self._pending) == 0
        with self._state:
            if self._state.wait_for(done, timeout=timeout_s):
                return
        self._raise_still_running(timeout_s, what, hint)

    def drop_queued(self) -> list[Job]:
        """Forget the jobs that have not started (they never run); returns them. The running job goes on."""
        with self._state:
            dropped = [job for job, _ in self._waiting]
            for _, busy in self._waiting:
                self._pending -= 1
                self._busy -= int(busy)
            self._dropped += len(self._waiting)
            self._waiting.clear()
            self._state.notify_all()
        return dropped

    def peek_failures(self) -> list[FailureRecord]:
        """The failures kept since the last :meth:`take_failures`, oldest first (they stay kept)."""
        with self._state:
            return list(self._records)

    def take_failures(self) -> list[FailureRecord]:
        """The failures kept since the last call, oldest first; forgets them."""
        with self._state:
            records, self._records = self._records, []
        return records

    def raise_failures(self) -> None:
        """Raise the kept failures (see :func:`raise_failures`) and forget them; nothing when none."""
        raise_failures(self.take_failures())

    def close(self, timeout_s: float | None, *, what: str = "background work", hint: str | None = None) -> None:
        """Let queued jobs finish, then stop the thread; at most ``timeout_s`` seconds in all.

        When jobs still run at the deadline, raises :class:`~ckptd.errors.StillRunningError` naming them
        and leaves the thread running (no new jobs are accepted); call ``close`` again to wait longer.
        Does not raise the kept failures. Safe to call again after it returned."""
        deadline = deadline_after(timeout_s)
        with self._state:
            if not self._stopping:
                self._stopping = True
                self._queue.put(None)
        if not self._thread.join_within(remaining(deadline)):
            self._raise_still_running(timeout_s, what, hint)

    def _raise_still_running(self, timeout_s: float | None, what: str, hint: str | None) -> None:
        jobs = self.unfinished()
        running = self.describe_unfinished() or f"{self.name} is still finishing"
        step = self._step_of(jobs[0]) if jobs else None
        waited = "" if timeout_s is None else f" after {timeout_s:g} s"
        raise StillRunningError(f"{what} did not finish{waited}: {running}", running=running, step=step, hint=hint)

    # --- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            self._guarded(f"{self.name} start", self._on_start)
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, busy = item
            with self._state:
                if self._dropped:
                    self._dropped -= 1
                    continue
                self._waiting.popleft()
                self._current, self._running = job, True
            try:
                self._handle(job)
            except BaseException as error:  # kept, raised on the owning thread
                records = self._records_of(job, error)
                with self._state:
                    self._records.extend(records)
            finally:
                with self._state:
                    self._current, self._running = None, False
                    idle = not self._waiting
            if idle and self._on_idle is not None:
                self._guarded(f"{self.name} upkeep", self._on_idle)
            with self._state:
                self._pending -= 1
                self._busy -= int(busy)
                self._state.notify_all()

    def _records_of(self, job: Job, error: BaseException) -> list[FailureRecord]:
        default = [FailureRecord(self._describe(job), error, step=self._step_of(job))]
        if self._failures_of is None:
            return default
        try:
            return self._failures_of(job, error)
        except Exception:  # noqa: BLE001 - the job's own error must still reach the owner
            log.exception("%s: recording a failure failed", self.name)
            return default

    def _guarded(self, what: str, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # kept, raised on the owning thread
            log.warning("%s failed: %s", what, error)
            with self._state:
                self._records.append(FailureRecord(what, error))


class TaskPool:
    """A thread pool with an owner that closes it: threads named ``<name>_<n>``, and a :meth:`close`
    that gives up after a deadline and names the tasks still running. Thread-safe."""

    def __init__(self, name: str, threads: int, *, initializer: Callable[[], None] | None = None) -> None:
        self.name, self.threads = name, max(1, threads)
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=name,
                                                               initializer=initializer)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool as an executor, for an API that takes one (an asyncio loop's default executor); its
        tasks run on this pool's threads, unnamed, and :meth:`close` still waits for them."""
        return self._executor

    def live_threads(self) -> list[threading.Thread]:
        """The pool's threads that have not ended."""
        # ThreadPoolExecutor keeps every thread it started in ``_threads`` (CPython since 3.2); it offers
        # no public way to join them with a deadline
        return [thread for thread in list(getattr(self._executor, "_threads", ())) if thread.is_alive()]

    def submit(self, fn: Callable[..., Result], *args: Any,
               what: str | None = None) -> concurrent.futures.Future[Result]:
        """Run ``fn(*args)`` on a pool thread; ``what`` names the task in a deadline error."""
        if what is None:
            return self._executor.submit(fn, *args)
        return self._executor.submit(self._named, what, fn, *args)

    def _named(self, what: str, fn: Callable[..., Result], *args: Any) -> Result:
        key = threading.get_ident()
        with self._lock:
            self._running[key] = what
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running.pop(key, None)

    def running(self) -> list[str]:
        """Names of the named tasks running now."""
        with self._lock:
            return sorted(self._running.values())

    @property
    def closed(self) -> bool:
        """Whether the pool accepts no new tasks (closed or retired)."""
        return self._closed

    def retire(self) -> None:
        """Accept no new tasks; the queued and running ones finish, then the threads end (no waiting)."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=False)

    def close(self, timeout_s: float | None = None, *, cancel_queued: bool = True) -> None:
        """Cancel queued tasks (unless ``cancel_queued=False``), then wait for running ones at most
        ``timeout_s`` seconds (None: until they end). Raises :class:`~ckptd.errors.StillRunningError`
        naming the tasks still running at the deadline; their threads then end when the tasks do.
        Must not be called from a thread of this pool. Safe to call twice."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=cancel_queued)
        threads = self.live_threads()
        deadline = deadline_after(timeout_s)
        for thread in threads:
            thread.join(timeout=remaining(deadline))
        still = [thread for thread in threads if thread.is_alive()]
        if still:
            running = ", ".join(self.running()) or f"{len(still)} task(s) of {self.name}"
            raise StillRunningError(f"{self.name} did not stop within {timeout_s or 0:g} s: {running} still "
                                    "running", running=running)

    def __enter__(self) -> TaskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolLease:
    """A claim on a shared pool; the holder calls :meth:`release` (or uses it as a context manager)
    once it submits nothing more and its tasks have ended. Releasing twice releases once."""

    def __init__(self, pool: TaskPool, owner: SharedPools) -> None:
        self.pool, self.owner = pool, owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.owner.release(self.pool)

    def __enter__(self) -> TaskPool:
        return self.pool

    def __exit__(self, *exc: object) -> None:
        self.release()


class SharedPools:
    """The process-wide pools, one current pool per purpose.

    :meth:`lease` returns the current pool for ``(purpose, threads)``, replacing it when the thread
    count differs; a superseded pool is shut down as soon as no lease holds it, and a pool only ever
    leased is shut down when its last lease is released. :meth:`current` serves callers that take a pool
    per task without a lease: such a pool lives until it is superseded or :meth:`shutdown` runs.
    Thread-safe; :meth:`release` must not be called from a thread of the released pool.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, TaskPool] = {}
        self._purpose: dict[TaskPool, str] = {}
        self._leases: dict[TaskPool, int] = {}
        self._unleased: set[TaskPool] = set()  # handed out by current(): kept while they are current

    def lease(self, purpose: str, threads: int, *,
              initializer: Callable[[], None] | None = None) -> PoolLease:
        """Claim the pool for ``purpose`` with ``threads`` threads (see the class docstring)."""
        with self._lock:
            pool = self._pool(purpose, threads, initializer)
            self._leases[pool] = self._leases.get(pool, 0) + 1
            return PoolLease(pool, self)

    def current(self, purpose: str, threads: int, *,
                initializer: Callable[[], None] | None = None) -> TaskPool:
        """The pool for ``purpose`` with ``threads`` threads, for a caller that holds no lease."""
        with self._lock:
            pool = self._pool(purpose, threads, initializer)
            self._unleased.add(pool)
            return pool

    def release(self, pool: TaskPool) -> None:
        """End one lease of ``pool``; shuts it down when nothing holds or may use it any more."""
        with self._lock:
            left = self._leases.get(pool, 0) - 1
            if left > 0:
                self._leases[pool] = left
                return
            self._leases.pop(pool, None)
            purpose = self._purpose.get(pool)
            if purpose is not None and self._current.get(purpose) is pool:
                if pool in self._unleased:
                    return
                del self._current[purpose]
            self._forget(pool)
        pool.close(timeout_s=None, cancel_queued=False)

    def pools(self) -> dict[str, TaskPool]:
        """The current pool of every purpose."""
        with self._lock:
            return dict(self._current)

    def shutdown(self) -> None:
        """Shut down every current pool that no lease holds (tests, interpreter exit)."""
        with self._lock:
            idle = [pool for pool in self._current.values() if pool not in self._leases]
            for pool in idle:
                del self._current[self._purpose[pool]]
                self._forget(pool)
        for pool in idle:
            pool.close(timeout_s=None, cancel_queued=False)

    def _forget(self, pool: TaskPool) -> None:
        self._purpose.pop(pool, None)
        self._unleased.discard(pool)

    def _pool(self, purpose: str, threads: int, initializer: Callable[[], None] | None) -> TaskPool:
        threads = max(1, threads)
        pool = self._current.get(purpose)
        if pool is not None and pool.threads == threads:
            return pool
        replacement = self._current[purpose] = TaskPool(f"ckptd-{purpose}", threads, initializer=initializer)
        self._purpose[replacement] = purpose
        if pool is not None:
            self._unleased.discard(pool)
            if pool not in self._leases:  # nothing holds it: queued tasks finish, then its threads end
                self._forget(pool)
                pool.retire()
        return replacement


#: The process-wide pools (see :class:`SharedPools`).
shared_pools = SharedPools()
