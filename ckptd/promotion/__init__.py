"""Promotion of committed steps to the object tier, garbage collection, and pulling steps back.

- :class:`Promoter` / :func:`promote_step`: verified, deduplicated, resumable copy of a local step.
- :class:`BackgroundUploader`: the in-process uploader the manager (and later the daemon) runs.
- :func:`collect_garbage`: retention plus mark-and-sweep of unreferenced chunks, for both tiers.
- :func:`pull_step` / :func:`prefetch_step`: re-populating the local tier, read-ahead for restores.
"""

from __future__ import annotations

from ckptd.promotion.gc import GcReport, collect_garbage
from ckptd.promotion.promoter import Promoter, PromotionReport, promote_step, stored_chunks
from ckptd.promotion.pull import prefetch_step, pull_step
from ckptd.promotion.uploader import BackgroundUploader

__all__ = ["BackgroundUploader", "GcReport", "Promoter", "PromotionReport", "collect_garbage",
           "prefetch_step", "promote_step", "pull_step", "stored_chunks"]
