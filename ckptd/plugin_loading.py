"""Loading plugins from entry points, the same way for every plugin group ckptd reads.

A leaf module. ckptd reads three namespaced entry-point groups (:data:`PLUGIN_GROUPS`):

- ``ckptd.storage``: storage tiers by URL scheme (read by ``ckptd.tiers.registry``);
- ``ckptd.shard_readers``: data-shard formats (read by ``ckptd.data.registry``);
- ``ckptd.integrations``: framework integrations (Lightning, Hugging Face), loaded with
  :func:`load_integration`.

Entry points are listed without importing anything; one is imported only when it is asked for. An
ImportError on the way (an optional dependency that is not installed) becomes
:class:`~ckptd.errors.PluginError` with the install hint. What an entry point needs is the *extra* it
names, in the standard entry-point syntax (``name = "module:object [extra]"``): the hint is then
``pip install 'dist[extra]'`` and :func:`list_plugins` shows that extra's requirements and whether they
are installed, which is what ``ckptd plugins`` prints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from ckptd.errors import PluginError

Loaded = TypeVar("Loaded", bound=type)

#: Entry-point group of storage tiers, keyed by URL scheme.
STORAGE_GROUP = "ckptd.storage"
#: Entry-point group of data-shard readers, keyed by format name.
SHARD_READERS_GROUP = "ckptd.shard_readers"
#: Entry-point group of framework integrations, keyed by framework.
INTEGRATIONS_GROUP = "ckptd.integrations"
#: Every group ckptd reads, in the order ``ckptd plugins`` lists them.
PLUGIN_GROUPS = (STORAGE_GROUP, SHARD_READERS_GROUP, INTEGRATIONS_GROUP)

#: Extras of ckptd's own entry points that are registered without the ``[extra]`` syntax (tests pin those
#: values): what they need all the same.
_BUILTIN_EXTRAS: dict[tuple[str, str], tuple[str, ...]] = {(STORAGE_GROUP, "s3"): ("s3",)}

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class PluginInfo:
    """One installed entry point of a ckptd plugin group, as ``ckptd plugins`` reports it.

    ``extras`` are the extras the entry point declares; ``requirements`` the requirements those extras
    add (as the distribution lists them) and ``missing`` the ones not installed. ``importable`` is None
    when the listing did not try to import the entry point; ``error`` is the import error otherwise."""

    group: str
    name: str
    target: str
    distribution: str | None
    extras: tuple[str, ...]
    requirements: tuple[str, ...]
    missing: tuple[str, ...]
    importable: bool | None
    error: str | None
    install_hint: str | None

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values (``ckptd plugins --json``)."""
        return {"group": self.group, "name": self.name, "target": self.target, "distribution": self.distribution,
                "extras": list(self.extras), "requirements": list(self.requirements), "missing": list(self.missing),
                "importable": self.importable, "error": self.error, "install_hint": self.install_hint}


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The entry points of ``group`` by name (nothing is imported)."""
    return {entry.name: entry for entry in metadata.entry_points(group=group)}


def _target(entry: metadata.EntryPoint) -> str:
    return entry.value.split("[", 1)[0].strip()


def _distribution_name(entry: metadata.EntryPoint) -> str | None:
    dist = getattr(entry, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def extras_of(entry: metadata.EntryPoint) -> tuple[str, ...]:
    """The extras ``entry`` needs: those it declares, else those ckptd knows for its own entry points."""
    if entry.extras:
        return tuple(entry.extras)
    if _distribution_name(entry) == "ckptd":
        return _BUILTIN_EXTRAS.get((entry.group, entry.name), ())
    return ()


def extra_requirements(entry: metadata.EntryPoint) -> tuple[str, ...]:
    """The requirements that the extras ``entry`` needs add to its distribution (none without extras)."""
    dist = getattr(entry, "dist", None)
    wanted = set(extras_of(entry))
    if dist is None or not wanted:
        return ()
    found = []
    for requirement in dist.requires or ():
        requirement_text, _, marker = requirement.partition(";")
        extras = set(_EXTRA_MARKER.findall(marker))
        if extras & wanted:
            found.append(requirement_text.strip())
    return tuple(found)


def _missing(requirements: tuple[str, ...], distribution: str | None) -> tuple[str, ...]:
    missing = []
    for requirement in requirements:
        matched = _REQUIREMENT_NAME.match(requirement)
        name = matched.group(1) if matched else requirement
        if distribution is not None and name.lower() == distribution.lower():
            continue  # "ckptd[s3]" inside an extra of ckptd itself: its own requirements are listed already
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(requirement)
    return tuple(missing)


def install_hint(entry: metadata.EntryPoint) -> str:
    """What to install so that ``entry`` imports: ``pip install 'ckptd[lightning]'`` for an entry point that
    declares the extra ``lightning``, else the package that provides it."""
    distribution, extras = _distribution_name(entry), extras_of(entry)
    if extras and distribution:
        return f"pip install '{distribution}[{','.join(extras)}]'"
    return f"install the package that provides {_target(entry)!r}"


def load_object(entry: metadata.EntryPoint, *, what: str, install_hint_text: str | None = None) -> Any:
    """Import what ``entry`` names; ``what`` names the plugin in errors (e.g. "the Lightning integration").

    An ImportError (or a PluginError the plugin raises itself for a missing dependency) becomes a
    PluginError with the install hint: ``install_hint_text`` when given, else :func:`install_hint`."""
    try:
        return entry.load()
    except PluginError:
        raise
    except ImportError as exc:
        raise PluginError(f"{what} could not be imported ({exc})",
                          hint=install_hint_text or install_hint(entry)) from exc


def load_class(entry: metadata.EntryPoint, base: Loaded, *, what: str, install_hint: str | None) -> Loaded:
    """Import the class ``entry`` names and check that it subclasses ``base``; ``what`` names the plugin in
    errors (e.g. "the storage tier for 's3' URLs")."""
    loaded = load_object(entry, what=what, install_hint_text=install_hint)
    if not (isinstance(loaded, type) and issubclass(loaded, base)):
        raise PluginError(f"entry point {entry.name!r} ({entry.value}) is not a ckptd {base.__name__} subclass",
                          hint="fix the plugin's entry point")
    return loaded  # type: ignore[return-value]


def load_integration(name: str) -> Any:
    """The object the ``ckptd.integrations`` entry point ``name`` names (e.g. ``"lightning"``: the
    ``CheckpointIO`` class), imported now; PluginError with the install hint when it is unknown or its
    framework is not installed."""
    entry = entry_points(INTEGRATIONS_GROUP).get(name)
    if entry is None:
        known = ", ".join(sorted(entry_points(INTEGRATIONS_GROUP))) or "none"
        raise PluginError(f"no ckptd integration named {name!r}",
                          hint=f"known integrations: {known}; `ckptd plugins` lists every plugin")
    return load_object(entry, what=f"the {name!r} integration")


def describe(group: str, entry: metadata.EntryPoint, *, try_import: bool = True) -> PluginInfo:
    """What ``entry`` of ``group`` needs and, with ``try_import``, whether it imports now."""
    distribution = _distribution_name(entry)
    requirements = extra_requirements(entry)
    importable: bool | None = None
    error: str | None = None
    if try_import:
        try:
            load_object(entry, what=f"{group} plugin {entry.name!r}")
            importable = True
        except PluginError as exc:
            importable, error = False, exc.message
        except Exception as exc:  # a plugin that breaks on import is reported, not fatal to the listing
            importable, error = False, f"{type(exc).__name__}: {exc}"
    return PluginInfo(group=group, name=entry.name, target=_target(entry), distribution=distribution,
                      extras=extras_of(entry), requirements=requirements,
                      missing=_missing(requirements, distribution), importable=importable, error=error,
                      install_hint=install_hint(entry) if extras_of(entry) or importable is False else None)


def list_plugins(groups: tuple[str, ...] = PLUGIN_GROUPS, *, try_import: bool = True,
                 names: tuple[str, ...] | None = None) -> list[PluginInfo]:
    """Every installed entry point of ``groups`` (only those called one of ``names``, when given), by group
    then name (see :class:`PluginInfo`)."""
    found = []
    for group in groups:
        for name, entry in sorted(entry_points(group).items()):
            if names is None or name in names:
                found.append(describe(group, entry, try_import=try_import))
    return found
