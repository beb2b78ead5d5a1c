"""One ``transformers.Trainer`` run for the CkptdCallback tests, in a fresh interpreter per rank.

``python hf_trainer_run.py CONFIG_JSON``: a tiny GPT-2 built from a config (no download), ``steps`` optimizer
steps over 32 samples, dropout on (so the RNG states matter), AdamW with a linear schedule, a save every
``save_every`` steps through :class:`CkptdCallback` when ``local`` is given (no saving otherwise). A run with
``kill_at`` sends itself SIGKILL in the middle of that step, once the save before it committed (and, with
``remote``, was promoted); with several ranks every rank waits for the others first (the whole job dies).
Every run calls ``ckptd_resume`` first, unless ``resume`` is ``"true"``: then
``trainer.train(resume_from_checkpoint=True)`` and no ckptd call. The run records the sample ids of every
batch it trains on (one line per batch), its final weights and a result (resumed step, global step, losses,
tiers).

:func:`run` starts ``world_size`` ranks (``torchrun``'s environment variables, gloo on CPU) and waits for
them; one intra-op thread, so CPU arithmetic is deterministic and runs compare bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rank_runs import run_ranks  # this folder

SAMPLES, BATCH = 32, 4


def _child(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from ckptd.plugins.huggingface import CkptdCallback, ckptd_resume

    rank = int(os.environ.get("RANK", "0"))
    samples_log = Path(config["samples_log"].format(rank=rank))

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
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()  # every rank saw the commit: the whole job dies now
                os.kill(os.getpid(), signal.SIGKILL)

    class RankStreams(TrainerCallback):
        """Moves each rank's torch generator by a different amount when training begins, so the ranks draw
        different dropout masks: a resumed rank must get its own RNG states back, not another rank's (a
        resumed run sets the restored states after this)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.rand(rank + 1)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    model.register_forward_pre_hook(record_samples, with_kwargs=True)
    ckptd_callback = None
    callbacks: list[Any] = [RankStreams()] if config.get("rank_streams") else []
    if config.get("local"):
        ckptd_callback = CkptdCallback(config["local"], remote=config.get("remote"),
                                       storage_options=config.get("storage_options"))
        callbacks.append(ckptd_callback)
        if config.get("kill_at"):
            callbacks.append(KillAt(ckptd_callback, config["kill_at"], bool(config.get("remote"))))
    distributed = {"ddp_backend": "gloo"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
    args = TrainingArguments(
        output_dir=config["output_dir"], max_steps=config["steps"], per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=config.get("accumulate", 1),
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=2,
        save_strategy="steps" if ckptd_callback else "no", save_steps=config["save_every"], seed=7, report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **distributed)
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=callbacks)
    if config.get("resume") == "true":  # the Trainer finds ckptd's checkpoint-N itself
        last = get_last_checkpoint(config["output_dir"]) if os.path.isdir(config["output_dir"]) else None
        resume = last
        trainer.train(resume_from_checkpoint=True)
    else:
        resume = ckptd_resume(trainer) if ckptd_callback else None
        trainer.train(resume_from_checkpoint=resume)
    tiers: list[str] = []
    if ckptd_callback is not None:
        last = ckptd_callback.manager.last_restore
        tiers = [str(tier) for tier in (last.tiers if last is not None else ())]
        ckptd_callback.close()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    torch.save(weights, config["weights"].format(rank=rank))
    losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    Path(config["result"].format(rank=rank)).write_text(json.dumps({
        "resumed_from": resume and Path(resume).name, "global_step": trainer.state.global_step,
        "losses": losses, "tiers": tiers}))


def run(tmp_path: Path, name: str, *, world_size: int = 1, timeout_s: float = 240,
        **config: Any) -> list[subprocess.CompletedProcess[str]]:
    """Start one run of ``world_size`` ranks in ``tmp_path/name``; the finished processes, by rank."""
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    config.setdefault("output_dir", str(directory / "out"))
    config.setdefault("steps", 12)
    config.setdefault("save_every", 4)
    config.update(samples_log=str(directory / "samples-{rank}.jsonl"), weights=str(directory / "weights-{rank}.pt"),
                  result=str(directory / "result-{rank}.json"))
    config_file = directory / f"config-{len(list(directory.glob('config-*')))}.json"
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_DAEMON="off", TOKENIZERS_PARALLELISM="false")
    return run_ranks(Path(__file__), config_file, world_size=world_size, env=env, timeout_s=timeout_s)


def batches(directory: Path, rank: int = 0) -> list[list[int]]:
    """The sample ids of every batch rank ``rank`` trained on, in order, over every run in ``directory``."""
    return [json.loads(line) for line in (directory / f"samples-{rank}.jsonl").read_text().splitlines()]


def result(directory: Path, rank: int = 0) -> dict[str, Any]:
    """What the last run in ``directory`` reported on rank ``rank``."""
    return json.loads((directory / f"result-{rank}.json").read_text())


if __name__ == "__main__":
    _child(json.loads(Path(sys.argv[1]).read_text()))
