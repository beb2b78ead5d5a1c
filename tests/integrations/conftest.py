"""The integrations group: tests against real frameworks (Lightning, Hugging Face), marked ``integrations``.

Every test under this directory gets the marker, so the default run (``-m 'not integrations ...'``)
leaves them out and ``pytest -m integrations`` (``make test-integrations``) runs exactly them. The S3
fixtures of ``tests/conftest.py`` apply here too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integrations)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that excludes the group (the default ``-m``) does not import its modules: the frameworks they
    import may not be installed (``make test`` installs them for the group only). A run that selects the
    group imports them, so a missing framework fails loudly there."""
    if collection_path.suffix == ".py" and collection_path.parent == _HERE \
            and "not integrations" in (config.option.markexpr or ""):
        return True
    return None
