"""Tiers are opened by URL scheme through the ``ckptd.storage`` entry points and describe themselves by
capabilities; the object tier owns its event-loop threads and stops them on close."""

from __future__ import annotations

import gc
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.errors import PluginError
from ckptd.tiers import ENTRY_POINT_GROUP, open_tier, register_tier, registered_schemes, scheme_of
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.registry import tier_class, unregister_tier


def test_the_package_registers_file_and_s3() -> None:
    names = {entry.name: entry.value for entry in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert names["file"] == "ckptd.tiers.local:LocalTier"
    assert names["s3"] == "ckptd.tiers.object:ObjectTier"
    assert {"file", "s3"} <= set(registered_schemes())


@pytest.mark.parametrize(("url", "scheme"), [("/data/ckpt", "file"), ("relative/dir", "file"),
                                             ("file:///data/ckpt", "file"), ("s3://bucket/run", "s3"),
                                             ("S3://bucket", "s3"), ("peer://node-2:8700/run", "peer")])
def test_scheme_of(url: str, scheme: str) -> None:
    assert scheme_of(url) == scheme


def test_paths_and_file_urls_open_the_local_tier(tmp_path: Path) -> None:
    for url in (str(tmp_path / "a"), f"file://{tmp_path}/b"):
        tier = open_tier(url, create=True)
        caps = tier.capabilities
        assert caps.node_local and caps.conditional_put and not caps.chunks_by_digest
        tier.write_bytes("step-00000001/x.bin", b"x")
        assert tier.read_bytes("step-00000001/x.bin") == b"x"
    with pytest.raises(Exception, match="does not exist"):
        open_tier(str(tmp_path / "missing"))


@pytest.mark.s3
def test_s3_urls_open_the_object_tier(s3_bucket: str, s3_options: dict) -> None:
    tier = open_tier(f"s3://{s3_bucket}/run", storage_options=s3_options)
    try:
        caps = tier.capabilities
        assert caps.chunks_by_digest and caps.conditional_put and caps.multipart_uploads and not caps.node_local
        tier.write_bytes("chunks/ab/c.raw", b"chunk")
        assert tier.read_bytes("chunks/ab/c.raw") == b"chunk"
    finally:
        tier.close()


def test_unknown_scheme_says_what_to_install() -> None:
    with pytest.raises(PluginError) as caught:
        open_tier("gs://bucket/run")
    assert "'gs'" in str(caught.value) and "gcsfs" in str(caught.value)
    with pytest.raises(PluginError) as caught:
        open_tier("nosuch://x")
    assert "nosuch" in str(caught.value) and "file" in str(caught.value) and ENTRY_POINT_GROUP in str(caught.value)


def test_missing_s3_dependency_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # an import of s3fs now fails as if it were not installed
    with pytest.raises(PluginError) as caught:
        open_tier("s3://bucket/run")
    assert "pip install 'ckptd[s3]'" in str(caught.value)


def _fake_distribution(root: Path, entries: dict[str, str]) -> None:
    """A real installed-package record on sys.path whose entry points name ``entries``."""
    info = root / "ckptd_test_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptd-test-plugin\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")


def test_a_plugin_that_fails_to_import_is_a_plugin_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckptd_test_plugin_tiers.py").write_text("class NotATier:\n    pass\n")
    _fake_distribution(tmp_path, {"broken": "ckptd_test_plugin_missing.tier:BrokenTier",
                                  "wrongtype": "ckptd_test_plugin_tiers:NotATier"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"broken", "wrongtype"} <= set(registered_schemes())
    with pytest.raises(PluginError) as caught:
        open_tier("broken://somewhere")
    assert "could not be imported" in str(caught.value)
    assert "ckptd_test_plugin_missing.tier:BrokenTier" in str(caught.value)
    assert isinstance(caught.value.__cause__, ImportError)
    with pytest.raises(PluginError, match="not a ckptd StorageTier"):
        open_tier("wrongtype://somewhere")


class _MirrorTier(LocalTier):
    """A plugin tier: a local directory named by its own scheme (what a peer or fsspec plugin does)."""

    kind = "mirror"

    @classmethod
    def from_url(cls, url: str, *, storage_options=None, create: bool = False) -> _MirrorTier:
        return cls(url.removeprefix("mirror://"), create=True)


def test_a_registered_tier_opens_its_scheme(tmp_path: Path) -> None:
    register_tier("mirror", _MirrorTier)
    try:
        tier = open_tier(f"mirror://{tmp_path}/m")
        assert isinstance(tier, _MirrorTier) and tier.root == tmp_path / "m"
        assert "mirror" in registered_schemes() and tier_class("MIRROR") is _MirrorTier
    finally:
        unregister_tier("mirror")
    with pytest.raises(PluginError):
        open_tier(f"mirror://{tmp_path}/m")


def _s3_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("ckptd-s3-io")]


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.s3
def test_object_tier_close_stops_its_event_loops(s3_bucket: str, s3_options: dict) -> None:
    before = set(_s3_threads())
    with override(s3_io_threads=3):
        tier = open_tier(f"s3://{s3_bucket}/run", storage_options=s3_options)
    tier.write_bytes("a.bin", b"a")
    assert tier.exists("a.bin")  # a lookup: the metadata client's lane starts them all
    mine = [thread for thread in _s3_threads() if thread not in before]
    assert len(mine) == 3 and all(thread.is_alive() for thread in mine)
    tier.close()
    assert not any(thread.is_alive() for thread in mine)
    assert tier.read_bytes("a.bin") == b"a", "a closed tier starts new lanes when used again"
    tier.close()
    assert set(_s3_threads()) <= before


@pytest.mark.s3
def test_changing_settings_does_not_leak_event_loops(s3_bucket: str, s3_options: dict) -> None:
    before = set(_s3_threads())
    for threads in (1, 2, 4, 2):
        with override(s3_io_threads=threads):
            tier = open_tier(f"s3://{s3_bucket}/run", storage_options=s3_options)
            tier.write_bytes("b.bin", b"b")
            assert tier.exists("b.bin")  # a lookup starts the lanes (a single PUT does not)
            assert len(set(_s3_threads()) - before) == threads
        del tier  # dropped without close(): its finalizer stops the loops
        gc.collect()
        assert _wait_until(lambda: set(_s3_threads()) <= before), [t.name for t in _s3_threads()]


class _CompatibleStoreTier(ObjectTier):
    """A plugin for "another S3-compatible store" under its own scheme, as a package would register it."""

    @classmethod
    def from_url(cls, url: str, *, storage_options=None, create: bool = False) -> _CompatibleStoreTier:
        return cls("s3://" + url.partition("://")[2], storage_options=storage_options)


@pytest.mark.s3
def test_a_plugin_scheme_works_as_the_managers_remote_untouched(s3_bucket: str, s3_options: dict,
                                                                 tmp_path: Path) -> None:
    import torch

    import ckptd

    register_tier("compat", _CompatibleStoreTier)
    try:
        state = {"weights": torch.arange(1000, dtype=torch.float32)}
        with ckptd.CheckpointManager(tmp_path / "a", remote=f"compat://{s3_bucket}/run", storage_options=s3_options,
                                     capture_rng=False) as manager:
            assert isinstance(manager.remote, _CompatibleStoreTier)
            manager.save(1, state)
            manager.wait_uploads()
        target = {"weights": torch.zeros(1000)}
        with ckptd.CheckpointManager(tmp_path / "b", remote=f"compat://{s3_bucket}/run", storage_options=s3_options,
                                     capture_rng=False) as restorer:
            assert restorer.restore(target) == 1
            assert restorer.last_restore is not None and restorer.last_restore.tier == restorer.remote.label
        assert torch.equal(target["weights"], state["weights"])
    finally:
        unregister_tier("compat")


@pytest.mark.s3
def test_a_closed_manager_leaves_no_object_tier_threads(s3_bucket: str, s3_options: dict, tmp_path: Path) -> None:
    import torch

    import ckptd

    before = set(_s3_threads())
    manager = ckptd.CheckpointManager(tmp_path / "a", remote=f"s3://{s3_bucket}/run", storage_options=s3_options,
                                      capture_rng=False)
    manager.save(1, {"weights": torch.ones(10)})
    manager.wait_uploads()
    assert set(_s3_threads()) - before, "the object tier runs its own I/O threads"
    manager.close()
    assert set(_s3_threads()) <= before
