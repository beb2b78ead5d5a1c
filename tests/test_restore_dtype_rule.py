"""One dtype rule for every restore: a live tensor of another dtype than the saved one is refused naming it,
whether the step is read from the memory tier, from disk, or resharded into another layout (which refused
it already); a restore never casts the saved values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import ResumeMismatchError


def _state(dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": (torch.arange(12, dtype=torch.float32) / 7).reshape(3, 4).to(dtype),
                      "b": torch.ones(4)}}


def test_a_live_tensor_of_another_dtype_is_refused_from_disk(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        assert manager.save(1, _state(torch.float32), force=True)
    live = _state(torch.float16)
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager, \
            pytest.raises(ResumeMismatchError, match=r"'model/w' was saved as float32 but the live state holds "
                                                     r"float16 \[3, 4\]") as caught:
        manager.restore(live)
    assert caught.value.step == 1
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:  # the saved dtype restores bit for bit
        same = _state(torch.float32)
        same["model"]["w"].zero_()
        assert manager.restore(same) == 1
    assert torch.equal(same["model"]["w"], _state(torch.float32)["model"]["w"])


def test_a_live_tensor_of_another_dtype_is_refused_from_memory(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        assert manager.save(1, _state(torch.float32), force=True)
        manager.wait()
        with pytest.raises(ResumeMismatchError, match=r"'model/w' was saved as float32 .*float64") as caught:
            manager.restore(_state(torch.float64))
        assert caught.value.tier == "memory"
