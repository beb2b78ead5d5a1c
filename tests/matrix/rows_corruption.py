"""Fault-matrix rows 8-12 and 36: corruption of a committed step and of a data shard.

Rows 8-12 commit steps 1 and 2 (small chunks, codec raw or zstd drawn from the seed), damage one file of
step 2 in place (which file, how many bytes, which bit: drawn from ``ctx.rng``) and restore as a
restarted job does. Each runs twice: on the local tier alone, where the restore must fall back to step 1,
and with step 2 promoted to S3 (moto's server on 127.0.0.1), where it must load step 2 itself, the
damaged part read from S3. The warnings of the restore must name the damaged file, the step and the
tier; the bytes restored must be the bytes saved (L1); the intact copies stay committed and verify (L2).

Row 36 damages a data shard (its cached copy, or its source and cache) of the verified data loader.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptd.config import override
from ckptd.errors import CkptdError, IntegrityError
from ckptd.format import codecs
from ckptd.format.hashing import chunk_digest
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.promotion import promote_step
from harness import invariants as inv
from ckptd.testing import tamper
from harness.matrix import Outcome, RunContext, S3Location, row
from harness.workloads import synthetic_state
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

STATE_BYTES = 64 * 1024
#: Long-mode runs of the variants with S3 (several seconds each on a loaded 2-core machine: the moto server
#: competes for the cores); the local-only variants run the default 100 times.
S3_LONG_RUNS = 25
CHUNK_BYTES = 4096
GOOD, BAD = 1, 2
WORKLOAD = inv.SyntheticWorkload(STATE_BYTES)


# --- committed steps and their restore ---------------------------------------------------------------

@dataclass(frozen=True)
class Steps:
    """Steps 1 and 2 committed on a local root (and promoted to ``remote`` when it is set), with what the
    local tier had committed before the damage (for L2)."""

    root: Path
    remote: S3Location | None
    codec: str
    local_label: str
    before_local: inv.CommittedRecord


def commit_two_steps(ctx: RunContext, *, with_s3: bool, codec: str | None = None) -> Steps:
    """Save steps 1 and 2 (4 KiB chunks) locally and, ``with_s3``, promote step 2 to a fresh bucket."""
    codec = codec or ctx.rng.choice(["raw", "zstd"])
    root = ctx.path("local")
    with override(chunk_bytes=CHUNK_BYTES):
        with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, codec=codec) as manager:
            for step in (GOOD, BAD):
                manager.save(step, synthetic_state(step, STATE_BYTES), force=True)
    local = LocalTier(root)
    remote = None
    if with_s3:
        remote = ctx.s3()
        tier = ObjectTier(remote.url, storage_options=remote.storage_options)
        try:
            promote_step(local, tier, BAD)  # the step the restore must find; step 1 stays local
        finally:
            tier.close()
    label = local.label
    local.close()
    return Steps(root, remote, codec, label, inv.record_committed(root))


def step_bytes(step: int) -> int:
    state = synthetic_state(step, STATE_BYTES)
    return sum(value.numel() * value.element_size() for value in state.values() if hasattr(value, "numel"))


@contextmanager
def captured_warnings() -> Iterator[list[logging.LogRecord]]:
    """Every WARNING (and above) ckptd logs inside the block."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("ckptd")
    handler, level = _Keep(logging.WARNING), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def relative_name(steps: Steps, path: Path) -> str:
    return path.relative_to(steps.root).as_posix()


def data_files(steps: Steps, step: int = BAD) -> list[Path]:
    listed = tamper.read_json(tamper.index_path(steps.root, step))["data_files"]
    return [tamper.step_path(steps.root, step) / entry[0] for entry in listed]


def pick_shard_file(ctx: RunContext, steps: Steps, *, with_index: bool) -> Path:
    """A data file of step 2, or (``with_index``) possibly its rank index, drawn from the seed."""
    files = data_files(steps)
    if with_index:
        files.append(tamper.index_path(steps.root, BAD))
    return ctx.rng.choice(files)


@dataclass(frozen=True)
class Damage:
    """What a scenario did to step 2: the file (relative to the root), and what its report must contain."""

    file: str
    how: str
    reason: str = ""
    chunk: str | None = None  # the digest of the damaged chunk, for chunk-level damage
    harmless: bool = False  # the change left the chunk decoding to its saved bytes (zstd padding)


def _messages(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records]


def check_named(records: list[logging.LogRecord], damage: Damage, tier_label: str) -> inv.Check:
    """L4 (a bad input gets a typed error that names it): a warning names the damaged file, step 2, the
    tier and the reason; for chunk damage, a logged IntegrityError names exactly that chunk."""
    wanted = f"file {damage.file}"
    naming = [text for text in _messages(records)
              if wanted in text and f"step {BAD}" in text and tier_label in text and damage.reason in text]
    if not naming:
        return inv.Check("L4", False, f"no warning names {wanted}, step {BAD}, tier {tier_label} and "
                                      f"{damage.reason!r} ({damage.how}); logged: {_messages(records)[:4]}")
    if damage.chunk is not None:
        errors = [arg for record in records if isinstance(record.args, tuple) for arg in record.args
                  if isinstance(arg, IntegrityError)]
        wrong = [str(e) for e in errors if e.chunk != damage.chunk or e.path != damage.file or e.step != BAD
                 or e.tier != tier_label]
        if not errors or wrong:
            return inv.Check("L4", False, f"chunk {damage.chunk} ({damage.how}): the logged chunk errors "
                                          f"name another chunk, file, step or tier: {wrong[:2] or 'none logged'}")
    return inv.Check("L4", True, f"{damage.how}: named in the log")


def restore_after(ctx: RunContext, steps: Steps, damage: Damage) -> Outcome:
    """Restore as a restarted job does and check what the row expects: local only, step 1 (or step 2
    when the damage was harmless); with S3, step 2 with the damaged part from S3."""
    ctx.stopwatch.fault()
    expected = BAD if steps.remote is not None or damage.harmless else GOOD
    with captured_warnings() as records:
        restored = inv.check_newest_restores(WORKLOAD, steps.root, remote=steps.remote, expected_step=expected)
    recovery = ctx.stopwatch.since_fault() if restored.ok else None
    checks = [restored]
    if not restored.ok:  # lost: the intact copy (step 1 locally, step 2 on S3) no longer reads bit-exact
        intact = inv.check_step_restores(WORKLOAD, steps.remote or steps.root, expected)
        checks[0] = replace(restored, bytes_lost=0 if intact.ok else step_bytes(expected))
    if not damage.harmless:
        checks.append(check_named(records, damage, steps.local_label))
    checks.append(inv.check_nothing_lost(_good_only(steps.before_local), steps.root))
    if steps.remote is None and not damage.harmless:  # the restore set the bad step aside: not advertised
        checks.append(inv.check_nothing_partial(steps.root, allowed=(GOOD,)))
    return inv.outcome(checks, recovery_s=recovery, detail=f"{damage.how} (codec {steps.codec})")


def _good_only(record: inv.CommittedRecord) -> inv.CommittedRecord:
    return inv.CommittedRecord(record.location, tuple(entry for entry in record.steps if entry.step != BAD))


# --- damages -------------------------------------------------------------------------------------

def truncate_shard(ctx: RunContext, steps: Steps) -> Damage:
    path = pick_shard_file(ctx, steps, with_index=False)
    size = path.stat().st_size
    cut = ctx.rng.randint(1, size)
    os.truncate(path, size - cut)
    return Damage(relative_name(steps, path), f"{path.name} cut by {cut} of {size} bytes",
                  f"data file size differs from the index (expected {size}, got {size - cut})")


def _chunk_still_decodes(record: list[Any], stored: bytes) -> bool:
    try:
        return chunk_digest(codecs.decode(record[3], stored, int(record[2]))) == record[4]
    except CkptdError:
        return False


def flip_chunk_bit(ctx: RunContext, steps: Steps) -> Damage:
    name, record = ctx.rng.choice(tamper.chunk_records(steps.root, BAD))
    path = data_files(steps)[record[5]]
    offset, length, digest = int(record[0]), int(record[1]), str(record[4])
    at, bit = offset + ctx.rng.randrange(length), ctx.rng.randrange(8)
    tamper.flip_bit(path, at, bit)
    with open(path, "rb") as handle:
        handle.seek(offset)
        harmless = _chunk_still_decodes(record, handle.read(length))
    return Damage(relative_name(steps, path), f"bit {bit} of byte {at} flipped in chunk {digest} of '{name}'",
                  f"chunk {digest}", chunk=digest, harmless=harmless)


def zero_shard(ctx: RunContext, steps: Steps) -> Damage:
    path = pick_shard_file(ctx, steps, with_index=True)
    path.write_bytes(bytes(path.stat().st_size))
    is_index = path.name.endswith(".index.json")
    return Damage(relative_name(steps, path), f"{path.name} overwritten with zeros",
                  "rank index does not match the manifest" if is_index else "chunk")


def remove_shard(ctx: RunContext, steps: Steps) -> Damage:
    path = pick_shard_file(ctx, steps, with_index=True)
    path.unlink()
    return Damage(relative_name(steps, path), f"{path.name} removed", "file not found")


def damage_metadata(ctx: RunContext, steps: Steps) -> Damage:
    """A bit flip or a truncation of step 2's manifest or rank index."""
    path = ctx.rng.choice([tamper.manifest_path(steps.root, BAD), tamper.index_path(steps.root, BAD)])
    size = path.stat().st_size
    if ctx.rng.random() < 0.5:
        at, bit = ctx.rng.randrange(size), ctx.rng.randrange(8)
        tamper.flip_bit(path, at, bit)
        how = f"bit {bit} of byte {at} of {path.name} flipped"
    else:
        keep = ctx.rng.randrange(size)
        os.truncate(path, keep)
        how = f"{path.name} truncated to {keep} of {size} bytes"
    return Damage(relative_name(steps, path), how)


# --- rows 8, 9, 11, 12 -------------------------------------------------------------------------------

def _scenario(damage: Callable[[RunContext, Steps], Damage], with_s3: bool,
              codec: str | None = None) -> Callable[[RunContext], Outcome]:
    def run(ctx: RunContext) -> Outcome:
        steps = commit_two_steps(ctx, with_s3=with_s3, codec=codec)
        return restore_after(ctx, steps, damage(ctx, steps))
    return run


def _register(number: int, title: str, damage: Callable[[RunContext, Steps], Damage], name: str,
              codec: str | None = None) -> None:
    for with_s3, where in ((False, "local"), (True, "local_and_s3")):
        scenario = _scenario(damage, with_s3, codec)
        scenario.__name__ = scenario.__qualname__ = f"row{number}_{name}_{where}"
        row(number, title, long_runs=S3_LONG_RUNS if with_s3 else 100)(scenario)


_register(8, "Truncated shard in a committed checkpoint", truncate_shard, "truncated_shard")
_register(9, "Single bit flip in a chunk", flip_chunk_bit, "bit_flip")
_register(11, "Shard of correct length, all zeros", zero_shard, "zeroed_shard")
_register(12, "Missing shard file", remove_shard, "missing_shard")


# --- row 10: the manifest and the index ------------------------------------------------------------

def _typed_metadata_error(steps: Steps, damage: Damage) -> inv.Check:
    """Reading step 2's metadata raises a CkptdError naming the damaged file and the step."""
    from ckptd.stepio.step_reader import load_rank_index, load_step_manifest

    tier = LocalTier(steps.root)
    try:
        manifest = load_step_manifest(tier, BAD)
        for entry in manifest.ranks:
            load_rank_index(tier, manifest, entry.rank)
    except CkptdError as error:
        if damage.file in str(error) and f"step {BAD}" in str(error):
            return inv.Check("L4", True, f"{type(error).__name__}: {error}")
        return inv.Check("L4", False, f"{damage.how}: the error does not name {damage.file} and step {BAD}: {error}")
    except Exception as error:  # noqa: BLE001 - an untyped error is the finding
        return inv.Check("L4", False, f"{damage.how}: untyped {type(error).__name__}: {error}")
    finally:
        tier.close()
    return inv.Check("L4", False, f"{damage.how}: the damaged metadata was accepted")


def _metadata_scenario(with_s3: bool) -> Callable[[RunContext], Outcome]:
    def run(ctx: RunContext) -> Outcome:
        steps = commit_two_steps(ctx, with_s3=with_s3)
        damage = damage_metadata(ctx, steps)
        typed = _typed_metadata_error(steps, damage)
        found = restore_after(ctx, steps, replace(damage, reason=""))
        return inv.outcome([typed, *([] if found.held else [inv.Check("L1", False, found.detail,
                                                                      found.bytes_lost)])],
                           recovery_s=found.recovery_s, detail=found.detail if found.held else damage.how)
    return run


for _with_s3, _where in ((False, "local"), (True, "local_and_s3")):
    _run = _metadata_scenario(_with_s3)
    _run.__name__ = _run.__qualname__ = f"row10_damaged_metadata_{_where}"
    row(10, "Bit flip or truncation in the manifest or the index", long_runs=S3_LONG_RUNS if _with_s3 else 100)(_run)


# --- row 36: data shards -----------------------------------------------------------------------------

SHARD_SIZES = [12, 9, 14, 10, 11]


@dataclass
class _CountingSource:
    """The real shard source; counts the reads of one shard (to see that it is fetched again once)."""

    inner: Any
    path: str
    reads: int = 0

    def read(self, relative: str) -> bytes:
        if relative == self.path:
            self.reads += 1
        return bytes(self.inner.read(relative))

    def url(self, relative: str) -> str:
        return str(self.inner.url(relative))


@row(36, "Data shard whose hash does not match")
def row36_corrupt_data_shard(ctx: RunContext) -> Outcome:
    """A bit flipped in a cached shard is fetched again once and repaired; flipped in the source too, the
    shard is fetched again once, then an IntegrityError names it (and the bad copy is quarantined)."""
    from ckptd.data import ShardCache, ShardDataset, ShardLoader, VerifiedFetcher, index_dataset
    from ckptd.data.cache import entry_name
    from ckptd.data.source import ShardSource
    from ckptd.data.testing import flip_bit, write_jsonl_shards

    source_dir, cache_dir = ctx.path("data"), ctx.path("cache")
    write_jsonl_shards(source_dir, SHARD_SIZES, payload_bytes=40)
    manifest = index_dataset(str(source_dir), "jsonl").manifest

    def ids(cache: Path) -> list[str]:
        loader = ShardLoader(ShardDataset(manifest, seed=5, cache_dir=cache, fetch_attempts=2, global_batch_size=4))
        return [sample for batch in loader for sample in batch["id"]]

    golden = ids(cache_dir)  # fills the cache
    record = ctx.rng.choice(manifest.shards)
    good = (source_dir / record.path).read_bytes()
    cached = cache_dir / entry_name(record)
    at, bit = ctx.rng.randrange(record.size), ctx.rng.randrange(8)
    flip_bit(cached, at, bit)
    how = f"bit {bit} of byte {at} of {record.path}"
    ctx.stopwatch.fault()
    checks = []
    source = _CountingSource(ShardSource(str(source_dir)), record.path)
    fetcher = VerifiedFetcher(source, ShardCache(cache_dir), attempts=2)  # type: ignore[arg-type]
    loaded = fetcher.load(record)
    checks.append(inv.Check("L1", loaded == good and cached.read_bytes() == good and source.reads == 1
                            and fetcher.refetches == 1,
                            f"cached copy, {how}: fetched {source.reads} time(s), {fetcher.refetches} refetch(es), "
                            f"bytes {'equal' if loaded == good else 'differ'}"))
    recovery = ctx.stopwatch.since_fault()
    checks.append(inv.Check("L5", ids(cache_dir) == golden, "the repaired cache gives the golden sample ids"))

    flip_bit(source_dir / record.path, at, bit)
    flip_bit(cached, at, bit)
    source.reads = 0
    try:
        VerifiedFetcher(source, ShardCache(cache_dir), attempts=2).load(record)  # type: ignore[arg-type]
        checks.append(inv.Check("L4", False, f"source and cache, {how}: the bad shard was returned"))
    except IntegrityError as error:
        named = str(source_dir / record.path) in str(error) and error.expected == record.digest
        checks.append(inv.Check("L4", named and source.reads == 2,
                                f"source and cache, {how}: fetched {source.reads} time(s) (want 2), error: {error}"))
    try:
        ids(ctx.path("cache-2"))
        checks.append(inv.Check("L4", False, f"the loader returned samples of the bad shard {record.path}"))
    except IntegrityError as error:
        checks.append(inv.Check("L4", record.path in str(error), f"loader: {error}"))
    return inv.outcome(checks, recovery_s=recovery, detail=how)
