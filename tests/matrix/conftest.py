"""The fault matrix's short mode: every ``rows_*.py`` here is imported once (registering its rows) before
collection, and the loopback S3 endpoint the runs share is stopped at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import matrix

matrix.discover(Path(__file__).parent)


@pytest.fixture(scope="session", autouse=True)
def _shared_endpoints() -> Iterator[None]:
    yield
    matrix.stop_shared_endpoints()
