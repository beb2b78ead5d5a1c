"""A tier that fails never blocks a tier that works: with an object tier that cannot be reached or is
misconfigured, saves keep committing locally and restore returns the saved bytes from the local tier
within a bounded time, with one warning naming the failing tier and its URL.

Every failure mode is real and stays on loopback (see :mod:`harness.broken_s3`): a closed port,
a host under ``.invalid`` whose lookup fails in-process (the machine's DNS resolver may be remote, so
no query is sent), a missing bucket and rejected or absent credentials on real moto servers. A wrong
region cannot be produced by moto (it serves every region); its classification is tested in
``test_s3_errors.py``.
"""

from __future__ import annotations

import contextlib
import threading
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.errors import CkptdError, TierUnreachableError
from ckptd.testing import run_multirank
from harness.broken_s3 import (auth_enforcing_s3, closed_port_options, offline_resolver,
                                     options_without_credentials, unknown_host_options, without_credentials)
from time_limit import load_per_core

HANG_GUARD_S = 15.0  # a hang guard (the issue saw 20-40 s on an idle machine), not a speed claim
MODES = ["closed-port", "unknown-host", "missing-bucket", "rejected-credentials", "no-credentials"]


@pytest.fixture(params=MODES)
def broken_remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(URL, storage options) of an object tier that cannot answer, in one of the MODES."""
    mode = request.param
    if mode == "closed-port":
        yield "s3://bucket/run", closed_port_options()
    elif mode == "unknown-host":
        with offline_resolver():
            yield "s3://bucket/run", unknown_host_options()
    elif mode == "missing-bucket":
        server = request.getfixturevalue("s3_server")
        yield f"s3://missing-{uuid.uuid4().hex[:8]}/run", server.storage_options
    elif mode == "rejected-credentials":
        with auth_enforcing_s3() as server:
            yield "s3://bucket/run", server.storage_options
    else:
        server = request.getfixturevalue("s3_server")
        with without_credentials(str(tmp_path)):
            yield "s3://bucket/run", options_without_credentials(server.endpoint_url)


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"weights": torch.randn(64 * 1024, generator=generator),
            "bias": torch.randn(17, generator=generator)}


def _timed(work: Any) -> tuple[Any, float]:
    started = time.monotonic()
    value = work()
    return value, time.monotonic() - started


def _restore_warnings(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "ckptd.restore" and record.levelno >= logging.WARNING and url in record.getMessage()]


@pytest.mark.s3
def test_saves_commit_and_restore_comes_from_local(broken_remote: tuple[str, dict[str, Any]], tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    url, options = broken_remote
    root = tmp_path / "local"
    policy = ckptd.Policy(keep_local=None)
    manager, took = _timed(lambda: ckptd.CheckpointManager(root, remote=url, storage_options=options,
                                                           policy=policy, capture_rng=False))
    assert took < HANG_GUARD_S * load_per_core()
    saved = {step: _state(step) for step in (1, 2, 3)}
    for step, state in saved.items():
        assert manager.save(step, state)
    manager.wait()
    assert manager.local.committed_steps() == [1, 2, 3], "saves keep committing while the object tier is down"
    with contextlib.suppress(CkptdError):  # it reports the steps that stayed unpromoted
        _, took = _timed(manager.close)
    assert took < HANG_GUARD_S * load_per_core()

    caplog.clear()
    restorer = ckptd.CheckpointManager(root, remote=url, storage_options=options, policy=policy, capture_rng=False)
    try:
        target = {"weights": torch.zeros(64 * 1024), "bias": torch.zeros(17)}
        with caplog.at_level(logging.WARNING):
            step, took = _timed(lambda: restorer.restore(target))
        assert step == 3 and took < HANG_GUARD_S * load_per_core()
        assert all(torch.equal(target[name], saved[3][name]) for name in target), "restore returned other bytes"
        assert restorer.last_restore is not None and restorer.last_restore.tier == restorer.local.label
        warnings = _restore_warnings(caplog, url)
        assert len(warnings) == 1, warnings
        restore_records = [r for r in caplog.records if r.name == "ckptd.restore" and r.levelno >= logging.WARNING]
        assert len(restore_records) == 1, [r.getMessage() for r in restore_records]
    finally:
        with contextlib.suppress(CkptdError):
            restorer.close()


@pytest.mark.s3
def test_nothing_local_and_the_object_tier_down_is_not_a_fresh_run(broken_remote: tuple[str, dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    url, options = broken_remote
    manager = ckptd.CheckpointManager(tmp_path / "empty", remote=url, storage_options=options, capture_rng=False)
    try:
        started = time.monotonic()
        with pytest.raises(TierUnreachableError) as caught:
            manager.restore({"weights": torch.zeros(4)})
        assert time.monotonic() - started < HANG_GUARD_S * load_per_core()
        assert url in str(caught.value) and "fresh run" in str(caught.value)
    finally:
        with contextlib.suppress(CkptdError):
            manager.close()


@pytest.mark.s3
def test_each_tier_is_listed_once_per_restore(s3_bucket: str, s3_options: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{s3_bucket}/run"
    with ckptd.CheckpointManager(tmp_path / "local", remote=url, storage_options=s3_options,
                                 policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(step))
        manager.wait_uploads()
    restorer = ckptd.CheckpointManager(tmp_path / "local", remote=url, storage_options=s3_options,
                                       capture_rng=False)
    # Only what the restoring thread asks counts: the uploader lists both tiers once, on its own thread.
    restoring = threading.get_ident()
    listed: list[str] = []
    for tier in restorer.tiers:
        original = tier.committed_steps

        def counting(tier: Any = tier, original: Any = original) -> list[int]:
            if threading.get_ident() == restoring:
                listed.append(tier.label)
            return original()

        monkeypatch.setattr(tier, "committed_steps", counting)
    requests: list[str] = []
    remote = restorer.remote
    assert remote is not None
    remote.on_call(lambda method, params: requests.append(f"{method} {params.get('Key', '')}"))  # type: ignore[attr-defined]
    directory_listings: list[str] = []
    original_numbers = remote.list_step_numbers

    def counting_numbers() -> list[int]:
        if threading.get_ident() == restoring:
            directory_listings.append(remote.label)
        return original_numbers()

    monkeypatch.setattr(remote, "list_step_numbers", counting_numbers)
    try:
        target = _state(99)
        assert restorer.restore(target) == 4
        assert all(torch.equal(target[name], _state(4)[name]) for name in target)
        # The local directory is read again after the restore, to set aside steps newer than the restored
        # one (a directory listing, no network); the object tier's committed steps are listed exactly once. Rank
        # 0 lists its step directories once more, after the restore, for interrupted promotions of newer steps
        # (none here, so nothing more is read for it).
        assert listed.count(remote.label) == 1 and restorer.local.label in listed
        assert directory_listings == [remote.label]
        read = [request for request in requests if request.endswith(("manifest.json", ".index.json"))]
        assert read and all("step-000000000004/" in request for request in read), \
            f"only metadata of the restored step is read, never each step's manifest: {requests}"
    finally:
        restorer.close()


def _save_then_restore_with_remote_down(rank: int, world_size: int, root: str, options: dict[str, Any]) -> bool:
    policy = ckptd.Policy(keep_local=None)
    manager = ckptd.CheckpointManager(root, remote="s3://bucket/run", storage_options=options, policy=policy,
                                      capture_rng=False)
    saved = {step: _state(10 * step + rank) for step in (1, 2)}
    for step, state in saved.items():
        assert manager.save(step, state)
    manager.wait()
    with contextlib.suppress(CkptdError):
        manager.close()
    restorer = ckptd.CheckpointManager(root, remote="s3://bucket/run", storage_options=options, policy=policy,
                                       capture_rng=False)
    target = _state(1000 + rank)
    started = time.monotonic()
    assert restorer.restore(target) == 2
    assert time.monotonic() - started < HANG_GUARD_S * load_per_core()
    assert all(torch.equal(target[name], saved[2][name]) for name in target)
    with contextlib.suppress(CkptdError):
        restorer.close()
    return True


@pytest.mark.multirank
def test_two_ranks_restore_from_local_with_the_object_tier_down(tmp_path: Path) -> None:
    results = run_multirank(_save_then_restore_with_remote_down, 2, str(tmp_path / "shared"), closed_port_options(),
                            timeout_s=120)
    assert results == [True, True]


@pytest.mark.s3
def test_a_store_that_never_answers_is_left_after_the_metadata_timeout(s3_server: Any, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """An endpoint that accepts connections and then says nothing (a hung proxy): the listing gives up
    after the short metadata read timeout, not the data transfers' one."""
    from ckptd.config import override
    from ckptd.testing.fault_proxy import FaultProxy

    root = tmp_path / "local"
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(5, _state(5))
    with FaultProxy(s3_server.endpoint_url, fraction=1.0, kinds=("stall",), stall_s=30.0) as proxy, \
            override(s3_metadata_read_timeout_s=1.0, s3_read_timeout_s=60.0):
        options = proxy.storage_options(s3_server.storage_options)
        restorer = ckptd.CheckpointManager(root, remote="s3://bucket/run", storage_options=options,
                                           capture_rng=False)
        try:
            target = _state(0)
            with caplog.at_level(logging.WARNING):
                step, took = _timed(lambda: restorer.restore(target))
            assert step == 5 and took < HANG_GUARD_S * load_per_core()
            assert all(torch.equal(target[name], _state(5)[name]) for name in target)
            assert len(_restore_warnings(caplog, "s3://bucket/run")) == 1
        finally:
            with contextlib.suppress(CkptdError):
                restorer.close()
