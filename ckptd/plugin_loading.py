"""Loading one class from an entry point, the same way for every plugin group ckptd reads.

A leaf module: the tier registry (``ckptd.storage``) and the shard-reader registry
(``ckptd.shard_readers``) both import the entry point only when it is asked for, turn an ImportError into
:class:`~ckptd.errors.PluginError` with an install hint, and refuse an entry point that does not name a
subclass of what the group expects.
"""

from __future__ import annotations

from importlib import metadata
from typing import TypeVar

from ckptd.errors import PluginError

Loaded = TypeVar("Loaded", bound=type)


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The entry points of ``group`` by name (nothing is imported)."""
    return {entry.name: entry for entry in metadata.entry_points(group=group)}


def load_class(entry: metadata.EntryPoint, base: Loaded, *, what: str, install_hint: str | None) -> Loaded:
    """Import the class ``entry`` names and check that it subclasses ``base``; ``what`` names the plugin in
    errors (e.g. "the storage tier for 's3' URLs")."""
    try:
        loaded = entry.load()
    except ImportError as exc:
        hint = install_hint or f"install the package that provides {entry.value!r}"
        raise PluginError(f"{what} could not be imported ({exc})", hint=hint) from exc
    if not (isinstance(loaded, type) and issubclass(loaded, base)):
        raise PluginError(f"entry point {entry.name!r} ({entry.value}) is not a ckptd {base.__name__} subclass",
                          hint="fix the plugin's entry point")
    return loaded  # type: ignore[return-value]
