"""transformers.Trainer saving through CkptdCallback: SIGKILL after a committed save, resume in a new process.

Each run is a fresh interpreter running ``hf_trainer_run.py``: a tiny GPT-2 built from a config (no
download), 12 optimizer steps over 32 samples (8 steps an epoch, so the runs cross
an epoch boundary), dropout on (so the RNG states matter), AdamW with a linear schedule, a save every 4
steps. A killed run sends itself SIGKILL in the middle of a step, after the save before it committed (and,
with S3, was promoted). The resumed run is a new process that calls ``ckptd_resume``.

Compared with an uninterrupted run, bit for bit: the final weights (CPU arithmetic is deterministic and
every run uses one intra-op thread), the sample ids of every batch trained on (the resumed run trains on
exactly the batches after the restored step, nothing skipped or repeated) and the logged losses (log
history restored).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hf_trainer_run import batches, result, run

pytestmark = pytest.mark.integrations

STEPS, SAVE_EVERY = 12, 4


def _run(tmp_path: Path, name: str, **config: Any) -> subprocess.CompletedProcess[str]:
    return run(tmp_path, name, steps=STEPS, save_every=SAVE_EVERY, **config)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run that never fails (and saves nothing): the reference."""
    tmp_path = tmp_path_factory.mktemp("reference")
    done = _run(tmp_path, "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    directory = tmp_path / "reference"
    return {"weights": torch.load(directory / "weights-0.pt"), "batches": batches(directory),
            "result": result(directory)}


def _assert_same_as(reference: dict[str, Any], run: Path, restored_step: int) -> None:
    import torch

    resumed = result(run)
    assert resumed["resumed_from"] == f"checkpoint-{restored_step}"
    assert resumed["global_step"] == STEPS
    assert resumed["losses"] == reference["result"]["losses"], "the log history differs from the uninterrupted run"
    trained = batches(run)
    assert len(reference["batches"]) == STEPS
    # the resumed run trained on every batch after the restored step, as the uninterrupted run did
    assert trained[-(STEPS - restored_step):] == reference["batches"][restored_step:]
    weights = torch.load(run / "weights-0.pt")
    assert weights.keys() == reference["weights"].keys()
    different = [name for name, tensor in weights.items() if not torch.equal(tensor, reference["weights"][name])]
    assert not different, f"weights differ from the uninterrupted run: {different}"


def test_sigkill_after_a_committed_save_resumes_bit_for_bit(tmp_path, uninterrupted):
    local = str(tmp_path / "ckpt")
    killed = _run(tmp_path, "run", local=local, kill_at=6)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert len(batches(tmp_path / "run")) == 5, "the killed run trained on steps 1 to 5"
    directories = sorted(path.name for path in (tmp_path / "run" / "out").glob("checkpoint-*"))
    assert directories == ["checkpoint-4"], directories  # ckptd's, for the committed step: no weights in it
    assert not list((tmp_path / "run" / "out").glob("checkpoint-*/*.pt")), "the Trainer wrote a checkpoint of its own"
    resumed = _run(tmp_path, "run", local=local)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_as(uninterrupted, tmp_path / "run", restored_step=4)
    from ckptd.tiers.local import LocalTier

    assert LocalTier(local).committed_steps()[-1] == STEPS


@pytest.mark.s3
def test_resume_from_s3_after_the_local_tier_is_lost(tmp_path, uninterrupted, s3_bucket, s3_options):
    """Killed after step 8 was promoted (an epoch boundary); the node's disk is gone; resume reads S3."""
    local, remote = str(tmp_path / "ckpt"), f"s3://{s3_bucket}/run"
    killed = _run(tmp_path, "run", local=local, remote=remote, storage_options=s3_options, kill_at=10)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shutil.rmtree(local)
    shutil.rmtree(tmp_path / "run" / "out")
    resumed = _run(tmp_path, "run", local=local, remote=remote, storage_options=s3_options)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_as(uninterrupted, tmp_path / "run", restored_step=8)
    tiers = result(tmp_path / "run")["tiers"]
    assert tiers == [f"object {remote}"], tiers
