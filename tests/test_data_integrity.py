"""Faults in data shards: flipped bits in the source and in the cache, truncation, missing shards,
transient corruption in transit, the skip policy, the cache size limit, and a changed manifest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.data import (DatasetManifest, ShardCache, ShardDataset, ShardLoader, VerifiedFetcher,
                        index_dataset)
from ckptd.data.cache import QUARANTINE_DIR, entry_name
from ckptd.data.source import ShardSource
from ckptd.data.testing import flip_bit, truncate, write_jsonl_shards
from ckptd.errors import IntegrityError, NotFoundError, ResumeMismatchError

SIZES = [12, 9, 14, 10, 11]


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_jsonl_shards(tmp_path / "data", SIZES, payload_bytes=40)
    return tmp_path / "data"


@pytest.fixture
def manifest(dataset_dir: Path) -> DatasetManifest:
    return index_dataset(str(dataset_dir), "jsonl").manifest


def _loader(manifest: DatasetManifest, cache: Path, **options: Any) -> ShardLoader:
    options.setdefault("global_batch_size", 4)
    return ShardLoader(ShardDataset(manifest, seed=5, cache_dir=cache, fetch_attempts=2, **options))


def _ids(loader: ShardLoader) -> list[str]:
    return [sample_id for batch in loader for sample_id in batch["id"]]


def test_flipped_bit_in_source_raises_naming_shard_and_digests(manifest: DatasetManifest, dataset_dir: Path,
                                                               tmp_path: Path) -> None:
    record = manifest.shards[2]
    flip_bit(dataset_dir / record.path)
    bad = (dataset_dir / record.path).read_bytes()
    with pytest.raises(IntegrityError) as caught:
        _ids(_loader(manifest, tmp_path / "cache"))
    error = caught.value
    assert record.path in str(error) and error.expected == record.digest
    assert error.actual and error.actual != record.digest and error.actual in str(error)
    assert "quarantined" in str(error) and "restore the shard" in str(error)
    kept = tmp_path / "cache" / QUARANTINE_DIR / entry_name(record)
    assert kept.read_bytes() == bad
    assert not (tmp_path / "cache" / entry_name(record)).exists()


def test_flipped_bit_in_cached_copy_is_refetched_and_repaired(manifest: DatasetManifest, dataset_dir: Path,
                                                              tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    reference = _ids(_loader(manifest, cache_dir))  # fills the cache
    record = manifest.shards[1]
    cached = cache_dir / entry_name(record)
    flip_bit(cached, byte_offset=5)
    assert cached.read_bytes() != (dataset_dir / record.path).read_bytes()
    fetcher = VerifiedFetcher(ShardSource(str(dataset_dir)), ShardCache(cache_dir))
    assert fetcher.load(record) == (dataset_dir / record.path).read_bytes()
    assert fetcher.refetches == 1
    assert cached.read_bytes() == (dataset_dir / record.path).read_bytes()
    flip_bit(cache_dir / entry_name(manifest.shards[3]))  # the loader repairs silently too
    assert _ids(_loader(manifest, cache_dir)) == reference


def test_truncated_shard_raises_with_sizes(manifest: DatasetManifest, dataset_dir: Path, tmp_path: Path) -> None:
    record = manifest.shards[0]
    truncate(dataset_dir / record.path, record.size - 7)
    with pytest.raises(IntegrityError, match=rf"{record.path}") as caught:
        _ids(_loader(manifest, tmp_path / "cache"))
    assert f"{record.size - 7} bytes, expected {record.size}" in str(caught.value)


def test_missing_shard_raises_not_found_naming_it(manifest: DatasetManifest, dataset_dir: Path,
                                                  tmp_path: Path) -> None:
    (dataset_dir / manifest.shards[4].path).unlink()
    with pytest.raises(NotFoundError, match=manifest.shards[4].path) as caught:
        _ids(_loader(manifest, tmp_path / "cache"))
    assert "re-index" in str(caught.value)


class _CorruptingSource(ShardSource):
    """The real local source, except that the first ``bad_reads`` reads come back with a flipped bit
    (corruption in transit, which a real disk cannot be made to produce on demand)."""

    def __init__(self, root: str, bad_reads: int) -> None:
        super().__init__(root)
        self.bad_reads = bad_reads
        self.reads = 0

    def read(self, relative: str) -> bytes:
        data = super().read(relative)
        self.reads += 1
        if self.reads <= self.bad_reads:
            return bytes([data[0] ^ 0x40]) + data[1:]
        return data


def test_transient_corruption_in_transit_is_retried(manifest: DatasetManifest, dataset_dir: Path,
                                                    tmp_path: Path) -> None:
    record = manifest.shards[3]
    source = _CorruptingSource(str(dataset_dir), bad_reads=2)
    fetcher = VerifiedFetcher(source, ShardCache(tmp_path / "cache"), attempts=3)
    assert fetcher.load(record) == (dataset_dir / record.path).read_bytes()
    assert source.reads == 3
    assert (tmp_path / "cache" / entry_name(record)).read_bytes() == (dataset_dir / record.path).read_bytes()
    failing = VerifiedFetcher(_CorruptingSource(str(dataset_dir), bad_reads=5), ShardCache(tmp_path / "c2"),
                              attempts=3)
    with pytest.raises(IntegrityError, match="after 3 fetch"):
        failing.load(record)


def test_skip_policy_is_deterministic_and_recorded(manifest: DatasetManifest, dataset_dir: Path,
                                                   tmp_path: Path) -> None:
    clean = _ids(_loader(manifest, tmp_path / "clean-cache"))
    bad = manifest.shards[2]
    flip_bit(dataset_dir / bad.path)
    uninterrupted = _loader(manifest, tmp_path / "c1", on_corrupt="skip")
    skipped_run = _ids(uninterrupted)
    assert skipped_run == [i for i in clean if not i.startswith("s002-")]
    assert uninterrupted.state_dict()["skipped_shards"] == [bad.path]
    first = _loader(manifest, tmp_path / "c2", on_corrupt="skip")
    iterator = iter(first)
    head = [sample_id for _ in range(6) for sample_id in next(iterator)["id"]]
    state = first.state_dict()
    resumed = _loader(manifest, tmp_path / "c3", on_corrupt="skip")
    resumed.load_state_dict(state)
    assert head + _ids(resumed) == skipped_run


def test_cache_stays_under_its_size_limit(manifest: DatasetManifest, tmp_path: Path) -> None:
    limit = max(s.size for s in manifest.shards) * 2 + 10
    ids = _ids(_loader(manifest, tmp_path / "cache", cache_bytes=limit, block_shards=1))
    assert len(ids) == (sum(SIZES) // 4) * 4
    cache = ShardCache(tmp_path / "cache", limit)
    assert 0 < cache.used_bytes() <= limit
    assert len(cache.entries()) < len(manifest.shards)


def test_prefetch_fills_the_cache_ahead(manifest: DatasetManifest, tmp_path: Path) -> None:
    loader = _loader(manifest, tmp_path / "cache", block_shards=1, prefetch_shards=3, shuffle=False)
    iterator = iter(loader)
    next(iterator)
    ahead = {entry_name(s) for s in manifest.shards[:4]}  # the shard in use and the next three

    def cached() -> set[str]:
        return {name for name, _, _ in ShardCache(tmp_path / "cache").entries()}

    deadline = time.monotonic() + 60  # only a prefetcher that never fills the cache takes this long
    while not ahead <= cached() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead <= cached()
    assert loader.samples_consumed == 4  # prefetching counts nothing as consumed


def test_state_from_another_manifest_is_refused_unless_allowed(manifest: DatasetManifest, dataset_dir: Path,
                                                              tmp_path: Path) -> None:
    loader = _loader(manifest, tmp_path / "cache")
    state = {**loader.state_dict(), "samples_consumed": 8, "manifest_digest": "0" * 32}
    with pytest.raises(ResumeMismatchError, match="allow_manifest_change"):
        loader.load_state_dict(state)
    relaxed = ShardLoader(ShardDataset(manifest, global_batch_size=4, cache_dir=tmp_path / "cache"),
                          allow_manifest_change=True)
    relaxed.load_state_dict(state)
    assert relaxed.samples_consumed == 8


@pytest.mark.s3
def test_object_store_shards_verified_and_repaired(dataset_dir: Path, tmp_path: Path, s3_bucket: str,
                                                   s3_options: dict[str, Any]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options)
    for path in sorted(dataset_dir.iterdir()):
        fs.pipe_file(f"{s3_bucket}/ds/{path.name}", path.read_bytes())
    manifest = index_dataset(f"s3://{s3_bucket}/ds", "jsonl", storage_options=s3_options).manifest
    local = index_dataset(str(dataset_dir), "jsonl").manifest
    assert manifest.digest == local.digest
    cache_dir = tmp_path / "cache"
    from_s3 = _ids(_loader(manifest, cache_dir, storage_options=s3_options))
    assert from_s3 == _ids(_loader(local, tmp_path / "local-cache"))
    record = manifest.shards[1]
    flip_bit(cache_dir / entry_name(record))
    assert _ids(_loader(manifest, cache_dir, storage_options=s3_options)) == from_s3
    assert (cache_dir / entry_name(record)).read_bytes() == fs.cat_file(f"{s3_bucket}/ds/{record.path}")
    damaged = bytearray(fs.cat_file(f"{s3_bucket}/ds/{record.path}"))
    damaged[3] ^= 0x01
    fs.pipe_file(f"{s3_bucket}/ds/{record.path}", bytes(damaged))
    (cache_dir / entry_name(record)).unlink()
    with pytest.raises(IntegrityError, match=f"s3://{s3_bucket}/ds/{record.path}"):
        _ids(_loader(manifest, cache_dir, storage_options=s3_options))
