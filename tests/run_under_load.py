"""Run the test command beside CPU burners, the way issue #30 asks `make test` to hold on a busy machine.

    python tests/run_under_load.py [--burners 20] [--report reports/load/run.json] [-- make test]

Starts ``--burners`` processes that spin on the CPU (at the default priority, like other users' jobs), runs the
command (``make test`` unless one follows ``--``), samples the one-minute load average every few seconds, stops the
burners, and prints (and writes as JSON with ``--report``, creating its folder) the command's exit code, its wall
time and the load seen. The exit code is the command's. Ctrl-C or SIGTERM of the runner passes the signal to the
command's process group (killed after a grace time) and stops the burners; burners also end by themselves when the
runner is gone (killed with SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SAMPLE_EVERY_S = 5.0
#: Seconds the command has to end after the signal it was passed on before its process group is killed.
STOP_GRACE_S = 30.0
#: A burner spins and, every few million iterations (tens of milliseconds), checks that the runner (whose pid is
#: its argument) is still its parent: a runner killed with SIGKILL leaves no burner behind.
BURNER = """\
import os, sys
runner = int(sys.argv[1])
while os.getppid() == runner:
    for _ in range(2_000_000):
        pass
"""


class Terminated(Exception):
    """The runner got SIGTERM."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _stop(command: subprocess.Popen[bytes], signum: int) -> int:
    """Pass ``signum`` to the command's process group; kill the group if it has not ended after
    :data:`STOP_GRACE_S`. Returns the command's exit code."""
    _signal_group(command, signum)
    try:
        return command.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(command, signal.SIGKILL)
        return command.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=20, help="CPU-spinning processes beside the command")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the command to run (after --)")
    args = parser.parse_args(argv)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    burners: list[subprocess.Popen[bytes]] = []
    command: subprocess.Popen[bytes] | None = None
    loads: list[float] = []
    started = time.monotonic()
    code: int | None = None
    try:
        burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(os.getpid())]) for _ in range(args.burners)]
        # its own process group, so that a stop reaches make's children (pytest and its workers) too
        command = subprocess.Popen(args.command, start_new_session=True)
        while code is None:
            try:
                code = command.wait(timeout=SAMPLE_EVERY_S)
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
    except KeyboardInterrupt:
        code = _stop(command, signal.SIGINT) if command is not None else 128 + signal.SIGINT
    except Terminated:
        code = _stop(command, signal.SIGTERM) if command is not None else 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
    assert code is not None
    if code < 0:  # ended by a signal: report it the way a shell does
        code = 128 - code
    figures = {"command": args.command, "exit_code": code, "wall_s": round(time.monotonic() - started, 1),
               "burners": args.burners, "cores": os.cpu_count(),
               "load_mean": round(sum(loads) / len(loads), 1) if loads else None,
               "load_max": round(max(loads), 1) if loads else None}
    print(json.dumps(figures))
    if args.report is not None:
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
