"""The fault matrix's short mode: each scenario of each row runs ``short_runs`` times with seeds derived
from its row number (``seed_for``), and must hold. A failure names the row, the scenario, the seed and
what broke; ``python tests/matrix/long_run.py --replay ROW:SEED`` replays it with its scratch directory
kept. The long mode (``long_run.py``) runs the same scenarios ``long_runs`` times and writes the report."""

from __future__ import annotations

import pytest

from ckptd.testing import matrix

CASES = [pytest.param(entry, matrix.seed_for(entry.number, index),
                      id=f"row{entry.number:02d}-{entry.scenario.__name__}-seed{matrix.seed_for(entry.number, index)}")
         for entry in matrix.scenarios() if entry.scenario is not None for index in range(entry.short_runs)]


@pytest.mark.parametrize(("entry", "seed"), CASES)
def test_row_holds(entry: matrix.Row, seed: int) -> None:
    record = matrix.run_row(entry, seed, keep_failed=True)
    outcome = record.outcome
    assert outcome.held, (f"row {entry.number} ({entry.title}) scenario {record.scenario} did not hold with seed "
                          f"{seed}: {outcome.detail}\n{record.error}scratch kept in {record.workdir}; replay: "
                          f"python tests/matrix/long_run.py --replay {entry.number}:{record.scenario}:{seed}")
    assert outcome.bytes_lost == 0, f"row {entry.number} seed {seed}: {outcome.bytes_lost} bytes lost, yet held"


def test_every_row_has_a_scenario_or_a_reason() -> None:
    missing = matrix.missing_rows()
    assert not missing, f"rows of the fault matrix with neither a scenario nor a not_runnable entry: {missing}"


def test_not_runnable_rows_say_why_and_what_covers_them() -> None:
    vague = [entry.number for entry in matrix.scenarios()
             if entry.scenario is None and not (entry.reason.strip() and entry.covered_by.strip())]
    assert not vague, f"not_runnable rows without a reason or a covered_by: {vague}"
