"""The CLI on the object tier: ``promote``, ``gc`` (both tiers, ``--dry-run``, ``--json``), and
``ls``, ``verify`` and ``restore`` of ``s3://`` URLs."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.errors import NotFoundError
from ckptd.stepio.step_reader import verify_step
from test_promotion_support import model_state, object_tier, same_bytes, save_local

pytestmark = pytest.mark.s3


@pytest.fixture
def runner(monkeypatch, s3_options) -> CliRunner:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("CKPTD_S3_ENDPOINT_URL", s3_options["client_kwargs"]["endpoint_url"])
    return CliRunner()


def _run(runner: CliRunner, *arguments: str) -> tuple[int, str]:
    outcome = runner.invoke(cli, list(arguments))
    return outcome.exit_code, outcome.output


def test_promote_then_gc_both_tiers(tmp_path, s3_bucket, s3_options, runner):
    local = save_local(tmp_path / "local", {step: model_state(step) for step in (1, 2, 3)})
    url = f"s3://{s3_bucket}/cli"
    code, output = _run(runner, "promote", str(local.root), "--to", url, "--json")
    assert code == 0, output
    reports = json.loads(output)
    assert [report["step"] for report in reports] == [1, 2, 3]
    assert reports[1]["bytes_uploaded"] < 0.2 * reports[0]["bytes_uploaded"], "dedup across steps"
    code, output = _run(runner, "promote", str(local.root), "--to", url, "--step", "2")
    assert code == 0 and "already committed" in output
    remote = object_tier(s3_bucket, s3_options, "cli")
    assert remote.committed_steps() == [1, 2, 3]

    code, output = _run(runner, "gc", url, "--keep", "1", "--dry-run", "--json")
    assert code == 0, output
    rehearsal = json.loads(output)
    assert rehearsal["dry_run"] and rehearsal["deleted_steps"] == [1, 2] and rehearsal["deleted_chunks"] == 2
    assert remote.committed_steps() == [1, 2, 3]
    code, output = _run(runner, "gc", url, "--keep", "1")
    assert code == 0 and "deleted 2 unreferenced chunk(s)" in output, output
    assert remote.committed_steps() == [3] and list(verify_step(remote, 3)) == []

    code, output = _run(runner, "gc", str(local.root), "--keep", "2", "--json")
    assert code == 0 and json.loads(output)["deleted_steps"] == [1]
    assert local.committed_steps() == [2, 3]


def test_promote_reports_a_missing_step_in_one_line(tmp_path, s3_bucket, runner):
    local = save_local(tmp_path / "local", {1: model_state(1)})
    code, output = _run(runner, "promote", str(local.root), "--to", f"s3://{s3_bucket}/x", "--step", "7")
    assert code == NotFoundError.exit_code
    assert output.strip().count("\n") == 0 and "step 7" in output and "ckptd ls" in output


def test_ls_verify_and_restore_read_the_object_tier(tmp_path, s3_bucket, s3_options, runner):
    states = {step: model_state(step) for step in (1, 2)}
    local = save_local(tmp_path / "local", states)
    url = f"s3://{s3_bucket}/read"
    assert _run(runner, "promote", str(local.root), "--to", url)[0] == 0

    code, output = _run(runner, "ls", str(local.root), url, "--json")
    assert code == 0, output
    copies = {(row["step"], row["tier"].split()[0]): row["state"] for row in json.loads(output)}
    assert copies == {(1, "local"): "committed", (2, "local"): "committed",
                      (1, "object"): "committed", (2, "object"): "committed"}

    out = tmp_path / "step2.pt"
    code, output = _run(runner, "restore", url, "--step", "2", "--out", str(out))
    assert code == 0, output
    exported = torch.load(out, weights_only=True)
    assert same_bytes({name: exported[name] for name in states[2]}, states[2])

    assert _run(runner, "verify", url)[0] == 0
    remote = object_tier(s3_bucket, s3_options, "read")
    trained_chunk = remote.chunk_path(ckptd_chunk_key(local, 2, "trained"))
    damaged = bytearray(remote.read_bytes(trained_chunk))
    damaged[0] ^= 1
    remote.write_bytes(trained_chunk, bytes(damaged))
    code, output = _run(runner, "verify", url, "--step", "2")
    assert code == 4 and "step 2" in output, output
    code, output = _run(runner, "ls", url, "--verify", "--json")
    assert {row["step"]: row["state"] for row in json.loads(output)} == {1: "verified", 2: "corrupt"}


def ckptd_chunk_key(local, step: int, tensor: str) -> str:
    """The content address of the first chunk of a tensor of a step, from the local index."""
    from ckptd.stepio.step_reader import load_step_manifest, load_rank_index

    index = load_rank_index(local, load_step_manifest(local, step), 0)
    return index.tensors[tensor].chunks[0].object_key
