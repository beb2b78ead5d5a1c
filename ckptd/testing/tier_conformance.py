"""A conformance suite every :class:`~ckptd.tiers.base.StorageTier` passes.

Use it by subclassing the mixins in a test module and providing a ``tier`` fixture that returns a
fresh, empty tier::

    class TestMyTier(TierConformance):
        @pytest.fixture
        def tier(self, tmp_path):
            return MyTier(...)

:class:`TierConformance` combines every mixin; each mixin can also be used alone.
"""

from __future__ import annotations

import os
import threading

import pytest

from ckptd.config import override
from ckptd.errors import AlreadyCommittedError, NotFoundError
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.tiers.base import StorageTier


def _payload(size: int, seed: int = 0) -> bytes:
    return bytes((index * 31 + seed) % 251 for index in range(size)) if size < 4096 else os.urandom(size)


class ReadWriteConformance:
    """Whole-file and ranged reads return exactly what was written."""

    def test_round_trip(self, tier: StorageTier) -> None:
        data = _payload(1000)
        tier.write_bytes(step_file(1, "rank-00000.data"), data)
        assert tier.read_bytes(step_file(1, "rank-00000.data")) == data

    def test_ranged_reads(self, tier: StorageTier) -> None:
        data = _payload(1000, seed=3)
        path = step_file(1, "rank-00000.data")
        tier.write_bytes(path, data)
        assert tier.read_bytes(path, 10, 100) == data[10:110]
        assert tier.read_bytes(path, 900) == data[900:]
        assert tier.read_bytes(path, 990, 50) == data[990:]
        assert tier.read_bytes(path, 5, 0) == b""

    def test_read_into(self, tier: StorageTier) -> None:
        data = _payload(300, seed=5)
        path = step_file(2, "rank-00000.data")
        tier.write_bytes(path, data)
        buffer = bytearray(100)
        tier.read_into(path, 50, memoryview(buffer))
        assert bytes(buffer) == data[50:150]

    def test_empty_file(self, tier: StorageTier) -> None:
        path = step_file(1, "empty.json")
        tier.write_bytes(path, b"")
        assert tier.exists(path) and tier.size(path) == 0 and tier.read_bytes(path) == b""

    def test_overwrite_replaces_whole_file(self, tier: StorageTier) -> None:
        path = step_file(1, "rank-00000.index.json")
        tier.write_bytes(path, b"a much longer first version")
        tier.write_bytes(path, b"short")
        assert tier.read_bytes(path) == b"short"
        assert tier.size(path) == 5

    def test_large_file_in_parts(self, tier: StorageTier) -> None:
        data = os.urandom(11 * 1024 * 1024 + 17)
        path = step_file(1, "rank-00001.data")
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=3):
            tier.write_bytes(path, data)
        assert tier.size(path) == len(data)
        assert tier.read_bytes(path) == data
        assert tier.read_bytes(path, 6 * 1024 * 1024, 1024) == data[6 * 1024 * 1024:6 * 1024 * 1024 + 1024]
        with override(s3_part_bytes=5 * 1024 * 1024, s3_concurrency=3):  # reads split into parts, too
            assert tier.read_bytes(path) == data
            assert tier.read_bytes(path, 1000, 7 * 1024 * 1024) == data[1000:1000 + 7 * 1024 * 1024]
            assert tier.read_bytes(path, 10 * 1024 * 1024) == data[10 * 1024 * 1024:]

    def test_memoryview_input(self, tier: StorageTier) -> None:
        path = step_file(1, "view.data")
        tier.write_bytes(path, memoryview(bytearray(b"0123456789"))[2:6])
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
        assert tier.read_bytes(path) == b"chunk bytes"
        assert tier.list_step_numbers() == []


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


class TierConformance(ReadWriteConformance, MissingFileConformance, ListingConformance,
                      ChunkStoreConformance, ConditionalWriteConformance):
    """Every conformance test; subclass it and provide a ``tier`` fixture."""
