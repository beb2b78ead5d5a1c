"""``ckptd plan``: what checkpointing a planned job will cost, before it runs.

From a model size (``--params`` or ``--config``), the bytes each parameter's state takes (``--state`` presets
named after what frameworks save, and the per-component ``--*-bytes``), a layout (``--tp --pp --dp --ep
--zero-stage --gpus-per-node``), the replica mode and directory layout (``--replicas``, by default what
``CheckpointManager`` would pick, ``--directories``), bandwidths (given, defaults, or ``--measure``d here),
retention, a failure rate and optionally the run's length (``--tokens --tflops-per-gpu`` or ``--run-days``), it
prints per rank and per node the bytes of a checkpoint, the staging stall, the durable time, restore time and
path and storage of each tier, the checkpoint interval per tier and the expected fraction of time lost, for
asynchronous (ckptd) and synchronous saves side by side, with the failures, hours lost and bytes written over
the run. The arithmetic and the ``--json`` schema are documented in :mod:`ckptd.planning.plan` and
docs/plan.md. Bad input exits 2 with one line naming the option.
"""

from __future__ import annotations

import os
import re
from typing import Any

import click

from ckptd.cli.options import json_option, print_json, s3_options, storage_options
from ckptd.planning.layout import DEFAULT_PRESET, DIRECTORY_LAYOUTS, PRESETS, REPLICA_MODES

_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
#: Parameter counts at or above this are refused (a typo, or a float that overflowed to infinity).
_MAX_COUNT = 1e18
#: The most ``--measure-mib`` may move (host memory holds two buffers of it, the GPU one).
_MAX_MEASURE_MIB = 4096
#: The fleet record the issue cites (Llama 3 405B pre-training), used when no failure rate is given.
_DEFAULT_FAILURES = (419.0, 54.0, 16384)
#: Bytes per parameter of each ``--state`` preset.
_PRESET_BYTES = {name: state.total for name, state in PRESETS.items()}
_BANDWIDTH_HELP = {
    "d2h": "device-to-host copy per GPU (pinned)",
    "host_memcpy": "host-memory copy per node (all its ranks together)",
    "disk": "local disk write per node",
    "peer": "network to the buddy node, per node",
    "object": "object-store upload per node",
    "object_job": "object-store limit for the whole job (default: none)",
}


def _parse_count(value: str | None, option: str, *, noun: str = "parameter count like 70e9 or 70B") -> int | None:
    """A count: ``70e9``, ``70B``, ``6.74b``, ``175_000_000_000``, ``1.4T``."""
    from ckptd.errors import ConfigError

    if value is None:
        return None
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-zA-Z]?)\s*", value, flags=re.I)
    if not match or match.group(2).lower() not in _COUNT_SUFFIXES:
        raise ConfigError(f"{option}: {value!r} is not a {noun}")
    scaled = float(match.group(1).replace("_", "")) * _COUNT_SUFFIXES[match.group(2).lower()]
    if not scaled < _MAX_COUNT:
        raise ConfigError(f"{option}: {value!r} is more than ckptd plan counts (at most 1e18)")
    count = round(scaled)
    if count < 1:
        raise ConfigError(f"{option}: {value!r}: the count must be at least 1")
    return count


def _bandwidth_options(command: Any) -> Any:
    for name in reversed(list(_BANDWIDTH_HELP)):
        flag = name.replace("_", "-")
        variable = f"CKPTD_PLAN_{name.upper()}_GB_PER_S"
        default = "" if name == "object_job" else " (default: see docs/plan.md)"
        command = click.option(f"--{flag}-gb-per-s", name, type=float, default=None, envvar=variable,
                               help=f"GB/s: gigabytes (1e9 bytes) per second, not gigabits (a 100 Gbit/s link "
                                    f"is 12.5), {_BANDWIDTH_HELP[name]}{default}. [env: {variable}]")(command)
    return command


@click.command("plan")
@click.option("--params", "params", default=None, metavar="COUNT",
              help="Parameter count (70e9, 70B). Or give --config.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="A model config (HF-style config.json, or TOML) to count the parameters from.")
@click.option("--tied-embeddings/--untied-embeddings", default=None,
              help="Whether the LM head shares the embedding (default: the config's tie_word_embeddings).")
@click.option("--expert-params", default=None, metavar="COUNT",
              help="With --params: how many of them are in experts (split over --ep).")
@click.option("--state", "preset", type=click.Choice(list(_PRESET_BYTES)), default=DEFAULT_PRESET, show_default=True,
              help="Bytes per parameter a checkpoint holds, as frameworks save it: "
                   + "; ".join(f"{name} {total:g}" for name, total in _PRESET_BYTES.items())
                   + " (fsdp2: fp32 parameters + two fp32 Adam moments; megatron: distributed optimizer; "
                     "deepspeed: ZeRO 1/2; see docs/plan.md).")
@click.option("--weight-bytes", type=float, default=None, help="Override: weight bytes per parameter.")
@click.option("--grad-bytes", type=float, default=None, help="Override: gradient bytes per parameter (0: not saved).")
@click.option("--master-bytes", type=float, default=None, help="Override: master-weight bytes per parameter.")
@click.option("--moment-bytes", type=float, default=None,
              help="Override: optimizer-moment bytes per parameter, all moments together.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel stages.")
@click.option("--dp", type=int, default=None, help="Data-parallel size (default 1, or what --world-size leaves).")
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel size (divides --dp).")
@click.option("--world-size", type=int, default=None, help="GPUs of the job; --dp is derived from it.")
@click.option("--zero-stage", type=int, default=0, show_default=True,
              help="ZeRO stage: 1 shards optimizer state over DP, 2 also grads, 3 also weights (FSDP).")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, envvar="CKPTD_PLAN_GPUS_PER_NODE",
              help="GPUs (ranks) per node. [env: CKPTD_PLAN_GPUS_PER_NODE]")
@click.option("--replicas", type=click.Choice(list(REPLICA_MODES)), default=None,
              help="How replicated pieces are written, as CheckpointManager(write_replicas=...) (default: what the "
                   "manager picks: once when the job has one local directory, else once-per-directory).")
@click.option("--directories", type=click.Choice(list(DIRECTORY_LAYOUTS)), default="per-node",
              show_default=True, help="Which ranks share a local-tier directory: a node's (one NVMe per node), none, "
                                      "or the whole job's (a parallel file system).")
@click.option("--no-dedup", "no_dedup", is_flag=True, hidden=True, help="Old name of --replicas every-rank.")
@_bandwidth_options
@click.option("--measure", is_flag=True,
              help="Measure host memcpy (one copier per rank of a node, up to this machine's cores), device-to-host (with a GPU), the disk of --local and the object store "
                   "of --measure-object here; bandwidths given as options win.")
@click.option("--local", "local_dir", type=click.Path(file_okay=False), default=None,
              help="With --measure: a directory on the local checkpoint disk.")
@click.option("--measure-object", default=None, metavar="URL",
              help="With --measure: an s3:// URL to upload a probe object to (it is deleted).")
@click.option("--measure-mib", type=int, default=256, show_default=True,
              help=f"MiB each measurement moves (1 to {_MAX_MEASURE_MIB}; a disk probe stops after 20 s).")
@s3_options
@click.option("--keep-local", type=int, default=2, show_default=True, help="Steps the local tier keeps.")
@click.option("--keep-peer", type=int, default=1, show_default=True, help="Steps the peer tier keeps.")
@click.option("--keep-remote", type=int, default=5, show_default=True, help="Steps the object tier keeps.")
@click.option("--mtbf-hours", type=float, default=None,
              help="The job's mean time between failures. Or give --failures --days --gpus.")
@click.option("--failures", type=float, default=None,
              help="Unexpected interruptions seen in a fleet (default 419: Llama 3 405B pre-training).")
@click.option("--days", type=float, default=None, help="Days over which --failures were seen (default 54).")
@click.option("--gpus", type=int, default=None, help="GPUs of that fleet (default 16384).")
@click.option("--restart-minutes", type=float, default=10.0, show_default=True,
              help="Time to notice a failure and restart, before the restore.")
@click.option("--tokens", default=None, metavar="COUNT",
              help="The run's training tokens (1.4T, 15e12): its length is 6 x parameters x tokens / (GPUs x "
                   "--tflops-per-gpu). Or give --run-days.")
@click.option("--tflops-per-gpu", type=float, default=None,
              help="With --tokens: the FLOP rate each GPU sustains in training, in TFLOP/s (e.g. 400).")
@click.option("--run-days", type=float, default=None, help="The run's length in days of training, without failures.")
@click.option("--object-store-limit-gb-per-s", "object_store_limit", type=float, default=None,
              help="Warn when the job-wide rate into the object store the plan assumes (nodes x "
                   "--object-gb-per-s) exceeds this many GB/s (default 100). [env: "
                   "CKPTD_PLAN_OBJECT_STORE_LIMIT_GB_PER_S]")
@json_option
def plan(as_json: bool, **options: Any) -> None:
    """Show what checkpointing a planned job costs: bytes per rank and node, times, storage, intervals, lost time,
    and with a run length the failures, hours lost and bytes written over the run, async against sync."""
    from ckptd.planning import make_plan

    result = make_plan(plan_inputs(**options))
    if as_json:
        print_json(result.as_json())
        return
    _print_plan(result.as_json())


def plan_inputs(params: str | None, config_path: str | None, tied_embeddings: bool | None, expert_params: str | None,
                preset: str, weight_bytes: float | None, grad_bytes: float | None, master_bytes: float | None,
                moment_bytes: float | None, tp: int, pp: int, dp: int | None, ep: int, world_size: int | None,
                zero_stage: int, gpus_per_node: int, replicas: str | None, directories: str, no_dedup: bool, measure: bool,
                local_dir: str | None, measure_object: str | None, measure_mib: int, endpoint_url: str | None,
                region: str | None, keep_local: int, keep_peer: int, keep_remote: int, mtbf_hours: float | None,
                failures: float | None, days: float | None, gpus: int | None, restart_minutes: float, tokens: str | None,
                tflops_per_gpu: float | None, run_days: float | None, object_store_limit: float | None,
                **gbps: float | None) -> Any:
    """The :class:`~ckptd.planning.PlanInputs` of ``plan``'s options (``ckptd goodput`` shares them)."""
    from dataclasses import replace

    from ckptd.errors import ConfigError
    from ckptd.planning import Bandwidths, Layout, PlanInputs, Retention
    from ckptd.planning.plan import DEFAULT_GBPS

    if no_dedup:
        if replicas not in (None, "every-rank"):
            raise ConfigError("--no-dedup is the old name of --replicas every-rank; it contradicts --replicas "
                              f"{replicas}")
        replicas = "every-rank"
    overrides = {name: value for name, value in (("weights", weight_bytes), ("grads", grad_bytes),
                                                 ("master", master_bytes), ("moments", moment_bytes))
                 if value is not None}
    state = replace(PRESETS[preset], **overrides)
    others = {"ep": ep, "zero_stage": zero_stage, "gpus_per_node": gpus_per_node}
    layout = Layout.for_world(world_size, tp=tp, pp=pp, dp=dp, **others) if world_size is not None \
        else Layout(tp=tp, pp=pp, dp=1 if dp is None else dp, **others)
    count, source = _parameters(params, config_path, tied_embeddings, expert_params, tp=layout.tp)
    mtbf_hours, rate = _mtbf(mtbf_hours, failures, days, gpus, job_gpus=layout.world_size)
    run = _run_length(tokens, tflops_per_gpu, run_days, parameters=count.total, gpus=layout.world_size)
    values, sources = _bandwidths(gbps, measure=measure, local_dir=local_dir, measure_object=measure_object,
                                  copiers=min(layout.ranks_per_node, os.cpu_count() or 1),
                                  nbytes=measure_mib << 20, options=storage_options(endpoint_url, region),
                                  defaults=DEFAULT_GBPS)
    inputs = PlanInputs(parameters=count, parameters_from=source, state=state, layout=layout, mtbf_hours=mtbf_hours,
                        mtbf_from="given" if rate is None else "failures", per_gpu_failures_per_hour=rate,
                        restart_s=restart_minutes * 60.0, replicas=replicas, directories=directories,
                        state_preset=None if overrides else preset,
                        bandwidths=Bandwidths(**values, sources=sources),
                        retention=Retention(keep_local=keep_local, keep_peer=keep_peer, keep_remote=keep_remote),
                        run=run, object_store_limit_gbps=object_store_limit)
    return inputs


def _run_length(tokens: str | None, tflops_per_gpu: float | None, run_days: float | None, *, parameters: int,
                gpus: int) -> Any:
    """The run's :class:`~ckptd.planning.RunLength` from ``--tokens --tflops-per-gpu`` or ``--run-days``, or None."""
    from ckptd.errors import ConfigError
    from ckptd.planning import RunLength

    if tokens is not None and run_days is not None:
        raise ConfigError("give the run's length one way: --tokens with --tflops-per-gpu, or --run-days")
    if tokens is None:
        if tflops_per_gpu is not None:
            raise ConfigError("--tflops-per-gpu goes with --tokens (6 x parameters x tokens FLOPs at that rate)")
        return None if run_days is None else RunLength.from_days(run_days)
    if tflops_per_gpu is None:
        raise ConfigError("--tokens needs --tflops-per-gpu: the FLOP rate each GPU sustains in training, e.g. 400 "
                          "(TFLOP/s) for bf16 on an H100 at about 40% of its peak")
    count = _parse_count(tokens, "--tokens", noun="token count like 1.4T or 15e12")
    return RunLength.from_tokens(count or 0, parameters=parameters, flops_per_gpu=tflops_per_gpu * 1e12, gpus=gpus)


def _parameters(params: str | None, config_path: str | None, tied_embeddings: bool | None,
                expert_params: str | None, *, tp: int) -> tuple[Any, str]:
    """The model's :class:`~ckptd.planning.ParameterCount` and where it came from."""
    from ckptd.errors import ConfigError
    from ckptd.planning import ParameterCount, load_config, shape_from_config

    if (params is None) == (config_path is None):
        raise ConfigError("give the model size: exactly one of --params COUNT and --config FILE")
    if config_path is None:
        return ParameterCount.flat(_parse_count(params, "--params") or 0,
                                   _parse_count(expert_params, "--expert-params") or 0), "--params"
    if expert_params is not None:
        raise ConfigError("--expert-params goes with --params; a --config counts its experts itself")
    shape = shape_from_config(load_config(config_path), source=config_path, tied_embeddings=tied_embeddings)
    shape.check_tensor_parallel(tp)
    return shape.parameters(), f"config {click.format_filename(config_path)}"


def _mtbf(mtbf_hours: float | None, failures: float | None, days: float | None, gpus: int | None, *,
          job_gpus: int) -> tuple[float, float | None]:
    """(the job's MTBF in hours, the per-GPU failure rate it came from or None when given directly)."""
    from ckptd.errors import ConfigError
    from ckptd.planning import job_mtbf_hours, per_gpu_failures_per_hour

    record = (failures, days, gpus)
    if mtbf_hours is not None:
        if any(value is not None for value in record):
            raise ConfigError("give the failure rate one way: --mtbf-hours, or --failures --days --gpus")
        return mtbf_hours, None
    if any(value is None for value in record) and any(value is not None for value in record):
        raise ConfigError("--failures, --days and --gpus go together (a fleet's interruptions, the days "
                          "they were seen over, and its GPU count)")
    fleet = _DEFAULT_FAILURES if failures is None else record
    return job_mtbf_hours(*fleet, job_gpus=job_gpus), per_gpu_failures_per_hour(*fleet)  # type: ignore[arg-type]


def _bandwidths(given: dict[str, float | None], *, measure: bool, local_dir: str | None, measure_object: str | None,
                copiers: int, nbytes: int, options: dict[str, Any] | None,
                defaults: dict[str, float | None]) -> tuple[dict[str, float | None], dict[str, str]]:
    """Each bandwidth and where it came from: given on the command line, measured here, or the default."""
    from ckptd.errors import ConfigError

    if not measure and (local_dir is not None or measure_object is not None):
        raise ConfigError("--local and --measure-object name what --measure measures; add --measure")
    values: dict[str, float | None] = dict(defaults)
    sources = {name: "default" for name in defaults}
    if measure:
        from ckptd.planning import measure as probe

        if not 1 <= nbytes >> 20 <= _MAX_MEASURE_MIB:
            raise ConfigError(f"--measure-mib must be between 1 and {_MAX_MEASURE_MIB}, got {nbytes >> 20}")
        measured: dict[str, float | None] = {"host_memcpy": probe.host_memcpy_gbps(nbytes, copiers=copiers),
                                             "d2h": probe.device_to_host_gbps(nbytes)}
        if local_dir is not None:
            measured["disk"] = probe.disk_gbps(local_dir, nbytes)
        if measure_object is not None:
            measured["object"] = probe.object_gbps(measure_object, nbytes, storage_options=options)
        for name, value in measured.items():
            if value is not None and given.get(name) is None:
                values[name], sources[name] = value, "measured"
    for name, value in given.items():
        if value is not None:
            values[name], sources[name] = value, "given"
    return values, sources


def _size(value: float | None) -> str:
    """Bytes in decimal units (1 TB = 1e12 bytes), three significant digits."""
    if value is None:
        return "-"
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def duration_text(seconds: float | None) -> str:
    """A duration as a short reading: seconds, minutes or hours ("-" for none)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _print_plan(document: dict[str, Any]) -> None:
    """The plan as a few lines and rich tables (bytes; tiers; async against sync saves)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = 120  # a file or pipe does not wrap
    inputs, layout = document["inputs"], document["inputs"]["layout"]
    per_parameter = inputs["bytes_per_parameter"]
    preset = f"--state {inputs['state_preset']}: " if inputs["state_preset"] else ""
    console.print(f"model: {inputs['parameters'] / 1e9:.4g} B parameters (from {inputs['parameters_from']}"
                  + (f", {inputs['expert_parameters'] / 1e9:.4g} B in experts" if inputs["expert_parameters"] else "")
                  + f"), {preset}{per_parameter['total']:g} bytes each (weights {per_parameter['weights']:g}, grads "
                  f"{per_parameter['grads']:g}, master {per_parameter['master']:g}, moments {per_parameter['moments']:g})")
    console.print("presets, bytes per parameter: " + ", ".join(
        f"{name} {preset_figures['bytes_per_parameter']:g}" for name, preset_figures in inputs["presets"].items()))
    chosen = "the manager's default" if inputs["replicas_from"] == "default" else "given"
    console.print(f"layout: tp {layout['tp']} x pp {layout['pp']} x dp {layout['dp']}"
                  + (f" (ep {layout['ep']})" if layout["ep"] > 1 else "")
                  + f" = {layout['world_size']} GPUs on {layout['nodes']} node(s) of {layout['gpus_per_node']}, "
                  f"ZeRO stage {layout['zero_stage']}, local directory {inputs['directories'].replace('-', ' ')}, "
                  f"replicas written {inputs['replicas']} ({chosen})")
    rank, node = document["rank"], document["node"]
    table = Table("bytes", "checkpoint", f"rank {rank['busiest']} holds", f"rank {rank['busiest']} writes",
                  f"node {node['busiest']} writes", title="one checkpoint (busiest rank and node)")
    for name in ("weights", "grads", "master", "moments", "total"):
        table.add_row(name, _size(document["checkpoint"]["unique_bytes"][name]), _size(rank["held_bytes"][name]),
                      _size(rank["written_bytes"][name]), _size(node["written_bytes"][name]))
    console.print(table)
    console.print(f"all nodes write {_size(document['checkpoint']['written_bytes_all_nodes'])} per checkpoint")
    staging = document["staging"]
    console.print(f"staging stall: {duration_text(staging['seconds'])} ({staging['bound']} bound)")
    gbps, sources = inputs["bandwidths_gb_per_s"], inputs["bandwidth_sources"]
    console.print("bandwidths, GB/s: " + ", ".join(
        f"{name.replace('_', ' ')} {value:.3g} ({sources[name]})" for name, value in gbps.items() if value is not None))
    tiers = Table("tier", "durable", "restore", "from", "kept/node", "job total", "every", "Young", "lost",
                  title=f"tiers: MTBF {duration_text(inputs['failures']['mtbf_hours'] * 3600)}, interval by Daly")
    for name, tier in document["tiers"].items():
        interval = tier["interval"]
        tiers.add_row(name, duration_text(tier["durable_seconds"]),
                      duration_text(tier["restore_seconds"]), tier["restore_from"], _size(tier["storage_bytes_per_node"]),
                      _size(tier["storage_bytes_total"]),
                      duration_text(interval["seconds"]) + ("*" if interval["bound"] == "tier" else ""),
                      duration_text(interval["young_seconds"]), f"{tier['lost_fraction']['total']:.2%}")
    console.print(tiers)
    if any(tier["interval"]["bound"] == "tier" for tier in document["tiers"].values()):
        console.print("*: raised to what the tier can absorb (a save reaches it before the next one does)")
    _print_modes(console, document, Table)
    failures = inputs["failures"]
    if failures["mtbf_from"] == "failures":
        console.print(f"MTBF {failures['mtbf_hours']:.3g} h for {layout['world_size']} GPUs at "
                      f"{failures['per_gpu_failures_per_hour']:.3g} failures per GPU-hour; restart "
                      f"{duration_text(failures['restart_s'])} plus the restore")
    for warning in document["warnings"]:
        console.print(f"warning: {warning}", style="yellow")


def _print_modes(console: Any, document: dict[str, Any], table_type: Any) -> None:
    """Asynchronous (ckptd) against synchronous saves per tier, with the run's totals when it has a length."""
    run = document["run"]
    columns = ["tier", "mode", "stall", "every", "goodput"]
    if run is not None:
        columns += ["saves over run", "failures", "lost", "written"]
        source = (f"{run['tokens']:.3g} tokens x 6 x {document['inputs']['parameters'] / 1e9:.4g} B parameters at "
                  f"{run['flops_per_gpu'] / 1e12:g} TFLOP/s per GPU" if run["from"] == "tokens" else "given")
        console.print(f"run: {run['compute_days']:.3g} days of compute ({source}); "
                      f"{run['failures_in_compute_time']:.3g} failures expected in that time")
    table = table_type(*columns, title="async (ckptd) and synchronous saves"
                       + (" over the run" if run is not None else ""))
    for name, tier in document["tiers"].items():
        for mode, figures, stall in (("async", tier, document["staging"]["seconds"]),
                                     ("sync", tier["sync"], tier["sync"]["stall_seconds"])):
            row = [name, mode, duration_text(stall), duration_text(figures["interval"]["seconds"]), f"{figures['goodput']:.2%}"]
            totals = figures["run"]
            if totals is not None:
                row += [f"{totals['saves']:.4g}",
                        "-" if totals["expected_failures"] is None else f"{totals['expected_failures']:.3g}",
                        "-" if totals["lost_hours"] is None else f"{totals['lost_hours']:.3g} h",
                        _size(totals["bytes_written"])]
            table.add_row(*row)
    console.print(table)
