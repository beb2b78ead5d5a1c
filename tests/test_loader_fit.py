"""A loader that fits training code: tensor batches (int64 ``[batch, seq_len]`` token windows, an
input/target split), runs for a number of steps across epochs with the epoch in the state, sample ids
per batch, and DataLoader options passed through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd.data import ShardDataset, ShardLoader, index_dataset, list_batch
from ckptd.data.testing import sample_id, write_jsonl_shards
from ckptd.errors import ConfigError

SEQ_LEN = 9
SHARD_TOKENS = (90, 72, 54)  # 10 + 8 + 6 = 24 windows
BATCH = 4


@pytest.fixture(scope="module")
def token_manifest(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tokens")
    start = 0
    for shard, count in enumerate(SHARD_TOKENS):  # token value = its position in the corpus: windows are checkable
        np.arange(start, start + count, dtype=np.uint16).tofile(root / f"part-{shard}.bin")
        start += count
    return index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}).manifest


def _window_starts(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


def test_token_batches_are_int64_tensors_of_whole_windows(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loader = ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, seed=1, cache_dir=tmp_path / "c"))
    batches = list(loader)
    assert len(batches) == 24 // BATCH
    for batch in batches:
        assert isinstance(batch, torch.Tensor) and batch.dtype == torch.int64 and batch.shape == (BATCH, SEQ_LEN)
        # every row is one window of consecutive tokens that starts at a window boundary of its shard
        assert torch.equal(batch - batch[:, :1], torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN))
    starts = sorted(s for batch in batches for s in _window_starts(batch))
    assert len(set(starts)) == 24  # one epoch: every window once


def test_split_targets_gives_inputs_and_next_token_targets(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dataset = ShardDataset(token_manifest, global_batch_size=BATCH, seed=1, cache_dir=tmp_path / "c",
                           split_targets=True)
    whole = ShardDataset(token_manifest, global_batch_size=BATCH, seed=1, cache_dir=tmp_path / "c")
    for (inputs, targets), tokens in zip(ShardLoader(dataset, num_workers=2), ShardLoader(whole), strict=True):
        assert inputs.shape == targets.shape == (BATCH, SEQ_LEN - 1)
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.is_contiguous() and targets.is_contiguous()
        assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(targets, tokens[:, 1:])


def test_split_targets_refuses_batches_that_are_not_token_windows(tmp_path: Path) -> None:
    write_jsonl_shards(tmp_path / "data", [8])
    manifest = index_dataset(str(tmp_path / "data"), "jsonl").manifest
    dataset = ShardDataset(manifest, global_batch_size=4, cache_dir=tmp_path / "c", split_targets=True)
    with pytest.raises(ConfigError, match=r"split_targets needs batches of token ids shaped \[batch, seq_len"):
        next(iter(ShardLoader(dataset)))


def test_records_collate_by_field_and_list_batch_keeps_samples(tmp_path: Path) -> None:
    write_jsonl_shards(tmp_path / "data", [8])
    manifest = index_dataset(str(tmp_path / "data"), "jsonl").manifest
    batch = next(iter(ShardLoader(ShardDataset(manifest, global_batch_size=4, shuffle=False,
                                               cache_dir=tmp_path / "c"))))
    assert batch["id"] == [sample_id(0, i) for i in range(4)]
    assert batch["index"].dtype == torch.int64 and batch["index"].tolist() == [0, 1, 2, 3]
    samples = next(iter(ShardLoader(ShardDataset(manifest, global_batch_size=4, shuffle=False,
                                                 cache_dir=tmp_path / "c", collate_fn=list_batch))))
    assert [sample["id"] for sample in samples] == batch["id"]


def test_steps_runs_across_epochs_and_keeps_the_epoch_in_the_state(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    per_epoch = 24 // BATCH

    def loader() -> ShardLoader:
        return ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, seed=3, cache_dir=tmp_path / "c"),
                           steps=2 * per_epoch + 2)

    whole = loader()
    assert len(whole) == 2 * per_epoch + 2
    batches = [_window_starts(batch) for batch in whole]
    assert len(batches) == 2 * per_epoch + 2  # one iteration, three epochs touched
    assert whole.epoch == 2 and whole.samples_consumed == 2 * BATCH and whole.batches_taken == len(batches)
    assert list(whole) == []  # the run is done: iterating again yields nothing
    first, second = batches[:per_epoch], batches[per_epoch:2 * per_epoch]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) and first != second  # a new order each epoch

    interrupted = loader()
    iterator = iter(interrupted)
    head = [_window_starts(next(iterator)) for _ in range(per_epoch + 1)]
    state = interrupted.state_dict_for_step(per_epoch + 1)
    assert (state["epoch"], state["samples_consumed"], state["step"]) == (1, BATCH, per_epoch + 1)
    resumed = loader()
    resumed.load_state_dict(state)
    assert len(resumed) == per_epoch + 1
    assert head + [_window_starts(batch) for batch in resumed] == batches


def test_steps_with_batches_per_step_counts_micro_batches(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loader = ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, seed=3, cache_dir=tmp_path / "c"),
                         steps=4, batches_per_step=3)
    assert sum(1 for _ in loader) == 12  # 4 steps of 3 micro-batches: two epochs of 6 batches
    assert (loader.epoch, loader.samples_consumed, loader.batches_taken) == (1, 6 * BATCH, 12)


def test_sample_ids_come_with_each_batch_and_name_its_samples(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dataset = ShardDataset(token_manifest, global_batch_size=BATCH, seed=5, cache_dir=tmp_path / "c")
    offsets = {"part-0.bin": 0, "part-1.bin": 90, "part-2.bin": 162}
    seen = []
    for workers in (0, 2):
        loader = ShardLoader(dataset, num_workers=workers, with_sample_ids=True)
        run = []
        for batch, ids in loader:
            assert len(ids) == BATCH
            for row, sample in zip(batch.tolist(), ids, strict=True):
                shard, index = sample.split("#")
                assert row[0] == offsets[shard] + int(index) * SEQ_LEN  # the id names the window in the batch
            run.append(ids)
        seen.append(run)
    assert seen[0] == seen[1]  # same ids in the same order with or without workers
    assert len({i for batch in seen[0] for i in batch}) == 24


def test_num_workers_and_pin_memory_reach_the_dataloader(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loader = ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, cache_dir=tmp_path / "c"),
                         num_workers=2, pin_memory=True, prefetch_factor=3)
    data_loader = loader._data_loader()
    assert (data_loader.num_workers, data_loader.pin_memory, data_loader.prefetch_factor) == (2, True, 3)
    with pytest.warns(UserWarning, match="pin_memory"):  # no accelerator here: torch says it cannot pin
        batches = list(loader)
    assert len(batches) == 24 // BATCH and all(b.dtype == torch.int64 for b in batches)
    with pytest.raises(ConfigError, match="num_workers"):
        ShardLoader(loader.dataset, num_workers=-1)
    with pytest.raises(ConfigError, match="batches_per_step"):
        ShardLoader(loader.dataset, batches_per_step=0)


@pytest.mark.gpu
def test_pin_memory_pins_tensor_batches(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dataset = ShardDataset(token_manifest, global_batch_size=BATCH, cache_dir=tmp_path / "c", split_targets=True)
    for workers in (0, 2):
        inputs, targets = next(iter(ShardLoader(dataset, num_workers=workers, pin_memory=True)))
        assert inputs.is_pinned() and targets.is_pinned()


def test_list_batches_hold_copies_and_tensor_batches_match_them(token_manifest, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Token windows are read as views into their shard; a list batch copies them (a kept sample must not
    keep its shard in memory), and the tensor batches hold the same tokens."""
    as_lists = list(ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, seed=1,
                                             cache_dir=tmp_path / "c", collate_fn=list_batch)))
    as_tensors = list(ShardLoader(ShardDataset(token_manifest, global_batch_size=BATCH, seed=1,
                                               cache_dir=tmp_path / "c")))
    assert len(as_lists) == len(as_tensors) == 24 // BATCH
    for samples, batch in zip(as_lists, as_tensors):
        assert all(sample.base is None and sample.flags.writeable for sample in samples)
        assert torch.equal(torch.from_numpy(np.stack(samples).astype(np.int64)), batch)
