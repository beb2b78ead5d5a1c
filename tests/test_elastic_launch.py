"""``ckptd launch`` restarts only the rank that failed; the others rejoin in-process and the job ends with the
weights, optimizer state and sample ids of an uninterrupted run, byte for byte.

Every run is a real ``ckptd launch`` subprocess with 2 gloo ranks (:mod:`harness.elastic_training`), or
two supervisors of one rank each standing in for two nodes; the failed rank really gets SIGKILL, or SIGSTOP
(a hang the supervisor finds by its heartbeat and kills).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from harness.elastic_runs import WORLD, finals, generations, launch_job

pytestmark = pytest.mark.multirank

@pytest.fixture(scope="module")
def reference(elastic_reference: list[bytes]) -> list[bytes]:
    return elastic_reference


def _scenario(seed: int, rank: int, signal_name: str, phase: str | None) -> list[str]:
    chooser = random.Random(seed)
    step, chosen = chooser.randint(5, 10), chooser.choice(["before-save", "after-save"])
    return ["--kill-rank", str(rank), "--kill-step", str(step), "--kill-signal", signal_name,
            "--kill-phase", phase or chosen]


@pytest.mark.parametrize(("seed", "victim", "signal_name", "nodes", "phase"), [
    (1, 1, "KILL", 1, None),
    pytest.param(5, 1, "KILL", 2, None, marks=pytest.mark.slow),  # two supervisors ("nodes") meeting through node 0's store
    # rank 0 (it decides the commits) dies once its newest save is committed: the survivor restores that step
    # from memory (the staged copy of its own last save), the replacement from its local directory
    (7, 0, "KILL", 1, "after-commit"),
    (4, 1, "STOP", 1, None),   # a hang: found by the heartbeat timeout, killed, replaced
], ids=["sigkill-rank1-seed1", "sigkill-rank1-seed5-two-nodes", "sigkill-rank0-after-commit", "sigstop-hang-rank1"])
def test_only_the_failed_rank_restarts_and_the_run_ends_bit_for_bit(tmp_path: Path, reference: list[bytes], seed: int,
                                                                     victim: int, signal_name: str, nodes: int,
                                                                     phase: str | None) -> None:
    job = _scenario(seed, victim, signal_name, phase)
    result = launch_job(tmp_path, *job, hang_timeout=4.0 if signal_name == "STOP" else 60.0, nodes=nodes)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, f"the recovered run differs from the uninterrupted one ({job})"

    kill_step = int(job[3])
    records = {rank: generations(out, rank) for rank in range(WORLD)}
    for rank, by_generation in records.items():
        assert sorted(by_generation) == [0, 1], f"rank {rank} joined generations {sorted(by_generation)}"
        first, second = by_generation[0], by_generation[1]
        assert first["restored"] is None
        if rank == victim:
            assert second["pid"] != first["pid"] and second["restart_count"] == 1 and second["rejoined"] == 0
        else:
            assert second["pid"] == first["pid"], f"survivor rank {rank} was restarted"
            assert second["rejoined"] == 1 and second["restart_count"] == 0
    restored = {records[rank][1]["restored"] for rank in range(WORLD)}
    assert len(restored) == 1, f"ranks restored different steps: {restored}"
    step = restored.pop()
    # saves every 2 steps; by step 5 every rank staged step 4, after its writer committed step 2 everywhere
    assert step is not None and step % 2 == 0 and 2 <= step <= kill_step, (step, kill_step)
    if phase == "after-commit":
        assert step == kill_step - kill_step % 2, "the newest save, committed before the kill, is restored"
        tiers = {rank: records[rank][1]["tier"] for rank in range(WORLD)}
        assert tiers[victim].startswith("local ") and all(tier == "memory" for rank, tier in tiers.items()
                                                          if rank != victim), tiers
    cause = "hung (no heartbeat" if signal_name == "STOP" else "killed by signal SIGKILL"
    assert f"rank {victim} (pid {records[victim][0]['pid']}) {cause}" in result.stderr
    assert f"restarting it alone in generation 1" in result.stderr


def test_a_rank_lost_before_the_first_commit_restarts_alone_and_the_survivor_starts_afresh(
        tmp_path: Path, reference: list[bytes]) -> None:
    # fault matrix row 20, seed 2000007: rank 1 dies at step 2 before its save, so no step was ever committed;
    # the next generation restores nothing, and the survivor (not restarted) must start from its setup's
    # initial state as the replacement does, not from its trained weights and advanced sample position
    job = ["--kill-rank", "1", "--kill-step", "2", "--kill-signal", "KILL", "--kill-phase", "before-save"]
    result = launch_job(tmp_path, *job)
    assert result.returncode == 0, result.stderr[-4000:]
    assert finals(tmp_path / "out") == reference, "the run restarted from nothing differs from the uninterrupted one"
    survivor, victim = generations(tmp_path / "out", 0), generations(tmp_path / "out", 1)
    assert sorted(survivor) == [0, 1] and survivor[0]["pid"] == survivor[1]["pid"], "the survivor was restarted"
    assert sorted(victim) == [0, 1] and victim[0]["pid"] != victim[1]["pid"]
    assert survivor[1]["restored"] is None and victim[1]["restored"] is None
    assert "rank 0: no step was committed before the failure; it builds its setup again" in result.stderr
    assert "restarting it alone in generation 1" in result.stderr


@pytest.mark.slow
def test_a_hang_outlasting_the_collective_and_rejoin_timeouts_restarts_only_the_hung_rank(
        tmp_path: Path, reference: list[bytes]) -> None:
    # the hang outlasts the configured collective timeout and the rejoin timeout: the survivor must keep
    # waiting (in its collective, whose timeout the worker raises above the hang timeout, or for the next
    # generation) until the supervisor kills the hung rank, instead of giving up and being replaced itself
    # (here after 5 + 8 s < 18 s)
    job = ["--kill-rank", "1", "--kill-step", "6", "--kill-signal", "STOP", "--kill-phase", "after-save"]
    result = launch_job(tmp_path, *job, hang_timeout=18.0,
                     settings={"CKPTD_ELASTIC_COLLECTIVE_TIMEOUT_S": "5", "CKPTD_ELASTIC_REJOIN_TIMEOUT_S": "8"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert finals(tmp_path / "out") == reference
    survivor, victim = generations(tmp_path / "out", 0), generations(tmp_path / "out", 1)
    assert sorted(survivor) == [0, 1] and survivor[0]["pid"] == survivor[1]["pid"], "the survivor was restarted"
    assert sorted(victim) == [0, 1] and victim[0]["pid"] != victim[1]["pid"]
    assert f"rank 1 (pid {victim[0]['pid']}) hung (no heartbeat" in result.stderr


def test_a_hang_is_ended_by_the_supervisors_kill_not_by_the_process_groups_timeout(
        tmp_path: Path, reference: list[bytes]) -> None:
    # a collective timeout (1 s) far below the hang timeout (4 s): the process group's timeout is raised
    # above the hang timeout, so the survivor's all_reduce with the stopped rank lasts until the supervisor
    # kills that rank and ends with a connection reset, not with gloo's timeout
    job = ["--kill-rank", "1", "--kill-step", "6", "--kill-signal", "STOP", "--kill-phase", "after-save"]
    result = launch_job(tmp_path, *job, hang_timeout=4.0, settings={"CKPTD_ELASTIC_COLLECTIVE_TIMEOUT_S": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert finals(tmp_path / "out") == reference
    log = result.stderr
    left = re.findall(r"rank 0 leaves generation 0 after a peer's failure: (.*)", log)
    assert len(left) == 1, log[-4000:]
    assert "timed out" not in left[0].lower() and "timeout" not in left[0].lower(), left[0]
    killed = log.index("rank 1 (pid")
    assert killed < log.index("rank 0 leaves generation 0"), "the survivor left before the hung rank was killed"


def test_recoveries_in_a_row_end_bit_for_bit_and_the_survivor_keeps_no_old_generation(
        tmp_path: Path, reference: list[bytes]) -> None:
    # rank 1 dies after its save of step 3, then after its first step of generations 1 to 3; with a save
    # at every step the survivor's interrupted commit rounds leave reference cycles behind
    result = launch_job(tmp_path, "--every", "1", "--kill-rank", "1", "--kill-step", "3", "--kill-phase", "after-save",
                     "--kill-generations", "4", max_restarts=4, extra=("--crash-loop", "0", "--restart-backoff", "0"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert finals(tmp_path / "out") == reference
    survivor = generations(tmp_path / "out", 0)
    assert sorted(survivor) == [0, 1, 2, 3, 4] and len({record["pid"] for record in survivor.values()}) == 1
    # the OS threads (gloo's among them) and open files of failed generations are freed: they stay flat
    # (generations 0 and 1 are left out: the writer starts at the first save, one failed generation may linger;
    # one thread of the generation just left may still be ending when the count is taken, a leak of one
    # thread per generation grows by 2 over generations 2 to 4)
    later = [survivor[generation] for generation in sorted(survivor) if generation >= 2]
    assert len({record["fds"] for record in later}) == 1, [(record["fds"], record["threads"]) for record in later]
    # the manager's read and write pools start their threads on demand, up to their fixed size, and keep them
    # across generations: seen once in CI as 13, 13, 15 with ckptd-read_2 and _3 started in generation 4
    pooled = ("ckptd-read_", "ckptd-write_")
    tasks = [record["tasks"] - sum(name.startswith(pooled) for name in record["threads"]) for record in later]
    assert max(tasks) - min(tasks) <= 1, [(record["tasks"], record["threads"]) for record in later]
    # what run() froze after setup is frozen once: no later generation adds its leftovers to the frozen objects
    frozen = [survivor[generation]["frozen"] for generation in sorted(survivor)]
    assert frozen[0] > 0 and frozen == sorted(frozen, reverse=True), frozen


def test_a_failure_past_max_restarts_stops_every_rank_and_names_rank_and_cause(tmp_path: Path) -> None:
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "3", max_restarts=0, nodes=2)
    assert result.returncode == 12, result.stderr[-4000:]
    # node 1's supervisor stops the job; node 0's stops its rank too, and both exits name the rank and cause
    assert result.stderr.count("ckptd: error: the job stopped: rank 1 killed by signal SIGKILL in generation 0") == 2
    assert "--max-restarts 0 are spent" in result.stderr
    assert not list((tmp_path / "out").glob("rank*-final.json")), "no rank may finish a stopped job"
    assert not list((tmp_path / "out").glob("rank*-gen1.json")), "no rank may start a new generation"


def test_a_rank_past_its_own_restart_budget_stops_the_job_naming_rank_step_and_cause(tmp_path: Path) -> None:
    # the job may restart 5 times, rank 1 only once: its second failure (in generation 1) stops the job
    # (a save at every step: a step committed before the kill is common to both ranks whatever the timing)
    result = launch_job(tmp_path, "--every", "1", "--kill-rank", "1", "--kill-step", "5", "--kill-generations", "3",
                        max_restarts=5,
                        extra=("--max-restarts-per-rank", "1", "--crash-loop", "0", "--restart-backoff", "0"))
    assert result.returncode == 12, result.stderr[-4000:]
    assert "restarting it alone in generation 1 (restart 1 of 5, the rank's 1 of 1)" in result.stderr
    stopped = re.search(r"ckptd: error: the job stopped: rank 1 killed by signal SIGKILL in generation 1 \(its last "
                        r"step (\d+)\), and its --max-restarts-per-rank 1 are spent", result.stderr)
    assert stopped is not None, result.stderr[-4000:]
    assert int(stopped.group(1)) >= 2, "the step named is the newest the rank completed"
    assert not list((tmp_path / "out").glob("rank*-final.json")), "no rank may finish a stopped job"
    assert not list((tmp_path / "out").glob("rank*-gen2.json")), "no rank may start a new generation"


def test_an_ended_generation_releases_its_waiters_and_refuses_writes() -> None:
    import torch.distributed as dist

    from ckptd.elastic import keys
    from ckptd.elastic.generation_store import GenerationStore
    from ckptd.errors import DeadlineError, GenerationEndedError

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    old, new = GenerationStore(store, 4), GenerationStore(store, 5)
    old.set("round", "a")
    assert not new.check(["round"]), "generations must not see each other's keys"
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            old.wait(["never-written"], timedelta(seconds=120))
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            outcome.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    old.end("rank 2 died")
    thread.join(timeout=30)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], GenerationEndedError)
    assert "rank 2 died" in str(outcome[0])
    with pytest.raises(GenerationEndedError):
        old.set("round", "stale write")
    assert store.get(keys.in_generation(4, "round")) == b"a"
    new.set("round", "b")
    assert new.get("round") == b"b"
    with pytest.raises(DeadlineError, match="absent of generation 5"):
        new.wait(["absent"], timedelta(seconds=0.2))


def test_a_crash_loop_stops_the_job_with_its_own_exit_code_after_backing_off(tmp_path: Path) -> None:
    # rank 1 dies at step 5 of generation 0 (steps were completed before: no loop), then at the first step of
    # every later generation, before completing one: the second such failure in a row stops the job
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "5", "--kill-phase", "before-step",
                     "--kill-generations", "99", extra=("--crash-loop", "2", "--restart-backoff", "0.2"))
    assert result.returncode == 14, result.stderr[-4000:]
    assert "restarting it alone in generation 1 (restart 1" in result.stderr, "no back-off after completed steps"
    assert "restarting it alone in generation 2 in 0.2 s (restart 2" in result.stderr, "a loop backs off"
    assert ("ckptd: error: the job stopped: rank 1 killed by signal SIGKILL in generation 2 (its last step 4): "
            "2 failure(s) in a row with no step completed in between (--crash-loop 2)") in result.stderr
    survivor = generations(tmp_path / "out", 0)
    assert sorted(survivor) == [0, 1, 2] and len({record["pid"] for record in survivor.values()}) == 1
    assert not list((tmp_path / "out").glob("rank*-final.json"))


def test_checkpoint_manager_refuses_the_options_the_launcher_sets(tmp_path: Path) -> None:
    from ckptd.elastic.worker import WorkerContext
    from ckptd.errors import ConfigError

    context = WorkerContext(rank=0, world_size=1, local_rank=0, node_rank=0, generation=0, store=None,  # type: ignore[arg-type]
                            restart_count=0, rejoined=0, _beat=lambda step: None)
    with pytest.raises(ConfigError) as caught:
        context.checkpoint_manager(tmp_path / "ckpt", rank=3, store=object())
    assert "rank, store" in str(caught.value) and not (tmp_path / "ckpt").exists()


def test_with_preload_the_replacement_is_forked_with_torch_imported_and_the_run_ends_bit_for_bit(
        tmp_path: Path, reference: list[bytes]) -> None:
    # --preload: every rank is forked from the node's fork server, which imported torch once; the replacement
    # of the killed rank finds torch imported before its first line runs and recovers to the same bytes
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "5", extra=("--preload",))
    assert result.returncode == 0, result.stderr[-4000:]
    assert finals(tmp_path / "out") == reference
    survivor, victim = generations(tmp_path / "out", 0), generations(tmp_path / "out", 1)
    assert sorted(victim) == [0, 1] and victim[0]["pid"] != victim[1]["pid"]
    assert survivor[0]["pid"] == survivor[1]["pid"], "the survivor was restarted"
    records = [survivor[0], victim[0], victim[1]]
    assert all(record["preloaded"] for record in records), "a rank imported torch itself"
    assert len({record["parent"] for record in records}) == 1, "every rank is a child of the one fork server"
    assert "restarting it alone in generation 1" in result.stderr


def test_without_preload_a_rank_imports_torch_itself(tmp_path: Path) -> None:
    result = launch_job(tmp_path, "--steps", "2", settings={"CKPTD_PRELOAD": "0"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert not any(record["preloaded"] for rank in range(WORLD) for record in generations(tmp_path / "out", rank).values())


_SPAWNING_SCRIPT = '''
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):  # defined in the script: a spawned worker must find it in its __main__
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return torch.tensor([index * index, os.getpid()])


if __name__ == "__main__":
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    rows = torch.cat(list(loader))
    with open(sys.argv[1] + f"/rank{os.environ['RANK']}.json", "w") as out:
        json.dump({"squares": rows[:, 0].tolist(), "workers": sorted(set(rows[:, 1].tolist())),
                   "pid": os.getpid(), "main": __name__}, out)
'''


def test_a_preloaded_rank_runs_a_script_whose_data_loader_spawns_workers(tmp_path: Path) -> None:
    # the script runs through runpy as __main__ in a process forked from the fork server: spawned
    # DataLoader workers (a new interpreter each) must still find the script's classes
    script = tmp_path / "spawning.py"
    script.write_text(_SPAWNING_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", "2", str(script),
                             str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["squares"] == [0, 1, 4, 9, 16, 25] and record["main"] == "__main__"
        assert len(record["workers"]) == 2 and record["pid"] not in record["workers"], record


def test_the_ckptd_entry_point_runs_a_module_from_the_current_directory_with_and_without_preload(
        tmp_path: Path) -> None:
    # `python -m` puts the current directory first on sys.path; a preloaded rank inherits the supervisor's
    # path, whose first entry is the console script's folder, so the launcher must put the directory there
    package = tmp_path / "localpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import json, os, sys\nopen(sys.argv[1] + '/rank' + os.environ['RANK'], 'w')"
                                      ".write(json.dumps([sys.path[0], sys.argv[1:]]))\n")
    entry_point = Path(sys.executable).with_name("ckptd")
    for preload in ("--preload", "--no-preload"):
        out = tmp_path / preload.strip("-")
        out.mkdir()
        result = subprocess.run([str(entry_point), "launch", preload, "--nproc-per-node", "2", "-m", "localpkg.train",
                                 str(out), "-u", "3"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, (preload, result.stderr[-4000:])
        seen = [json.loads((out / f"rank{rank}").read_text()) for rank in range(2)]
        assert seen == [[str(tmp_path), [str(out), "-u", "3"]]] * 2, (preload, seen)  # the script's own -u stays
