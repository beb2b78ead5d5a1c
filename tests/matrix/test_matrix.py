"""The fault matrix's short mode: each scenario of each row runs ``short_runs`` times with seeds derived
from its row number (``seed_for``), and must hold (in ``test_short_<area>.py``, one file per rows module; this
file checks that every row and every rows module is covered). A failure names the row, the scenario, the seed and
what broke; ``python tests/matrix/long_run.py --replay ROW:SEED`` replays it with its scratch directory
kept. The long mode (``long_run.py``) runs the same scenarios ``long_runs`` times and writes the report."""

from __future__ import annotations

from pathlib import Path

from harness import matrix

HERE = Path(__file__).parent


def test_every_rows_module_has_its_short_mode_file() -> None:
    """The short mode runs in ``test_short_<area>.py``, one per ``rows_<area>.py`` (so that pytest-xdist
    spreads them): a rows module without its file would never run by default. (A module whose scenarios all
have ``short_runs=0`` has none: its rows are checked by default elsewhere, as its docstring says.)"""
    modules = {path.stem.removeprefix("rows_") for path in HERE.glob("rows_*.py") if matrix.short_params(path.stem)}
    files = {path.stem.removeprefix("test_short_") for path in HERE.glob("test_short_*.py")}
    assert modules == files, f"rows modules without a test_short file: {sorted(modules - files)}; " \
                             f"test_short files without a rows module: {sorted(files - modules)}"


def test_every_row_has_a_scenario_or_a_reason() -> None:
    missing = matrix.missing_rows()
    assert not missing, f"rows of the fault matrix with neither a scenario nor a not_runnable entry: {missing}"


def test_not_runnable_rows_say_why_and_what_covers_them() -> None:
    vague = [entry.number for entry in matrix.scenarios()
             if entry.scenario is None and not (entry.reason.strip() and entry.covered_by.strip())]
    assert not vague, f"not_runnable rows without a reason or a covered_by: {vague}"
