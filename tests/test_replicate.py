"""replicate_step: a verified copy of a committed local step to a buddy's daemon (a real aiohttp peer server on
loopback, reached through the peer tier), and restore from it once the local root is gone."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.errors import CommitError, IntegrityError
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, TEMP_MARKER, step_dir
from ckptd.manager.restoring import restore_state
from ckptd.promotion.pinning import PinnedSteps
from ckptd.promotion.replicate import replicate_step
from ckptd.stepio.step_reader import verify_step
from ckptd.testing import run_multirank
from harness.peer_server import PeerServer
from ckptd.testing.tamper import chunk_location, flip_bit
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier

TOKEN = "replication-test-token"
NAMESPACE = "replicas/node-a/run1"


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 * 256 * 1024, generator=generator),  # 3 MiB: chunks in a data file of its own
            "small": torch.randn(100, generator=generator),  # in the rank's pack
            "other": torch.randn(1000, generator=generator)}


def _save(root: Path, steps: dict[int, dict[str, torch.Tensor]]) -> LocalTier:
    with override(chunk_bytes=1024 * 1024):
        with ckptd.CheckpointManager(root, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
            for step, state in steps.items():
                assert manager.save(step, state)
            manager.wait()
    return LocalTier(root)


class _Buddy:
    """Node B: a peer server keeping replicas, and counts of what it received."""

    def __init__(self, tmp_path: Path) -> None:
        self.replicas = tmp_path / "node-b-replicas"
        self.received: list[int] = []
        self.server = PeerServer(PeerNamespaces({}, self.replicas), token=TOKEN,
                                 on_received=lambda namespace, count: self.received.append(count))

    def directory(self, step: int) -> Path:
        return self.replicas / "node-a" / "run1" / step_dir(step)

    def tier(self) -> PeerTier:
        return PeerTier(self.server.url(NAMESPACE), token=TOKEN)


@pytest.fixture
def buddy(tmp_path: Path) -> Iterator[_Buddy]:
    node = _Buddy(tmp_path)
    with node.server:
        yield node


def _files(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_replicated_step_is_byte_equal_and_restores_without_the_local_root(tmp_path: Path, buddy: _Buddy) -> None:
    saved = {1: _state(1), 2: _state(2)}
    local = _save(tmp_path / "node-a", saved)
    peer = buddy.tier()
    sent: list[int] = []
    for step in (1, 2):
        report = replicate_step(local, peer, step, progress=sent.append)
        assert not report.already_committed and report.step == step and report.tier == peer.label
        local_files = _files(local.root / step_dir(step))
        assert _files(buddy.directory(step)) == local_files, "every file arrives with the same bytes"
        assert {name: peer.read_bytes(f"{step_dir(step)}/{name}") for name in local_files} == local_files
        assert report.files == len(local_files) and report.bytes_sent == sum(map(len, local_files.values()))
    assert sum(sent) > 3 * 1024 * 1024 and peer.committed_steps() == [1, 2]

    shutil.rmtree(local.root)  # node A lost its local tier
    target = {name: torch.zeros_like(value) for name, value in saved[2].items()}
    result = restore_state([peer], target, rank=0, world_size=1)
    assert result.step == 2 and result.tier == peer.label
    assert all(torch.equal(target[name], saved[2][name]) for name in target)

    with ckptd.CheckpointManager(tmp_path / "node-a-new", peer=buddy.server.url(NAMESPACE),
                                 storage_options={"peer_token": TOKEN}, capture_rng=False) as manager:
        restored = {name: torch.zeros_like(value) for name, value in saved[1].items()}
        assert manager.restore(restored, step=1) == 1
        assert all(torch.equal(restored[name], saved[1][name]) for name in restored)
        assert manager.last_restore is not None and manager.last_restore.tier == manager.peer.label
    peer.close()


def test_second_replication_sends_nothing(tmp_path: Path, buddy: _Buddy) -> None:
    local = _save(tmp_path / "node-a", {5: _state(5)})
    peer = buddy.tier()
    first = replicate_step(local, peer, 5)
    received = len(buddy.received)
    assert received == first.files
    again = replicate_step(local, peer, 5)
    assert again.already_committed and again.bytes_sent == 0 and again.files == 0
    assert len(buddy.received) == received, "nothing was sent the second time"
    assert _files(buddy.directory(5)) == _files(local.root / step_dir(5))


def test_a_different_step_with_that_number_is_refused(tmp_path: Path, buddy: _Buddy) -> None:
    peer = buddy.tier()
    replicate_step(_save(tmp_path / "first", {3: _state(3)}), peer, 3)
    before = _files(buddy.directory(3))
    with pytest.raises(CommitError) as caught:
        replicate_step(_save(tmp_path / "second", {3: _state(4)}), peer, 3)
    assert "different step" in str(caught.value) and caught.value.step == 3
    assert _files(buddy.directory(3)) == before, "the committed replica is untouched"


@pytest.mark.parametrize("tensor", ["big", "small"], ids=["streamed-data-file", "pack"])
def test_a_corrupt_local_chunk_commits_nothing(tmp_path: Path, buddy: _Buddy, tensor: str) -> None:
    local = _save(tmp_path / "node-a", {7: _state(7)})
    path, offset, length = chunk_location(local.root, 7, tensor, position=1 if tensor == "big" else 0)
    flip_bit(path, offset + length // 2)
    peer = buddy.tier()
    with pytest.raises(IntegrityError) as caught:
        replicate_step(local, peer, 7)
    assert path.name in str(caught.value) and caught.value.step == 7
    assert not peer.is_committed(7) and peer.committed_steps() == []
    directory = buddy.directory(7)
    left = sorted(os.listdir(directory)) if directory.is_dir() else []
    assert MANIFEST_NAME not in left and path.name not in left, left
    assert not [name for name in left if TEMP_MARKER in name], "no temporary left on the buddy"
    assert left == [], "what was sent before the bad chunk was discarded"


def test_a_pinned_step_whose_directory_is_gone(tmp_path: Path, buddy: _Buddy) -> None:
    local = _save(tmp_path / "node-a", {4: _state(4)})
    expected = _files(local.root / step_dir(4))
    pins = PinnedSteps(local)
    pins.pin(4, local.list_files(4))
    local.delete_step(4)  # local retention deleted it before the replication ran
    report = replicate_step(pins.tier, buddy.tier(), 4)
    assert not report.already_committed
    assert _files(buddy.directory(4)) == expected


def test_replication_into_a_directory(tmp_path: Path) -> None:
    local = _save(tmp_path / "node-a", {9: _state(9)})
    target = LocalTier(tmp_path / "copy")
    replicate_step(local, target, 9)
    assert _files(target.root / step_dir(9)) == _files(local.root / step_dir(9))
    assert replicate_step(local, target, 9).already_committed


def _save_on_two_nodes(rank: int, world_size: int, roots: list[str]) -> None:
    with ckptd.CheckpointManager(roots[rank], policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        assert manager.save(1, _state(10 + rank))
        manager.wait()


def test_a_node_directory_holding_some_ranks(tmp_path: Path, buddy: _Buddy) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]  # one directory per node, one rank each
    run_multirank(_save_on_two_nodes, 2, roots, timeout_s=120)
    node1 = LocalTier(roots[1])
    assert RANKS_HERE_NAME in node1.list_files(1), "node 1's directory holds rank 1 only"
    peer = buddy.tier()
    replicate_step(node1, peer, 1)
    assert _files(buddy.directory(1)) == _files(node1.root / step_dir(1))
    assert peer.committed_steps() == [1]
    assert list(verify_step(peer, 1)) == [], "every chunk of rank 1 verifies on the buddy"
    assert replicate_step(node1, peer, 1).already_committed
