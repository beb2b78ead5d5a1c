"""One rank of a real two-rank gloo job loses its node daemon: every rank promotes in-process from then on.

Each rank has a local directory of its own (two "nodes"); one daemon stand-in in this process serves the real
:class:`~ckptd.daemon.control_socket.ControlSocket` for both, and stops answering rank 1's commits from step 2
on (it holds them, as a daemon that accepts and never answers). Rank 1 gives its daemon up after its request
deadline; rank 0, whose daemon still answers, must give its own up too (rank 0 decides the promotions and
rank 1 follows it). Every step from the loss on reaches S3 with both ranks' files, byte-checked, and no
rank's ``wait_uploads`` or ``close`` raises. A daemon that answers a commit with an error (it is stopping, it
could not pin the step) did not take it: the trainer promotes that step, and the later ones, itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.daemon.control_socket import ControlSocket
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import StorageError
from ckptd.promotion.pinning import PinnedSteps
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.testing import run_multirank
from ckptd.tiers import open_tier
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.local import LocalTier

pytestmark = [pytest.mark.s3, pytest.mark.multirank]


@dataclass(frozen=True)
class _Root:
    name: str


class _TwoNodes:
    """Answers for roots ``a`` (rank 0) and ``b`` (rank 1); holds every commit of ``b`` from step 2 on."""

    def __init__(self, roots: dict[str, Path], remote: str) -> None:
        self.roots = {name: path.resolve() for name, path in roots.items()}
        self.remote, self.metrics = remote, DaemonMetrics()
        self.commits: list[tuple[str, int]] = []
        self.release = threading.Event()
        self.refuse: set[int] = set()  # steps answered with an error (as a stopping daemon does)

    def root_for(self, path: Path) -> _Root | None:
        return next((_Root(name) for name, root in self.roots.items() if root == Path(path).resolve()), None)

    def describe_root(self, root_name: str) -> dict[str, Any]:
        return {"root_name": root_name, "promotes": True, "replicates": False, "remote": self.remote,
                "peer_url": None, "pin_directory": ".ckptd-daemon-pins"}  # as the real daemon: it pins its own

    def notice_commit(self, root_name: str, step: int) -> bool:
        if root_name == "b" and step >= 2:
            self.release.wait(60)
        self.commits.append((root_name, step))
        if step in self.refuse:
            raise StorageError("the daemon is stopping: the step is not journaled", step=step, tier="local")
        return True

    def record_trainer_report(self, root_name: str, report: dict[str, Any]) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


def _train(rank: int, world_size: int, roots: list[str], remote: str, options: dict[str, Any],
           env: dict[str, str]) -> dict[str, Any]:
    import ckptd

    os.environ.update(env)  # here, not in the test: the ranks fork from a forkserver started with its own env
    with ckptd.CheckpointManager(roots[rank], remote=remote, storage_options=options, capture_rng=False,
                                 policy=ckptd.Policy(keep_local=None)) as manager:
        took = manager.daemon_promotes
        for step in range(1, 6):
            manager.save(step, {f"rank{rank}": torch.full((16 * 1024,), float(rank * 100 + step))})
            manager.wait()
        manager.wait_uploads()
        return {"took": took, "promotes_at_end": manager.daemon_promotes,
                "uploaded": [report.step for report in manager.upload_reports]}


@pytest.fixture
def nodes(tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    directory = Path(tempfile.mkdtemp(prefix="ckptd-loss-"))
    roots = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for root in roots.values():
        root.mkdir()
    remote = f"s3://{s3_bucket}/run1"
    stand_in = _TwoNodes(roots, remote)
    server = ControlSocket(stand_in, directory / "c.sock", allowed_uids=frozenset({os.geteuid()}))
    server.start()
    try:
        yield {"roots": roots, "remote": remote, "options": s3_options, "socket": server.path, "daemon": stand_in}
    finally:
        stand_in.release.set()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_rank_that_loses_its_daemon_turns_every_rank_to_in_process_promotion(nodes):
    env = {"CKPTD_DAEMON_SOCKET": str(nodes["socket"]), "CKPTD_DAEMON_REQUEST_TIMEOUT_S": "1",
           "CKPTD_COMMIT_TIMEOUT_S": "30",  # bounds a follower's wait for rank 0's decisions
           # A follower's pin cap may release a step rank 0 announces later (the uploader's own race, not the
           # hand-off's): a cap above the steps of this run keeps it out of this test.
           "CKPTD_PIN_MAX_STEPS": "16"}
    roots = [str(nodes["roots"]["a"]), str(nodes["roots"]["b"])]
    results = run_multirank(_train, 2, roots, nodes["remote"], nodes["options"], env, timeout_s=150)
    assert [result["took"] for result in results] == [True, True], results
    assert [result["promotes_at_end"] for result in results] == [False, False], results  # both gave it up
    assert results[0]["uploaded"] == results[1]["uploaded"] and 5 in results[0]["uploaded"], results
    remote = open_tier(nodes["remote"], storage_options=nodes["options"])
    assert 5 in remote.committed_steps()
    for step in results[0]["uploaded"]:
        manifest = load_step_manifest(remote, step)
        assert set(ranks_held(remote, step, manifest)) == {0, 1}
        assert list(verify_step(remote, step)) == []
    assert ("a", 1) in nodes["daemon"].commits and not [step for root, step in nodes["daemon"].commits
                                                        if root == "a" and step >= 4]


def test_a_commit_the_daemon_refuses_is_promoted_in_process_and_leaves_no_pin(nodes, monkeypatch):
    import ckptd

    monkeypatch.setenv("CKPTD_DAEMON_SOCKET", str(nodes["socket"]))
    nodes["daemon"].refuse = {3}
    root = nodes["roots"]["a"]
    with ckptd.CheckpointManager(root, remote=nodes["remote"], storage_options=nodes["options"], capture_rng=False,
                                 policy=ckptd.Policy(keep_local=None)) as manager:
        assert manager.daemon_promotes
        for step in range(1, 5):
            manager.save(step, {"weights": torch.full((16 * 1024,), float(step))})
            manager.wait()
        manager.wait_uploads()
        assert not manager.daemon_promotes
    assert nodes["daemon"].commits == [("a", 1), ("a", 2), ("a", 3)]  # not told of step 4
    remote = open_tier(nodes["remote"], storage_options=nodes["options"])
    assert 4 in remote.committed_steps() and list(verify_step(remote, 4)) == []
    assert PinnedSteps(LocalTier(root)).pinned() == [], "every pin promoted or released"


def test_steps_an_earlier_run_left_pinned_are_promoted_in_process_though_a_daemon_runs(nodes, monkeypatch):
    import ckptd
    from ckptd.format.layout import MANIFEST_NAME, rank_files

    root = nodes["roots"]["a"]
    with ckptd.CheckpointManager(root, capture_rng=False, daemon="off", policy=ckptd.Policy(keep_local=None)) as first:
        first.save(1, {"weights": torch.full((16 * 1024,), 1.0)})
    local = LocalTier(root)  # the earlier run crashed before promoting step 1; retention deleted it since
    PinnedSteps(local).pin(1, rank_files(local.list_files(1), 0) + [MANIFEST_NAME])
    local.delete_step(1)
    local.close()
    monkeypatch.setenv("CKPTD_DAEMON_SOCKET", str(nodes["socket"]))
    with ckptd.CheckpointManager(root, remote=nodes["remote"], storage_options=nodes["options"], capture_rng=False,
                                 policy=ckptd.Policy(keep_local=None)) as manager:
        assert not manager.daemon_promotes  # only an in-process uploader resumes .promoting
        manager.wait_uploads()
    remote = open_tier(nodes["remote"], storage_options=nodes["options"])
    assert remote.committed_steps() == [1] and list(verify_step(remote, 1)) == []
    assert PinnedSteps(LocalTier(root)).pinned() == []
