"""The fault matrix as runnable scenarios: rows, runs, outcomes and the report.

Each row of the fault matrix (``FAULT-MATRIX`` in the design documents: a fault or a bad input, how it is
injected, and what counts as held) is a function registered with :func:`row`. It gets a
:class:`RunContext` (its seed, a seeded random generator, a scratch directory, an S3 endpoint on loopback
when it asks for one, and a stopwatch for recovery times) and returns an :class:`Outcome`: which of the
invariants L1-L5 it checked, whether all of them held, how long recovery took and how many bytes of
committed data were lost.

- L1: the newest committed checkpoint loads bit-exact.
- L2: nothing committed is ever lost except by retention policy.
- L3: nothing partial is ever advertised as restorable.
- L4: a bad input gets a typed error, touches nothing outside the root, and runs no code.
- L5: a resumed run matches the golden run (same sample ids, same state hash).

A row that cannot run on this machine is registered with :func:`not_runnable`, with the reason and what
covers it instead. :func:`run_row` runs one row once (a fresh scratch directory per run, the seed
recorded); the short mode (the default test run) and the long mode (``tests/matrix/long_run.py``) both
call it. A scenario that raises counts as not held: the exception and its seed go into the report so
that the run can be replayed.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INVARIANTS = ("L1", "L2", "L3", "L4", "L5")


@dataclass(frozen=True)
class Outcome:
    """What one run of a row found."""

    held: bool
    checked: tuple[str, ...]
    recovery_s: float | None = None
    step_recovery_s: float | None = None
    bytes_lost: int = 0
    detail: str = ""

    def __post_init__(self) -> None:
        unknown = [name for name in self.checked if name not in INVARIANTS]
        if unknown or not self.checked:
            raise ValueError(f"an outcome checks some of {INVARIANTS}, got {self.checked!r}")


class Stopwatch:
    """Times from a fault to the moment it is recovered from (monotonic clock)."""

    def __init__(self) -> None:
        self._fault_at: float | None = None

    def fault(self) -> None:
        """Mark the moment the fault was injected."""
        self._fault_at = time.monotonic()

    def since_fault(self) -> float:
        """Seconds since :meth:`fault` (raises if no fault was marked)."""
        if self._fault_at is None:
            raise RuntimeError("Stopwatch.since_fault() before Stopwatch.fault()")
        return time.monotonic() - self._fault_at


@dataclass(frozen=True)
class S3Location:
    """A fresh bucket on the loopback S3 endpoint: ``url`` (``s3://bucket/prefix``) and its options."""

    url: str
    bucket: str
    storage_options: dict[str, Any]
    endpoint_url: str


class _SharedS3:
    """One moto server per process, started on first use, fresh bucket per request."""

    def __init__(self) -> None:
        self._server: Any = None

    def location(self, prefix: str = "run") -> S3Location:
        if self._server is None:
            from ckptd.embedded_s3 import EmbeddedS3

            self._server = EmbeddedS3().start()
        bucket = f"matrix-{uuid.uuid4().hex[:12]}"
        self._server.create_bucket(bucket)
        return S3Location(f"s3://{bucket}/{prefix}", bucket, dict(self._server.storage_options),
                          self._server.endpoint_url)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


_S3 = _SharedS3()


@dataclass
class RunContext:
    """Everything one run of a row gets."""

    row: int
    seed: int
    workdir: Path
    rng: random.Random = field(init=False)
    stopwatch: Stopwatch = field(default_factory=Stopwatch)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def s3(self, prefix: str = "run") -> S3Location:
        """A fresh, empty bucket on a real S3 endpoint (moto's server on 127.0.0.1)."""
        return _S3.location(prefix)

    def path(self, name: str) -> Path:
        """A directory under this run's scratch directory (created)."""
        directory = self.workdir / name
        directory.mkdir(parents=True, exist_ok=True)
        return directory


Scenario = Callable[[RunContext], Outcome]


@dataclass(frozen=True)
class Row:
    """One row of the fault matrix and its scenario (``scenario`` is None where it cannot run here)."""

    number: int
    title: str
    scenario: Scenario | None
    short_runs: int = 1
    long_runs: int = 100
    reason: str = ""
    covered_by: str = ""


ROWS: dict[int, list[Row]] = {}


def row(number: int, title: str, *, short_runs: int = 1, long_runs: int = 100) -> Callable[[Scenario], Scenario]:
    """Register ``fn(ctx) -> Outcome`` as a scenario of matrix row ``number`` (a row may have several)."""

    def register(fn: Scenario) -> Scenario:
        ROWS.setdefault(number, []).append(Row(number, title, fn, short_runs, long_runs))
        return fn

    return register


def not_runnable(number: int, title: str, *, reason: str, covered_by: str) -> None:
    """Record that row ``number`` cannot run on this machine, why, and what covers it instead."""
    ROWS.setdefault(number, []).append(Row(number, title, None, 0, 0, reason, covered_by))


@dataclass(frozen=True)
class RunRecord:
    """One run of one scenario: its seed, outcome and wall time (``error`` is the traceback if it raised)."""

    number: int
    scenario: str
    seed: int
    outcome: Outcome
    wall_s: float
    error: str = ""
    #: The run's scratch directory when it was kept (``keep`` or a failed run with ``keep_failed``).
    workdir: str = ""


def run_row(entry: Row, seed: int, *, keep_failed: bool = False, keep: bool = False) -> RunRecord:
    """Run ``entry``'s scenario once with ``seed`` in a fresh scratch directory, removed afterwards unless
    ``keep`` (or ``keep_failed`` and the run did not hold); a kept directory is named in the record."""
    if entry.scenario is None:
        raise ValueError(f"row {entry.number} cannot run here: {entry.reason}")
    name = entry.scenario.__name__
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"ckptd-matrix-{entry.number}-{seed}-"))
    try:
        outcome = entry.scenario(RunContext(entry.number, seed, workdir))
        error = ""
    except Exception as raised:  # noqa: BLE001 - a scenario that raises did not hold; its seed replays it
        error = traceback.format_exc()
        outcome = Outcome(held=False, checked=("L1",), detail=f"scenario raised {type(raised).__name__}: {raised}")
    kept = keep or (keep_failed and not outcome.held)
    if not kept:
        shutil.rmtree(workdir, ignore_errors=True)
    return RunRecord(entry.number, name, seed, outcome, time.monotonic() - started, error,
                     str(workdir) if kept else "")


#: Rows of the fault matrix (``FAULT-MATRIX``): every one needs a scenario or a not-runnable entry.
MATRIX_ROWS = range(1, 39)


def seed_for(number: int, index: int) -> int:
    """The seed of run ``index`` (0, 1, ...) of row ``number``: the short mode's runs are the long mode's first."""
    return number * 100_000 + index


def scenarios() -> list[Row]:
    """Every registered entry (runnable or not), by row number then registration order."""
    return [entry for number in sorted(ROWS) for entry in ROWS[number]]


def find_scenario(number: int, name: str | None = None) -> list[Row]:
    """The runnable entries of row ``number`` (only the scenario called ``name`` when given)."""
    found = [entry for entry in ROWS.get(number, []) if entry.scenario is not None
             and (name is None or entry.scenario.__name__ == name)]
    if not found:
        known = ", ".join(e.scenario.__name__ for e in ROWS.get(number, []) if e.scenario is not None) or "none"
        raise KeyError(f"row {number} has no runnable scenario{f' {name!r}' if name else ''} (scenarios: {known})")
    return found


def missing_rows(expected: Iterable[int] = MATRIX_ROWS) -> list[int]:
    """The rows of ``expected`` with neither a scenario nor a not-runnable entry."""
    return [number for number in expected if not ROWS.get(number)]


def discover(directory: str | os.PathLike[str]) -> list[str]:
    """Import every ``rows_*.py`` of ``directory`` (once), which registers their rows; returns the module
    names. The directory is put on ``sys.path`` and the modules imported under their plain names, so child
    processes (forkserver, spawn: they inherit ``sys.path``) can import a scenario's module-level targets."""
    base = str(Path(directory).resolve())
    if base not in sys.path:
        sys.path.insert(0, base)
    names = sorted(path.stem for path in Path(base).glob("rows_*.py"))
    for name in names:
        importlib.import_module(name)
    return names


@dataclass(frozen=True)
class RowSummary:
    """The report line of one scenario over all its runs."""

    number: int
    title: str
    scenario: str
    runs: int
    held: int
    worst_recovery_s: float | None
    median_recovery_s: float | None
    worst_step_recovery_s: float | None
    bytes_lost: int
    failed_seeds: tuple[int, ...]


def summarise(entry: Row, records: list[RunRecord]) -> RowSummary:
    """Fold the runs of one scenario into its report line."""
    recoveries = [r.outcome.recovery_s for r in records if r.outcome.recovery_s is not None]
    step_recoveries = [r.outcome.step_recovery_s for r in records if r.outcome.step_recovery_s is not None]
    return RowSummary(
        number=entry.number, title=entry.title,
        scenario=entry.scenario.__name__ if entry.scenario else "",
        runs=len(records), held=sum(1 for r in records if r.outcome.held),
        worst_recovery_s=max(recoveries) if recoveries else None,
        median_recovery_s=statistics.median(recoveries) if recoveries else None,
        worst_step_recovery_s=max(step_recoveries) if step_recoveries else None,
        bytes_lost=sum(r.outcome.bytes_lost for r in records),
        failed_seeds=tuple(r.seed for r in records if not r.outcome.held),
    )


_INJECTOR: Any = None


def crash_injector() -> Any:
    """The :class:`~harness.crash.CrashInjector` the runs of this process share (its forkserver
    started once)."""
    global _INJECTOR
    if _INJECTOR is None:
        from harness.crash import CrashInjector

        _INJECTOR = CrashInjector(timeout_s=120.0)
    return _INJECTOR


def stop_shared_endpoints() -> None:
    """Stop the S3 endpoint the runs of this process shared (call once at the end)."""
    _S3.stop()


def short_params(module: str) -> list[Any]:
    """The short mode's runs of the scenarios defined in rows module ``module`` (e.g. ``"rows_crash"``), as
    ``pytest.param(entry, seed)`` with ids ``rowNN-<scenario>-seed<S>``: one test file per rows module, so
    that pytest-xdist spreads the modules over its workers."""
    import pytest

    return [pytest.param(entry, seed_for(entry.number, index),
                         id=f"row{entry.number:02d}-{entry.scenario.__name__}-seed{seed_for(entry.number, index)}")
            for entry in scenarios() if entry.scenario is not None and entry.scenario.__module__ == module
            for index in range(entry.short_runs)]


def check_short_run(entry: Row, seed: int) -> None:
    """Run ``entry`` once with ``seed`` and fail (AssertionError naming row, scenario, seed, scratch and the
    replay command) unless it held with nothing lost."""
    record = run_row(entry, seed, keep_failed=True)
    outcome = record.outcome
    assert outcome.held, (f"row {entry.number} ({entry.title}) scenario {record.scenario} did not hold with seed "
                          f"{seed}: {outcome.detail}\n{record.error}scratch kept in {record.workdir}; replay: "
                          f"python tests/matrix/long_run.py --replay {entry.number}:{record.scenario}:{seed}")
    assert outcome.bytes_lost == 0, f"row {entry.number} seed {seed}: {outcome.bytes_lost} bytes lost, yet held"
