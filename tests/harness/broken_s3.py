"""Object stores that cannot answer, for tests of "a tier that fails never blocks a tier that works".

Everything stays on loopback:

- :func:`closed_port_options`: an endpoint on 127.0.0.1 where nothing listens (connection refused);
- :func:`unknown_host_options` with :func:`offline_resolver`: an endpoint under ``.invalid`` (RFC 6761)
  whose name resolution fails in-process, as a resolver answering NXDOMAIN would, so no DNS query leaves
  the machine (the machine's resolver may be remote);
- :func:`auth_enforcing_s3`: a real moto server that checks credentials, so unknown keys get 403
  ``InvalidAccessKeyId``;
- :func:`without_credentials`: an environment where botocore finds no credentials at all (and never
  asks an instance-metadata endpoint).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from ckptd.embedded_s3 import EmbeddedS3
from ckptd.testing.multirank import free_port

UNKNOWN_HOST = "ckptd-no-such-store.invalid"


def _options(endpoint: str, *, credentials: bool = True) -> dict[str, Any]:
    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    if credentials:
        options.update(key="testing", secret="testing")
    return options


def closed_port_options() -> dict[str, Any]:
    """s3fs options for an endpoint on a loopback port where nothing listens."""
    return _options(f"http://127.0.0.1:{free_port()}")


def unknown_host_options() -> dict[str, Any]:
    """s3fs options for an endpoint whose host name does not exist (use with :func:`offline_resolver`)."""
    return _options(f"http://{UNKNOWN_HOST}:9000")


@contextlib.contextmanager
def offline_resolver() -> Iterator[list[str]]:
    """Names under ``.invalid`` fail to resolve in this process without a query leaving it; every other
    name resolves as before. Wraps the real ``socket.getaddrinfo`` (which asyncio and aiohttp call).
    Yields the list of names it refused, for the test to check that the lookup went through it."""
    original = socket.getaddrinfo
    refused: list[str] = []

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host or "")
        if name.rstrip(".").endswith(".invalid"):
            refused.append(name)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return original(host, *args, **kwargs)

    socket.getaddrinfo = resolve  # type: ignore[assignment]
    try:
        yield refused
    finally:
        socket.getaddrinfo = original  # type: ignore[assignment]


@contextlib.contextmanager
def auth_enforcing_s3() -> Iterator[EmbeddedS3]:
    """A moto server that validates credentials from its first request on (moto's
    ``INITIAL_NO_AUTH_ACTION_COUNT=0``): requests signed with unknown keys get 403."""
    saved = os.environ.get("INITIAL_NO_AUTH_ACTION_COUNT")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    try:
        server = EmbeddedS3().start()
    finally:
        if saved is None:
            os.environ.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        else:
            os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = saved
    try:
        yield server
    finally:
        server.stop()


def options_without_credentials(endpoint: str) -> dict[str, Any]:
    """s3fs options that reach ``endpoint`` and name no credentials (use with :func:`without_credentials`)."""
    return _options(endpoint, credentials=False)


@contextlib.contextmanager
def without_credentials(scratch: str) -> Iterator[None]:
    """An environment in which botocore's credential chain finds nothing: no ``AWS_*`` keys or profile,
    credential and config files that do not exist (under ``scratch``), instance metadata disabled."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    for name in saved:
        del os.environ[name]
    os.environ.update(AWS_EC2_METADATA_DISABLED="true",
                      AWS_SHARED_CREDENTIALS_FILE=os.path.join(scratch, "no-credentials"),
                      AWS_CONFIG_FILE=os.path.join(scratch, "no-config"))
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(saved)


__all__ = ["UNKNOWN_HOST", "auth_enforcing_s3", "closed_port_options", "offline_resolver",
           "options_without_credentials", "unknown_host_options", "without_credentials"]
