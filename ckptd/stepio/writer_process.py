"""The writer process: hashing, encoding, writing and the local commit outside the trainer's interpreter.

A training loop that holds the GIL (pure-Python work between steps) starves any writer thread of its own
process: each chunk's bookkeeping waits for the GIL, and a 2 MB step took 0.46-0.79 s to commit beside
such a loop on a node whose other core was busy. :class:`WriterProcess` runs the write in a separate
interpreter instead, started once per :class:`~ckptd.manager.saving.Saver` (``python -m
ckptd.stepio.writer_process``: a fresh interpreter that imports only the write path, never torch and never
the trainer's ``__main__``, so a script without a ``__main__`` guard is safe). The trainer stages the state
into shared-memory buffers (:mod:`ckptd.stepio.shared_memory`) and sends the small plan (names, segments,
offsets, dtypes, shapes, the index's values) as JSON over a pipe; the process maps the buffers, writes the
rank's data files and index with :class:`~ckptd.stepio.rank_writer.RankWriter` and answers with the
rank's manifest entry. With one rank (no agreement needed) it builds the manifest and commits the step in
the same request; with several, the trainer's writer thread agrees through the c10d store and sends the
agreed manifest back to be committed here (:meth:`WriterProcess.commit`).

The process keeps the settings snapshot sent with each request (``override()`` in the trainer applies),
runs at ``CKPTD_WRITER_PROCESS_NICE`` (its pool threads inherit it) and exits when told to stop or when the
trainer's end of the pipe closes. It never commits a step once the trainer is gone (it checks its parent
before every commit), so a step is committed only while its trainer lives, as with the thread writer.

A reply records the time of the local commit (``time.monotonic()``, the same clock in every process) and
the newest step the trainer had reached then: the trainer writes each step it is called for into a small
shared segment (:meth:`WriterProcess.note_step`), read at the commit.

Errors come back typed: a :class:`~ckptd.errors.CkptdError` raised in the process is raised again in the
trainer as the same class (message, step, file, tier, hint); anything else as a
:class:`~ckptd.errors.StorageError` naming the writer process. A process that dies (killed, out of
memory) is seen within ``CKPTD_WRITER_POLL_S`` and fails the step in progress with
:class:`~ckptd.errors.WriterProcessError`; the next request starts a new process. Every wait has a
deadline. Thread: one caller at a time (the Saver's writer thread; ``close`` from the training thread
once that thread has stopped).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ckptd import errors
from ckptd.config import Settings, settings
from ckptd.errors import CkptdError, DeadlineError, StorageError, WriterProcessError
from ckptd.stepio.shared_memory import (SegmentCache, create_segment, remove_orphans, remove_segment_file,
                                       remove_segments_of)

log = logging.getLogger("ckptd.save")

_STEP_FORMAT = "<q"
_NO_STEP = -1
#: Seconds the process waits for its trainer to exit once the pipe closed, before removing its segments.
_PARENT_EXIT_WAIT_S = 5.0
#: Seconds the trainer waits for a writer process it found dead (or whose pipe broke) to exit, before it
#: kills it (and again after the kill).
_DIED_WAIT_S = 5.0


def _error_json(error: BaseException) -> dict[str, Any]:
    if isinstance(error, CkptdError):
        return {"type": type(error).__name__, "ckptd": True, "message": error.message, "path": error.path,
                "step": error.step, "tier": error.tier, "hint": error.hint,
                "failures": {str(k): v for k, v in getattr(error, "failures", {}).items()}
                if isinstance(getattr(error, "failures", None), dict) else None}
    return {"type": type(error).__name__, "ckptd": False, "message": str(error)}


def _error_from_json(body: dict[str, Any], *, step: int | None) -> CkptdError:
    """The error a writer process reported, as the class it raised (a CkptdError) or a StorageError."""
    kind = getattr(errors, str(body.get("type")), None) if body.get("ckptd") else None
    if isinstance(kind, type) and issubclass(kind, CkptdError):
        fields = {"path": body.get("path"), "step": body.get("step"), "tier": body.get("tier"),
                  "hint": body.get("hint")}
        try:
            if issubclass(kind, errors.WorkerError):
                failures = {int(k): v for k, v in (body.get("failures") or {}).items()}
                return kind(body["message"], failures, **fields)
            return kind(body["message"], **fields)
        except TypeError:  # a class with another constructor: keep its words
            pass
    return StorageError(f"the writer process failed: {body.get('type')}: {body.get('message')}", step=step,
                        tier="local", hint="see the message; the step was not committed")


# --- the writer process ---------------------------------------------------------------------------------
class _Serve:
    """The loop of the writer process: one request at a time, one reply each."""

    def __init__(self, requests: Connection, replies: Connection) -> None:
        self.requests, self.replies = requests, replies
        self.parent = os.getppid()
        self.segments = SegmentCache()
        self.tiers: dict[str, Any] = {}

    def run(self) -> None:
        self.replies.send_bytes(json.dumps({"ready": os.getpid()}).encode())
        while True:
            try:
                raw = self.requests.recv_bytes()
            except (EOFError, OSError):  # the trainer is gone: nobody else frees its staging memory
                self.segments.close()  # (a live trainer closes the pipe only after "stop" or with a kill)
                self._await_parent_exit()
                remove_segments_of(self.parent)  # those whose owner lock is free (see shared_memory)
                return
            request = json.loads(raw)
            if request.get("op") == "stop":
                self.segments.close()
                return
            try:
                reply = self.handle(request)
            except BaseException as error:  # noqa: BLE001 - every failure goes back to the trainer
                reply = {"ok": False, "error": _error_json(error)}
            reply["id"] = request.get("id")
            try:
                self.replies.send_bytes(json.dumps(reply).encode())
            except OSError:
                return

    def _await_parent_exit(self, timeout_s: float = _PARENT_EXIT_WAIT_S) -> None:
        """Wait (a bounded while) until the trainer has exited, not only closed the pipe: its descriptors,
        the one holding its segments' owner lock among them, are all released by the time this process is
        given another parent."""
        deadline = time.monotonic() + timeout_s
        while os.getppid() == self.parent and time.monotonic() < deadline:
            time.sleep(0.01)

    def _tier(self, root: str) -> Any:
        from ckptd.tiers.local import LocalTier

        tier = self.tiers.get(root)
        if tier is None:
            tier = self.tiers[root] = LocalTier(root)
        return tier

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        options = dataclasses.replace(Settings(**request["settings"]), background_nice=0)
        if op == "write":
            return self.write(request, options)
        if op == "commit":
            return self.commit(request, self._tier(request["root"]))
        if op == "discard":
            from ckptd.format.layout import rank_files
            from ckptd.tiers.atomicity import DirectoryCommit

            tier = self._tier(request["root"])
            DirectoryCommit(tier).discard(request["step"], rank_files(tier.list_files(request["step"]),
                                                                       request["rank"]))
            return {"ok": True}
        raise ValueError(f"unknown writer request {op!r}")

    def write(self, request: dict[str, Any], options: Settings) -> dict[str, Any]:
        from ckptd.stepio.rank_writer import RankWriter, RawTensor
        from ckptd.tiers.atomicity import DirectoryCommit

        tier = self._tier(request["root"])
        step, rank = request["step"], request["rank"]
        self.segments.keep_only(set(request["segments"]) | {request.get("clock") or ""})
        DirectoryCommit(tier).check_writable(step)
        writer = RankWriter(tier, step, rank, codec=request["codec"], chunk_bytes=options.chunk_bytes,
                            options=options)
        try:
            for name, segment, offset, length, dtype, shape, itemsize, floating in request["tensors"]:
                view = self.segments.view(segment, offset, length) if length else memoryview(b"")
                writer.add(name, RawTensor(view, dtype, tuple(shape), itemsize, floating))
            entry = writer.finish(request["values"])
        except BaseException:
            writer.abort()
            raise
        reply: dict[str, Any] = {"ok": True, "entry": entry.to_json()}
        single = request.get("commit")
        if single is not None:  # one rank: the manifest is this entry alone
            from ckptd.format.records import Manifest

            manifest = Manifest(step=step, world_size=1, ranks=(entry,), codec=request["codec"])
            try:
                reply.update(self.commit({"step": step, "manifest": manifest.to_json_bytes().decode(),
                                          "world_size": 1, "ranks_here": single["ranks_here"],
                                          "clock": request.get("clock")}, tier))
            except BaseException:
                from ckptd.format.layout import rank_files

                DirectoryCommit(tier).discard(step, rank_files(tier.list_files(step), rank))
                raise
        return reply

    def commit(self, request: dict[str, Any], tier: Any) -> dict[str, Any]:
        from ckptd.tiers.atomicity import DirectoryCommit

        step = request["step"]
        if os.getppid() != self.parent:
            raise WriterProcessError("the training process ended before the step was committed; it is not "
                                     "committed", step=step, tier=tier.label)
        DirectoryCommit(tier).commit(step, request["manifest"].encode(), world_size=request["world_size"],
                                     ranks_here=request["ranks_here"])
        committed_at = time.monotonic()
        newest = None
        clock = request.get("clock")
        if clock:
            (value,) = struct.unpack_from(_STEP_FORMAT, self.segments.view(clock, 0, 8))
            newest = None if value == _NO_STEP else value
        return {"ok": True, "committed_at": committed_at, "newest_step": newest}


def main(argv: list[str]) -> int:
    """Entry point of the writer process: ``python -m ckptd.stepio.writer_process READ_FD WRITE_FD NICE``."""
    read_fd, write_fd, nice = int(argv[0]), int(argv[1]), int(argv[2])
    if nice > 0 and hasattr(os, "setpriority"):
        try:  # before any thread starts: the pool threads inherit it
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the job goes to the trainer, which stops us
    logging.basicConfig(level=logging.WARNING, format="ckptd writer process: %(levelname)s %(message)s")
    remove_orphans()
    _Serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False)).run()
    return 0


# --- the trainer's side ---------------------------------------------------------------------------------
class WriterProcess:
    """The trainer's handle on its writer process (see the module docstring): start, requests with
    deadlines, death detection, stop.

    ``nice``: the priority increment of the process (default ``CKPTD_WRITER_PROCESS_NICE``)."""

    def __init__(self, *, nice: int | None = None) -> None:
        self.nice = settings().writer_process_nice if nice is None else nice
        self._process: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._ready = False
        self._ids = 0
        self.starts = 0
        self._options: Settings | None = None
        self._options_json = "{}"
        self._clock = create_segment(mmap.PAGESIZE)
        self._clock_name = self._clock.name  # its file goes at close()
        struct.pack_into(_STEP_FORMAT, self._clock.memory, 0, _NO_STEP)
        self.start()

    @property
    def pid(self) -> int | None:
        """The process id of the running writer process (None before the first start or after close)."""
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start a writer process (the previous one, if any, must have ended)."""
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        package_parent = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "ckptd.stepio.writer_process", str(child_read), str(child_write),
                 str(max(0, self.nice))],
                pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        except BaseException:
            for fd in (parent_read, parent_write):
                os.close(fd)
            raise
        finally:
            os.close(child_read)
            os.close(child_write)
        self._requests = Connection(parent_write, readable=False)
        self._replies = Connection(parent_read, writable=False)
        self._ready = False
        self.starts += 1

    def note_step(self, step: int) -> None:
        """Record the newest step the training loop reached (read by the process at each commit)."""
        struct.pack_into(_STEP_FORMAT, self._clock.memory, 0, step)

    def request(self, body: dict[str, Any], *, what: str, step: int | None) -> dict[str, Any]:
        """Send one request and return its reply (:meth:`send`, then :meth:`receive`)."""
        sent = self.send(body)
        if sent is None:
            raise self._died(what, step)
        return self.receive(sent, what=what, step=step)

    def send(self, body: dict[str, Any]) -> int | None:
        """Send one request (starting a process first when none runs); returns its id, None when the process
        died before it took the request (:meth:`receive` then reports it). The training thread sends a save's
        request itself, so that the write starts without waiting for any thread of the trainer."""
        options = settings()
        if not self.alive:
            self._reap()
            self.start()
        self._ids += 1
        if options != self._options:  # serialised again only when a setting changed
            self._options, self._options_json = options, json.dumps(dataclasses.asdict(options))
        body = dict(body, id=self._ids, clock=self._clock_name)
        raw = json.dumps(body)[:-1] + f', "settings": {self._options_json}}}'
        assert self._requests is not None
        try:
            self._requests.send_bytes(raw.encode())
        except OSError:
            return None
        return self._ids

    def receive(self, sent: int, *, what: str, step: int | None) -> dict[str, Any]:
        """The reply to request ``sent``; raises the process's error (typed), WriterProcessError when the
        process died, DeadlineError (and kills the process) after ``CKPTD_WRITER_TIMEOUT_S``."""
        options = settings()
        deadline = time.monotonic() + options.writer_timeout_s
        while True:
            reply = self._receive(what, step, deadline, options.writer_poll_s)
            if "ready" in reply:
                self._ready = True
                continue
            if reply.get("id") != sent:
                continue  # the answer to a request given up on before
            if not reply.get("ok"):
                raise _error_from_json(reply.get("error") or {}, step=step)
            return reply

    def _receive(self, what: str, step: int | None, deadline: float, poll_s: float) -> dict[str, Any]:
        if self._replies is None:
            raise self._died(what, step)
        while True:
            try:
                if self._replies.poll(max(0.001, min(poll_s, deadline - time.monotonic()))):
                    return json.loads(self._replies.recv_bytes())
            except (EOFError, OSError) as error:
                raise self._died(what, step) from error
            if not self.alive:
                raise self._died(what, step)
            if time.monotonic() >= deadline:
                self.kill()
                raise DeadlineError(f"the writer process did not finish {what} within "
                                    f"{settings().writer_timeout_s:g} s; it was stopped", step=step, tier="local",
                                    hint="the local tier may hang (check the disk); raise CKPTD_WRITER_TIMEOUT_S "
                                         "if it is only slow")

    def lost(self, what: str, step: int | None) -> WriterProcessError:
        """The error for a process that died during ``what`` (it is reaped; the next request starts another)."""
        return self._died(what, step)

    def _died(self, what: str, step: int | None) -> WriterProcessError:
        process = self._process
        code = None
        killed = None  # the pid of a process killed here
        if process is not None:
            try:
                code = process.wait(timeout=_DIED_WAIT_S)
            except subprocess.TimeoutExpired:  # the pipe broke but the process lives (stopped, hung): end it
                killed = process.pid
                process.kill()
                try:
                    code = process.wait(timeout=_DIED_WAIT_S)
                except subprocess.TimeoutExpired:
                    code = None  # unkillable for now (uninterruptible I/O): _reap() tries again, bounded
        if killed is not None:
            how = f"stopped answering (its pipe closed) and was killed (pid {killed})"
        elif code is not None and code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        try:
            self._reap()
        except subprocess.TimeoutExpired:
            pass  # forgotten all the same (_reap drops the handle first); the error below is what matters
        return WriterProcessError(f"the writer process {how} during {what}; the step was not committed",
                                  step=step, tier="local",
                                  hint="earlier committed steps are intact; the next save starts a new writer "
                                       "process (check the system log for an out-of-memory kill)")

    def _reap(self) -> None:
        for connection in (self._requests, self._replies):
            if connection is not None:
                connection.close()
        self._requests = self._replies = None
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5.0)

    def kill(self) -> None:
        """Kill the process at once (a request in flight fails)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def close(self, timeout_s: float) -> None:
        """Ask the process to stop and wait for it at most ``timeout_s`` seconds, then kill it."""
        process = self._process
        if process is not None and process.poll() is None and self._requests is not None:
            try:
                self._requests.send_bytes(json.dumps({"op": "stop"}).encode())
            except OSError:
                pass
            try:
                process.wait(timeout=max(0.0, timeout_s))
            except subprocess.TimeoutExpired:
                log.warning("the writer process %d did not stop within %g s: killed", process.pid, timeout_s)
                process.kill()
        self._reap()
        remove_segment_file(self._clock_name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
