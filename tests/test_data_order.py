"""The global sample order: a pure function of (manifest, seed, epoch), cut the same way for any world
size and worker count; shuffle sanity."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.data import DatasetManifest, EpochOrder, RankSchedule, ShardDataset, ShardLoader, index_dataset
from ckptd.data.testing import write_jsonl_shards
from ckptd.errors import ConfigError

SIZES = [17, 23, 19, 21, 20, 18]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> DatasetManifest:
    root = tmp_path_factory.mktemp("order-data")
    write_jsonl_shards(root, SIZES)
    return index_dataset(str(root), "jsonl").manifest


def _all_pairs(counts: list[int]) -> list[tuple[int, int]]:
    return [(shard, i) for shard, count in enumerate(counts) for i in range(count)]


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=12), seed=st.integers(0, 2**32),
       epoch=st.integers(0, 50), block=st.integers(1, 5), cut=st.data())
def test_every_epoch_is_a_permutation_and_slices_agree(counts: list[int], seed: int, epoch: int, block: int,
                                                       cut: st.DataObject) -> None:
    order = EpochOrder(counts, seed=seed, epoch=epoch, block_shards=block)
    everything = order.samples(0, order.total)
    assert sorted(everything) == _all_pairs(counts)
    start = cut.draw(st.integers(0, order.total))
    stop = cut.draw(st.integers(start, order.total))
    fresh = EpochOrder(counts, seed=seed, epoch=epoch, block_shards=block)  # a pure function: rebuilt
    assert fresh.samples(start, stop) == everything[start:stop]


def test_seeds_and_epochs_change_the_order() -> None:
    counts = [50] * 8
    base = EpochOrder(counts, seed=1, epoch=0).samples(0, 400)
    assert EpochOrder(counts, seed=2, epoch=0).samples(0, 400) != base
    assert EpochOrder(counts, seed=1, epoch=1).samples(0, 400) != base
    assert EpochOrder(counts, seed=1, epoch=0).samples(0, 400) == base


def test_shuffle_mixes_shards_and_samples() -> None:
    order = EpochOrder([100] * 8, seed=7, epoch=0, block_shards=4)
    first_batch = order.samples(0, 32)
    assert len({shard for shard, _ in first_batch}) >= 3  # within-block mixing of several shards
    locals_of_one_shard = [i for shard, i in order.samples(0, 400) if shard == first_batch[0][0]]
    assert locals_of_one_shard != sorted(locals_of_one_shard)  # within-shard shuffle
    shard_order = [int(s) for s in order.shard_sequence]
    assert sorted(shard_order) == list(range(8)) and shard_order != list(range(8))


def test_no_shuffle_is_manifest_order() -> None:
    order = EpochOrder([3, 2], seed=5, epoch=9, shuffle=False)
    assert order.samples(0, 5) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_rank_schedule_rejects_batches_the_world_cannot_split() -> None:
    with pytest.raises(ConfigError, match="multiple of the world size"):
        RankSchedule(global_batch_size=10, world_size=4)
    with pytest.raises(ConfigError, match="rank 4"):
        RankSchedule(global_batch_size=8, world_size=4, rank=4)


def _ids_per_step(manifest: DatasetManifest, tmp_path: Path, world: int, workers: int, epoch: int = 0
                  ) -> list[list[str]]:
    """The union, per global step, of what every rank's loader yields (rank order)."""
    per_rank = []
    for rank in range(world):
        dataset = ShardDataset(manifest, global_batch_size=8, seed=11, rank=rank, world_size=world,
                               cache_dir=tmp_path / "cache")
        loader = ShardLoader(dataset, num_workers=workers)
        loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
        per_rank.append([list(batch["id"]) for batch in loader])
    return [sum((rank_batches[step] for rank_batches in per_rank), []) for step in range(len(per_rank[0]))]


def test_world_size_and_workers_do_not_change_the_global_sequence(manifest: DatasetManifest,
                                                                  tmp_path: Path) -> None:
    reference = _ids_per_step(manifest, tmp_path, world=1, workers=0)
    assert len(reference) == sum(SIZES) // 8  # the final partial global batch is dropped
    assert len({i for step in reference for i in step}) == 8 * len(reference)
    assert _ids_per_step(manifest, tmp_path, world=4, workers=0) == reference
    assert _ids_per_step(manifest, tmp_path, world=2, workers=2) == reference
    assert _ids_per_step(manifest, tmp_path, world=1, workers=0, epoch=1) != reference
