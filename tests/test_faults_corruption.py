"""Corruption of a committed step (bit flips, truncation, deletion, zeroed files, damaged index or
manifest) is detected and named, and restore falls back to the older intact step, whose bytes it returns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.errors import CkptdError
from ckptd.format.layout import MANIFEST_NAME, rank_data_name, rank_index_name
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from ckptd.testing.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from ckptd.testing.workloads import synthetic_state, synthetic_template

STATE_BYTES = 64 * 1024
CHUNK_BYTES = 4096
BAD_STEP = 2


@pytest.fixture(params=["raw", "zstd"])
def two_steps(request: pytest.FixtureRequest, manager_factory: ManagerFactory, checkpoint_dir: Path) -> Path:
    """Steps 1 and 2 committed (with small chunks, in the codec of the parameter)."""
    with override(chunk_bytes=CHUNK_BYTES):
        manager = manager_factory(codec=request.param)
        for step in (1, BAD_STEP):
            manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
        manager.wait()
        manager.close()
    return checkpoint_dir


def middle_chunk(root: Path) -> list[object]:
    """The middle chunk of the first data file (the one every rank has)."""
    records = tamper.chunk_records(root, BAD_STEP, part=0)
    return records[len(records) // 2][1]


def flip_bit_in_middle_chunk(root: Path) -> str:
    chunk = middle_chunk(root)
    offset, length = int(chunk[0]), int(chunk[1])  # type: ignore[call-overload]
    tamper.flip_bit(tamper.data_path(root, BAD_STEP), offset + length // 2, bit=3)
    return str(chunk[4])


def truncate(path: Path, keep: float) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(int(path.stat().st_size * keep))


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def replace_by_directory(root: Path) -> None:
    path = tamper.data_path(root, BAD_STEP)
    path.unlink()
    path.mkdir()


def zero_data(root: Path) -> str:
    zero(tamper.data_path(root, BAD_STEP))
    return str(tamper.chunk_records(root, BAD_STEP, part=0)[0][1][4])


@dataclass(frozen=True)
class Damage:
    #: Damages step 2 in place; returns the digest of a chunk the report must name, or "".
    apply: Callable[[Path], str]
    names: str  # the file the report must name


def damage(action: Callable[[Path], object], names: str) -> Damage:
    def apply(root: Path) -> str:
        action(root)
        return ""
    return Damage(apply, names)


DATA, INDEX = rank_data_name(0), rank_index_name(0)
DAMAGES: dict[str, Damage] = {
    "flipped-bit-in-data": Damage(flip_bit_in_middle_chunk, DATA),
    "zeroed-data-file": Damage(zero_data, DATA),
    "truncated-data-file": damage(lambda root: truncate(tamper.data_path(root, BAD_STEP), 0.5), DATA),
    "data-file-missing-its-last-byte": damage(lambda root: truncate(tamper.data_path(root, BAD_STEP), 0.9999), DATA),
    "deleted-data-file": damage(lambda root: tamper.data_path(root, BAD_STEP).unlink(), DATA),
    "data-file-replaced-by-a-directory": damage(replace_by_directory, DATA),
    "corrupted-index": damage(lambda root: tamper.flip_bit(tamper.index_path(root, BAD_STEP), 40), INDEX),
    "zeroed-index": damage(lambda root: zero(tamper.index_path(root, BAD_STEP)), INDEX),
    "deleted-index": damage(lambda root: tamper.index_path(root, BAD_STEP).unlink(), INDEX),
    "corrupted-manifest": damage(lambda root: tamper.flip_bit(tamper.manifest_path(root, BAD_STEP), 60), MANIFEST_NAME),
    "zeroed-manifest": damage(lambda root: zero(tamper.manifest_path(root, BAD_STEP)), MANIFEST_NAME),
    "truncated-manifest": damage(lambda root: truncate(tamper.manifest_path(root, BAD_STEP), 0.5), MANIFEST_NAME),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_step_is_named_and_restore_returns_the_older_step(two_steps: Path, manager_factory: ManagerFactory,
                                                                  case: str, caplog: pytest.LogCaptureFixture) -> None:
    bad_chunk = DAMAGES[case].apply(two_steps)
    live = synthetic_template(STATE_BYTES)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert manager_factory().restore(live) == 1
    assert_same_state(live, synthetic_state(1, STATE_BYTES))
    assert DAMAGES[case].names in caplog.text and f"step {BAD_STEP}" in caplog.text
    assert bad_chunk in caplog.text


@pytest.mark.parametrize("case", ["flipped-bit-in-data", "truncated-data-file", "corrupted-index"])
def test_restoring_a_damaged_step_by_number_fails_naming_the_file(two_steps: Path, manager_factory: ManagerFactory,
                                                                  case: str) -> None:
    bad_chunk = DAMAGES[case].apply(two_steps)
    with pytest.raises(CkptdError) as caught:
        manager_factory().restore(synthetic_template(STATE_BYTES), step=BAD_STEP)
    assert DAMAGES[case].names in str(caught.value) and bad_chunk in str(caught.value)


def test_intact_steps_restore_without_warnings(two_steps: Path, manager_factory: ManagerFactory,
                                               caplog: pytest.LogCaptureFixture) -> None:
    live = synthetic_template(STATE_BYTES)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert manager_factory().restore(live) == BAD_STEP
    assert_same_state(live, synthetic_state(BAD_STEP, STATE_BYTES))
    assert caplog.text == ""
