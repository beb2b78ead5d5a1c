"""Short mode of the scenarios in ``rows_crash.py`` (see ``test_matrix.py``)."""

from __future__ import annotations

import pytest

from harness import matrix


@pytest.mark.parametrize(("entry", "seed"), matrix.short_params("rows_crash"))
def test_row_holds(entry: matrix.Row, seed: int) -> None:
    matrix.check_short_run(entry, seed)
