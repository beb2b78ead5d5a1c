"""Metrics an operator alerts on move when their cause happens, against real daemon processes.

- An object tier that does not answer (nothing listens at its endpoint): ``ckptd_promotion_lag_steps`` keeps a
  series and grows as the trainer commits, ``ckptd_tier_degraded{tier="object"}`` is 1 and ``/status`` says
  the tier is unreachable; steps the pin cap releases count in ``ckptd_pin_cap_skipped_steps_total``;
  ``ckptd_pinned_steps`` / ``ckptd_pinned_bytes`` show what the pins hold; ``ckptd_journal_depth`` follows the
  journal.
- A working object tier (moto's server) with slowed writes: ``ckptd_copy_in_flight_bytes`` shows a promotion
  in progress, ``ckptd_last_promotion_timestamp_seconds`` is set when it is done, and the lag returns to 0;
  ``/status`` lists what the store holds, also after a restart.
- A chunk whose digest fails while it is promoted counts in ``ckptd_verify_failures_total{tier="local"}``.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from harness.daemon_process import DaemonProcess, run_trainer, write_config
from ckptd.testing.tamper import chunk_location, flip_bit
from ckptd.tiers.object import ObjectTier


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(tmp_path: Path, remote: str, options: dict[str, Any], **extra: Any) -> tuple[Path, Path, Path]:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir(exist_ok=True)
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "remote": remote,
                                                      "storage_options": options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.1,
                          retry_backoff_s=0.2, scrub_interval_s=0, **extra)
    return config, state, root


def _value(daemon: DaemonProcess, name: str, **labels: str) -> float | None:
    return daemon.metrics().get((name, tuple(sorted(labels.items()))))


def test_an_object_tier_outage_shows_in_lag_degraded_pins_and_the_pin_cap(tmp_path: Path) -> None:
    dead = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_free_port()}", "region_name": "us-east-1"}}
    config, state, root = _config(tmp_path, "s3://bucket-down/run1", dead)
    env = {"CKPTD_PIN_MAX_STEPS": "2", "CKPTD_S3_RETRIES": "0", "CKPTD_S3_CONNECT_RETRIES": "0"}
    with DaemonProcess(config, state, env=env) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 2, keep_local=None) == [1, 2]
        daemon.wait_for(lambda: _value(daemon, "ckptd_promotion_lag_steps", root="run1", tier="object") == 2, 60,
                        "a lag series of 2 steps while the object tier is down")
        assert _value(daemon, "ckptd_tier_degraded", root="run1", tier="object") == 1.0
        assert _value(daemon, "ckptd_journal_depth", kind="promote") == 2.0
        tier = daemon.get_json("/status")["roots"]["run1"]["tiers"]["object"]
        assert tier["reachable"] is False and tier["error"] and tier["unreachable_since"] > 0
        assert _value(daemon, "ckptd_pinned_steps", root="run1") == 2.0
        assert _value(daemon, "ckptd_pinned_bytes", root="run1") == 0.0, "the steps are still in the root"

        assert run_trainer(root, 3, 4, keep_local=1) == [3, 4, 5, 6]  # retention leaves only pins of 1-5
        daemon.wait_for(lambda: _value(daemon, "ckptd_promotion_lag_steps", root="run1", tier="object") == 6, 60,
                        "the lag to grow to 6 steps")
        daemon.wait_for(lambda: (_value(daemon, "ckptd_pin_cap_skipped_steps_total", root="run1") or 0) >= 1, 60,
                        "the pin cap to release steps")
        skipped = sum(task["state"] == "skipped" for task in daemon.tasks())
        daemon.wait_for(lambda: _value(daemon, "ckptd_pin_cap_skipped_steps_total", root="run1") == skipped, 30,
                        "the counter to count each released step")
        pinned = daemon.get_json("/status")["roots"]["run1"]["pinned"]
        daemon.wait_for(lambda: _value(daemon, "ckptd_pinned_steps", root="run1") == len(pinned), 30,
                        "the pinned-steps gauge to follow the pins")
        assert (_value(daemon, "ckptd_pinned_bytes", root="run1") or 0) > 0, "pins now hold steps gone from the root"
        open_tasks = sum(task["state"] in ("pending", "running", "failed") and task["kind"] == "promote"
                         for task in daemon.tasks())
        daemon.wait_for(lambda: _value(daemon, "ckptd_journal_depth", kind="promote") == open_tasks, 30,
                        "the journal depth to be live")
        assert daemon.terminate() == 0


@pytest.mark.s3
def test_a_promotion_shows_bytes_in_flight_then_its_time_and_status_agrees_with_the_store(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    url = f"s3://{s3_bucket}/run1"
    config, state, root = _config(tmp_path, url, s3_options)
    assert run_trainer(root, 1, 3, keep_local=None) == [1, 2, 3]
    with DaemonProcess(config, state, slow_writes_s=0.3) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: (_value(daemon, "ckptd_copy_in_flight_bytes", root="run1", tier="object") or 0) > 0,
                        60, "bytes in flight while a promotion runs")
        remote = ObjectTier(url, storage_options=s3_options)
        daemon.wait_for(lambda: remote.committed_steps() == [1, 2, 3], 180, "steps 1-3 promoted")
        daemon.wait_for(lambda: _value(daemon, "ckptd_promotion_lag_steps", root="run1", tier="object") == 0, 60,
                        "the lag to return to 0")
        assert (_value(daemon, "ckptd_last_promotion_timestamp_seconds", root="run1") or 0) > time.time() - 3600
        daemon.wait_for(lambda: _value(daemon, "ckptd_copy_in_flight_bytes", root="run1", tier="object") == 0, 30,
                        "no bytes in flight once done")
        assert _value(daemon, "ckptd_tier_degraded", root="run1", tier="object") == 0.0
        assert daemon.terminate() == 0
    with DaemonProcess(config, state) as daemon:  # a restart: /status lists what the store holds
        daemon.wait_ready()
        assert run_trainer(root, 4, 1, keep_local=None) == [4]
        daemon.wait_for(lambda: remote.committed_steps() == [1, 2, 3, 4], 120, "step 4 promoted")
        daemon.wait_for(lambda: daemon.get_json("/status")["roots"]["run1"]["tiers"]["object"]["steps"]
                        == remote.committed_steps(), 60, "/status to list exactly the store's steps")
        assert daemon.get_json("/status")["roots"]["run1"]["tiers"]["object"]["reachable"] is True
        assert daemon.terminate() == 0


@pytest.mark.s3
def test_a_chunk_that_fails_its_digest_while_promoted_is_counted(tmp_path: Path, s3_bucket: str,
                                                                 s3_options: dict[str, Any]) -> None:
    config, state, root = _config(tmp_path, f"s3://{s3_bucket}/run1", s3_options)
    assert run_trainer(root, 1, 1, keep_local=None) == [1]
    data_file, offset, length = chunk_location(root, 1, "weights")
    flip_bit(data_file, offset + length // 2, bit=3)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: (_value(daemon, "ckptd_verify_failures_total", tier="local") or 0) >= 1, 60,
                        "the digest failure counted")
        assert daemon.terminate() == 0
