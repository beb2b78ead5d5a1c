"""An S3 endpoint on loopback for demos and tests: moto's server in a child process.

It speaks real S3 over HTTP on 127.0.0.1 and a free port, so every client (s3fs, boto3) talks to it
exactly as it would to AWS or MinIO. Data lives in the child's memory and is gone when it stops.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ckptd.errors import PluginError, StorageError

_STARTUP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedS3:
    """A running moto server; use as a context manager or call :meth:`stop`."""

    host: str = "127.0.0.1"
    port: int = 0
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, object]:
        """fsspec/s3fs options that reach this endpoint."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    def start(self) -> EmbeddedS3:
        try:
            import moto.server  # noqa: F401
        except ImportError as exc:
            raise PluginError(
                "the embedded S3 endpoint needs moto's server",
                hint="install it with: pip install 'ckptd[embedded-s3]'",
            ) from exc
        if not self.port:
            self.port = _free_port()
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise StorageError(f"the embedded S3 server exited with code {self._process.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise StorageError(f"the embedded S3 server did not listen on {self.endpoint_url} in time")

    def create_bucket(self, name: str) -> None:
        """Create a bucket (idempotent)."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if name not in existing:
            client.create_bucket(Bucket=name)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
