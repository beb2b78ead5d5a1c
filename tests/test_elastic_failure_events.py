"""How the supervisor counts failures towards ``--crash-loop``: ranks dying together are one event, even
when it finds them in several rounds (a process that never reached the current generation died with the
failure that raised it), while replacements that keep dying before completing a step are counted each
time and stop the job. The supervisor's recovery runs against a real c10d store; restarts wait out their
back-off, so no process is started."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptd.elastic import keys
from ckptd.elastic.supervisor import LaunchSpec, Supervisor
from ckptd.errors import CrashLoopError


def _supervisor(world_size: int = 3) -> Supervisor:
    spec = LaunchSpec(command=("train.py",), nproc_per_node=world_size, crash_loop=3, restart_backoff_s=1.0,
                      max_restarts=10)
    supervisor = Supervisor(spec)
    supervisor.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5),
                                     wait_for_workers=False)
    supervisor.store.set(keys.GENERATION, "0")
    for rank in range(world_size):
        supervisor.store.set(keys.beat(rank), keys.NO_BEAT)
        supervisor.store.set(keys.alive(rank), keys.NOT_ALIVE_YET)
    supervisor._aware = set(range(world_size))  # every rank runs ckptd.elastic.run: failed ranks restart alone
    return supervisor


def _fails(supervisor: Supervisor, rank: int, started_in: int) -> None:
    """The process of ``rank`` started in generation ``started_in`` exits; the supervisor finds it."""
    failed = supervisor.ranks[rank]
    failed.generation, failed.process = started_in, None
    supervisor._recover([(failed, "exited with code 1")])


def _count(supervisor: Supervisor) -> int:
    return int(supervisor.store.add(keys.CRASH_LOOP, 0))


def test_ranks_dying_together_found_in_two_rounds_are_one_failure(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = _supervisor()
    with caplog.at_level(logging.WARNING, logger="ckptd.elastic"):
        _fails(supervisor, 1, started_in=0)
        assert (_count(supervisor), supervisor.generation) == (1, 1)
        _fails(supervisor, 2, started_in=0)  # found a round later, after the generation went up
    assert (_count(supervisor), supervisor.generation) == (1, 2), "the second death was counted as a new failure"
    assert "rank 2 (pid None) exited with code 1 in generation 0" in caplog.text
    assert all(rank.start_at is not None for rank in supervisor.ranks[1:]), "restarts wait out their back-off"


def test_replacements_that_keep_dying_are_a_crash_loop_even_when_their_failures_overlap() -> None:
    supervisor = _supervisor()
    _fails(supervisor, 1, started_in=0)
    _fails(supervisor, 2, started_in=0)
    _fails(supervisor, 1, started_in=1)  # rank 1's replacement dies while the job is in generation 2
    assert _count(supervisor) == 2
    with pytest.raises(CrashLoopError, match="rank 2 exited with code 1 in generation 2"):
        _fails(supervisor, 2, started_in=2)
    assert _count(supervisor) == 3


def test_a_completed_step_between_failures_ends_the_count() -> None:
    supervisor = _supervisor()
    _fails(supervisor, 1, started_in=0)
    supervisor.store.set(keys.beat(0), "1:5:9:4")  # rank 0 completed step 4 in generation 1
    _fails(supervisor, 1, started_in=1)
    assert _count(supervisor) == 0


def test_one_failure_found_by_two_supervisors_at_once_is_counted_once() -> None:
    first = _supervisor()
    second = Supervisor(first.spec)
    second.store = dist.TCPStore("127.0.0.1", first.store.port, None, False, timeout=timedelta(seconds=5))
    # the other supervisor claimed generation 0 and has not yet raised the newest counted generation: the
    # claim alone decides, this supervisor's failure of generation 0 is the same event
    assert second.store.add(f"{keys.CRASH_LOOP_CHARGED}/0", 1) == 1
    assert first._charge(0) is False
    assert [second._charge(1), first._charge(1), first._charge(0)] == [True, False, False]
    assert first.store.get(keys.CRASH_LOOP_CHARGED) == b"1"
