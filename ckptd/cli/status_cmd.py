"""``ckptd status``: the status document of this node's daemon (steps per tier, lag, pending work, errors).

The daemon is found by ``--socket`` (or ``CKPTD_DAEMON_SOCKET``), or by the ``.ckptd-daemon.json`` it writes
into a root it watches (``--local ROOT``). Exit status: 0, 2 when neither names a daemon or the daemon refuses
this user (its ``control_allowed_uids``), 3 when no daemon answers, 1 when it answers with an error instead of
its status (one line on stderr).
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from ckptd.cli.options import json_option, print_json

#: Exit status when no daemon answers.
NO_DAEMON_EXIT = 3
#: Exit status when the daemon refuses this user.
REFUSED_EXIT = 2
_REFUSAL_WAIT_S = 2.0


@click.command("status")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), envvar="CKPTD_DAEMON_SOCKET", default=None,
              help="The daemon's control socket. [env: CKPTD_DAEMON_SOCKET]")
@click.option("--local", "local_root", type=click.Path(file_okay=False), default=None,
              help="A local checkpoint directory the daemon watches (its .ckptd-daemon.json names the socket).")
@json_option
@click.pass_context
def status(ctx: click.Context, socket_path: str | None, local_root: str | None, as_json: bool) -> None:
    """Show the status document of this node's ckptd daemon (exit 3 when no daemon answers)."""
    from pathlib import Path

    from ckptd.manager.daemon_link import DaemonLink, daemon_socket_path

    if local_root is not None and ctx.get_parameter_source("socket_path") != click.core.ParameterSource.COMMANDLINE:
        socket_path = None  # --local names the daemon; CKPTD_DAEMON_SOCKET does not override it
    if socket_path is None and local_root is not None:
        found = daemon_socket_path(Path(local_root), environ={})
        if found is None:
            click.echo(f"ckptd: error: no daemon watches {local_root} (it holds no readable .ckptd-daemon.json)",
                       err=True)
            raise click.exceptions.Exit(NO_DAEMON_EXIT)
        socket_path = str(found)
    if socket_path is None:
        raise click.UsageError("name the daemon: --socket PATH or --local ROOT (or set CKPTD_DAEMON_SOCKET)")
    link = DaemonLink(socket_path)
    try:
        document = link.status()
    finally:
        link.close()
    refusal = str(link.refusal) if document is None and link.alive and link.refusal else None
    if document is None and (refusal is None or "may not use" not in refusal):
        refusal = _refusal(socket_path) if not link.alive else None
    if document is None and refusal is not None and "may not use" in refusal:
        click.echo(f"ckptd: error: the ckptd daemon on {socket_path} refuses this user: {refusal}; run this as a "
                   f"user in the daemon's control_allowed_uids (or add UID {os.geteuid()} there)", err=True)
        raise click.exceptions.Exit(REFUSED_EXIT)
    if document is None and link.alive:
        click.echo(f"ckptd: error: the ckptd daemon on {socket_path} answered without its status: {link.refusal}; "
                   "see its log", err=True)
        raise click.exceptions.Exit(1)
    if document is None:
        click.echo(f"ckptd: error: no ckptd daemon answers on {socket_path} ({link.failure})", err=True)
        raise click.exceptions.Exit(NO_DAEMON_EXIT)
    if as_json:
        print_json(document)
        return
    _print_document(document)


def _refusal(socket_path: str) -> str | None:
    """The daemon's refusal of this user, which it sends on connecting, before reading anything (None: none)."""
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(_REFUSAL_WAIT_S)
            connection.connect(socket_path)
            line = connection.recv(4096).split(b"\n", 1)[0]
    except OSError:
        return None
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    if isinstance(answer, dict) and answer.get("ok") is False and "may not use" in str(answer.get("error", "")):
        return str(answer["error"])
    return None


def _print_document(document: dict[str, Any]) -> None:
    """The status document as rich tables: the daemon's own fields, each root's tiers (steps and lag), then
    one table per other section."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    overview = Table("field", "value", title="ckptd daemon", show_header=False)
    for key, value in document.items():
        if not isinstance(value, (dict, list)):
            overview.add_row(key, _cell(value))
    console.print(overview)
    roots = document.get("roots")
    by_tier = _has_tiers(roots)
    if by_tier:
        for name, root in roots.items():
            table = Table("tier", "url", "steps", "newest", "lag (steps)", "lag (s)", title=f"root {name}")
            for tier, about in root["tiers"].items():
                about = about if isinstance(about, dict) else {}
                steps = about.get("steps")
                table.add_row(tier, _cell(about.get("url")), _steps(steps),
                              _cell(max(steps) if isinstance(steps, list) and steps else None),
                              _cell(about.get("lag_steps")), _cell(about.get("lag_seconds")))
            console.print(table)
            for key, value in root.items():
                if key != "tiers":
                    console.print(f"  {key}: {_cell(value)}")
    for key, value in document.items():
        if key == "roots" and by_tier:
            continue
        rows = _rows(value)
        if rows is None:
            continue
        columns = list(dict.fromkeys(column for _, row in rows for column in row))
        table = Table("", *columns, title=key)
        for name, row in rows:
            table.add_row(name, *(_cell(row.get(column)) for column in columns))
        console.print(table if rows else f"{key}: none")


def _rows(value: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """A section as (row name, fields) pairs: a dict of dicts by key, a list of dicts by position, a dict of
    scalars as one row; None for a scalar."""
    if isinstance(value, dict):
        if value and all(isinstance(item, dict) for item in value.values()):
            return [(str(name), item) for name, item in value.items()]
        return [("", value)] if value else []
    if isinstance(value, list):
        return [(str(index), item if isinstance(item, dict) else {"value": item}) for index, item in enumerate(value)]
    return None


def _has_tiers(roots: Any) -> bool:
    """Whether ``roots`` is a dict of roots that each hold a ``tiers`` dict (shown as one table per root)."""
    return isinstance(roots, dict) and bool(roots) and all(
        isinstance(root, dict) and isinstance(root.get("tiers"), dict) for root in roots.values())


def _steps(steps: Any) -> str:
    """A step list in a few characters: all of them when short, else the first, the last and the count."""
    if not isinstance(steps, list):
        return _cell(steps)
    if len(steps) <= 6:
        return ", ".join(map(str, steps)) or "none"
    return f"{steps[0]} ... {steps[-1]} ({len(steps)})"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    return str(value)
