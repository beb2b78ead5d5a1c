"""``Model.load_from_checkpoint(pointer)``: Lightning's own loader reads a ckptd pointer through ckptd.

``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read a path with Lightning's
``pl_load``, which hands the file to ``torch.load``; a ckptd pointer is JSON, which torch cannot unpickle.
:func:`install` puts :func:`load_checkpoint_file` in the place of the name ``pl_load`` in
``lightning.pytorch.core.saving`` (nothing of torch changes, and nothing else of Lightning): a file that is
a ckptd pointer is read from the tiers it names (local, then the object tier), every chunk verified and
nothing unpickled; any other path or file object goes to Lightning's own loader unchanged. Importing
:mod:`ckptd.plugins.lightning` installs it, and so does every ``Trainer`` (ckptd's callbacks entry point),
so that an evaluation script that builds a Trainer needs no ckptd import.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.core import saving

from ckptd.errors import FormatError, NotFoundError
from ckptd.plugins.lightning.checkpoint_io import CkptdCheckpointIO
from ckptd.plugins.lightning.pointer import read_pointer

log = logging.getLogger("ckptd.plugins.lightning")

#: Lightning's own loader (None on a Lightning that reads files by another name: nothing is installed then).
_lightning_load = getattr(saving, "pl_load", None)


def load_checkpoint_file(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """What Lightning's ``pl_load`` returns for ``path_or_url``; a ckptd pointer is read through ckptd."""
    if isinstance(path_or_url, (str, os.PathLike)):
        try:
            pointer = read_pointer(path_or_url)
        except (FormatError, NotFoundError, IsADirectoryError):
            pointer = None  # not a pointer (or no file): Lightning's loader says what it is
        if pointer is not None:
            return CkptdCheckpointIO.read_pointed(path_or_url, pointer, map_location)
    assert _lightning_load is not None  # installed only over it
    if weights_only is None:  # Lightning releases before weights_only take no such argument
        return _lightning_load(path_or_url, map_location=map_location)
    return _lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)


def install() -> None:
    """Let ``Model.load_from_checkpoint`` read ckptd pointers (idempotent; see the module docstring). Nothing
    happens on a Lightning whose loading no longer reads files through ``pl_load``."""
    if _lightning_load is None:
        log.debug("lightning.pytorch.core.saving has no pl_load: Model.load_from_checkpoint reads no ckptd pointer")
        return
    saving.pl_load = load_checkpoint_file
