"""PyTorch Lightning integration: :class:`CkptdCheckpointIO`, a ``CheckpointIO`` that saves through ckptd.

Needs ``lightning`` (``pip install 'ckptd[lightning]'``); without it, importing this package raises
:class:`ckptd.errors.PluginError` with that hint.
"""

from __future__ import annotations

from ckptd.errors import PluginError

try:
    import lightning.fabric.plugins  # noqa: F401  (the one dependency this integration has)
except ImportError as exc:
    raise PluginError(f"the Lightning integration needs the lightning package ({exc})",
                      hint="pip install 'ckptd[lightning]'") from exc

from ckptd.plugins.lightning.checkpoint_io import CkptdCheckpointIO

__all__ = ["CkptdCheckpointIO"]
