"""Rank 0's promotion decisions through the job's c10d store (a
:class:`~ckptd.promotion.schedule.PromotionSchedule`).

Decision ``k`` is the key ``<coordinator prefix>/promotion/<k>``, holding the step number or ``closed``.
The keys live under the :class:`~ckptd.manager.commit.StoreCoordinator`'s generation prefix, so a
decision of an earlier incarnation of the job is never read as one of this incarnation. When the
coordinator joins a new generation (an in-process restart, or a survivor's manager moved to a new store),
the numbering of keys starts again at 1 while the indices the uploader sees keep growing.

The steps each rank holds pinned (:meth:`StorePromotionSchedule.share_pins`) are the key
``<coordinator prefix>/promotion/pins/<rank>`` (a JSON list), in the same generation scope.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ckptd.errors import CommitError
from ckptd.manager.commit import StoreCoordinator
from ckptd.promotion.schedule import Decision

#: The value of the decision that says rank 0's uploader closed.
CLOSED = "closed"
#: A wait for the next decision looks for it after this pause, doubled at each look up to the second.
_WAIT_POLL_FIRST_S = 0.005
_WAIT_POLL_MAX_S = 0.1


class StorePromotionSchedule:
    """:class:`~ckptd.promotion.schedule.PromotionSchedule` over a coordinator's store (thread-safe)."""

    def __init__(self, coordinator: StoreCoordinator) -> None:
        self.coordinator = coordinator
        self._lock = threading.Lock()
        self._announced = 0
        #: The store and generation the keys are numbered for (see :meth:`_follow_generation`).
        self._generation: tuple[Any, int] = (coordinator.store, coordinator.generation)
        #: Indices of earlier generations: decision ``index`` of this generation is key ``index - offset``.
        self._offset = 0

    def announce(self, step: int) -> int:
        with self._lock:
            self._follow_generation(self._announced)
            self._announced += 1
            self._set(self._announced, str(step))
            return self._announced

    def announce_closing(self) -> None:
        with self._lock:
            self._follow_generation(self._announced)
            self._set(self._announced + 1, CLOSED)

    def _decision_key(self, after_index: int) -> tuple[int, str]:
        with self._lock:
            self._follow_generation(after_index)
            return after_index + 1, self._key(after_index + 1)

    def wait_for_decision(self, after_index: int, timeout_s: float) -> None:
        # Polls with short checks, 5 ms apart at first, then up to 100 ms: a c10d store client serves one request
        # at a time, so a blocking wait would hold up every other user of the job's store in this process (the
        # save path, the commit exchange) for as long as it waits
        if timeout_s <= 0:
            return
        deadline, pause = time.monotonic() + timeout_s, _WAIT_POLL_FIRST_S
        while True:
            with self._lock:
                if self._generation != (self.coordinator.store, self.coordinator.generation):
                    return  # a new generation: the read that follows numbers its keys
                key = self._key(after_index + 1)
            try:
                if self.coordinator.store.check([key]):
                    return
            except Exception:  # noqa: BLE001 - a store gone away is reported by the read that follows
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _WAIT_POLL_MAX_S)

    def next_decision(self, after_index: int, timeout_s: float) -> Decision | None:
        self.wait_for_decision(after_index, timeout_s)
        index, key = self._decision_key(after_index)
        store = self.coordinator.store
        try:
            if not store.check([key]):
                return None
            value = store.get(key).decode()
        except Exception as exc:  # noqa: BLE001 - the store went away (rank 0, its host, has exited)
            raise CommitError(f"could not read rank 0's promotion decision {index} from the job's store: {exc}",
                              hint="rank 0 may have exited or died; its steps stay pinned and are promoted at "
                              "the next start") from exc
        return Decision(index, None if value == CLOSED else int(value))

    def share_pins(self, steps: Sequence[int]) -> None:
        try:
            self.coordinator.store.set(self._pins_key(self.coordinator.rank), json.dumps(sorted(steps)))
        except Exception as exc:  # noqa: BLE001 - c10d store errors are plain RuntimeErrors
            raise CommitError(f"could not publish the steps rank {self.coordinator.rank} holds pinned in the job's "
                              f"store: {exc}", hint="the job's store (hosted by rank 0) is unreachable") from exc

    def shared_pins(self, timeout_s: float) -> dict[int, list[int]]:
        store = self.coordinator.store
        keys = {rank: self._pins_key(rank) for rank in range(self.coordinator.world_size)}
        try:
            if timeout_s > 0:
                try:
                    store.wait(list(keys.values()), timedelta(seconds=timeout_s))
                except Exception:  # noqa: BLE001 - c10d raises a plain RuntimeError/DistStoreError on timeout
                    pass
            return {rank: [int(step) for step in json.loads(store.get(key))]
                    for rank, key in keys.items() if store.check([key])}
        except Exception as exc:  # noqa: BLE001 - the store went away (rank 0, its host, has exited)
            raise CommitError(f"could not read the steps the ranks hold pinned from the job's store: {exc}",
                              hint="rank 0 may have exited or died; the steps stay pinned and are settled at the "
                              "next start") from exc

    def _pins_key(self, rank: int) -> str:
        return f"{self.coordinator.prefix}/promotion/pins/{rank}"

    def _follow_generation(self, last_index: int) -> None:
        """Under the lock: after a new generation, number this generation's keys from 1 again."""
        store, generation = self.coordinator.store, self.coordinator.generation
        if store is not self._generation[0] or generation != self._generation[1]:
            self._generation = (store, generation)
            self._offset = last_index

    def _key(self, index: int) -> str:
        return f"{self.coordinator.prefix}/promotion/{index - self._offset}"

    def _set(self, index: int, value: str) -> None:
        try:
            self.coordinator.store.set(self._key(index), value)
        except Exception as exc:  # noqa: BLE001 - c10d store errors are plain RuntimeErrors
            raise CommitError(f"could not announce promotion decision {index} ({value}) in the job's store: {exc}",
                              hint="the job's store (hosted by rank 0) is unreachable") from exc
