"""Finding the tier for a URL: the ``ckptd.storage`` entry-point group, keyed by URL scheme, loaded lazily.

A URL's scheme is the part before ``://``; a bare path is ``file``. ckptd registers ``file`` (the
local tier) and ``s3`` (the object tier, any S3-compatible store) in its own package metadata; a plugin
package adds a scheme (a peer daemon, GCS, Azure) by registering a :class:`~ckptd.tiers.base.StorageTier`
subclass under the same group::

    [project.entry-points."ckptd.storage"]
    gs = "my_package.tier:GcsTier"

Entry points are listed when a scheme is asked for and imported only then, so a missing optional
dependency matters only to users of that scheme, and the error says what to install. The manager, the
CLI and the daemon never name a tier class: they open URLs here and ask the tier's
:class:`~ckptd.tiers.base.TierCapabilities` what it can do. :func:`register_tier` adds a tier in-process
(tests, notebooks) without packaging it.
"""

from __future__ import annotations

import threading
from importlib import metadata
from typing import Any

from ckptd.errors import PluginError
from ckptd.plugin_loading import entry_points, load_class
from ckptd.tiers.base import StorageTier

#: Entry-point group that storage tiers register under.
ENTRY_POINT_GROUP = "ckptd.storage"

#: What to install when a scheme is unknown or its tier fails to import.
_INSTALL_HINTS = {
    "s3": "pip install 'ckptd[s3]'",
    "s3a": "name the bucket as s3://bucket/prefix (any S3-compatible store: set endpoint_url)",
    "gs": "pip install gcsfs and a ckptd storage plugin that registers the 'gs' scheme",
    "gcs": "pip install gcsfs and a ckptd storage plugin that registers the 'gcs' scheme",
    "az": "pip install adlfs and a ckptd storage plugin that registers the 'az' scheme",
    "abfs": "pip install adlfs and a ckptd storage plugin that registers the 'abfs' scheme",
}

_lock = threading.Lock()
_registered: dict[str, type[StorageTier]] = {}


def scheme_of(url: str) -> str:
    """The scheme a tier URL names: ``s3`` for ``s3://bucket``, ``file`` for a bare path."""
    scheme, separator, _ = url.partition("://")
    if not separator or not scheme or "/" in scheme:
        return "file"
    return scheme.lower()


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return entry_points(ENTRY_POINT_GROUP)


def register_tier(scheme: str, tier: type[StorageTier]) -> None:
    """Make ``tier`` open URLs of ``scheme`` in this process (it wins over an entry point)."""
    with _lock:
        _registered[scheme.lower()] = tier


def unregister_tier(scheme: str) -> None:
    """Forget a tier added with :func:`register_tier` (entry points are untouched)."""
    with _lock:
        _registered.pop(scheme.lower(), None)


def registered_schemes() -> list[str]:
    """Every scheme known to this process, loaded or not."""
    with _lock:
        return sorted(set(_registered) | set(_entry_points()))


def tier_class(scheme: str) -> type[StorageTier]:
    """The tier class registered for ``scheme``; raises PluginError if it is unknown or fails to load."""
    scheme = scheme.lower()
    with _lock:
        if scheme in _registered:
            return _registered[scheme]
    entry = _entry_points().get(scheme)
    if entry is None:
        hint = _INSTALL_HINTS.get(scheme) or (f"known schemes: {', '.join(registered_schemes()) or 'none'}; a "
                                              f"plugin registers one under the entry-point group "
                                              f"{ENTRY_POINT_GROUP!r}")
        raise PluginError(f"no storage tier for URLs of scheme {scheme!r}", hint=hint)
    loaded = load_class(entry, StorageTier, what=f"the storage tier for {scheme!r} URLs",
                        install_hint=_INSTALL_HINTS.get(scheme))
    with _lock:
        _registered.setdefault(scheme, loaded)
        return _registered[scheme]


def open_tier(url: str, *, storage_options: dict[str, Any] | None = None, create: bool = False) -> StorageTier:
    """The tier a URL names, through the class registered for its scheme (see the module docstring).

    ``storage_options`` go to the backend (endpoint, region, credentials of an object store); a local
    directory that does not exist is created only with ``create=True``."""
    return tier_class(scheme_of(str(url))).from_url(str(url), storage_options=storage_options, create=create)


__all__ = ["ENTRY_POINT_GROUP", "open_tier", "register_tier", "registered_schemes", "scheme_of", "tier_class",
           "unregister_tier"]
