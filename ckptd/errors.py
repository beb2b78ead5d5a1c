"""The one exception tree of ckptd.

Every error ckptd raises on purpose derives from :class:`CkptdError`. Each carries enough context
(file, step, tier) to act on, and its message says what to do next. The CLI prints ``str(error)``
as one line and exits with :attr:`CkptdError.exit_code`.
"""

from __future__ import annotations


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


class StorageError(CkptdError):
    """A tier could not be read or written (unreachable endpoint, permission, full disk)."""

    exit_code = 6


class DiskFullError(StorageError):
    """The tier ran out of space while writing; nothing partial was committed."""


class LockedError(CkptdError):
    """Another writer holds the lock of a checkpoint directory."""

    exit_code = 7


class NotFoundError(CkptdError):
    """A requested step, file or shard does not exist on any tier that was searched."""

    exit_code = 8


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
