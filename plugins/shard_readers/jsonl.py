"""JSON lines shards: one JSON value per line; sample ``i`` is line ``i`` decoded.

The layout stores where every line starts, so a sample is one slice and one ``json.loads``. Blank
lines are not samples.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader, pack_offsets, unpack_offsets
from ckptd.errors import FormatError


def _line_spans(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    buffer = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buffer == ord("\n"))
    if len(buffer) and (not len(ends) or ends[-1] != len(buffer) - 1):
        ends = np.append(ends, len(buffer))
    starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else np.zeros(0, dtype=np.int64)
    keep = [bool(data[s:e].strip()) for s, e in zip(starts.tolist(), ends.tolist())]
    return starts[keep].astype(np.int64), ends[keep].astype(np.int64)


class _OpenJsonLines:
    def __init__(self, data: bytes, starts: np.ndarray, ends: np.ndarray, name: str) -> None:
        self._data = data
        self._starts = starts.tolist()
        self._ends = ends.tolist()
        self._name = name

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> Any:
        try:
            return json.loads(self._data[self._starts[index]:self._ends[index]])
        except ValueError as exc:
            raise FormatError(f"line {index} of JSON-lines shard {self._name} is not valid JSON: {exc}",
                              path=self._name, hint="fix the shard and re-index it") from exc


class JsonLinesReader(ShardReader):
    """Reads ``.jsonl`` shards (UTF-8, one JSON value per line)."""

    format_name = "jsonl"
    suffixes = (".jsonl", ".ndjson")

    def scan(self, data: bytes, name: str) -> ShardLayout:
        starts, ends = _line_spans(data)
        if len(starts):
            first = data[starts[0]:ends[0]]
            try:
                json.loads(first)
            except ValueError as exc:
                raise FormatError(f"the first line of {name} is not JSON: {exc}", path=name,
                                  hint="is this a JSON-lines shard? pick another --format") from exc
        return ShardLayout(samples=len(starts), locator={"starts": pack_offsets(starts),
                                                         "ends": pack_offsets(ends)})

    def open(self, data: bytes, layout: ShardLayout, name: str) -> OpenShard:
        starts = unpack_offsets(layout.locator["starts"])
        ends = unpack_offsets(layout.locator["ends"])
        if len(starts) != layout.samples or len(ends) != layout.samples or (len(ends) and ends[-1] > len(data)):
            raise FormatError(f"the manifest's line index does not fit shard {name}", path=name,
                              hint="re-index the dataset with `ckptd data index`")
        return _OpenJsonLines(data, starts, ends, name)
