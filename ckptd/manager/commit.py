"""How the ranks of a job agree that a step is committed.

Every rank writes its data and index, then reports success (its manifest entry) or failure. Rank 0
collects all reports; if every rank succeeded it builds the manifest, otherwise the step fails on every
rank with a :class:`~ckptd.errors.WorkerError` naming each failed rank. Agreement goes through the job's
c10d ``Store`` (plain key/value calls with deadlines), never through collectives, so it is safe to run
from a background thread while training issues collectives on the process group.

A rank that skips a step because its previous save is still being written (``Policy.on_busy="skip"``)
reports the step as skipped; the step then fails quietly on every rank (:class:`SkippedStep`).

Restore uses the same store, on the training thread, through :meth:`StoreCoordinator.exchange`: every
rank publishes a JSON value and reads everyone's (see :mod:`ckptd.manager.restoring`).

After the agreement every rank writes the manifest into its local tier and confirms it through the store
(:meth:`StoreCoordinator.confirm`), so a step counts as committed locally only when it is committed in
every rank's directory (and a shared directory is never touched by a rank's cleanup while another rank
still commits into it).

Thread: commit rounds (:meth:`agree`, :meth:`confirm`) run on the writer thread, exchange rounds on the
training thread;
each kind has its own round counter and key prefix, and each is called in the same order on all ranks.

Incarnations: launchers such as ``torchrun --max-restarts`` keep the job's store across restart attempts,
so keys written by an earlier attempt are still there, under the same names. Every key of a
:class:`StoreCoordinator` therefore lives under ``<prefix>/g<generation>/``, where the generation is agreed
when the coordinator is built (:meth:`StoreCoordinator.join`): rank 0 takes a new number from a store
counter, every other rank joins the newest number with a fresh nonce, and rank 0 publishes the roster of
nonces it saw. A rank accepts a generation only when the roster holds its own nonce, so an answer of an
earlier attempt is never read as one of this attempt.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from ckptd.errors import CommitError, UndecidedCommitError, WorkerError

#: Error text a rank reports for a step it skipped because it was busy.
SKIPPED = "skipped: the previous save was still being written"


class SkippedStep(CommitError):
    """A step was skipped by at least one rank (back-pressure); nothing was committed, nothing failed."""
from ckptd.format.records import Manifest, RankEntry

log = logging.getLogger("ckptd.commit")


class CommitCoordinator(Protocol):
    """Call order: each rank calls :meth:`agree` once per save, in the same order on every rank."""

    rank: int
    world_size: int

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        """Report this rank's outcome; returns the manifest bytes every rank must commit, or raises
        WorkerError when any rank failed (SkippedStep when ranks only skipped it)."""

    def exchange(self, kind: str, value: Any) -> list[Any]:
        """Publish a JSON value and return every rank's value, by rank (training thread only)."""

    def confirm(self, step: int, error: str | None) -> dict[int, str]:
        """After :meth:`agree` and the local manifest write (writer thread): report whether this rank
        wrote its manifest and wait for every rank; returns the ranks that could not, with why."""


class SingleProcessCoordinator:
    """The coordinator for one process (no process group)."""

    rank = 0
    world_size = 1

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        if entry is None:
            raise WorkerError(f"step {step} failed", {0: error or "unknown error"}, step=step)
        return build([entry]).to_json_bytes()

    def exchange(self, kind: str, value: Any) -> list[Any]:
        return [value]

    def confirm(self, step: int, error: str | None) -> dict[int, str]:
        return {0: error} if error is not None else {}


class StoreCoordinator:
    """Agreement through a c10d ``Store`` shared by all ranks (the job's TCPStore)."""

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float,
                 prefix: str = "ckptd") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.root_prefix = prefix
        self.generation = 0
        self.prefix = prefix
        self._round = 0
        self._exchanges = 0
        self.join()

    def join(self) -> int:
        """Agree with every rank on a new generation and scope all later keys to it; returns it.

        Every rank calls it (the constructor does), on the training thread. Call it again, on every rank,
        when the job's ranks are re-formed in the same store (an in-process restart)."""
        counter = f"{self.root_prefix}/generation"
        nonce = uuid.uuid4().hex
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.rank == 0:
            generation = int(self.store.add(counter, 1))
            base = f"{self.root_prefix}/join/{generation}"
            keys = [f"{base}/member/{rank}" for rank in range(1, self.world_size)]
            try:
                if keys:
                    self.store.wait(keys, self.timeout)
            except Exception as exc:  # c10d raises a plain RuntimeError/DistStoreError on timeout
                missing = [rank for rank in range(1, self.world_size)
                           if not self.store.check([f"{base}/member/{rank}"])]
                raise CommitError(f"ranks {missing} did not join generation {generation} within {self.timeout}",
                                  hint="start every rank of the job, with the same store") from exc
            roster = {"0": nonce} | {key.rsplit("/", 1)[1]: self.store.get(key).decode() for key in keys}
            self.store.set(f"{base}/roster", json.dumps(roster))
        else:
            generation = self._join_as_member(counter, nonce, deadline)
        # the prefix first: a reader that sees the new generation (the promotion schedule renumbers its keys
        # then) must not combine it with the old prefix
        self.prefix = f"{self.root_prefix}/g{generation}"
        self.generation = generation
        self._round = 0
        self._exchanges = 0
        log.debug("rank %d joined store generation %d", self.rank, generation)
        return generation

    def _join_as_member(self, counter: str, nonce: str, deadline: float) -> int:
        """Join the newest generation rank 0 opened; rejoin a newer one until a roster names our nonce."""
        joined: int | None = None
        while True:
            newest = int(self.store.add(counter, 0))
            if newest > 0 and newest != joined:
                joined = newest
                self.store.set(f"{self.root_prefix}/join/{joined}/member/{self.rank}", nonce)
            if joined is not None:
                roster_key = f"{self.root_prefix}/join/{joined}/roster"
                if self.store.check([roster_key]):
                    roster = json.loads(self.store.get(roster_key))
                    if roster.get(str(self.rank)) == nonce:
                        return joined
            if time.monotonic() > deadline:
                raise CommitError(f"rank 0 did not open a store generation for rank {self.rank} within "
                                  f"{self.timeout}", hint="start every rank of the job, with the same store")
            time.sleep(0.02)

    def exchange(self, kind: str, value: Any) -> list[Any]:
        self._exchanges += 1
        return self._gather(f"{self.prefix}/exchange/{self._exchanges}/{kind}", value,
                            what=f"answer the {kind!r} round")

    def _gather(self, base: str, value: Any, *, what: str, step: int | None = None) -> list[Any]:
        """Publish this rank's JSON value under ``base``, wait for every rank's, return them by rank."""
        self.store.set(f"{base}/{self.rank}", json.dumps(value))
        keys = [f"{base}/{rank}" for rank in range(self.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as exc:  # c10d raises a plain RuntimeError/DistStoreError on timeout
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            raise CommitError(f"ranks {missing} did not {what} within {self.timeout}", step=step,
                              hint="a rank may have died; the supervisor will restart it") from exc
        values = [json.loads(self.store.get(key)) for key in keys]
        self._leave(base)
        return values

    def _leave(self, base: str) -> None:
        """End a round: rank 0 (which usually hosts the store) waits until every rank has read what it
        needed, so that it never exits while another rank still reads from the store."""
        self.store.set(f"{base}/left/{self.rank}", "1")
        if self.rank == 0:
            try:
                self.store.wait([f"{base}/left/{rank}" for rank in range(self.world_size)], self.timeout)
            except Exception:  # noqa: BLE001 - a rank that died no longer needs the store
                log.warning("not every rank left store round %s within %s", base, self.timeout)

    def agree(self, step: int, entry: RankEntry | None, error: str | None,
              build: Callable[[list[RankEntry]], Manifest]) -> bytes:
        self._round += 1
        # The step is part of the key: ranks whose rounds slipped out of step wait on different keys and
        # time out with a clear error, instead of reading another step's report.
        base = f"{self.prefix}/commit/{self._round}-step{step}"
        report = {"entry": entry.to_json() if entry else None, "error": error}
        self.store.set(f"{base}/rank/{self.rank}", json.dumps(report))
        if self.rank == 0:
            self._decide(step, base, build)
        try:  # rank 0 decides within one timeout of its own report: wait longer than that for its answer
            self.store.wait([f"{base}/outcome"], 2 * self.timeout)
        except Exception as exc:  # c10d raises a plain RuntimeError/DistStoreError on timeout
            raise UndecidedCommitError(f"no commit decision for step {step} within {2 * self.timeout}",
                                       step=step, hint="rank 0 may have died; the supervisor will restart it "
                                       "(this rank's files are kept: the step may still be committed)") from exc
        outcome = json.loads(self.store.get(f"{base}/outcome"))
        if outcome["failures"]:
            self._leave(base)
            failures = {int(rank): why for rank, why in outcome["failures"].items()}
            if all(why == SKIPPED for why in failures.values()):
                raise SkippedStep(f"step {step} was skipped by busy rank(s) {sorted(failures)}", step=step)
            raise WorkerError(f"step {step} failed on {len(failures)} rank(s); nothing was committed",
                              failures, step=step)
        return outcome["manifest"].encode()

    def confirm(self, step: int, error: str | None) -> dict[int, str]:
        reports = self._gather(f"{self.prefix}/commit/{self._round}-step{step}/written", error, step=step,
                               what=f"confirm writing the manifest of step {step}")
        return {rank: why for rank, why in enumerate(reports) if why is not None}

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
            entries = [RankEntry.from_json(r["entry"], step=step, path=f"{base}/rank/{rank}")
                       for rank, r in enumerate(reports)]
            try:  # a manifest that cannot be built fails the step on every rank, none waits for it in vain
                manifest = build(entries).to_json_bytes().decode()
            except CommitError as error:
                failures = {0: str(error)}
        self.store.set(f"{base}/outcome", json.dumps({"failures": failures, "manifest": manifest}))
