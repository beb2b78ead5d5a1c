"""A small data-parallel job for ``ckptd launch`` tests: ``ckptd launch ... -m harness.elastic_training``.

Every rank trains the same tiny model on its share of a deterministic sample stream (a seeded permutation
of sample ids, whose position is checkpointed), averages gradients with gloo, and checkpoints every
``--every`` steps through :meth:`ckptd.elastic.WorkerContext.checkpoint_manager` into ``<root>/rank<r>``.
The sample ids each rank consumed are part of the state (one row per step), so a recovery that skipped or
repeated a batch shows in them.

With ``--kill-rank R --kill-step S`` rank R sends itself ``--kill-signal`` (KILL, or STOP for a hang)
at step S of the first generation, ``--kill-phase`` before the step's collectives, before or after that
step's save, before it once the earlier saves are committed, once that save is committed, or
(``before-commit-marker``) from its writer thread once that save is agreed and committed in every other
rank's directory, before it writes its own commit marker; with ``--kill-generations N`` also at the first step of generations 1 to N-1 (a crash loop).
With ``--kill-in-restore`` the process that replaces rank R SIGKILLs itself once more, inside its own
restore: at its first read of a data file of the step agreed on (metadata read, step agreed, no tensor loaded
yet), once per job (``rank<R>-killed-in-restore.json``, written first, keeps the next replacement from it).
Each rank writes,
for every generation it joins, ``rank<r>-gen<g>.json`` (pid, restored step, tier, its OS threads and open files, wall-clock times of
entering the generation, of the restore and of its first completed step; the victim also writes
``rank<r>-killed.json`` just before the signal) and at the end
``rank<r>-final.json`` (weights, optimizer state, sample ids) into ``--out``, and after each save that
staged a step ``rank<r>-staged.json`` (the steps staged, by generation). Its model, optimizer and data stream
are built by ``setup_fn`` (:func:`ckptd.elastic.run`); a warm spare writes ``spare-<pid>.json`` (its pid and
node) once it has built them, and ``--kill-when-spare-ready`` holds the kill until one of the victim's node has (``--kill-spare-first``: then the
victim SIGKILLs that spare first; ``--spare-setup-until-assigned``: a spare's setup ends only once it was
handed a rank). ``--also-kill-rank R`` kills rank R too, at the same step and phase. With an
object tier (:mod:`harness.elastic_tiered_training`) ``--kill-once-promoted`` holds the victim's signal
until that tier holds a committed step.

``--step-sleep S`` makes every step S seconds longer (a job still running when a test acts on it).

``--poison-rank R --poison-step K`` poisons rank R's step K of the first generation with NaN weights, with
correct hashes: ``--poison-how saved`` saves NaN weights as step K (memory and disk hold them; the live
model keeps its own, so training goes on as if nothing happened), ``memory`` overwrites the staged copy
in host memory once step K is committed (a fault in RAM only a fake can make; disk stays good).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Whether this process found torch imported before its first line ran (forked by ``ckptd launch``, whose default is ``--preload``).
PRELOADED = "torch" in sys.modules

import torch  # noqa: E402 - after PRELOADED
import torch.distributed as dist  # noqa: E402

import ckptd
from ckptd import elastic
from ckptd.elastic import keys as elastic_keys
from ckptd.format.layout import MANIFEST_NAME, step_file
from harness.processes import process_alive

SAMPLES = 96
BATCH_PER_RANK = 4


class SampleStream:
    """Sample ids in a seeded order, epoch after epoch; its position is checkpointed (``state_dict``)."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch, self.position = seed, 0, 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))

    def take(self, count: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < count:
            if self.position == SAMPLES:
                self.epoch, self.position = self.epoch + 1, 0
            order = self._order()
            step = min(count - len(ids), SAMPLES - self.position)
            ids.extend(int(i) for i in order[self.position:self.position + step])
            self.position += step
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])


def _hex(tensor: torch.Tensor) -> str:
    return tensor.detach().contiguous().numpy().tobytes().hex()


def _signal_self(name: str) -> None:
    os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def _save(manager: ckptd.CheckpointManager, step: int, state: dict[str, Any], *, poison: str | None) -> bool:
    """``manager.save``; with ``poison`` the step is saved with NaN weights ("saved"), or its staged copy
    is overwritten with NaN once committed ("memory")."""
    model = state["model"]
    if poison == "saved":
        kept = {name: value.clone() for name, value in model.state_dict().items()}
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
        try:
            return manager.save(step, state)
        finally:
            model.load_state_dict(kept)
    saved = manager.save(step, state)
    if poison == "memory":
        manager.wait()
        copy = manager._saver.memory  # the fault: RAM damaged after the commit, behind the manager's back
        assert copy is not None and copy.step == step and copy.committed, "step to poison not in memory"
        for name, tensor in copy.staged.tensors.items():
            if name.startswith("model") and tensor.is_floating_point():
                tensor.fill_(float("nan"))
    return saved


def _wait_for_a_promoted_step(manager: ckptd.CheckpointManager, timeout_s: float = 120.0) -> None:
    """``--kill-once-promoted``: until the manager's object tier holds a committed step."""
    deadline = time.monotonic() + timeout_s
    while manager.remote is None or not manager.remote.committed_steps():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step was committed on the object tier within {timeout_s} s")
        time.sleep(0.05)


def _die(args: argparse.Namespace, manager: ckptd.CheckpointManager) -> None:
    """The victim's signal (``--kill-signal``), once the object tier holds a step with ``--kill-once-promoted``."""
    if args.kill_once_promoted:
        _wait_for_a_promoted_step(manager)
    _signal_self(args.kill_signal)


def _die_before_commit_marker(manager: ckptd.CheckpointManager, step: int, others: list[Path]) -> None:
    """The fault of ``--kill-phase before-commit-marker``: this rank's writer SIGKILLs the process once the
    commit of ``step`` is agreed and the other ranks' directories (``others``) hold it committed, just before
    it writes its own commit marker (a moment no signal sent from outside can hit). Wraps the real commit."""
    commit = manager._saver._commit
    real = commit.commit

    def dying(at: int, manifest_bytes: bytes, **options: Any) -> None:
        if at == step:
            deadline = time.monotonic() + 60.0
            while not all((other / step_file(step, MANIFEST_NAME)).exists() for other in others):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step} was not committed by the other ranks within 60 s")
                time.sleep(0.01)
            _signal_self("KILL")
        real(at, manifest_bytes, **options)

    commit.commit = dying  # type: ignore[method-assign]


def _die_in_restore(manager: ckptd.CheckpointManager, marker: Path, generation: int) -> None:
    """The fault of ``--kill-in-restore``: this process SIGKILLs itself at the first read of a data file
    (``*.data``, a tensor's bytes) from the manager's local tier, unless ``marker`` exists; it creates
    ``marker`` (exclusively: one reader thread alone dies) just before, naming the process, ``generation`` and
    the file. Wraps the local tier's reads, so the signal lands inside the restore's load, wherever it reads."""
    tier = manager.local
    for name in ("read_bytes", "read_into", "read_whole_into"):
        real = getattr(tier, name)

        def dying(path: str, *args: Any, _real: Any = real, **options: Any) -> Any:
            if path.endswith(".data") and not marker.exists():
                try:
                    with marker.open("x") as sink:
                        json.dump({"pid": os.getpid(), "generation": generation, "path": path, "at": time.time()},
                                  sink)
                except FileExistsError:  # another reader thread is dying already
                    pass
                else:
                    _signal_self("KILL")
            return _real(path, *args, **options)

        setattr(tier, name, dying)


def _wait_for_the_assignment(timeout_s: float = 120.0) -> None:
    """In a spare (``--spare-setup-until-assigned``): hold the setup until the supervisor has handed this
    spare a rank, so that the rank is handed to a spare whose setup is not done."""
    host, _, port = os.environ[elastic_keys.ENV_STORE].rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=timeout_s))
    node, ident = int(os.environ.get("GROUP_RANK", "0")), int(os.environ[elastic_keys.ENV_SPARE])
    store.wait([elastic_keys.spare_assignment(node, ident)], timedelta(seconds=timeout_s))


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """What the job builds before it knows its rank (``setup_fn``): a warm spare has it ready."""
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    built = {"features": torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(args.seed)),
             "state": {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01),
                       "data": SampleStream(args.seed),
                       "seen": torch.full((args.steps, BATCH_PER_RANK), -1, dtype=torch.int64)}}
    if elastic_keys.ENV_SPARE in os.environ and args.spare_setup_until_assigned:
        _wait_for_the_assignment()
    if elastic_keys.ENV_SPARE in os.environ:
        (Path(args.out) / f"spare-{os.getpid()}.json").write_text(json.dumps({
            "pid": os.getpid(), "node": int(os.environ.get("GROUP_RANK", "0")), "ready_at": time.time()}))
    return built


def _spares_of(out: Path, node: int) -> list[Path]:
    found = []
    for path in out.glob("spare-*.json"):
        try:
            if json.loads(path.read_text())["node"] == node:
                found.append(path)
        except (FileNotFoundError, json.JSONDecodeError):  # being written
            pass
    return found


def _wait_for_a_spare(out: Path, node: int, timeout_s: float = 120.0) -> None:
    """Until a warm spare of ``node`` finished its setup (it writes ``spare-<pid>.json``), so that the kill
    finds it ready."""
    deadline = time.monotonic() + timeout_s
    while not _spares_of(out, node):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no warm spare finished its setup within {timeout_s} s")
        time.sleep(0.05)
    time.sleep(0.2)  # its ready key follows the file


def _kill_the_spares(out: Path, timeout_s: float = 60.0) -> None:
    """SIGKILL every warm spare that finished its setup and wait until each is dead (a zombie its supervisor
    has not reaped yet counts as dead)."""
    for path in out.glob("spare-*.json"):
        pid = json.loads(path.read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while process_alive(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm spare {pid} still runs {timeout_s} s after SIGKILL")
            time.sleep(0.01)


def _train(ctx: elastic.WorkerContext, args: argparse.Namespace) -> None:
    features, state = ctx.setup["features"], ctx.setup["state"]
    model, optim, stream, seen = state["model"], state["optim"], state["data"], state["seen"]
    entered = time.time()
    manager = ctx.checkpoint_manager(Path(args.root) / f"rank{ctx.rank}",
                                     policy=ckptd.Policy(every_steps=args.every, keep_local=3))
    if ctx.rank == args.kill_rank and ctx.generation == 0 and args.kill_phase == "before-commit-marker":
        _die_before_commit_marker(manager, args.kill_step, [Path(args.root) / f"rank{other}"
                                                           for other in range(ctx.world_size) if other != ctx.rank])
    if args.kill_in_restore and ctx.rank == args.kill_rank and ctx.generation > 0 and ctx.rejoined == 0:
        _die_in_restore(manager, Path(args.out) / f"rank{ctx.rank}-killed-in-restore.json", ctx.generation)
    start = manager.restore(state)
    out = Path(args.out)
    record = {"pid": os.getpid(), "generation": ctx.generation, "restored": start, "restart_count": ctx.restart_count,
              "rejoined": ctx.rejoined, "tier": manager.last_restore.tier if manager.last_restore else None,
              "entered_at": entered, "restored_at": time.time(),
              # the process's OS threads and open files: a survivor's must not grow from generation to generation
              "tasks": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
              "threads": sorted(thread.name for thread in threading.enumerate()), "preloaded": PRELOADED,
              "parent": os.getppid(),
              # objects frozen out of the GC (ckptd.elastic.run freezes what setup built, once per process)
              "frozen": gc.get_freeze_count()}
    record_path = out / f"rank{ctx.rank}-gen{ctx.generation}.json"
    staged_path = out / f"rank{ctx.rank}-staged.json"
    staged = json.loads(staged_path.read_text()) if staged_path.exists() else {}
    record_path.write_text(json.dumps(record))
    for step in range((start or 0) + 1, args.steps + 1):
        victim = ctx.rank == args.kill_rank and (step == args.kill_step if ctx.generation == 0 else
                                                 ctx.generation < args.kill_generations and step == (start or 0) + 1)
        victim = victim or (ctx.generation == 0 and ctx.rank == args.also_kill_rank and step == args.kill_step)
        if victim and args.kill_when_spare_ready:  # the saves so far committed, a spare ready
            manager.wait()
            _wait_for_a_spare(out, ctx.node_rank)
            if args.kill_spare_first and ctx.rank == args.kill_rank:
                _kill_the_spares(out)
        if victim:
            (out / f"rank{ctx.rank}-killed.json").write_text(json.dumps({"step": step, "at": time.time()}))
        if victim and args.kill_phase == "before-step":
            _die(args, manager)
        if step == (start or 0) + 2:  # the first step of this generation completed
            record_path.write_text(json.dumps(record | {"first_step_at": time.time()}))
        elastic.heartbeat()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ids = stream.take(BATCH_PER_RANK * ctx.world_size)[ctx.rank::ctx.world_size]
        seen[step - 1] = torch.tensor(ids)
        inputs = features[ids]
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True).sin()).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= ctx.world_size
        optim.step()
        if victim and args.kill_phase == "before-save-committed":
            manager.wait()  # the earlier saves are committed on every rank; this step's never will be
        if victim and args.kill_phase in ("before-save", "before-save-committed"):
            _die(args, manager)
        poisoned = ctx.generation == 0 and ctx.rank == args.poison_rank and step == args.poison_step
        if _save(manager, step, state, poison=args.poison_how if poisoned else None):
            staged.setdefault(str(ctx.generation), []).append(step)
            (out / f"rank{ctx.rank}-staged.json").write_text(json.dumps(staged))
        if victim and args.kill_phase == "after-commit":
            manager.wait()
        if victim and args.kill_phase in ("after-save", "after-commit"):
            _die(args, manager)
    manager.close()
    optimizer_state = {f"{index}.{name}": _hex(value) if isinstance(value, torch.Tensor) else repr(value)
                       for index, entry in optim.state_dict()["state"].items() for name, value in entry.items()}
    final = {"weights": {name: _hex(value) for name, value in model.state_dict().items()},
             "optimizer": optimizer_state, "seen": seen.tolist(), "data": stream.state_dict()}
    (out / f"rank{ctx.rank}-final.json").write_text(json.dumps(final))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-signal", choices=("KILL", "STOP"), default="KILL")
    parser.add_argument("--kill-phase", choices=("before-step", "before-save", "before-save-committed", "after-save",
                                                       "after-commit", "before-commit-marker"),
                        default="after-save")
    parser.add_argument("--kill-once-promoted", action="store_true",
                        help="the victim's signal waits until the object tier holds a committed step")
    parser.add_argument("--kill-generations", type=int, default=1)
    parser.add_argument("--kill-in-restore", action="store_true",
                        help="the replacement of --kill-rank SIGKILLs itself once, in its restore's first data read")
    parser.add_argument("--kill-when-spare-ready", action="store_true")
    parser.add_argument("--kill-spare-first", action="store_true",
                        help="with --kill-when-spare-ready: the victim SIGKILLs the ready spares before it dies")
    parser.add_argument("--spare-setup-until-assigned", action="store_true",
                        help="a warm spare's setup ends only once it was handed a rank")
    parser.add_argument("--also-kill-rank", type=int, default=-1,
                        help="a second victim, killed at the same step, phase and signal in generation 0")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (a longer job)")
    parser.add_argument("--poison-rank", type=int, default=-1)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--poison-how", choices=("saved", "memory"), default="saved")
    args = parser.parse_args(argv)
    if os.environ.get("CKPTD_TEST_LOG_LEVEL"):  # a test that reads ckptd's INFO lines from the ranks' output
        logging.basicConfig(level=os.environ["CKPTD_TEST_LOG_LEVEL"], format=f"rank %(process)d: %(message)s")
    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    elastic.run(lambda ctx: _train(ctx, args), setup_fn=lambda: _setup(args))


if __name__ == "__main__":
    main()
