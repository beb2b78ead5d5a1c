"""The daemon's retention: the newest ``keep`` committed steps stay on each kind of tier, protected steps
and the newest always stay, uncommitted step directories are left alone, and the object tier's sweep
keeps every chunk a kept step references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptd.daemon.retention import apply_retention
from ckptd.errors import ConfigError
from ckptd.format.layout import step_dir
from ckptd.promotion import promote_step
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest, verify_step
from ckptd.tiers.local import LocalTier
from test_promotion_support import model_state, object_tier, s3_client, save_local

STEPS = (1, 2, 3, 4, 5)


@pytest.fixture
def local(tmp_path) -> LocalTier:
    """Five committed steps on a local root (a frozen tensor shared by all, a trained one per step)."""
    return save_local(tmp_path / "local", {step: model_state(step) for step in STEPS})


def _replica_of(local: LocalTier, directory: Path) -> LocalTier:
    """A buddy's replica directory, laid out like the local tier."""
    for step in local.committed_steps():
        shutil.copytree(local.root / step_dir(step), directory / step_dir(step))
    return LocalTier(directory)


@pytest.fixture(params=["local-root", "replica-dir"])
def directory_tier(request, local, tmp_path) -> LocalTier:
    if request.param == "local-root":
        return local
    return _replica_of(local, tmp_path / "replicas" / "node-a" / "run1")


@pytest.mark.parametrize("keep, kept", [(1, (5,)), (2, (4, 5)), (5, STEPS), (9, STEPS)])
def test_a_directory_tier_keeps_the_newest_steps(directory_tier, keep, kept):
    report = apply_retention(directory_tier, keep=keep)
    assert directory_tier.committed_steps() == list(kept)
    assert report.kept_steps == kept and report.deleted_steps == tuple(s for s in STEPS if s not in kept)
    assert sorted(path.name for path in directory_tier.root.glob("step-*")) == [step_dir(step) for step in kept], \
        "the deleted steps' directories are gone"
    for step in kept:
        assert list(verify_step(directory_tier, step)) == [], "kept steps are intact"


def test_protected_steps_survive_and_the_newest_always_does(directory_tier):
    report = apply_retention(directory_tier, keep=1, protect={2, 4})
    assert directory_tier.committed_steps() == [2, 4, 5]
    assert report.deleted_steps == (1, 3) and report.protected_steps == (2, 4)
    assert apply_retention(directory_tier, keep=1, protect=range(1, 5)).deleted_steps == (), "nothing left to delete"
    assert directory_tier.committed_steps() == [2, 4, 5]


def test_keep_none_touches_nothing_and_a_bad_keep_is_refused(directory_tier):
    before = sorted(str(path) for path in directory_tier.root.rglob("*"))
    assert apply_retention(directory_tier, keep=None).deleted_steps == ()
    assert sorted(str(path) for path in directory_tier.root.rglob("*")) == before
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="integer >= 1"):
            apply_retention(directory_tier, keep=bad)
    assert directory_tier.committed_steps() == list(STEPS)


def test_uncommitted_step_directories_are_left_to_their_writer(local):
    in_flight = local.root / step_dir(0)  # older than every committed step: a replication still writing
    shutil.copytree(local.root / step_dir(1), in_flight)
    (in_flight / "manifest.json").unlink()
    apply_retention(local, keep=2)
    assert local.committed_steps() == [4, 5]
    assert in_flight.is_dir() and any(in_flight.iterdir())


def _chunk_keys(tier, step: int) -> set[str]:
    index = load_rank_index(tier, load_step_manifest(tier, step), 0)
    return {chunk.object_key for chunk in index.chunks}


def _stored_chunks(server, bucket: str) -> set[str]:
    client = s3_client(server)
    return {item["Key"].removeprefix("run/chunks/")
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run/chunks/")
            for item in page.get("Contents", [])}


@pytest.mark.s3
def test_the_object_tier_keeps_the_newest_and_protected_steps_and_their_chunks(local, s3_server, s3_bucket,
                                                                               s3_options):
    remote = object_tier(s3_bucket, s3_options)
    try:
        for step in STEPS:
            promote_step(local, remote, step)
        keys = {step: _chunk_keys(remote, step) for step in STEPS}
        shared = set.intersection(*keys.values())
        assert shared and all(keys[step] - shared for step in STEPS), "a shared frozen part, a trained part per step"

        report = apply_retention(remote, keep=2, protect={2})

        assert remote.committed_steps() == [2, 4, 5]
        assert report.kept_steps == (2, 4, 5) and report.deleted_steps == (1, 3) and report.protected_steps == (2,)
        stored = _stored_chunks(s3_server, s3_bucket)
        assert keys[2] | keys[4] | keys[5] <= stored, "every chunk a kept step references survives the sweep"
        assert not (keys[1] | keys[3]) - (keys[2] | keys[4] | keys[5]) & stored, "the deleted steps' own chunks go"
        assert report.deleted_chunks == len((keys[1] | keys[3]) - (keys[2] | keys[4] | keys[5]))
        for step in (2, 4, 5):
            assert list(verify_step(remote, step)) == []
        assert apply_retention(remote, keep=None).deleted_steps == () and remote.committed_steps() == [2, 4, 5]
    finally:
        remote.close()


def test_the_report_is_json(local):
    report = apply_retention(local, keep=3, protect={1})
    assert json.loads(json.dumps(report.to_json()))["deleted_steps"] == [2]
