"""One way for every framework integration to restore the step a pointer names, and to fall back.

A framework keeps its own small record of which ckptd step a checkpoint is (Lightning's pointer file,
accelerate's ``ckptd-step.json``, the Hugging Face Trainer's ``checkpoint-N`` directory). When that step is
not intact on any tier (the process died before it committed, or its bytes went bad), every integration
does the same: it warns once, naming the pointer, the step and the step it goes back to, and restores the
newest older step committed on some tier; with no older step it raises
:class:`~ckptd.errors.NotFoundError`. None of them starts from step 0 without saying so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from ckptd.errors import CkptdError, NoIntactCheckpointError, NotFoundError

log = logging.getLogger("ckptd.plugins")


def fallback_warning(pointer: str, step: int, fallback: int, why: str) -> str:
    """The one wording of the warning (see the module docstring)."""
    return (f"the checkpoint {pointer} points to ckptd step {step}, which no tier holds intact ({why}): "
            f"restoring step {fallback}, the newest older committed step; training resumes from step {fallback}")


def committed_on_any_tier(manager: Any) -> list[int]:
    """The steps committed on some tier of ``manager`` (a tier that cannot answer counts as empty), ascending."""
    found: set[int] = set()
    for tier in manager.tiers:
        try:
            found.update(tier.committed_steps())
        except CkptdError as error:
            log.warning("could not list the committed steps of %s: %s", tier.label, error)
    return sorted(found)


def restore_pointed_step(manager: Any, state: Callable[[], MutableMapping[str, Any]], step: int,
                         pointer: str | os.PathLike[str], *, keys: list[str] | None = None) -> int:
    """Restore ``step``, which ``pointer`` names, into ``state()`` (called again for each try, so that a
    try that failed half-way leaves nothing behind); when no tier holds it intact, warn and restore the
    newest older committed step that loads. ``keys``: a partial restore of those keys. Returns the step
    restored."""
    where = os.fspath(pointer)
    options = {} if keys is None else {"keys": keys}
    try:
        restored = manager.restore(state(), step=step, **options)
    except (NotFoundError, NoIntactCheckpointError) as error:
        why: CkptdError = error
    else:
        if restored is None:  # the manager found nothing at all: as if the step were lost
            why = NotFoundError("no step is committed on any tier", step=step)
        else:
            return int(restored)
    reasons = [str(why)]
    for older in reversed([candidate for candidate in committed_on_any_tier(manager) if candidate < step]):
        log.warning("%s", fallback_warning(where, step, older, "; ".join(reasons)))
        try:
            restored = manager.restore(state(), step=older, **options)
        except (NotFoundError, NoIntactCheckpointError) as error:
            reasons.append(f"step {older} did not load either: {error}")
            continue
        if restored is not None:
            return int(restored)
    raise NotFoundError(f"the checkpoint points to ckptd step {step}, which no tier holds intact, and no older "
                        f"step is committed and intact ({'; '.join(reasons)})", step=step, path=where,
                        hint="resume from another checkpoint, or check the tiers with `ckptd ls`") from why
