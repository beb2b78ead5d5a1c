"""Storage tiers, nearest first: memory (the staged copy), local disk, peer daemon, object storage.

Tiers are opened by URL through the ``ckptd.storage`` registry (:mod:`ckptd.tiers.registry`) and say
what they can do through :class:`TierCapabilities`."""

from __future__ import annotations

from ckptd.tiers.base import StorageTier, TierCapabilities
from ckptd.tiers.registry import ENTRY_POINT_GROUP, open_tier, register_tier, registered_schemes, scheme_of

__all__ = ["ENTRY_POINT_GROUP", "StorageTier", "TierCapabilities", "open_tier", "register_tier",
           "registered_schemes", "scheme_of"]
