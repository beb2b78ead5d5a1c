"""Policy: one meaning for remote_every_steps=None, the multiple-of check, retention policy objects."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import pytest

import ckptd
from ckptd.errors import ConfigError
from ckptd.policy import KeepEvery, KeepLatest, Policy, RetentionPolicy


def test_remote_every_steps_none_promotes_every_saved_step():
    policy = Policy(every_steps=3)
    assert [step for step in range(1, 13) if policy.saves(step)] == [3, 6, 9, 12]
    assert all(policy.promotes(step) for step in (3, 6, 9, 12))
    assert policy.promotes(7), "a force-saved step is promoted as well when remote_every_steps is None"


def test_remote_every_steps_selects_multiples_among_saved_steps():
    policy = Policy(every_steps=100, remote_every_steps=500)
    saved = [step for step in range(1, 2001) if policy.saves(step)]
    assert [step for step in saved if policy.promotes(step)] == [500, 1000, 1500, 2000]


@pytest.mark.parametrize(("every", "remote", "common"), [(100, 250, 500), (2, 3, 6), (4, 6, 12)])
def test_remote_every_steps_not_a_multiple_is_a_config_error_naming_the_lcm(every, remote, common):
    with pytest.raises(ConfigError) as caught:
        Policy(every_steps=every, remote_every_steps=remote)
    text = str(caught.value)
    assert f"remote_every_steps={remote}" in text and f"every_steps={every}" in text
    assert f"use remote_every_steps={common}" in text, text


@pytest.mark.parametrize("options", [
    {"every_steps": 0}, {"every_steps": -5}, {"every_steps": 1.5}, {"every_steps": True},
    {"remote_every_steps": 0}, {"remote_every_steps": "10"},
    {"keep_local": 0}, {"keep_remote": -1}, {"keep_local": 2.0}, {"keep_local": False},
    {"keep_remote": "all"}, {"keep_local": object()}, {"on_busy": "drop"},
])
def test_bad_options_are_config_errors_naming_the_option(options):
    (name,) = options
    with pytest.raises(ConfigError, match=name):
        Policy(**options)


def test_retention_from_integers_and_none():
    committed = [1, 2, 3, 4, 5]
    assert Policy(keep_local=2).local_retention == KeepLatest(2)
    assert Policy(keep_local=2).local_retention.deletable(committed) == [1, 2, 3]
    assert Policy(keep_local=None).local_retention.deletable(committed) == []
    assert Policy(keep_remote=1).remote_retention.deletable(committed) == [1, 2, 3, 4]
    assert Policy().remote_retention.deletable(committed) == [], "keep_remote defaults to keeping all"


def test_retention_policy_object_is_returned_as_is():
    keep = KeepEvery(10, latest=2)
    policy = Policy(keep_local=keep, keep_remote=KeepLatest(4))
    assert policy.local_retention is keep
    assert policy.remote_retention == KeepLatest(4)
    assert isinstance(keep, RetentionPolicy)
    assert ckptd.KeepEvery is KeepEvery and ckptd.KeepLatest is KeepLatest and ckptd.RetentionPolicy is RetentionPolicy


def test_keep_every_keeps_multiples_and_the_newest():
    committed = [5, 10, 15, 20, 25, 30, 35, 37]
    assert KeepEvery(10, latest=2).deletable(committed) == [5, 15, 25]
    assert KeepEvery(10).deletable(committed) == [5, 15, 25, 35]
    assert KeepEvery(10, latest=100).deletable(committed) == []
    assert KeepEvery(1).deletable(committed) == []
    assert KeepEvery(7).deletable([]) == []


def test_keep_latest_never_deletes_the_newest():
    assert KeepLatest(1).deletable([3]) == []
    assert KeepLatest(1).deletable([3, 4]) == [3]
    assert KeepLatest(3).deletable([1, 2]) == []


@pytest.mark.parametrize("build", [lambda: KeepLatest(0), lambda: KeepEvery(0), lambda: KeepEvery(5, latest=0),
                                   lambda: KeepEvery(5, latest=None)])
def test_retention_objects_check_their_arguments(build):
    with pytest.raises(ConfigError):
        build()


def test_records_are_frozen():
    with pytest.raises(FrozenInstanceError):
        Policy().every_steps = 2  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        KeepEvery(3).every = 4  # type: ignore[misc]


def test_a_user_retention_policy_drives_local_retention(tmp_path):
    @dataclass(frozen=True)
    class KeepOdd:
        def deletable(self, committed: list[int]) -> list[int]:
            return [step for step in committed[:-1] if step % 2 == 0]

    import torch
    state = {"weights": torch.arange(8, dtype=torch.float32)}
    with ckptd.CheckpointManager(tmp_path, policy=Policy(keep_local=KeepOdd()), capture_rng=False) as manager:
        for step in range(1, 7):
            manager.save(step, state)
            manager.wait()
        assert manager.committed_steps() == [1, 3, 5, 6]


def test_keep_every_on_the_local_tier(tmp_path):
    import torch
    state = {"weights": torch.arange(8, dtype=torch.float32)}
    policy = Policy(every_steps=2, keep_local=KeepEvery(4, latest=1))
    with ckptd.CheckpointManager(tmp_path, policy=policy, capture_rng=False) as manager:
        for step in range(1, 11):
            manager.save(step, state)
            manager.wait()
        assert manager.committed_steps() == [4, 8, 10]
