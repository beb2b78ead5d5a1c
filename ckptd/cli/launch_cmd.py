"""``ckptd launch``: torchrun's command line (parsed by torch's own torchrun parser) plus ckptd's options; one
supervisor per node that restarts only the rank that failed.

The command line is parsed by ``torch.distributed.run.get_args_parser()`` with ckptd's options added to it,
so every option and spelling of the installed torch's ``torchrun --help`` is known (``--nproc_per_node``,
``--standalone``, ``--rdzv-backend``, ``PET_*`` variables, ...). Each is either honoured as torchrun does or,
where ckptd cannot, refused with a usage error (exit 2) that names it (:data:`REFUSED`); docs/elastic.md
says which. ``--help`` imports no torch: it shows ckptd's options and points to ``torchrun --help``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click

from ckptd.errors import ConfigError

#: torchrun options ckptd cannot honour yet, with the value that leaves them unused (torchrun's default):
#: any other value is a usage error naming the option.
REFUSED: dict[str, tuple[str, Any]] = {
    "duplicate_stdout_filters": ("--duplicate-stdout-filters", []),
    "duplicate_stderr_filters": ("--duplicate-stderr-filters", []),
    "local_addr": ("--local-addr", None),
    "logs_specs": ("--logs-specs", None),
    "numa_binding": ("--numa-binding", None),
    "virtual_local_rank": ("--virtual-local-rank", False),
    "event_log_handler": ("--event-log-handler", "null"),
}
#: Rendezvous backends ckptd meets through: a c10d TCPStore at the endpoint, hosted by node rank 0.
RDZV_BACKENDS = ("static", "c10d")
#: ``--rdzv-conf`` keys ckptd honours (seconds the supervisors wait for each other).
RDZV_CONF_KEYS = ("join_timeout", "timeout")
#: torchrun's default for ``--signals-to-handle``.
_TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _env_default(name: str, fallback: Any, convert: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get(name)
    return fallback if raw in (None, "") else convert(raw)


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off", "")


def add_ckptd_options(parser: argparse.ArgumentParser) -> None:
    """ckptd's own options (those torchrun lacks), each with its ``CKPTD_*`` variable."""
    group = parser.add_argument_group("ckptd options (torchrun's are above; each also reads its CKPTD_* variable)")
    group.add_argument("--hang-timeout", type=float, default=_env_default("CKPTD_HANG_TIMEOUT", 300.0, float),
                       help="Seconds without a heartbeat after which a rank is killed and replaced (0: never). "
                            "[env: CKPTD_HANG_TIMEOUT] (default 300)")
    group.add_argument("--max-restarts-per-rank", type=int,
                       default=_env_default("CKPTD_MAX_RESTARTS_PER_RANK", None, int),
                       help="Restarts each rank may spend (default: only --max-restarts bounds them); the rank's "
                            "next failure stops the job (exit 12). [env: CKPTD_MAX_RESTARTS_PER_RANK]")
    group.add_argument("--crash-loop", type=int, default=_env_default("CKPTD_CRASH_LOOP", 3, int),
                       help="Failures in a row with no training step completed in between that stop the job "
                            "(exit 14; 0: never). [env: CKPTD_CRASH_LOOP] (default 3)")
    group.add_argument("--restart-backoff", type=float, default=_env_default("CKPTD_RESTART_BACKOFF", 1.0, float),
                       help="Seconds before restarting a rank that failed with no step completed since the last "
                            "failure, doubled at each such failure. [env: CKPTD_RESTART_BACKOFF] (default 1)")
    group.add_argument("--spares", type=int, default=_env_default("CKPTD_SPARES", 0, int),
                       help="Warm spares per node: processes that import torch and run the script's setup_fn "
                            "(ckptd.elastic.run), then wait to take a failed rank's place. [env: CKPTD_SPARES]")
    group.add_argument("--preload", dest="preload", action="store_true",
                       default=_env_default("CKPTD_PRELOAD", True, _flag),
                       help="Fork every rank and spare from one process per node that imported torch once "
                            "(the default); each is seeded as a new interpreter would be. [env: CKPTD_PRELOAD]")
    group.add_argument("--no-preload", dest="preload", action="store_false",
                       help="Start each rank as a new interpreter.")
    group.add_argument("--node-timeout", type=float, default=_env_default("CKPTD_NODE_TIMEOUT", 30.0, float),
                       help="Seconds without a heartbeat from a node's supervisor after which the other nodes "
                            "take it for lost. [env: CKPTD_NODE_TIMEOUT] (default 30)")
    group.add_argument("--checkpoint-on-stop", action="store_true",
                       default=_env_default("CKPTD_CHECKPOINT_ON_STOP", False, _flag),
                       help="A stop signal first has every rank save and commit one agreed step, then stops "
                            "the job. Pass it to every node's supervisor. [env: CKPTD_CHECKPOINT_ON_STOP]")
    group.add_argument("--stop-timeout", type=float, default=_env_default("CKPTD_STOP_TIMEOUT", 120.0, float),
                       help="With --checkpoint-on-stop: seconds the ranks get for the final checkpoint. "
                            "[env: CKPTD_STOP_TIMEOUT] (default 120)")


def launch_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser with ckptd's options added (imports torch)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ckptd launch"
    # ckptd's defaults where the launch's environment names no PET_* value: a job restarts 3 times, and the
    # CKPTD_* variables of the options torchrun shares keep working
    defaults: dict[str, Any] = {}
    for dest, name, fallback in (("max_restarts", "CKPTD_MAX_RESTARTS", "3"),
                                 ("nproc_per_node", "CKPTD_NPROC_PER_NODE", None),
                                 ("nnodes", "CKPTD_NNODES", None), ("node_rank", "CKPTD_NODE_RANK", None),
                                 ("rdzv_endpoint", "CKPTD_RDZV_ENDPOINT", None),
                                 # the supervisor polls its ranks every 10 ms unless told (torchrun: 0.1 s)
                                 ("monitor_interval", "CKPTD_MONITOR_INTERVAL", "0.01")):
        if f"PET_{dest.upper()}" not in os.environ:
            value = _env_default(name, fallback)
            if value is not None:
                defaults[dest] = value
    parser.set_defaults(**defaults)
    add_ckptd_options(parser)
    return parser


#: torchrun's options as ``ckptd launch --help`` shows them (it imports no torch, so it cannot ask torch's
#: parser; tests/test_launch_command_line.py checks that every option of that parser is listed here):
#: (spellings, value, what ckptd does with it).
TORCHRUN_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--nnodes", "N", "Nodes (supervisors) in the job (MIN:MAX with MIN < MAX is refused). [default 1]"),
    ("--nproc-per-node, --nproc_per_node", "N", "Ranks on this node (a number, cpu, gpu, xpu or auto). [default 1]"),
    ("--rdzv-backend, --rdzv_backend", "NAME", "static or c10d: a c10d TCPStore at --rdzv-endpoint hosted by node "
                                               "rank 0; others are refused."),
    ("--rdzv-endpoint, --rdzv_endpoint", "HOST[:PORT]", "The job's store (default on one node: a free loopback "
                                                        "port)."),
    ("--rdzv-id, --rdzv_id", "ID", "The job's id (TORCHELASTIC_RUN_ID of every rank)."),
    ("--rdzv-conf, --rdzv_conf", "K=V,...", "join_timeout (or timeout): seconds the supervisors wait for each "
                                            "other [300]; other keys are refused."),
    ("--standalone", "", "One node, a store on a free loopback port."),
    ("--max-restarts, --max_restarts", "N", "Rank restarts the whole job may spend; the next failure stops it "
                                            "(exit 12). [ckptd's default 3; torchrun's 0]"),
    ("--monitor-interval, --monitor_interval", "S", "Seconds between two looks at the ranks. [ckptd's default "
                                                    "0.01]"),
    ("--start-method, --start_method", "NAME", "Accepted; as under torchrun it does not apply to scripts."),
    ("--event-log-handler, --event_log_handler", "NAME", "null only."),
    ("--role", "NAME", "The ranks' ROLE_NAME."),
    ("-m, --module", "", "Run SCRIPT as a module (python -m SCRIPT)."),
    ("--no-python, --no_python", "", "Run SCRIPT as an executable, not with python (implies --no-preload)."),
    ("--run-path, --run_path", "", "Run SCRIPT as a file (the default)."),
    ("--log-dir, --log_dir", "DIR", "Base folder of the ranks' log files: DIR/<rdzv-id>_<random>/attempt_N/"
                                    "<local rank>/std{out,err}.log, as torchrun."),
    ("-r, --redirects", "SPEC", "Streams sent to those files only: 0-3 (1 stdout, 2 stderr, 3 both) or per "
                                "local rank, 0:1,1:2. [default 0]"),
    ("-t, --tee", "SPEC", "Streams sent to those files and to the console, each line prefixed [<role><local "
                          "rank>]: (as --redirects). [default 0]"),
    ("--local-ranks-filter, --local_ranks_filter", "RANKS", "Local ranks shown on the console, e.g. 0,1 (the "
                                                            "files keep every rank's)."),
    ("--duplicate-stdout-filters, --duplicate_stdout_filters", "F", "Refused (not supported yet)."),
    ("--duplicate-stderr-filters, --duplicate_stderr_filters", "F", "Refused (not supported yet)."),
    ("--node-rank, --node_rank", "N", "This node's rank; node 0 hosts the job's store. [default 0]"),
    ("--master-addr, --master_addr", "HOST", "With --master-port and no --rdzv-endpoint: the store's host."),
    ("--master-port, --master_port", "PORT", "With no --rdzv-endpoint: the store's port."),
    ("--local-addr, --local_addr", "HOST", "Refused (not supported yet)."),
    ("--logs-specs, --logs_specs", "NAME", "Refused (not supported yet)."),
    ("--numa-binding, --numa_binding", "NAME", "Refused (not supported yet)."),
    ("--signals-to-handle, --signals_to_handle", "SIGNALS", "Signals that stop the job gracefully (exit 15). "
                                                            "[default SIGTERM,SIGINT,SIGHUP,SIGQUIT]"),
    ("--shutdown-timeout, --shutdown_timeout", "S", "Seconds between SIGTERM and SIGKILL when ranks are ended. "
                                                    "[default 5]"),
    ("--virtual-local-rank, --virtual_local_rank", "", "Refused (not supported yet)."),
)


def _light_help() -> str:
    """``ckptd launch --help`` without importing torch, laid out as click lays out the other commands."""
    ckptd_options = argparse.ArgumentParser(add_help=False)
    add_ckptd_options(ckptd_options)
    rows = [(names, value, text) for names, value, text in TORCHRUN_OPTIONS]
    for action in ckptd_options._actions:
        value = "" if action.nargs == 0 else action.dest.upper()
        rows.append((", ".join(action.option_strings), value, action.help or ""))
    rows.append(("-h, --help", "", "Show this message and exit."))
    lines = ["Usage: ckptd launch [OPTIONS] SCRIPT [ARGS]...", "",
             "  Start a training script on every rank of this node and restart only the rank that fails.", "",
             "  Takes torchrun's whole command line, parsed by torch's own torchrun parser (every option of",
             "  `torchrun --help`, either spelling, PET_* variables), plus ckptd's options. An option ckptd cannot",
             "  honour is refused with exit 2 naming it. A supervisor started with the --node-rank of a lost node",
             "  joins the running job in its place. A stop signal to any supervisor stops the whole job (exit 15).",
             "  Exit codes: 0 done, 2 usage, 12 a budget spent or a node lost, 14 crash loop, 15 stopped.",
             "  See docs/elastic.md.", "", "Options:"]
    for names, value, text in rows:
        head = f"  {names} {value}".rstrip()
        lines.append(head if len(head) > 40 else f"{head:<42}{text}")
        if len(head) > 40:
            lines.append(f"{'':<42}{text}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ParsedLaunch:
    """What ``ckptd launch``'s command line asks for: the supervisor's spec and what the CLI does around it."""

    spec: Any  # LaunchSpec (imports torch)
    rdzv_backend: str
    run_id: str


def _refuse(option: str, why: str, hint: str = "see docs/elastic.md for the torchrun options ckptd honours") -> None:
    raise ConfigError(f"ckptd launch: {option} {why}", hint=hint)


def _endpoint(value: str, nnodes: int, master_addr: str, master_port: int | None) -> tuple[str, int]:
    """(host, port) of the job's store: ``--rdzv-endpoint``, else ``--master-addr``/``--master-port``, else on
    one node a free loopback port."""
    if not value and master_port is not None:
        return master_addr, int(master_port)
    if not value or value.rpartition(":")[2] == "0" and nnodes == 1:
        if nnodes > 1:
            _refuse("--rdzv-endpoint", "is required with --nnodes > 1",
                    hint="pass the node-rank-0 host and a free port, e.g. --rdzv-endpoint node0:29400")
        host = value.rpartition(":")[0] if value and ":" in value else "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            return ("127.0.0.1" if host in ("", "localhost") else host), int(probe.getsockname()[1])
    host, _, port = value.rpartition(":")
    if not host:
        host, port = value, "29400"  # torchrun's default port for an endpoint without one
    if not port.isdigit():
        _refuse("--rdzv-endpoint", f"{value!r} is not HOST[:PORT]")
    return host, int(port)


def _signals(raw: str) -> tuple[int, ...]:
    found = []
    for name in (part.strip() for part in raw.split(",") if part.strip()):
        try:
            found.append(int(signal.Signals[name]))
        except KeyError:
            _refuse("--signals-to-handle", f"names {name!r}, which is not a signal")
    return tuple(found)


def _log_spec(args: argparse.Namespace, nproc: int) -> Any:
    """torchrun's logging options as a LogSpec (torch's own parsing of ``--redirects`` and ``--tee``)."""
    from torch.distributed.elastic.multiprocessing.api import Std, to_map

    from ckptd.elastic.log_routing import LogSpec

    maps = {}
    for option, raw in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            parsed = Std.from_str(str(raw))
        except ValueError:
            parsed = None
        if parsed is None:
            _refuse(option, f"{raw!r} is not 0-3 or a map of local ranks such as 0:1,1:2 (as torchrun)")
        maps[option] = {local: int(value) for local, value in to_map(parsed, nproc).items()}
    shown = None
    if args.local_ranks_filter:
        try:
            shown = frozenset(int(part) for part in str(args.local_ranks_filter).split(","))
        except ValueError:
            _refuse("--local-ranks-filter", f"{args.local_ranks_filter!r} is not a comma-separated list of local "
                                            "ranks, e.g. 0,1")
    return LogSpec(log_dir=args.log_dir or None, redirects=maps["--redirects"], tee=maps["--tee"],
                   local_ranks_filter=shown, prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
                   or None)


def parse_launch(argv: Sequence[str]) -> ParsedLaunch:
    """Parse ``ckptd launch``'s arguments into the supervisor's spec; a usage error (exit 2) for what ckptd
    cannot honour. Imports torch."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    from ckptd.elastic.supervisor import LaunchSpec

    args = launch_parser().parse_args(list(argv))
    for dest, (option, unused) in REFUSED.items():
        if getattr(args, dest) != unused:
            _refuse(option, f"{getattr(args, dest)!r} is not supported yet (ckptd launch accepts torchrun's "
                            f"default, {unused!r}, only)")
    if args.rdzv_backend not in RDZV_BACKENDS and not args.standalone:
        _refuse("--rdzv-backend", f"{args.rdzv_backend!r} is not supported: ckptd meets through a c10d TCPStore at "
                                  f"--rdzv-endpoint, hosted by node rank 0 ({' or '.join(RDZV_BACKENDS)})")
    join_timeout = 300.0
    for pair in (part.strip() for part in (args.rdzv_conf or "").split(",") if part.strip()):
        key, _, value = pair.partition("=")
        if key.strip() not in RDZV_CONF_KEYS:
            _refuse("--rdzv-conf", f"key {key.strip()!r} is not supported (ckptd honours {', '.join(RDZV_CONF_KEYS)})")
        try:
            join_timeout = float(value)
        except ValueError:
            _refuse("--rdzv-conf", f"{pair!r}: {key.strip()} takes seconds")
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(str(args.nnodes))
    except (RuntimeError, ValueError):
        _refuse("--nnodes", f"{args.nnodes!r} is not N or MIN:MAX")
    if min_nodes != max_nodes:
        _refuse("--nnodes", f"{args.nnodes!r}: an elastic range (MIN:MAX) is not supported yet; give one number")
    try:
        nproc = determine_local_world_size(str(args.nproc_per_node))
    except ValueError as error:
        _refuse("--nproc-per-node", f"{args.nproc_per_node!r}: {error}")
    nnodes = max_nodes
    if args.standalone:
        if nnodes != 1:
            _refuse("--standalone", f"runs one node, but --nnodes is {args.nnodes}")
        host, port = _endpoint("", 1, "127.0.0.1", None)
    else:
        master_port = None if args.master_port is None else int(args.master_port)
        host, port = _endpoint(args.rdzv_endpoint or "", nnodes, args.master_addr, master_port)
    if args.module and args.no_python:
        _refuse("--no-python", "and -m cannot be used together (as under torchrun)")
    if args.shutdown_timeout is not None and float(args.shutdown_timeout) <= 0:
        _refuse("--shutdown-timeout", f"{args.shutdown_timeout!r} must be above 0")
    script = args.training_script
    if args.no_python:
        command: tuple[str, ...] = (script, *args.training_script_args)
    else:
        command = (sys.executable, "-u", *(("-m", script) if args.module else (script,)), *args.training_script_args)
    spec = LaunchSpec(command=command, nproc_per_node=nproc, nnodes=nnodes, node_rank=int(args.node_rank),
                      rdzv_host=host, rdzv_port=port, max_restarts=int(args.max_restarts),
                      max_restarts_per_rank=args.max_restarts_per_rank, hang_timeout_s=args.hang_timeout,
                      crash_loop=args.crash_loop, restart_backoff_s=args.restart_backoff, spares=args.spares,
                      node_timeout_s=args.node_timeout, checkpoint_on_stop=args.checkpoint_on_stop,
                      stop_timeout_s=args.stop_timeout, preload=args.preload and not args.no_python,
                      join_timeout_s=join_timeout, poll_s=float(args.monitor_interval),
                      stop_signals=_signals(args.signals_to_handle or _TORCHRUN_SIGNALS),
                      term_grace_s=5.0 if args.shutdown_timeout is None else float(args.shutdown_timeout),
                      role=args.role, run_id=args.rdzv_id, logs=_log_spec(args, nproc))
    return ParsedLaunch(spec=spec, rdzv_backend="c10d" if args.standalone else args.rdzv_backend,
                        run_id=args.rdzv_id)


@click.command("launch", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "allow_interspersed_args": False})
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED)
def launch(arguments: tuple[str, ...]) -> None:
    """Start a training script on every rank of this node and restart only the rank that fails.

    Takes torchrun's whole command line (parsed by torch's own parser) plus ckptd's options; see
    ``ckptd launch --help``, docs/elastic.md and ckptd.elastic.supervisor for every exit code."""
    before_script = []
    for argument in arguments:  # --help before the script (after it, it is the script's)
        if not argument.startswith("-"):
            break
        before_script.append(argument)
    if not arguments or "-h" in before_script or "--help" in before_script:
        click.echo(_light_help())
        return
    parsed = parse_launch(arguments)
    from ckptd.elastic.supervisor import Supervisor  # imported by parse_launch already

    logging.basicConfig(level=logging.INFO, format="ckptd launch: %(message)s", stream=sys.stderr)
    Supervisor(parsed.spec).run()
