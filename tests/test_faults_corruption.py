"""Corruption of a committed step (bit flips, truncation, deletion, zeroed files, damaged index or
manifest) is detected and named, and restore falls back to the older intact step, whose bytes it returns."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.config import override
from ckptd.errors import CkptdError, IntegrityError
from ckptd.format.hashing import chunk_digest
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state, synthetic_template

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


@dataclass(frozen=True)
class Expected:
    """What the report of one damage must name: the damaged file (relative to the tier root), the reason
    for the file (sizes, digests) and, when chunks were damaged, exactly which (digest -> (tensor,
    stored offset)); a report naming another file, other sizes or another chunk fails the test."""

    file: str
    reason: str
    chunks: dict[str, tuple[str, int]] = field(default_factory=dict)


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _chunks(root: Path) -> list[tuple[str, int, int, str]]:
    """(tensor, stored offset, stored length, digest) of every chunk of the first data file, in file order."""
    return [(name, int(chunk[0]), int(chunk[1]), str(chunk[4]))
            for name, chunk in tamper.chunk_records(root, BAD_STEP, part=0)]


def flip_bit_in_middle_chunk(root: Path) -> Expected:
    chunks = _chunks(root)
    name, offset, length, digest = chunks[len(chunks) // 2]
    path = tamper.data_path(root, BAD_STEP)
    tamper.flip_bit(path, offset + length // 2, bit=3)
    return Expected(_relative(root, path), f"chunk {digest}", {digest: (name, offset)})


def zero_data(root: Path) -> Expected:
    chunks = _chunks(root)
    path = tamper.data_path(root, BAD_STEP)
    zero(path)
    return Expected(_relative(root, path), "chunk", {digest: (name, offset) for name, offset, _, digest in chunks})


def truncate(path: Path, keep: float) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(int(path.stat().st_size * keep))


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def resize_data(change: Callable[[Path], None]) -> Callable[[Path], Expected]:
    """A damage that changes the data file's size: the report names the recorded and the actual size."""
    def apply(root: Path) -> Expected:
        path = tamper.data_path(root, BAD_STEP)
        recorded = path.stat().st_size
        change(path)
        actual = 4096 if path.is_dir() else path.stat().st_size
        assert actual != recorded
        return Expected(_relative(root, path), f"data file size differs from the index "
                                               f"(expected {recorded}, got {actual})")
    return apply


def replace_by_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def damage_index(change: Callable[[Path], None]) -> Callable[[Path], Expected]:
    """A damage of the rank index: the report names the digest the manifest records and the actual one."""
    def apply(root: Path) -> Expected:
        path = tamper.index_path(root, BAD_STEP)
        (entry,) = tamper.read_json(tamper.manifest_path(root, BAD_STEP))["ranks"]
        change(path)
        actual = chunk_digest(path.read_bytes())
        assert actual != entry["index_digest"]
        return Expected(_relative(root, path), f"rank index does not match the manifest "
                                               f"(expected {entry['index_digest']}, got {actual})")
    return apply


def remove(pick: Callable[[Path, int], Path]) -> Callable[[Path], Expected]:
    def apply(root: Path) -> Expected:
        path = pick(root, BAD_STEP)
        path.unlink()
        return Expected(_relative(root, path), "file not found")
    return apply


def damage_manifest(change: Callable[[Path], None], reason: str) -> Callable[[Path], Expected]:
    def apply(root: Path) -> Expected:
        path = tamper.manifest_path(root, BAD_STEP)
        change(path)
        return Expected(_relative(root, path), reason)
    return apply


#: Damages step 2 in place and returns what its report must name.
DAMAGES: dict[str, Callable[[Path], Expected]] = {
    "flipped-bit-in-data": flip_bit_in_middle_chunk,
    "zeroed-data-file": zero_data,
    "truncated-data-file": resize_data(lambda path: truncate(path, 0.5)),
    "data-file-missing-its-last-byte": resize_data(lambda path: truncate(path, 0.9999)),
    "deleted-data-file": remove(tamper.data_path),
    "data-file-replaced-by-a-directory": resize_data(replace_by_directory),
    "corrupted-index": damage_index(lambda path: tamper.flip_bit(path, 40)),
    "zeroed-index": damage_index(zero),
    "deleted-index": remove(tamper.index_path),
    "corrupted-manifest": damage_manifest(lambda path: tamper.flip_bit(path, 60), "file is not a ckptd manifest"),
    "zeroed-manifest": damage_manifest(zero, "manifest is not valid JSON"),
    "truncated-manifest": damage_manifest(lambda path: truncate(path, 0.5), "manifest is not valid JSON"),
}

_FILE = re.compile(r"\bfile (step-[^\s)]+)")
_CHUNK = re.compile(r"chunk of tensor '([^']+)' at offset (\d+) .*?chunk ([0-9a-f]{32})")


def assert_names_the_damage(message: str, expected: Expected) -> None:
    """``message`` (why step 2 cannot be restored) names the damaged file, its reason and only damaged chunks."""
    assert _FILE.findall(message) == [expected.file], message
    assert expected.reason in message, message
    named = [(tensor, int(offset), digest) for tensor, offset, digest in _CHUNK.findall(message)]
    if expected.chunks:
        assert named, f"no chunk named: {message}"
        for tensor, offset, digest in named:
            assert expected.chunks.get(digest) == (tensor, offset), f"names an intact chunk: {message}"
    else:
        assert named == [], message


def assert_chunk_warnings_name_only_damaged_chunks(records: list[logging.LogRecord], expected: Expected) -> None:
    errors = [arg for record in records if isinstance(record.args, tuple)
              for arg in record.args if isinstance(arg, IntegrityError)]
    if not expected.chunks:
        assert errors == [], [str(error) for error in errors]
        return
    assert errors, "no chunk-level warning"
    for error in errors:
        assert error.chunk in expected.chunks and error.path == expected.file and error.step == BAD_STEP, str(error)
        if error.expected is not None:
            assert error.expected == error.chunk, str(error)
    if len(expected.chunks) == 1:
        assert {error.chunk for error in errors} == set(expected.chunks)


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_step_is_named_and_restore_returns_the_older_step(two_steps: Path, manager_factory: ManagerFactory,
                                                                  case: str, caplog: pytest.LogCaptureFixture) -> None:
    expected = DAMAGES[case](two_steps)
    live = synthetic_template(STATE_BYTES)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert manager_factory().restore(live) == 1
    assert_same_state(live, synthetic_state(1, STATE_BYTES))
    prefix = f"step {BAD_STEP} cannot be restored on rank 0"
    reports = [record.getMessage() for record in caplog.records if record.getMessage().startswith(prefix)]
    assert len(reports) == 1, caplog.text
    assert_names_the_damage(reports[0], expected)
    assert_chunk_warnings_name_only_damaged_chunks(caplog.records, expected)


@pytest.mark.parametrize("case", ["flipped-bit-in-data", "truncated-data-file", "corrupted-index", "deleted-index"])
def test_restoring_a_damaged_step_by_number_fails_naming_the_file(two_steps: Path, manager_factory: ManagerFactory,
                                                                  case: str) -> None:
    expected = DAMAGES[case](two_steps)
    with pytest.raises(CkptdError) as caught:
        manager_factory().restore(synthetic_template(STATE_BYTES), step=BAD_STEP)
    assert_names_the_damage(str(caught.value), expected)


def test_the_check_fails_when_another_chunk_or_file_is_named(two_steps: Path) -> None:
    expected = flip_bit_in_middle_chunk(two_steps)
    (digest, (tensor, offset)), = expected.chunks.items()
    other_tensor, other_offset, _, other = next(c for c in _chunks(two_steps) if c[3] != digest)
    good = (f"step 2 cannot be restored on rank 0, trying an older one: chunk of tensor '{tensor}' at offset "
            f"{offset} fails its digest: chunk {digest} (expected {digest}, got 0) (tier local x, step 2, "
            f"file {expected.file})")
    assert_names_the_damage(good, expected)
    for wrong in (good.replace(digest, other).replace(f"offset {offset} ", f"offset {other_offset} ")
                  .replace(f"'{tensor}'", f"'{other_tensor}'"),
                  good.replace(f"offset {offset} ", f"offset {offset + 1} "),
                  good.replace(expected.file, expected.file.replace(".data", ".index.json"))):
        with pytest.raises(AssertionError):
            assert_names_the_damage(wrong, expected)


def test_intact_steps_restore_without_warnings(two_steps: Path, manager_factory: ManagerFactory,
                                               caplog: pytest.LogCaptureFixture) -> None:
    live = synthetic_template(STATE_BYTES)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert manager_factory().restore(live) == BAD_STEP
    assert_same_state(live, synthetic_state(BAD_STEP, STATE_BYTES))
    assert caplog.text == ""
