"""The one exception tree of ckptd.

Every error ckptd raises on purpose derives from :class:`CkptdError`. Each carries enough context
(file, step, tier) to act on, and its message says what to do next. The CLI prints ``str(error)``
as one line and exits with :attr:`CkptdError.exit_code`.

This module holds every error class of ckptd; import them from here. The package re-exports the
ones a caller is expected to catch (``ckptd.IntegrityError is ckptd.errors.IntegrityError``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class CkptdError(Exception):
    """Root of every error that ckptd raises on purpose."""

    exit_code: int = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        tier: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.step = step
        self.tier = tier
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.tier is not None:
            where.append(f"tier {self.tier}")
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.path is not None:
            where.append(f"file {self.path}")
        text = self.message
        if where:
            text = f"{text} ({', '.join(where)})"
        if self.hint:
            text = f"{text}; {self.hint}"
        return text


class ConfigError(CkptdError):
    """An option or environment variable has a value ckptd cannot use."""

    exit_code = 2


class LoaderPositionError(ConfigError):
    """A save's step does not fit the batches the data loader handed out: resuming from it would skip or
    repeat batches (see :mod:`ckptd.data.position`)."""


class FormatError(CkptdError):
    """A manifest, index or data file is malformed (bad JSON, bad extents, unsafe paths)."""

    exit_code = 3


class FormatVersionError(FormatError):
    """A manifest or index names a format version this ckptd does not know."""


class UnsafePathError(FormatError):
    """A path read from a manifest or index would leave its step directory."""


class IntegrityError(CkptdError):
    """Stored bytes do not match their recorded digest or size."""

    exit_code = 4

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        step: int | None = None,
        tier: str | None = None,
        chunk: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.chunk = chunk
        self.expected = expected
        self.actual = actual
        details = message
        if chunk is not None:
            details = f"{details}: chunk {chunk}"
        if expected is not None or actual is not None:
            details = f"{details} (expected {expected}, got {actual})"
        super().__init__(details, path=path, step=step, tier=tier, hint=hint)


class CommitError(CkptdError):
    """A step could not be committed (a write failed on some rank, or the commit was lost)."""

    exit_code = 5


class OtherPromotionError(CommitError):
    """A written-once object of a step on the object tier holds other bytes: another promotion of that step
    number (an interrupted one of this job, which the promoter takes over, or another job's, refused)."""


class ShareReleasedError(CommitError):
    """Another rank dropped its share of the step unpromoted (``rank-NNNNN.released``): it cannot be committed,
    and retrying does not help."""


class StepSetAsideError(CommitError):
    """The step was set aside locally while being promoted (a restore went back to an older step on every
    rank): its promotion stops, nothing of it is committed, and the step saved again with that number is
    promoted instead."""


class AlreadyCommittedError(CommitError):
    """A file that must be written only once (a commit marker) already exists; nothing was replaced."""


class CheckpointExistsError(AlreadyCommittedError):
    """A save asked not to overwrite (DCP's ``overwrite=False``) found the step or directory already committed."""


class UndecidedCommitError(CommitError):
    """A rank saw no commit decision in time: the step may still have been committed by the deciding rank,
    so this rank's files of it are kept."""


class WriterProcessError(CommitError):
    """The writer process of a save died (killed, out of memory) or the trainer ended before it committed;
    the step in progress is not committed, earlier committed steps are untouched."""


class StorageError(CkptdError):
    """A tier could not be read or written (unreachable endpoint, permission, full disk)."""

    exit_code = 6


class TierUnreachableError(StorageError):
    """The tier cannot answer at all (no connection, unknown host, timeout), as opposed to a bad file."""


class TierMisconfiguredError(TierUnreachableError):
    """The tier answers but refuses every request (missing bucket, bad credentials, wrong region)."""

    exit_code = 2


class DiskFullError(StorageError):
    """The tier ran out of space while writing; nothing partial was committed."""


class LockedError(CkptdError):
    """Another writer holds the lock of a checkpoint directory."""

    exit_code = 7


class NotFoundError(CkptdError):
    """A requested step, file or shard does not exist on any tier that was searched."""

    exit_code = 8


class PartialStepError(NotFoundError):
    """A step saved without collectives is not committed: some ranks' parts are missing."""


class NoIntactCheckpointError(NotFoundError):
    """Checkpoints exist but none could be restored intact."""


class ResumeMismatchError(CkptdError):
    """The saved state does not fit the state it is loaded into (shapes, world size, manifest)."""

    exit_code = 9


class PickleRefusedError(CkptdError):
    """A value needs pickle to save or load and the caller did not opt in with allow_pickle=True."""

    exit_code = 10


class PluginError(CkptdError):
    """A plugin (storage backend, shard reader, integration) is missing or failed to load."""

    exit_code = 11


class WorkerError(CkptdError):
    """Work failed on one or more ranks; holds one failure per rank."""

    exit_code = 12

    def __init__(self, message: str, failures: dict[int, str] | None = None, **kwargs: object) -> None:
        self.failures = dict(failures or {})
        if self.failures:
            listed = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(self.failures.items()))
            message = f"{message} [{listed}]"
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class DeadlineError(CkptdError):
    """A wait ran past its deadline (a ``CKPTD_*_TIMEOUT_S`` setting); the message names what was waited for."""

    exit_code = 13


class StillRunningError(DeadlineError):
    """Background work was still running when ``wait`` or ``close`` gave up; :attr:`running` says what.

    Whatever that work needs stays held (a manager keeps its directory lock): call ``close`` again later.
    """

    def __init__(self, message: str, *, running: str = "", **kwargs: object) -> None:
        self.running = running
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class BackgroundError(CkptdError):
    """Several pieces of background work failed; :attr:`failures` holds one record per step and rank
    (:class:`ckptd.background.FailureRecord`), oldest first."""

    exit_code = 12

    def __init__(self, message: str, failures: Sequence[Any] = (), **kwargs: object) -> None:
        self.failures = tuple(failures)
        listed = "; ".join(record.describe() for record in self.failures)
        super().__init__(f"{message}: {listed}" if listed else message, **kwargs)  # type: ignore[arg-type]


class GenerationEndedError(CkptdError):
    """An elastic job moved on to a new generation (a rank failed and is being replaced): a store call of
    the old generation is refused, so that a survivor leaves it and a stale process cannot touch the new one."""

    exit_code = 12


class CrashLoopError(WorkerError):
    """An elastic job stopped because its ranks kept failing with no training step completed in between
    (``ckptd launch --crash-loop``); the message names the rank, its last step and the cause."""

    exit_code = 14


class JobStoppedError(WorkerError):
    """An elastic job stopped on request (SIGTERM or SIGINT to one of its ``ckptd launch`` supervisors):
    every rank left at its next step and exited; committed steps are kept, and a new launch resumes."""

    exit_code = 15


class UnpromotedError(StorageError):
    """Committed local steps could not be promoted to the object tier before ``close`` returned; they stay
    pinned on the local tier (:attr:`steps`) and promotion resumes at the next start."""

    def __init__(self, message: str, steps: Iterable[int] = (), **kwargs: object) -> None:
        self.steps = tuple(sorted(steps))
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
