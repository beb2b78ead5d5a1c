"""ckptd's storage plugins for torch.distributed.checkpoint (DCP).

:class:`CkptdStorageWriter` and :class:`CkptdStorageReader` write and read ckptd's format (chunks,
xxh3-128 digests, codecs, manifest last) so that ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` work
with FSDP2/DTensor state and load into a different world size. The CheckpointManager writes the same
format and reshards through the reader.
"""

from ckptd.dcp.reader import CkptdStorageReader
from ckptd.dcp.writer import CkptdStorageWriter

__all__ = ["CkptdStorageReader", "CkptdStorageWriter"]
