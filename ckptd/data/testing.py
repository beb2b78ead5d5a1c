"""Helpers for tests and benchmarks of the data loader: small datasets with known sample ids, and
byte-level damage. Shipped so that plugin authors can test against the same fixtures."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


def sample_id(shard: int, index: int) -> str:
    """The id written into sample ``index`` of shard ``shard`` by :func:`write_jsonl_shards`."""
    return f"s{shard:03d}-{index:05d}"


def write_jsonl_shards(directory: str | os.PathLike[str], sizes: Sequence[int], *, payload_bytes: int = 0
                       ) -> list[str]:
    """Write ``shard-NNN.jsonl`` files with ``sizes[n]`` samples each; returns every id in file order.

    Each sample is ``{"id": ..., "shard": n, "index": i, "payload": "x" * payload_bytes}``.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ids = []
    for shard, count in enumerate(sizes):
        lines = []
        for index in range(count):
            ids.append(sample_id(shard, index))
            lines.append(json.dumps({"id": ids[-1], "shard": shard, "index": index,
                                     "payload": "x" * payload_bytes}))
        (root / f"shard-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ids


def flip_bit(path: str | os.PathLike[str], byte_offset: int | None = None, bit: int = 0) -> None:
    """Flip one bit of a file in place (the middle byte by default)."""
    target = Path(path)
    data = bytearray(target.read_bytes())
    offset = len(data) // 2 if byte_offset is None else byte_offset
    data[offset] ^= 1 << bit
    target.write_bytes(bytes(data))


def truncate(path: str | os.PathLike[str], keep: int) -> None:
    """Cut a file down to its first ``keep`` bytes."""
    target = Path(path)
    target.write_bytes(target.read_bytes()[:keep])
