"""Ranks forked from a process that has already imported torch (``ckptd launch``'s default; ``--no-preload``
starts every rank as a new interpreter).

Without a warm spare, a replacement rank's recovery is almost all its own start: ``import torch`` (2-3 s
on a 2-core machine) and the first optimizer build (about 2 s, the lazy import of ``torch._dynamo``).
By default the supervisor starts one :mod:`multiprocessing` fork server per node that imports
:data:`PRELOAD` once, single-threaded and without touching CUDA, and forks every rank (and spare) from
it: the rank then runs the job's script or module as ``__main__`` (:mod:`runpy`) with its environment,
argv and unbuffered stdout/stderr, and finds those modules already imported; its random generators
(torch's, numpy's, :mod:`random`) are seeded afresh, as in a new interpreter (:func:`fresh_random_state`). Unlike a warm spare it holds
no model, optimizer or device memory while it waits: only the imported modules, shared with the ranks
copy-on-write.

:class:`PreloadedProcess` gives the supervisor the part of :class:`subprocess.Popen` it uses (``pid``,
``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``, ``returncode``). A rank dies with the fork
server (``PR_SET_PDEATHSIG``), and the fork server with the supervisor (:mod:`ckptd.elastic.fork_server_guard`).
"""

from __future__ import annotations

import atexit
import ctypes
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext
from typing import Any, TypeAlias

from ckptd.background import start_thread
from ckptd.elastic.log_routing import redirect_from_environment
from ckptd.elastic.waiting import wait_for
from ckptd.errors import WorkerError

_NO_PRELOAD_HINT = "see the supervisor's stderr for the fork server's error; --no-preload starts every rank as a " \
                   "new interpreter instead"

#: What the fork server imports before it forks the first rank.
PRELOAD = ("ckptd.elastic.fork_server_guard", "torch", "torch._dynamo", "torch.optim", "torch.distributed", "ckptd",
           "ckptd.elastic")


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, errors="backslashreplace")


def _inherited_stdin() -> io.TextIOWrapper | Any:
    """The supervisor's stdin, which :mod:`multiprocessing` replaced with /dev/null in the child (so that
    ``breakpoint()`` in a rank reads the terminal as it does without ``--preload``)."""
    try:
        os.fstat(0)
    except OSError:
        return sys.stdin
    return io.TextIOWrapper(io.FileIO(0, "r", closefd=False))


def fresh_random_state() -> None:
    """Seed the global random generators from fresh entropy, as a new interpreter does: torch's default CPU
    generator, numpy's global state (when numpy is imported; otherwise its import seeds it) and :mod:`random`.
    A forked rank would otherwise start with the fork server's state, the same on every rank and every
    replacement. (CUDA's generators are not initialised in the fork server; they start as in a new process.)"""
    import random

    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_rank(command: Sequence[str], environment: dict[str, str]) -> None:  # pragma: no cover - a forked rank
    """In the forked rank: become ``python [-u] [-m] SCRIPT ARGS...`` with ``environment``."""
    die_with_parent()  # with the fork server, which dies with the supervisor
    fresh_random_state()
    os.environ.clear()
    os.environ.update(environment)
    redirect_from_environment(environment)
    sys.stdout, sys.stderr = _unbuffered(1), _unbuffered(2)
    sys.stdin = _inherited_stdin()
    arguments = list(command[2:] if tuple(command[1:2]) == ("-u",) else command[1:])  # the interpreter's -u only
    # sys.path[0] is the fork server's (the supervisor's: its script's folder, or the ckptd console script's);
    # python puts the current directory there for -m and the script's folder for a script
    first = os.getcwd() if arguments and arguments[0] == "-m" else os.path.dirname(os.path.abspath(arguments[0]))
    sys.path[:1] = [first]
    try:
        if arguments[0] == "-m":
            sys.argv = [arguments[1], *arguments[2:]]
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(arguments)
            runpy.run_path(arguments[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        # as the interpreter does with an uncaught exception: sys.excepthook prints it (torch's, once the
        # process group exists, prefixes each line with [rankN]:), and the exit status is 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, past the atexit hooks


class PreloadedProcess:
    """A rank forked by a :class:`PreloadedStarter`, with the :class:`subprocess.Popen` calls the supervisor
    makes. ``returncode`` is the exit status, or minus the signal that ended it, as for Popen."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


#: What the supervisor starts a rank or spare as.
RankProcess: TypeAlias = "subprocess.Popen[bytes] | PreloadedProcess"


class PreloadedStarter:
    """Forks ranks from this node's fork server (started, and :data:`PRELOAD` imported, on the first
    :meth:`start`; started again by :mod:`multiprocessing` if it died)."""

    def __init__(self, environment: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self._context: ForkServerContext = multiprocessing.get_context("forkserver")  # type: ignore[assignment]
        self._context.set_forkserver_preload(list(preload))
        self._environment = environment

    def warm(self, timeout_s: float) -> None:
        """Start the fork server and wait until it imported :data:`PRELOAD` (seconds; logged while it lasts,
        DeadlineError past ``timeout_s``): a supervisor does this before it joins the job, since it sends no
        heartbeat while it waits and the other nodes would take it for lost after ``--node-timeout``."""
        self._ensure_running()  # on this thread: the server dies with the thread that started it
        probe: Any = self._context.Process(target=_nothing, name="ckptd-preload-probe")
        # start() blocks until the server, its imports done, forks the probe: on a thread of its own, so
        # that this wait can log and give up
        starting = start_thread("ckptd-preload-probe", _start_and_join, probe)
        wait_for(lambda: not starting.alive, what="this node's fork server to import torch and ckptd "
                 "(--preload)", timeout_s=timeout_s, poll_s=0.02, hint=_NO_PRELOAD_HINT)
        if probe.exitcode != 0:
            raise WorkerError(f"this node's fork server could not start a process (its probe ended with "
                              f"{probe.exitcode})", hint=_NO_PRELOAD_HINT)

    def start(self, command: Sequence[str], environment: dict[str, str]) -> PreloadedProcess:
        """Fork ``command`` (``python [-u] [-m] SCRIPT ARGS...``) with ``environment`` as a rank."""
        self._ensure_running()
        process: Any = self._context.Process(target=_run_rank, args=(tuple(command), environment),
                                             name="ckptd-rank")
        process.start()
        return PreloadedProcess(process)

    def _ensure_running(self) -> None:
        from multiprocessing import forkserver

        saved = dict(os.environ)
        try:  # the fork server starts with the ranks' environment (libraries read some of it at import)
            os.environ.update(self._environment)
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _start_and_join(process: Any) -> None:
    process.start()
    process.join()


def _nothing() -> None:  # pragma: no cover - forked
    """The probe :meth:`PreloadedStarter.warm` forks."""
