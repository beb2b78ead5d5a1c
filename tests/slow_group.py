"""A pytest plugin (loaded by conftest.py): the tests listed in ``tests/slow_tests.txt`` are marked slow.

The default run keeps at least one end-to-end test of every capability; the variants and heavier scenarios of
a capability it already tests are listed in ``slow_tests.txt`` (grouped, with the default-run test that covers the
capability named in a comment) so that the default run stays under 8 minutes on 2 idle cores. ``make test-slow``
and ``make test-all`` run them. A line is a test id (``file::name`` or ``file::name[params]``); without ``[...]``
it names every parameter set of the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

LIST = Path(__file__).with_name("slow_tests.txt")


def listed_ids(path: Path = LIST) -> set[str]:
    """The ids of ``path``: one per line, ``#`` starts a comment."""
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.add(line)
    return ids


@pytest.hookimpl(tryfirst=True)  # before the -m filter deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = listed_ids()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("[", 1)[0] in listed:
            item.add_marker(pytest.mark.slow)
