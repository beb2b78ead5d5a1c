"""``ckptd bench``: how fast ckptd saves and restores on this disk, against torch.save and DCP.

Prints medians and the ratios the performance targets are stated in, and the checkpoint interval
that minimises lost time for a mean time between failures (Young/Daly), from the measured save cost.
"""

from __future__ import annotations

import json
import re

import click

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _parse_size(value: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{value!r} is not a size like 256MiB or 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@click.command("bench")
@click.option("--size", default="1GiB", show_default=True, envvar="CKPTD_BENCH_SIZE",
              help="Total fp32 state size (env: CKPTD_BENCH_SIZE).")
@click.option("--tensor-size", default="64MiB", show_default=True, envvar="CKPTD_BENCH_TENSOR_SIZE",
              help="Size of each tensor of the state (env: CKPTD_BENCH_TENSOR_SIZE).")
@click.option("--dir", "directory", default=None, envvar="CKPTD_BENCH_DIR",
              help="Directory on the disk to measure (env: CKPTD_BENCH_DIR; default: the system temp dir).")
@click.option("--repeats", default=3, show_default=True, envvar="CKPTD_BENCH_REPEATS",
              help="Runs per measurement; medians are reported (env: CKPTD_BENCH_REPEATS).")
@click.option("--io-threads", default=None, type=int, envvar="CKPTD_IO_THREADS",
              help="ckptd's hashing/writing threads (env: CKPTD_IO_THREADS).")
@click.option("--read-threads", default=None, type=int, envvar="CKPTD_READ_THREADS",
              help="ckptd's reading/verifying threads on restore (env: CKPTD_READ_THREADS).")
@click.option("--codec", default="raw", show_default=True, type=click.Choice(["raw", "zstd", "byteplane"]),
              envvar="CKPTD_CODEC", help="ckptd codec (env: CKPTD_CODEC).")
@click.option("--mtbf-hours", default=24.0, show_default=True, envvar="CKPTD_BENCH_MTBF_HOURS",
              help="Mean time between failures for the interval advice (env: CKPTD_BENCH_MTBF_HOURS).")
@click.option("--compare-writers", is_flag=True, envvar="CKPTD_BENCH_COMPARE_WRITERS",
              help="Also compare writer threads with a writer process fed through shared memory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(size: str, tensor_size: str, directory: str | None, repeats: int, io_threads: int | None,
          read_threads: int | None, codec: str, mtbf_hours: float, compare_writers: bool, as_json: bool) -> None:
    """Measure save stall, durable throughput, restore and training slowdown against torch.save and DCP."""
    from ckptd.bench.runner import BenchOptions, ratios, run_bench
    from ckptd.config import settings

    options = BenchOptions(size_bytes=_parse_size(size), tensor_bytes=_parse_size(tensor_size), repeats=repeats,
                           directory=directory, io_threads=io_threads or settings().io_threads,
                           read_threads=read_threads or settings().read_threads, codec=codec,
                           mtbf_hours=mtbf_hours, compare_writers=compare_writers)
    progress = (lambda _: None) if as_json else (lambda what: click.echo(f"... {what}", err=True))
    report = run_bench(options, progress)
    derived = ratios(report)
    if as_json:
        click.echo(json.dumps({"state_bytes": report.state_bytes, "options": report.options,
                               "seconds": report.seconds, "loop_ratio": report.loop, "writers": report.writers,
                               "ratios": derived}, indent=1))
        return
    _print_table(report, derived)


def _print_table(report: object, derived: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report.seconds  # type: ignore[attr-defined]
    gib = report.state_bytes / (1 << 30)  # type: ignore[attr-defined]
    table = Table(title=f"ckptd bench: {gib:.2f} GiB fp32 state, medians")
    for column in ("measure", "ckptd", "compared with", "ratio", "target"):
        table.add_column(column)
    table.add_row("save stall (s)", f"{s['ckptd_stall']:.3f}", f"copy_ {s['copy']:.3f}",
                  f"{derived['stall_vs_copy']:.2f}x copy", "<= 1.2x")
    table.add_row("  DCP async_save stall (s)", "", f"{s['dcp_async_stall']:.3f}",
                  f"{derived['dcp_async_stall_vs_copy']:.2f}x copy", "")
    table.add_row("  first save stall (allocates)", f"{s['ckptd_first_stall']:.3f}", "", 
                  f"{derived['first_stall_vs_copy']:.2f}x copy", "")
    table.add_row("  first save, new manager (s)", f"{s['ckptd_first_stall_cold']:.3f}", "",
                  f"{derived['first_stall_cold_vs_later']:.2f}x later saves", "")
    table.add_row("  ... buffers prepared after restore", f"{s['ckptd_first_stall_prepared']:.3f}", "",
                  f"{derived['first_stall_prepared_vs_later']:.2f}x later saves", "~1x")
    table.add_row("durable save (s)", f"{s['ckptd_durable']:.3f}",
                  f"torch.save+fsync {s['torch_save']:.3f} / DCP x4 {s['dcp_save']:.3f}",
                  f"{derived['durable_speedup_vs_best']:.2f}x faster than best", ">= 1.0x")
    table.add_row("restore, verified (s)", f"{s['ckptd_restore']:.3f}",
                  f"torch.load {s['torch_load']:.3f} / dcp.load {s['dcp_load']:.3f}",
                  f"{derived['restore_speedup_vs_best']:.2f}x faster than best", ">= 1.0x")
    for kind, label in (("live", "into written tensors"), ("untouched", "into torch.empty_like"),
                        ("absent", "into an empty state")):
        key = "ckptd_restore" if kind == "live" else f"ckptd_restore_{kind}"
        table.add_row(f"  restore {label} (s)", f"{s[key]:.3f}", f"torch.load {s['torch_load']:.3f}",
                      f"{derived[f'restore_{kind}_vs_torch_load']:.2f}x faster", ">= 1.0x")
    table.add_row("compute loop during save", f"{derived['loop_ratio_ckptd']:.2f}x",
                  f"DCP async_save {derived['loop_ratio_dcp_async']:.2f}x", "of undisturbed speed", ">= 0.9x")
    Console().print(table)
    for name, figures in report.writers.items():  # type: ignore[attr-defined]
        click.echo(f"writer {name}: stall {figures['stall_s']:.3f} s, durable {figures['durable_s']:.3f} s, "
                   f"compute loop {figures['loop_ratio']:.2f}x")
    hours = report.options["mtbf_hours"]  # type: ignore[attr-defined]
    click.echo(f"save cost {derived['save_cost_s']:.3f} s -> checkpoint every "
               f"{derived['young_daly_interval_s'] / 60:.1f} min for an MTBF of {hours:g} h (Young/Daly: "
               "sqrt(2 x save cost x MTBF))")
