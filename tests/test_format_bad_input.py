"""Bad input: forged manifests and indexes (unsafe paths, impossible extents, unknown versions) are
rejected with a typed error naming the file and the step, and restore falls back to an older intact
step; pickled payloads are refused unless the caller opts in, and never run otherwise."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.config import override
from ckptd.errors import (CkptdError, FormatError, FormatVersionError, IntegrityError, NoIntactCheckpointError,
                          PickleRefusedError, UnsafePathError)
from ckptd.format.layout import MANIFEST_NAME, rank_data_name, rank_index_name
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template
from ckptd.tiers.local import LocalTier

INDEX, MANIFEST, DATA = rank_index_name(0), MANIFEST_NAME, rank_data_name(0)
FORGED_STEP = 2
STATE_BYTES = 64 * 1024


@pytest.fixture
def two_steps(manager_factory: ManagerFactory, checkpoint_dir: Path) -> Path:
    """Steps 1 and 2 committed in ``checkpoint_dir`` with 4 KiB chunks."""
    with override(chunk_bytes=4096):
        manager = manager_factory()
        for step in (1, FORGED_STEP):
            manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
        manager.wait()
        manager.close()
    return checkpoint_dir


def load_step_metadata(root: Path, step: int) -> None:
    """Parse and check the manifest and every rank index of a step, as a reader does before reading."""
    tier = LocalTier(root)
    manifest = load_step_manifest(tier, step)
    for entry in manifest.ranks:
        load_rank_index(tier, manifest, entry.rank)


def edit_rank_entry(**changes: Any) -> Callable[[Path], None]:
    def forge(root: Path) -> None:
        tamper.rewrite_manifest(root, FORGED_STEP, lambda body: body["ranks"][0].update(changes))
    return forge


def edit_manifest(**changes: Any) -> Callable[[Path], None]:
    def forge(root: Path) -> None:
        tamper.rewrite_manifest(root, FORGED_STEP, lambda body: body.update(changes))
    return forge


def edit_index(**changes: Any) -> Callable[[Path], None]:
    def forge(root: Path) -> None:
        tamper.rewrite_index(root, FORGED_STEP, lambda body: body.update(changes))
    return forge


def edit_chunk(position: int, field: int, value: Any, *more: tuple[int, Any]) -> Callable[[Path], None]:
    """Set fields of the ``position``-th chunk (in file order) of the step's index."""
    def forge(root: Path) -> None:
        _, target = tamper.chunk_records(root, FORGED_STEP)[position]

        def change(body: dict[str, Any]) -> None:
            for tensor in body["tensors"].values():
                for chunk in tensor["chunks"]:
                    if chunk == target:
                        for index, replacement in ((field, value), *more):
                            chunk[index] = replacement
        tamper.rewrite_index(root, FORGED_STEP, change)
    return forge


def edit_tensor(**changes: Any) -> Callable[[Path], None]:
    def forge(root: Path) -> None:
        tamper.rewrite_index(root, FORGED_STEP, lambda body: body["tensors"]["wide"].update(changes))
    return forge


def overlap_second_chunk(root: Path) -> None:
    """Move the second chunk into the first one's data file, one byte past the first one's start."""
    first = tamper.chunk_records(root, FORGED_STEP)[0][1]
    edit_chunk(1, 0, first[0] + 1, (5, first[5]))(root)


def set_data_files(files: Callable[[list[list[Any]]], list[list[Any]]], *,
                   in_index: bool = True, in_manifest: bool = True) -> Callable[[Path], None]:
    """Replace rank 0's ``data_files`` list ([name, size] pairs) by ``files(current list)``."""
    def forge(root: Path) -> None:
        current = tamper.read_json(tamper.index_path(root, FORGED_STEP))["data_files"]
        if in_index:
            tamper.rewrite_index(root, FORGED_STEP, lambda body: body.update(data_files=files(current)))
        if in_manifest:
            tamper.rewrite_manifest(root, FORGED_STEP, lambda body: body["ranks"][0].update(data_files=files(current)))
    return forge


def first_file_as(name: str | None = None, size: int | None = None) -> Callable[[list[list[Any]]], list[list[Any]]]:
    """The data file list with the first file's name or size replaced (size: added to the true one)."""
    def change(files: list[list[Any]]) -> list[list[Any]]:
        first = [files[0][0] if name is None else name, files[0][1] + (size or 0), *files[0][2:]]
        return [first, *files[1:]]
    return change


@dataclass(frozen=True)
class Forgery:
    forge: Callable[[Path], None]
    error: type[CkptdError]
    names: str  # the file the error must name


FORGERIES: dict[str, Forgery] = {
    "manifest-index-parent-path": Forgery(edit_rank_entry(index_file="../" + INDEX), UnsafePathError, MANIFEST),
    "manifest-data-absolute-path": Forgery(set_data_files(first_file_as("/etc/passwd"), in_index=False),
                                           UnsafePathError, MANIFEST),
    "manifest-data-file-twice": Forgery(set_data_files(lambda files: files + files[:1], in_index=False),
                                        FormatError, MANIFEST),
    "manifest-data-files-not-pairs": Forgery(edit_rank_entry(data_files=[DATA]), FormatError, MANIFEST),
    "manifest-index-nested-path": Forgery(edit_rank_entry(index_file="sub/" + INDEX), UnsafePathError, MANIFEST),
    "manifest-unknown-version": Forgery(edit_manifest(format_version=99), FormatVersionError, MANIFEST),
    "manifest-negative-data-size": Forgery(edit_rank_entry(data_files=[[DATA, -1]]), FormatError, MANIFEST),
    "manifest-huge-index-size": Forgery(edit_rank_entry(index_size=2**62), IntegrityError, INDEX),
    "manifest-wrong-world-size": Forgery(edit_manifest(world_size=3), FormatError, MANIFEST),
    "manifest-other-step": Forgery(edit_manifest(step=7), FormatError, MANIFEST),
    "index-data-parent-path": Forgery(set_data_files(first_file_as("../" + DATA), in_manifest=False),
                                      UnsafePathError, INDEX),
    "index-data-absolute-path": Forgery(set_data_files(first_file_as("/dev/zero"), in_manifest=False),
                                        UnsafePathError, INDEX),
    "index-data-files-differ-from-manifest": Forgery(set_data_files(first_file_as(size=1), in_manifest=False),
                                                     IntegrityError, INDEX),
    "index-unknown-version": Forgery(edit_index(format_version=4), FormatVersionError, INDEX),
    "index-pack-in-version-2": Forgery(edit_index(format_version=2), FormatError, INDEX),
    "index-data-file-odd-marker": Forgery(set_data_files(lambda files: [[*files[0][:2], "zipped"], *files[1:]]),
                                          FormatError, MANIFEST),
    "index-chunk-in-unlisted-file": Forgery(edit_chunk(0, 5, 99), FormatError, INDEX),
    "index-chunk-without-file-number": Forgery(edit_chunk(0, 5, None), FormatError, INDEX),
    "index-negative-offset": Forgery(edit_chunk(1, 0, -4096), FormatError, INDEX),
    "index-huge-offset": Forgery(edit_chunk(1, 0, 2**62), FormatError, INDEX),
    "index-negative-length": Forgery(edit_chunk(0, 1, -1), FormatError, INDEX),
    "index-huge-length": Forgery(edit_chunk(0, 1, 2**40), FormatError, INDEX),
    "index-huge-raw-length": Forgery(edit_chunk(0, 2, 2**40), FormatError, INDEX),
    "index-chunk-size-not-raw-length": Forgery(edit_chunk(0, 1, 4095), FormatError, INDEX),
    "index-overlapping-extents": Forgery(overlap_second_chunk, FormatError, INDEX),
    "index-unknown-codec": Forgery(edit_chunk(0, 3, "lzma"), FormatError, INDEX),
    "index-shape-not-chunk-bytes": Forgery(edit_tensor(shape=[1]), FormatError, INDEX),
    "index-negative-dimension": Forgery(edit_tensor(shape=[-6144]), FormatError, INDEX),
    "index-unknown-dtype": Forgery(edit_tensor(dtype="float128"), FormatError, INDEX),
    "data-size-not-file-size": Forgery(set_data_files(first_file_as(size=4096)), IntegrityError, DATA),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_metadata_is_rejected_with_a_typed_error_naming_file_and_step(two_steps: Path, case: str) -> None:
    forgery = FORGERIES[case]
    forgery.forge(two_steps)
    with pytest.raises(forgery.error) as caught:
        load_step_metadata(two_steps, FORGED_STEP)
    assert caught.value.step == FORGED_STEP
    assert forgery.names in str(caught.value) and f"step {FORGED_STEP}" in str(caught.value)


@pytest.mark.parametrize("case", list(FORGERIES))
def test_restore_falls_back_past_a_forged_step(two_steps: Path, manager_factory: ManagerFactory, case: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    FORGERIES[case].forge(two_steps)
    live = synthetic_template(STATE_BYTES)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert manager_factory().restore(live) == 1
    assert_same_state(live, synthetic_state(1, STATE_BYTES))
    assert FORGERIES[case].names in caplog.text


class MarkerPayload:
    """Unpickling this object creates a marker file: proof that pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_is_refused_when_saving_without_opt_in(manager_factory: ManagerFactory, tmp_path: Path) -> None:
    manager = manager_factory()
    with pytest.raises(PickleRefusedError, match="allow_pickle"):
        manager.save(1, {"payload": MarkerPayload(tmp_path / "marker")}, force=True)
        manager.wait()
    assert manager.committed_steps() == []


def test_pickled_payload_never_runs_without_opt_in(manager_factory: ManagerFactory, checkpoint_dir: Path,
                                                   tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    writer = manager_factory(allow_pickle=True)
    writer.save(1, {"payload": MarkerPayload(marker), "weights": torch.ones(3)}, force=True)
    writer.wait()
    writer.close()
    assert not marker.exists()

    refusing = manager_factory()
    with pytest.raises(PickleRefusedError, match="allow_pickle"):
        refusing.restore({"weights": torch.zeros(3)})
    refusing.close()
    assert not marker.exists()

    opted_in: dict[str, Any] = {}
    assert manager_factory(allow_pickle=True).restore(opted_in) == 1
    assert marker.exists()  # the payload is live: it runs exactly when the caller opts in


SKELETON_FORGERIES: dict[str, dict[str, Any]] = {  # what the entry "meta" of step 2 is replaced with
    "object-ndarray": {"ndarray": "wide", "dtype": "|O", "shape": [1]},
    "unknown-ndarray-dtype": {"ndarray": "wide", "dtype": "not-a-dtype", "shape": [1]},
    "ndarray-shape-not-its-bytes": {"ndarray": "wide", "dtype": "<i8", "shape": [5, 5]},
    "object-numpy-scalar": {"np_scalar": "AAAAAAAAAAA=", "dtype": "|O"},
    "torch-attribute-as-dtype": {"dtype": "load"},
    "missing-tensor": {"tensor": "no-such-tensor"},
    "unknown-kind": {"lambda": "os.system"},
    "dict-not-a-list": {"dict": 5},
    "dict-key-not-a-scalar": {"dict": [[["unhashable"], {"value": 1}]]},
    "list-not-a-list": {"list": {"a": 1}},
    "size-of-strings": {"size": ["x"]},
    "bad-base64": {"bytes": "not base64!"},
}


@pytest.mark.parametrize("case", list(SKELETON_FORGERIES))
def test_forged_state_skeleton_is_rejected_and_restore_falls_back(two_steps: Path, manager_factory: ManagerFactory,
                                                                  case: str) -> None:
    def forge(body: dict[str, Any]) -> None:
        values = body["values"]
        skeleton = values["skeleton"] if "skeleton" in values else values  # the layout of index values
        for item in skeleton["dict"]:
            if item[0] == "meta":
                item[1] = SKELETON_FORGERIES[case]

    tamper.rewrite_index(two_steps, FORGED_STEP, forge)
    manager = manager_factory()
    with pytest.raises(CkptdError, match=f"step {FORGED_STEP}"):
        manager.restore(synthetic_template(STATE_BYTES), step=FORGED_STEP)
    live = synthetic_template(STATE_BYTES)
    assert manager.restore(live) == 1
    assert_same_state(live, synthetic_state(1, STATE_BYTES))
