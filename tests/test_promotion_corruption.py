"""Corruption across tiers: a flipped bit in a local chunk is repaired from S3 during restore, chunk by
chunk; a flipped bit in the S3 copy is found by ``ckptd verify`` and on restore."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.errors import IntegrityError
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.promotion import promote_step
from ckptd.testing import tamper
from test_promotion_support import flip_bit, model_state, object_tier, s3_client, same_bytes, \
    save_local, zero_like

pytestmark = pytest.mark.s3


def _chunk_key(remote, step: int, tensor: str) -> str:
    index = load_rank_index(remote, load_step_manifest(remote, step), 0)
    return index.tensors[tensor].chunks[-1].object_key


def test_flipped_bit_in_a_local_chunk_is_repaired_from_s3(tmp_path, s3_bucket, s3_options):
    state = model_state(1)
    local = save_local(tmp_path / "local", {1: state})
    remote = object_tier(s3_bucket, s3_options)
    promote_step(local, remote, 1)
    data_file, offset, _ = tamper.chunk_location(local.root, 1, "frozen", 1)
    damaged = tamper.read_json(tamper.index_path(local.root, 1))["tensors"]["frozen"]["chunks"][1][4]
    flip_bit(data_file, offset + 100)  # inside the 2nd chunk
    restored = zero_like(state)
    with ckptd.CheckpointManager(tmp_path / "local", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        assert manager.restore(restored) == 1
        result = manager.last_restore
    assert same_bytes(restored, state)
    assert result.tier == local.label, "the step is read from the nearest tier"
    assert len(result.events) == 1, "only the bad chunk is fetched from the next tier"
    event = result.events[0]
    assert event.tier == local.label and event.step == 1 and event.tensor == "frozen"
    assert event.chunk == damaged, "the event names the damaged chunk, not another one"
    assert f"chunk {damaged}" in event.error and f"at offset {offset} " in event.error
    assert f"file {data_file.parent.name}/{data_file.name}" in event.error


def test_flipped_bit_in_the_s3_copy_is_detected_by_verify_and_on_restore(tmp_path, s3_server, s3_bucket,
                                                                          s3_options, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    states = {1: model_state(1), 2: model_state(2)}
    local = save_local(tmp_path / "local", states)
    remote = object_tier(s3_bucket, s3_options)
    for step in (1, 2):
        promote_step(local, remote, step)
    key = _chunk_key(remote, 2, "trained")  # step 2's own chunk, not shared with step 1
    client = s3_client(s3_server)
    object_key = f"run/chunks/{key}"
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=object_key)["Body"].read())
    body[5] ^= 0x10
    client.put_object(Bucket=s3_bucket, Key=object_key, Body=bytes(body))

    endpoint = s3_options["client_kwargs"]["endpoint_url"]
    outcome = CliRunner().invoke(cli, ["verify", remote.url, "--endpoint-url", endpoint, "--json"])
    assert outcome.exit_code == IntegrityError.exit_code, outcome.output
    problems = json.loads(outcome.output)["problems"]
    assert [problem["step"] for problem in problems] == [2]
    assert key.split("/")[1] in problems[0]["error"]

    restored = zero_like(states[1])
    with ckptd.CheckpointManager(tmp_path / "empty", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        assert manager.restore(restored) == 1, "no intact copy of step 2 anywhere: fall back to step 1"
        (reason,) = manager.last_restore.skipped
        digest = key.split("/")[1].split(".")[0]
        assert reason.startswith("step 2 on rank 0:") and f"chunk {digest}" in reason, reason
    assert same_bytes(restored, states[1])

    with ckptd.CheckpointManager(tmp_path / "local", remote=remote.url, storage_options=s3_options,
                                 capture_rng=False) as manager:
        restored = zero_like(states[2])
        assert manager.restore(restored) == 2, "the intact local copy wins"
    assert same_bytes(restored, states[2])
