"""Storage tiers, nearest first: memory (the staged copy), local disk, peer daemon, object storage."""

from __future__ import annotations

from typing import Any

from ckptd.tiers.base import StorageTier


def open_tier(url: str, *, storage_options: dict[str, Any] | None = None, create: bool = False) -> StorageTier:
    """The tier a URL names: a directory or ``file://`` URL is the local tier, ``s3://`` the object tier.

    A local directory that does not exist is created only with ``create=True``."""
    if url.startswith("s3://"):
        from ckptd.tiers.object import ObjectTier

        return ObjectTier(url, storage_options=storage_options)
    from ckptd.tiers.local import LocalTier

    return LocalTier(url, create=create)


__all__ = ["StorageTier", "open_tier"]
