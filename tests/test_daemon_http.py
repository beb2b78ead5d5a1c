"""The daemon's HTTP API: health and readiness, the status document, Prometheus metrics.

Against a real ``ckptd daemon`` process and moto's S3 server: ``/healthz`` and ``/readyz`` answer, the
metrics change after a promotion (bytes and steps promoted, the trainer's reported save stall), and the
status document shows each step on each tier. The server's own rules (503 with a reason while the daemon is
not ready, request bodies refused outside the peer routes, a port in use is a clear error) are checked on
:class:`~ckptd.daemon.http_server.HttpServer` with a small stand-in for the daemon.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from ckptd.daemon.http_server import HttpServer
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import ConfigError
from harness.daemon_process import DaemonProcess, metric_samples, run_trainer, wait_until, write_config


def _get(url: str, *, data: bytes | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers.get("Content-Type", "")


# --- against the real daemon --------------------------------------------------------------------------
@pytest.fixture
def daemon(tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[tuple[DaemonProcess, Path, str]]:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    remote = f"s3://{s3_bucket}/run1"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "remote": remote,
                                                      "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=0)
    with DaemonProcess(config, state) as process:
        process.wait_ready()
        yield process, root, remote


@pytest.mark.s3
def test_health_readiness_metrics_and_status_of_a_real_daemon(daemon):
    process, root, remote = daemon
    status, body, _ = _get(process.http + "/healthz")
    assert status == 200 and body.strip() == b"ok"
    wait_until(lambda: _get(process.http + "/readyz")[0] == 200, 30, "the daemon to be ready")
    assert json.loads(_get(process.http + "/readyz")[1]) == {"ready": True}

    status, text, content_type = _get(process.http + "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    before = metric_samples(text.decode())
    promoted = ("ckptd_promoted_steps_total", (("root", "run1"),))
    assert before.get(promoted, 0.0) == 0.0

    assert run_trainer(root, 1, 2) == [1, 2]  # a real trainer process: the daemon watches its root

    def promoted_twice() -> dict[Any, float] | None:
        samples = metric_samples(_get(process.http + "/metrics")[1].decode())
        return samples if samples.get(promoted, 0.0) >= 2 else None

    after = wait_until(promoted_twice, 60, "the metrics to count two promotions")
    assert after[("ckptd_promoted_bytes_total", (("root", "run1"),))] > 0
    assert after[("ckptd_promotion_seconds_count", (("root", "run1"),))] >= 2
    assert after[("ckptd_trainer_save_stall_seconds_count", (("root", "run1"),))] >= 2  # reported by the trainer
    assert after[("ckptd_trainer_step_seconds_count", (("root", "run1"),))] >= 1

    def steps_per_tier() -> dict[str, Any] | None:
        document = json.loads(_get(process.http + "/status")[1])
        tiers = document["roots"]["run1"]["tiers"]
        return document if tiers["local"]["steps"] == [1, 2] and tiers["object"]["steps"] == [1, 2] else None

    document = wait_until(steps_per_tier, 30, "the status document to show steps 1 and 2 on both tiers")
    assert document["node_id"] == "node-a" and document["ready"] is True
    assert document["roots"]["run1"]["tiers"]["object"]["url"] == remote
    assert document["roots"]["run1"]["tiers"]["object"]["lag_steps"] == 0

    status, body, _ = _get(process.http + "/status", data=b"x" * 10)
    assert status in (405, 413)  # no route but the peer routes takes a body
    assert _get(process.http + "/nothing-here")[0] == 404


# --- the server's own rules, with a stand-in daemon ----------------------------------------------------
class _StandIn:
    """The two questions the HTTP server asks a daemon, answered from fields a test sets."""

    def __init__(self) -> None:
        self.metrics = DaemonMetrics()
        self.ready = False
        self.document: dict[str, Any] = {"node_id": "stand-in", "roots": {}}

    def is_ready(self) -> bool:
        return self.ready

    def status(self) -> dict[str, Any]:
        return self.document


@pytest.fixture
def served() -> Iterator[tuple[HttpServer, _StandIn, list[str]]]:
    stand_in, bodies = _StandIn(), []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        bodies.append(body.decode())
        return web.Response(text=f"{len(body)}")

    server = HttpServer(stand_in, "127.0.0.1", 0,
                        peer_routes=lambda app: app.router.add_put("/v1/peer/echo", echo))
    server.start()
    yield server, stand_in, bodies
    server.stop()


def test_readiness_follows_the_daemon_and_says_why(served):
    server, stand_in, _ = served
    status, body, _ = _get(server.url + "/readyz")
    assert status == 503 and json.loads(body)["ready"] is False and "not ready" in json.loads(body)["why"]
    assert _get(server.url + "/healthz")[0] == 200  # alive while not ready
    stand_in.ready = True
    assert _get(server.url + "/readyz")[0] == 200


def test_metrics_render_what_was_recorded(served):
    server, stand_in, _ = served
    stand_in.metrics.promoted("run1", 1000, 0.5)
    stand_in.metrics.lag("run1", "object", 3, 12.5)
    stand_in.metrics.journal_depth("promote", 4)
    stand_in.metrics.retry("object", "promote")
    samples = metric_samples(_get(server.url + "/metrics")[1].decode())
    assert samples[("ckptd_promoted_bytes_total", (("root", "run1"),))] == 1000
    assert samples[("ckptd_promotion_lag_steps", (("root", "run1"), ("tier", "object")))] == 3
    assert samples[("ckptd_promotion_lag_seconds", (("root", "run1"), ("tier", "object")))] == 12.5
    assert samples[("ckptd_journal_depth", (("kind", "promote"),))] == 4
    assert samples[("ckptd_retries_total", (("operation", "promote"), ("tier", "object")))] == 1


def test_only_the_peer_routes_take_a_body(served):
    server, stand_in, bodies = served
    request = urllib.request.Request(server.url + "/v1/peer/echo", data=b"abc", method="PUT")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.read() == b"3"
    assert bodies == ["abc"]
    request = urllib.request.Request(server.url + "/healthz", data=b"abc", method="GET")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413


def test_a_status_that_fails_is_a_500_with_the_reason_and_counted(served):
    server, stand_in, _ = served
    def broken() -> dict[str, Any]:
        raise OSError("journal is gone")

    stand_in.status = broken  # type: ignore[method-assign]
    status, body, _ = _get(server.url + "/status")
    assert status == 500 and "journal is gone" in json.loads(body)["error"]
    assert metric_samples(stand_in.metrics.render()[0].decode())[("ckptd_errors_total", (("where", "http"),))] == 1


def test_a_port_in_use_is_a_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            HttpServer(_StandIn(), "127.0.0.1", port).start()
    finally:
        taken.close()


def test_a_status_or_readiness_that_hangs_is_a_503_with_the_reason(served, monkeypatch):
    import threading

    from ckptd.daemon import http_server

    server, stand_in, _ = served
    monkeypatch.setattr(http_server, "ANSWER_TIMEOUT_S", 0.5)
    released = threading.Event()

    def hung_status() -> dict[str, Any]:
        released.wait(30)
        return {}

    def hung_ready() -> bool:
        released.wait(30)
        return True

    stand_in.status, stand_in.is_ready = hung_status, hung_ready  # type: ignore[method-assign]
    try:
        status, body, _ = _get(server.url + "/status")
        assert status == 503 and "took longer" in json.loads(body)["error"]
        status, body, _ = _get(server.url + "/readyz")
        assert status == 503 and json.loads(body)["ready"] is False and "took longer" in json.loads(body)["why"]
        assert _get(server.url + "/healthz")[0] == 200
        assert metric_samples(stand_in.metrics.render()[0].decode())[("ckptd_errors_total", (("where", "http"),))] == 1
    finally:
        released.set()
