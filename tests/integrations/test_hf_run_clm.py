"""A ``run_clm.py``-shaped script with CkptdCallback, SIGKILLed in the middle of an epoch and resumed the
Trainer's own ways: ``trainer.train(resume_from_checkpoint=True)`` and ``run_clm.py``'s
``get_last_checkpoint(output_dir)`` flow, with no ckptd call but the callback (``hf_run_clm.py``).

The script keeps the Trainer's defaults (AdamW, linear schedule, dropout, ``default_data_collator``) with
``dataloader_num_workers=2``: 39 blocks of 16 tokens, 4 a batch, 10 steps an epoch, 2 epochs, a save every 3
steps. Compared with one uninterrupted run, bit for bit: the final weights, optimizer and scheduler states,
the SHA-256 of every batch trained on (the resumed run trains on exactly the batches after the restored
step) and the logged losses. After the resume ``output_dir`` holds nothing large of ckptd's: its
``checkpoint-N`` directories hold the Trainer's state and RNG files, not the weights.

What holds with the data: the Trainer's data order is a function of its seed and the epoch, and its own
skip of the batches already trained on puts the loader back in the middle of the epoch; the collator here
draws no random numbers. A collator that draws from the global generators in the main process
(``dataloader_num_workers=0``) resumes bit for bit only at an epoch boundary: the Trainer's limit, with its
own checkpoints too (it sets the RNG after drawing the first resumed batches).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from hf_run_clm import run

pytestmark = pytest.mark.integrations

STEPS = 20  # 10 steps an epoch, 2 epochs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    directory = tmp_path_factory.mktemp("reference")
    done = run(directory)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"final": torch.load(directory / "final.pt", weights_only=True),
            "batches": (directory / "batches.txt").read_text().splitlines(),
            "result": json.loads((directory / "result.json").read_text())}


def _same_tree(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Paths where two state trees differ (tensors compared exactly)."""
    import torch

    if isinstance(theirs, torch.Tensor):
        return [] if isinstance(ours, torch.Tensor) and torch.equal(ours, theirs) else [where]
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or ours.keys() != theirs.keys():
            return [where]
        return [path for key in theirs for path in _same_tree(ours[key], theirs[key], f"{where}/{key}")]
    if isinstance(theirs, (list, tuple)):
        if not isinstance(ours, (list, tuple)) or len(ours) != len(theirs):
            return [where]
        return [path for index, (a, b) in enumerate(zip(ours, theirs)) for path in _same_tree(a, b, f"{where}/{index}")]
    return [] if ours == theirs else [where]


def _kill_and_resume(tmp_path: Path, reference: dict[str, Any], *, kill_at: int, restored: int,
                     resume: str) -> None:
    import torch

    killed = run(tmp_path, kill_at=kill_at, resume="last" if resume == "last" else "none")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert len((tmp_path / "batches.txt").read_text().splitlines()) == kill_at - 1, "it died in step kill_at"
    assert restored % 10 != 0, "the kill is in the middle of an epoch"

    resumed = run(tmp_path, resume=resume)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    if resume == "last":
        assert result["last_checkpoint"] == f"checkpoint-{restored}"
    assert result["global_step"] == STEPS
    assert result["losses"] == reference["result"]["losses"], "the log history differs from the uninterrupted run"
    trained = (tmp_path / "batches.txt").read_text().splitlines()[kill_at - 1:]
    assert len(reference["batches"]) == STEPS
    assert trained == reference["batches"][restored:], "the resumed run trained on other batches"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for part in ("weights", "optimizer", "scheduler"):
        different = _same_tree(final[part], reference["final"][part])
        assert not different, f"the {part} differs from the uninterrupted run: {different[:10]}"

    out = tmp_path / "out"
    assert not (out / "ckptd-resume").exists()
    for directory in out.glob("checkpoint-*"):  # ckptd's, small: the weights stay in ckptd
        sizes = {path.name: path.stat().st_size for path in directory.iterdir()}
        assert "ckptd.json" in sizes and max(sizes.values()) < 20_000, (directory.name, sizes)
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-18", "checkpoint-20"]


def test_resume_from_checkpoint_true_after_sigkill_mid_epoch(tmp_path, uninterrupted):
    _kill_and_resume(tmp_path, uninterrupted, kill_at=8, restored=6, resume="true")


def test_run_clm_get_last_checkpoint_flow_after_sigkill_mid_epoch(tmp_path, uninterrupted):
    _kill_and_resume(tmp_path, uninterrupted, kill_at=14, restored=12, resume="last")
