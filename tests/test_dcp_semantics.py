"""ckptd's DCP plugins behave as DCP's own writer where a user can tell: ``overwrite=False`` raises
"Checkpoint already exists" (the checks of PyTorch's ``test_overwrite``), ``validate_checkpoint_id``
declines what ckptd cannot serve (so DCP's auto-detection picks another storage), and
``dcp.save(..., use_collectives=False)`` on 2 real gloo ranks commits a step once every rank's part is
written, while a load of a step some rank has not finished is refused naming that rank; ``ckptd inspect``
shows the bytes each rank of that step wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.dcp.parts import part_name
from ckptd.errors import AlreadyCommittedError, CheckpointExistsError, ConfigError, PartialStepError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier
from ckptd.tiers.registry import register_tier, unregister_tier


def test_overwrite_false_raises_checkpoint_already_exists_as_dcp_does(tmp_path: Path) -> None:
    """PyTorch's test_overwrite, with ckptd's writer and reader."""
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=CkptdStorageWriter(tmp_path, overwrite=False))
    dcp.save({"random": t2}, storage_writer=CkptdStorageWriter(tmp_path, overwrite=True))
    loaded = {"random": torch.zeros(10)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path))
    assert torch.equal(loaded["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t2}, storage_writer=CkptdStorageWriter(tmp_path, overwrite=False))
    assert LocalTier(tmp_path).committed_steps() == [0, 1], "the refused save wrote no step"
    dcp.load(loaded, checkpoint_id=str(tmp_path), storage_reader=CkptdStorageReader())
    assert torch.equal(loaded["random"], t2)


def test_overwrite_false_refuses_a_committed_step_and_true_never_rewrites_it(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=CkptdStorageWriter(tmp_path, step=4, overwrite=False))
    writer = CkptdStorageWriter(tmp_path, step=4, overwrite=False)
    writer.reset()
    with pytest.raises(CheckpointExistsError) as caught:
        writer.set_up_storage_writer(True)
    assert "Checkpoint already exists" in str(caught.value) and "step 4" in str(caught.value)
    rewriting = CkptdStorageWriter(tmp_path, step=4, overwrite=True)
    rewriting.reset()
    with pytest.raises(AlreadyCommittedError) as again:
        rewriting.set_up_storage_writer(True)
    assert not isinstance(again.value, CheckpointExistsError)
    # A new step of the same root is not an overwrite.
    dcp.save({"w": torch.zeros(3)}, storage_writer=CkptdStorageWriter(tmp_path, step=5, overwrite=False))
    loaded = {"w": torch.full((3,), 9.0)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=4))
    assert torch.equal(loaded["w"], torch.ones(3))


@pytest.mark.parametrize("url", ["abc://bucket/ckpt", "gs://bucket/ckpt", "hf://org/model", "s3://bucket/ckpt"])
def test_the_writer_declines_urls_it_cannot_write(url: str) -> None:
    assert not CkptdStorageWriter.validate_checkpoint_id(url)
    assert not CkptdStorageWriter.validate_checkpoint_id(f"{url}/{step_dir(3)}")


def test_the_reader_accepts_paths_and_registered_schemes_only(tmp_path: Path) -> None:
    for url in ("abc://bucket/ckpt", "gs://bucket/ckpt", "hf://org/model", ""):
        assert not CkptdStorageReader.validate_checkpoint_id(url), url
    assert CkptdStorageReader.validate_checkpoint_id("s3://bucket/ckpt"), "ckptd registers s3"
    assert CkptdStorageReader.validate_checkpoint_id(str(tmp_path / "ckpt"))
    assert CkptdStorageReader.validate_checkpoint_id(f"file://{tmp_path}/ckpt/{step_dir(2)}")
    assert CkptdStorageWriter.validate_checkpoint_id(str(tmp_path / "new" / "ckpt"))
    assert CkptdStorageWriter.validate_checkpoint_id(tmp_path)
    (tmp_path / "a-file").write_bytes(b"x")
    assert not CkptdStorageWriter.validate_checkpoint_id(str(tmp_path / "a-file"))

    register_tier("gs", LocalTier)  # a plugin registering the scheme
    try:
        assert CkptdStorageReader.validate_checkpoint_id("gs://bucket/ckpt")
        assert not CkptdStorageWriter.validate_checkpoint_id("gs://bucket/ckpt"), "the writer writes files only"
    finally:
        unregister_tier("gs")
    assert not CkptdStorageReader.validate_checkpoint_id("gs://bucket/ckpt")


def test_dcp_auto_detection_picks_file_system_storage_and_ckptd_only_where_swapped_in(tmp_path: Path) -> None:
    from harness import dcp_swap

    plain = tmp_path / "plain"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(plain))
    assert (plain / ".metadata").exists() and not list(plain.glob("step-*")), "DCP's own FileSystemWriter"

    originals = dcp_swap.swap()
    try:
        swapped = tmp_path / "swapped"
        dcp.save({"w": torch.full((2,), 3.0)}, checkpoint_id=str(swapped))
        assert (swapped / step_dir(0) / MANIFEST_NAME).exists(), "ckptd, registered in FileSystemWriter's place"
        loaded = {"w": torch.zeros(2)}
        dcp.load(loaded, checkpoint_id=str(swapped))
        assert torch.equal(loaded["w"], torch.full((2,), 3.0))
        from torch.distributed.checkpoint._storage_utils import _storage_setup

        with pytest.raises(RuntimeError, match="Cannot detect which StorageReader or StorageWriter"):
            dcp.save({"w": torch.ones(2)}, checkpoint_id="abc://bucket/ckpt")  # before: "Protocol not known"
        for url in ("abc://bucket/ckpt", "gs://bucket/ckpt", "hf://org/model"):
            for reader in (False, True):
                try:
                    chosen = _storage_setup(None, url, reader=reader)
                except (RuntimeError, ImportError) as error:  # fsspec has no (installed) file system for it
                    assert "Cannot detect" in str(error) or "install" in str(error).lower()
                    continue
                assert not isinstance(chosen, (CkptdStorageWriter, CkptdStorageReader)), (url, chosen)
                assert type(chosen).__name__.startswith("Fsspec"), (url, chosen)
    finally:
        import importlib

        for name, (writer, reader) in originals.items():
            module = importlib.import_module(name)
            if writer is not None:
                module.FileSystemWriter = writer
            if reader is not None:
                module.FileSystemReader = reader


STEP, LATER = 3, 9


def _state(rank: int, fill: float) -> dict[str, Any]:
    return {"shared": torch.full((4,), fill), f"rank{rank}": torch.arange(6.0) + 10 * rank + fill,
            "meta": {"fill": fill}}


def _without_collectives(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dcp.save(_state(rank, 1.0), storage_writer=CkptdStorageWriter(root, step=STEP), use_collectives=False)
    tier = LocalTier(root)
    out["committed_after_save"] = tier.is_committed(STEP)
    for collectives in (True, False):  # dcp.load decides collectives itself; a plain reader on each rank too
        state = _state(rank, 0.0)
        if collectives:
            dcp.load(state, storage_reader=CkptdStorageReader(root, step=STEP))
        else:
            dcp.load(state, storage_reader=CkptdStorageReader(root, step=STEP), no_dist=True)
        out[f"equal_{collectives}"] = all(torch.equal(state[k], v) for k, v in _state(rank, 1.0).items()
                                          if isinstance(v, torch.Tensor)) and state["meta"] == {"fill": 1.0}
    try:
        dcp.save(_state(rank, 2.0), storage_writer=CkptdStorageWriter(root), use_collectives=False)
    except ConfigError as error:
        out["no_step"] = str(error)

    # A partial step: rank 1 has not saved its part yet (it only joins DCP's closing barrier).
    if rank == 0:
        dcp.save(_state(rank, 5.0), storage_writer=CkptdStorageWriter(root, step=LATER), use_collectives=False)
    else:
        dist.barrier()
    dist.barrier()
    try:
        CkptdStorageReader(root, step=LATER).read_metadata()
    except PartialStepError as error:
        out["partial"] = str(error)
    try:
        dcp.load(_state(rank, 0.0), storage_reader=CkptdStorageReader(root, step=LATER))
    except BaseException as error:  # DCP wraps the reader's error in a CheckpointException
        out["partial_load"] = str(error)
    newest = _state(rank, 0.0)
    dcp.load(newest, storage_reader=CkptdStorageReader(root))
    out["newest_is_the_committed_step"] = torch.equal(newest["shared"], torch.full((4,), 1.0))
    dist.barrier()
    # Rank 1 writes its part: the step is committed by whichever rank finds every part.
    if rank == 1:
        dcp.save(_state(rank, 5.0), storage_writer=CkptdStorageWriter(root, step=LATER), use_collectives=False)
    else:
        dist.barrier()
    state = _state(rank, 0.0)
    dcp.load(state, storage_reader=CkptdStorageReader(root, step=LATER))
    out["later_equal"] = all(torch.equal(state[k], v) for k, v in _state(rank, 5.0).items()
                             if isinstance(v, torch.Tensor))
    return out


@pytest.mark.multirank
def test_use_collectives_false_on_two_gloo_ranks_round_trips_and_refuses_a_partial_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_multirank(_without_collectives, 2, str(root), timeout_s=150)
    for rank, out in enumerate(results):
        assert out["committed_after_save"], f"rank {rank}: the step is committed when dcp.save returns"
        assert out["equal_True"] and out["equal_False"], f"rank {rank}: round trip"
        assert "use_collectives=False" in out["no_step"] and "step" in out["no_step"]
        assert "step 9" in out["partial"] and "ranks [1] of 2" in out["partial"] and "present: [0]" in out["partial"]
        assert "step 9" in out["partial_load"] and "ranks [1] of 2" in out["partial_load"]
        assert out["newest_is_the_committed_step"], "a load of the root skips the partial step"
        assert out["later_equal"], f"rank {rank}: the step committed once rank 1 wrote its part"
    tier = LocalTier(root)
    assert tier.committed_steps() == [STEP, LATER]
    manifest = (root / step_dir(LATER) / MANIFEST_NAME).read_bytes()
    assert b'"world_size": 2' in manifest or b'"world_size":2' in manifest
    assert (root / step_dir(LATER) / part_name(0)).exists() and (root / step_dir(LATER) / part_name(1)).exists()
    # `ckptd inspect` shows the bytes each rank wrote (both ranks wrote "shared" and their own tensor).
    from click.testing import CliRunner

    from ckptd.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", str(root), "--step", str(LATER), "--json"])
    assert shown.exit_code == 0, shown.output
    per_rank = json.loads(shown.output)["bytes_per_rank"]
    expected = [sum(t.numel() * t.element_size() for t in _state(rank, 5.0).values() if isinstance(t, torch.Tensor))
                for rank in (0, 1)]
    assert [row["tensor_bytes"] for row in per_rank["ranks"]] == expected
    assert [row["rank"] for row in per_rank["ranks"]] == [0, 1] and all(r["data_bytes"] > 0 for r in per_rank["ranks"])
    text = CliRunner().invoke(cli, ["inspect", str(root), "--step", str(LATER)])
    assert text.exit_code == 0 and "bytes per rank:" in text.output
    assert f"busiest rank {per_rank['busiest_rank']} writes {per_rank['busiest_over_mean']:.3f}x the mean" in text.output


STALE, STALE_INDEX = 5, 6
OLD_FILL, NEW_FILL = 7.0, 8.0


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


class _SteppedWriter(CkptdStorageWriter):
    """A writer whose save signals and waits on files at chosen points, to order two ranks' saves."""

    def __init__(self, root: str, step: int, hooks: dict[str, Any]) -> None:
        super().__init__(root, step=step)
        self.hooks = hooks

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.hooks.get("after_set_up", lambda: None)()

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.hooks.get("before_write", lambda: None)()
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        self.hooks.get("before_finish", lambda: None)()
        super().finish(metadata, results)
        self.hooks.get("after_finish", lambda: None)()


def _new_content_restored(rank: int, root: str, step: int) -> bool:
    ok = True
    for no_dist in (False, True):
        state = _state(rank, 0.0)
        dcp.load(state, storage_reader=CkptdStorageReader(root, step=step), no_dist=no_dist)
        ok = ok and all(torch.equal(state[k], v) for k, v in _state(rank, NEW_FILL).items()
                        if isinstance(v, torch.Tensor)) and state["meta"] == {"fill": NEW_FILL}
    return ok


def _stale_part_of_an_earlier_attempt(rank: int, world_size: int, root: str, sync: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    signals, tier = Path(sync), LocalTier(root)
    for step in (STALE, STALE_INDEX):
        # An earlier attempt at the step: rank 1 wrote its part (old content), rank 0 crashed before its own.
        if rank == 1:
            dcp.save(_state(rank, OLD_FILL), storage_writer=CkptdStorageWriter(root, step=step),
                     use_collectives=False)
        else:
            dist.barrier()  # rank 1's save ends in DCP's barrier
        dist.barrier()
        out[f"{step}_committed_before"] = tier.is_committed(step)

    # The job restarts and saves step STALE again on every rank. Rank 1 sets its save up, then waits until
    # rank 0 has finished its whole save: rank 0 must not commit rank 1's stale part.
    def rank0_finished() -> None:
        out["rank0_committed"] = tier.is_committed(STALE)
        (signals / "r0-finished").touch()

    hooks = ({"after_finish": rank0_finished} if rank == 0 else
             {"after_set_up": lambda: (signals / "r1-set-up").touch(),
              "before_write": lambda: _wait_for(signals / "r0-finished")})
    if rank == 0:
        _wait_for(signals / "r1-set-up")
    dcp.save(_state(rank, NEW_FILL), storage_writer=_SteppedWriter(root, STALE, hooks), use_collectives=False)
    dist.barrier()
    out["stale_restored_new"] = _new_content_restored(rank, root, STALE)

    # Step STALE_INDEX: rank 1's stale part is in place while its new index is already written (a part
    # record no set-up deleted): its recorded index digest no longer matches the file, so rank 0 does not
    # commit it; rank 1 commits once its new part is written.
    stale_part = tier.root / step_dir(STALE_INDEX) / part_name(1)
    old_bytes = stale_part.read_bytes()
    dist.barrier()

    def rank0_finished_index() -> None:
        out["rank0_committed_index"] = tier.is_committed(STALE_INDEX)
        (signals / "r0-finished-index").touch()

    def rank1_stale_part_back() -> None:
        stale_part.write_bytes(old_bytes)
        (signals / "r1-index-written").touch()
        _wait_for(signals / "r0-finished-index")

    hooks = ({"after_finish": rank0_finished_index} if rank == 0 else {"before_finish": rank1_stale_part_back})
    if rank == 0:
        _wait_for(signals / "r1-index-written")
    dcp.save(_state(rank, NEW_FILL), storage_writer=_SteppedWriter(root, STALE_INDEX, hooks),
             use_collectives=False)
    dist.barrier()
    out["index_restored_new"] = _new_content_restored(rank, root, STALE_INDEX)

    # A committed step is never written again: a save of it fails on set-up, before writing anything.
    try:
        dcp.save(_state(rank, OLD_FILL), storage_writer=CkptdStorageWriter(root, step=STALE), use_collectives=False)
    except BaseException as error:
        out["again"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    out["still_new"] = _new_content_restored(rank, root, STALE)
    return out


@pytest.mark.multirank
def test_use_collectives_false_never_commits_a_part_left_by_an_earlier_attempt(tmp_path: Path) -> None:
    root, sync = tmp_path / "ckpt", tmp_path / "sync"
    sync.mkdir()
    results = run_multirank(_stale_part_of_an_earlier_attempt, 2, str(root), str(sync), timeout_s=150)
    for rank, out in enumerate(results):
        assert not out[f"{STALE}_committed_before"] and not out[f"{STALE_INDEX}_committed_before"]
        assert out["stale_restored_new"], f"rank {rank}: step {STALE} holds exactly the new save on both ranks"
        assert out["index_restored_new"], f"rank {rank}: step {STALE_INDEX} holds exactly the new save"
        assert "AlreadyCommittedError" in out["again"] and "never rewritten" in out["again"], out["again"]
        assert out["still_new"]
    assert results[0]["rank0_committed"] is False, "rank 0 did not commit rank 1's part of the earlier attempt"
    assert results[0]["rank0_committed_index"] is False, "nor a part whose index file has changed"
    assert LocalTier(root).committed_steps() == [STALE, STALE_INDEX]
