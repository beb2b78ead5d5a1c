"""One generation's view of the job store: every key under ``gen{g}/``, refused once the generation ends.

A :class:`GenerationStore` is what a rank hands its :class:`~ckptd.CheckpointManager` (``store=``). It
answers the calls the manager's commit rounds make (``set``, ``get``, ``add``, ``check``, ``wait``,
``compare_set``) through a c10d ``PrefixStore``. When the supervisor starts a new generation the worker
ends the view (:meth:`GenerationStore.end`): every later call, and every call still waiting, raises
:class:`~ckptd.errors.GenerationEndedError` within one poll. A writer thread stuck in a commit round for a
rank that died is released at once instead of at the commit timeout, and a stale process cannot write
into the new generation. Thread-safe: the training and writer threads share one view.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptd.errors import GenerationEndedError
from ckptd.elastic.keys import generation_prefix
from ckptd.elastic.waiting import wait_for

#: Longest pause between two looks at the keys a ``wait`` waits for.
_POLL_S = 0.005


class GenerationStore:
    """The keys of one generation (see the module docstring)."""

    def __init__(self, store: Any, generation: int) -> None:
        self.generation = generation
        #: The underlying c10d store of this generation (for ``init_process_group``), not revocable.
        self.raw = dist.PrefixStore(generation_prefix(generation), store)
        self._ended = threading.Event()
        self._why = ""

    def end(self, why: str) -> None:
        """Refuse every later call, and release every call waiting, with GenerationEndedError."""
        self._why = why
        self._ended.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def raise_if_ended(self) -> None:
        """Raise GenerationEndedError, naming why, once the generation has ended."""
        self._check_open()

    def _check_open(self) -> None:
        if self._ended.is_set():
            raise GenerationEndedError(f"store generation {self.generation} has ended: {self._why}",
                                       hint="the rank leaves this generation and joins the next one")

    def set(self, key: str, value: str | bytes) -> None:
        self._check_open()
        self.raw.set(key, value)

    def add(self, key: str, amount: int) -> int:
        self._check_open()
        return int(self.raw.add(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._check_open()
        return self.raw.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._check_open()
        return bool(self.raw.check(keys))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.raw.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists; raise GenerationEndedError when the generation ends first, and
        DeadlineError after ``timeout`` (default: the store's own timeout), logging while it waits."""
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        wait_for(lambda: self.check(keys), what=f"store key(s) {shown} of generation {self.generation}",
                 timeout_s=(timeout or self.raw.timeout).total_seconds(), poll_s=_POLL_S)
