"""PyTorch Lightning integration: :class:`CkptdCheckpointIO`, a ``CheckpointIO`` that saves through ckptd.

Needs ``lightning`` (``pip install 'ckptd[lightning]'``); without it, importing this package raises
:class:`ckptd.errors.PluginError` with that hint. Importing it lets ``Model.load_from_checkpoint`` read
ckptd pointers (:mod:`ckptd.plugins.lightning.loading`). :class:`LightningShardLoader` is ckptd's
``ShardLoader`` for a data module; ``ResumableDistributedSampler`` (needs torchdata) makes a
``StatefulDataLoader`` resume exactly under DDP.
"""

from __future__ import annotations

from ckptd.errors import PluginError

try:
    import lightning.fabric.plugins  # noqa: F401  (the one dependency this integration has)
except ImportError as exc:
    raise PluginError(f"the Lightning integration needs the lightning package ({exc})",
                      hint="pip install 'ckptd[lightning]'") from exc

from ckptd.plugins.lightning.checkpoint_io import CkptdCheckpointIO
from ckptd.plugins.lightning.loading import install as _install_pointer_loading
from ckptd.plugins.lightning.shard_loader import LightningShardLoader

_install_pointer_loading()  # Model.load_from_checkpoint(pointer) reads through ckptd (see .loading)

__all__ = ["CkptdCheckpointIO", "LightningShardLoader", "ResumableDistributedSampler"]


def __getattr__(name: str) -> object:
    if name == "ResumableDistributedSampler":  # needs torchdata, which only this sampler imports
        from ckptd.plugins.lightning.sampler import ResumableDistributedSampler

        return ResumableDistributedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
