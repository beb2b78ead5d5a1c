"""ckptd: fault-tolerant tiered checkpointing and verified data loading for PyTorch training."""

from __future__ import annotations

from ckptd._version import __version__

from ckptd.data import DatasetManifest, ShardDataset, ShardLoader, index_dataset, load_dataset_manifest  # noqa: E402
from ckptd.errors import CkptdError  # noqa: E402
from ckptd.manager.manager import CheckpointManager  # noqa: E402
from ckptd.policy import Policy  # noqa: E402

__all__ = ["CheckpointManager", "CkptdError", "Policy", "__version__"]
__all__ += ["DatasetManifest", "ShardDataset", "ShardLoader", "index_dataset", "load_dataset_manifest"]
