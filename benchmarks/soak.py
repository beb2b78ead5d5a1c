"""The soak run (issue 17, part 4; not part of the test run): a multi-node training job with its daemons,
under a seeded schedule of faults, ending with a bit-exact comparison against an uninterrupted run.

Usage::

    python benchmarks/soak.py --minutes 60 --seed 1 --report reports/soak/<date>.json     # or: make soak

Two nodes stand in for two machines on this one (:mod:`harness.soak_cluster`): each with its own
directory (local checkpoint root, daemon state), its own ``ckptd daemon`` (promotion to one S3 prefix on
moto's server, behind the fault proxy; replication to the other node's daemon) and its own ``ckptd launch``
supervisor of ``--ranks-per-node`` gloo ranks of :mod:`harness.soak_job` (a small MLP fed by the
verified shard loader, checkpointed every ``--every`` steps). During ``--minutes`` of training the driver
injects, at seeded times (each once the job has completed a step since the previous fault):

- ``trainer-kill``: SIGKILL of one rank (its supervisor restarts it; the others rejoin);
- ``daemon-kill``: SIGKILL of one node's daemon, started again after a seeded delay (as systemd would);
- ``s3-window``: for a seeded duration the proxy answers a fraction of requests with 503 SlowDown or 500,
  stalls them, resets them or cuts their bodies (one seeded mode per window, or a mix);
- ``node-loss`` (exactly one, in the middle of the run): a node's supervisor (its ranks die with it),
  daemon and directory are gone; the other supervisor is killed too (the launcher replaces ranks, not a
  lost supervisor), the node comes back empty, and the job is started again on the same store: the lost
  ranks restore from the buddy's replicas (peer tier) or from S3.

Then the driver writes the stop step, the job ends cleanly, the daemons are stopped, every tier is
checked (every step recorded before a fault is still committed and verifies unless retention retired it;
every step advertised verifies), and the same job runs uninterrupted for the same number of steps (one
supervisor, no daemon, no S3, no saves). The final weights, optimizer state and sample-id stream of every
rank must equal byte for byte; each step replayed after a rollback must have drawn the same samples.
The report (JSON) lists every fault (time, kind, target, step), how it was recovered (restart, tier each
rank restored from, time to the next completed step, time until the object tier held the step the job
had reached), the verdict (EQUAL or the differences) and the bytes lost; a summary table is printed. Exit
status: 0 when EQUAL with nothing lost, 1 otherwise.
"""

from __future__ import annotations

import harness_path  # noqa: F401  (tests/harness)

import argparse
import bisect
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.invariants import Check, check_nothing_lost, check_nothing_partial, record_committed
from harness.soak_cluster import JobOptions, SoakCluster, SoakNode

#: The proxy's fault modes of an S3 window: (name, fault kinds, fraction of requests).
S3_MODES: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("503-burst", ("503",), 0.5),
    ("503-persistent", ("503",), 1.0),
    ("500", ("500",), 0.3),
    ("stall", ("stall",), 0.3),
    ("reset", ("reset",), 0.3),
    ("mixed", ("500", "503", "reset", "truncate"), 0.3),
)


@dataclass
class Fault:
    """One injected fault and how the job came through it."""

    number: int
    kind: str
    planned_s: float
    target: str = ""
    at_s: float | None = None  # seconds since the soak phase began
    at: float | None = None  # wall-clock time
    step: int | None = None  # the newest step any rank had completed
    detail: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)


# --- the schedule --------------------------------------------------------------------------------

def plan_faults(rng: random.Random, duration_s: float, counts: dict[str, int]) -> list[Fault]:
    """The faults of a run, at seeded times spread over ``duration_s`` (one slot each, jittered inside it);
    the node loss, if any, falls in the middle third."""
    kinds = [kind for kind in ("trainer-kill", "daemon-kill", "s3-window") for _ in range(counts[kind])]
    rng.shuffle(kinds)
    if counts["node-loss"]:
        middle = len(kinds) // 3 + rng.randint(0, max(0, len(kinds) // 3))
        kinds.insert(middle, "node-loss")
    slot = duration_s / (len(kinds) + 1)
    return [Fault(number, kind, round(slot * (number + 1) + rng.uniform(-0.3, 0.3) * slot, 3))
            for number, kind in enumerate(kinds)]


# --- watching the job ------------------------------------------------------------------------------

class Progress:
    """Follows the ranks' ``rank<r>-progress.log`` files: the last completed step of each rank and the
    stream digest of every step each rank completed (a replayed step must repeat its digest)."""

    def __init__(self, out: Path, world: int) -> None:
        self.out, self.world = out, world
        self._offsets = [0] * world
        #: Every completed step of each rank, in order: (time, incarnation, generation, step).
        self.lines: list[list[tuple[float, int, int, int]]] = [[] for _ in range(world)]
        self.digests: list[dict[int, str]] = [{} for _ in range(world)]
        self.replayed = 0
        self.mismatches: list[str] = []

    def poll(self) -> None:
        for rank in range(self.world):
            path = self.out / f"rank{rank}-progress.log"
            if not path.exists():
                continue
            with open(path, encoding="utf-8") as log:
                log.seek(self._offsets[rank])
                data = log.read()
            complete = data[:data.rfind("\n") + 1]
            self._offsets[rank] += len(complete.encode())
            for line in complete.splitlines():
                at, incarnation, generation, step, digest = line.split()
                self.lines[rank].append((float(at), int(incarnation), int(generation), int(step)))
                seen = self.digests[rank].get(int(step))
                if seen is None:
                    self.digests[rank][int(step)] = digest
                    continue
                self.replayed += 1
                if seen != digest:
                    self.mismatches.append(f"rank {rank} step {step}: replayed with stream digest {digest}, "
                                           f"first {seen}")

    def newest_step(self) -> int | None:
        steps = [lines[-1][3] for lines in self.lines if lines]
        return max(steps) if steps else None

    def oldest_step(self) -> int:
        return min(lines[-1][3] if lines else 0 for lines in self.lines)

    def position(self) -> tuple[int, int]:
        """The (incarnation, generation) of the newest step logged."""
        newest = max((lines[-1] for lines in self.lines if lines), default=(0.0, 0, 0, 0))
        return newest[1], newest[2]

    def every_rank_since(self, at: float, after: tuple[int, int] | None = None) -> float | None:
        """The time by which every rank had completed a step after ``at`` (and, with ``after``, in a later
        (incarnation, generation) than that); None: not yet."""
        times = []
        for lines in self.lines:
            first = next((line[0] for line in lines[bisect.bisect_right(lines, (at, 2**62)):]
                          if after is None or (line[1], line[2]) > after), None)
            if first is None:
                return None
            times.append(first)
        return max(times)


def _generation_records(out: Path, rank: int, incarnation: int) -> dict[int, dict[str, Any]]:
    records = {}
    for path in out.glob(f"rank{rank}-inc{incarnation}-gen*.json"):
        try:
            record = json.loads(path.read_text())
        except ValueError:  # being written
            continue
        records[record["generation"]] = record
    return records


def _ckptd_warnings(logs: Path, incarnation: int, limit: int = 12) -> list[str]:
    """ckptd's own log lines about promotion and pins in the supervisors' logs of ``incarnation`` (the
    context of a finding), at most ``limit``, each cut to 300 characters."""
    words = ("promot", "pinned", "daemon", "waiting for rank")
    lines = []
    for path in sorted(logs.glob(f"launch-node*-inc{incarnation}.log")):
        for line in path.read_text(errors="replace").splitlines():
            if any(word in line for word in words) and not line.startswith(("  File", "[rank")):
                lines.append(f"{path.name}: {line[:300]}")
    return lines[:limit]


class JobFailed(RuntimeError):
    """The job stopped on its own (a supervisor exited) or did not recover in time."""


class Driver:
    """Runs the soak phase: the schedule, recovery checks and the records the report is made of."""

    def __init__(self, cluster: SoakCluster, args: argparse.Namespace, rng: random.Random) -> None:
        self.cluster, self.args, self.rng = cluster, args, rng
        self.world = sum(len(node.ranks) for node in cluster.nodes)
        self.progress = Progress(cluster.out, self.world)
        self.started = time.time()
        self.faults: list[Fault] = []
        self.unexpected: list[dict[str, Any]] = []
        #: What went wrong without stopping the run (a job that would not end, ...): each makes the exit 1.
        self.findings: list[dict[str, Any]] = []
        self.records: list[tuple[str, Any, int | None]] = []  # (what, CommittedRecord, keep_last)
        self._catch_up: list[tuple[Fault, int, float]] = []  # fault, step, since
        self.object_steps: list[int] = []
        self._listed_at = 0.0
        #: Seconds from the job's end until the object tier held its last step (None: not within the timeout).
        self.final_promoted_s: float | None = None

    # --- helpers -----------------------------------------------------------------------------------
    def _node_of(self, rank: int) -> SoakNode:
        return next(node for node in self.cluster.nodes if rank in node.ranks)

    def tick(self) -> None:
        """One look at the job: progress, processes, the object tier's catch-up after earlier faults."""
        self.progress.poll()
        codes = self.cluster.supervisor_codes()
        if any(code is not None for code in codes):
            raise JobFailed(f"a supervisor exited during the run: exit codes {codes} (logs in {self.cluster.logs})")
        for node in self.cluster.nodes:
            if node.daemon is not None and not self.cluster.daemon_alive(node):
                code = node.daemon.process.returncode
                self.unexpected.append({"at_s": round(time.time() - self.started, 3), "what":
                                        f"the daemon of {node.node_id} exited on its own (code {code})"})
                self.cluster.start_daemon(node)
        if self._catch_up and time.monotonic() - self._listed_at > 1.0:
            self._listed_at = time.monotonic()
            self._check_catch_up()

    def _object_committed(self) -> list[int]:
        from ckptd.tiers import open_tier

        tier = open_tier(self.cluster.remote, storage_options=self.cluster.direct_options)
        try:
            return tier.committed_steps()
        finally:
            tier.close()

    def _check_catch_up(self) -> None:
        steps = self._object_committed()
        newest = max(steps) if steps else 0
        for entry in list(self._catch_up):
            fault, step, since = entry
            if newest >= step:
                fault.recovery["object_caught_up_s"] = round(time.time() - since, 3)
                self._catch_up.remove(entry)

    def _saved_everywhere(self) -> int:
        """The newest multiple of ``every`` every rank has completed (the step the tiers must reach)."""
        oldest = self.progress.oldest_step()
        return oldest - oldest % self.args.every

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def wait_recovered(self, since: float, what: str, timeout_s: float | None = None,
                       after: tuple[int, int] | None = None) -> float:
        """Until every rank completed a step after ``since`` (in a later generation than ``after``); returns
        the time of the last of those steps."""
        deadline = time.monotonic() + (timeout_s or self.args.recovery_timeout)
        while True:
            self.tick()
            done = self.progress.every_rank_since(since, after)
            if done is not None:
                return done
            if time.monotonic() > deadline:
                raise JobFailed(f"no step completed on every rank within {self.args.recovery_timeout:g} s of {what}")
            time.sleep(0.1)

    def _record_tiers(self, skip: SoakNode | None = None) -> None:
        """Before a fault: what each tier holds committed (checked once the run is over)."""
        for node in self.cluster.nodes:
            if node is skip:
                continue
            for rank in node.ranks:
                self.records.append((f"{node.node_id} local rank{rank}", record_committed(node.rank_root(rank)), 3))
        self.records.append(("object", record_committed(self.cluster.remote, self.cluster.direct_options),
                             self.cluster.options.keep_remote))

    # --- the faults --------------------------------------------------------------------------------
    def run(self, faults: list[Fault], duration_s: float) -> None:
        self.cluster.start_job()
        self.wait_recovered(self.started, "the job's start", timeout_s=max(180.0, self.args.recovery_timeout))
        for fault in faults:
            self.wait(max(0.0, self.started + fault.planned_s - time.time()))
            getattr(self, "_" + fault.kind.replace("-", "_"))(fault)
            self.faults.append(fault)
            print(f"soak: {fault.at_s:8.1f}s  #{fault.number:<3} {fault.kind:<13} {fault.target:<16} step "
                  f"{fault.step}: {fault.recovery}", flush=True)
        self.wait(max(0.0, self.started + duration_s - time.time()))

    def _mark(self, fault: Fault) -> None:
        """The moment of injection: its time and the newest step any rank had completed."""
        self.progress.poll()
        fault.at = time.time()
        fault.at_s = round(fault.at - self.started, 3)
        fault.step = self.progress.newest_step()

    def _trainer_kill(self, fault: Fault) -> None:
        rank = self.rng.randrange(self.world)
        deadline = time.monotonic() + self.args.recovery_timeout
        while self.progress.oldest_step() < 2 * self.args.every and time.monotonic() < deadline:
            self.wait(0.1)  # a step saved on every rank, so that the replacement has one to restore
        incarnation = self.cluster.incarnation
        records = _generation_records(self.cluster.out, rank, incarnation)
        generation = max(records)
        pid = records[generation]["pid"]
        fault.target = f"rank {rank} (pid {pid})"
        self._record_tiers()
        self._mark(fault)
        os.kill(pid, signal.SIGKILL)
        done = self.wait_recovered(fault.at, f"fault {fault.number}", after=(incarnation, generation))
        after = {r: _generation_records(self.cluster.out, r, incarnation) for r in range(self.world)}
        newest = {r: after[r][max(after[r])] for r in range(self.world)}
        fault.recovery = {"how": f"rank {rank} restarted by its supervisor (generation {generation} -> "
                                 f"{newest[rank]['generation']}), the others rejoined",
                          "restored_step": newest[rank]["restored"],
                          "tiers": {r: newest[r]["tier"] for r in range(self.world)},
                          # where the time went: the replacement's start (import torch, setup), the restore
                          "replacement_started_s": round(newest[rank]["entered_at"] - fault.at, 3),
                          "restore_s": round(max(newest[r]["restored_at"] - newest[r]["entered_at"]
                                                 for r in range(self.world)), 3),
                          "step_recovery_s": round(done - fault.at, 3)}
        self._catch_up.append((fault, self._saved_everywhere(), time.time()))

    def _daemon_kill(self, fault: Fault) -> None:
        node = self.rng.choice(self.cluster.nodes)
        delay = round(self.rng.uniform(*self.args.daemon_down_s), 3)
        fault.target = f"daemon {node.node_id}"
        fault.detail = {"down_s": delay}
        self._record_tiers()
        self._mark(fault)
        self.cluster.kill_daemon(node)
        self.wait(delay)
        started = time.time()
        self.cluster.start_daemon(node)
        done = self.wait_recovered(fault.at, f"fault {fault.number}")
        fault.recovery = {"how": "daemon started again by the driver (journal resumed)",
                          "daemon_restart_s": round(time.time() - started, 3),
                          "step_recovery_s": round(done - fault.at, 3)}
        self._catch_up.append((fault, self._saved_everywhere(), fault.at))

    def _s3_window(self, fault: Fault) -> None:
        name, kinds, fraction = self.rng.choice(S3_MODES)
        duration = round(self.rng.uniform(*self.args.s3_window_s), 3)
        proxy = self.cluster.proxy
        fault.target = f"s3 proxy ({name})"
        before = dict(proxy.counts)
        self._record_tiers()
        self._mark(fault)
        proxy.kinds, proxy.fraction = kinds, fraction
        try:
            self.wait(duration)
        finally:
            proxy.fraction = 0.0
        counts = {kind: proxy.counts[kind] - before.get(kind, 0) for kind in proxy.counts}
        fault.detail = {"mode": name, "kinds": list(kinds), "fraction": fraction, "duration_s": duration,
                        "requests": counts.pop("requests", 0), "faults": counts}
        done = self.wait_recovered(fault.at + duration, f"fault {fault.number}")
        fault.recovery = {"how": "retried by the uploads (window over)",
                          "step_recovery_s": round(max(0.0, done - fault.at - duration), 3)}
        self._catch_up.append((fault, self._saved_everywhere(), time.time()))

    def _node_loss(self, fault: Fault) -> None:
        lost = self.rng.choice(self.cluster.nodes)
        others = [node for node in self.cluster.nodes if node is not lost]
        fault.target = f"{lost.node_id} (ranks {', '.join(map(str, lost.ranks))})"
        waited = time.time()
        deadline = time.monotonic() + self.args.recovery_timeout
        while not self._copies_elsewhere(lost) and time.monotonic() < deadline:
            self.wait(0.5)  # a node lost before any of its steps left it restarts nothing: not this scenario
        fault.detail = {"waited_for_a_copy_elsewhere_s": round(time.time() - waited, 3)}
        self._record_tiers(skip=lost)
        self._mark(fault)
        self.cluster.lose_node(lost)
        for node in others:  # the launcher does not replace a lost supervisor: the job ends
            self.cluster.kill_supervisor(node)
        self.cluster.restore_node(lost)
        incarnation = self.cluster.start_job()
        done = self.wait_recovered(fault.at, f"fault {fault.number}", timeout_s=max(180.0, self.args.recovery_timeout),
                                   after=(incarnation - 1, 2**31))
        records = {r: _generation_records(self.cluster.out, r, incarnation)[0] for r in range(self.world)}
        fault.recovery = {"how": f"{lost.node_id} back empty (new daemon), job started again (incarnation "
                                 f"{incarnation})",
                          "restored_step": min((record["restored"] or 0) for record in records.values()),
                          "tiers": {r: record["tier"] for r, record in records.items()},
                          "step_recovery_s": round(done - fault.at, 3)}
        self._catch_up.append((fault, self._saved_everywhere(), time.time()))

    def _copies_elsewhere(self, node: SoakNode) -> bool:
        """Whether the object tier, or the buddy for each of ``node``'s ranks, holds a committed step."""
        from ckptd.tiers.local import LocalTier

        if self._object_committed():
            return True
        holders = [other for other in self.cluster.nodes if other is not node]
        return all(any(other.replica_root(node, rank).is_dir() and
                       LocalTier(other.replica_root(node, rank), create=False).committed_steps() for other in holders)
                   for rank in node.ranks)

    # --- the end -----------------------------------------------------------------------------------
    def stop(self) -> int:
        """Write the stop step, wait for the job to end cleanly and for the object tier to hold that step."""
        self.progress.poll()
        every = self.args.every
        newest = (self.progress.newest_step() or 0) + max(10, 2 * every)
        stop_at = math.ceil(newest / every) * every
        self.cluster.stop_file.write_text(f"{stop_at}\n")
        told = time.time()
        codes = self.cluster.wait_job(timeout_s=self.args.stop_timeout)
        if codes != [0] * len(codes):
            # a finding, not the end of the run: the stacks went to the logs; a new incarnation finishes the job
            incarnation = self.cluster.incarnation
            self.findings.append({
                "at_s": round(told - self.started, 3), "what": "the job did not end within "
                f"{self.args.stop_timeout:g} s of reaching its last step {stop_at} (exit codes {codes} after SIGKILL); "
                f"the ranks' stacks are in logs/launch-node*-inc{incarnation}.log; started again to finish",
                "warnings": _ckptd_warnings(self.cluster.logs, incarnation)})
            self.cluster.start_job()
            codes = self.cluster.wait_job(timeout_s=self.args.recovery_timeout + self.args.stop_timeout)
            if codes != [0] * len(codes):
                raise JobFailed(f"the job did not end cleanly: exit codes {codes} (logs in {self.cluster.logs})")
        self.progress.poll()
        ended = time.time()
        deadline = time.monotonic() + self.args.final_promotion_timeout
        while True:
            self.object_steps = self._object_committed()
            if self._catch_up:
                self._check_catch_up()
            if stop_at in self.object_steps:
                self.final_promoted_s = round(time.time() - ended, 3)
            if self.final_promoted_s is not None and not self._catch_up or time.monotonic() > deadline:
                return stop_at
            time.sleep(0.5)


# --- checks after the run --------------------------------------------------------------------------

def check_tiers(cluster: SoakCluster, records: list[tuple[str, Any, int | None]]) -> list[Check]:
    """L2 for every record taken before a fault (on tiers that were not lost since), L3 for every tier."""
    checks = []
    lost_later = set()
    for what, record, keep in records:
        if not Path(record.location).exists() and "://" not in record.location:
            lost_later.add(what)
            continue
        check = check_nothing_lost(record, storage_options=cluster.direct_options if what == "object" else None,
                                   keep_last=keep)
        checks.append(Check(check.invariant, check.ok, f"{what}: {check.detail}", check.bytes_lost))
    tiers: list[tuple[str, Any, dict[str, Any] | None]] = [("object", cluster.remote, cluster.direct_options)]
    for node in cluster.nodes:
        tiers += [(f"{node.node_id} local rank{rank}", node.rank_root(rank), None) for rank in node.ranks]
        tiers += [(f"{node.node_id} replicas of {source.node_id} rank{rank}", node.replica_root(source, rank), None)
                  for source in cluster.nodes if source is not node for rank in source.ranks
                  if node.replica_root(source, rank).exists()]
    for what, location, options in tiers:
        check = check_nothing_partial(location, options)
        checks.append(Check(check.invariant, check.ok, f"{what}: {check.detail}", check.bytes_lost))
    return checks


def run_golden(workdir: Path, cluster: SoakCluster, steps: int, world: int, args: argparse.Namespace) -> Path:
    """The same job, uninterrupted: one supervisor with every rank, no daemon, no S3, no saves."""
    root, out = workdir / "golden", workdir / "golden" / "out"
    command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(world), "--max-restarts", "0",
               "-m", "harness.soak_job", "--root", str(root / "ckpt"), "--out", str(out),
               "--data", str(cluster.manifest), "--cache", str(root / "cache"), "--steps", str(steps),
               "--every", str(10**12), "--seed", str(args.seed), "--daemon", "off"]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    environment.pop("CKPTD_DAEMON_SOCKET", None)
    with open(cluster.logs / "launch-golden.log", "wb") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                              timeout=max(600, steps)).returncode
    if code != 0:
        raise JobFailed(f"the uninterrupted run failed with exit code {code} (log in {cluster.logs})")
    return out


def compare_finals(soak: Path, golden: Path, world: int) -> list[str]:
    """What differs between the two runs' final records, rank by rank ([] when equal byte for byte)."""
    differences = []
    for rank in range(world):
        name = f"rank{rank}-final.json"
        if not (soak / name).exists():
            differences.append(f"rank {rank}: the soak run wrote no final record")
            continue
        if (soak / name).read_bytes() == (golden / name).read_bytes():
            continue
        mine, theirs = json.loads((soak / name).read_text()), json.loads((golden / name).read_text())
        for key in sorted(set(mine) | set(theirs)):
            if isinstance(theirs.get(key), dict) and isinstance(mine.get(key), dict):
                differences += [f"rank {rank}: {key}.{inner} differs" for inner in sorted(set(mine[key]) |
                                set(theirs[key])) if mine[key].get(inner) != theirs[key].get(inner)]
            elif mine.get(key) != theirs.get(key):
                differences.append(f"rank {rank}: {key} differs ({mine.get(key)!r} != {theirs.get(key)!r})"[:300])
    return differences


# --- the report ------------------------------------------------------------------------------------

def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarise(faults: list[Fault]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for kind in ("trainer-kill", "daemon-kill", "s3-window", "node-loss"):
        chosen = [fault for fault in faults if fault.kind == kind]
        steps = [fault.recovery["step_recovery_s"] for fault in chosen if "step_recovery_s" in fault.recovery]
        caught = [fault.recovery["object_caught_up_s"] for fault in chosen if "object_caught_up_s" in fault.recovery]
        kinds[kind] = {"injected": len(chosen), "recovered": len(steps),
                       "step_recovery_s": {"median": _median(steps), "worst": max(steps) if steps else None},
                       "object_caught_up_s": {"median": _median(caught), "worst": max(caught) if caught else None}}
    return kinds


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'#':>3} {'at (s)':>8}  {'kind':<13} {'target':<22} {'step':>6}  {'next step (s)':>13}  "
          f"{'S3 caught up (s)':>16}  restored from")
    for fault in report["faults"]:
        recovery = fault["recovery"]
        tiers = recovery.get("tiers") or {}
        restored = ", ".join(f"r{rank}: {str(tier).split(' ')[0]}" for rank, tier in tiers.items()) or "-"
        print(f"{fault['number']:>3} {fault['at_s'] or 0:>8.1f}  {fault['kind']:<13} {fault['target'][:22]:<22} "
              f"{fault['step'] if fault['step'] is not None else '-':>6}  "
              f"{recovery.get('step_recovery_s', '-'):>13}  {recovery.get('object_caught_up_s', '-'):>16}  {restored}")
    print(f"\n{'kind':<13} {'injected':>8} {'recovered':>9} {'median next step (s)':>20} {'worst':>8}")
    for kind, entry in report["summary"].items():
        print(f"{kind:<13} {entry['injected']:>8} {entry['recovered']:>9} "
              f"{entry['step_recovery_s']['median'] if entry['step_recovery_s']['median'] is not None else '-':>20} "
              f"{entry['step_recovery_s']['worst'] if entry['step_recovery_s']['worst'] is not None else '-':>8}")
    print(f"\nsteps {report['steps']}, verdict {report['verdict']}, bytes lost {report['bytes_lost']}, "
          f"{len(report['checks'])} tier checks ({sum(not c['ok'] for c in report['checks'])} failed)")
    for difference in report["differences"][:20]:
        print(f"  {difference}")
    for finding in report["findings"]:
        print(f"finding at {finding['at_s']:.1f}s: {finding['what']}")
        for line in finding.get("warnings", []):
            print(f"    {line}")


def render_markdown(report: dict[str, Any]) -> str:
    """A report as Markdown (for docs/fault-matrix.md): the run, the figures per fault kind, the verdict."""
    machine = report["machine"]
    lines = [f"Soak run of {report['started'][:10]}: `{report['command']}`, {report['minutes']:g} min of faults, "
             f"{report['steps']} steps, {report['topology']['nodes']} nodes x {report['topology']['ranks_per_node']} "
             f"rank(s), {machine['cpus']} CPUs (load average {machine['load_average_at_start'][0]} at the start).", "",
             "| fault | injected | recovered | next step on every rank, median / worst (s) | S3 caught up, median / "
             "worst (s) |", "|---|---|---|---|---|"]
    for kind, entry in report["summary"].items():
        step, caught = entry["step_recovery_s"], entry["object_caught_up_s"]
        if entry["injected"]:
            lines.append(f"| {kind} | {entry['injected']} | {entry['recovered']} | {step['median']} / {step['worst']} "
                         f"| {caught['median'] or '-'} / {caught['worst'] or '-'} |")
    tiers: dict[str, int] = {}
    for fault in report["faults"]:
        for tier in (fault["recovery"].get("tiers") or {}).values():
            name = str(tier).split(" ")[0]
            tiers[name] = tiers.get(name, 0) + 1
    lines += ["", f"Verdict: **{report['verdict']}** (weights, optimizer state and sample-id stream of every rank "
              f"against the uninterrupted run), bytes lost: {report['bytes_lost']}, replayed steps drawing the same "
              f"samples: {report.get('replayed_steps')}, restores by tier: "
              f"{', '.join(f'{name} {count}' for name, count in sorted(tiers.items())) or 'none'}, findings: "
              f"{len(report.get('findings', []))}."]
    lines += [f"- Finding: {finding['what']}" for finding in report.get("findings", [])]
    return "\n".join(lines) + "\n"


def _counts(args: argparse.Namespace) -> dict[str, int]:
    minutes = args.minutes
    defaults = {"trainer-kill": max(1, round(minutes * 0.4)), "daemon-kill": max(1, round(minutes * 0.2)),
                "s3-window": max(1, round(minutes * 0.25)), "node-loss": 1}
    given = {"trainer-kill": args.trainer_kills, "daemon-kill": args.daemon_kills, "s3-window": args.s3_windows,
             "node-loss": args.node_losses}
    return {kind: defaults[kind] if given[kind] is None else given[kind] for kind in defaults}


def run_soak(args: argparse.Namespace, workdir: Path, faults: list[Fault], options: JobOptions,
             report: dict[str, Any], rng: random.Random) -> str | None:
    """The run, the checks and the uninterrupted run, filling ``report``; the failure that stopped it, if any."""
    began = time.time()
    cluster = SoakCluster(workdir, ranks_per_node=args.ranks_per_node, options=options, proxy_seed=args.seed,
                          stall_s=args.stall_s)
    failure = None
    phases = report["phases_s"]
    try:
        driver = Driver(cluster, args, rng)
        try:
            cluster.start_daemons()
            driver.started = time.time()
            phases["start"] = round(driver.started - began, 3)
            driver.run(faults, args.minutes * 60)
            phases["faults"] = round(time.time() - driver.started, 3)
            stopping = time.time()
            report["steps"] = driver.stop()
            phases["stop"] = round(time.time() - stopping, 3)
            report["object_tier"] = {"steps_at_end": driver.object_steps,
                                     "last_step_promoted_s": driver.final_promoted_s}
        except Exception as error:  # noqa: BLE001 - reported, the run is kept for a look
            failure = f"{type(error).__name__}: {error}"
        finally:
            cluster.stop_processes()
        driver.progress.poll()
        report["faults"] = [asdict(fault) for fault in driver.faults]
        report["unexpected"] = driver.unexpected
        report["findings"] = driver.findings
        report["replayed_steps"] = driver.progress.replayed
        report["differences"] = list(driver.progress.mismatches)
        report["summary"] = summarise(driver.faults)
        if failure is not None:
            return failure
        checking = time.time()
        checks = check_tiers(cluster, driver.records)
        phases["checks"] = round(time.time() - checking, 3)
        report["checks"] = [asdict(check) for check in checks]
        report["bytes_lost"] = sum(check.bytes_lost for check in checks)
        report["differences"] += [check.detail for check in checks if not check.ok]
        uninterrupted = time.time()
        try:
            golden = run_golden(workdir, cluster, report["steps"], driver.world, args)
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        phases["uninterrupted_run"] = round(time.time() - uninterrupted, 3)
        report["differences"] += compare_finals(cluster.out, golden, driver.world)
        return None
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes of training under faults")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the proxy")
    parser.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="gloo ranks per node (2 nodes)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds each step sleeps (compute)")
    parser.add_argument("--trainer-kills", type=int, default=None, help="default: 0.4 per minute")
    parser.add_argument("--daemon-kills", type=int, default=None, help="default: 0.2 per minute")
    parser.add_argument("--s3-windows", type=int, default=None, help="default: 0.25 per minute")
    parser.add_argument("--node-losses", type=int, choices=(0, 1), default=None, help="default: 1")
    parser.add_argument("--daemon-down-s", type=float, nargs=2, default=(0.5, 5.0), help="daemon down, seconds")
    parser.add_argument("--s3-window-s", type=float, nargs=2, default=(5.0, 40.0), help="S3 window, seconds")
    parser.add_argument("--stall-s", type=float, default=25.0, help="a stalled request's silence, seconds")
    parser.add_argument("--final-promotion-timeout", type=float, default=120.0,
                        help="seconds to wait, once the job ended, for the object tier to hold its last step")
    parser.add_argument("--stop-timeout", type=float, default=100.0,
                        help="seconds for the job to end once told to stop (then the ranks' stacks are logged)")
    parser.add_argument("--recovery-timeout", type=float, default=180.0, help="seconds to the next step")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary directory")
    parser.add_argument("--keep-workdir", action="store_true", help="keep it (always kept on failure)")
    parser.add_argument("--render", type=Path, default=None, metavar="REPORT",
                        help="print a report written by an earlier run as Markdown, and exit")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render_markdown(json.loads(args.render.read_text())), end="")
        return 0
    # SIGTERM (a test's timeout, a CI job cancelled) ends the run through its cleanup: no process is left
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"soak: stopped by signal {signum}"))
    rng = random.Random(args.seed)
    counts = _counts(args)
    faults = plan_faults(rng, args.minutes * 60, counts)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    options = JobOptions(every=args.every, step_time_s=args.step_time, seed=args.seed)
    report: dict[str, Any] = {
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed, "minutes": args.minutes, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_start": [round(value, 2) for value in os.getloadavg()]},
        "topology": {"nodes": 2, "ranks_per_node": args.ranks_per_node, "every": args.every,
                     "step_time_s": args.step_time, "keep_local": 3, "keep_remote": options.keep_remote},
        "planned": counts, "faults": [], "unexpected": [], "checks": [], "differences": [], "steps": None,
        "verdict": "NOT RUN", "bytes_lost": None,
        "findings": [], "summary": {}, "phases_s": {}}
    print(f"soak: {args.minutes:g} min, seed {args.seed}, faults {counts}, workdir {workdir}", flush=True)
    failure = run_soak(args, workdir, faults, options, report, rng)
    report["ended"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if failure is not None:
        report["verdict"], report["failure"] = "FAILED", failure
    else:
        report["verdict"] = "EQUAL" if not report["differences"] and report["bytes_lost"] == 0 else "DIFFERENT"
    passed = report["verdict"] == "EQUAL" and not report["findings"]
    report["workdir"] = str(workdir) if not passed or args.keep_workdir else None
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        # the run's own directory is named, not spelled out: the report is meant to be kept and compared
        args.report.write_text(json.dumps(report, indent=1).replace(str(workdir), "<workdir>") + "\n")
    print_table(report)
    if failure is not None:
        print(f"soak: FAILED: {failure}; the run is kept in {workdir}")
    elif passed and not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
