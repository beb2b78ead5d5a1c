"""A daemon reports a root whose local tier cannot take a save (read-only, full, quota, I/O errors) as
degraded, in its status document and in ``ckptd_tier_degraded``, and as healthy again once it recovers
(fault matrix row 7). The disk fails through :class:`harness.write_faults.FaultyDisk` (the real
system calls of the local tier, failed with an errno: no root needed)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.config import load_config
from ckptd.daemon.service import Daemon
from harness.write_faults import ErrnoRule, FaultyDisk


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    config = load_config(None, {"state_dir": str(tmp_path / "state"), "node_id": "node-a", "listen": "127.0.0.1:0",
                                "watch": "poll", "poll_interval_s": 10.0, "scrub_interval_s": 0, "name": "run1",
                                "local": str(tmp_path / "root"), "remote": None}, {})
    running = Daemon(config)
    running.start()
    yield running
    running.stop(5.0)


def _reported(daemon: Daemon) -> tuple[dict[str, Any], str]:
    daemon.check_local_tiers()
    health = daemon.status()["roots"]["run1"]["tiers"]["local"]["health"]
    return health, daemon.metrics.render()[0].decode()


@pytest.mark.parametrize(("code", "operation", "words"), [(errno.EROFS, "open", "Read-only file system"),
                                                          (errno.EDQUOT, "write", "quota exceeded"),
                                                          (errno.ENOSPC, "write", "disk full"),
                                                          (errno.EIO, "fsync", "Input/output error")])
def test_a_failing_local_tier_is_reported_degraded_then_healthy(daemon: Daemon, code: int, operation: str,
                                                               words: str) -> None:
    health, metrics = _reported(daemon)
    assert health["state"] == "ok" and health["reason"] is None
    assert 'ckptd_tier_degraded{root="run1",tier="local"} 0.0' in metrics
    with FaultyDisk(rules=[ErrnoRule(operation, code, times=None)]) as disk:
        health, metrics = _reported(daemon)
    assert disk.injected
    assert health["state"] == "degraded" and words in health["reason"], health
    assert 'ckptd_tier_degraded{root="run1",tier="local"} 1.0' in metrics
    health, metrics = _reported(daemon)
    assert health["state"] == "ok"
    assert 'ckptd_tier_degraded{root="run1",tier="local"} 0.0' in metrics
    assert not list((Path(daemon.status()["roots"]["run1"]["local"])).glob(".ckptd-daemon-probe*"))
