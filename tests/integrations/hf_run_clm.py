"""A causal language model fine-tuning run in the shape of transformers' ``run_clm.py``, with ckptd's callback.

``python hf_run_clm.py CONFIG_JSON``, one process. As ``run_clm.py`` does: the last checkpoint of
``output_dir`` is looked up with ``get_last_checkpoint`` before anything else, the seed is set, the texts are
tokenized and grouped into blocks of ``block_size`` tokens (labels = inputs), a GPT-2 is built from a config
(``AutoModelForCausalLM.from_config``, no download), the Trainer runs with its defaults (AdamW, linear
schedule, dropout on) and ``default_data_collator``, ``trainer.train(resume_from_checkpoint=checkpoint)``,
then ``save_model`` and ``save_state``. The one ckptd line is ``callbacks=[CkptdCallback(local)]``.

``resume``: ``"last"`` passes what ``get_last_checkpoint`` found (``run_clm.py``'s flow), ``"true"`` passes
``resume_from_checkpoint=True`` (the Trainer looks it up itself), ``"none"`` passes nothing. ``kill_at``:
SIGKILL in the middle of that optimizer step, once the saves before it committed.

For the tests it records the SHA-256 of every batch the model trains on (one line each), and at the end the
final weights, optimizer and scheduler states (``final.pt``) and the number of steps trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Texts of the toy corpus: "documents" of token ids, as a tokenizer would return them.
DOCUMENTS, BLOCK_SIZE, VOCAB = 40, 16, 96


def tokenized_corpus() -> list[list[int]]:
    """Token ids of every document (a fixed, seedless function of the document number)."""
    return [[(7 * document + 3 * position) % VOCAB for position in range(12 + document % 9)]
            for document in range(DOCUMENTS)]


def group_texts(token_lists: list[list[int]], block_size: int) -> list[dict[str, list[int]]]:
    """``run_clm.py``'s grouping: concatenate every text, drop the remainder, cut blocks; labels = inputs."""
    concatenated = [token for tokens in token_lists for token in tokens]
    total = (len(concatenated) // block_size) * block_size
    blocks = [concatenated[start:start + block_size] for start in range(0, total, block_size)]
    return [{"input_ids": block, "attention_mask": [1] * block_size, "labels": list(block)} for block in blocks]


def main(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import (AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback, TrainingArguments,
                              default_data_collator, set_seed)
    from transformers.trainer_utils import get_last_checkpoint

    from ckptd.plugins.huggingface import CkptdCallback

    training_args = TrainingArguments(
        output_dir=config["output_dir"], do_train=True, per_device_train_batch_size=4, num_train_epochs=2,
        save_strategy="steps", save_steps=config["save_steps"], logging_steps=2, dataloader_num_workers=2,
        report_to=[], use_cpu=True, disable_tqdm=True)

    # Detecting last checkpoint (run_clm.py)
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)

    lm_dataset = group_texts(tokenized_corpus(), BLOCK_SIZE)
    model_config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK_SIZE, n_embd=32, n_layer=2, n_head=2)
    model = AutoModelForCausalLM.from_config(model_config)

    hashes = Path(config["hashes"])

    def record_batch(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        digest = hashlib.sha256()
        for name in ("input_ids", "attention_mask", "labels"):
            digest.update(kwargs[name].numpy().tobytes())
        with hashes.open("a", encoding="utf-8") as out:
            out.write(digest.hexdigest() + "\n")

    model.register_forward_pre_hook(record_batch, with_kwargs=True)
    ckptd_callback = CkptdCallback(config["local"], export_safetensors=bool(config.get("export")))

    class KillAt(TrainerCallback):
        """SIGKILL in the middle of step ``kill_at`` (its batches drawn), once the saves before it committed."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step + 1 == config.get("kill_at"):
                ckptd_callback.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(model=model, args=training_args, train_dataset=lm_dataset,
                      data_collator=default_data_collator, callbacks=[ckptd_callback, KillAt()])
    checkpoint = {"last": last_checkpoint, "true": True, "none": None}[config["resume"]]
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    trainer.save_state()
    ckptd_callback.close()
    torch.save({"weights": {name: value.detach().clone() for name, value in model.state_dict().items()},
                "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.lr_scheduler.state_dict()},
               config["final"])
    Path(config["result"]).write_text(json.dumps({
        "global_step": train_result.global_step, "last_checkpoint": last_checkpoint and Path(last_checkpoint).name,
        "losses": [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]}))


def run(directory: Path, timeout_s: float = 300, **config: Any) -> subprocess.CompletedProcess[str]:
    """One run in a fresh interpreter, its files in ``directory`` (``output_dir`` is ``directory/out``, ckptd's
    local tier ``directory/ckpt`` unless given); ``config`` as the module docstring says."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"output_dir": str(directory / "out"), "local": str(directory / "ckpt"), "save_steps": 3,
              "resume": "none", "hashes": str(directory / "batches.txt"), "final": str(directory / "final.pt"),
              "result": str(directory / "result.json"), **config}
    config_file = directory / "config.json"
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_DAEMON="off", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, __file__, str(config_file)], capture_output=True, text=True, env=env,
                          timeout=timeout_s)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
