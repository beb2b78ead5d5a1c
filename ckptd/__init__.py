"""ckptd: fault-tolerant tiered checkpointing and verified data loading for PyTorch training.

The names in ``__all__`` are the public API: the checkpoint manager and its policy, the retention
policies, the dataset loader, and the error classes. Every error class lives in :mod:`ckptd.errors`
(which holds them all, internal ones included); the ones a caller is expected to catch are
re-exported here, so ``ckptd.IntegrityError`` and ``ckptd.errors.IntegrityError`` are the same class.
"""

from __future__ import annotations

from ckptd._version import __version__

from ckptd.data import (  # noqa: E402
    DatasetManifest,
    ShardDataset,
    ShardLoader,
    index_dataset,
    load_dataset_manifest,
    save_dataset_manifest,
)
from ckptd.errors import (  # noqa: E402
    AlreadyCommittedError,
    BackgroundError,
    CkptdError,
    CommitError,
    ConfigError,
    DeadlineError,
    DiskFullError,
    FormatError,
    FormatVersionError,
    IntegrityError,
    LockedError,
    NoIntactCheckpointError,
    NotFoundError,
    PickleRefusedError,
    PluginError,
    ResumeMismatchError,
    StillRunningError,
    StorageError,
    TierMisconfiguredError,
    TierUnreachableError,
    UndecidedCommitError,
    UnpromotedError,
    UnsafePathError,
    WorkerError,
)
from ckptd.manager.manager import CheckpointManager  # noqa: E402
from ckptd.policy import KeepEvery, KeepLatest, Policy, RetentionPolicy  # noqa: E402

__all__ = [
    "CheckpointManager",
    "KeepEvery",
    "KeepLatest",
    "Policy",
    "RetentionPolicy",
    "__version__",
    # data
    "DatasetManifest",
    "ShardDataset",
    "ShardLoader",
    "index_dataset",
    "load_dataset_manifest",
    "save_dataset_manifest",
    # errors (all of them, and a few internal ones, are in ckptd.errors)
    "AlreadyCommittedError",
    "BackgroundError",
    "CkptdError",
    "CommitError",
    "ConfigError",
    "DeadlineError",
    "DiskFullError",
    "FormatError",
    "FormatVersionError",
    "IntegrityError",
    "LockedError",
    "NoIntactCheckpointError",
    "NotFoundError",
    "PickleRefusedError",
    "PluginError",
    "ResumeMismatchError",
    "StillRunningError",
    "StorageError",
    "TierMisconfiguredError",
    "TierUnreachableError",
    "UndecidedCommitError",
    "UnpromotedError",
    "UnsafePathError",
    "WorkerError",
]
