"""Parquet shards through pyarrow: sample ``i`` is row ``i`` as a dict of column values.

The layout stores the row count of every row group, so a sample read decodes only its row group;
decoded row groups of an open shard are kept while the shard is open, since shuffled reads visit every
group of a shard in turn.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader
from ckptd.errors import FormatError


def _parquet_file(data: bytes, name: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise FormatError(f"{name} is not a readable Parquet file: {exc}", path=name,
                          hint="is this a Parquet shard? pick another --format") from exc


class _OpenParquet:
    def __init__(self, data: bytes, layout: ShardLayout, name: str) -> None:
        self._file = _parquet_file(data, name)
        rows = [int(count) for count in layout.locator["row_groups"]]
        if rows != [self._file.metadata.row_group(g).num_rows for g in range(self._file.num_row_groups)]:
            raise FormatError(f"the manifest's row groups do not fit Parquet shard {name}", path=name,
                              hint="re-index the dataset with `ckptd data index`")
        self._ends = list(accumulate(rows))
        self._decoded: dict[int, list[dict[str, Any]]] = {}

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> dict[str, Any]:
        group = bisect.bisect_right(self._ends, index)
        if group not in self._decoded:
            self._decoded[group] = self._file.read_row_group(group).to_pylist()
        start = self._ends[group - 1] if group else 0
        return self._decoded[group][index - start]


class ParquetReader(ShardReader):
    """Reads ``.parquet`` shards; each row is a sample."""

    format_name = "parquet"
    suffixes = (".parquet",)

    def scan(self, data: bytes, name: str) -> ShardLayout:
        metadata = _parquet_file(data, name).metadata
        rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        return ShardLayout(samples=sum(rows), locator={"row_groups": rows})

    def open(self, data: bytes, layout: ShardLayout, name: str) -> OpenShard:
        return _OpenParquet(data, layout, name)
