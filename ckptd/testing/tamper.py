"""Reading and tampering with checkpoint files on the local tier, for corruption and bad-input tests.

:func:`rewrite_manifest` and :func:`rewrite_index` change the JSON of a committed step and then fix up
every digest and size above it, so that the forged step is self-consistent and a reader must reject it
for the change itself rather than for a digest mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.format.hashing import chunk_digest
from ckptd.format.layout import MANIFEST_NAME, rank_data_name, rank_index_name, step_dir

JsonEdit = Callable[[dict[str, Any]], None]


def step_path(root: Path, step: int) -> Path:
    return Path(root) / step_dir(step)


def manifest_path(root: Path, step: int) -> Path:
    return step_path(root, step) / MANIFEST_NAME


def index_path(root: Path, step: int, rank: int = 0) -> Path:
    return step_path(root, step) / rank_index_name(rank)


def data_path(root: Path, step: int, rank: int = 0, part: int = 0) -> Path:
    """A rank's data file number ``part`` (every rank has part 0)."""
    return step_path(root, step) / rank_data_name(rank, part)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_bytes())


def _manifest_bytes(body: dict[str, Any]) -> bytes:
    body = dict(body)
    body.pop("manifest_digest", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["manifest_digest"] = chunk_digest(canonical)
    return json.dumps(body, indent=1).encode()


def rewrite_manifest(root: Path, step: int, edit: JsonEdit) -> None:
    """Apply ``edit`` to the manifest of ``step`` and store it with a matching manifest digest."""
    body = read_json(manifest_path(root, step))
    edit(body)
    manifest_path(root, step).write_bytes(_manifest_bytes(body))


def rewrite_index(root: Path, step: int, edit: JsonEdit, rank: int = 0) -> None:
    """Apply ``edit`` to a rank index and record its new size and digest in the manifest."""
    body = read_json(index_path(root, step, rank))
    edit(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    index_path(root, step, rank).write_bytes(raw)

    def record(manifest: dict[str, Any]) -> None:
        for entry in manifest["ranks"]:
            if entry["rank"] == rank:
                entry["index_size"], entry["index_digest"] = len(raw), chunk_digest(raw)

    rewrite_manifest(root, step, record)


def chunk_records(root: Path, step: int, rank: int = 0, part: int | None = None) -> list[tuple[str, list[Any]]]:
    """Every (tensor name, chunk record) of a rank (in data file ``part`` only, when given), in file
    order; a record is ``[offset, length, raw_length, codec, digest, data file number]``."""
    tensors = read_json(index_path(root, step, rank))["tensors"]
    found = [(name, chunk) for name, tensor in tensors.items() for chunk in tensor["chunks"]
             if part is None or chunk[5] == part]
    return sorted(found, key=lambda item: (item[1][5], item[1][0]))


def chunk_location(root: Path, step: int, tensor: str, position: int = 0, rank: int = 0) -> tuple[Path, int, int]:
    """Where the ``position``-th chunk of a saved tensor lies: (data file, offset, stored length)."""
    index = read_json(index_path(root, step, rank))
    offset, length, *_, part = index["tensors"][tensor]["chunks"][position]
    return step_path(root, step) / index["data_files"][part][0], offset, length


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))
