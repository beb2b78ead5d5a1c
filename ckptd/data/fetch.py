"""Verified shard bytes: cache first, source second, every copy checked against the manifest.

:meth:`VerifiedFetcher.load` returns a shard's bytes only if their size and xxh3-64 digest equal the
manifest record. A cached copy is checked every time it is opened; a bad one is deleted and the shard
is fetched again from the source. A shard whose source copy stays bad (or missing) for
``attempts`` fetches is quarantined: its last bad bytes are kept in the cache's ``quarantine/`` folder
and :class:`~ckptd.errors.IntegrityError` (or :class:`~ckptd.errors.NotFoundError`) names the shard and
both digests. Safe to call from several threads and processes at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ckptd.config import settings
from ckptd.data.cache import ShardCache, entry_name
from ckptd.data.manifest import ShardRecord
from ckptd.data.source import ShardSource
from ckptd.errors import ConfigError, IntegrityError, NotFoundError, StorageError
from ckptd.format.hashing import shard_digest

log = logging.getLogger("ckptd.data")

_BACKOFF_S = 0.05


@dataclass(frozen=True)
class _Check:
    ok: bool
    actual: str


def _check(record: ShardRecord, data: bytes) -> _Check:
    if len(data) != record.size:
        return _Check(False, f"{shard_digest(data)} ({len(data)} bytes, expected {record.size})")
    actual = shard_digest(data)
    return _Check(actual == record.digest, actual)


class VerifiedFetcher:
    """Loads shards of one dataset through a :class:`ShardCache`, verifying each copy."""

    def __init__(self, source: ShardSource, cache: ShardCache, *, verify: bool = True,
                 attempts: int | None = None) -> None:
        self.source = source
        self.cache = cache
        self.verify = verify
        self.attempts = settings().data_fetch_attempts if attempts is None else attempts
        if self.attempts < 1:
            raise ConfigError(f"fetch attempts must be >= 1, got {self.attempts}",
                              hint="set CKPTD_DATA_FETCH_ATTEMPTS")
        #: How many times a cached copy failed verification and was fetched again (for tests, metrics).
        self.refetches = 0

    def load(self, record: ShardRecord) -> bytes:
        """The verified bytes of a shard (see the module docstring for retries and quarantine)."""
        entry = entry_name(record)
        last_bad: bytes | None = None
        last_actual = ""
        last_error: Exception | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(_BACKOFF_S * attempt)
            with self.cache.lock(entry):
                cached = self.cache.read(entry)
                if cached is not None:
                    check = _check(record, cached) if self.verify else _Check(True, "")
                    if check.ok:
                        return cached
                    log.warning("cached copy of shard %s is corrupt (expected %s, got %s); fetching it again",
                                self.source.url(record.path), record.digest, check.actual)
                    self.cache.discard(entry)
                    self.refetches += 1
                try:
                    data = self.source.read(record.path)
                except (NotFoundError, StorageError) as exc:
                    last_error = exc
                    continue
                check = _check(record, data) if self.verify else _Check(True, "")
                if check.ok:
                    self.cache.store(entry, data)
                    return data
                last_bad, last_actual, last_error = data, check.actual, None
                log.warning("shard %s from the source is corrupt (expected %s, got %s), attempt %d of %d",
                            self.source.url(record.path), record.digest, check.actual, attempt + 1,
                            self.attempts)
        if last_error is not None:
            raise last_error
        kept = self.cache.quarantine(entry, last_bad or b"")
        raise IntegrityError(
            f"data shard stays corrupt after {self.attempts} fetch(es) and was quarantined (bad copy kept "
            f"at {kept})", path=self.source.url(record.path), expected=record.digest, actual=last_actual,
            hint="restore the shard from a good copy and re-index it, or use on_corrupt='skip'")
