"""The node daemon (``ckptd daemon``): promotes, replicates, scrubs and serves the steps of local roots.

- :class:`Daemon`: the orchestrator (watcher, journal, workers, HTTP server, control socket).
- :class:`DaemonConfig` / :func:`load_config`: its configuration (TOML < ``CKPTD_DAEMON_*`` < flags).

Names are imported on first use, so that the CLI's ``--check-config`` does not load the tiers.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Daemon": "service",
    "DaemonConfig": "config", "RootConfig": "config", "load_config": "config",
    "Journal": "journal", "Task": "journal",
    "CommitWatcher": "watcher",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"ckptd.daemon.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'ckptd.daemon' has no attribute {name!r}")
