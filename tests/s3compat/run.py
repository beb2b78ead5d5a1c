"""``make test-s3-compat``: the object tier's conformance tests and the promotion/restore scenarios against a
second S3 implementation, LocalStack's own S3 provider (``localstack-core`` in host mode, from its own Python
3.13 virtual environment), instead of moto.

It starts LocalStack on a free loopback port (only the S3 service, data in memory), waits until its health
endpoint says S3 is available, runs pytest from this interpreter with ``CKPTD_TEST_S3_ENDPOINT`` pointing the
tests' ``s3_server`` fixture at it, and stops LocalStack (also after a failure or Ctrl-C). Exit code: pytest's,
or 2 when LocalStack cannot be started.

    python tests/s3compat/run.py --localstack-python VENV/bin/python [-- PYTEST ARGS]

Without pytest arguments it runs :data:`DEFAULT_TESTS`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

#: The object tier's conformance suite and the promotion and restore tests that run against S3.
DEFAULT_TESTS = ("tests/test_tier_conformance.py", "tests/test_object_tier.py", "tests/test_promotion_dedup.py",
                 "tests/test_promotion_multirank.py", "tests/test_promotion_cli.py",
                 "tests/test_promotion_corruption.py", "tests/test_packed_chunks.py", "tests/test_multipart_owner.py",
                 "tests/test_peer_restore_path.py")
_START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _s3_ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/_localstack/health", timeout=2) as response:
            services = json.loads(response.read()).get("services", {})
    except (OSError, ValueError):
        return False
    return services.get("s3") in ("available", "running")


def start_localstack(python: str, port: int, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """LocalStack in host mode on ``127.0.0.1:port`` with only S3; (its process, its endpoint URL)."""
    environment = dict(os.environ, GATEWAY_LISTEN=f"127.0.0.1:{port}", SERVICES="s3", EAGER_SERVICE_LOADING="1",
                       LOCALSTACK_VOLUME_DIR=str(workdir / "volume"), FILESYSTEM_ROOT=str(workdir / "root"),
                       PERSISTENCE="0", DNS_ADDRESS="0", SKIP_INFRA_DOWNLOADS="1", DISABLE_EVENTS="1",
                       LOCALSTACK_CLI="1")
    log = open(workdir / "localstack.log", "wb")
    process = subprocess.Popen([python, "-m", "localstack.runtime.main"], stdout=log, stderr=subprocess.STDOUT,
                               env=environment, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _s3_ready(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            tail = (workdir / "localstack.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"LocalStack did not serve S3 on {endpoint} (exit {process.returncode}):\n{tail}")
        time.sleep(0.5)
    return process, endpoint


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM LocalStack's process group, SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--localstack-python", required=True, help="the Python of the venv holding localstack-core")
    parser.add_argument("--port", type=int, default=0, help="LocalStack's port (default: a free one)")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptd-localstack-") as scratch:
        workdir = Path(scratch)
        try:
            process, endpoint = start_localstack(args.localstack_python, args.port or _free_port(), workdir)
        except (OSError, RuntimeError) as error:
            print(f"test-s3-compat: {error}", file=sys.stderr)
            return 2
        try:
            version = subprocess.run([args.localstack_python, "-c", "import importlib.metadata as m; "
                                      "print(m.version('localstack-core'))"], capture_output=True, text=True).stdout
            print(f"LocalStack {version.strip()} (its own S3 provider) at {endpoint}", flush=True)
            environment = dict(os.environ, CKPTD_TEST_S3_ENDPOINT=endpoint)
            tests = args.pytest_args or list(DEFAULT_TESTS)
            return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", *tests],
                                  env=environment).returncode
        finally:
            stop(process)


if __name__ == "__main__":
    sys.exit(main())
