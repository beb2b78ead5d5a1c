"""DataLoader workers whose garbage collector leaves alone what they inherited from the training process.

A forked worker holds a copy of every object of its parent, garbage included, but none of its threads. If
the worker's collector frees an inherited object whose C++ destructor joins a thread (a gloo process group
left in a reference cycle, for one), the destructor waits on a thread that does not exist in the worker:
the worker hangs or aborts ("terminate called after throwing an instance of 'std::system_error'"), and the
DataLoader reports that it "exited unexpectedly". Objects frozen in the child at the fork are never
collected there; their memory is the parent's copy-on-write pages anyway.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_this_thread = threading.local()


def _hold_the_collector() -> None:
    # "before" hooks run in the reverse order of registration, so this one runs ahead of the hooks other
    # modules registered earlier (threading, logging, random); the child's "after" hooks then run their Python
    # code with the collector off, until the inherited objects are frozen
    if getattr(_this_thread, "starting_workers", False):
        _this_thread.collector_was_on = gc.isenabled()
        gc.disable()


def _release_the_collector_in_the_parent() -> None:
    if getattr(_this_thread, "starting_workers", False) and _this_thread.collector_was_on:
        gc.enable()


def _freeze_what_the_worker_inherited() -> None:
    if getattr(_this_thread, "starting_workers", False):
        gc.freeze()
        if _this_thread.collector_was_on:
            gc.enable()


os.register_at_fork(before=_hold_the_collector, after_in_parent=_release_the_collector_in_the_parent,
                    after_in_child=_freeze_what_the_worker_inherited)


@contextmanager
def workers_leave_inherited_objects_alone() -> Iterator[None]:
    """While inside, a process this thread forks freezes what it inherited before its collector can run."""
    _this_thread.starting_workers = True
    try:
        yield
    finally:
        _this_thread.starting_workers = False
