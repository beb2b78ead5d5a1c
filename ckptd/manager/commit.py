"""How the ranks of a job agree that a step is committed.

Every rank writes its data and index, then reports success (its manifest entry) or failure. Rank 0
collects all reports; if every rank succeeded it builds the manifest, otherwise the step fails on every
rank with a :class:`~ckptd.errors.WorkerError` naming each failed rank. Agreement goes through the job's
c10d ``Store`` (plain key/value calls with deadlines), never through collectives, so it is safe to run
from a background thread while training issues collectives on the process group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from ckptd.errors import CommitError, WorkerError
from ckptd.format.records import Manifest, RankEntry


class CommitCoordinator(Protocol):
    """Call order: each rank calls :meth:`agree` once per save, in the same order on every rank."""

    rank: int
    world_size: int

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        """Report this rank's outcome; returns the manifest bytes every rank must commit, or raises
        WorkerError when any rank failed."""


class SingleProcessCoordinator:
    """The coordinator for one process (no process group)."""

    rank = 0
    world_size = 1

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        if entry is None:
            raise WorkerError(f"step {step} failed", {0: error or "unknown error"}, step=step)
        return build([entry]).to_json_bytes()


class StoreCoordinator:
    """Agreement through a c10d ``Store`` shared by all ranks (the job's TCPStore)."""

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float,
                 prefix: str = "ckptd") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.prefix = prefix
        self._round = 0

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        self._round += 1
        base = f"{self.prefix}/commit/{self._round}"
        report = {"entry": entry.to_json() if entry else None, "error": error}
        self.store.set(f"{base}/rank/{self.rank}", json.dumps(report))
        if self.rank == 0:
            self._decide(step, base, build)
        try:
            self.store.wait([f"{base}/outcome"], self.timeout)
        except Exception as exc:  # c10d raises a plain RuntimeError/DistStoreError on timeout
            raise CommitError(f"no commit decision for step {step} within {self.timeout}", step=step,
                              hint="rank 0 may have died; the supervisor will restart it") from exc
        outcome = json.loads(self.store.get(f"{base}/outcome"))
        if outcome["failures"]:
            failures = {int(rank): why for rank, why in outcome["failures"].items()}
            raise WorkerError(f"step {step} failed on {len(failures)} rank(s); nothing was committed",
                              failures, step=step)
        return outcome["manifest"].encode()

    def _decide(self, step: int, base: str, build: Callable[[list[RankEntry]], Manifest]) -> None:
        keys = [f"{base}/rank/{rank}" for rank in range(self.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as exc:
            missing = {rank: "no report before the commit timeout" for rank in range(self.world_size)
                       if not self.store.check([keys[rank]])}
            self.store.set(f"{base}/outcome", json.dumps({"failures": missing, "manifest": None}))
            raise CommitError(f"ranks {sorted(missing)} did not report step {step}", step=step) from exc
        reports = [json.loads(self.store.get(key)) for key in keys]
        failures = {rank: r["error"] for rank, r in enumerate(reports) if r["entry"] is None}
        manifest = None
        if not failures:
            entries = [RankEntry(**r["entry"]) for r in reports]
            manifest = build(entries).to_json_bytes().decode()
        self.store.set(f"{base}/outcome", json.dumps({"failures": failures, "manifest": manifest}))
