"""``ckptd launch --spares N``: a warm spare (torch imported, the script's setup_fn run) takes the place of a
SIGKILLed rank; its process becomes the rank's, the survivor stays in its process, a new spare starts, and
the job ends with the weights, optimizer state and sample ids of an uninterrupted run, byte for byte.

Real ``ckptd launch`` runs of the 2-rank gloo test job (:mod:`harness.elastic_training`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harness.elastic_runs import finals, generations, launch_job

pytestmark = pytest.mark.multirank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(elastic_reference: list[bytes]) -> list[bytes]:
    return elastic_reference


def test_a_killed_rank_is_recovered_through_a_warm_spare_bit_for_bit(tmp_path: Path, reference: list[bytes]) -> None:
    result = launch_job(tmp_path / "run", "--kill-rank", "1", "--kill-step", "7", "--kill-phase", "before-step",
                        "--kill-when-spare-ready", extra=("--spares", "1"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "run" / "out"
    assert finals(out) == reference, "the run recovered through a spare differs"

    spares = [json.loads(path.read_text())["pid"] for path in out.glob("spare-*.json")]
    survivor, victim = generations(out, 0), generations(out, 1)
    assert sorted(victim) == [0, 1] and sorted(survivor) == [0, 1]
    assert survivor[1]["pid"] == survivor[0]["pid"], "the survivor was restarted"
    assert victim[1]["pid"] in spares and victim[1]["pid"] != victim[0]["pid"], (victim, spares)
    assert victim[1]["restart_count"] == 1 and victim[1]["restored"] == 6, victim[1]
    assert f"handed rank 1 to warm spare 0 (pid {victim[1]['pid']}) in generation 1" in result.stderr
    assert f"started rank 1 (pid {victim[1]['pid']})" not in result.stderr, "no new process for the rank"
    # a new spare replaces the one used; the supervisor stops it when the job ends
    started = [int(pid) for pid in re.findall(r"started warm spare 1 \(pid (\d+)\)", result.stderr)]
    assert len(started) == 1 and not _alive(started[0]), result.stderr[-4000:]


@pytest.mark.slow
def test_on_two_nodes_a_failure_on_node_1_is_taken_by_node_1s_spare(tmp_path: Path, reference: list[bytes]) -> None:
    # two supervisors (one rank each), --spares 1 on both: rank 1 (node 1) dies once node 1's spare is ready
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "7", "--kill-phase", "before-step",
                        "--kill-when-spare-ready", nodes=2, extra=("--spares", "1"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the two-node run recovered through a spare differs"
    spares = {json.loads(path.read_text())["pid"]: json.loads(path.read_text())["node"]
              for path in out.glob("spare-*.json")}
    survivor, victim = generations(out, 0), generations(out, 1)
    assert sorted(victim) == [0, 1] and survivor[1]["pid"] == survivor[0]["pid"], "the survivor was restarted"
    assert spares.get(victim[1]["pid"]) == 1, f"rank 1 was not given to node 1's spare: {victim}, {spares}"
    assert victim[1]["restart_count"] == 1 and victim[1]["restored"] == 6, victim[1]
    assert f"handed rank 1 to warm spare 0 (pid {victim[1]['pid']}) in generation 1" in result.stderr
    # node 0's spare is still the first one it started: nothing was handed to it
    assert "handed rank 0" not in result.stderr and "started warm spare 1" in result.stderr
    assert len(re.findall(r"started warm spare 0 \(pid \d+\) on node 0", result.stderr)) == 1
