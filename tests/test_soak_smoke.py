"""A short run of the soak driver (``benchmarks/soak.py``, the hour-long run of issue 17 part 4) with a
compressed schedule: one SIGKILL of a trainer rank, one SIGKILL of a daemon (started again by the driver),
one S3 fault window; then the job stops cleanly and must equal an uninterrupted run byte for byte (weights,
optimizer state, sample-id stream), with every tier verifying and nothing lost. The node loss is left to
the long run (it restarts the whole job, which doubles the time on two cores).

The driver runs as a subprocess exactly as documented; the test reads its JSON report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Minutes on a loaded 2-core machine: outside the default run (``pytest -m slow tests/test_soak_smoke.py``).
pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.s3]

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_a_compressed_soak_run_recovers_from_every_fault_and_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    command = [sys.executable, str(SOAK), "--minutes", "0.25", "--seed", "7", "--report", str(report_path),
               "--trainer-kills", "1", "--daemon-kills", "1", "--s3-windows", "1", "--node-losses", "0",
               "--step-time", "0.02", "--every", "3", "--daemon-down-s", "0.5", "1", "--s3-window-s", "2", "3",
               "--stall-s", "2", "--final-promotion-timeout", "2", "--recovery-timeout", "120", "--stop-timeout", "30",
               "--workdir", str(tmp_path / "work")]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        output = driver.communicate(timeout=240)[0][-6000:]
    except subprocess.TimeoutExpired:
        driver.terminate()  # the driver stops its daemons, supervisors and S3 on SIGTERM
        output = driver.communicate(timeout=30)[0][-6000:]
        raise AssertionError(f"the soak driver did not finish within 240 s:\n{output}") from None
    finally:
        try:  # whatever the driver left behind in its session
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        driver.wait()
    finished = subprocess.CompletedProcess(command, driver.returncode, output)
    assert report_path.exists(), output
    report = json.loads(report_path.read_text())
    assert report["verdict"] == "EQUAL", (report.get("failure"), report["differences"], output)
    assert report["findings"] == [], report["findings"]
    assert finished.returncode == 0, output
    assert report["bytes_lost"] == 0 and report["differences"] == []
    assert report["checks"] and all(check["ok"] for check in report["checks"]), report["checks"]
    kinds = {fault["kind"]: fault for fault in report["faults"]}
    assert set(kinds) == {"trainer-kill", "daemon-kill", "s3-window"}, report["faults"]
    for fault in report["faults"]:
        assert fault["step"] is not None and fault["recovery"].get("step_recovery_s") is not None, fault
    killed = kinds["trainer-kill"]
    victim = int(killed["target"].split()[1])
    assert killed["recovery"]["tiers"][str(victim)] is not None, killed  # the replacement restored a step
    assert kinds["s3-window"]["detail"]["requests"] > 0, kinds["s3-window"]  # the window met real traffic
    assert report["steps"] > max(fault["step"] for fault in report["faults"])
    assert report["unexpected"] == []
