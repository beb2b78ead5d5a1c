"""A scrub pass never starves the rest of the upkeep: it runs on its own worker (``ckptd-daemon-scrub``, a
:class:`~ckptd.background.BackgroundWorker`) with its bandwidth limit, while the maintenance thread keeps its
interval (retention, the tier probes, listings, aborts, gauges).

A real daemon process scrubs at 1 byte per second, so its first pass outlasts the test; meanwhile its
maintenance passes go on, retention deletes the steps a trainer commits past ``keep_local``, the local tier's
probe stays fresh and ``/metrics`` shows the pass running. Stopping the daemon ends the pass at once.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.tiers.local import LocalTier
from harness.daemon_process import DaemonProcess, run_trainer, write_config


def test_retention_probes_and_gauges_keep_their_interval_while_a_throttled_scrub_runs(tmp_path: Path) -> None:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    assert run_trainer(root, 1, 2, keep_local=None) == [1, 2]
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "keep_local": 2}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.1,
                          scrub_interval_s=0.5, scrub_bytes_per_s=1.0)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()

        def upkeep() -> dict:
            return daemon.get_json("/status")["upkeep"]

        daemon.wait_for(lambda: upkeep()["scrub_running"], 60, "a scrub pass to begin")
        began = upkeep()
        assert run_trainer(root, 3, 2, keep_local=None) == [3, 4]
        daemon.wait_for(lambda: LocalTier(root).committed_steps() == [3, 4], 60,
                        "retention to keep steps 3 and 4 while the scrub pass runs")
        daemon.wait_for(lambda: upkeep()["passes"] >= began["passes"] + 3, 60, "three more maintenance passes")
        now = upkeep()
        assert now["scrub_running"] and now["scrub_passes"] == 0, "the first scrub pass is still running"
        assert now["scrub_started"] == began["scrub_started"]
        status = daemon.get_json("/status")
        checked = status["roots"]["run1"]["tiers"]["local"]["health"]["checked"]
        assert checked > began["last_pass"], "the local tier was probed again during the pass"
        metrics = daemon.metrics()
        assert metrics[("ckptd_scrub_running", ())] == 1.0
        assert metrics[("ckptd_upkeep_last_pass_timestamp_seconds", ())] >= now["last_pass"] - 1e-3
        assert daemon.terminate(60) == 0, "SIGTERM ended the scrub pass between chunks and the daemon drained"
        assert "did not finish" not in daemon.log_path.read_text()
