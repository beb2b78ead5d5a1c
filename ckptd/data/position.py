"""Which batch a saved step resumes at, whatever the shape of the training loop.

A loop may hold batches it has taken from the loader but not trained on yet when it saves: nanoGPT
takes the next batch before the save, a CUDA-stream prefetcher keeps one or two batches in flight, a
wrapping generator may read ahead. Counting the batches handed out therefore says nothing about the
batches trained on. The step being saved does, under one convention:

    **the step passed to** ``save(step, state)`` **counts the training steps done**, and training step
    ``n`` (counting from 1) consumes batches ``[(n - 1) * batches_per_step, n * batches_per_step)``.

Both ``for step in range(1, N + 1): train(next_batch()); manager.save(step, state)`` and nanoGPT's
``save(iter_num)`` before training ``iter_num`` (from 0) follow it. A loop whose numbers are shifted
says so with ``start_step``, the step number it would save before training anything (``-1`` for
``for step in range(N): train(); save(step)``, ``1`` for a loop that saves ``step`` before training it
and counts from 1). With ``batches_per_step`` micro-batches per step, saving step ``s`` means that
``(s - start_step) * batches_per_step`` batches are consumed.

:class:`BatchLedger` holds the positions of the last batches handed out, so the loader can save the
position of the first batch not consumed yet, and reports a save that does not fit: a step that needs
more batches than the loop took would skip batches on resume; one that leaves more than ``max_ahead``
taken batches unaccounted for would repeat them. Both raise :class:`~ckptd.errors.LoaderPositionError`
naming the step, the counts and the argument that would fit.

Counting cannot tell a loop that is off by one step number from a loop that holds one batch more, so
a shifted loop that forgets ``start_step`` passes these checks at the save; docs/data-loader.md lists the
common loops with their arguments. A resume shows it: the loop then holds another number of batches at its
first save than at the save it resumed from, and :func:`held_changed` words the warning.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ckptd.errors import ConfigError, LoaderPositionError


@dataclass(frozen=True)
class Position:
    """A place in the sample stream: ``samples_consumed`` global samples into ``epoch``."""

    epoch: int
    samples_consumed: int


@dataclass(frozen=True)
class StepConvention:
    """How a training loop's saved step numbers map to batches (see the module docstring).

    ``max_ahead``: most batches the loop may hold, taken but not trained on, when it saves (default
    ``2 * batches_per_step``: a prefetch of the next step plus one more batch).
    """

    batches_per_step: int = 1
    start_step: int = 0
    max_ahead: int | None = None

    def __post_init__(self) -> None:
        if self.batches_per_step < 1:
            raise ConfigError(f"batches_per_step must be >= 1, got {self.batches_per_step}")
        if self.max_ahead is not None and self.max_ahead < 0:
            raise ConfigError(f"max_ahead must be >= 0, got {self.max_ahead}")

    @property
    def ahead_limit(self) -> int:
        return 2 * self.batches_per_step if self.max_ahead is None else self.max_ahead


class BatchLedger:
    """Counts the batches handed out since an origin (a step and its position) and keeps the start
    positions of the last ones. Used from the training thread only."""

    def __init__(self, convention: StepConvention, origin_step: int, origin: Position) -> None:
        self.convention = convention
        self.origin_step = origin_step
        self.origin = origin
        #: Batches handed out since the origin.
        self.handed_out = 0
        self._starts: deque[Position] = deque(maxlen=convention.ahead_limit + 1)

    def handed(self, start: Position) -> None:
        """One more batch, beginning at ``start``, was handed to the training loop."""
        self.handed_out += 1
        self._starts.append(start)

    def position_for(self, step: int, current: Position, *, what: str = "the data loader") -> Position:
        """The position of the first batch that the steps after ``step`` consume; ``current`` is the
        position after the last batch handed out. Raises LoaderPositionError for a step that does not
        fit the batches handed out."""
        convention = self.convention
        if step < self.origin_step:
            raise LoaderPositionError(
                f"{what} is asked to save step {step}, older than step {self.origin_step} at which its "
                f"position was set", step=step,
                hint="pass the training step counter to save(); it must not go backwards after a restore")
        needed = (step - self.origin_step) * convention.batches_per_step
        ahead = self.handed_out - needed
        if 0 <= ahead <= convention.ahead_limit:
            return current if ahead == 0 else self._starts[-ahead]
        counts = (f"saving step {step} means {needed} batch(es) consumed since step {self.origin_step} "
                  f"(batches_per_step={convention.batches_per_step}, start_step={convention.start_step}), "
                  f"but the loop took {self.handed_out} from {what}")
        if ahead < 0:
            raise LoaderPositionError(f"{counts}: a resume would skip {-ahead} batch(es)", step=step,
                                      hint=self._fits(step) or "save the step counter after the step trains")
        raise LoaderPositionError(
            f"{counts}: a resume would repeat {ahead} batch(es), more than the {convention.ahead_limit} a "
            f"prefetching loop may hold (max_ahead)", step=step,
            hint=self._fits(step) or "a loop that holds more batches at a save passes max_ahead")

    def held(self, step: int) -> int:
        """Batches taken but not consumed by the steps up to ``step`` (what the loop holds at its save)."""
        return self.handed_out - (step - self.origin_step) * self.convention.batches_per_step

    def _fits(self, step: int) -> str:
        """The argument of ShardLoader that would make this save fit with nothing held, if one would."""
        convention, steps = self.convention, step - self.origin_step
        hints = []
        if steps > 0 and self.handed_out % steps == 0 and self.handed_out // steps != convention.batches_per_step:
            hints.append(f"batches_per_step={self.handed_out // steps} (micro-batches per step)")
        if self.handed_out % convention.batches_per_step == 0:
            start = convention.start_step + steps - self.handed_out // convention.batches_per_step
            if start != convention.start_step:
                hints.append(f"start_step={start} (the step number saved before any training)")
        return ("pass ShardLoader(" + " or ".join(hints) + ") if that is how your loop counts") if hints else ""


def held_changed(convention: StepConvention, restored_step: int, held_then: int, step: int, held_now: int,
                 what: str) -> str | None:
    """The warning for a loop that held ``held_then`` batches when it saved ``restored_step`` and holds
    ``held_now`` at its first save (``step``) after resuming from it; None when the counts agree."""
    if held_now == held_then:
        return None
    shift, per_step = held_then - held_now, convention.batches_per_step
    fit = f"; pass ShardLoader(start_step={convention.start_step - shift // per_step}) if that is how your " \
          "loop counts" if shift % per_step == 0 else ""
    if shift > 0:
        return (f"{what} held {held_then} untrained batch(es) when step {restored_step} was saved but holds "
                f"{held_now} at step {step}, after resuming from it: if the loop numbers its steps lower than "
                f"the steps done (for step in range(N): train(); save(step)), the resume trained {shift} "
                f"batch(es) again{fit}")
    return (f"{what} held {held_then} untrained batch(es) when step {restored_step} was saved but holds "
            f"{held_now} at step {step}, after resuming from it: if the loop numbers its steps higher than the "
            f"steps done (saves step n before training it, from 1), the resume skipped {-shift} batch(es)"
            f"{fit} (no batch was lost if the earlier run had run out of batches or ended an epoch there)")
