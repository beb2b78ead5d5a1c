"""Shared fixtures: a real S3 endpoint (moto's server over HTTP on 127.0.0.1) for the whole session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ckptd.embedded_s3 import EmbeddedS3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    """moto's S3 server in a child process on a free loopback port."""
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
