"""Scrub: re-read and re-hash every stored chunk of a tier's committed steps, at a bounded rate, and mend
what is bad from another tier.

:class:`Scrubber` walks the committed steps of one tier with the verifier everything else uses
(:func:`ckptd.stepio.step_reader.verify_step`), paced by a token bucket (:class:`ByteRateLimiter`) that
it consults after every chunk, so a pass never reads faster than ``bytes_per_s`` on average. A pass can
be stopped between two chunks (``should_stop``); the report says which steps it did not finish.

What is found bad is mended, never deleted:

- on a tier that stores chunks by digest (the object tier), each bad chunk or pack object is recorded
  bad (:func:`ckptd.tiers.chunk_health.report_bad_chunk`, so promotion's dedup stops reusing it) and then
  replaced by :func:`ckptd.promotion.repair.repair_objects` from the ``repair_from`` tiers (or another
  step's copy on the tier itself), which checks every copy before and after writing it;
- on a tier that keeps per-rank data files (a local root, a replica directory), the damaged chunk's byte
  range is written again in place with a copy of the same chunk (same digest) read and checked on
  another tier, or in another step of the same tier, then read back and checked. Only the bytes of a
  chunk that fails its digest are ever written, so nothing a committed step holds intact is changed;
  the data file keeps its name and inode (the hard-linked pin of a step waiting for promotion is mended
  with it).

A chunk object that several steps share is read once per pass. Steps that are not committed are never
read nor written, and a step deleted during the pass (retention) is not mended. A problem that is no
chunk (a bad manifest or index, a missing data file, a read the disk refused) is reported and left alone:
the step's owner deals with it (a restore sets a bad local step aside; a promotion uploads a step again).
A tier that is neither (a peer tier, read over HTTP) is scrubbed but not mended: its own daemon mends it.

Threads: one Scrubber is used by one thread at a time (the daemon's scrub worker); the pacing is shared
by every tier that Scrubber scrubs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, ConfigError, IntegrityError, NotFoundError, StorageError, UnsafePathError
from ckptd.format import codecs
from ckptd.format.layout import step_dir
from ckptd.format.records import ChunkRecord
from ckptd.format.verify import decode_verified
from ckptd.promotion.contents import (RankShare, check_stored_chunk, read_step_contents, read_stored_chunk,
                                      stored_chunk_path)
from ckptd.promotion.repair import repair_objects
from ckptd.stepio.step_reader import VerifyProblem, load_step_manifest, verify_step
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.base import StorageTier
from ckptd.tiers.chunk_health import bad_chunk_paths, report_bad_chunk
from ckptd.tiers.direct_io import pwrite_all

log = logging.getLogger("ckptd.scrub")


class ByteRateLimiter:
    """A token bucket in bytes: :meth:`spend` after each read; it sleeps while the bucket is in debt.

    The bucket starts empty, refills at ``bytes_per_s`` and holds at most ``burst`` bytes (default: one
    second's worth), which only time spent idle between calls lets it gather. Over any run of calls, the
    bytes spent never exceed ``burst + bytes_per_s * elapsed`` (from the first call, which is also the
    start of a pass: ``bytes_per_s * elapsed``), elapsed measured on ``clock`` up to the end of the last
    call. ``clock`` and ``sleep`` are injectable (a test
    passes a fake clock whose ``sleep`` advances it; the daemon passes its stop event's ``wait`` so a
    shutdown cuts a long pause short). ``bytes_per_s=math.inf`` never sleeps."""

    def __init__(self, bytes_per_s: float, *, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> None:
        if not bytes_per_s > 0:  # also refuses NaN
            raise ConfigError(f"the scrub rate must be > 0 bytes per second, got {bytes_per_s!r}",
                              hint="set scrub_bytes_per_s to a positive number, or scrub_interval_s = 0 for no scrub")
        self.bytes_per_s = float(bytes_per_s)
        self.burst = float(bytes_per_s if burst is None else burst)
        self._clock, self._sleep = clock, sleep
        self._tokens = 0.0
        self._last = clock()
        #: Seconds slept so far (what the pacing cost).
        self.slept_s = 0.0

    def spend(self, amount: int) -> None:
        """Take ``amount`` bytes out of the bucket; sleep until it is out of debt."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + max(0.0, now - self._last) * self.bytes_per_s) - amount
        self._last = now
        if self._tokens < 0 and math.isfinite(self.bytes_per_s):
            pause = -self._tokens / self.bytes_per_s
            self._sleep(pause)
            self.slept_s += pause


@dataclass(frozen=True)
class ScrubReport:
    """One pass over one tier.

    ``bad``: paths (relative to the tier root) found bad in this pass: chunk objects and packs on a chunk
    store, data files on a tier that keeps them, metadata files. ``repaired``: paths now intact again
    (on a chunk store this may include objects recorded bad earlier, by a restore or a promotion).
    ``unrepaired``: bad paths still bad, with why in ``reasons`` (path -> text). ``intact``: paths
    found bad that verify after all (a read that went wrong on its way). ``remaining``: committed steps
    the pass did not finish because it was stopped (scrub them next)."""

    tier: str
    steps: tuple[int, ...]
    chunks: int
    bytes: int
    bad: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()
    unrepaired: tuple[str, ...] = ()
    intact: tuple[str, ...] = ()
    reasons: tuple[tuple[str, str], ...] = ()
    stopped: bool = False
    remaining: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able values (for the daemon's status document)."""
        return asdict(self)


@dataclass
class _Pass:
    chunks: int = 0
    bytes: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)


class Scrubber:
    """Scrubs tiers at no more than ``bytes_per_s`` raw chunk bytes per second (see the module docstring).

    Keep one for the daemon's life, so the rate holds across passes and tiers; pass the daemon's stop
    event as ``sleep=stop.wait`` and ``should_stop=stop.is_set`` so that a shutdown ends a pause and
    a pass at once. Good ``repair_from`` tiers for a root: its local tier and pinned steps
    (:func:`ckptd.promotion.repair.repair_sources` builds both), the object tier, the buddy's replica."""

    def __init__(self, *, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.limiter = ByteRateLimiter(bytes_per_s, clock=clock, sleep=sleep)

    def scrub_tier(self, tier: StorageTier, *, repair_from: Sequence[StorageTier], steps: Sequence[int] | None = None,
                   should_stop: Callable[[], bool] = lambda: False) -> ScrubReport:
        """Verify every chunk of the committed ``steps`` of ``tier`` (None: all of them, oldest first)
        and mend what is bad from the ``repair_from`` tiers (nearest first). ``should_stop`` is asked
        between chunks; a stopped pass still mends what it found. Raises only for a failure to list the
        tier (StorageError); every problem of a step is in the report."""
        committed = tier.committed_steps()
        wanted = committed if steps is None else sorted(set(steps) & set(committed))
        found = _Pass()
        checked: set[str] = set()  # chunk objects shared by several steps are read once per pass
        done: list[int] = []
        stopped = False

        def paced(raw_bytes: int) -> None:
            nonlocal stopped
            found.chunks += 1
            found.bytes += raw_bytes
            self.limiter.spend(raw_bytes)
            stopped = stopped or should_stop()

        for step in wanted:
            if should_stop():
                stopped = True
                break
            problems: list[VerifyProblem] = []
            try:  # verify_step ends between two chunks once paced saw should_stop (the step is then unfinished)
                for problem in verify_step(tier, step, progress=paced, checked=checked, should_stop=lambda: stopped):
                    problems.append(problem)
            except OSError as error:  # a read the tier did not translate (EIO from a failing disk): next step
                problems.append(VerifyProblem(step, None, step_dir(step), f"reading the step failed: {error}"))
            found.problems.extend(problems)
            if stopped:
                break
            done.append(step)
        outcome = _mend(tier, found.problems, repair_from)
        report = ScrubReport(tier=tier.label, steps=tuple(done), chunks=found.chunks, bytes=found.bytes,
                             bad=outcome.bad, repaired=outcome.repaired, unrepaired=outcome.unrepaired,
                             intact=outcome.intact, reasons=outcome.reasons, stopped=stopped,
                             remaining=tuple(step for step in wanted if step not in done))
        _log_report(report)
        return report


def _log_report(report: ScrubReport) -> None:
    log.info("scrubbed %d step(s), %d chunk(s), %d byte(s) of %s: %d bad, %d repaired, %d unrepaired%s",
             len(report.steps), report.chunks, report.bytes, report.tier, len(report.bad), len(report.repaired),
             len(report.unrepaired), " (stopped)" if report.stopped else "")
    reasons = dict(report.reasons)
    for path in report.unrepaired:
        log.error("scrub: %s on %s is bad and could not be repaired: %s", path, report.tier, reasons.get(path, "?"))


@dataclass(frozen=True)
class _Outcome:
    """The mending part of a report."""

    bad: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()
    unrepaired: tuple[str, ...] = ()
    intact: tuple[str, ...] = ()
    reasons: tuple[tuple[str, str], ...] = ()


def _still_committed(tier: StorageTier, step: int) -> bool:
    try:
        return tier.is_committed(step)
    except CkptdError:
        return True  # cannot tell: mending checks every copy anyway, and never deletes


def _mend(tier: StorageTier, problems: list[VerifyProblem], repair_from: Sequence[StorageTier]) -> _Outcome:
    """Mend what a pass found (see the module docstring) and say what became of each bad path."""
    gone = {step for step in {problem.step for problem in problems} if not _still_committed(tier, step)}
    if gone:  # deleted by retention while the pass ran: nothing of theirs is mended (nor reported)
        log.info("scrub: steps %s left %s during the pass; their problems are dropped", sorted(gone), tier.label)
        problems = [problem for problem in problems if problem.step not in gone]
    reasons = {problem.path: problem.error for problem in problems}
    metadata = {problem.path for problem in problems if problem.chunk is None}
    unrepaired = {path: f"not a chunk a scrub can mend ({reasons[path]}); left to the step's owner"
                  for path in metadata}
    chunk_problems = [problem for problem in problems if problem.chunk is not None and problem.path not in metadata]
    if tier.stores_chunks_by_digest:
        repaired, intact, failed = _mend_objects(tier, chunk_problems, repair_from)
    else:
        repaired, intact, failed = _mend_data_files(tier, chunk_problems, repair_from)
    unrepaired.update(failed)
    reasons.update(unrepaired)
    return _Outcome(bad=tuple(sorted({problem.path for problem in problems})),
                    repaired=tuple(sorted(repaired)), unrepaired=tuple(sorted(unrepaired)),
                    intact=tuple(sorted(intact)), reasons=tuple(sorted(reasons.items())))


def _missing(tier: StorageTier, path: str) -> bool:
    try:
        return not tier.exists(path)
    except CkptdError:
        return False


def _mend_objects(tier: StorageTier, problems: list[VerifyProblem],
                  repair_from: Sequence[StorageTier]) -> tuple[set[str], set[str], dict[str, str]]:
    """Record every bad object and repair it, with those recorded bad earlier, through repair_objects."""
    found = {problem.path: problem for problem in problems}
    try:
        recorded = bad_chunk_paths(tier)
    except CkptdError as error:
        log.warning("scrub: cannot list the bad-object records of %s: %s", tier.label, error)
        recorded = set()
    for path in sorted(set(found) - recorded):  # the read records a bad object, not a missing one
        if _missing(tier, path):  # else the store failed to answer: repair_objects reads it again
            report_bad_chunk(tier, path, step=found[path].step, reason=f"scrub: {found[path].error}")
    wanted = set(found) | recorded
    if not wanted:
        return set(), set(), {}
    sources = [*repair_from, tier]  # another step's pack on the tier itself may hold the chunk too
    try:
        result = repair_objects(tier, wanted, sources)
    except (CkptdError, OSError) as error:  # a source failed in a way the repair does not expect
        log.warning("scrub: repairing %s failed: %s", tier.label, error)
        return set(), set(), {path: f"the repair failed: {error}" for path in wanted}
    return set(result.repaired), set(result.intact), dict(result.unrepairable)


# --- tiers that keep data files --------------------------------------------------------------------


def _mend_data_files(tier: StorageTier, problems: list[VerifyProblem],
                     repair_from: Sequence[StorageTier]) -> tuple[set[str], set[str], dict[str, str]]:
    """Mend each bad chunk in place; a data file is repaired once every bad chunk in it is."""
    if not tier.capabilities.node_local:
        why = f"{tier.kind} tiers are mended by their own daemon (scrub that node's replica directory there)"
        return set(), set(), {problem.path: why for problem in problems}
    copies = _CopyFinder([*repair_from, tier])
    results: dict[str, list[tuple[str, str]]] = {}  # data file -> (outcome, why) of each bad chunk in it
    for problem in problems:
        if problem.chunk is None or problem.rank is None:  # _mend passes chunk problems only
            continue
        results.setdefault(problem.path, []).append(
            _mend_chunk_in_place(tier, problem.step, problem.rank, problem.chunk, problem.path, copies))
    repaired, intact, failed = set(), set(), {}
    for path, outcomes in results.items():
        reasons = [why for outcome, why in outcomes if outcome == _UNREPAIRED]
        if reasons:
            failed[path] = "; ".join(reasons)
        elif any(outcome == _REPAIRED for outcome, _ in outcomes):
            repaired.add(path)
        else:
            intact.add(path)
    return repaired, intact, failed


_REPAIRED, _INTACT, _UNREPAIRED = "repaired", "intact", "unrepaired"


def _mend_chunk_in_place(tier: StorageTier, step: int, rank: int, chunk: ChunkRecord, path: str,
                         copies: _CopyFinder) -> tuple[str, str]:
    """Write an intact copy of ``chunk`` over its bytes in data file ``path``. Returns (outcome, why):
    repaired, intact (it verifies now: nothing written) or unrepaired (why not)."""
    try:
        share = copies.share(tier, step, rank)
    except (CkptdError, OSError) as error:
        return _UNREPAIRED, f"the step's metadata cannot be read here: {error}"
    if chunk not in share.index.chunks:  # deleted and saved again (after a restore) since the pass read it
        return _UNREPAIRED, "the step was saved again since the pass read it: nothing written (scrub it again)"
    try:
        read_stored_chunk(tier, share, chunk)
        return _INTACT, ""
    except (CkptdError, OSError):
        pass
    tried: list[str] = []
    for source, record, stored in copies.verified_copies(chunk, step):
        try:
            data = _encoded_like(chunk, record, stored)
        except IntegrityError as error:
            tried.append(f"{source.label}: cannot be stored as {chunk.codec} of {chunk.length} bytes ({error.message})")
            continue
        try:
            _write_range(tier, stored_chunk_path(tier, share, chunk), chunk.offset, data)
            read_stored_chunk(tier, share, chunk)
        except (CkptdError, OSError) as error:
            return _UNREPAIRED, f"writing the copy from {source.label} failed: {error}"
        log.warning("scrub: repaired the chunk at offset %d of %s on %s (step %d) from %s", chunk.offset, path,
                    tier.label, step, source.label)
        return _REPAIRED, ""
    return _UNREPAIRED, "no intact copy found on any tier" + (f" (tried {'; '.join(tried)})" if tried else "")


def _encoded_like(chunk: ChunkRecord, record: ChunkRecord, stored: bytes) -> bytes:
    """The stored bytes ``chunk`` describes, from the checked stored bytes of a copy with the same digest
    whose ``record`` may use another codec. Raises IntegrityError when the copy cannot be stored in
    ``chunk``'s encoding byte for byte (another zstd level, say)."""
    if record.codec == chunk.codec and record.length == chunk.length:
        data = stored
    else:
        raw = decode_verified(record, stored, path="copy", step=-1, tier="copy")
        data = bytes(codecs.encode(chunk.codec, raw))
    check_stored_chunk(data, chunk, path="copy", step=-1, tier="copy")
    return data


def _write_range(tier: StorageTier, path: str, offset: int, data: bytes) -> None:
    """Overwrite ``len(data)`` bytes at ``offset`` of an existing data file (never extending it), durably.
    Only node-local tiers have a root directory to write in; a file whose real path leaves it (a linked
    step directory) is refused."""
    root = Path(getattr(tier, "root")).resolve()
    target = root / path
    if root not in target.resolve().parents:
        raise UnsafePathError("refusing to mend a data file outside the tier root", path=path, tier=tier.label,
                              hint="a step directory or data file links elsewhere; check the root")
    fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if offset + len(data) > size:
            raise StorageError("the chunk lies past the end of its data file", path=path, tier=tier.label,
                               expected=f">= {offset + len(data)} bytes", actual=str(size))
        pwrite_all(fd, memoryview(data), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


class _CopyFinder:
    """Finds checked copies of a chunk (same digest) on a list of tiers: the same step first on every
    tier, then the tiers' other committed steps, newest first. What it reads is kept for one pass."""

    def __init__(self, sources: Sequence[StorageTier]) -> None:
        self.sources = list(sources)
        self._shares_of: dict[tuple[int, int], tuple[RankShare, ...] | Exception] = {}
        self._steps: dict[int, list[int]] = {}

    def share(self, tier: StorageTier, step: int, rank: int) -> RankShare:
        """The checked metadata of one rank of a committed step on ``tier`` (raises CkptdError)."""
        shares = self._shares(tier, step)
        if isinstance(shares, Exception):
            raise shares
        for share in shares:
            if share.rank == rank:
                return share
        raise NotFoundError(f"rank {rank} is not held here", step=step, tier=tier.label)

    def _shares(self, source: StorageTier, step: int) -> tuple[RankShare, ...] | Exception:
        key = (id(source), step)
        if key not in self._shares_of:
            try:
                manifest = load_step_manifest(source, step)
                held = ranks_held(source, step, manifest)  # a node-local copy may hold some ranks only
                self._shares_of[key] = read_step_contents(source, step, ranks=list(held)).shares
            except (CkptdError, OSError) as error:
                log.info("scrub: step %d on %s is not usable as a source: %s", step, source.label, error)
                self._shares_of[key] = error
        return self._shares_of[key]

    def _committed(self, source: StorageTier) -> list[int]:
        if id(source) not in self._steps:
            try:
                self._steps[id(source)] = sorted(source.committed_steps(), reverse=True)
            except (CkptdError, OSError) as error:
                log.warning("scrub: cannot list %s: %s", source.label, error)
                self._steps[id(source)] = []
        return self._steps[id(source)]

    def verified_copies(self, chunk: ChunkRecord, step: int) -> Iterator[tuple[StorageTier, ChunkRecord, bytes]]:
        """Each intact copy found: (its tier, its record, its stored bytes, already checked)."""
        order = [(source, step) for source in self.sources if step in self._committed(source)]
        order += [(source, other) for source in self.sources for other in self._committed(source) if other != step]
        for source, candidate_step in order:
            shares = self._shares(source, candidate_step)
            for share in () if isinstance(shares, Exception) else shares:
                for record in share.index.chunks:
                    if record.digest != chunk.digest:
                        continue
                    try:
                        stored = read_stored_chunk(source, share, record)
                    except (CkptdError, OSError):
                        continue  # this copy is bad too (the scrubbed location itself, say)
                    yield source, record, stored
                    break  # one copy per rank share is enough


__all__ = ["ByteRateLimiter", "ScrubReport", "Scrubber"]
