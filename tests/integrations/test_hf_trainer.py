"""transformers.Trainer saving through CkptdCallback: SIGKILL after a committed save, resume in a new process.

Each run is a fresh interpreter running this file (``python test_hf_trainer.py RUN.json``): a tiny GPT-2
built from a config (no download), 12 optimizer steps over 32 samples (8 steps an epoch, so the runs cross
an epoch boundary), dropout on (so the RNG states matter), AdamW with a linear schedule, a save every 4
steps. A killed run sends itself SIGKILL in the middle of a step, after the save before it committed (and,
with S3, was promoted). The resumed run is a new process that calls ``ckptd_resume``.

Compared with an uninterrupted run, bit for bit: the final weights (CPU arithmetic is deterministic and
every run uses one intra-op thread), the sample ids of every batch trained on (the resumed run trains on
exactly the batches after the restored step, nothing skipped or repeated) and the logged losses (log
history restored).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integrations

STEPS, SAVE_EVERY, SAMPLES, BATCH = 12, 4, 32, 4


# --- the child: one training run ------------------------------------------------------------------

def _child(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ckptd.plugins.huggingface import CkptdCallback, ckptd_resume

    samples_log = Path(config["samples_log"])

    class Samples(torch.utils.data.Dataset):
        """Sample ``index`` is the token sequence that starts with ``index``."""

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, index: int) -> dict[str, Any]:
            ids = torch.arange(16, dtype=torch.long).add_(index).remainder_(64)
            return {"input_ids": ids, "labels": ids.clone()}

    def record_samples(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """The samples of every batch the model trains on (a forward pass), one line per batch."""
        with samples_log.open("a", encoding="utf-8") as out:
            out.write(json.dumps(kwargs["input_ids"][:, 0].tolist()) + "\n")

    class KillAt(TrainerCallback):
        """SIGKILL in the middle of step ``at`` (after its forward pass began), once earlier saves committed."""

        def __init__(self, ckptd_callback: Any, at: int, uploads: bool) -> None:
            self.ckptd_callback, self.at, self.uploads = ckptd_callback, at, uploads

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step + 1 == self.at:
                manager = self.ckptd_callback.manager
                manager.wait_uploads() if self.uploads else manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    model.register_forward_pre_hook(record_samples, with_kwargs=True)
    ckptd_callback = None
    callbacks: list[Any] = []
    if config.get("local"):
        ckptd_callback = CkptdCallback(config["local"], remote=config.get("remote"),
                                       storage_options=config.get("storage_options"))
        callbacks.append(ckptd_callback)
        if config.get("kill_at"):
            callbacks.append(KillAt(ckptd_callback, config["kill_at"], bool(config.get("remote"))))
    args = TrainingArguments(
        output_dir=config["output_dir"], max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=2,
        save_strategy="steps" if ckptd_callback else "no", save_steps=SAVE_EVERY, seed=7, report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=callbacks)
    resume = ckptd_resume(trainer) if ckptd_callback else None
    trainer.train(resume_from_checkpoint=resume)
    tiers: list[str] = []
    if ckptd_callback is not None:
        last = ckptd_callback.manager.last_restore
        tiers = [str(tier) for tier in (last.tiers if last is not None else ())]
        ckptd_callback.close()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    torch.save(weights, config["weights"])
    losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    Path(config["result"]).write_text(json.dumps({"resumed_from": resume and Path(resume).name,
                                                  "global_step": trainer.state.global_step, "losses": losses,
                                                  "tiers": tiers}))


# --- the parent: the tests ------------------------------------------------------------------------

def _run(tmp_path: Path, name: str, **config: Any) -> subprocess.CompletedProcess[str]:
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    config.setdefault("output_dir", str(run / "out"))
    config.update(samples_log=str(run / "samples.jsonl"), weights=str(run / "weights.pt"),
                  result=str(run / "result.json"))
    config_file = run / f"config-{len(list(run.glob('config-*')))}.json"
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_DAEMON="off", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, __file__, str(config_file)], capture_output=True, text=True,
                          timeout=240, env=env)


def _batches(run: Path) -> list[list[int]]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run that never fails (and saves nothing): the reference."""
    tmp_path = tmp_path_factory.mktemp("reference")
    done = _run(tmp_path, "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    run = tmp_path / "reference"
    return {"weights": torch.load(run / "weights.pt"), "batches": _batches(run),
            "result": json.loads((run / "result.json").read_text())}


def _assert_same_as(reference: dict[str, Any], run: Path, restored_step: int) -> None:
    import torch

    result = json.loads((run / "result.json").read_text())
    assert result["resumed_from"] == f"checkpoint-{restored_step}"
    assert result["global_step"] == STEPS
    assert result["losses"] == reference["result"]["losses"], "the log history differs from the uninterrupted run"
    batches = _batches(run)
    assert len(reference["batches"]) == STEPS
    # the resumed run trained on every batch after the restored step, as the uninterrupted run did
    assert batches[-(STEPS - restored_step):] == reference["batches"][restored_step:]
    weights = torch.load(run / "weights.pt")
    assert weights.keys() == reference["weights"].keys()
    different = [name for name, tensor in weights.items() if not torch.equal(tensor, reference["weights"][name])]
    assert not different, f"weights differ from the uninterrupted run: {different}"


def test_sigkill_after_a_committed_save_resumes_bit_for_bit(tmp_path, uninterrupted):
    local = str(tmp_path / "ckpt")
    killed = _run(tmp_path, "run", local=local, kill_at=6)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert len(_batches(tmp_path / "run")) == 5, "the killed run trained on steps 1 to 5"
    assert not list((tmp_path / "run" / "out").glob("checkpoint-*")), "the Trainer wrote a checkpoint of its own"
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
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["tiers"] == [f"object {remote}"], result["tiers"]


if __name__ == "__main__":
    _child(json.loads(Path(sys.argv[1]).read_text()))
