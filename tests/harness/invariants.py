"""Checkers of the fault matrix's invariants L1-L5, shared by every row.

Each checker returns a :class:`Check` (which invariant, whether it held, what was wrong, how many bytes
of committed data it found lost) instead of raising, so that a scenario collects them and folds them into
its :class:`~harness.matrix.Outcome` with :func:`outcome`. A checker that meets an unexpected
exception reports it as a failed check (the exception type and message in ``detail``).

A tier is named by a *location*: a local directory (``str`` or ``Path``), an ``s3://`` URL with its
``storage_options``, or anything with ``.url`` and ``.storage_options`` (a matrix
:class:`~harness.matrix.S3Location`). Every checker reads the tier through ckptd's own code: the
tier's listing (:meth:`~ckptd.tiers.StorageTier.committed_steps`, what ``ckptd ls`` shows as committed),
:func:`~ckptd.stepio.step_reader.verify_step` (what ``ckptd verify`` runs) and
:meth:`~ckptd.CheckpointManager.restore` (what a restarted job runs), never by globbing files.

- L1 :func:`check_newest_restores`: the newest committed step restores bit-exact against the state a
  :class:`Workload` rebuilds for that step (optionally in a fresh process, as users restore);
- L2 :func:`record_committed` before the fault, :func:`check_nothing_lost` after: every step recorded is
  still committed, byte-identical manifest, and verifies, unless retention may have removed it;
- L3 :func:`check_nothing_partial`: every advertised step verifies completely; and
  :func:`check_no_temporaries` for what a crash left in a local root after the next start;
- L4 :func:`snapshot_tree` / :func:`check_untouched` and :func:`plant_canary` / :func:`check_canary`:
  nothing outside the root changed, no payload ran;
- L5 :func:`state_digest` and :func:`check_same_run`: sample-id streams and state hashes of two runs.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import xxhash

from harness.matrix import INVARIANTS, Outcome, crash_injector

Location = Any  # str | os.PathLike[str] | an object with .url and .storage_options


@dataclass(frozen=True)
class Check:
    """The result of one invariant check."""

    invariant: str
    ok: bool
    detail: str = ""
    bytes_lost: int = 0
    #: What the check found, for a scenario's own assertions (L1: ``step``, ``tier``, ``tiers``,
    #: ``chunks_by_tier``, ``fallbacks``), so that nobody parses ``detail``.
    facts: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.invariant not in INVARIANTS:
            raise ValueError(f"invariant must be one of {INVARIANTS}, got {self.invariant!r}")


def outcome(checks: Iterable[Check], *, recovery_s: float | None = None, step_recovery_s: float | None = None,
            detail: str = "") -> Outcome:
    """Fold checks into an :class:`Outcome`: held when every check held; the details of the failed ones
    (after ``detail``, the scenario's own note) and the bytes lost summed."""
    checks = list(checks)
    if not checks:
        raise ValueError("outcome() needs at least one check")
    failed = [c for c in checks if not c.ok]
    notes = [detail] if detail else []
    notes += [f"{c.invariant}: {c.detail}" for c in failed]
    checked = tuple(name for name in INVARIANTS if any(c.invariant == name for c in checks))
    return Outcome(held=not failed, checked=checked, recovery_s=recovery_s, step_recovery_s=step_recovery_s,
                   bytes_lost=sum(c.bytes_lost for c in checks), detail="; ".join(notes))


def _failure(invariant: str, error: BaseException, what: str) -> Check:
    return Check(invariant, False, f"{what} raised {type(error).__name__}: {error}")


# --- tiers ---------------------------------------------------------------------------------------

def _url_and_options(location: Location, storage_options: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    if hasattr(location, "url") and hasattr(location, "storage_options"):
        return str(location.url), storage_options or dict(location.storage_options)
    return os.fspath(location), storage_options


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def open_location(location: Location, storage_options: dict[str, Any] | None = None) -> Any:
    """The :class:`~ckptd.tiers.StorageTier` a location names (closed by the caller). A local directory that
    does not exist is not created; its listing is empty."""
    from ckptd.tiers import open_tier

    url, options = _url_and_options(location, storage_options)
    return open_tier(url, storage_options=options, create=False)


def _local_missing(location: Location) -> bool:
    url, _ = _url_and_options(location, None)
    if not _is_local(url):
        return False
    from ckptd.tiers.local import local_root

    return not local_root(url).is_dir()


def advertised_steps(location: Location, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The steps a tier advertises as committed (restorable), ascending, from its own listing."""
    if _local_missing(location):
        return []
    tier = open_location(location, storage_options)
    try:
        return tier.committed_steps()
    finally:
        tier.close()


def _problems(tier: Any, step: int) -> list[str]:
    from ckptd.stepio.step_reader import verify_step

    return [f"step {p.step} rank {p.rank}: {p.path}: {p.error}" for p in verify_step(tier, step)]


# --- workloads (the expected states) -----------------------------------------------------------

class Workload(Protocol):
    """A state that is a pure function of its step (and rank), so a checker can rebuild what was saved.
    Must pickle (it travels to the fresh process of ``fresh_process=True``)."""

    def state(self, step: int, rank: int = 0) -> Any:
        """The state saved at ``step`` by ``rank``."""

    def template(self, rank: int = 0) -> Any:
        """A live state of the same structure to restore into."""


@dataclass(frozen=True)
class SyntheticWorkload:
    """:func:`harness.workloads.synthetic_state` of ``nbytes`` (what ``workloads.save_steps`` saves);
    rank ``r`` saves the state of step ``step * rank_stride + r`` so that ranks differ."""

    nbytes: int
    rank_stride: int = 1

    def _step(self, step: int, rank: int) -> int:
        return step * self.rank_stride + rank

    def state(self, step: int, rank: int = 0) -> Any:
        from harness.workloads import synthetic_state

        return synthetic_state(self._step(step, rank), self.nbytes)

    def template(self, rank: int = 0) -> Any:
        from harness.workloads import synthetic_template

        return synthetic_template(self.nbytes)


# --- L1 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestoreFinding:
    """What one restore found: the step it loaded, from which tier, and how the bytes differ."""

    step: int | None
    tier: str | None
    differences: tuple[str, ...]
    error: str = ""
    #: Every tier that supplied data (nearest first), chunks read from each, and chunks read from a farther
    #: tier because the nearer copy was bad or missing (a restore through a manager only).
    tiers: tuple[str, ...] = ()
    chunks_by_tier: Mapping[str, int] = field(default_factory=dict)
    fallbacks: int = 0

    def facts(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "tiers": self.tiers, "chunks_by_tier": dict(self.chunks_by_tier),
                "fallbacks": self.fallbacks}


def _restore_with_manager(local: str, remote: str | None, storage_options: dict[str, Any] | None,
                          workload: Workload, step: int | None) -> RestoreFinding:
    from ckptd.manager.manager import CheckpointManager
    from ckptd.policy import Policy
    from ckptd.testing.compare import state_differences

    live = workload.template()
    with CheckpointManager(local, remote=remote, storage_options=storage_options, policy=Policy(keep_local=None),
                           capture_rng=False, daemon="off") as manager:
        restored = manager.restore(live, step=step)
        result = manager.last_restore
    seen = {"tiers": tuple(result.tiers), "chunks_by_tier": dict(result.chunks_by_tier),
            "fallbacks": len(result.events)} if result is not None else {}
    tier = result.tier if result is not None else None
    if restored is None:
        return RestoreFinding(None, tier, (), **seen)
    return RestoreFinding(restored, tier, tuple(state_differences(live, workload.state(restored))), **seen)


def _restore_read_only(location: Location, storage_options: dict[str, Any] | None, workload: Workload,
                       step: int, rank: int) -> RestoreFinding:
    """Read one rank's share of ``step`` through the step reader (no manager, no lock: what
    ``ckptd restore --step`` does), for a root a live writer holds."""
    from ckptd.state.rng import RNG_KEY
    from ckptd.state.tree import rebuild
    from ckptd.stepio.step_reader import ChunkSource, StepReader, load_rank_index, load_step_manifest
    from ckptd.testing.compare import state_differences

    tier = open_location(location, storage_options)
    try:
        manifest = load_step_manifest(tier, step)
        reader = StepReader([ChunkSource(tier, load_rank_index(tier, manifest, rank))])
        state = rebuild(reader.index.values, reader.read_tensor)
    finally:
        tier.close()
    if isinstance(state, dict):
        state.pop(RNG_KEY, None)
    return RestoreFinding(step, tier.label, tuple(state_differences(state, workload.state(step, rank))))


def check_step_restores(workload: Workload, location: Location, step: int, *, rank: int = 0,
                        storage_options: dict[str, Any] | None = None) -> Check:
    """L1 for one given step, read-only (no manager, no lock; every chunk verified as it is read): what
    ``ckptd restore --step`` does, usable on a root a live writer holds."""
    try:
        finding = _restore_read_only(location, storage_options, workload, step, rank)
    except Exception as error:  # noqa: BLE001 - a failed read is a finding
        return _failure("L1", error, f"reading step {step} rank {rank}")
    if finding.differences:
        return Check("L1", False, f"step {step} rank {rank} from {finding.tier} is not bit-exact: "
                                  f"{'; '.join(finding.differences[:5])}", facts=finding.facts())
    return Check("L1", True, f"step {step} rank {rank} read bit-exact from {finding.tier}", facts=finding.facts())


def restore_in_child(channel: Any, local: str, remote: str | None, storage_options: dict[str, Any] | None,
                     workload: Workload, step: int | None) -> RestoreFinding:
    """Crash-injector target: :func:`_restore_with_manager` in a fresh process (forked from the forkserver,
    which holds no state of the test process: no memory tier, no open files)."""
    try:
        return _restore_with_manager(local, remote, storage_options, workload, step)
    except Exception as error:  # reported to the parent as a finding
        return RestoreFinding(None, None, (), f"{type(error).__name__}: {error}")


def check_newest_restores(workload: Workload, local: Location | None = None, *, remote: Location | None = None,
                          storage_options: dict[str, Any] | None = None, expected_step: int | None = None,
                          allowed_steps: Iterable[int] | None = None, fresh_process: bool = False,
                          read_only: bool = False, scratch: Path | None = None) -> Check:
    """L1: a restore of the newest step loads the bytes ``workload`` saved at that step.

    The restore runs as a restarted job runs it: a :class:`~ckptd.CheckpointManager` on ``local`` (and
    ``remote``, an object tier), ``restore()`` with no step. Without ``local`` the restore uses a fresh
    empty directory under ``scratch`` (a node whose local tier is gone; without ``scratch``, a temporary
    directory removed afterwards). ``expected_step``: the step it must
    land on; ``allowed_steps``: the steps it may land on (e.g. old or new after a kill at the rename);
    without either it must land on the newest step the tiers advertise. ``fresh_process``: restore in a new
    process, as users do after a crash. ``read_only``: no manager (it would take the root's lock and clean
    temporaries): the newest advertised step of ``local`` is read through the step reader, rank 0.
    """
    cleanup: Path | None = None
    try:
        options = storage_options
        if remote is not None:
            remote_url, options = _url_and_options(remote, storage_options)
        else:
            remote_url = None
        if local is None:  # removed at the end unless under the caller's scratch directory
            local = Path(tempfile.mkdtemp(prefix="empty-local-", dir=scratch))
            if scratch is None:
                cleanup = local
        local_url, _ = _url_and_options(local, None)
        advertised = sorted(set(advertised_steps(local_url)) |
                            set(advertised_steps(remote_url, options) if remote_url else ()))
        newest = advertised[-1] if advertised else None
        if read_only:
            if newest is None:
                return Check("L1", False, f"no committed step in {local_url}")
            finding = _restore_read_only(local_url, None, workload, newest, 0)
        elif fresh_process:
            child = crash_injector().run(restore_in_child, local_url, remote_url, options, workload, None)
            if child.error or child.value is None:
                return Check("L1", False, f"the fresh process failed: exit {child.exitcode} {child.error or ''}")
            finding = child.value
        else:
            finding = _restore_with_manager(local_url, remote_url, options, workload, None)
    except Exception as error:  # noqa: BLE001 - a failed restore is a finding, reported
        return _failure("L1", error, "restore")
    finally:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
    if finding.error:
        return Check("L1", False, f"restore raised {finding.error}", facts=finding.facts())
    where = f"{local_url}" + (f" + {remote_url}" if remote_url else "")
    if finding.step is None:
        return Check("L1", False, f"restore of {where} found no checkpoint (advertised {advertised})",
                     facts=finding.facts())
    wanted = {expected_step} if expected_step is not None else \
        set(allowed_steps) if allowed_steps is not None else {newest}
    if finding.step not in wanted:
        return Check("L1", False, f"restore of {where} loaded step {finding.step}, expected "
                                  f"{' or '.join(map(str, sorted(wanted, key=str)))} (advertised {advertised})",
                     facts=finding.facts())
    if finding.differences:
        return Check("L1", False, f"step {finding.step} from {finding.tier} is not bit-exact: "
                                  f"{'; '.join(finding.differences[:5])}", facts=finding.facts())
    return Check("L1", True, f"step {finding.step} restored bit-exact from {finding.tier}", facts=finding.facts())


# --- L2 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommittedStep:
    """A committed step as recorded before a fault: its manifest's digest and the bytes it holds."""

    step: int
    manifest_digest: str
    total_bytes: int


@dataclass(frozen=True)
class CommittedRecord:
    """The committed steps of one tier before a fault."""

    location: str
    steps: tuple[CommittedStep, ...] = field(default_factory=tuple)

    @property
    def numbers(self) -> list[int]:
        return [entry.step for entry in self.steps]


def _manifest_digest(tier: Any, step: int) -> str:
    from ckptd.format.layout import MANIFEST_NAME, step_file

    return xxhash.xxh3_128_hexdigest(tier.read_bytes(step_file(step, MANIFEST_NAME)))


def record_committed(location: Location, storage_options: dict[str, Any] | None = None) -> CommittedRecord:
    """The committed steps of a tier with their manifest digests and sizes (raises: call it before the fault,
    on a tier that must answer)."""
    from ckptd.stepio.step_reader import load_step_manifest

    url, options = _url_and_options(location, storage_options)
    if _local_missing(url):
        return CommittedRecord(url)
    tier = open_location(url, options)
    try:
        entries = tuple(CommittedStep(step, _manifest_digest(tier, step), load_step_manifest(tier, step).total_bytes)
                        for step in tier.committed_steps())
    finally:
        tier.close()
    return CommittedRecord(url, entries)


@dataclass
class _TierView:
    """One pass over a tier: the advertised steps, each one's manifest digest and verification problems
    (computed once, whichever checks ask)."""

    url: str
    steps: list[int]
    digests: dict[int, str]
    problems: dict[int, list[str]]


def _view(url: str, options: dict[str, Any] | None, only: Iterable[int] | None = None) -> _TierView:
    steps = advertised_steps(url, options)
    if not steps:
        return _TierView(url, [], {}, {})
    wanted = set(steps) if only is None else set(steps) & set(only)
    tier = open_location(url, options)
    try:
        digests = {step: _manifest_digest(tier, step) for step in sorted(wanted)}
        problems = {step: _problems(tier, step) for step in sorted(wanted)}
    finally:
        tier.close()
    return _TierView(url, steps, digests, problems)


def _lost(before: CommittedRecord, view: _TierView, keep_last: int | None) -> Check:
    lost: list[str] = []
    bytes_lost = 0
    for entry in before.steps:
        newer = sum(1 for step in view.steps if step > entry.step)
        if entry.step not in view.steps:
            if keep_last is not None and newer >= keep_last:
                continue
            why = f"step {entry.step} is gone ({newer} newer committed, keep_last={keep_last})"
        elif view.digests[entry.step] != entry.manifest_digest:
            why = f"step {entry.step}: its manifest was rewritten"
        elif view.problems[entry.step]:
            why = f"step {entry.step} no longer verifies: {view.problems[entry.step][0]}"
        else:
            continue
        lost.append(why)
        bytes_lost += entry.total_bytes
    if lost:
        return Check("L2", False, f"{view.url}: " + "; ".join(lost), bytes_lost)
    return Check("L2", True, f"{len(before.steps)} recorded step(s) intact or retired by retention")


def _partial(view: _TierView, allowed: Iterable[int] | None) -> Check:
    if allowed is not None:
        extra = sorted(set(view.steps) - set(allowed))
        if extra:
            return Check("L3", False, f"{view.url} advertises step(s) {extra}, which were never committed "
                                      f"(allowed: {sorted(set(allowed))})")
    problems = [problem for step in view.steps for problem in view.problems.get(step, [])]
    if problems:
        return Check("L3", False, f"{view.url}: advertised step(s) do not verify: " + "; ".join(problems[:5]))
    return Check("L3", True, f"{view.url}: step(s) {view.steps} verify" if view.steps else
                 f"{view.url} advertises no step")


def check_nothing_lost(before: CommittedRecord, location: Location | None = None, *,
                       storage_options: dict[str, Any] | None = None, keep_last: int | None = None) -> Check:
    """L2: every step of ``before`` is still committed on the tier, with the same manifest bytes, and verifies.

    Retention: with ``keep_last`` (the policy's ``keep_local``/``keep_remote``), a recorded step may be gone
    only if at least ``keep_last`` newer steps are committed now (retention keeps the newest ``keep_last``
    and deletes older ones only once newer ones are committed); without it, no step may be gone. Each lost
    step counts its manifest's ``total_bytes`` in ``bytes_lost``.
    """
    url, options = _url_and_options(location if location is not None else before.location, storage_options)
    try:
        return _lost(before, _view(url, options, only=before.numbers), keep_last)
    except Exception as error:  # noqa: BLE001 - reported as a finding
        return _failure("L2", error, f"checking {url}")


# --- L3 ------------------------------------------------------------------------------------------

def check_nothing_partial(location: Location, storage_options: dict[str, Any] | None = None, *,
                          allowed: Iterable[int] | None = None) -> Check:
    """L3: every step the tier advertises as committed verifies completely (every chunk of every rank it
    holds re-hashed, as ``ckptd verify`` does). ``allowed``: the only steps that may be advertised at all
    (e.g. a step whose save was killed before its commit must not be)."""
    url, options = _url_and_options(location, storage_options)
    try:
        return _partial(_view(url, options), allowed)
    except Exception as error:  # noqa: BLE001 - reported as a finding
        return _failure("L3", error, f"verifying {url}")


def check_committed(before: CommittedRecord, location: Location | None = None, *,
                    storage_options: dict[str, Any] | None = None, keep_last: int | None = None,
                    allowed: Iterable[int] | None = None) -> list[Check]:
    """:func:`check_nothing_lost` (L2) and :func:`check_nothing_partial` (L3) from one pass over the tier
    (each step listed, read and verified once: an object tier's round trips make that worth it)."""
    url, options = _url_and_options(location if location is not None else before.location, storage_options)
    try:
        view = _view(url, options)
    except Exception as error:  # noqa: BLE001 - reported as a finding
        return [_failure("L2", error, f"checking {url}"), _failure("L3", error, f"verifying {url}")]
    return [_lost(before, view, keep_last), _partial(view, allowed)]


def leftover_temporaries(root: str | os.PathLike[str]) -> list[str]:
    """Temporary files (``.tmp-`` names of files not yet renamed into place) under a local root's step
    directories, relative to the root."""
    from ckptd.format.layout import TEMP_MARKER, parse_step_dir

    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for directory in sorted(base.iterdir()):
        if directory.is_dir() and parse_step_dir(directory.name) is not None:
            found += [f"{directory.name}/{name}" for name in sorted(os.listdir(directory)) if TEMP_MARKER in name]
    return found


def check_no_temporaries(root: str | os.PathLike[str]) -> Check:
    """L3 (local tier, after the next start): the temporary files a crash left are gone."""
    left = leftover_temporaries(root)
    if left:
        return Check("L3", False, f"temporary files left in {root} after the restart: {left[:5]}")
    return Check("L3", True, "no temporary files left")


# --- L4 ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TreeEntry:
    """One entry of a directory tree: kind (file, dir, link, other), size, mtime (ns), mode bits."""

    kind: str
    size: int
    mtime_ns: int
    mode: int


@dataclass(frozen=True)
class TreeSnapshot:
    """Every entry under a directory (paths relative to it), without following symbolic links."""

    root: str
    entries: Mapping[str, TreeEntry]


def _entry(info: os.stat_result) -> TreeEntry:
    kind = "link" if stat.S_ISLNK(info.st_mode) else "dir" if stat.S_ISDIR(info.st_mode) else \
        "file" if stat.S_ISREG(info.st_mode) else "other"
    return TreeEntry(kind, info.st_size if kind == "file" else 0, info.st_mtime_ns, stat.S_IMODE(info.st_mode))


def snapshot_tree(root: str | os.PathLike[str]) -> TreeSnapshot:
    """Names, kinds, sizes, mtimes and modes of everything under ``root`` (an absent root: empty)."""
    base = Path(root)
    entries: dict[str, TreeEntry] = {}
    if base.exists():
        for directory, names, files in os.walk(base, followlinks=False):
            for name in names + files:
                path = Path(directory) / name
                entries[str(path.relative_to(base))] = _entry(path.lstat())
    return TreeSnapshot(str(base), entries)


def check_untouched(before: TreeSnapshot, after: TreeSnapshot | None = None) -> Check:
    """L4: nothing under ``before.root`` was added, removed or changed (``after`` defaults to a new snapshot)."""
    after = after if after is not None else snapshot_tree(before.root)
    added = sorted(set(after.entries) - set(before.entries))
    removed = sorted(set(before.entries) - set(after.entries))
    changed = sorted(path for path in set(before.entries) & set(after.entries)
                     if before.entries[path] != after.entries[path]
                     and not (before.entries[path].kind == "dir" and after.entries[path].kind == "dir"
                              and before.entries[path].mode == after.entries[path].mode))
    if added or removed or changed:
        parts = [f"{what}: {paths[:5]}" for what, paths in (("added", added), ("removed", removed),
                                                            ("changed", changed)) if paths]
        return Check("L4", False, f"outside the root, {before.root} was touched: " + "; ".join(parts))
    return Check("L4", True, f"{len(before.entries)} entries outside the root untouched")


def plant_canary(directory: str | os.PathLike[str], name: str = "canary.txt") -> Path:
    """A file outside a checkpoint root whose bytes a scenario checks afterwards (:func:`check_canary`)."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_canary_bytes(path))
    return path


def _canary_bytes(path: Path) -> bytes:
    return f"ckptd canary {path.name}: must stay exactly these bytes\n".encode()


def check_canary(path: str | os.PathLike[str]) -> Check:
    """L4: a canary planted with :func:`plant_canary` still holds exactly its bytes."""
    path = Path(path)
    try:
        same = path.read_bytes() == _canary_bytes(path)
    except OSError as error:
        return Check("L4", False, f"canary {path} is gone or unreadable: {error}")
    return Check("L4", True, "canary intact") if same else Check("L4", False, f"canary {path} was rewritten")


def check_absent(path: str | os.PathLike[str], why: str = "a payload would create it") -> Check:
    """L4: a sentinel file that only a payload that ran would create does not exist."""
    if os.path.lexists(path):
        return Check("L4", False, f"sentinel {path} exists ({why}): code ran")
    return Check("L4", True, "sentinel absent")


# --- L5 ------------------------------------------------------------------------------------------

def state_digest(state: Any) -> str:
    """An xxh3-128 digest of a state: its structure, key names, dtypes, shapes and raw tensor/array bytes
    (floats by bit pattern), so two states have one digest exactly when they are bit-identical."""
    import numpy as np
    import torch

    from ckptd.testing.compare import tensor_bytes

    hasher = xxhash.xxh3_128()

    def feed(value: Any) -> None:
        if hasattr(value, "state_dict") and callable(value.state_dict) and not isinstance(value, Mapping):
            hasher.update(b"S")
            feed(value.state_dict())
        elif isinstance(value, torch.Tensor):
            hasher.update(f"T{value.dtype}{list(value.shape)}".encode())
            hasher.update(tensor_bytes(value).numpy().tobytes())
        elif isinstance(value, np.ndarray):
            hasher.update(f"A{value.dtype}{list(value.shape)}".encode())
            hasher.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, Mapping):
            hasher.update(f"M{len(value)}".encode())
            for key, child in value.items():
                hasher.update(repr(key).encode())
                feed(child)
        elif isinstance(value, (list, tuple)):
            hasher.update(f"{type(value).__name__[0]}{len(value)}".encode())
            for child in value:
                feed(child)
        elif isinstance(value, float):
            hasher.update(b"F" + np.float64(value).tobytes())
        else:
            hasher.update(f"V{type(value).__name__}:{value!r}".encode())

    feed(state)
    return hasher.hexdigest()


def check_same_run(golden_ids: Iterable[Any], resumed_ids: Iterable[Any], golden_digest: str | None = None,
                   resumed_digest: str | None = None) -> Check:
    """L5: a resumed run saw the golden run's sample ids in the same order and ends on the same state hash."""
    golden, resumed = list(golden_ids), list(resumed_ids)
    if golden != resumed:
        first = next((i for i, (a, b) in enumerate(zip(golden, resumed)) if a != b), min(len(golden), len(resumed)))
        return Check("L5", False, f"sample ids differ from position {first} (golden {len(golden)} ids, resumed "
                                  f"{len(resumed)}): golden {golden[first:first + 3]!r}, "
                                  f"resumed {resumed[first:first + 3]!r}")
    if golden_digest != resumed_digest:
        return Check("L5", False, f"state hash {resumed_digest} != golden {golden_digest}")
    return Check("L5", True, f"{len(golden)} sample ids and the state hash equal the golden run's")
