"""Shared fixtures: a real S3 endpoint (moto's server over HTTP on 127.0.0.1) for the whole session, and the
uninterrupted runs of the elastic test job (2 ranks, and 3) that the elastic tests compare their recovered
runs with."""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import harness
from ckptd.embedded_s3 import EmbeddedS3
from slow_group import pytest_collection_modifyitems  # noqa: F401  (tests/slow_tests.txt)
from time_limit import pytest_configure, pytest_runtest_logreport, pytest_sessionfinish  # noqa: F401  (the 60 s rule)

harness.reach_from_subprocesses()  # jobs the tests start run harness modules


class _RunningS3(EmbeddedS3):
    """An S3 server started outside the tests (``make test-s3-compat``: LocalStack), at ``CKPTD_TEST_S3_ENDPOINT``."""

    def start(self) -> EmbeddedS3:
        return self

    def stop(self) -> None:
        pass


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    """moto's S3 server in a child process on a free loopback port, or the one ``CKPTD_TEST_S3_ENDPOINT`` names."""
    external = os.environ.get("CKPTD_TEST_S3_ENDPOINT")
    if external:
        from urllib.parse import urlsplit

        address = urlsplit(external)
        yield _RunningS3(host=address.hostname or "127.0.0.1", port=address.port or 80)
        return
    with EmbeddedS3() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: EmbeddedS3) -> str:
    """A fresh, empty bucket for one test; returns its name."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


@pytest.fixture
def s3_options(s3_server: EmbeddedS3) -> dict[str, Any]:
    """fsspec/s3fs storage options that reach the test server."""
    return s3_server.storage_options


def _uninterrupted_run(tmp_path_factory: pytest.TempPathFactory, world: int) -> list[bytes]:
    """Each rank's final bytes of the elastic test job (:mod:`harness.elastic_training`, default
    arguments) run uninterrupted under ``ckptd launch`` with ``world`` ranks: run once per test session and
    shared by the pytest-xdist workers (under a lock in their common temporary directory), since it is the
    same run."""
    from harness.elastic_runs import finals, launch_job

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = Path(shared) / f"elastic-reference-{world}-ranks"
    with (Path(shared) / f"elastic-reference-{world}-ranks.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            result = launch_job(root, world=world)
            assert result.returncode == 0, result.stderr[-4000:]
            (root / "done").touch()
    written = finals(root / "out", world)
    ids = [sample for final in written for row in json.loads(final)["seen"] for sample in row]
    assert -1 not in ids and len(ids) == 12 * 4 * world, "every rank consumed a batch at every step"
    return written


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The uninterrupted run of the elastic test job with its usual WORLD (2) ranks (:func:`_uninterrupted_run`)."""
    from harness.elastic_runs import WORLD

    return _uninterrupted_run(tmp_path_factory, WORLD)


@pytest.fixture(scope="session")
def elastic_reference_three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The uninterrupted run of the elastic test job with 3 ranks (:func:`_uninterrupted_run`), for the tests in
    which a rank survives the failure of two others."""
    return _uninterrupted_run(tmp_path_factory, 3)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any) -> Iterator[None]:
    """After every other summary, the ids of the failed tests alone, one per line: CI shows only the
    tail of the output, and an untruncated assertion message can push the short summary out of it."""
    result = yield
    failed = [report.nodeid for key in ("failed", "error") for report in terminalreporter.stats.get(key, [])
              if getattr(report, "nodeid", None)]
    if failed:
        terminalreporter.write_sep("=", f"{len(failed)} failed or erred (ids only)")
        for nodeid in failed:
            terminalreporter.write_line(nodeid)
    return result
