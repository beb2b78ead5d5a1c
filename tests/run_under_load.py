"""Run the test command beside CPU burners, the way issue #30 asks `make test` to hold on a busy machine.

    python tests/run_under_load.py [--burners 20] [--report reports/load/run.json] [-- make test]

Starts ``--burners`` processes that spin on the CPU (at the default priority, like other users' jobs), runs the
command (``make test`` unless one follows ``--``), samples the one-minute load average every few seconds, stops the
burners, and prints (and writes as JSON with ``--report``) the command's exit code, its wall time and the load
seen. The exit code is the command's.
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
BURNER = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=20, help="CPU-spinning processes beside the command")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the command to run (after --)")
    args = parser.parse_args(argv)

    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners)]
    loads: list[float] = []
    started = time.monotonic()
    try:
        command = subprocess.Popen(args.command)
        while True:
            try:
                code = command.wait(timeout=SAMPLE_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
    except KeyboardInterrupt:
        command.send_signal(signal.SIGINT)
        code = command.wait()
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
    figures = {"command": args.command, "exit_code": code, "wall_s": round(time.monotonic() - started, 1),
               "burners": args.burners, "cores": os.cpu_count(),
               "load_mean": round(sum(loads) / len(loads), 1) if loads else None,
               "load_max": round(max(loads), 1) if loads else None}
    print(json.dumps(figures))
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
