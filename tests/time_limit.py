"""A pytest plugin (loaded by conftest.py): the run fails when a default-run test took longer than its limit.

The limit is ``CKPTD_TEST_LIMIT_S`` seconds (60 unless set; 0 turns the check off) for a test's setup, call and
teardown together, on an idle machine. On a busy machine every test is slower by about the load per core, so the
limit is scaled by the run's mean one-minute load average per core (sampled at each test report, never below 1):
at a load of 20 on 2 cores a test may take ten times as long. Tests marked slow, bench, gpu or integrations are
not part of the default run and are not checked. A ``CKPTD_TEST_LIMIT_S`` that is not a number stops the run
at its start. With ``CKPTD_TEST_TIMES=<file>`` each test report's phase and seconds are appended to that file
as JSON lines while the run goes on (to see where the time of a run goes); a relative path is taken from the
directory pytest started in (tests change directories).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

DEFAULT_LIMIT_S = 60.0
UNCHECKED_MARKERS = ("slow", "bench", "gpu", "integrations")


def _load_average_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def load_per_core() -> float:
    """The one-minute load average per core now, never below 1: about how many times slower than on an idle
    machine a test runs here. The hang guards of single calls (``elapsed < GUARD_S * load_per_core()``) scale
    by it, so that a loaded machine never trips them while an idle one still catches a call that hangs."""
    return max(1.0, _load_average_per_core())


@dataclass
class RunTimes:
    """Each checked test's seconds so far, and the load samples of the run."""

    seconds: dict[str, float] = field(default_factory=dict)
    load_per_core: list[float] = field(default_factory=list)

    def add(self, nodeid: str, seconds: float) -> None:
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + seconds
        self.load_per_core.append(_load_average_per_core())

    def load_factor(self) -> float:
        if not self.load_per_core:
            return 1.0
        return max(1.0, sum(self.load_per_core) / len(self.load_per_core))

    def over(self, base_limit_s: float) -> list[tuple[str, float]]:
        limit = base_limit_s * self.load_factor()
        return sorted(((nodeid, seconds) for nodeid, seconds in self.seconds.items() if seconds > limit),
                      key=lambda item: -item[1])


def _base_limit_s() -> float:
    value = os.environ.get("CKPTD_TEST_LIMIT_S", "")
    try:
        return float(value) if value else DEFAULT_LIMIT_S
    except ValueError:
        raise pytest.UsageError(f"CKPTD_TEST_LIMIT_S={value!r} is not a number of seconds (0 turns the check off)")


_TIMES = RunTimes()
#: CKPTD_TEST_TIMES, made absolute when conftest imports this module (before any test changes directory).
_TIMES_FILE = os.path.abspath(os.environ["CKPTD_TEST_TIMES"]) if os.environ.get("CKPTD_TEST_TIMES") else None


def pytest_configure(config: pytest.Config) -> None:
    _base_limit_s()  # a bad value stops the run now, not after it


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _TIMES_FILE and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a plain run) sees every report
        with open(_TIMES_FILE, "a", encoding="utf-8") as out:
            out.write(json.dumps({"id": report.nodeid, "when": report.when, "s": round(report.duration, 3),
                                  "outcome": report.outcome}) + "\n")
    if any(marker in report.keywords for marker in UNCHECKED_MARKERS):
        return
    _TIMES.add(report.nodeid, report.duration)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sees every report and decides
        return
    base = _base_limit_s()
    if base <= 0:
        return
    over = _TIMES.over(base)
    reporter: Any = session.config.pluginmanager.get_plugin("terminalreporter")
    if not over:
        return
    factor = _TIMES.load_factor()
    if reporter is not None:
        reporter.write_sep("=", f"{len(over)} default-run tests over the {base:.1f} s limit "
                                f"(x{factor:.1f} for the run's load per core)", red=True)
        for nodeid, seconds in over:
            reporter.write_line(f"{seconds:8.1f}s {nodeid}")
        reporter.write_line("Make the test faster, or mark it slow (pytest.mark.slow) if the default run has another "
                            "test of the same capability.")
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
