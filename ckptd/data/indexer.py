"""Building a dataset manifest: list the shards under a root, hash and scan them in parallel.

The shards are the files that :mod:`ckptd.data.selection` picks (include/exclude globs, else the
reader's suffixes; several splits without a pattern are refused). A URI naming one file indexes that
file alone, under its directory as the root.

Re-indexing with the previous manifest at hand only reads shards whose size or storage version (mtime,
ETag) changed, or that the previous manifest does not list; every other record is reused as is.
Progress is reported through a callback, once per shard, from the calling thread.
"""

from __future__ import annotations

import concurrent.futures
import glob
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd.background import TaskPool
from ckptd.config import settings
from ckptd.data.manifest import DatasetManifest, ShardRecord
from ckptd.data.reader_api import ShardReader
from ckptd.data.registry import make_reader
from ckptd.data.selection import select
from ckptd.data.source import ListedFile, ShardSource
from ckptd.errors import ConfigError, NotFoundError
from ckptd.format.hashing import shard_digest

#: Called once per shard with (record, reused, done, total).
ProgressCallback = Callable[[ShardRecord, bool, int, int], None]


@dataclass(frozen=True)
class IndexResult:
    """A new manifest and which shards were read again."""

    manifest: DatasetManifest
    hashed: tuple[str, ...] = ()
    reused: tuple[str, ...] = ()
    dropped: tuple[str, ...] = field(default=())


def _index_one(source: ShardSource, reader: ShardReader, listed: ListedFile) -> ShardRecord:
    data = source.read(listed.path)
    layout = reader.scan(data, source.url(listed.path))
    return ShardRecord(path=listed.path, size=len(data), digest=shard_digest(data), samples=layout.samples,
                       layout=dict(layout.locator), source_version=listed.version)


def resolve_root(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, str | None]:
    """(dataset root, the one file to index or None): a URI naming a file has its directory as root."""
    source = ShardSource(uri, storage_options)
    if not source.is_file():
        return uri, None
    stripped = uri.rstrip("/")
    return posixpath.dirname(stripped), posixpath.basename(stripped)


def _reusable(previous: DatasetManifest | None, fmt: str, options: Mapping[str, Any]
              ) -> dict[str, ShardRecord]:
    if previous is None or previous.format != fmt or dict(previous.reader_options) != dict(options):
        return {}
    return {shard.path: shard for shard in previous.shards if shard.source_version}


def index_dataset(
    uri: str,
    fmt: str,
    *,
    reader_options: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    previous: DatasetManifest | None = None,
    suffixes: tuple[str, ...] | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    threads: int | None = None,
    progress: ProgressCallback | None = None,
) -> IndexResult:
    """Index every shard of format ``fmt`` under ``uri`` and return the manifest.

    ``uri`` is a directory or prefix, or one file (then its directory is the manifest's root).
    ``previous`` (an earlier manifest of the same root and format) lets unchanged shards skip reading.
    ``suffixes`` overrides the file endings the reader claims; ``include``/``exclude`` globs pick the
    files (:mod:`ckptd.data.selection`). ``threads`` read and hash in parallel (default
    ``CKPTD_DATA_INDEX_THREADS``).
    """
    reader = make_reader(fmt, dict(reader_options or {}))
    uri, only_file = resolve_root(uri, storage_options)
    if only_file is not None:
        include, exclude = ("/" + glob.escape(only_file),), ()
    source = ShardSource(uri, storage_options)
    endings = tuple(suffixes or reader.suffixes)
    listed = select(source.list_files(), lambda item: item.path, suffixes=endings, include=include,
                    exclude=exclude, where=f"the dataset root {uri}")
    if not listed:
        chosen = f"files matching {', '.join(include)}" if include else f"files ending in {', '.join(endings)}"
        left_out = f", less those matching {', '.join(exclude)}" if exclude else ""
        raise NotFoundError(f"no {fmt} shards ({chosen}{left_out}) under the dataset root", path=uri,
                            hint="check the URI, the --format, --include/--exclude, or pass --suffix")
    workers = threads if threads is not None else settings().data_index_threads
    if workers < 1:
        raise ConfigError(f"indexing needs at least one thread, got {workers}")
    old = _reusable(previous, fmt, reader.options)
    records: dict[str, ShardRecord] = {}
    hashed: list[str] = []
    reused: list[str] = []
    to_read: list[ListedFile] = []
    for item in listed:
        known = old.get(item.path)
        if known is not None and known.size == item.size and known.source_version == item.version:
            records[item.path] = known
            reused.append(item.path)
        else:
            to_read.append(item)
    done = 0
    for path in reused:
        done += 1
        if progress:
            progress(records[path], True, done, len(listed))
    with TaskPool("ckptd-index", workers) as pool:
        futures = {pool.submit(_index_one, source, reader, item): item for item in to_read}
        try:
            for future in concurrent.futures.as_completed(futures):
                record = future.result()
                records[record.path] = record
                hashed.append(record.path)
                done += 1
                if progress:
                    progress(record, False, done, len(listed))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    ordered = tuple(records[item.path] for item in listed)
    manifest = DatasetManifest(root=uri, format=fmt, shards=ordered, reader_options=dict(reader.options))
    dropped = tuple(sorted(set(_paths(previous)) - set(records)))
    return IndexResult(manifest=manifest, hashed=tuple(sorted(hashed)), reused=tuple(sorted(reused)),
                       dropped=dropped)


def _paths(manifest: DatasetManifest | None) -> list[str]:
    """Shard paths of a manifest (none for no manifest)."""
    return [shard.path for shard in manifest.shards] if manifest is not None else []
