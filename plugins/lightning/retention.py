"""Retention that follows Lightning: a step goes when no checkpoint path points to it any more.

``ModelCheckpoint`` decides what to keep (``save_top_k``, ``last.ckpt``) and calls ``remove_checkpoint``
for the rest. :class:`PointerRetention` counts, per ckptd step, the paths of this process that point to
it; a step that was pointed to and no longer is may be deleted, on every tier it is kept with. The
CheckpointIO also points it at the pointers an earlier run left in a directory it saves to or loads from
(a resumed run keeps the steps those name). Steps no known path ever named are kept. The newest
committed step is never deleted.
"""

from __future__ import annotations

import threading


class PointerRetention:
    """A :class:`ckptd.RetentionPolicy` fed by the CheckpointIO: :meth:`point` and :meth:`unpoint` run on
    the training thread, :meth:`deletable` on ckptd's writer and upload threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[str, int] = {}
        self._released: set[int] = set()

    def __getstate__(self) -> dict[str, object]:  # a spawning strategy (ddp_spawn) pickles the plugins
        with self._lock:
            return {"paths": dict(self._paths), "released": set(self._released)}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._lock = threading.Lock()
        self._paths = dict(state["paths"])  # type: ignore[call-overload]
        self._released = set(state["released"])  # type: ignore[call-overload]

    def point(self, path: str, step: int) -> None:
        """``path`` now points to ``step`` (it may have pointed to another step before)."""
        with self._lock:
            previous = self._paths.get(path)
            self._paths[path] = step
            self._released.discard(step)
            if previous is not None and previous != step and previous not in self._paths.values():
                self._released.add(previous)

    def unpoint(self, path: str) -> int | None:
        """``path`` was removed; returns the step it pointed to (None if this process did not know it)."""
        with self._lock:
            step = self._paths.pop(path, None)
            if step is not None and step not in self._paths.values():
                self._released.add(step)
            return step

    def step_of(self, path: str) -> int | None:
        """The step ``path`` points to, if this process wrote or read that pointer."""
        with self._lock:
            return self._paths.get(path)

    def deletable(self, committed: list[int]) -> list[int]:
        """The committed steps no path points to any more, except the newest."""
        if not committed:
            return []
        newest = max(committed)
        with self._lock:
            return sorted(step for step in committed if step in self._released and step != newest)
