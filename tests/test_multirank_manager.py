"""CheckpointManager on real gloo process groups: bit-for-bit round trips at world sizes 2 and 4,
a failed write on one rank failing the step everywhere, restore agreement, and no collectives issued
from background threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd.errors import StorageError, WorkerError
from ckptd.format.layout import rank_data_name, step_dir
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank


def _rank_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step_info": {"rank": rank, "loss": 0.5 + rank},
            "buffer": torch.arange(10, dtype=torch.int32) * (rank + 1)}


def _tensor_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    out = {f"model.{k}": v.detach().numpy().tobytes() for k, v in state["model"].state_dict().items()}
    for pid, moments in state["optim"].state_dict()["state"].items():
        for key, value in moments.items():
            out[f"optim.{pid}.{key}"] = value.numpy().tobytes()
    out["buffer"] = state["buffer"].numpy().tobytes()
    return out


def _round_trip(rank: int, world_size: int, root: str) -> bool:
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(keep_local=None))
    state = _rank_state(rank)
    assert manager.save(1, state)
    expected = _tensor_bytes(state)
    expected_draw = torch.rand(3)  # the RNG stream right after the save
    with torch.no_grad():  # the state may change as soon as save returns
        for p in state["model"].parameters():
            p.add_(1.0)
    state["buffer"].zero_()
    manager.wait()
    manager.close()

    fresh = _rank_state(world_size + 7)  # different values everywhere
    fresh["step_info"] = {}
    restorer = ckptd.CheckpointManager(root)
    assert restorer.restore(fresh) == 1
    restorer.close()
    assert _tensor_bytes(fresh) == expected
    assert fresh["step_info"] == {"rank": rank, "loss": 0.5 + rank}
    assert torch.equal(torch.rand(3), expected_draw)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_save_and_restore_bit_for_bit(tmp_path: Path, world_size: int) -> None:
    assert run_multirank(_round_trip, world_size, str(tmp_path), timeout_s=120) == [True] * world_size


_COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "gather_object",
                "broadcast_object_list", "scatter_object_list", "reduce_scatter", "gather", "scatter",
                "all_to_all", "send", "recv", "monitored_barrier", "reduce")


def _watch_collectives() -> list[str]:
    """Wrap every collective so that a call from a thread other than the main one is recorded."""
    offenders: list[str] = []
    for name in _COLLECTIVES:
        for module in (dist, dist.distributed_c10d):
            original = getattr(module, name, None)
            if original is None or getattr(original, "_ckptd_watched", False):
                continue

            def watched(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
                if threading.current_thread() is not threading.main_thread():
                    offenders.append(f"{__name} from {threading.current_thread().name}")
                return __original(*args, **kwargs)

            watched._ckptd_watched = True  # type: ignore[attr-defined]
            setattr(module, name, watched)
    return offenders


def _failure_then_recovery(rank: int, world_size: int, root: str) -> dict[str, Any]:
    offenders = _watch_collectives()
    # the detector itself works: a collective from a helper thread is recorded
    probe = threading.Thread(target=dist.barrier, name="probe")
    probe.start()
    probe.join()
    assert offenders == ["barrier from probe"], offenders
    offenders.clear()

    from ckptd.stepio import rank_writer

    original_add = rank_writer.RankWriter.add

    def failing_add(self: Any, name: str, tensor: torch.Tensor) -> Any:
        if self.rank == 1 and self.step == 2:
            raise StorageError("injected write failure", path=f"{step_dir(2)}/{rank_data_name(1)}", step=2,
                               tier="local")
        return original_add(self, name, tensor)

    rank_writer.RankWriter.add = failing_add  # type: ignore[method-assign]
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(keep_local=None))
    state = _rank_state(rank)
    outcome: dict[str, Any] = {}
    for step in (1, 2, 3):
        manager.save(step, state)
        tensor = torch.ones(4) * (rank + 1)
        dist.all_reduce(tensor)  # training collectives keep running on the main thread
        try:
            manager.wait()
        except WorkerError as error:
            outcome[f"error{step}"] = str(error)
    outcome["committed"] = manager.committed_steps()
    manager.close()
    outcome["offenders"] = list(offenders)
    return outcome


def test_failed_write_on_one_rank_fails_the_step_everywhere_and_next_step_works(tmp_path: Path) -> None:
    outcomes = run_multirank(_failure_then_recovery, 2, str(tmp_path), timeout_s=120)
    for outcome in outcomes:
        assert set(outcome) == {"error2", "committed", "offenders"}
        assert "rank 1" in outcome["error2"] and rank_data_name(1) in outcome["error2"]
        assert "step 2" in outcome["error2"]
        assert outcome["committed"] == [1, 3]
        assert outcome["offenders"] == []
    assert not (tmp_path / step_dir(2) / "manifest.json").exists()


def _agree_on_older_step(rank: int, world_size: int, root: str) -> tuple[int | None, list[str]]:
    own = f"{root}/node{rank}"  # node-local directories
    manager = ckptd.CheckpointManager(own, policy=ckptd.Policy(keep_local=None), capture_rng=False)
    state = {"w": torch.full((64,), float(rank))}
    for step in (1, 2):
        state["w"].fill_(step * 10 + rank)
        manager.save(step, state)
        manager.wait()
    manager.close()
    if rank == 1:  # corrupt one byte of rank 1's data for step 2
        data = Path(own) / step_dir(2) / rank_data_name(1)
        raw = bytearray(data.read_bytes())
        raw[3] ^= 0x40
        data.write_bytes(bytes(raw))
    restorer = ckptd.CheckpointManager(own, capture_rng=False)
    state["w"].zero_()
    step = restorer.restore(state)
    skipped = restorer.last_restore.skipped if restorer.last_restore else []
    restorer.close()
    assert torch.equal(state["w"], torch.full((64,), float(10 + rank)))
    return step, skipped


def test_ranks_agree_on_the_newest_step_intact_everywhere(tmp_path: Path) -> None:
    results = run_multirank(_agree_on_older_step, 2, str(tmp_path), timeout_s=120)
    assert [step for step, _ in results] == [1, 1]
    for _, skipped in results:
        assert any("step 2 on rank 1" in why and "digest" in why for why in skipped)


def _busy_rank_skips(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from ckptd.stepio import rank_writer

    release = threading.Event()
    original_add = rank_writer.RankWriter.add

    def slow_add(self: Any, name: str, tensor: torch.Tensor) -> Any:
        if self.rank == 1 and self.step == 1:
            release.wait(60)  # rank 1 is still writing step 1 when step 2 is requested
        return original_add(self, name, tensor)

    rank_writer.RankWriter.add = slow_add  # type: ignore[method-assign]
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(on_busy="skip", keep_local=None),
                                      capture_rng=False)
    state = {"w": torch.full((32,), float(rank))}
    saved = [manager.save(1, state), manager.save(2, state)]
    release.set()
    manager.wait()
    saved.append(manager.save(3, state))
    manager.wait()
    outcome = {"saved": saved, "committed": manager.committed_steps(), "skipped": list(manager._saver.skipped)}
    manager.close()
    return outcome


def test_a_busy_rank_skips_the_step_on_every_rank_without_an_error(tmp_path: Path) -> None:
    outcomes = run_multirank(_busy_rank_skips, 2, str(tmp_path), timeout_s=120)
    assert outcomes[1]["saved"] == [True, False, True] and outcomes[1]["skipped"] == [2]
    for outcome in outcomes:
        assert outcome["committed"] == [1, 3]
    assert not (tmp_path / step_dir(2) / "manifest.json").exists()
