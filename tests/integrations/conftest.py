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


def _selects_the_group(markexpr: str) -> bool:
    """Whether ``-m markexpr`` can select a test marked only ``integrations``."""
    if not markexpr.strip():
        return True
    try:
        from _pytest.mark.expression import Expression  # pytest's own evaluator of -m expressions
    except ImportError:
        return "not integrations" not in markexpr
    return Expression.compile(markexpr).evaluate(lambda name, **_: name == "integrations")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that excludes the group (the default ``-m``) does not import its modules: the frameworks they
    import may not be installed (``make test`` installs them for the group only). A run that selects the
    group imports them, so a missing framework fails loudly there."""
    if collection_path.suffix == ".py" and collection_path.parent == _HERE \
            and not _selects_the_group(config.option.markexpr or ""):
        return True
    return None
