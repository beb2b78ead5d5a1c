"""``ckptd export --format safetensors`` of a 2-rank FSDP2 checkpoint (real gloo processes): the
consolidated tensors equal the trained weights bit for bit, from a local directory and from moto's S3
server; shards by size with a Hugging Face index; dtype cast; a corrupt chunk is refused (and read from
the next tier when one has it); clear errors for what cannot be exported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import ckptd
from ckptd.cli.main import cli
from ckptd.errors import ConfigError
from ckptd.export import ExportOptions, export_safetensors, save_tensors
from ckptd.export.hf_layout import parse_shard_size
from ckptd.testing import run_multirank
from ckptd.testing.tamper import chunk_location, flip_bit

pytestmark = pytest.mark.multirank

STEP = 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 33)  # 33 rows over 2 ranks: uneven shards
        self.head = nn.Linear(33, 5)
        self.register_buffer("seen", torch.arange(7))  # an int64 buffer, not sharded by FSDP2

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(inputs)))


def _save(rank: int, world_size: int, root: str, dcp_root: str, replicated_root: str) -> dict[str, Any]:
    """Train an FSDP2 model for STEP steps, save it with a CheckpointManager and with dcp.save and ckptd's
    writer (and :func:`_save_replicated`); returns the full (gathered) weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ckptd.dcp import CkptdStorageWriter

    torch.manual_seed(0)
    model = _Net()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEP):
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    assert all(isinstance(model_state[key], DTensor) for key in ("inner.weight", "head.weight"))
    columns = distribute_tensor(torch.arange(20.0).reshape(4, 5), mesh, [Shard(1)])  # 3 + 2 columns
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(STEP, {"model": model_state, "optim": optim_state, "epoch": 1, "tp": {"columns": columns}},
                     force=True)
    dcp.save({"model": model_state}, storage_writer=CkptdStorageWriter(dcp_root, step=STEP))
    _save_replicated(replicated_root)
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).numpy().copy()  # by value
            for key, value in model_state.items()}


def _save_replicated(root: str) -> None:
    """DTensors replicated over a 2 x 1 mesh (HSDP-like): a replicated piece may be written by one of its
    holders only, the other rank's index then lacks it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    state = {"w": distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Replicate(), Shard(0)]),
             "b": distribute_tensor(torch.arange(4.0), mesh, [Replicate(), Replicate()])}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(1, {"model": state}, force=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(manager root, dcp.save root, full weights) of one 2-rank training run."""
    base = tmp_path_factory.mktemp("export")
    root, dcp_root = base / "ckpt", base / "dcp"
    ranks = run_multirank(_save, 2, str(root), str(dcp_root), str(base / "replicated"), timeout_s=180)
    weights = [{key: torch.from_numpy(value) for key, value in rank.items()} for rank in ranks]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    return root, dcp_root, weights[0]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["export", *args])
    return result.exit_code, result.output


def same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.dtype == second.dtype and first.shape == second.shape and \
        first.reshape(-1).view(torch.uint8).numpy().tobytes() == second.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_consolidated_export_equals_the_trained_weights(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    out = tmp_path / "model"
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", str(out))
    assert code == 0, output
    assert sorted(path.name for path in out.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == weights.keys()
    for key, tensor in weights.items():
        assert same_bytes(loaded[key], tensor), key
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "ckptd_step": str(STEP)}


def test_a_dcp_saved_step_exports_the_same_weights(saved, tmp_path: Path) -> None:
    _, dcp_root, weights = saved
    report = export_safetensors(str(dcp_root), STEP, tmp_path / "model",
                                ExportOptions(consolidate=True, key_prefix="model"))
    loaded = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert report.tensors == len(weights) and loaded.keys() == weights.keys()
    assert all(same_bytes(loaded[key], tensor) for key, tensor in weights.items())


def test_pieces_sharded_along_a_later_dimension_are_assembled(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    report = export_safetensors(str(root), STEP, tmp_path / "tp", ExportOptions(consolidate=True, key_prefix="tp"))
    assert report.tensors == 1
    assert torch.equal(load_file(str(tmp_path / "tp" / "model.safetensors"))["columns"],
                       torch.arange(20.0).reshape(4, 5))


def test_replicated_dtensors_export_once_whichever_rank_wrote_them(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    export_safetensors(str(root.parent / "replicated"), 1, tmp_path / "out", ExportOptions(consolidate=True, key_prefix="model"))
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert loaded.keys() == {"w", "b"}
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(6, 2)) and torch.equal(loaded["b"], torch.arange(4.0))


def test_pieces_that_do_not_tile_their_tensor_are_refused() -> None:
    from ckptd.errors import FormatError
    from ckptd.export.assembly import check_pieces
    from ckptd.export.selection import SavedTensor, TensorPiece

    def tensor(*pieces: tuple[tuple[int, int], tuple[int, int]]) -> SavedTensor:
        return SavedTensor("w", torch.float32, (4, 4), tuple(TensorPiece(rank, f"w{rank}", offsets, shape)
                                                             for rank, (offsets, shape) in enumerate(pieces)))

    check_pieces(tensor(((0, 0), (2, 4)), ((2, 0), (2, 4))), step=1, consolidate=True)
    with pytest.raises(FormatError, match="do not cover"):
        check_pieces(tensor(((0, 0), (2, 4)), ((2, 0), (1, 4))), step=1, consolidate=True)
    with pytest.raises(FormatError, match="overlap"):
        check_pieces(tensor(((0, 0), (3, 4)), ((2, 0), (2, 4))), step=1, consolidate=True)
    with pytest.raises(FormatError, match="outside"):
        check_pieces(tensor(((0, 0), (2, 4)), ((3, 0), (2, 4))), step=1, consolidate=True)
    with pytest.raises(ConfigError, match="--consolidate"):
        check_pieces(tensor(((0, 0), (2, 4)), ((2, 0), (2, 4))), step=1, consolidate=False)


def test_sharded_tensors_are_refused_without_consolidate(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    code, output = invoke(str(root), "--step", str(STEP), "--key-prefix", "model", "--out", str(tmp_path / "m"))
    assert code == 2
    assert "'inner.weight' is stored in 2 pieces" in output and "--consolidate" in output
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_a_small_max_shard_size_writes_indexed_shards(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    out = tmp_path / "model"
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.",
                          "--max-shard-size", "1KB", "--out", str(out), "--json")
    assert code == 0, output
    report = json.loads(output)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == report["total_size"] == sum(t.numel() * t.element_size()
                                                                         for t in weights.values())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    assert sorted(path.name for path in out.iterdir()) == sorted([*shards, "model.safetensors.index.json"])
    assert index["weight_map"].keys() == weights.keys()
    for shard in shards:
        loaded = load_file(str(out / shard))
        assert sorted(loaded) == sorted(key for key, name in index["weight_map"].items() if name == shard)
        assert len(loaded) == 1 or sum(t.numel() * t.element_size() for t in loaded.values()) <= 1000
        assert all(same_bytes(tensor, weights[key]) for key, tensor in loaded.items())


def test_dtype_cast_applies_to_floating_tensors_only(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    out = tmp_path / "model"
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--dtype",
                          "bf16", "--out", str(out))
    assert code == 0, output
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded["seen"].dtype == torch.int64 and torch.equal(loaded["seen"], weights["seen"])
    for key, tensor in weights.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert same_bytes(loaded[key], expected), key


def test_a_corrupt_chunk_is_refused_and_read_from_the_next_tier(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    data_file, offset, length = chunk_location(broken, STEP, "model/inner.weight", rank=1)
    flip_bit(data_file, offset + length // 2)
    out = tmp_path / "model"
    code, output = invoke(str(broken), "--step", str(STEP), "--consolidate", "--key-prefix", "model.",
                          "--out", str(out))
    assert code == 4, output
    assert f"step {STEP}" in output and data_file.name in output and "tier local" in output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["broken"], "no output, no temporary left"
    code, output = invoke(str(broken), str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.",
                          "--out", str(out))
    assert code == 0, output
    loaded = load_file(str(out / "model.safetensors"))
    assert all(same_bytes(loaded[key], tensor) for key, tensor in weights.items())


@pytest.mark.s3
def test_export_from_s3_equals_the_trained_weights(saved, tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.promotion import promote_step
    from ckptd.tiers.local import LocalTier
    from ckptd.tiers.object import ObjectTier

    root, _, weights = saved
    url = f"s3://{s3_bucket}/run"
    promote_step(LocalTier(root), ObjectTier(url, storage_options=s3_options), STEP)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    out = tmp_path / "model"
    code, output = invoke(url, "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", str(out),
                          "--endpoint-url", s3_options["client_kwargs"]["endpoint_url"])
    assert code == 0, output
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == weights.keys()
    assert all(same_bytes(loaded[key], tensor) for key, tensor in weights.items())


def test_what_cannot_be_exported_gets_a_clear_error(saved, tmp_path: Path) -> None:
    root, _, _ = saved
    out = str(tmp_path / "model")
    code, output = invoke(str(root), "--step", "9", "--out", out)
    assert code == 8 and "step 9" in output
    code, output = invoke(str(tmp_path / "missing"), "--step", str(STEP), "--out", out)
    assert code == 8 and "does not exist" in output
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--out", out)
    assert code == 2 and "non-tensor" in output and "'epoch'" in output and "--key-prefix" in output
    code, output = invoke(str(root), "--step", str(STEP), "--key-prefix", "decoder", "--out", out)
    assert code == 8 and "'decoder.'" in output and "'model'" in output
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", out,
                          "--max-shard-size", "5 parsecs")
    assert code == 2 and "is not a size" in output
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", out)
    assert code == 2 and "not empty" in output
    assert [path.name for path in (tmp_path / "model").iterdir()] == ["keep.txt"]


def test_a_dtype_safetensors_cannot_hold_is_refused(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"model": {"w": torch.ones(3), "z": torch.ones(2, dtype=torch.complex128)}}, force=True)
    with pytest.raises(ConfigError, match="'z' has dtype complex128, which safetensors cannot hold"):
        export_safetensors(str(tmp_path / "ckpt"), 1, tmp_path / "out", ExportOptions(key_prefix="model"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_the_writer_round_trips_every_dtype_through_safetensors(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=generator),
        "f32": torch.randn(5, generator=generator), "f16": torch.randn(4, generator=generator).half(),
        "bf16": torch.randn(2, 3, generator=generator).bfloat16(), "i64": torch.arange(6),
        "i32": torch.arange(3, dtype=torch.int32), "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-2, 2, dtype=torch.int8), "u8": torch.arange(9, dtype=torch.uint8),
        "u16": torch.arange(4).to(torch.uint16), "u32": torch.arange(4).to(torch.uint32),
        "u64": torch.arange(4).to(torch.uint64), "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(7, generator=generator).to(torch.float8_e4m3fn),
        "f8b": torch.randn(7, generator=generator).to(torch.float8_e5m2),
        "c64": torch.randn(2, dtype=torch.complex64, generator=generator),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
        "view": torch.arange(12.0).reshape(3, 4)[:, 1],  # not contiguous
    }
    save_tensors(tmp_path / "all.safetensors", tensors, {"format": "pt", "note": "x"})
    raw = (tmp_path / "all.safetensors").read_bytes()
    assert int.from_bytes(raw[:8], "little") % 8 == 0, "the header is padded as the safetensors library pads it"
    with safe_open(str(tmp_path / "all.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "x"}
        assert sorted(handle.keys()) == sorted(tensors)
        for key, tensor in tensors.items():
            assert same_bytes(handle.get_tensor(key), tensor.contiguous()), key
    assert [path.name for path in tmp_path.iterdir()] == ["all.safetensors"]


def test_shard_sizes_follow_hugging_face_units() -> None:
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("500 MB") == 500 * 10**6
    assert parse_shard_size("1234") == 1234
    for bad in ("", "0", "5 parsecs", "-1GB"):
        with pytest.raises(ConfigError):
            parse_shard_size(bad)


def test_tensors_stream_through_two_reused_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptd.export.assembly as assembly

    tensors = {f"layer{number}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(number))
               for number in range(6)}
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"model": tensors}, force=True)
    allocated: list[int] = []

    def counting(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        allocated.append(shape[0])
        return real(shape, dtype)

    real = assembly.aligned_empty
    monkeypatch.setattr(assembly, "aligned_empty", counting)
    export_safetensors(str(tmp_path / "ckpt"), 1, tmp_path / "out", ExportOptions(key_prefix="model"))
    assert allocated == [64 * 1024 * 4] * 2, "one buffer for the tensor written, one for the next"
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert loaded.keys() == tensors.keys()
    assert all(same_bytes(loaded[key], tensor) for key, tensor in tensors.items())


def test_two_entries_with_one_dotted_key_are_refused(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, force=True)
    with pytest.raises(ConfigError, match="two entries of the state export to the key 'a.b'"):
        export_safetensors(str(tmp_path / "ckpt"), 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dry_run_plans_without_writing_and_config_must_be_json(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    out = tmp_path / "model"
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", str(out),
                          "--max-shard-size", "1KB", "--dry-run", "--json")
    assert code == 0, output
    plan = json.loads(output)
    assert plan["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert sorted(key for keys in plan["files"].values() for key in keys) == sorted(weights)
    assert not out.exists()
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--key-prefix", "model.", "--out", str(out),
                          "--config", str(bad))
    assert code == 2 and "not JSON" in output and "config.json" in output
    assert not out.exists()


def test_exclude_leaves_sub_trees_out(saved, tmp_path: Path) -> None:
    root, _, weights = saved
    out = tmp_path / "model"
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--exclude", "optim", "--exclude", "epoch",
                          "--exclude", "tp.", "--out", str(out))
    assert code == 0, output
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == {f"model.{key}" for key in weights}
    assert all(same_bytes(loaded[f"model.{key}"], tensor) for key, tensor in weights.items())
    code, output = invoke(str(root), "--step", str(STEP), "--consolidate", "--exclude", "optim", "--out",
                          str(tmp_path / "other"))
    assert code == 2 and "'epoch'" in output and "--exclude" in output


def test_a_quantized_tensor_of_a_dcp_step_is_refused_not_exported_as_plain_integers(tmp_path: Path) -> None:
    """dcp.save stores a quantized tensor as its integers plus scale and zero point; safetensors has no
    quantized dtype, so exporting it as int8 would hand out wrong weights."""
    import torch.distributed.checkpoint as dcp

    from ckptd.dcp import CkptdStorageWriter

    root = tmp_path / "dcp"
    quantized = torch.quantize_per_tensor(torch.linspace(-1, 1, 16), scale=0.05, zero_point=3, dtype=torch.qint8)
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save({"model": {"q": quantized, "w": weight}}, storage_writer=CkptdStorageWriter(str(root), step=1))
    code, output = invoke(str(root), "--step", "1", "--key-prefix", "model.", "--out", str(tmp_path / "a"))
    assert code == 2 and "model.q" in output, output
    assert not (tmp_path / "a").exists()
    code, output = invoke(str(root), "--step", "1", "--key-prefix", "model.", "--exclude", "model.q",
                          "--out", str(tmp_path / "b"))
    assert code == 0, output
    exported = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert list(exported) == ["w"] and same_bytes(exported["w"], weight)
