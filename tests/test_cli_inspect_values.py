"""``ckptd inspect`` shows the plain values a step saved (the step counter, the data loader's position,
the run's config, the optimizer's learning rate) next to its tensors, defaults to the newest step, and
reads no tensor bytes to do so. Real checkpoints of a short training loop with ckptd's ShardLoader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.data import ShardDataset, ShardLoader, index_dataset
from ckptd.data.testing import write_jsonl_shards
from ckptd.testing.tamper import chunk_records, flip_bit, index_path, read_json, step_path

GLOBAL_BATCH = 4
CONFIG = {"name": "tiny-gpt", "block_size": 16, "dims": [8, 8], "dropout": 0.0}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three training steps, each saved: step counter, loader, config, model and optimizer."""
    root = tmp_path_factory.mktemp("inspect")
    write_jsonl_shards(root / "data", [10, 10])
    dataset = ShardDataset(index_dataset(str(root / "data"), "jsonl").manifest, global_batch_size=GLOBAL_BATCH,
                           seed=7, cache_dir=root / "cache")
    loader = ShardLoader(dataset)
    model = torch.nn.Linear(8, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state: dict[str, Any] = {"iter_num": 0, "config": CONFIG, "data": loader, "model": model, "optim": optim}
    with ckptd.CheckpointManager(root / "ckpt", policy=ckptd.Policy(keep_local=None)) as manager:
        for step, _batch in zip(range(1, 4), loader):
            state["iter_num"] = step
            manager.save(step, state, force=True)
    return root / "ckpt"


def _inspect(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["inspect", *args])
    return result.exit_code, result.output


def _values(output: str) -> dict[str, Any]:
    return {row["path"]: row["value"] for row in json.loads(output)["values"]}


def test_inspect_shows_counters_loader_position_and_config_of_the_newest_step(run: Path) -> None:
    code, output = _inspect(str(run), "--json")
    assert code == 0, output
    assert json.loads(output)["step"] == 3
    values = _values(output)
    assert values["iter_num"] == 3
    assert {key: values[f"config/{key}"] for key in CONFIG} == CONFIG
    assert values["data/epoch"] == 0
    assert values["data/samples_consumed"] == 3 * GLOBAL_BATCH
    assert values["optim/param_groups/0/lr"] == pytest.approx(3e-4)
    assert all(row["rank"] == 0 for row in json.loads(output)["values"])
    tensors = {row["name"] for row in json.loads(output)["tensors"]}
    assert {"model/weight", "model/bias"} <= tensors
    assert not any(path.startswith("model/") for path in values), "tensors are listed as tensors, not values"


def test_inspect_of_an_older_step_shows_its_values(run: Path) -> None:
    code, output = _inspect(str(run), "--step", "1", "--json")
    assert code == 0, output
    values = _values(output)
    assert values["iter_num"] == 1 and values["data/samples_consumed"] == GLOBAL_BATCH


def test_inspect_text_lists_values_then_tensors(run: Path) -> None:
    code, output = _inspect(str(run))
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0].startswith("step 3:")
    value_header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["RANK", "PATH", "VALUE"])
    tensor_header = next(i for i, line in enumerate(lines) if "DTYPE" in line)
    assert value_header < tensor_header
    shown = {line.split()[1]: line.split(None, 2)[2] for line in lines[value_header + 1:tensor_header]}
    assert shown["iter_num"] == "3" and shown["config/name"] == "tiny-gpt" and shown["config/dims"] == "[8, 8]"
    assert any(line.endswith("model/weight") for line in lines[tensor_header:])


def test_inspect_reads_no_tensor_bytes(run: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(run, copy)
    files = read_json(index_path(copy, 3))["data_files"]
    for _, (offset, *_, part) in chunk_records(copy, 3):
        flip_bit(step_path(copy, 3) / files[part][0], offset)  # every chunk of step 3 is now bad
    code, output = _inspect(str(copy), "--json")
    assert code == 0, output
    assert _values(output)["iter_num"] == 3


def test_inspect_shows_the_values_of_a_step_written_with_dcp_save(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckptd.dcp import CkptdStorageWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "saving in a single process"
        dcp.save({"w": torch.ones(3), "meta": {"step": 5, "name": "x"}, "lr": 0.1},
                 storage_writer=CkptdStorageWriter(tmp_path, step=3))
    code, output = _inspect(str(tmp_path), "--json")
    assert code == 0, output
    assert _values(output) == {"lr": 0.1, "meta.name": "x", "meta.step": 5}
