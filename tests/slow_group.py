"""A pytest plugin (loaded by conftest.py): the tests listed in ``tests/slow_tests.txt`` are marked slow.

The default run keeps an end-to-end test of most capabilities, and at least one test of every test file whose
cheapest test is affordable; the variants and heavier scenarios are listed in ``slow_tests.txt`` so that the
default run stays under 8 minutes on 2 idle cores. Above each file's lines a comment names the tests the default
run keeps of it, or says it keeps none and why: its cheapest test costs too much for the default run's budget (or
over 40 s), or was never measured. Those files, and the few that mark their tests slow in their own code, are
tested by ``make test-slow`` and ``make test-all`` only. A line is a test id (``file::name`` or
``file::name[params]``); without ``[...]`` it names every parameter set of the test.
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
