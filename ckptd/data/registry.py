"""Finding shard readers: the ``ckptd.shard_readers`` entry-point group, loaded lazily.

Entry points are listed once and imported only when a format is asked for, so a missing optional
dependency (pyarrow for Parquet) only matters to users of that format, and then the error says what to
install. :func:`register_reader` adds a reader in-process (tests, notebooks) without packaging it.
"""

from __future__ import annotations

import threading
from importlib import metadata
from typing import Any

from ckptd.data.reader_api import ShardReader
from ckptd.errors import PluginError
from ckptd.plugin_loading import entry_points, load_class

#: Entry-point group that shard readers register under.
ENTRY_POINT_GROUP = "ckptd.shard_readers"

#: What to install when a built-in reader's import fails.
_INSTALL_HINTS = {
    "parquet": "pip install 'ckptd[data]' (it needs pyarrow)",
}

_lock = threading.Lock()
_registered: dict[str, type[ShardReader]] = {}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return entry_points(ENTRY_POINT_GROUP)


def register_reader(name: str, reader: type[ShardReader]) -> None:
    """Make ``reader`` available under ``name`` in this process (it wins over an entry point)."""
    with _lock:
        _registered[name] = reader


def available_formats() -> list[str]:
    """Names of every reader known to this process, loaded or not."""
    with _lock:
        return sorted(set(_registered) | set(_entry_points()))


def reader_class(name: str) -> type[ShardReader]:
    """The reader class registered as ``name``; raises PluginError if it is unknown or fails to load."""
    with _lock:
        if name in _registered:
            return _registered[name]
    entry = _entry_points().get(name)
    if entry is None:
        raise PluginError(f"no shard reader named {name!r}",
                          hint=f"known formats: {', '.join(available_formats()) or 'none'}; a third-party "
                               f"reader registers under the entry-point group {ENTRY_POINT_GROUP!r}")
    loaded = load_class(entry, ShardReader, what=f"the {name!r} shard reader", install_hint=_INSTALL_HINTS.get(name))
    with _lock:
        _registered.setdefault(name, loaded)
        return _registered[name]


def make_reader(name: str, options: dict[str, Any] | None = None) -> ShardReader:
    """An instance of reader ``name`` with ``options``."""
    return reader_class(name)(**dict(options or {}))
