"""This repository's test harness: training jobs the tests launch, fault injectors, the fault matrix, the
soak cluster, invariants. Not shipped with ckptd (the public kit is :mod:`ckptd.testing`).

Tests import it as ``harness`` (``tests/`` is on ``sys.path`` under pytest); processes they start reach it
through ``PYTHONPATH``, which :func:`reach_from_subprocesses` sets for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

#: The directory that holds this package (``tests/``).
TESTS_DIR = Path(__file__).resolve().parent.parent


def reach_from_subprocesses() -> None:
    """Put ``tests/`` first on ``PYTHONPATH``, so that ``python -m harness.<job>`` (and ``ckptd launch -m
    harness.<job>``) started from this process imports this package."""
    parts = [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]
    if str(TESTS_DIR) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *parts])
