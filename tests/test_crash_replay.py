"""Crash consistency by replay: the recorder, the crash-state model, and a full replay of real saves.

The model's tests record real ``os`` calls on a scratch directory and check what the model allows after
a power loss: a write before its file's fsync is never lost, one after it may be dropped, zeroed or torn
at a sector boundary; directory entries after the last fsync of their directory persist as a prefix; a
directory whose parent was not fsynced after its ``mkdir`` can vanish with everything in it. The replay
tests record real saves (``CheckpointManager`` on a local directory) and check every distinct crash state
with a fresh start (L1-L3), one of them also with directory entries persisting in any order (a subset,
as POSIX allows); others re-create known durability bugs (a step directory whose name is never made
durable, also when a killed attempt left it; a data file renamed into place without its fsync) and show
that the replay finds them.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest

from harness import crash_replay
from harness.crash_replay import (FIRST_STEP, FRESH_ROOT, LATER_STEP_RETENTION, LEFTOVER_STEP_DIRECTORY,
                                        PACKED_AND_DIRECT, TWO_RANKS, check_state, record_save, replay)
from harness.crash_states import SECTOR, CrashModel, CrashState, replay_everything, tree_differences, tree_of
from harness.fs_recorder import Trace, record


def _write_file(path: Path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _all_trees(trace: Trace, crash_point: int | None = None) -> list[dict[str, bytes]]:
    """Every state the model allows at ``crash_point`` (default: after the last op), as name -> bytes."""
    model = CrashModel(trace)
    point = len(trace.ops) if crash_point is None else crash_point
    trees = []
    for state in model.states(point, random.Random(0), cap=10_000):
        tree = model.materialise(state)
        trees.append({name: tree.contents[file_id] for name, file_id in tree.files.items()})
    assert len(trees) == model.count(point)
    return trees


# --- the model ------------------------------------------------------------------------------------

def test_a_write_before_fsync_is_never_lost_and_one_after_may_be(tmp_path: Path) -> None:
    path = tmp_path / "data"
    _write_file(path, b"", sync=False)
    _sync_directory(tmp_path)
    with record(tmp_path) as trace:
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, b"A" * 100, 0)
        os.fsync(fd)
        os.pwrite(fd, b"B" * 100, 100)
        os.close(fd)
    trees = _all_trees(trace)
    assert all(tree["data"][:100] == b"A" * 100 for tree in trees)
    assert {tree["data"] for tree in trees} == {b"A" * 100, b"A" * 100 + b"B" * 100, b"A" * 100 + bytes(100)}


def test_a_rename_before_the_directory_fsync_can_vanish_and_not_after(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        _write_file(tmp_path / "file.tmp", b"payload", sync=True)
        os.rename(tmp_path / "file.tmp", tmp_path / "file")
        before_sync = len(trace.ops)
        _sync_directory(tmp_path)
    unsynced = _all_trees(trace, before_sync)
    assert any("file" not in tree for tree in unsynced)
    assert any(tree.get("file") == b"payload" for tree in unsynced)
    assert all(set(tree) == {"file"} and tree["file"] == b"payload" for tree in _all_trees(trace))


def test_entries_of_one_directory_persist_in_order(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        for name in ("first", "second", "third"):
            _write_file(tmp_path / name, name.encode(), sync=True)
    trees = _all_trees(trace)
    assert sorted(tuple(sorted(tree)) for tree in trees) == [(), ("first",), ("first", "second"),
                                                             ("first", "second", "third")]


def test_a_directory_whose_parent_was_not_fsynced_can_vanish(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        os.mkdir(tmp_path / "step")
        _write_file(tmp_path / "step" / "file", b"x" * 10, sync=True)
        _sync_directory(tmp_path / "step")
        without_parent_sync = len(trace.ops)
        _sync_directory(tmp_path)
    assert any(tree == {} for tree in _all_trees(trace, without_parent_sync))
    assert all(tree == {"step/file": b"x" * 10} for tree in _all_trees(trace))


def test_a_torn_write_stops_at_a_sector_boundary(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        _write_file(tmp_path / "big", b"z" * 10_000, sync=False)
        _sync_directory(tmp_path)
    model = CrashModel(trace)
    write = next(op for op in trace.ops if op.kind == "write")
    for boundary in (SECTOR, 2 * SECTOR):
        state = CrashState(len(trace.ops), fates=((write.index, f"torn@{boundary}"),))
        tree = model.materialise(state)
        assert tree.contents[tree.files["big"]] == b"z" * boundary
    sizes = {len(tree["big"]) for tree in _all_trees(trace)}
    assert sizes <= {0, SECTOR, 2 * SECTOR, 10_000} and {0, 10_000} <= sizes


def test_counts_and_the_cap(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        _write_file(tmp_path / "a", b"1" * 5000, sync=False)  # create + write: 2 entry choices x 4 fates
        _write_file(tmp_path / "b", b"2" * 10, sync=False)    # create + write: 1 more entry choice, 3 fates
    model = CrashModel(trace)
    assert [model.count(point) for point in model.crash_points] == [1, 2, 8, 12, 36]
    assert model.total() == 59
    every = list(model.states(4, random.Random(1), cap=36))
    assert len(every) == 36 == len(set(every))
    capped = list(model.states(4, random.Random(1), cap=10))
    assert len(capped) == 10 == len(set(capped))
    assert capped[0].fates == ((1, "drop"), (3, "drop")) and dict(capped[0].directory_kept) == {"": 0}


def test_the_recorder_unpatches_os_when_its_block_raises(tmp_path: Path) -> None:
    real_open, real_fsync = os.open, os.fsync
    with pytest.raises(RuntimeError, match="inside"):
        with record(tmp_path):
            assert os.open is not real_open
            raise RuntimeError("inside the recording")
    assert os.open is real_open and os.fsync is real_fsync
    with record(tmp_path) as trace:  # and a new recording can start
        _write_file(tmp_path / "after", b"1", sync=True)
    assert [op.kind for op in trace.ops] == ["create", "write", "fsync"]


def test_the_recorder_replays_to_the_directory_a_save_left(tmp_path: Path) -> None:
    recording = record_save(PACKED_AND_DIRECT, tmp_path / "root")
    trace = recording.trace
    assert tree_differences(replay_everything(trace), tree_of(recording.root)) == []
    assert any(op.kind == "write" and op.direct for op in trace.ops), "large chunks are written with O_DIRECT"
    assert any(op.kind == "write" and not op.direct for op in trace.ops), "the pack goes through the page cache"
    assert trace.count("dirsync") >= 2 and trace.count("fsync") >= 4
    retention = record_save(LATER_STEP_RETENTION, tmp_path / "retention").trace
    assert any(op.kind == "unlink" and op.path == "step-000000000001/manifest.json" for op in retention.ops)
    assert any(op.kind == "rmdir" and op.path == "step-000000000001" for op in retention.ops)


# --- full replays of real saves -------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "resume"), [(FIRST_STEP, True), (LATER_STEP_RETENTION, True), (FRESH_ROOT, False)],
                         ids=["first_step", "later_step_retention", "fresh_root"])
def test_every_crash_state_of_a_save_recovers(tmp_path: Path, shape: crash_replay.SaveShape, resume: bool) -> None:
    """Every state the model allows, each distinct tree opened by a fresh start (and, where ``resume``,
    the next save after it; the fresh-root shape's 1,000-odd states are checked without it, for time)."""
    recording = record_save(shape, tmp_path / "root")
    report = replay(recording, tmp_path / "scratch", random.Random(4), cap=10_000, resume=resume)
    assert report.enumerated == report.states_in_model and report.sampled == 0, "every state was enumerated"
    assert report.checked > 15
    assert 0 < report.with_recorded_step < report.checked, "states before and after the commit were checked"
    assert report.failures == [], "\n\n".join(f"{f.description}\n{f.problems}" for f in report.failures)


@pytest.mark.parametrize("shape", [PACKED_AND_DIRECT, TWO_RANKS], ids=lambda shape: shape.name)
def test_sampled_crash_states_of_larger_saves_recover(tmp_path: Path, shape: crash_replay.SaveShape) -> None:
    recording = record_save(shape, tmp_path / "root")
    report = replay(recording, tmp_path / "scratch", random.Random(5), cap=3)
    assert report.sampled > 0 and report.checked > 20 and report.with_recorded_step > 0
    assert report.failures == [], "\n\n".join(f"{f.description}\n{f.problems}" for f in report.failures)


def test_unordered_directory_entries_a_subset_persists(tmp_path: Path) -> None:
    with record(tmp_path) as trace:
        for name in ("first", "second"):
            _write_file(tmp_path / name, name.encode(), sync=True)
    model = CrashModel(trace, ordered_entries=False)
    trees = set()
    for state in model.states(len(trace.ops), random.Random(0), cap=100):
        trees.add(tuple(sorted(model.materialise(state).files)))
    assert trees == {(), ("first",), ("second",), ("first", "second")}


def test_a_save_does_not_rely_on_the_order_of_directory_entries(tmp_path: Path) -> None:
    """The replay of two ranks' save (and the old step's deletion) with each directory's unsynced entry
    changes persisting as any subset, as POSIX allows, not only as a prefix."""
    recording = dataclasses.replace(record_save(TWO_RANKS, tmp_path / "root"), ordered_entries=False)
    report = replay(recording, tmp_path / "scratch", random.Random(9), cap=6, resume=False)
    assert report.states_in_model > CrashModel(recording.trace).total()
    assert report.checked > 20 and report.with_recorded_step > 0
    assert report.failures == [], "\n\n".join(f"{f.description}\n{f.problems}" for f in report.failures)


def _plain_mkdir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)


def test_the_replay_finds_a_step_directory_whose_name_is_not_durable(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (found by this replay): the step directory was created without fsyncing the root, so a
    power loss after an acknowledged commit could take the whole step away, and with ``keep_local=1``
    the previous step too (its manifest's unlink was durable)."""
    monkeypatch.setattr("ckptd.tiers.local.make_directory", _plain_mkdir)
    recording = record_save(LATER_STEP_RETENTION, tmp_path / "root")
    report = replay(recording, tmp_path / "scratch", random.Random(6), cap=10_000, stop_after_failures=100,
                    resume=False, first_point=recording.acknowledged_at)
    problems = [problem for failure in report.failures for problem in failure.problems]
    assert any("L2: acknowledged step(s) [2] lost (committed now: [])" in problem for problem in problems)
    monkeypatch.undo()
    fixed = record_save(LATER_STEP_RETENTION, tmp_path / "fixed")
    mkdir = next(op.index for op in fixed.trace.ops if op.kind == "mkdir")
    assert any(op.kind == "dirsync" and op.path == "" and op.index > mkdir
               for op in fixed.trace.ops[:fixed.acknowledged_at])


def test_the_replay_finds_a_checkpoint_root_whose_name_is_not_durable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (found by this replay): the manager created its root without fsyncing the directory
    holding it, so a power loss after the first acknowledged commit could take the root away."""
    monkeypatch.setattr("ckptd.tiers.local.make_directory", _plain_mkdir)
    recording = record_save(FRESH_ROOT, tmp_path / "root")
    report = replay(recording, tmp_path / "scratch", random.Random(7), cap=10_000, stop_after_failures=1,
                    resume=False, first_point=recording.acknowledged_at)
    assert report.failures, "the root's mkdir is not durable without an fsync of its parent"
    assert "dropped #0 mkdir run" in report.failures[0].description
    assert "L2: acknowledged step(s) [1] lost" in report.failures[0].problems[0]


def test_a_step_directory_left_by_a_killed_attempt_is_made_durable(tmp_path: Path) -> None:
    """Regression (found in review): an attempt killed between the step directory's ``mkdir`` and the
    fsync of the root leaves a directory that is not durable; the restarted job's save went into it
    without fsyncing the root (another process had created it), so a power loss after that save's
    acknowledged commit could take the step away, and with ``keep_local=1`` the step before it too."""
    recording = record_save(LEFTOVER_STEP_DIRECTORY, tmp_path / "root")
    assert recording.trace.ops[0].kind == "mkdir" and recording.trace.ops[0].path == "step-000000000002"
    report = replay(recording, tmp_path / "scratch", random.Random(8), cap=10_000, stop_after_failures=1,
                    resume=False, first_point=recording.acknowledged_at + 1)
    assert report.failures == [], "\n\n".join(f"{f.description}\n{f.problems}" for f in report.failures)
    assert report.checked > 0 and report.with_recorded_step == report.checked


def test_the_replay_finds_a_data_file_renamed_without_its_fsync(tmp_path: Path) -> None:
    """The trace of a real save with the data file's fsync taken out (the order a writer that commits
    before its data is durable would issue): some crash state advertises a step that does not verify."""
    recording = record_save(FIRST_STEP, tmp_path / "root")
    data_syncs = {op.index for op in recording.trace.ops if op.kind == "fsync" and ".data" in op.path}
    assert data_syncs
    ops = [dataclasses.replace(op, index=i)
           for i, op in enumerate(op for op in recording.trace.ops if op.index not in data_syncs)]
    broken = dataclasses.replace(recording, trace=Trace(recording.trace.root, recording.trace.snapshot, ops))
    broken.acknowledged_at = crash_replay.acknowledged_commit(broken.trace, FIRST_STEP.step)
    model = broken.model
    point = len(ops)
    state = CrashState(point, fates=tuple((op.index, "zero") for op in ops
                                          if op.kind == "write" and ".data" in op.path))
    verdict = check_state(broken, state, tmp_path / "state")
    assert not verdict.held
    assert any(problem.startswith(("L3", "L1", "recovery")) for problem in verdict.problems), verdict.problems
    assert model.count(point) > 1
