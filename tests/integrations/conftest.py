"""The integrations group: tests against real frameworks (Lightning, Hugging Face), marked ``integrations``.

Every test under this directory gets the marker, so the default run (``-m 'not integrations ...'``)
leaves them out and ``pytest -m integrations`` (``make test-integrations``) runs exactly them. The S3
fixtures of ``tests/conftest.py`` apply here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integrations)
