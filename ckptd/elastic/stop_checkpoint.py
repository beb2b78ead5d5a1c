"""A stop that takes a final checkpoint (``ckptd launch --checkpoint-on-stop``): which step every rank saves
before it leaves a stopping job.

When SIGTERM or SIGINT reaches a supervisor of such a job, its stop request (``elastic/stop``) says
``checkpoint``. A rank looks for the request at every save through a manager of
:meth:`~ckptd.elastic.WorkerContext.checkpoint_manager`, in the store itself (a rank that relied on its
watcher thread could pass the agreed step before the thread saw the request). The first rank that sees it
sets its generation's stop step (compare-and-set: the first proposal stands) to the step after the one it
is saving; every rank goes on to that step, saves it whatever the policy says, waits for its local commit
and closes its managers within the stop's deadline (so the step is promoted to the object tier with the
in-process uploader, or handed to the node's daemon), then leaves with exit code 15.

The step after, not the one being saved: a peer may have passed its save of that step, unsaved by its
policy, before the request came, and a commit waits for every rank. Every step's collectives keep the
ranks within one step of each other (data-parallel training), so no rank has passed the step after.
A rank that never saves (only :func:`~ckptd.elastic.heartbeat`) takes no checkpoint: its supervisor ends it
at the stop's deadline.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ckptd.elastic import keys

log = logging.getLogger("ckptd.elastic")

#: Seconds of a stop's deadline a rank leaves for its supervisor (its exit, the SIGTERM that follows).
_EXIT_MARGIN_S = 5.0


def stop_request(store: Any) -> dict[str, Any] | None:
    """The job's stop request (the JSON of ``elastic/stop``), or None while the job runs."""
    if not store.check([keys.STOP]):
        return None
    return dict(json.loads(store.get(keys.STOP)))


def close_timeout_s(request: dict[str, Any] | None, default_s: float) -> float:
    """How long a rank of a stopping job may spend closing its managers: the stop's deadline (``grace_s``)
    less a margin for its exit, or ``default_s`` for a stop without a checkpoint."""
    if request is None or not request.get("checkpoint"):
        return default_s
    return max(1.0, float(request.get("grace_s", default_s)) - _EXIT_MARGIN_S)


class StopCheckpoint:
    """One generation's stop step, as one rank learns it (see the module docstring)."""

    def __init__(self, store: Any, generation: int, rank: int) -> None:
        self.store, self.generation, self.rank = store, generation, rank
        self.request: dict[str, Any] | None = None
        self._step: int | None = None

    def step(self, saving: int) -> int | None:
        """The step to save before leaving (None: no stop with a checkpoint was requested); ``saving`` is the
        step this rank is about to save. One store read per call until a stop is requested."""
        if self._step is not None:
            return self._step
        request = stop_request(self.store)
        if request is None or not request.get("checkpoint"):
            return None
        self.request = request
        key = keys.in_generation(self.generation, keys.STOP_STEP)
        self._step = int(self.store.compare_set(key, "", str(saving + 1)))
        log.warning("rank %d: the job stops (%s): every rank saves step %d, then leaves", self.rank,
                    request.get("message", "?"), self._step)
        return self._step
