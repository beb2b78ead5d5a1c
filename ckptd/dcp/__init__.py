"""ckptd's storage plugins for torch.distributed.checkpoint (DCP).

:class:`CkptdStorageWriter` and :class:`CkptdStorageReader` write and read ckptd's format (chunks,
xxh3-128 digests, codecs, manifest last) so that ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` work
with FSDP2/DTensor state and load into a different world size. The CheckpointManager writes the same
format and reshards through the reader.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CkptdStorageReader", "CkptdStorageWriter"]


def __getattr__(name: str) -> Any:
    # Imported on first use: torch.distributed.checkpoint is heavy and `import ckptd` should stay light.
    if name == "CkptdStorageReader":
        from ckptd.dcp.reader import CkptdStorageReader

        return CkptdStorageReader
    if name == "CkptdStorageWriter":
        from ckptd.dcp.writer import CkptdStorageWriter

        return CkptdStorageWriter
    raise AttributeError(f"module 'ckptd.dcp' has no attribute {name!r}")
