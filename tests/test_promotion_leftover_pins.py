"""Steps an earlier run left pinned on only some ranks (a lost node's root held the others) are settled by the
ranks of the new run, and every manager's close() returns instead of waiting for a share nobody holds.

Two real gloo ranks, each with its own local root, promote in-process to one shared S3 prefix (moto's server).
An earlier run committed steps 1..6 locally; its uploaders died with these pins left (the real
:class:`~ckptd.promotion.pinning.PinnedSteps`), and some shares reached S3 before that:

- step 1 (the oldest): pinned on rank 0 only, rank 1's share lost -> rank 0 releases its pin with a warning
  naming the step, and the committed local step stays (before the fix rank 0 promoted it first and waited in
  close() for rank 1's share, and rank 1 for rank 0's next decision);
- step 2: pinned on both ranks -> both promote it, rank 0 commits;
- step 4: pinned on rank 0 only, rank 1's share promoted by the earlier run -> rank 0 completes it alone;
- step 5: pinned on rank 1 only, rank 0's share promoted by the earlier run -> rank 1 commits it.

A fresh 2-rank manager pair then saves steps 7 and 8, promotes and closes within its deadline; every step
committed on S3 restores, from S3 alone, to the bytes saved. Two smaller tests: a committing share whose
peer never promotes gives up at its deadline naming the rank, and a mangled GC lease stops a promotion at
its deadline instead of holding it for ever.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.config import override
from ckptd.errors import DeadlineError
from ckptd.format.layout import MANIFEST_NAME, rank_files, step_file
from ckptd.promotion.lease import LEASE_PATH, wait_for_collector
from ckptd.promotion.pinning import PIN_DIRECTORY, PinnedSteps
from ckptd.promotion.promoter import Promoter
from ckptd.stepio.step_reader import verify_step
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier
from test_multirank_manager import _rank_state, _tensor_bytes
from test_promotion_support import object_tier

pytestmark = [pytest.mark.multirank, pytest.mark.s3]
CLOSE_TIMEOUT_S = 60.0
PINNED = {0: (1, 2, 4), 1: (2, 5)}


def _advance(state: dict[str, Any], rank: int, step: int) -> None:
    with torch.no_grad():
        for parameter in state["model"].parameters():
            parameter.add_(0.125 * (rank + 1))
    state["buffer"].add_(step)
    state["step_info"] = {"rank": rank, "step": step}


def _earlier_run(rank: int, world_size: int, base: str) -> dict[int, dict[str, bytes]]:
    state = _rank_state(rank)
    saved: dict[int, dict[str, bytes]] = {}
    with ckptd.CheckpointManager(Path(base) / f"node{rank}", policy=ckptd.Policy(keep_local=None),
                                 capture_rng=False) as manager:
        for step in range(1, 7):
            _advance(state, rank, step)
            assert manager.save(step, state)
            saved[step] = _tensor_bytes(state)
    return saved


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _new_run(rank: int, world_size: int, base: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("ckptd").addHandler(warnings)
    state = _rank_state(rank)
    local = Path(base) / f"node{rank}"
    manager = ckptd.CheckpointManager(local, remote=url, storage_options=options, capture_rng=False,
                                      policy=ckptd.Policy(keep_local=None, remote_every_steps=1))
    uploader = manager.uploader
    assert uploader is not None
    saved: dict[int, dict[str, bytes]] = {}
    for step in (7, 8):
        _advance(state, rank, step)
        assert manager.save(step, state)
        saved[step] = _tensor_bytes(state)
    error = None
    try:
        manager.close(timeout_s=CLOSE_TIMEOUT_S)
    except ckptd.CkptdError as failure:
        error = f"{type(failure).__name__}: {failure}"
    return {"saved": saved, "error": error, "released": list(uploader.released),
            "promoted": [report.step for report in uploader.reports], "warnings": warnings.messages,
            "pins_left": LocalTier(local / PIN_DIRECTORY).list_step_numbers(),
            "local_steps": LocalTier(local).committed_steps()}


def _restore(rank: int, world_size: int, base: str, url: str, options: dict[str, Any],
             steps: list[int]) -> dict[int, dict[str, bytes]]:
    restored: dict[int, dict[str, bytes]] = {}
    with ckptd.CheckpointManager(Path(base) / f"empty{rank}", remote=url, storage_options=options,
                                 capture_rng=False, policy=ckptd.Policy(keep_local=None)) as manager:
        for step in steps:
            fresh = _rank_state(world_size + 7)
            fresh["step_info"] = {}
            assert manager.restore(fresh, step) == step
            assert manager.last_restore is not None and manager.last_restore.tier.startswith("object"), step
            assert fresh["step_info"] == {"rank": rank, "step": step}
            restored[step] = _tensor_bytes(fresh)
    return restored


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[int, dict[str, bytes]]]]:
    """Two ranks' local roots (``node0``, ``node1``) holding committed steps 1..6, and the bytes saved."""
    base = tmp_path_factory.mktemp("earlier")
    return base, run_multirank(_earlier_run, 2, str(base), timeout_s=120)


def test_leftover_pins_held_by_some_ranks_are_settled_and_close_returns(
        earlier_run: tuple[Path, list[dict[int, dict[str, bytes]]]], s3_bucket: str,
        s3_options: dict[str, Any]) -> None:
    tmp_path, earlier = earlier_run
    remote = object_tier(s3_bucket, s3_options, prefix="shared")
    url = f"s3://{s3_bucket}/shared"
    roots = [LocalTier(tmp_path / f"node{rank}") for rank in (0, 1)]
    for rank, steps in PINNED.items():  # what each earlier uploader had pinned when it died
        pins = PinnedSteps(roots[rank])
        for step in steps:
            pins.pin(step, rank_files(roots[rank].list_files(step), rank) + [MANIFEST_NAME])
    # shares the earlier run promoted before it died: rank 1's of step 4, rank 0's of step 5
    Promoter(roots[1], remote).promote(4, ranks=[1])
    Promoter(roots[0], remote).promote(5, ranks=[0], commits=False)
    assert remote.committed_steps() == []

    results = run_multirank(_new_run, 2, str(tmp_path), url, s3_options, timeout_s=3 * CLOSE_TIMEOUT_S)

    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}'s close failed: {result['error']}"
        assert result["pins_left"] == [], f"rank {rank} left pins behind"
        assert 1 in result["local_steps"], f"rank {rank}: releasing a pin never deletes the committed local step"
    assert 1 in results[0]["released"] and 1 not in results[0]["promoted"]
    assert any("step 1," in message and "rank(s) 1" in message and "not promoted" in message
               for message in results[0]["warnings"]), results[0]["warnings"]
    assert {2, 4} <= set(results[0]["promoted"]) and {2, 5} <= set(results[1]["promoted"])
    committed = remote.committed_steps()
    assert 1 not in committed and {2, 4, 5, 8} <= set(committed), committed
    for step in committed:
        assert list(verify_step(remote, step)) == [], f"remote step {step} does not verify"

    steps = sorted(set(committed) & {2, 4, 5, 8})
    restored = run_multirank(_restore, 2, str(tmp_path), url, s3_options, steps, timeout_s=120)
    for rank in (0, 1):
        saved = earlier[rank] | results[rank]["saved"]
        for step in steps:
            assert restored[rank][step] == saved[step], f"rank {rank}: S3's step {step} is not the bytes saved"


def test_the_committing_share_gives_up_at_its_deadline_naming_the_rank_that_never_promoted(
        earlier_run: tuple[Path, list[dict[int, dict[str, bytes]]]], s3_bucket: str,
        s3_options: dict[str, Any]) -> None:
    remote = object_tier(s3_bucket, s3_options, prefix="alone")
    promoter = Promoter(LocalTier(earlier_run[0] / "node0"), remote)
    give_up_at = time.monotonic() + 1.0
    promoter.give_up_at = lambda: give_up_at
    with pytest.raises(DeadlineError, match=r"rank\(s\) 1 did not promote their share before this uploader closed"):
        promoter.promote(3, ranks=[0])
    assert remote.exists(step_file(3, "rank-00000.promoted")), "rank 0's own share was uploaded"
    assert remote.committed_steps() == [], "nothing is committed without rank 1's share"


def test_a_mangled_gc_lease_stops_a_promotion_at_its_deadline(s3_bucket: str, s3_options: dict[str, Any]) -> None:
    remote = object_tier(s3_bucket, s3_options, prefix="leased")
    remote.write_bytes(LEASE_PATH, b"not a lease")
    with override(gc_lease_s=1.0), pytest.raises(DeadlineError, match="lease stayed fresh"):
        wait_for_collector(remote)
    assert remote.read_bytes(LEASE_PATH) == b"not a lease", "the lease is the operator's to delete"
