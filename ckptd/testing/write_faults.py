"""A fault injector around the real file layer: hold or fail the data-file writes of chosen steps.

:class:`WriteFaults` wraps :meth:`ckptd.tiers.local.AtomicFile.write_at` (the call that writes every
chunk of a step's data files) for as long as it is installed. A write into a chosen step's data file
either blocks until :meth:`WriteFaults.release` (``hang_steps``) or raises the
:class:`~ckptd.errors.StorageError` that a disk I/O error would raise (``fail_steps``); every other write
goes to the real file unchanged. It patches the class, so it acts on every tier of the process; install
it in the process (or the rank) whose writes should misbehave.

Use it as a context manager (it releases held writes and restores the real method on exit)::

    with WriteFaults(hang_steps={2}) as faults:
        manager.save(2, state)
        faults.entered.wait(10)     # the write of step 2 is now held
        ...
        faults.release()
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ckptd.errors import StorageError
from ckptd.format.layout import step_dir
from ckptd.tiers.local import AtomicFile


class WriteFaults:
    """Holds (``hang_steps``) or fails (``fail_steps``) writes into the data files of those steps."""

    def __init__(self, *, hang_steps: Iterable[int] = (), fail_steps: Iterable[int] = (),
                 hang_limit_s: float = 120.0) -> None:
        self.hang_dirs = {step_dir(step) for step in hang_steps}
        self.fail_dirs = {step_dir(step) for step in fail_steps}
        self.hang_limit_s = hang_limit_s
        #: Set when a write was first held.
        self.entered = threading.Event()
        self._released = threading.Event()
        self._original: Any = None
        #: Data files whose write failed on purpose.
        self.failed: list[str] = []

    def install(self) -> WriteFaults:
        if self._original is not None:
            return self
        original = self._original = AtomicFile.write_at
        faults = self

        def write_at(handle: AtomicFile, offset: int, data: Any) -> None:
            parent = handle.final.parent.name
            if parent in faults.fail_dirs:
                faults.failed.append(handle.final.name)
                raise StorageError("writing failed: [Errno 5] Input/output error (injected)",
                                   path=f"{parent}/{handle.final.name}", tier="local")
            if parent in faults.hang_dirs:
                faults.entered.set()
                faults._released.wait(faults.hang_limit_s)
            original(handle, offset, data)

        AtomicFile.write_at = write_at  # type: ignore[method-assign]
        return self

    def release(self) -> None:
        """Let held writes (and later ones) go on."""
        self._released.set()

    def uninstall(self) -> None:
        self.release()
        if self._original is not None:
            AtomicFile.write_at = self._original  # type: ignore[method-assign]
            self._original = None

    def __enter__(self) -> WriteFaults:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
