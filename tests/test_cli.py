"""The restore CLI against real checkpoints on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptd
from ckptd.cli.main import cli
from ckptd.errors import IntegrityError
from ckptd.format.hashing import chunk_digest
from ckptd.testing.tamper import chunk_location, flip_bit, manifest_path


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two committed steps of a small model; returns the directory and step 2's tensors."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    root = tmp_path / "ckpt"
    with ckptd.CheckpointManager(root, codec="zstd") as manager:
        manager.save(1, {"model": model, "epoch": 1})
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        manager.save(2, {"model": model, "epoch": 2})
    return root, {k: v.clone() for k, v in model.state_dict().items()}


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_help_lists_the_commands() -> None:
    code, output = invoke("--help")
    assert code == 0
    for command in ("ls", "verify", "inspect", "restore", "demo"):
        assert command in output


def test_ls_json_lists_committed_steps(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    code, output = invoke("ls", str(root), "--json")
    assert code == 0
    rows = json.loads(output)
    assert [(r["step"], r["state"], r["ranks"]) for r in rows] == [(1, "committed", 1), (2, "committed", 1)]
    assert all(r["bytes"] > 0 for r in rows)


def test_ls_marks_a_step_without_manifest_incomplete(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    (root / "step-000000000002" / "manifest.json").unlink()
    code, output = invoke("ls", str(root), "--json")
    assert code == 0
    assert {r["step"]: r["state"] for r in json.loads(output)} == {1: "committed", 2: "incomplete"}


def test_inspect_reports_every_tensor_with_its_digest(checkpoint_dir) -> None:
    root, tensors = checkpoint_dir
    code, output = invoke("inspect", str(root), "--step", "2", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(output)["tensors"]}
    for key, tensor in tensors.items():
        row = rows[f"model/{key}"]
        assert row["shape"] == list(tensor.shape)
        assert row["dtype"] == "float32"
        assert row["bytes"] == tensor.numel() * 4
        assert row["digest"] == chunk_digest(tensor.numpy().tobytes())


def test_verify_passes_then_names_the_bad_chunk(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    assert invoke("verify", str(root))[0] == 0
    data = root / "step-000000000002" / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    code, output = invoke("verify", str(root))
    assert code == 4
    assert "step 2" in output and "rank-00000.data" in output
    code, output = invoke("verify", str(root), "--step", "1")
    assert code == 0


def test_restore_exports_equal_bytes_to_torch_and_safetensors(checkpoint_dir, tmp_path: Path) -> None:
    root, tensors = checkpoint_dir
    assert invoke("restore", str(root), "--step", "2", "--out", str(tmp_path / "out.pt"))[0] == 0
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert exported["epoch"] == 2
    for key, tensor in tensors.items():
        assert torch.equal(exported["model"][key], tensor)
    assert invoke("restore", str(root), "--step", "2", "--out", str(tmp_path / "out.safetensors"))[0] == 0
    loaded = load_file(str(tmp_path / "out.safetensors"))
    for key, tensor in tensors.items():
        assert torch.equal(loaded[f"model.{key}"], tensor)


def test_errors_are_one_line_and_an_exit_code(tmp_path: Path) -> None:
    completed = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "ls", str(tmp_path / "missing")],
                               capture_output=True, text=True, check=False)
    assert completed.returncode == 8
    assert "Traceback" not in completed.stderr
    assert completed.stderr.strip().count("\n") == 0
    assert "does not exist" in completed.stderr


def test_inspect_of_a_missing_step_names_it(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    code, output = invoke("inspect", str(root), "--step", "7")
    assert code == 8
    assert "step 7" in output


def test_ls_verify_exits_4_on_a_corrupt_step_and_names_it(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    assert invoke("ls", str(root), "--verify")[0] == 0
    path, offset, _ = chunk_location(root, 2, "model/0.weight")
    flip_bit(path, offset)
    code, output = invoke("ls", str(root), "--verify", "--json")
    assert code == IntegrityError.exit_code
    assert {row["step"]: row["state"] for row in json.loads(output)} == {1: "verified", 2: "corrupt"}
    code, output = invoke("ls", str(root), "--verify")
    assert code == IntegrityError.exit_code and "corrupt" in output and "model/0.weight" in output, output
    assert invoke("ls", str(root))[0] == 0, "without --verify no chunk is read: the manifests are intact"


def test_ls_exits_4_on_a_corrupt_manifest_but_not_on_an_incomplete_step(checkpoint_dir) -> None:
    root, _ = checkpoint_dir
    (root / "step-000000000003").mkdir()  # a save being written: no manifest yet
    assert invoke("ls", str(root))[0] == 0
    manifest = manifest_path(root, 2)
    manifest.write_bytes(manifest.read_bytes().replace(b'"world_size"', b'"world_sizf"'))
    code, output = invoke("ls", str(root), "--json")
    assert code == IntegrityError.exit_code
    assert {row["step"]: row["state"] for row in json.loads(output)} == {1: "committed", 2: "corrupt",
                                                                          3: "incomplete"}


def test_inspect_defaults_to_the_newest_step(checkpoint_dir) -> None:
    root, tensors = checkpoint_dir
    code, output = invoke("inspect", str(root), "--json")
    assert code == 0, output
    shown = json.loads(output)
    assert shown["step"] == 2
    assert {"rank": 0, "path": "epoch", "value": 2} in shown["values"]
    empty = root.parent / "empty"
    empty.mkdir()
    code, output = invoke("inspect", str(empty))
    assert code == 8 and "no committed step" in output, output


@pytest.mark.s3
def test_ls_shows_how_far_the_object_tier_is_behind(checkpoint_dir, s3_bucket, s3_options, monkeypatch) -> None:
    root, _ = checkpoint_dir
    url = f"s3://{s3_bucket}/lag"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret"])
    endpoint = ["--endpoint-url", s3_options["client_kwargs"]["endpoint_url"]]
    assert invoke("promote", str(root), "--to", url, "--step", "1", *endpoint)[0] == 0
    code, output = invoke("ls", str(root), url, *endpoint)
    assert code == 0, output
    assert "promotion: object tier 1 step(s) behind" in output and "local 2, remote 1" in output, output
    code, output = invoke("ls", str(root), url, "--lag", "--json", *endpoint)
    assert code == 0, output
    lag = json.loads(output)
    assert (lag["local_step"], lag["remote_step"], lag["steps_behind"]) == (2, 1, 1)
    assert lag["seconds_behind"] is not None and lag["seconds_behind"] >= 0
    assert invoke("promote", str(root), "--to", url, *endpoint)[0] == 0
    code, output = invoke("ls", str(root), url, "--lag", *endpoint)
    assert code == 0 and "up to date" in output, output
    code, output = invoke("ls", str(root), "--lag")
    assert code == 2 and "--lag needs" in output, output
