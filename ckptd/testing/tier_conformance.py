"""A conformance suite every :class:`~ckptd.tiers.base.StorageTier` passes.

Use it by subclassing the mixins in a test module and providing a ``tier`` fixture that returns a
fresh, empty tier, and a ``write_fault`` fixture: a function that takes the tier and returns a context
manager inside which the tier's writes fail part-way (after some bytes went out), by wrapping the
tier's real I/O::

    class TestMyTier(TierConformance):
        @pytest.fixture
        def tier(self, tmp_path):
            return MyTier(...)

        @pytest.fixture
        def write_fault(self):
            return my_fault_injector

:class:`TierConformance` combines every mixin; each mixin can also be used alone. ckptd's own tests
run it for every scheme in the :mod:`ckptd.tiers.registry`.

The read contract the suite checks: ``read_bytes(path, offset, length)`` returns the bytes from
``offset`` up to ``offset + length`` or the end of the file, whichever comes first, so a range that
starts at or past the end is empty; ``read_into`` raises :class:`~ckptd.errors.IntegrityError` when
the file cannot fill the whole buffer. A file is listed (``exists``, ``list_files``) only once it is
complete, and a write that fails leaves nothing listed and an earlier version of the file intact.

A tier whose :attr:`~ckptd.tiers.base.TierCapabilities.reads_committed_only` is set (the peer tier)
runs the same tests: before a file is read back the suite checks that its bytes are refused
(NotFoundError) and then commits its step with a manifest, so the reads are of a committed step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ContextManager

import pytest

from ckptd.config import override
from ckptd.errors import AlreadyCommittedError, CkptdError, IntegrityError, NotFoundError
from ckptd.format.layout import TEMP_MARKER
from ckptd.format.layout import MANIFEST_NAME, parse_step_dir, step_dir, step_file
from ckptd.tiers.base import StorageTier


def _payload(size: int, seed: int = 0) -> bytes:
    return bytes((index * 31 + seed) % 251 for index in range(size)) if size < 4096 else os.urandom(size)


def _readable(tier: StorageTier, path: str) -> bool:
    """Prepare to read ``path`` back; returns whether its bytes can be read at all. On a tier that reads
    only committed steps its bytes are refused first (NotFoundError, though the file exists), then its
    step is committed with a manifest; a file in no step (a chunk) is never readable there."""
    if not tier.capabilities.reads_committed_only:
        return True
    assert tier.exists(path), f"{path} was written"
    with pytest.raises(NotFoundError):
        tier.read_bytes(path)
    step = parse_step_dir(path.split("/")[0])
    if step is None:
        return False
    if not tier.is_committed(step):
        tier.write_bytes(step_file(step, MANIFEST_NAME), b"{}")
    return True


class ReadWriteConformance:
    """Whole-file and ranged reads return exactly what was written."""

    def test_round_trip(self, tier: StorageTier) -> None:
        data = _payload(1000)
        tier.write_bytes(step_file(1, "rank-00000.data"), data)
        assert _readable(tier, step_file(1, "rank-00000.data"))
        assert tier.read_bytes(step_file(1, "rank-00000.data")) == data

    def test_ranged_reads(self, tier: StorageTier) -> None:
        data = _payload(1000, seed=3)
        path = step_file(1, "rank-00000.data")
        tier.write_bytes(path, data)
        assert _readable(tier, path)
        assert tier.read_bytes(path, 10, 100) == data[10:110]
        assert tier.read_bytes(path, 900) == data[900:]
        assert tier.read_bytes(path, 990, 50) == data[990:]
        assert tier.read_bytes(path, 5, 0) == b""

    def test_read_into(self, tier: StorageTier) -> None:
        data = _payload(300, seed=5)
        path = step_file(2, "rank-00000.data")
        tier.write_bytes(path, data)
        assert _readable(tier, path)
        buffer = bytearray(100)
        tier.read_into(path, 50, memoryview(buffer))
        assert bytes(buffer) == data[50:150]

    def test_read_whole_into(self, tier: StorageTier) -> None:
        data = os.urandom(11 * 1024 * 1024 + 17)
        path = step_file(2, "rank-00000.data")
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=3):
            tier.write_bytes(path, data)
            assert _readable(tier, path)
            buffer = bytearray(len(data))
            tier.read_whole_into(path, memoryview(buffer))  # in parts where the tier reads by part
            assert buffer == data
        small = step_file(3, "small.json")
        tier.write_bytes(small, b"0123456789")
        assert _readable(tier, small)
        buffer = bytearray(10)
        tier.read_whole_into(small, memoryview(buffer))
        assert buffer == b"0123456789"
        for wrong in (9, 11, 0):  # a buffer of another size than the file: its size is wrong
            with pytest.raises(IntegrityError) as caught:
                tier.read_whole_into(small, memoryview(bytearray(wrong)))
            assert caught.value.path == small
        with pytest.raises(NotFoundError):
            tier.read_whole_into(step_file(3, "absent.data"), memoryview(bytearray(4)))

    def test_empty_file(self, tier: StorageTier) -> None:
        path = step_file(1, "empty.json")
        tier.write_bytes(path, b"")
        assert tier.exists(path) and tier.size(path) == 0 and _readable(tier, path)
        assert tier.read_bytes(path) == b""

    def test_overwrite_replaces_whole_file(self, tier: StorageTier) -> None:
        path = step_file(1, "rank-00000.index.json")
        tier.write_bytes(path, b"a much longer first version")
        tier.write_bytes(path, b"short")
        assert _readable(tier, path)
        assert tier.read_bytes(path) == b"short"
        assert tier.size(path) == 5

    def test_large_file_in_parts(self, tier: StorageTier) -> None:
        data = os.urandom(11 * 1024 * 1024 + 17)
        path = step_file(1, "rank-00001.data")
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=3):
            tier.write_bytes(path, data)
        assert tier.size(path) == len(data) and _readable(tier, path)
        assert tier.read_bytes(path) == data
        assert tier.read_bytes(path, 6 * 1024 * 1024, 1024) == data[6 * 1024 * 1024:6 * 1024 * 1024 + 1024]
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=3):  # reads split into parts, too
            assert tier.read_bytes(path) == data
            assert tier.read_bytes(path, 1000, 7 * 1024 * 1024) == data[1000:1000 + 7 * 1024 * 1024]
            assert tier.read_bytes(path, 10 * 1024 * 1024) == data[10 * 1024 * 1024:]

    def test_write_stream(self, tier: StorageTier) -> None:
        for wrong in ([b"0123456789", b"extra"], [b"01234"]):  # longer, shorter than announced
            with pytest.raises(IntegrityError):
                tier.write_stream(step_file(1, "rank-00001.data"), 10, lambda wrong=wrong: iter(wrong))
        pieces = [_payload(1000, seed=1), b"", memoryview(_payload(3000, seed=2)), _payload(17, seed=3)]
        path = step_file(1, "rank-00000.data")
        tier.write_stream(path, 4017, lambda: iter(pieces))
        assert _readable(tier, path)
        assert tier.read_bytes(path) == b"".join(bytes(piece) for piece in pieces)
        assert not tier.exists(step_file(1, "rank-00001.data")), "a wrong-sized stream stores nothing"
        assert "rank-00001.data" not in tier.list_files(1)

    def test_memoryview_input(self, tier: StorageTier) -> None:
        path = step_file(1, "view.data")
        tier.write_bytes(path, memoryview(bytearray(b"0123456789"))[2:6])
        assert _readable(tier, path)
        assert tier.read_bytes(path) == b"2345"


class MissingFileConformance:
    """Absent files raise NotFoundError naming the file; deleting them is not an error."""

    def test_missing_read(self, tier: StorageTier) -> None:
        with pytest.raises(NotFoundError) as caught:
            tier.read_bytes(step_file(9, "nothing.data"))
        assert "nothing.data" in str(caught.value)

    def test_missing_size_and_exists(self, tier: StorageTier) -> None:
        assert not tier.exists(step_file(9, "nothing.data"))
        with pytest.raises(NotFoundError):
            tier.size(step_file(9, "nothing.data"))

    def test_directory_is_not_a_file(self, tier: StorageTier) -> None:
        tier.write_bytes(step_file(4, "rank-00000.data"), b"x")
        assert not tier.exists(step_dir(4))

    def test_delete_missing_is_ignored(self, tier: StorageTier) -> None:
        tier.delete_files([step_file(9, "nothing.data")])
        tier.delete_step(9)


class ListingConformance:
    """Steps and files are listed in order; only steps with a manifest count as committed."""

    def test_empty_tier(self, tier: StorageTier) -> None:
        assert tier.list_step_numbers() == []
        assert tier.committed_steps() == []
        assert tier.list_files(1) == []

    def test_steps_and_files(self, tier: StorageTier) -> None:
        for step in (12, 3, 7):
            tier.write_bytes(step_file(step, "rank-00000.data"), b"d")
            tier.write_bytes(step_file(step, "rank-00000.index.json"), b"{}")
        tier.write_bytes("chunks/ab/unrelated.raw", b"c")
        assert tier.list_step_numbers() == [3, 7, 12]
        assert tier.list_files(7) == ["rank-00000.data", "rank-00000.index.json"]

    def test_commit_is_the_manifest(self, tier: StorageTier) -> None:
        tier.write_bytes(step_file(5, "rank-00000.index.json"), b"{}")
        assert not tier.is_committed(5) and tier.committed_steps() == []
        tier.write_bytes(step_file(5, MANIFEST_NAME), b"{}")
        assert tier.is_committed(5) and tier.committed_steps() == [5]

    def test_delete_step_uncommits_and_removes(self, tier: StorageTier) -> None:
        for step in (1, 2):
            tier.write_bytes(step_file(step, "rank-00000.index.json"), b"{}")
            tier.write_bytes(step_file(step, MANIFEST_NAME), b"{}")
        tier.delete_step(1)
        assert tier.committed_steps() == [2]
        assert tier.list_files(1) == []
        assert 1 not in tier.list_step_numbers()

    def test_delete_files(self, tier: StorageTier) -> None:
        paths = [step_file(1, f"file-{index}.bin") for index in range(3)]
        for path in paths:
            tier.write_bytes(path, b"1")
        tier.delete_files(paths[:2])
        assert [tier.exists(path) for path in paths] == [False, False, True]


class ChunkStoreConformance:
    """Tiers that store chunks by digest keep them under ``chunks/`` outside every step."""

    def test_chunk_path_round_trip(self, tier: StorageTier) -> None:
        key = "ab/" + "ab" * 16 + ".raw"
        path = tier.chunk_path(key)
        assert path.startswith("chunks/") and path.endswith(key)
        tier.write_bytes(path, b"chunk bytes")
        if _readable(tier, path):
            assert tier.read_bytes(path) == b"chunk bytes"
        else:  # its bytes are refused (checked by _readable), its size is not
            assert tier.size(path) == len(b"chunk bytes")
        assert tier.list_step_numbers() == []

    def test_chunks_are_listed_with_their_sizes(self, tier: StorageTier) -> None:
        tier.write_bytes(tier.chunk_path("ab/first.raw"), b"12345")
        tier.write_bytes(tier.chunk_path("cd/second.raw"), b"")
        tier.write_bytes(step_file(1, "rank-00000.index.json"), b"{}")
        if type(tier).list_objects is StorageTier.list_objects:  # a tier that lists by step only
            assert not tier.capabilities.chunks_by_digest, "a chunk store is listed through list_objects"
            with pytest.raises(NotImplementedError):
                tier.list_objects("chunks")
            return
        listed = {obj.path: obj.size for obj in tier.list_objects("chunks")}
        assert listed == {"chunks/ab/first.raw": 5, "chunks/cd/second.raw": 0}

    def test_read_ahead_is_a_hint(self, tier: StorageTier) -> None:
        hinted = [tier.chunk_path("ab/first.raw"), tier.chunk_path("cd/second.raw"), tier.chunk_path("ef/x.raw")]
        tier.write_bytes(hinted[0], b"12345")
        tier.write_bytes(hinted[1], b"")
        tier.read_ahead(hinted)
        if all([_readable(tier, path) for path in hinted[:2]]):
            assert [tier.read_bytes(path) for path in hinted[:2]] == [b"12345", b""]
        with pytest.raises(NotFoundError):
            tier.read_bytes(hinted[2])
        tier.read_ahead([])


class ConditionalWriteConformance:
    """``write_bytes(..., if_absent=True)`` writes a file once and never replaces it."""

    def test_if_absent_writes_a_new_file(self, tier: StorageTier) -> None:
        path = step_file(3, MANIFEST_NAME)
        tier.write_bytes(path, b"first", if_absent=True)
        assert tier.read_bytes(path) == b"first"

    def test_if_absent_refuses_an_existing_file_and_keeps_it(self, tier: StorageTier) -> None:
        path = step_file(3, MANIFEST_NAME)
        tier.write_bytes(path, b"committed manifest")
        with pytest.raises(AlreadyCommittedError) as caught:
            tier.write_bytes(path, b"another manifest", if_absent=True)
        assert MANIFEST_NAME in str(caught.value) and caught.value.tier is not None
        assert tier.read_bytes(path) == b"committed manifest"
        assert tier.list_files(3) == [MANIFEST_NAME], "a refused write leaves no temporary behind"

    def test_if_absent_with_the_same_bytes_counts_as_written(self, tier: StorageTier) -> None:
        path = step_file(3, MANIFEST_NAME)
        tier.write_bytes(path, b"same bytes", if_absent=True)
        tier.write_bytes(path, memoryview(b"same bytes"), if_absent=True)
        assert tier.read_bytes(path) == b"same bytes"

    def test_if_absent_large_file(self, tier: StorageTier) -> None:
        path = step_file(3, "rank-00000.data")
        data = os.urandom(6 * 1024 * 1024 + 3)
        with override(s3_part_bytes=5 * 1024 * 1024):
            tier.write_bytes(path, data, if_absent=True)
            with pytest.raises(AlreadyCommittedError):
                tier.write_bytes(path, os.urandom(len(data)), if_absent=True)
        assert _readable(tier, path)
        assert tier.read_bytes(path) == data

    def test_racing_writers_exactly_one_wins(self, tier: StorageTier) -> None:
        if not tier.capabilities.conditional_put:
            pytest.skip("the tier's if_absent is look-up-then-write, not race-free (its capabilities say so)")
        path = step_file(8, MANIFEST_NAME)
        writers = 6
        start = threading.Barrier(writers)
        outcomes: dict[int, str] = {}

        def write(index: int) -> None:
            payload = f"writer {index}".encode()
            start.wait()
            try:
                tier.write_bytes(path, payload, if_absent=True)
                outcomes[index] = "won"
            except AlreadyCommittedError:
                outcomes[index] = "refused"

        threads = [threading.Thread(target=write, args=(index,)) for index in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        winners = [index for index, outcome in outcomes.items() if outcome == "won"]
        assert len(outcomes) == writers and len(winners) == 1, outcomes
        assert tier.read_bytes(path) == f"writer {winners[0]}".encode()
        assert tier.list_files(8) == [MANIFEST_NAME]


#: What a ``write_fault`` fixture returns: given the tier, a context manager in which its writes fail.
WriteFault = Callable[[StorageTier], ContextManager[None]]


def _leftovers(tier: StorageTier, step: int) -> list[str]:
    """What a failed write may have left where the tier keeps its files, beyond what it lists."""
    found: list[str] = []
    if tier.capabilities.node_local:
        directory = getattr(tier, "root") / step_dir(step)
        found += [name for name in (os.listdir(directory) if directory.is_dir() else []) if TEMP_MARKER in name]
    if tier.capabilities.multipart_uploads:
        found += [path for path, _, _ in tier.incomplete_uploads()]
    return found


class AtomicVisibilityConformance:
    """Nothing half-written is ever listed, and a failed write leaves nothing behind."""

    def test_a_file_is_listed_only_when_complete(self, tier: StorageTier) -> None:
        path = step_file(6, "rank-00000.data")
        data = os.urandom(12 * 1024 * 1024 + 5)
        seen_sizes: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                listed = tier.exists(path) or "rank-00000.data" in tier.list_files(6)
                if listed:
                    seen_sizes.append(tier.size(path))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, name="conformance-watcher")
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=2):
            watcher.start()
            try:
                tier.write_bytes(path, data)
            finally:
                done.set()
                watcher.join(timeout=60)
        assert all(size == len(data) for size in seen_sizes), f"listed before complete: sizes {set(seen_sizes)}"
        assert _readable(tier, path)
        assert tier.read_bytes(path) == data

    def test_a_file_written_piece_by_piece_appears_at_commit(self, tier: StorageTier) -> None:
        path = step_file(6, "rank-00000.data")
        pieces = [os.urandom(256 * 1024) for _ in range(4)]
        if not tier.capabilities.node_local:  # object stores take whole objects: one PUT or a multipart upload
            tier.write_bytes(path, b"".join(pieces))
            assert _readable(tier, path)
            assert tier.read_bytes(path) == b"".join(pieces)
            return
        handle = getattr(tier, "open_file")(path)
        for piece in pieces:
            handle.write(piece)
            assert not tier.exists(path) and tier.list_files(6) == []
        handle.commit()
        assert tier.read_bytes(path) == b"".join(pieces) and tier.list_files(6) == ["rank-00000.data"]
        aborted = getattr(tier, "open_file")(step_file(6, "rank-00001.data"))
        aborted.write(pieces[0])
        aborted.abort()
        assert tier.list_files(6) == ["rank-00000.data"] and _leftovers(tier, 6) == []

    @pytest.mark.parametrize("size", [1000, 11 * 1024 * 1024 + 7], ids=["small", "in-parts"])
    def test_a_failed_write_leaves_nothing_listed(self, tier: StorageTier, write_fault: WriteFault,
                                                  size: int) -> None:
        path = step_file(7, "rank-00000.data")
        tier.write_bytes(step_file(7, "rank-00000.index.json"), b"{}")
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=2), write_fault(tier), \
                pytest.raises(CkptdError) as caught:
            tier.write_bytes(path, os.urandom(size))
        assert "rank-00000.data" in str(caught.value)
        assert not tier.exists(path)
        assert tier.list_files(7) == ["rank-00000.index.json"]
        assert _leftovers(tier, 7) == []

    def test_a_failed_overwrite_keeps_the_earlier_version(self, tier: StorageTier,
                                                          write_fault: WriteFault) -> None:
        path = step_file(7, "rank-00000.index.json")
        tier.write_bytes(path, b"version one")
        with write_fault(tier), pytest.raises(CkptdError):
            tier.write_bytes(path, b"version two, longer than the first")
        assert _readable(tier, path)
        assert tier.read_bytes(path) == b"version one"
        committed = [MANIFEST_NAME] if tier.capabilities.reads_committed_only else []  # by _readable
        assert tier.list_files(7) == [*committed, "rank-00000.index.json"] and _leftovers(tier, 7) == []

    def test_a_failed_conditional_write_leaves_nothing(self, tier: StorageTier, write_fault: WriteFault) -> None:
        path = step_file(7, MANIFEST_NAME)
        with write_fault(tier), pytest.raises(CkptdError):
            tier.write_bytes(path, b"manifest", if_absent=True)
        assert not tier.exists(path) and not tier.is_committed(7) and _leftovers(tier, 7) == []
        tier.write_bytes(path, b"manifest", if_absent=True)  # the failed attempt does not block a retry
        assert tier.read_bytes(path) == b"manifest"


class ShortReadConformance:
    """Ranges that run past the end behave the same on every tier (see the module docstring)."""

    def test_ranges_past_the_end(self, tier: StorageTier) -> None:
        data = _payload(1000, seed=7)
        path = step_file(1, "rank-00000.data")
        tier.write_bytes(path, data)
        assert _readable(tier, path)
        assert tier.read_bytes(path, 990, 50) == data[990:]
        assert tier.read_bytes(path, 1000, 10) == b""
        assert tier.read_bytes(path, 1000) == b""
        assert tier.read_bytes(path, 5000, 10) == b""
        assert tier.read_bytes(path, 0, 10_000) == data

    def test_ranges_of_an_empty_file(self, tier: StorageTier) -> None:
        path = step_file(1, "empty.data")
        tier.write_bytes(path, b"")
        assert _readable(tier, path)
        assert tier.read_bytes(path, 0, 10) == b"" and tier.read_bytes(path, 3) == b""

    @pytest.mark.parametrize(("offset", "length"), [(950, 100), (1000, 1), (4096, 4096)])
    def test_read_into_past_the_end_raises(self, tier: StorageTier, offset: int, length: int) -> None:
        path = step_file(1, "rank-00000.data")
        tier.write_bytes(path, _payload(1000, seed=9))
        assert _readable(tier, path)
        with pytest.raises(IntegrityError) as caught:
            tier.read_into(path, offset, memoryview(bytearray(length)))
        assert "rank-00000.data" in str(caught.value)

    def test_missing_file_ranges_raise(self, tier: StorageTier) -> None:
        with pytest.raises(NotFoundError):
            tier.read_bytes(step_file(1, "absent.data"), 10, 10)
        with pytest.raises(NotFoundError):
            tier.read_into(step_file(1, "absent.data"), 0, memoryview(bytearray(8)))


class ConcurrentReadConformance:
    """Several threads reading ranges of one file at once each get exactly their bytes."""

    def test_concurrent_ranged_reads(self, tier: StorageTier) -> None:
        data = os.urandom(3 * 1024 * 1024 + 11)
        path = step_file(2, "rank-00000.data")
        tier.write_bytes(path, data)
        assert _readable(tier, path)
        step = 97 * 1024 + 3
        ranges = [(offset, min(step * 2, len(data) - offset)) for offset in range(0, len(data), step)]

        def read(span: tuple[int, int]) -> bool:
            offset, length = span
            return tier.read_bytes(path, offset, length) == data[offset:offset + length]

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="conformance-reader") as pool:
            assert all(pool.map(read, ranges * 2))

    def test_concurrent_read_into(self, tier: StorageTier) -> None:
        data = os.urandom(2 * 1024 * 1024)
        path = step_file(2, "rank-00000.data")
        tier.write_bytes(path, data)
        assert _readable(tier, path)
        piece = 256 * 1024
        target = bytearray(len(data))

        def fill(offset: int) -> None:
            tier.read_into(path, offset, memoryview(target)[offset:offset + piece])

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="conformance-reader") as pool:
            list(pool.map(fill, range(0, len(data), piece)))
        assert bytes(target) == data


class TierConformance(ReadWriteConformance, MissingFileConformance, ListingConformance,
                      ChunkStoreConformance, ConditionalWriteConformance, AtomicVisibilityConformance,
                      ShortReadConformance, ConcurrentReadConformance):
    """Every conformance test; subclass it and provide a ``tier`` fixture."""
