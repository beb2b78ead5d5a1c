"""Which steps the ranks of a job promote together: rank 0 decides, every other rank follows.

With several ranks every rank promotes its own share of a step and rank 0 commits the step once every
share arrived, so the ranks must promote exactly the same steps. Rank 0's uploader picks the next step as
a single process does (the newest committed step supersedes the queued ones) and announces it; the
announcements form one sequence, numbered from 1. Every other rank reads the sequence in order, promotes
its share of each announced step and releases its pins of the older steps that were never announced.
When rank 0's uploader closes it announces that no step follows.

Steps an earlier run left pinned (its uploader died before promoting them) are not in the sequence: each
rank publishes the steps it holds pinned (:meth:`PromotionSchedule.share_pins`), and a rank holding such a
leftover step learns which ranks still hold their share of it (:meth:`PromotionSchedule.shared_pins`), so
that the ranks that hold it promote it together, or release it when a share is lost with its node (see
:mod:`ckptd.promotion.leftovers`).

:class:`PromotionSchedule` is what the uploader needs; the manager implements it over the job's c10d store
(:mod:`ckptd.manager.promotion_schedule`), so promotion does not depend on the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision number ``index`` (from 1): promote ``step``, or (``step`` None) no step follows."""

    index: int
    step: int | None

    @property
    def closing(self) -> bool:
        """Whether rank 0's uploader closed: no decision follows this one."""
        return self.step is None


class PromotionSchedule(Protocol):
    """The sequence of rank 0's promotion decisions, shared by the ranks of one job incarnation.

    Rank 0 calls :meth:`announce` (and :meth:`announce_closing` once, at the end) from its uploader
    thread; the other ranks call :meth:`next_decision` from theirs. Decisions are announced in ascending
    step order."""

    def announce(self, step: int) -> int:
        """Rank 0: announce that ``step`` is promoted next; returns the decision's index."""

    def announce_closing(self) -> None:
        """Rank 0: announce that no decision follows (its uploader closes)."""

    def next_decision(self, after_index: int, timeout_s: float) -> Decision | None:
        """The decision after ``after_index`` (0: the first), waiting at most ``timeout_s`` seconds for it
        (0: only look); None when it was not announced by then."""

    def wait_for_decision(self, after_index: int, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds until the decision after ``after_index`` is announced, without
        reading it (a reader waits with this, then reads with :meth:`next_decision` and no wait)."""

    def share_pins(self, steps: Sequence[int]) -> None:
        """Every rank (at the uploader's start, and again when the ranks re-form in a new generation): publish
        the steps this rank holds pinned with its own share. Never waits."""

    def shared_pins(self, timeout_s: float) -> dict[int, list[int]]:
        """The steps each rank published (rank -> steps), waiting at most ``timeout_s`` seconds for every
        rank's; a rank that has not published by then is missing from the answer."""
