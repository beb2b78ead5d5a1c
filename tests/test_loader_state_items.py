"""Data loaders as state items of CheckpointManager (ckptd.state.loaders).

- torchdata's ``StatefulDataLoader`` (shuffled, 2 workers), saved in the middle of an epoch and restored in
  a new interpreter whose global RNG differs: the rest of that epoch and the next one are the batches of
  an uninterrupted run.
- A plain ``DataLoader`` saves no position: the save warns once, naming the state key and the fix, and a
  restore leaves the live loader as it is while the other entries come back.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptd import CheckpointManager, Policy
from ckptd.data import has_position, loader_state_item

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

SAMPLES, BATCH, WORKERS = 40, 4, 2
BATCHES_PER_EPOCH = SAMPLES // BATCH
SAVE_AFTER = 3  # batches of the second epoch before the save


def _loader(stateful: bool = True) -> DataLoader:
    dataset = TensorDataset(torch.arange(SAMPLES))
    kind = StatefulDataLoader if stateful else DataLoader
    return kind(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS)


def _ids(batch: list[torch.Tensor]) -> list[int]:
    return batch[0].tolist()


def _resume(root: str) -> None:
    """The child: a new loader, another global seed, the saved position; prints the batches it then yields."""
    torch.manual_seed(999)
    loader = _loader()
    with CheckpointManager(root) as manager:
        restored = manager.restore({"loader": loader})
    rest = [_ids(batch) for batch in loader]  # the rest of the interrupted epoch
    following = [_ids(batch) for batch in loader]
    print(json.dumps({"restored": restored, "rest": rest, "following": following}))


def test_a_stateful_dataloader_with_workers_resumes_mid_epoch_in_a_new_process(tmp_path: Path) -> None:
    torch.manual_seed(7)
    reference_loader = _loader()
    reference = [[_ids(batch) for batch in reference_loader] for _ in range(3)]

    torch.manual_seed(7)
    loader = _loader()
    assert [_ids(batch) for batch in loader] == reference[0]
    epoch = iter(loader)
    seen = [_ids(next(epoch)) for _ in range(SAVE_AFTER)]
    assert seen == reference[1][:SAVE_AFTER]
    with CheckpointManager(tmp_path / "ckpt", policy=Policy(every_steps=1)) as manager:
        manager.save(5, {"loader": loader})
    del epoch

    child = subprocess.run([sys.executable, __file__, str(tmp_path / "ckpt")], capture_output=True, text=True,
                           timeout=240)
    assert child.returncode == 0, child.stderr[-4000:]
    resumed = json.loads(child.stdout.strip().splitlines()[-1])
    assert resumed["restored"] == 5
    assert resumed["rest"] == reference[1][SAVE_AFTER:]
    assert resumed["following"] == reference[2]
    assert len(resumed["rest"]) == BATCHES_PER_EPOCH - SAVE_AFTER


def test_a_plain_dataloader_is_named_in_one_warning_and_left_alone_on_restore(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loader = _loader(stateful=False)
    weights = torch.arange(6, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="ckptd.loaders"):
        with CheckpointManager(tmp_path / "ckpt", policy=Policy(every_steps=1)) as manager:
            manager.save(1, {"train_loader": loader, "weights": weights})
            manager.save(2, {"train_loader": loader, "weights": weights + 1})
    warnings = [record.getMessage() for record in caplog.records if record.name == "ckptd.loaders"]
    assert len(warnings) == 1, warnings
    assert "'train_loader'" in warnings[0] and "StatefulDataLoader" in warnings[0]
    assert "sampler=RandomSampler" in warnings[0] and f"num_workers={WORKERS}" in warnings[0]

    live = {"train_loader": loader, "weights": torch.zeros(6)}
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore(live) == 2
    assert live["train_loader"] is loader
    assert torch.equal(live["weights"], weights + 1)


def test_a_restore_into_a_state_without_the_loader_adds_no_entry_for_it(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt", policy=Policy(every_steps=1)) as manager:
        manager.save(1, {"train_loader": _loader(stateful=False), "weights": torch.ones(4)})
    live = {"weights": torch.zeros(4)}
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore(live) == 1
    assert set(live) == {"weights"} and torch.equal(live["weights"], torch.ones(4))


class _PreparedWithoutState(DataLoader):
    """The shape of accelerate's loader prepared without ``use_stateful_dataloader``: state methods, no state."""

    use_stateful_dataloader = False

    def state_dict(self) -> dict:
        raise AttributeError("'DataLoader' object has no attribute 'dl_state_dict'")

    def load_state_dict(self, state: dict) -> None:
        raise AttributeError("'DataLoader' object has no attribute 'dl_state_dict'")


def test_a_loader_with_state_methods_but_no_state_gets_the_marker_and_the_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loader = _PreparedWithoutState(TensorDataset(torch.arange(8)), batch_size=2)
    assert not has_position(loader) and loader_state_item(loader, "loader") is None
    with caplog.at_level(logging.WARNING, logger="ckptd.loaders"):
        with CheckpointManager(tmp_path / "ckpt", policy=Policy(every_steps=1)) as manager:
            manager.save(1, {"loader": loader, "weights": torch.ones(2)})
    assert [record.name for record in caplog.records].count("ckptd.loaders") == 1


def test_dcp_refuses_a_plain_dataloader_as_before(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptd.dcp import CkptdStorageWriter

    with pytest.raises(BaseException) as caught:
        dcp.save({"w": torch.ones(3), "loader": _loader(stateful=False)},
                 storage_writer=CkptdStorageWriter(tmp_path, step=1))
    assert "PickleRefusedError" in str(caught.value) and "loader" in str(caught.value)


if __name__ == "__main__":
    _resume(sys.argv[1])
