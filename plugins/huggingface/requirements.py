"""Importing an optional framework, or a PluginError that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

from ckptd.errors import PluginError

#: What installs every framework this package integrates with.
INSTALL_HINT = "pip install 'ckptd[huggingface]'"


def require(module: str, *, needed_by: str) -> ModuleType:
    """Import ``module`` (``transformers``, ``accelerate``); PluginError with the install hint when it is missing.

    ``needed_by`` names what needs it in the message (e.g. ``"ckptd.plugins.huggingface.CkptdCallback"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(f"{needed_by} needs {module!r}, which could not be imported ({exc})",
                          hint=INSTALL_HINT) from exc
