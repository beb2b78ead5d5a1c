"""CkptdCallback in a distributed Trainer job: two gloo ranks on CPU, as ``torchrun --nproc-per-node 2`` starts.

The job trains with DDP and ``gradient_accumulation_steps=2`` (each optimizer step is two forward passes per
rank; each rank's generator draws its own dropout masks), saves through ckptd every 4 steps, and is killed
whole (SIGKILL on every rank) in the middle of step 6, once step 4 committed. A new job resumes with
``trainer.train(resume_from_checkpoint=True)`` on every rank (no ckptd call: the Trainer finds ckptd's
``checkpoint-4``, the callback loads the step). Compared with an uninterrupted 2-rank job, bit for bit: each
rank's final weights, the sample ids of every batch each rank trained on after the restored step (nothing
skipped or repeated, accumulation included) and the logged losses. Each rank wrote its RNG file into the
step's ``checkpoint-N``, and the step holds the replicated model and optimizer once (the layout marks them
replicated), not once per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hf_trainer_run import batches, result, run

pytestmark = pytest.mark.integrations

STEPS, SAVE_EVERY, ACCUMULATE, WORLD = 8, 4, 2, 2


def _job(tmp_path: Path, name: str, **config: Any) -> list[Any]:
    return run(tmp_path, name, world_size=WORLD, steps=STEPS, save_every=SAVE_EVERY, accumulate=ACCUMULATE,
               rank_streams=True, **config)


def test_a_two_rank_job_killed_after_a_save_resumes_bit_for_bit(tmp_path):
    import torch

    from ckptd.tiers.local import LocalTier

    reference = _job(tmp_path, "reference")
    assert [done.returncode for done in reference] == [0, 0], reference[0].stderr[-3000:]
    local = str(tmp_path / "ckpt")
    killed = _job(tmp_path, "run", local=local, kill_at=6)
    assert [done.returncode for done in killed] == [-9, -9], [done.stderr[-2000:] for done in killed]
    resumed = _job(tmp_path, "run", local=local, resume="true")
    assert [done.returncode for done in resumed] == [0, 0], [done.stderr[-3000:] for done in resumed]

    restored, passes = 4, ACCUMULATE
    for rank in range(WORLD):
        theirs, ours = result(tmp_path / "reference", rank), result(tmp_path / "run", rank)
        assert ours["resumed_from"] == f"checkpoint-{restored}" and ours["global_step"] == STEPS
        assert ours["losses"] == theirs["losses"], f"rank {rank}: the log history differs"
        reference_batches = batches(tmp_path / "reference", rank)
        assert len(reference_batches) == STEPS * passes
        assert batches(tmp_path / "run", rank)[-(STEPS - restored) * passes:] == \
            reference_batches[restored * passes:], f"rank {rank} trained on other batches after the restore"
        expected = torch.load(tmp_path / "reference" / f"weights-{rank}.pt")
        weights = torch.load(tmp_path / "run" / f"weights-{rank}.pt")
        different = [name for name, tensor in weights.items() if not torch.equal(tensor, expected[name])]
        assert weights.keys() == expected.keys() and not different, f"rank {rank}: weights differ: {different}"
        assert (tmp_path / "run" / "out" / "checkpoint-8" / f"rng_state_{rank}.pth").is_file()
    tier = LocalTier(local)
    assert tier.committed_steps()[-1] == STEPS
    step = tier.root / "step-000000000004"
    data = sum(path.stat().st_size for path in step.glob("rank-*.data"))
    parameters = sum(tensor.numel() * tensor.element_size() for name, tensor in expected.items()
                     if name != "lm_head.weight")  # tied to transformer.wte.weight
    # model + AdamW's two moments once (not once per rank), and each rank's small states
    assert 3 * parameters <= data < 4 * parameters, (data, parameters)


def test_fsdp_and_deepspeed_trainer_runs_are_refused(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptd.errors import ConfigError
    from ckptd.plugins.huggingface import CkptdCallback

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    args.fsdp = "full_shard"
    with pytest.raises(ConfigError, match="does not cover Trainer runs with fsdp"):
        CkptdCallback(tmp_path / "ckpt").on_init_end(args, TrainerState(), TrainerControl())
