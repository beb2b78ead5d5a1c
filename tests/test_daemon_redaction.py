"""Credentials never reach the daemon's log, at any level (ckptd.daemon.redaction).

A real daemon process at ``log_level = "debug"`` (every level's records: botocore's signed-request lines,
s3fs's, aiohttp's and the daemon's own) promotes steps to moto's S3 server with credentials of its own and
serves peer requests; its whole log is grepped for the access key id, the secret key, the peer token and
signatures. The filter itself is checked on the shapes botocore logs.
"""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.redaction import REDACTED, RedactingFilter, known_secrets, redact
from harness.daemon_process import DaemonProcess, run_trainer, write_config

KEY_ID = "AKIDCKPTDREDACTION01"
SECRET_KEY = "ckptdRedactionSecretKey0123456789abcdefXY"
PEER_TOKEN = "peer-token-of-the-redaction-test-0123456789"


@pytest.mark.s3
def test_no_credential_in_any_level_of_a_real_daemons_log(tmp_path: Path, s3_bucket: str,
                                                          s3_options: dict[str, Any]) -> None:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    options = {**s3_options, "key": KEY_ID, "secret": SECRET_KEY}
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1", "storage_options": options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=0, log_level="debug", peer_token=PEER_TOKEN)
    with DaemonProcess(config, state, env={"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 2) == [1, 2]
        daemon.wait_for(lambda: daemon.metrics().get(("ckptd_promoted_steps_total", (("root", "run1"),)), 0) >= 2,
                        120, "two promotions")
        for token in (PEER_TOKEN, "wrong-" + PEER_TOKEN):
            request = urllib.request.Request(daemon.http + "/v1/peer/roots/run1/steps",
                                             headers={"Authorization": f"Bearer {token}"})
            try:
                urllib.request.urlopen(request, timeout=10).close()
            except urllib.error.HTTPError:
                pass
    log = daemon.log_path.read_text(errors="replace")
    levels = set(re.findall(r" (DEBUG|INFO|WARNING|ERROR) ", log))
    assert {"DEBUG", "INFO"} <= levels, "the log holds records of every level the daemon wrote"
    assert "botocore" in log and "Authorization" in log, "botocore's signed requests were logged (redacted)"
    for secret in (KEY_ID, SECRET_KEY, PEER_TOKEN):
        assert secret not in log, f"a credential ({secret[:4]}...) is in the log"
    assert not re.search(r"Signature=[0-9a-f]{16}", log), "a request signature is in the log"
    assert REDACTED in log


def test_the_filter_removes_every_shape_botocore_logs() -> None:
    secrets = known_secrets(PEER_TOKEN, [{"key": KEY_ID, "client_kwargs": {"secret": SECRET_KEY}}], environ={})
    assert set(secrets) == {PEER_TOKEN, KEY_ID, SECRET_KEY}
    lines = [
        f"headers={{'Authorization': b'AWS4-HMAC-SHA256 Credential={KEY_ID}/20261207/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0123456789abcdef0123'}",
        f"Authorization: AWS4-HMAC-SHA256 Credential={KEY_ID}/2026, Signature=fedcba9876543210",
        f"https://b.s3/k?X-Amz-Credential={KEY_ID}%2F2026&X-Amz-Signature=deadbeefdeadbeef&x=1",
        f"{{'key': '{KEY_ID}', 'secret': '{SECRET_KEY}'}}",
        f"Bearer {PEER_TOKEN}",
        "x-amz-security-token:FQoGZXIvYXdzEXAMPLE",
    ]
    for line in lines:
        cleaned = redact(line, secrets)
        for secret in (KEY_ID, SECRET_KEY, PEER_TOKEN, "0123456789abcdef0123", "fedcba9876543210", "deadbeefdeadbeef",
                       "FQoGZXIvYXdzEXAMPLE"):
            assert secret not in cleaned, (line, cleaned)
    record = logging.LogRecord("botocore.endpoint", logging.DEBUG, __file__, 1, "Sending %s", (f"key={KEY_ID}",), None)
    assert RedactingFilter(secrets).filter(record) and KEY_ID not in record.getMessage()
