"""A third-party tier that implements only the small protocol (``tests/minimal_tier_plugin.py``: the eight
abstract methods of StorageTier and one capability), registered through a ``ckptd.storage`` entry point of an
installed distribution: it passes the tier conformance suite, and a CheckpointManager uses it as its remote
tier as it uses S3 (steps promoted in the background, restored from it on an empty node, every byte equal)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
import minimal_tier_plugin
from ckptd.testing.tier_conformance import TierConformance
from ckptd.tiers import ENTRY_POINT_GROUP, open_tier, registered_schemes
from ckptd.tiers.base import StorageTier
from ckptd.tiers.registry import tier_class, unregister_tier
from minimal_tier_plugin import SCHEME, BlobDirTier

#: What a tier must implement (ckptd.tiers.base): read, size, exists, write (with conditional create), delete, list.
SMALL_PROTOCOL = {"read_bytes", "size", "exists", "write_bytes", "delete_files", "list_objects"}


@pytest.fixture
def installed(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An installed distribution (a dist-info record on sys.path) whose entry point names the plugin tier."""
    site = tmp_path_factory.mktemp("site")
    info = site / "ckptd_blobdir_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptd-blobdir-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{SCHEME} = minimal_tier_plugin:BlobDirTier\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    unregister_tier(SCHEME)  # the class the entry point loaded stays registered in-process otherwise


def test_the_entry_point_opens_the_plugin_tier(installed: None, tmp_path: Path) -> None:
    assert SCHEME in registered_schemes()
    assert tier_class(SCHEME) is BlobDirTier
    tier = open_tier(f"{SCHEME}://{tmp_path}/store")
    assert isinstance(tier, BlobDirTier) and tier.root == tmp_path / "store"
    abstract = {name for name, member in vars(StorageTier).items() if getattr(member, "__isabstractmethod__", False)}
    assert abstract | {"list_objects"} == SMALL_PROTOCOL
    overridden = {name for name in vars(BlobDirTier) if name in vars(StorageTier) and not name.startswith("_")}
    assert overridden == SMALL_PROTOCOL | {"from_url", "kind", "capabilities"}, \
        "the plugin implements the small protocol and nothing more of StorageTier"


def test_a_tier_that_lists_nothing_is_refused_when_defined() -> None:
    implemented = {name: (lambda self, *args, **kwargs: None) for name in SMALL_PROTOCOL - {"list_objects"}}
    with pytest.raises(TypeError, match="Unlisted lists nothing"):
        type("Unlisted", (StorageTier,), implemented)
    type("AbstractBase", (StorageTier,), {})  # still abstract: its concrete subclasses are the ones checked


@contextlib.contextmanager
def _broken_writes(tier: StorageTier) -> Iterator[None]:
    """Writes put half their bytes in the file and then fail, as a full disk would."""
    original = minimal_tier_plugin.write_all

    def half(handle: Any, data: memoryview) -> None:
        original(handle, data[: len(data) // 2])
        raise OSError(28, "No space left on device (injected)")

    minimal_tier_plugin.write_all = half
    try:
        yield
    finally:
        minimal_tier_plugin.write_all = original


class TestPluginTierConformance(TierConformance):
    @pytest.fixture
    def tier(self, installed: None, tmp_path: Path) -> StorageTier:
        return open_tier(f"{SCHEME}://{tmp_path}/store")

    @pytest.fixture
    def write_fault(self) -> Callable[[StorageTier], Any]:
        return _broken_writes


def test_a_manager_promotes_to_the_plugin_tier_and_restores_from_it(installed: None, tmp_path: Path) -> None:
    remote = f"{SCHEME}://{tmp_path}/store"
    policy = ckptd.Policy(keep_local=None, remote_every_steps=1)
    state = {"weights": torch.randn(300, 200, generator=torch.Generator().manual_seed(3)),
             "table": torch.arange(70_000, dtype=torch.int64), "epoch": 2}
    with ckptd.CheckpointManager(tmp_path / "node-a", remote=remote, policy=policy, capture_rng=False) as manager:
        assert isinstance(manager.remote, BlobDirTier)
        manager.save(1, state)
        manager.wait_uploads()
        state["weights"].mul_(-1)
        manager.save(2, state)
    assert open_tier(remote).committed_steps() == [1, 2]

    target = {"weights": torch.zeros(300, 200), "table": torch.zeros(70_000, dtype=torch.int64), "epoch": 0}
    with ckptd.CheckpointManager(tmp_path / "node-b", remote=remote, policy=policy, capture_rng=False) as restorer:
        assert restorer.restore(target) == 2
        assert restorer.last_restore is not None and restorer.last_restore.tier == restorer.remote.label
    assert torch.equal(target["weights"], state["weights"]) and torch.equal(target["table"], state["table"])
    assert target["epoch"] == 2
