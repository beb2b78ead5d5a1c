"""Settling the steps an earlier run left pinned, when several ranks promote their shares together.

A step pinned by an uploader that died before promoting it (a crash, a lost node) is resumed at the next
start. With several ranks every rank promotes its own share and one rank commits the step once every
share's ``rank-NNNNN.promoted`` marker exists, so a leftover step can be committed only when every rank of
the step either still holds its share pinned or promoted it before. A rank whose root was lost (a new node)
holds nothing, and its peers would wait for its share in vain.

Every rank publishes the steps it holds pinned through the job's store
(:meth:`~ckptd.promotion.schedule.PromotionSchedule.share_pins`); a rank holding a leftover step reads the
others' (:meth:`~ckptd.promotion.schedule.PromotionSchedule.shared_pins`) and settles the step with
:func:`settle_leftover`: the ranks that hold it promote it together (rank 0 commits when it holds the step,
else the lowest rank that holds it), or every holder releases its pin with a warning naming the step and
the ranks whose share is lost. Releasing a pin never deletes the committed local step. Every holder reaches
the same verdict from the same answers and markers: the shares it checks belong to ranks that do not hold
the step, so nobody writes them meanwhile.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.promotion.promoter import promoted_marker_name
from ckptd.tiers.object import ObjectTier


@dataclass(frozen=True)
class LeftoverVerdict:
    """What the ranks do with a leftover step: promote it (``committer`` commits it) or release its pins."""

    step: int
    promote: bool
    #: The rank that commits the step (promote only).
    committer: int | None = None
    #: Why, in words (the ranks whose share is lost, for a release).
    reason: str = ""


def holders_of(step: int, pins_by_rank: Mapping[int, Sequence[int]]) -> list[int]:
    """The ranks that published ``step`` among the steps they hold pinned, ascending."""
    return sorted(rank for rank, steps in pins_by_rank.items() if step in steps)


def settle_leftover(step: int, *, step_ranks: Sequence[int], holders: Collection[int],
                    remote: ObjectTier) -> LeftoverVerdict:
    """The verdict on a leftover ``step`` whose manifest names ``step_ranks``, pinned now by ``holders``
    (current ranks). Asks the object tier whether the step is committed and which absent ranks' markers
    exist (StorageError when it does not answer: the step then stays pinned)."""
    present = sorted(set(holders))
    committer = 0 if 0 in present else present[0]
    absent = [rank for rank in step_ranks if rank not in present]
    if not absent:
        return LeftoverVerdict(step, True, committer, "every rank holds its share")
    if remote.exists(step_file(step, MANIFEST_NAME)):
        return LeftoverVerdict(step, True, committer, "already committed on the object tier")
    lost = [rank for rank in absent if not remote.exists(step_file(step, promoted_marker_name(rank)))]
    if not lost:
        return LeftoverVerdict(step, True, committer,
                               f"rank(s) {', '.join(map(str, absent))} promoted their share in an earlier run")
    return LeftoverVerdict(step, False, None, f"rank(s) {', '.join(map(str, lost))} of the step hold no pinned copy "
                           "of their share and did not promote it (their local directory was lost or replaced)")
