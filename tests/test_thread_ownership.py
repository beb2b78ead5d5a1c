"""Every thread and pool ckptd starts is owned by ``ckptd/background.py`` (issue #27): a scan of the source
fails, naming file and line, on any other module that starts a thread or a pool itself, however the name
was imported; and the threads ``background`` starts for others are named and stop with a deadline."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from ckptd.background import OwnedThread, start_thread
from ckptd.errors import StillRunningError

PACKAGE = Path(__file__).resolve().parent.parent / "ckptd"
OWNER = PACKAGE / "background.py"
# ckptd/testing/ is the public test kit (its fault proxy serves HTTP on threads, its suite races writers),
# which runs beside the code under test, not inside it
HARNESS = PACKAGE / "testing"

#: Callables that start a thread or a pool, by their full dotted name.
STARTERS = frozenset({
    "threading.Thread", "threading.Timer", "_thread.start_new_thread", "_thread.start_new",
    "concurrent.futures.ThreadPoolExecutor", "concurrent.futures.ProcessPoolExecutor",
    "concurrent.futures.thread.ThreadPoolExecutor", "concurrent.futures.process.ProcessPoolExecutor",
    "multiprocessing.Pool", "multiprocessing.pool.Pool", "multiprocessing.pool.ThreadPool",
    "multiprocessing.dummy.Pool",
})


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import of the module (nested ones too)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # ``import a.b`` binds ``a``
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The full dotted name ``node`` refers to through the module's imports, or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def starts_in(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, dotted name) of every call of a thread or pool starter in ``source``, and of every class
    that subclasses one."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            candidates = [node.func]
        elif isinstance(node, ast.ClassDef):
            candidates = list(node.bases)
        else:
            continue
        for candidate in candidates:
            name = _dotted(candidate, aliases)
            if name in STARTERS:
                found.append((node.lineno, name))
    return sorted(found)


def _product_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path != OWNER and HARNESS not in path.parents)


def test_no_module_but_background_starts_a_thread_or_pool() -> None:
    modules = _product_modules()
    assert len(modules) > 50, "the scan found the package"
    offenders = [f"ckptd/{path.relative_to(PACKAGE)}:{line}: {name}"
                 for path in modules for line, name in starts_in(path.read_text(encoding="utf-8"), str(path))]
    assert not offenders, ("only ckptd/background.py starts threads and pools (start_thread, BackgroundWorker, "
                           "TaskPool, run_jobs); these modules start their own:\n" + "\n".join(offenders))


def test_the_scan_sees_every_way_of_importing_a_starter() -> None:
    source = """
import threading
import threading as th
import concurrent.futures
import concurrent.futures as cf
import multiprocessing.pool
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor as Pool, ProcessPoolExecutor
from threading import Timer
from _thread import start_new_thread
from multiprocessing.pool import ThreadPool

threading.Thread(target=print)
th.Thread(target=print)
concurrent.futures.ThreadPoolExecutor(2)
cf.ProcessPoolExecutor()
futures.ThreadPoolExecutor()
Pool(4)
ProcessPoolExecutor()
Timer(1.0, print)
start_new_thread(print, ())
ThreadPool(2)
multiprocessing.pool.Pool(2)

class Worker(th.Thread):
    def helper(self):
        from threading import Thread as Named
        return Named(target=print)

threading.Event().wait(0)
concurrent.futures.Future()
Thread = object
Thread()
"""
    found = starts_in(source)
    assert [line for line, _ in found] == list(range(13, 24)) + [25, 28]
    assert {name for _, name in found} == {
        "threading.Thread", "threading.Timer", "concurrent.futures.ThreadPoolExecutor",
        "concurrent.futures.ProcessPoolExecutor", "_thread.start_new_thread", "multiprocessing.pool.ThreadPool",
        "multiprocessing.pool.Pool"}


# --- the API that the other modules use ------------------------------------------------------------------

def test_a_started_thread_is_named_and_stops_within_its_deadline() -> None:
    stop = threading.Event()
    ran: list[str] = []

    def run(label: str) -> None:
        ran.append(label)
        stop.wait()

    thread = start_thread("ckptd-test-owned", run, "first", stop=stop.set)
    assert isinstance(thread, OwnedThread) and thread.name == "ckptd-test-owned"
    assert any(live.name == "ckptd-test-owned" and live.daemon for live in threading.enumerate())
    thread.stop_within(30)  # a generous deadline: only a hang reaches it
    assert not thread.alive and ran == ["first"]
    assert thread.join_within(0), "an ended thread has ended at once"


def test_a_thread_that_does_not_end_within_its_deadline_is_reported_and_left_running() -> None:
    release = threading.Event()
    thread = start_thread("ckptd-test-stuck", release.wait)
    try:
        assert not thread.join_within(0.01)
        with pytest.raises(StillRunningError) as caught:
            thread.stop_within(0.01)
        assert "ckptd-test-stuck" in str(caught.value) and "ckptd-test-stuck" in caught.value.running
        with pytest.raises(StillRunningError, match="the stuck job did not stop"):
            thread.stop_within(0, what="the stuck job")
        assert thread.alive, "giving up leaves the thread alone"
    finally:
        release.set()
    assert thread.join_within(30)


def test_a_thread_waiting_for_itself_does_not_hang() -> None:
    answers: list[bool] = []
    holder: list[OwnedThread] = []
    ready = threading.Event()

    def run() -> None:
        ready.wait()
        answers.append(holder[0].join_within(None))

    holder.append(start_thread("ckptd-test-self", run))
    ready.set()
    assert holder[0].join_within(30)
    assert answers == [False]
