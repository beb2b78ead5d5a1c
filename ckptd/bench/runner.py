"""``ckptd bench``: measure ckptd against torch.save and DCP on the user's disk and state size.

:func:`run_bench` runs every contender ``repeats`` times (medians) on one fp32 state and returns a
:class:`BenchReport`; :func:`ratios` derives the figures the issue's targets are stated in. Each
disturbed compute-loop measurement is compared with an undisturbed one taken just before it, because
other work on the machine changes the loop's speed over time. Main thread.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptd.bench import contenders as c
from ckptd.bench.workloads import ComputeLoop, make_state, median, state_bytes
from ckptd.planning.failures import young_interval_s


@dataclass(frozen=True)
class BenchOptions:
    size_bytes: int = 1 << 30
    tensor_bytes: int = 64 << 20
    repeats: int = 3
    directory: str | None = None
    io_threads: int = 2
    read_threads: int = 4
    codec: str = "raw"
    mtbf_hours: float = 24.0
    loop_seconds: float = 1.0
    compare_writers: bool = False


@dataclass
class BenchReport:
    """Medians in seconds (loop figures are ratios to the undisturbed loop)."""

    state_bytes: int
    options: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    loop: dict[str, float] = field(default_factory=dict)
    writers: dict[str, dict[str, float]] = field(default_factory=dict)


def _ckptd_durable(saver: c.CkptdContender, state: dict[str, Any], copy: Callable[[], float],
                   runs: dict[str, list[float]]) -> None:
    runs["copy"].append(copy())  # right before the stall it is compared with
    durable = saver.save(state)
    runs["ckptd_stall"].append(durable.stall)
    runs["ckptd_durable"].append(durable.durable)


def _ckptd_restore(state: dict[str, Any], directory: Path, read_threads: int, kind: str,
                   runs: dict[str, list[float]]) -> Callable[[], None]:
    key = "ckptd_restore" if kind == "live" else f"ckptd_restore_{kind}"
    return lambda: runs[key].append(c.restore_ckptd(state, directory, read_threads=read_threads, targets=kind))


def _take_turns(round_number: int, contenders: list[Callable[[], None]]) -> None:
    """Run every contender once, a different one first in each round."""
    for index in range(len(contenders)):
        contenders[(index + round_number) % len(contenders)]()


def _with_loop(loop: ComputeLoop, seconds: float, save: Callable[[float], c.SaveRun]) -> c.SaveRun:
    baseline = loop.run_for(seconds).rate
    return save(baseline)


def run_bench(options: BenchOptions, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Run every measurement; writes under ``options.directory`` (a temporary directory by default).

    Contenders are interleaved within each round (rather than all repeats of one, then the next) so
    that they see the same disk and machine load; durable times are taken without the compute loop,
    loop ratios in separate saves.
    """
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-", dir=options.directory) as scratch:
        root = Path(scratch)
        state = make_state(options.size_bytes, options.tensor_bytes)
        report = BenchReport(state_bytes=state_bytes(state), options=asdict(options))
        loop, repeats = ComputeLoop(), max(1, options.repeats)
        runs: dict[str, list[float]] = defaultdict(list)
        copy = c.copy_baseline(state)
        copy()
        ckptd_saver = c.CkptdContender(c.fresh(root / "ckptd"), io_threads=options.io_threads, codec=options.codec)
        try:
            runs["ckptd_first_stall"].append(ckptd_saver.save(state).stall)
            for round_number in range(1, repeats + 1):
                progress(f"round {round_number}/{repeats}: saves")
                # The durable savers take turns going first: a save right after another one competes
                # with the disk's write-back of the previous files.
                _take_turns(round_number, [
                    lambda: runs["torch_save"].append(c.torch_save(state, c.fresh(root / "torch")).durable),
                    lambda: runs["dcp_save"].append(c.dcp_save(state, c.fresh(root / "dcp")).durable),
                    lambda: _ckptd_durable(ckptd_saver, state, copy, runs),
                ])
                plain_async = c.dcp_async_save(state, c.fresh(root / "dcp_async"), None, None)
                runs["dcp_async_stall"].append(plain_async.stall)
                runs["dcp_async_durable"].append(plain_async.durable)
                progress(f"round {round_number}/{repeats}: compute loop beside background saves")
                beside = _with_loop(loop, options.loop_seconds, lambda base: ckptd_saver.save(state, loop, base))
                runs["loop_ckptd"].append(beside.loop_ratio)  # type: ignore[arg-type]
                beside = _with_loop(loop, options.loop_seconds, lambda base: c.dcp_async_save(
                    state, c.fresh(root / "dcp_async"), loop, base))
                runs["loop_dcp_async"].append(beside.loop_ratio)  # type: ignore[arg-type]
                progress(f"round {round_number}/{repeats}: first saves of new managers")
                _take_turns(round_number, [
                    lambda: runs["ckptd_first_stall_cold"].append(c.first_save_stall(
                        state, root / "first", io_threads=options.io_threads, codec=options.codec, prepared=False)),
                    lambda: runs["ckptd_first_stall_prepared"].append(c.first_save_stall(
                        state, root / "first", io_threads=options.io_threads, codec=options.codec, prepared=True)),
                ])
                progress(f"round {round_number}/{repeats}: restores (cold page cache)")
                _take_turns(round_number, [  # reads right after heavy writes are slower: take turns too
                    lambda: runs["torch_load"].append(c.restore_torch_load(root / "torch")),
                    lambda: runs["dcp_load"].append(c.restore_dcp_load(state, root / "dcp")),
                    *[_ckptd_restore(state, root / "ckptd", options.read_threads, kind, runs) for kind in c.TARGETS],
                ])
        finally:
            ckptd_saver.close()
        for name, values in runs.items():
            if name.startswith("loop_"):
                report.loop[name[len("loop_"):]] = median(values)
            else:
                report.seconds[name] = median(values)
        if options.compare_writers:
            _compare_writers(state, root, loop, options, report, progress)
        return report


def _compare_writers(state: Any, root: Path, loop: ComputeLoop, options: BenchOptions, report: BenchReport,
                     progress: Callable[[str], None]) -> None:
    from ckptd.bench.writer_process import ProcessWriter

    candidates: dict[str, Callable[[], Any]] = {
        "thread, 1 io thread": lambda: c.CkptdContender(c.fresh(root / "w1"), io_threads=1),
        "thread, 2 io threads": lambda: c.CkptdContender(c.fresh(root / "w2"), io_threads=2),
        "process via shared memory": lambda: ProcessWriter(state, c.fresh(root / "wp")),
    }
    for name, make in candidates.items():
        progress(f"writer: {name}")
        writer = make()
        try:
            writer.save(state)  # first save allocates; not measured
            runs = [_with_loop(loop, options.loop_seconds, lambda base: writer.save(state, loop, base))
                    for _ in range(max(1, options.repeats))]
        finally:
            writer.close()
        report.writers[name] = {"stall_s": median([r.stall for r in runs]),
                                "durable_s": median([r.durable for r in runs]),
                                "loop_ratio": median([r.loop_ratio for r in runs if r.loop_ratio is not None])}


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Checkpoint interval that minimises lost time: sqrt(2 x save cost x MTBF) (Young/Daly)."""
    return young_interval_s(save_cost_s, mtbf_s)


def ratios(report: BenchReport) -> dict[str, float]:
    """The figures the targets are stated in (see docs/performance.md)."""
    s, loop = report.seconds, report.loop
    best_save = min(s["torch_save"], s["dcp_save"])
    best_load = min(s["torch_load"], s["dcp_load"])
    background = max(0.0, s["ckptd_durable"] - s["ckptd_stall"])
    save_cost = s["ckptd_stall"] + background * (1.0 - min(1.0, loop.get("ckptd", 1.0)))
    mtbf_s = float(report.options["mtbf_hours"]) * 3600.0
    gib = report.state_bytes / (1 << 30)
    return {
        "stall_vs_copy": s["ckptd_stall"] / s["copy"],
        "dcp_async_stall_vs_copy": s["dcp_async_stall"] / s["copy"],
        "first_stall_vs_copy": s["ckptd_first_stall"] / s["copy"],
        "durable_speedup_vs_best": best_save / s["ckptd_durable"],
        "durable_speedup_vs_torch_save": s["torch_save"] / s["ckptd_durable"],
        "durable_speedup_vs_dcp": s["dcp_save"] / s["ckptd_durable"],
        "durable_gib_per_s": gib / s["ckptd_durable"],
        "restore_speedup_vs_best": best_load / s["ckptd_restore"],
        "restore_live_vs_torch_load": s["torch_load"] / s["ckptd_restore"],
        "restore_untouched_vs_torch_load": s["torch_load"] / s["ckptd_restore_untouched"],
        "restore_absent_vs_torch_load": s["torch_load"] / s["ckptd_restore_absent"],
        "first_stall_cold_vs_later": s["ckptd_first_stall_cold"] / s["ckptd_stall"],
        "first_stall_prepared_vs_later": s["ckptd_first_stall_prepared"] / s["ckptd_stall"],
        "restore_gib_per_s": gib / s["ckptd_restore"],
        "loop_ratio_ckptd": loop.get("ckptd", float("nan")),
        "loop_ratio_dcp_async": loop.get("dcp_async", float("nan")),
        "save_cost_s": save_cost,
        "young_daly_interval_s": young_daly_interval_s(save_cost, mtbf_s),
    }
