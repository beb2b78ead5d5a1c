"""``ckptd daemon``: run the node daemon (see :mod:`ckptd.daemon.service`).

Options come from ``--config FILE`` (TOML), then ``CKPTD_DAEMON_*`` variables, then these flags, later ones
winning (:func:`ckptd.daemon.config.load_config`). ``--check-config`` validates and prints one line.

SIGTERM and SIGINT drain: no new task starts, running ones get ``drain_timeout_s``, the rest stays journaled.
Exit codes: 0 clean stop (or a valid config), 2 configuration error (one line on stderr), 1 any other failure.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ckptd.errors import CkptdError, ConfigError

F = TypeVar("F", bound=Callable[..., Any])

#: (flag key, metavar, help) of every option; the variable is CKPTD_DAEMON_<KEY>.
_TOP_FLAGS = (
    ("node_id", "ID", "This node's id (default: the host name)."),
    ("state_dir", "DIR", "Directory of the journal, the control socket and daemon.json (required)."),
    ("listen", "HOST:PORT", "HTTP address (default 127.0.0.1:9470; port 0 picks one)."),
    ("socket", "PATH", "Control socket (default <state_dir>/daemon.sock)."),
    ("control_allowed_uids", "UID,...", "User ids allowed on the control socket (default: the daemon's own)."),
    ("peer_token", "TOKEN", "Bearer token of peer traffic (also CKPTD_PEER_TOKEN; prefer --peer-token-file)."),
    ("peer_token_file", "FILE", "File holding the peer token (also CKPTD_PEER_TOKEN_FILE)."),
    ("buddy", "peer://HOST:PORT|dns://NAME:PORT", "The buddy daemon this node replicates to, or a name listing "
     "every node's daemon (the next address after this node's own is the buddy)."),
    ("advertise", "ADDRESS", "This node's address in a dns:// buddy's ring (default: listen's host)."),
    ("replica_dir", "DIR", "Where replicas from buddies are kept (default <state_dir>/replicas)."),
    ("watch", "auto|inotify|poll", "How commits are noticed (default auto)."),
    ("poll_interval_s", "SECONDS", "Rescan interval when polling (default 1.0; x10 with inotify)."),
    ("scrub_interval_s", "SECONDS", "Seconds between scrub passes (default 3600; 0 never)."),
    ("scrub_bytes_per_s", "BYTES", "Scrub read rate limit (default 50e6)."),
    ("drain_timeout_s", "SECONDS", "How long SIGTERM waits for running tasks (default 30)."),
    ("retry_backoff_s", "SECONDS", "First retry delay of a failed task, doubling (default 2)."),
    ("peer_max_concurrency", "N", "Most peer requests served at once (default 16)."),
    ("peer_max_put_bytes", "BYTES", "Largest replica file accepted (default 64 GiB)."),
    ("log_level", "LEVEL", "debug, info, warning or error (default info)."),
    ("keep_peer", "N", "Replicated steps kept per buddy root (default 2)."),
    ("cpu_policy", "nice|idle", "How copy threads yield the CPU: nice (default) or idle (SCHED_IDLE: only spare "
     "CPU, copies lag on a busy node)."),
    ("local_disk", "any|separate", "separate: refuse to start when a root's local directory is on the disk of the "
     "state dir or of / (an NVMe that did not mount); any (default): no check."),
)
_ROOT_FLAGS = (
    ("name", "NAME", "Name of the single root given by flags (default 'default')."),
    ("local", "DIR", "The single root's local checkpoint directory."),
    ("remote", "s3://BUCKET/PREFIX", "The single root's object tier."),
    ("s3_endpoint_url", "URL", "S3-compatible endpoint of the single root's object tier."),
    ("remote_every_steps", "N", "Promote the steps that are multiples of N (default every one)."),
    ("replicate_every_steps", "N", "Replicate the steps that are multiples of N (default every one)."),
    ("keep_local", "N", "Committed steps the daemon keeps in the local root (default: left to the trainer)."),
    ("keep_remote", "N", "Committed steps the daemon keeps on the object tier (default: all)."),
)
_KEYS = tuple(key for key, *_ in _TOP_FLAGS + _ROOT_FLAGS)


def _flags(command: F) -> F:
    for key, metavar, text in reversed(_TOP_FLAGS + _ROOT_FLAGS):
        variable = f"CKPTD_DAEMON_{key.upper()}"
        command = click.option(f"--{key.replace('_', '-')}", key, metavar=metavar, default=None,
                               help=f"{text} [env: {variable}]")(command)
    return command


@click.command("daemon")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="CKPTD_DAEMON_CONFIG", help="TOML config file. [env: CKPTD_DAEMON_CONFIG]")
@click.option("--check-config", is_flag=True, help="Validate the configuration, print one line and exit.")
@click.option("--print-token", "print_token", type=click.Choice(["node", "read", "scrape"]), default=None,
              help="Print the token of this scope derived from the configured peer token and exit: 'scrape' reads "
                   "/metrics (Prometheus), 'read' also /status and peer reads (restoring trainers), 'node' writes "
                   "only into replicas/<node id>/ (--token-node-id).")
@click.option("--token-node-id", default=None, metavar="ID", help="The node a 'node' token is for (default: this "
              "daemon's node_id).")
@_flags
def daemon(config_path: Path | None, check_config: bool, print_token: str | None, token_node_id: str | None,
           **flags: Any) -> None:
    """Run the node daemon: promote, replicate, scrub and serve the committed steps of local roots."""
    from ckptd.daemon.config import load_config

    overrides = {key: value for key, value in flags.items() if key in _KEYS and value is not None}
    config = load_config(config_path, overrides, os.environ)  # ConfigError: one line, exit 2
    if check_config:
        click.echo(config.describe())
        return
    if print_token is not None:
        from ckptd.daemon.auth import derive_token

        if not config.peer_token:
            raise ConfigError("no peer token is configured to derive a token from",
                              hint="set peer_token_file (or CKPTD_PEER_TOKEN)")
        click.echo(derive_token(config.peer_token, print_token, token_node_id or config.node_id))
        return
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    from ckptd.daemon.redaction import install_redaction, known_secrets

    install_redaction(known_secrets(config.peer_token, [root.storage_options for root in config.roots]))
    sys.exit(_run(config))


def _run(config: Any) -> int:
    from ckptd.daemon.service import Daemon

    stop_requested = threading.Event()

    def on_signal(number: int, frame: object) -> None:
        logging.getLogger("ckptd.daemon").info("signal %d: draining", number)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service = Daemon(config)
    try:
        service.start()
    except ConfigError:
        service.stop(0)
        raise
    except CkptdError as error:
        service.stop(0)
        click.echo(f"ckptd: error: {error}", err=True)
        return 1
    except Exception as error:  # noqa: BLE001 - one line, exit 1 (CKPTD_DEBUG=1 shows the traceback)
        if os.environ.get("CKPTD_DEBUG"):
            raise
        click.echo(f"ckptd: error: the daemon failed to start: {type(error).__name__}: {error}", err=True)
        return 1
    while not stop_requested.wait(1.0):
        pass
    left = service.stop()
    if left:  # copies still running past the drain deadline: leave them journaled, exit now
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
