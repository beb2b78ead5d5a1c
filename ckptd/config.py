"""Every tunable of ckptd in one place.

Each field of :class:`Settings` can be overridden by an environment variable named
``CKPTD_<FIELD NAME IN CAPITALS>`` (for example ``CKPTD_CHUNK_BYTES=8388608``). Tests override values
for a block of code with :func:`override`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from ckptd.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tunables; the defaults suit a node-local NVMe tier and a 2-core CI machine alike."""

    #: Largest piece a tensor is cut into before hashing and encoding.
    chunk_bytes: int = 16 * 1024 * 1024
    #: Codec for new checkpoints when the caller names none: raw, zstd or byteplane.
    codec: str = "raw"
    #: zstd level for the zstd and byteplane codecs.
    zstd_level: int = 1
    #: Threads that hash/encode/write chunks in the background; also the number of data files a rank's
    #: large chunks are written to in parallel.
    io_threads: int = 2
    #: Threads that read and verify chunks during a restore (training waits for it, and reads wait on the
    #: disk more than on a core).
    read_threads: int = 4
    #: Write large chunks with direct I/O (O_DIRECT), bypassing the page cache, where the file system
    #: allows it.
    direct_io: bool = True
    #: Chunks of at least this many stored bytes go to the parallel (direct-I/O) data files; smaller ones
    #: are packed into the rank's first data file through the page cache (no padding to 4 KiB).
    direct_io_min_bytes: int = 256 * 1024
    #: Tensors of fewer raw bytes go into the rank's pack, its first data file, which the object tier
    #: stores as one object per rank and step and reads by range; the chunks of larger tensors are
    #: stored there by digest and shared by the steps that hold them. 0: no pack (format 2 layout).
    #: The default equals direct_io_min_bytes, so the pack is written as the page-cache file was before.
    pack_below_bytes: int = 256 * 1024
    #: Seconds a rank waits for the others to agree on a commit before failing the step.
    commit_timeout_s: float = 300.0
    #: Seconds after which a temporary file left in a tier is considered abandoned.
    stale_temp_s: float = 0.0
    #: Object tier: connect and read timeouts in seconds of data requests (uploads, chunk reads). The read
    #: timeout bounds a silence on the socket, not a whole transfer.
    s3_connect_timeout_s: float = 3.0
    s3_read_timeout_s: float = 20.0
    #: Object tier: retries of one operation, all its requests together (a multipart upload's parts, a
    #: ranged read's pieces), with botocore's jittered exponential back-off.
    s3_retries: int = 4
    #: Object tier: of those, retries after a connection could not be made (refused, connect timeout,
    #: unknown host), so that a dead endpoint is known within about two connect timeouts.
    s3_connect_retries: int = 1
    #: Object tier: back-off before the first retry of an operation (full jitter, doubling each retry),
    #: and its cap, in seconds.
    s3_backoff_base_s: float = 0.2
    s3_backoff_max_s: float = 5.0
    #: Object tier: checksum asked of the store at upload (computed by zlib) and compared by promotion's
    #: dedup with the local bytes: CRC32, or "" for a store that refuses checksum headers.
    s3_upload_checksum: str = "CRC32"
    #: Object tier: seconds an owner record of a multipart upload stays valid; the uploader refreshes it
    #: every third of that, and GC aborts an upload only when its owner is dead or its record expired.
    s3_upload_owner_lease_s: float = 120.0
    #: This machine's identity in owner records of uploads and GC leases ("": the host name).
    host_id: str = ""
    #: Object tier: this job's identity in the claims of its promotions, the same for every restart of the job
    #: ("": the object-tier URL, one job per prefix). A restart owns its interrupted promotions; another run
    #: id's are refused (see docs/object-tier.md).
    run_id: str = ""
    #: Object tier: seconds between looks at a step's owner records while a promotion waits for another
    #: live promoter of the same step number (its record refreshed or expired) before taking the step over.
    promotion_owner_poll_s: float = 2.0
    #: Object tier: connect and read timeouts and attempts of listings, lookups and deletes, kept short so
    #: that a store that cannot be reached or hangs is known within seconds (restore then uses the tiers
    #: that answer).
    s3_metadata_connect_timeout_s: float = 2.0
    s3_metadata_read_timeout_s: float = 10.0
    s3_metadata_retries: int = 2
    #: Object tier: parallel requests (multipart parts and ranged reads).
    s3_concurrency: int = 8
    #: Object tier: multipart part size.
    s3_part_bytes: int = 16 * 1024 * 1024
    #: Object tier: I/O threads (each with its own s3fs client) that parallel transfers are spread over.
    s3_io_threads: int = 2
    #: Object tier: single GETs and PUTs of data through a blocking botocore client on threads (faster than
    #: the lanes' aiohttp: :mod:`ckptd.tiers.s3_blocking`); off: every request on the lanes.
    s3_blocking_data: bool = True
    #: Object tier: compressed chunks and whole packs fetched ahead of the reader during a restore (0: as
    #: many as s3_concurrency); uncompressed chunks are read straight into the tensors instead.
    s3_read_ahead: int = 0
    #: Object tier: write commit markers with a conditional PUT (If-None-Match: *). Turn it off for a
    #: store that ignores the header; the tier then looks the key up before writing (not race-free).
    s3_conditional_put: bool = True
    #: Promotion: seconds a GC lease on the object tier stays valid (a crashed GC is ignored after it).
    gc_lease_s: float = 600.0
    #: GC: seconds after which an uncommitted step directory counts as abandoned and may be removed.
    gc_abandoned_s: float = 3600.0
    #: Promotion: most local steps kept pinned while they wait for the object tier (per local directory
    #: and rank); past it the oldest unpromoted pins are released (the newest is always kept).
    pin_max_steps: int = 4
    #: Promotion: most bytes held only by pins (of steps local retention already deleted) per local
    #: directory and rank (0: no byte limit); past it the oldest unpromoted pins are released.
    pin_max_bytes: int = 32 * 1024 * 1024 * 1024
    #: Host memory the stager may hold for one save (0: no limit). A ``ckptd launch`` rank's manager keeps two
    #: sets of staging buffers (its two newest saves), each bounded by this: up to twice it in all.
    staging_budget_bytes: int = 0
    #: Pin the stager's host buffers when CUDA is present (faster device-to-host copies).
    pin_staging: bool = True
    #: Seconds ``close()`` waits for background work (pending writes, then uploads) before it raises
    #: StillRunningError (the manager then keeps its directory lock) or, for uploads, UnpromotedError.
    close_timeout_s: float = 600.0
    #: Seconds ``wait()`` (and ``wait_uploads()``, a busy save under ``on_busy="wait"``, a prefetched
    #: shard) blocks for background work before it raises StillRunningError naming what still runs.
    wait_timeout_s: float = 1800.0
    #: Seconds a chunk's write waits for a free parallel data file of its rank before DeadlineError.
    file_handoff_timeout_s: float = 300.0
    #: Data shards: seconds a loader waits for another loader's download of the same shard (the cache
    #: entry's lock) before DeadlineError.
    data_cache_lock_timeout_s: float = 600.0
    #: Nice value added to ckptd's background threads (writer, hashing, reading) on Linux, so that the
    #: training thread wins contended cores; 0 leaves their priority alone.
    background_nice: int = 10
    #: Where a save is hashed, encoded, written and committed locally: "process" (a writer process per
    #: manager, fed through shared-memory staging buffers, so a training loop that holds the GIL does not
    #: delay the commit) or "thread" (a writer thread in the training process).
    writer_mode: str = "thread"
    #: Nice value added to the writer process (0: the trainer's priority). See docs/saving.md for the
    #: measurement behind the default.
    writer_process_nice: int = 0
    #: Seconds one request to the writer process (writing or committing one step) may take before the
    #: process is stopped and the step fails with DeadlineError.
    writer_timeout_s: float = 1800.0
    #: Seconds between checks that the writer process still lives while a request waits for it.
    writer_poll_s: float = 0.25
    #: Seconds ``close()`` waits for the writer process to exit before it is killed.
    writer_stop_timeout_s: float = 10.0
    #: Log level for ckptd's loggers.
    log_level: str = "WARNING"
    #: Data shards: local cache directory ("" means ~/.cache/ckptd/shards).
    data_cache_dir: str = ""
    #: Data shards: most bytes the shard cache keeps on disk (least recently used shards go first).
    data_cache_bytes: int = 32 * 1024 * 1024 * 1024
    #: Data shards: shards loaded ahead (fetched, verified) per loading process; at least the next
    #: shuffle block is loaded ahead whenever this is above 0.
    data_prefetch_shards: int = 4
    #: Data shards: fetches of one shard before it is quarantined as corrupt or missing.
    data_fetch_attempts: int = 3
    #: Data shards: threads that read and hash shards while indexing.
    data_index_threads: int = 4
    #: Elastic (``ckptd launch``): seconds a rank waits, after a failure, for the supervisor's next
    #: generation and for every rank to join it (and, at the end, for every rank to finish) before it exits.
    elastic_rejoin_timeout_s: float = 120.0
    #: Elastic: seconds a collective of the process group may block (gloo's timeout) in each generation.
    elastic_collective_timeout_s: float = 60.0
    #: Peer tier: connect and read timeouts in seconds of requests to a buddy node's daemon (the read
    #: timeout bounds a silence on the socket, not a whole transfer).
    peer_connect_timeout_s: float = 2.0
    peer_read_timeout_s: float = 30.0
    #: Whether a CheckpointManager hands its steps to the node's daemon: auto (when one answers), off or
    #: require (the manager's ``daemon=`` argument wins).
    daemon: str = "auto"
    #: Seconds one request of a manager to the daemon's control socket may take, connecting included; a
    #: daemon that does not answer in time counts as gone and the manager promotes in-process.
    daemon_request_timeout_s: float = 5.0
    #: ``ckptd plan``: job-wide object-store upload rate (GB/s) beyond which a plan that assumes it warns (also
    #: ``--object-store-limit-gb-per-s``). About what one S3 prefix takes at 3,500 PUT/s of 16 MiB parts
    #: (59 GB/s) rounded up; large on-premises stores sustain tens to a few hundred GB/s.
    plan_object_store_limit_gb_per_s: float = 100.0


_overrides: dict[str, Any] = {}


def _coerce(name: str, raw: str, kind: type) -> Any:
    try:
        if kind is bool:
            return raw.strip().lower() in {"1", "true", "yes", "on"}
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(
            f"environment variable CKPTD_{name.upper()}={raw!r} is not a valid {kind.__name__}",
            hint="fix or unset it",
        ) from exc


def settings() -> Settings:
    """Current settings: defaults, then ``CKPTD_*`` environment variables, then :func:`override`."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        kind = type(field.default)
        raw = os.environ.get(f"CKPTD_{field.name.upper()}")
        if raw is not None:
            values[field.name] = _coerce(field.name, raw, kind)
    values.update(_overrides)
    return Settings(**values)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[Settings]:
    """Temporarily override settings (for tests and benchmarks)."""
    unknown = set(values) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield settings()
    finally:
        _overrides.clear()
        _overrides.update(saved)
