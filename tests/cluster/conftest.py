"""The cluster harness's tests need network namespaces: skipped with the reason where they cannot be made."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from netns import sweep_stale, unavailable_reason  # noqa: E402


@pytest.fixture(scope="session")
def namespaces_available() -> None:
    """Skip unless network namespaces can be made here; removes those a killed earlier run left."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the cluster harness cannot run here: {reason}")
    sweep_stale()
