"""Benchmark of elastic recovery (not part of the test run): time to recover from a SIGKILLed rank under
``ckptd launch`` (only that rank restarts, the survivors rejoin in their processes), without and with a
warm spare (``--spares 1``: the rank is handed to a process that has imported torch and built model and
optimizer), against ``torchrun --standalone --max-restarts 1`` (every rank restarts), on the same script
and the same 2-rank gloo job.

torchrun runs with ``--standalone``: with torch 2.13's default static rendezvous, a restarted gloo job
failed to reconnect (``connectFullMesh`` timed out against the dead attempt's addresses), while
``--standalone`` (c10d rendezvous on a local store) restarts cleanly. Under torchrun the script forms its
process group over ``PrefixStore("attempt-<n>/", agent store)`` (see :mod:`harness.launched_training`).

The job trains a small MLP for ``--steps`` steps, saving every ``--every`` steps (local tier), each step
``--step-time`` seconds long; rank 1 SIGKILLs itself right after its save of step ``--kill-step``. Time to
recover is from that SIGKILL to the first step every rank completed after recovery, split into:

- detection: SIGKILL to the launcher's log line about the failure (the harness timestamps every line);
- restart: that line to the first line of Python of the replacement process(es) (0 for a warm spare);
- import: to the end of the worker's imports (``import torch``, ckptd);
- setup: to the end of building model and optimizer;
- rendezvous + process group: to the process group of the new generation/attempt (the launcher's
  rendezvous, the other ranks joining, ``init_process_group``);
- restore: the checkpoint manager's start and its ``restore`` (survivors under ckptd: from memory);
- first step: to the end of the first step after the restore (the slowest rank);

and the steps lost (killed step minus restored step). ``--repeats`` rounds alternate the two launchers;
the median of each figure counts. Usage: ``python benchmarks/bench_elastic.py [--repeats 3] [--json]``.

The same file is the job: ``ckptd launch ... benchmarks/bench_elastic.py --worker ...``.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # the replacement's first line of Python, before torch is imported

import argparse  # noqa: E402 - after the start time
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

WORLD = 2
VICTIM = 1
PHASES = ("detection", "restart", "import", "setup", "rendezvous + process group", "restore", "first step")
#: When the worker finished its imports and its setup (model, optimizer), time.time().
_TIMES: dict[str, float] = {}


# --- the job -----------------------------------------------------------------------------------------
def _setup() -> dict[str, Any]:
    """Model and optimizer (what a warm spare builds before it is given a rank)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    built = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01)}
    _TIMES["setup_at"] = time.time()
    return built


def _train(rank: int, world_size: int, generation: int, make_manager: Callable[..., Any], formed_at: float,
           args: argparse.Namespace, prepared: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import ckptd

    model, optim = prepared["model"], prepared["optim"]
    manager_at = time.time()
    manager = make_manager(Path(args.root) / f"rank{rank}", policy=ckptd.Policy(every_steps=args.every, keep_local=3))
    start = manager.restore({"model": model, "optim": optim}) or 0
    out = Path(args.out)
    record = {"rank": rank, "generation": generation, "pid": os.getpid(), "started_at": _STARTED,
              "imported_at": _TIMES["imported_at"], "setup_at": _TIMES["setup_at"], "formed_at": formed_at, "manager_at": manager_at, "restored_at": time.time(), "restored": start,
              "tier": manager.last_restore.tier if manager.last_restore else None}
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(10_000 * step + rank)
        inputs = torch.randn(64, 64, generator=generator)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True).sin()).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
        optim.step()
        time.sleep(args.step_time)
        manager.save(step, {"model": model, "optim": optim})
        if step == start + 1:
            record["first_step_at"] = time.time()
            (out / f"rank{rank}-gen{generation}.json").write_text(json.dumps(record))
        if generation == 0 and rank == VICTIM and step == args.kill_step:
            (out / "killed.json").write_text(json.dumps({"step": step, "at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
    manager.close()


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ckptd
    from ckptd import elastic
    from ckptd.elastic import keys

    _TIMES["imported_at"] = time.time()
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if keys.ENV_STORE in os.environ:  # under ckptd launch
        elastic.run(lambda ctx: _train(ctx.rank, ctx.world_size, ctx.generation, ctx.checkpoint_manager, time.time(),
                                       args, ctx.setup), setup_fn=_setup)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    prepared = _setup()  # before the process group, as ckptd.elastic.run calls setup_fn
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))

    def manager(local: Path, **options: Any) -> ckptd.CheckpointManager:
        return ckptd.CheckpointManager(local, rank=rank, world_size=world_size, store=store, **options)

    _train(rank, world_size, attempt, manager, time.time(), args, prepared)
    dist.destroy_process_group()


# --- the harness -------------------------------------------------------------------------------------
def _run(launcher: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out, root = work / "out", work / "ckpt"
    job = [str(Path(__file__).resolve()), "--worker", "--root", str(root), "--out", str(out), "--steps",
           str(args.steps), "--every", str(args.every), "--kill-step", str(args.kill_step), "--step-time",
           str(args.step_time)]
    if launcher.startswith("ckptd launch"):
        command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(WORLD),
                   "--max-restarts", "1", "--hang-timeout", "60", *launcher.split()[2:], *job]
        failure_line = "restarting it alone"
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                   "--max-restarts", "1", "--monitor-interval", "0.05", *job]
        failure_line = "failed"
    lines: list[tuple[float, str]] = []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = process.wait(timeout=600)
    reader.join(timeout=10)
    if code != 0:
        raise SystemExit(f"{launcher} failed with exit code {code}:\n" + "\n".join(line for _, line in lines[-30:]))
    killed = json.loads((out / "killed.json").read_text())
    after = [json.loads((out / f"rank{rank}-gen1.json").read_text()) for rank in range(WORLD)]
    detected = next(at for at, line in lines if at >= killed["at"] and failure_line in line)
    restarted = [record for record in after if record["pid"] != _first_pid(out, record["rank"])]
    # a warm spare started long before the failure: its restart is the hand-over, counted in the next phase
    started = max(detected, min(record["started_at"] for record in restarted))
    # the slowest restarted rank's imports and setup (a warm spare did both before the failure: 0)
    imported = max(started, max(record["imported_at"] for record in restarted))
    set_up = max(imported, max(record["setup_at"] for record in restarted))
    formed = max(set_up, max(record["formed_at"] for record in after))
    restored = max(record["restored_at"] for record in after)
    first_step = max(record["first_step_at"] for record in after)
    phases = dict(zip(PHASES, (detected - killed["at"], started - detected, imported - started, set_up - imported,
                               formed - set_up, restored - formed, first_step - restored)))
    return {"launcher": launcher, "total_s": first_step - killed["at"], "phases_s": phases,
            "steps_lost": killed["step"] - after[VICTIM]["restored"], "restarted_ranks": [r["rank"] for r in restarted],
            "tiers": {record["rank"]: record["tier"] for record in after}}


def _first_pid(out: Path, rank: int) -> int | None:
    path = out / f"rank{rank}-gen0.json"
    return json.loads(path.read_text())["pid"] if path.exists() else None


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {"launcher": rounds[0]["launcher"], "total_s": statistics.median(r["total_s"] for r in rounds),
            "phases_s": {phase: statistics.median(r["phases_s"][phase] for r in rounds) for phase in PHASES},
            "steps_lost": statistics.median(r["steps_lost"] for r in rounds),
            "restarted_ranks": rounds[0]["restarted_ranks"], "tiers": rounds[0]["tiers"], "rounds": len(rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    rounds: dict[str, list[dict[str, Any]]] = {"ckptd launch --no-preload": [], "ckptd launch": [],
                                               "ckptd launch --spares 1": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-elastic-") as work:
        for round_number in range(args.repeats):
            for launcher in rounds:
                name = launcher.replace(" ", "").replace("-", "")
                rounds[launcher].append(_run(launcher, Path(work) / f"{name}-{round_number}", args))
    result: dict[str, Any] = {launcher: _median(runs) for launcher, runs in rounds.items()}
    result["ratio"] = {launcher: result[launcher]["total_s"] / result["torchrun"]["total_s"]
                       for launcher in rounds if launcher != "torchrun"}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"time to recover from a SIGKILLed rank (median of {args.repeats}; {WORLD} gloo ranks, CPU)")
    print(f"{'':24}" + "".join(f"{launcher:>26}" for launcher in rounds))
    for phase in PHASES:
        print(f"{phase:24}" + "".join(f"{result[launcher]['phases_s'][phase]:>25.3f}s" for launcher in rounds))
    print(f"{'total':24}" + "".join(f"{result[launcher]['total_s']:>25.3f}s" for launcher in rounds))
    print(f"{'steps lost':24}" + "".join(f"{result[launcher]['steps_lost']:>26g}" for launcher in rounds))
    print(f"{'ranks restarted':24}" + "".join(f"{str(result[launcher]['restarted_ranks']):>26}" for launcher in rounds))
    for launcher, ratio in result["ratio"].items():
        print(f"ratio {launcher} / torchrun --standalone: {ratio:.2f}x (goal <= 0.5x)")
    print("restored from: " + "; ".join(f"{launcher}: {result[launcher]['tiers']}" for launcher in rounds))


if __name__ == "__main__":
    main()
