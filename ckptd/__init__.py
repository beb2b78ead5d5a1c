"""ckptd: fault-tolerant tiered checkpointing and verified data loading for PyTorch training.

The names in ``__all__`` are the public API: the checkpoint manager and its policy, the retention
policies, the dataset loader, and the error classes. Every error class lives in :mod:`ckptd.errors`
(which holds them all, internal ones included); the ones a caller is expected to catch are
re-exported here, so ``ckptd.IntegrityError`` and ``ckptd.errors.IntegrityError`` are the same class.
The names that need torch (the manager and the data loader) are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ckptd._version import __version__

from ckptd.errors import (
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
from ckptd.policy import KeepEvery, KeepLatest, Policy, RetentionPolicy
from ckptd.format.mesh_layout import Layout

if TYPE_CHECKING:
    from ckptd.data import (DatasetManifest, ShardDataset, ShardLoader, index_dataset, load_dataset_manifest,
                            save_dataset_manifest)
    from ckptd.manager.manager import CheckpointManager
    from ckptd.state.rng import capture_rng_states, restore_rng_states
    from ckptd.tiers.local import write_file_atomically

#: Public names that need torch, and the module each comes from: imported on first use (PEP 562), so
#: ``import ckptd`` (and every CLI command that reads only metadata) starts without importing torch.
_LAZY: dict[str, str] = {
    "CheckpointManager": "ckptd.manager.manager",
    "DatasetManifest": "ckptd.data",
    "ShardDataset": "ckptd.data",
    "ShardLoader": "ckptd.data",
    "index_dataset": "ckptd.data",
    "load_dataset_manifest": "ckptd.data",
    "save_dataset_manifest": "ckptd.data",
    "capture_rng_states": "ckptd.state.rng",
    "restore_rng_states": "ckptd.state.rng",
    "write_file_atomically": "ckptd.tiers.local",
}


def __getattr__(name: str) -> Any:
    """A lazy public name on first use; a sub-package (``ckptd.format``, ...) imported on first access."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointManager",
    "KeepEvery",
    "KeepLatest",
    "Layout",
    "Policy",
    "RetentionPolicy",
    "__version__",
    "capture_rng_states",
    "restore_rng_states",
    "write_file_atomically",
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
