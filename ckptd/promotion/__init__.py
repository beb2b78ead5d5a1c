"""Promotion of committed steps to the object tier, garbage collection, and pulling steps back.

- :class:`Promoter` / :func:`promote_step`: verified, deduplicated, resumable copy of a local step.
- :class:`BackgroundUploader`: the in-process uploader the manager runs (the daemon schedules its own).
- :func:`collect_garbage`: retention plus mark-and-sweep of unreferenced chunks, for both tiers.
- :func:`pull_step` / :func:`prefetch_step`: re-populating the local tier, read-ahead for restores.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it, imported on first use (the CLI's verify and promote load
#: parts of this package and must not pull in torch through the others).
_HOMES = {
    "GcReport": "gc", "collect_garbage": "gc",
    "Promoter": "promoter", "PromotionReport": "promoter", "promote_step": "promoter", "stored_chunks": "promoter",
    "prefetch_step": "pull", "pull_step": "pull",
    "BackgroundUploader": "uploader",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"ckptd.promotion.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'ckptd.promotion' has no attribute {name!r}")
