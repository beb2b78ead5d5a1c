"""``ckptd goodput``: simulate a job's failures and recoveries for ckptd against checkpoint-and-restart-all.

It takes ``ckptd plan``'s model, layout, bandwidth (``--measure`` too) and failure-rate options, makes the
plan, and from its staging, commit and restore times (:func:`~ckptd.planning.simulate.strategies_from_plan`)
simulates ``--runs`` seeded traces of ``--job-days`` days of the job (:mod:`ckptd.planning.simulate`). It
prints, per strategy, goodput, failures, lost work, downtime and time to recover at the planned interval and
at the interval that maximises the simulated goodput. The same options and seed give the same figures.
docs/goodput.md explains the model and compares it with published figures.
"""

from __future__ import annotations

from typing import Any

import click

from ckptd.cli.options import json_option, print_json
from ckptd.cli.plan_cmd import plan as _plan_command
from ckptd.cli.plan_cmd import duration_text, plan_inputs

#: ``ckptd plan``'s options that make no sense here: the run's length (``--job-days`` is the simulated wall
#: time instead) and the output switch (this command has its own).
_NOT_SHARED = frozenset({"as_json", "tokens", "tflops_per_gpu", "run_days"})


def _shared_options(command: click.Command) -> click.Command:
    command.params[:0] = [param for param in _plan_command.params if param.name not in _NOT_SHARED]
    return command


@_shared_options
@click.command("goodput")
@click.option("--job-days", type=float, default=54.0, show_default=True,
              help="Wall-clock days of the job to simulate (each run).")
@click.option("--runs", type=int, default=20, show_default=True,
              help="Independent seeded failure traces to simulate; figures are over all of them.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the failure traces.")
@click.option("--process-share", type=float, default=0.17, show_default=True,
              help="Share of failures that kill a process and leave its node up.")
@click.option("--node-share", type=float, default=0.78, show_default=True,
              help="Share of failures that lose a node with its local disk (Llama 3: ~78% hardware).")
@click.option("--hang-share", type=float, default=0.05, show_default=True,
              help="Share of failures where a rank hangs and is found by a timeout.")
@click.option("--spares/--no-spares", default=True, show_default=True,
              help="ckptd: warm spare processes and a spare node; without, a new process starts and a lost "
                   "node waits for --node-replace-minutes (restart-all waits for it too).")
@click.option("--node-replace-minutes", type=float, default=15.0, show_default=True,
              help="Without spares: time until a replacement for a lost node joins.")
@click.option("--hang-timeout", type=float, default=300.0, show_default=True,
              help="ckptd: seconds without a heartbeat before a hung rank is replaced (ckptd launch --hang-timeout).")
@click.option("--node-timeout", type=float, default=30.0, show_default=True,
              help="Seconds until a lost node is noticed (ckptd launch --node-timeout).")
@click.option("--regroup-seconds", type=float, default=60.0, show_default=True,
              help="ckptd: time to re-form the job's process group around a replaced rank.")
@click.option("--process-start-seconds", type=float, default=30.0, show_default=True,
              help="ckptd without spares: a replacement process's start (import torch, build model and optimizer).")
@click.option("--collective-timeout-minutes", type=float, default=10.0, show_default=True,
              help="restart-all: time until a hang is found (the collective's timeout).")
@click.option("--interval-seconds", type=float, default=None,
              help="ckptd's checkpoint interval (default: the plan's for the local tier).")
@click.option("--baseline-interval-seconds", type=float, default=None,
              help="restart-all's interval (default: Daly's for its synchronous save to the object tier).")
@json_option
def goodput(job_days: float, runs: int, seed: int, process_share: float, node_share: float, hang_share: float,
            spares: bool, node_replace_minutes: float, hang_timeout: float, node_timeout: float,
            regroup_seconds: float, process_start_seconds: float, collective_timeout_minutes: float,
            interval_seconds: float | None, baseline_interval_seconds: float | None, as_json: bool,
            **options: Any) -> None:
    """Simulate failures of a planned job: goodput, lost work and time to recover, ckptd against restart-all,
    and the interval that maximises goodput."""
    from ckptd.planning import make_plan
    from ckptd.planning.simulate import FailureModel, RecoveryTimes, goodput_report, strategies_from_plan

    inputs = plan_inputs(tokens=None, tflops_per_gpu=None, run_days=None, **options)
    plan = make_plan(inputs)
    times = RecoveryTimes(node_detect_s=node_timeout, hang_detect_s=hang_timeout, spares=spares,
                          process_start_s=process_start_seconds, regroup_s=regroup_seconds,
                          node_replace_s=node_replace_minutes * 60.0,
                          baseline_hang_detect_s=collective_timeout_minutes * 60.0)
    ckptd, baseline = strategies_from_plan(plan, times)
    model = FailureModel(mttf_s=inputs.mtbf_hours * 3600.0, process=process_share, node=node_share,
                         hang=hang_share)
    intervals = (plan.tiers["local"].interval.seconds if interval_seconds is None else interval_seconds,
                 plan.tiers["object"].sync.interval.seconds if baseline_interval_seconds is None
                 else baseline_interval_seconds)
    report = goodput_report(list(zip((ckptd, baseline), intervals)), model, gpus=inputs.layout.world_size,
                            days=job_days, runs=runs, seed=seed)
    document = report.as_json()
    document["plan"] = {"staging_seconds": plan.staging_s,
                        "restore_seconds": {name: tier.restore_s for name, tier in plan.tiers.items()},
                        "restorable_seconds": {name: tier.restorable_s for name, tier in plan.tiers.items()},
                        "restart_seconds": inputs.restart_s, "spares": spares}
    if as_json:
        print_json(document)
        return
    _print_report(document)


def _print_report(document: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = 120
    failures = document["failures"]
    shares = ", ".join(f"{kind} {share:.0%}" for kind, share in failures["shares"].items())
    console.print(f"{document['gpus']} GPUs, {document['runs']} runs of {document['days']:g} days (seed "
                  f"{document['seed']}); job MTTF {duration_text(failures['job_mttf_hours'] * 3600)} ({shares})")
    table = Table("strategy", "interval", "goodput", "p10-p90", "failures", "lost work", "downtime/failure",
                  "recovered in", title="simulated goodput (planned interval, then the best one)")
    for name, figures in document["strategies"].items():
        for label, outcome in (("planned", figures["planned"]), ("best", figures["best"])):
            runs = outcome["failures"]
            table.add_row(f"{name} ({label})", duration_text(outcome["interval_seconds"]), f"{outcome['goodput']:.2%}",
                          f"{outcome['goodput_p10']:.1%}-{outcome['goodput_p90']:.1%}",
                          f"{sum(runs.values()) / document['runs']:.3g}/run",
                          f"{outcome['lost_work_gpu_hours'] / document['runs']:.3g} GPU-h/run",
                          duration_text(outcome["mean_downtime_seconds"]), duration_text(outcome["mean_recovery_seconds"]))
    console.print(table)
    costs = Table("strategy", "stall", "commit (process/node)", "detect (process/node/hang)",
                  "recover (process/node/hang)", title="costs per checkpoint and per failure")
    for name, figures in document["strategies"].items():
        cost = figures["costs"]
        costs.add_row(name, duration_text(cost["stall_seconds"]),
                      " / ".join(duration_text(cost["commit_seconds"][kind]) for kind in ("process", "node")),
                      " / ".join(duration_text(cost["detect_seconds"][kind]) for kind in ("process", "node", "hang")),
                      " / ".join(duration_text(cost["recover_seconds"][kind]) for kind in ("process", "node", "hang")))
    console.print(costs)
