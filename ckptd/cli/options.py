"""Options and helpers shared by the subcommands: opening tiers, JSON output, progress bars."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from ckptd.tiers import StorageTier, open_tier

F = TypeVar("F", bound=Callable[..., Any])


def storage_options(endpoint_url: str | None, region: str | None = None) -> dict[str, Any] | None:
    """fsspec/s3fs options from the command line (credentials come from the usual AWS places)."""
    client_kwargs: dict[str, Any] = {}
    if endpoint_url:
        client_kwargs["endpoint_url"] = endpoint_url
    if region:
        client_kwargs["region_name"] = region
    return {"client_kwargs": client_kwargs} if client_kwargs else None


def s3_options(command: F) -> F:
    """Adds --endpoint-url and --region to a command that opens tiers."""
    command = click.option("--region", envvar="CKPTD_S3_REGION", default=None,
                           help="Object-store region. [env: CKPTD_S3_REGION]")(command)
    command = click.option("--endpoint-url", envvar="CKPTD_S3_ENDPOINT_URL", default=None,
                           help="S3-compatible endpoint (MinIO, moto, ...). [env: CKPTD_S3_ENDPOINT_URL]")(command)
    return command


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(command)


def open_cli_tier(url: str, endpoint_url: str | None, region: str | None) -> StorageTier:
    return open_tier(url, storage_options=storage_options(endpoint_url, region))


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


@contextmanager
def byte_progress(description: str, total: int, *, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar over bytes on stderr; yields the function that advances it."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, \
        TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=not enabled, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total)
        yield lambda done: progress.advance(task, done)
