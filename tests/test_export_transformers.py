"""The safetensors export of a 2-rank FSDP2 checkpoint of a tiny ``transformers`` model (built from a
config, no download) loads with ``AutoModelForCausalLM.from_pretrained`` and equals the trained weights
bit for bit, whole and split into indexed shards, and the loaded model gives the logits of a model built from the
config with the trained weights, in the same process (logits from another process can differ in their last
bits: the matmul kernels split work by the thread count)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.testing import run_multirank

pytestmark = [pytest.mark.integrations, pytest.mark.multirank]

STEP = 3
PROMPT = [[1, 5, 9, 2, 7, 3]]


def _config() -> Any:
    import transformers  # imported by the tests only: collecting this file in the core install needs none

    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train the model sharded with FSDP2 for STEP steps and save model and optimizer through a
    CheckpointManager; returns the full trained weights."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEP):
        ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    assert isinstance(model_state["model.embed_tokens.weight"], DTensor)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(STEP, {"model": model_state, "optim": optim_state, "step": STEP}, force=True)
    full = {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for key, value in model_state.items()}
    return {"weights": {key: value.numpy().copy() for key, value in full.items()}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    base = tmp_path_factory.mktemp("hf-export")
    root, config_dir = base / "ckpt", base / "config"
    results = run_multirank(_train_and_save, 2, str(root), timeout_s=240)
    _config().save_pretrained(config_dir)
    weights = {key: torch.from_numpy(value) for key, value in results[0]["weights"].items()}
    return root, config_dir / "config.json", weights


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT)).logits


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("max_shard_size", ["5GB", "20KB"])
def test_from_pretrained_loads_the_export_with_the_trained_weights(trained, tmp_path: Path,
                                                                   max_shard_size: str) -> None:
    root, config_file, weights = trained
    out = tmp_path / "model"
    result = CliRunner().invoke(cli, ["export", str(root), "--step", str(STEP), "--consolidate", "--key-prefix",
                                      "model.", "--config", str(config_file), "--max-shard-size", max_shard_size,
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    sharded = max_shard_size != "5GB"
    assert (out / "model.safetensors.index.json").exists() == sharded
    assert (out / "model.safetensors").exists() != sharded
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    for key, tensor in weights.items():
        assert loaded[key].dtype == tensor.dtype and _bytes(loaded[key]) == _bytes(tensor), key
    reference = LlamaForCausalLM(_config())
    reference.load_state_dict(weights)
    assert torch.equal(_logits(model.eval()), _logits(reference.eval()))


def test_a_bf16_export_loads_as_bf16(trained, tmp_path: Path) -> None:
    root, config_file, weights = trained
    out = tmp_path / "model"
    result = CliRunner().invoke(cli, ["export", str(root), "--step", str(STEP), "--consolidate", "--key-prefix",
                                      "model", "--config", str(config_file), "--dtype", "bf16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    loaded = model.state_dict()
    for key, tensor in weights.items():
        assert _bytes(loaded[key]) == _bytes(tensor.to(torch.bfloat16)), key
