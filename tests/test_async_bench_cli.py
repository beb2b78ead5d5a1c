"""`ckptd bench` and the GPU staging script run end to end on a tiny state and report every figure (figures
are not asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from ckptd.bench.runner import young_daly_interval_s
from ckptd.cli.main import cli


def test_young_daly_interval() -> None:
    assert young_daly_interval_s(2.0, 3600.0) == math.sqrt(2 * 2.0 * 3600.0)
    assert young_daly_interval_s(-1.0, 3600.0) == 0.0


def test_bench_json_on_a_tiny_state(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "--size", "4MiB", "--tensor-size", "1MiB", "--repeats", "1",
                                      "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["state_bytes"] == 4 << 20
    for key in ("stall_vs_copy", "durable_speedup_vs_best", "restore_speedup_vs_best", "loop_ratio_ckptd",
                "loop_ratio_dcp_async", "young_daly_interval_s", "restore_live_vs_torch_load",
                "restore_untouched_vs_torch_load", "restore_absent_vs_torch_load", "first_stall_cold_vs_later",
                "first_stall_prepared_vs_later"):
        assert report["ratios"][key] > 0, key
    assert list(tmp_path.iterdir()) == []  # scratch space removed


def test_bench_table_prints_the_restore_and_first_save_rows(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "--size", "2MiB", "--tensor-size", "1MiB", "--repeats", "1",
                                      "--dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for row in ("restore into written tensors", "restore into torch.empty_like", "restore into an empty state",
                "first save, new manager", "buffers prepared after restore"):
        assert row in result.output, row


def test_gpu_staging_script_runs_its_code_paths_on_cpu(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_staging.py"
    completed = subprocess.run([sys.executable, str(script), "--device", "cpu", "--gib", "0.03", "--tensor-mib", "4",
                                "--repeats", "1", "--dir", str(tmp_path), "--json"],
                               capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["tensors"] == 8 and report["state_bytes"] == 8 * (4 << 20)
    for key in ("dcp_async_save_staged", "ckptd_save_stall"):
        assert report[key]["seconds"] > 0 and report[key]["of_pinned_peak"] > 0, key
    assert report["ckptd_first_save_stall_s"] > 0 and report["ckptd_first_save_prepared_s"] > 0
    assert list(tmp_path.iterdir()) == []  # scratch space removed
