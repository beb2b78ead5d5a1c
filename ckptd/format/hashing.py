"""Digests: xxh3-128 for checkpoint chunks and metadata, xxh3-64 for data shards.

Digests are lower-case hex strings so that they read the same in JSON, logs and object keys.
xxhash releases the GIL while hashing large buffers, so background hashing does not stall training.
"""

from __future__ import annotations

import xxhash

from ckptd._types import Buffer

#: Name recorded in manifests next to every checkpoint digest.
CHUNK_DIGEST_ALGORITHM = "xxh3-128"
#: Name recorded in dataset manifests next to every shard digest.
SHARD_DIGEST_ALGORITHM = "xxh3-64"


def chunk_digest(data: Buffer) -> str:
    """xxh3-128 of a checkpoint chunk or metadata file, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def shard_digest(data: Buffer) -> str:
    """xxh3-64 of a data shard, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


class StreamingChunkDigest:
    """:func:`chunk_digest` over a stream of pieces (a file hashed while it is received or read)."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_128()

    def update(self, data: Buffer) -> None:
        self._state.update(data)

    def hexdigest(self) -> str:
        """The digest of every piece so far, as :func:`chunk_digest` gives it for their concatenation."""
        return self._state.hexdigest()
