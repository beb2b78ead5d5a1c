"""accelerate's save_state/load_state through CkptdAccelerate: SIGKILL after a committed save, resume in a new
process, compare with an uninterrupted run bit for bit.

Each run is a fresh interpreter running this file: a small MLP with dropout (the RNG states matter), AdamW, a
linear schedule, 48 samples in batches of 4 (12 steps an epoch), 18 steps, ``accelerator.save_state`` every 4
steps; a step counter registered with ``register_for_checkpointing`` gives the ckptd step and the batches to
skip with ``accelerator.skip_first_batches``. The sampler is accelerate's seedable one, drawing from its own
generator (the DataLoader is given one), so the data order is a function of seed and epoch and the global RNG
feeds only dropout. CPU arithmetic on one intra-op thread is deterministic: weights compare bit for bit.
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

STEPS, SAVE_EVERY, SAMPLES, BATCH = 18, 4, 48, 4


def _child(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from accelerate import Accelerator, DataLoaderConfiguration

    from ckptd.plugins.huggingface import CkptdAccelerate

    class Progress:
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.step = int(state["step"])

    torch.manual_seed(0)
    features = torch.randn(SAMPLES, 8)
    targets = features @ torch.randn(8, 1) + 0.1 * torch.randn(SAMPLES, 1)
    dataset = torch.utils.data.TensorDataset(features, targets, torch.arange(SAMPLES))
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    hooks = CkptdAccelerate(accelerator, config["local"], remote=config.get("remote"),
                            storage_options=config.get("storage_options"), step=lambda: progress.step,
                            allow_pickle=config.get("resume") == "load_state") \
        if config.get("local") else None
    out = Path(config["output_dir"])
    if config.get("resume") == "load_state":
        newest = max(out.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
        accelerator.load_state(str(newest))
    elif config.get("resume") == "restore":
        assert hooks is not None and hooks.restore() is not None
    resumed_from = progress.step
    seen = Path(config["samples_log"])
    steps_per_epoch = len(loader)
    while progress.step < STEPS:
        epoch, done_in_epoch = divmod(progress.step, steps_per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for inputs, wanted, samples in batches:
            if config.get("kill_at") == progress.step + 1:
                hooks.manager.wait_uploads() if config.get("remote") else hooks.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            with seen.open("a", encoding="utf-8") as log:
                log.write(json.dumps(samples.tolist()) + "\n")
            loss = torch.nn.functional.mse_loss(model(inputs), wanted)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if hooks is not None and progress.step % SAVE_EVERY == 0:
                accelerator.save_state(str(out / f"step-{progress.step}"))
            if progress.step == STEPS:
                break
    if hooks is not None:
        hooks.close()
    torch.save({name: tensor.detach().clone() for name, tensor in accelerator.unwrap_model(model).state_dict().items()},
               config["weights"])
    Path(config["result"]).write_text(json.dumps({"resumed_from": resumed_from,
                                                  "lr": scheduler.get_last_lr(), "tiers": [] if hooks is None else
                                                  list(getattr(hooks.manager.last_restore, "tiers", []) or [])}))


def _run(tmp_path: Path, name: str, **config: Any) -> subprocess.CompletedProcess[str]:
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    config.setdefault("output_dir", str(run / "out"))
    config.update(samples_log=str(run / "samples.jsonl"), weights=str(run / "weights.pt"),
                  result=str(run / "result.json"))
    config_file = run / f"config-{len(list(run.glob('config-*')))}.json"
    config_file.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_DAEMON="off")
    return subprocess.run([sys.executable, __file__, str(config_file)], capture_output=True, text=True,
                          timeout=240, env=env)


def _batches(run: Path) -> list[list[int]]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("reference")
    done = _run(tmp_path, "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    run = tmp_path / "reference"
    return {"weights": torch.load(run / "weights.pt"), "batches": _batches(run),
            "result": json.loads((run / "result.json").read_text())}


def _assert_same_as(reference: dict[str, Any], run: Path, restored_step: int) -> dict[str, Any]:
    import torch

    result = json.loads((run / "result.json").read_text())
    assert result["resumed_from"] == restored_step
    assert result["lr"] == reference["result"]["lr"], "the scheduler did not continue where it stopped"
    assert len(reference["batches"]) == STEPS
    assert _batches(run)[-(STEPS - restored_step):] == reference["batches"][restored_step:]
    weights = torch.load(run / "weights.pt")
    different = [name for name, tensor in weights.items() if not torch.equal(tensor, reference["weights"][name])]
    assert weights.keys() == reference["weights"].keys() and not different, different
    return result


def test_load_state_after_sigkill_resumes_bit_for_bit(tmp_path, uninterrupted):
    """load_state with allow_pickle=True (accelerate unpickles its own files after ckptd's restore)."""
    local = str(tmp_path / "ckpt")
    killed = _run(tmp_path, "run", local=local, kill_at=10)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert len(_batches(tmp_path / "run")) == 9
    saved = tmp_path / "run" / "out" / "step-8"
    assert json.loads((saved / "ckptd-step.json").read_text()) == {"step": 8}
    assert not list(saved.glob("model*")), "accelerate wrote the weights itself"
    resumed = _run(tmp_path, "run", local=local, resume="load_state")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_as(uninterrupted, tmp_path / "run", restored_step=8)


@pytest.mark.s3
def test_restore_from_s3_without_the_local_tier_or_accelerate_files(tmp_path, uninterrupted, s3_bucket, s3_options):
    """Killed after step 12 (an epoch boundary) was promoted; the node's disk is gone; restore reads S3."""
    local, remote = str(tmp_path / "ckpt"), f"s3://{s3_bucket}/run"
    killed = _run(tmp_path, "run", local=local, remote=remote, storage_options=s3_options, kill_at=14)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shutil.rmtree(local)
    shutil.rmtree(tmp_path / "run" / "out")
    resumed = _run(tmp_path, "run", local=local, remote=remote, storage_options=s3_options, resume="restore")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = _assert_same_as(uninterrupted, tmp_path / "run", restored_step=12)
    assert result["tiers"] == [f"object {remote}"]


if __name__ == "__main__":
    _child(json.loads(Path(sys.argv[1]).read_text()))
