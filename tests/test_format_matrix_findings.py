"""Findings of the fault matrix's hostile-input rows (32), kept as regression tests: metadata nested
deeper than the JSON parser recurses, and a world size far beyond the ranks a manifest lists, are
refused with a FormatError naming the file and the step (they raised RecursionError and MemoryError,
which also stopped the restore instead of letting it fall back to the older step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.errors import FormatError
from ckptd.format.hashing import chunk_digest
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template
from ckptd.tiers.local import LocalTier

STATE_BYTES = 16 * 1024
FORGED = 2


@pytest.fixture
def two_steps(manager_factory: ManagerFactory, checkpoint_dir: Path) -> Path:
    with override(chunk_bytes=4096):
        manager = manager_factory()
        for step in (1, FORGED):
            manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
        manager.wait()
        manager.close()
    return checkpoint_dir


def _read_metadata(root: Path) -> None:
    tier = LocalTier(root)
    manifest = load_step_manifest(tier, FORGED)
    for entry in manifest.ranks:
        load_rank_index(tier, manifest, entry.rank)


def _nest_index(root: Path, depth: int) -> None:
    """Step 2's index with a field nested ``depth`` lists deep, its size and digest recorded in the manifest
    (matrix row 32, seed 3200000)."""
    text = json.dumps(tamper.read_json(tamper.index_path(root, FORGED)), separators=(",", ":"))
    raw = (text[:-1] + ',"deep":' + "[" * depth + "]" * depth + "}").encode()
    tamper.index_path(root, FORGED).write_bytes(raw)
    tamper.rewrite_manifest(root, FORGED, lambda body: body["ranks"][0].update(index_size=len(raw),
                                                                              index_digest=chunk_digest(raw)))


def _nest_manifest(root: Path, depth: int) -> None:
    body = tamper.read_json(tamper.manifest_path(root, FORGED))
    text = json.dumps(body)
    tamper.manifest_path(root, FORGED).write_text(text[:-1] + ',"deep":' + "[" * depth + "]" * depth + "}")


FORGERIES = {
    "deeply-nested-index": (lambda root: _nest_index(root, 100_000), "rank-00000.index.json"),
    "deeply-nested-manifest": (lambda root: _nest_manifest(root, 100_000), "manifest.json"),
    "world-size-2^40": (lambda root: tamper.rewrite_manifest(root, FORGED, lambda b: b.update(world_size=2**40)),
                        "manifest.json"),  # matrix row 32, seed 3200002
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_metadata_is_a_format_error_naming_the_file(two_steps: Path, case: str) -> None:
    forge, names = FORGERIES[case]
    forge(two_steps)
    with pytest.raises(FormatError) as caught:
        _read_metadata(two_steps)
    assert caught.value.step == FORGED and names in str(caught.value), str(caught.value)


@pytest.mark.parametrize("case", list(FORGERIES))
def test_restore_falls_back_past_it(two_steps: Path, manager_factory: ManagerFactory, case: str) -> None:
    FORGERIES[case][0](two_steps)
    live = synthetic_template(STATE_BYTES)
    assert manager_factory().restore(live) == 1
    assert_same_state(live, synthetic_state(1, STATE_BYTES))
