"""The states a power loss can leave after a recorded sequence of file-system operations (row 4).

The model is ALICE's (Pillai et al., OSDI 2014) with CrashMonkey's sector-sized tears, for a POSIX file
system that promises no more than POSIX: after a crash, the tree on disk is the tree of the last
barriers plus any subset of the later operations the rules below allow.

- A crash happens after any operation (crash point ``k``: the first ``k`` operations were issued, none
  after). Crash point 0 is the starting :class:`~harness.fs_recorder.Snapshot`, which is taken as
  durable.
- ``fsync`` (or ``fdatasync``) of a file makes that file's bytes and size durable as of that call, not
  its name. Each data operation on a file after its last fsync (before ``k``) independently either
  happened (``keep``), did not (``drop``), left zeros (``zero``: a write that extended the file extended
  it, but its bytes never reached the disk), or was torn at a 4 KiB sector boundary (``torn@B``: the
  bytes before absolute offset ``B`` landed, the file ends there if the write extended it). A truncation
  after the last fsync happened or did not.
- ``fsync`` of a directory makes that directory's entries durable as of that call. The entry operations
  of a directory (``create`` of a file, ``mkdir``, ``rmdir``, ``rename``, ``link``, ``unlink``) after its
  last fsync persisted as a prefix, in the order they were issued: any number of them, from none to all
  (a later entry change never persists without the earlier ones of the same directory; directories are
  independent of each other). A rename or link belongs to its destination's directory (ckptd renames
  within one directory only; a cross-directory rename is modelled as atomic).
- A name is reachable only if every directory above it is: a directory whose ``mkdir`` did not persist
  takes everything under it away, however durable its own entries are.

:class:`CrashModel` counts, enumerates and samples these states. Per crash point the number of states is
the product of (pending entry operations + 1) per directory and the fates per pending data operation
(keep, drop, zero and one tear for a write; keep and drop for a truncation): exponential, so
:meth:`CrashModel.states` yields all of them up to a cap and otherwise the two extremes (everything
pending dropped, everything kept) plus seeded random samples, without repeats. A torn write's boundary
is drawn by the caller's generator. :meth:`CrashModel.materialise` builds a state as a
:class:`TreeState` in memory; :meth:`TreeState.write_to` writes it into a scratch directory, and
:meth:`TreeState.digest` lets a caller check each distinct tree once. :func:`replay_everything` replays
the whole trace with nothing lost: it must equal the real directory the recording left (the recorder's
self-check).
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from harness.fs_recorder import DATA_OPS, DIRECTORY_OPS, FsOp, Snapshot, Trace

#: Granularity of a torn write (a disk sector or page).
SECTOR = 4096


@dataclass(frozen=True)
class CrashState:
    """One crash state: the crash point, which pending entry operations persisted per directory (how many,
    as a prefix; in a model with ``ordered_entries=False`` a bit mask over them), and the fate of each
    pending data operation (by operation index)."""

    crash_point: int
    directory_kept: tuple[tuple[str, int], ...] = ()
    fates: tuple[tuple[int, str], ...] = ()

    def describe(self, trace: Trace, *, ordered_entries: bool = True) -> str:
        """Which operations were pending at the crash and what became of each (for failure reports)."""
        model = CrashModel(trace, ordered_entries=ordered_entries)
        pending = model.pending(self.crash_point)
        lines = [f"crash after op #{self.crash_point - 1}" if self.crash_point else "crash before any op"]
        kept = dict(self.directory_kept)
        for directory, indexes in pending.directory_ops.items():
            persisted = set(model.kept_entries(indexes, kept.get(directory, 0)))
            for index in indexes:
                lines.append(f"  {'kept   ' if index in persisted else 'dropped'} {trace.ops[index].describe()}")
        for index, fate in self.fates:
            lines.append(f"  {fate:<7} {trace.ops[index].describe()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Pending:
    """What is not yet durable at one crash point."""

    directory_ops: dict[str, list[int]]
    data_ops: list[int]
    #: Entry operations of each directory that are durable (issued before its last fsync).
    durable_directory_ops: frozenset[int]
    #: Per file id, the index of its last fsync before the crash point (-1: none).
    last_file_sync: dict[int, int]


@dataclass
class TreeState:
    """A materialised state: directories, names -> file ids, and file contents (all relative paths)."""

    directories: set[str]
    files: dict[str, int]
    contents: dict[int, bytes]

    def digest(self) -> str:
        """A digest of the whole tree (names, links and bytes), to skip trees already checked."""
        hasher = xxhash.xxh3_128()
        for directory in sorted(self.directories):
            hasher.update(f"d {directory}\n".encode())
        for name, file_id in sorted(self.files.items()):
            first = min(n for n, i in self.files.items() if i == file_id)
            hasher.update(f"f {name} {first} {xxhash.xxh3_128_hexdigest(self.contents[file_id])}\n".encode())
        return hasher.hexdigest()

    def write_to(self, target: Path) -> None:
        """Create the tree under ``target`` (an empty or absent directory); names that share a file id
        become hard links."""
        target.mkdir(parents=True, exist_ok=True)
        for directory in sorted(self.directories, key=lambda d: d.count("/")):
            if directory:
                (target / directory).mkdir(exist_ok=True)
        written: dict[int, Path] = {}
        for name, file_id in sorted(self.files.items()):
            path = target / name
            if file_id in written:
                os.link(written[file_id], path)
                continue
            path.write_bytes(self.contents[file_id])
            written[file_id] = path


class CrashModel:
    """Crash states of one :class:`~harness.fs_recorder.Trace` (see the module docstring).

    With ``ordered_entries=False`` the pending entry operations of a directory persist as any subset,
    not only a prefix (POSIX promises no order; journaling file systems keep it): a save that relied on
    that order without a directory fsync in between would show up there."""

    def __init__(self, trace: Trace, *, ordered_entries: bool = True) -> None:
        self.trace = trace
        self.ops = trace.ops
        self.ordered_entries = ordered_entries

    def _entry_choices(self, pending_ops: int) -> int:
        """How many ways the pending entry operations of one directory can persist."""
        return pending_ops + 1 if self.ordered_entries else 2 ** pending_ops

    def kept_entries(self, indexes: list[int], choice: int) -> list[int]:
        """The pending entry operations (``indexes``, in order) that persisted under ``choice``."""
        if self.ordered_entries:
            return indexes[:choice]
        return [index for bit, index in enumerate(indexes) if choice >> bit & 1]

    @property
    def crash_points(self) -> range:
        return range(len(self.ops) + 1)

    def pending(self, crash_point: int) -> Pending:
        issued = self.ops[:crash_point]
        last_dir_sync: dict[str, int] = {}
        last_file_sync: dict[int, int] = {}
        for op in issued:
            if op.kind == "dirsync":
                last_dir_sync[op.path] = op.index
            elif op.kind == "fsync":
                last_file_sync[op.file_id] = op.index
        directory_ops: dict[str, list[int]] = {}
        durable: set[int] = set()
        data_ops: list[int] = []
        for op in issued:
            if op.kind in DIRECTORY_OPS:
                if op.index < last_dir_sync.get(op.directory, -1):
                    durable.add(op.index)
                else:
                    directory_ops.setdefault(op.directory, []).append(op.index)
            elif op.kind in DATA_OPS and op.index > last_file_sync.get(op.file_id, -1):
                data_ops.append(op.index)
        return Pending(directory_ops, data_ops, frozenset(durable), last_file_sync)

    @staticmethod
    def _fate_kinds(op: FsOp) -> list[str]:
        if op.kind == "truncate":
            return ["keep", "drop"]
        kinds = ["keep", "drop", "zero"]
        if _tear_points(op):
            kinds.append("torn")
        return kinds

    def count(self, crash_point: int) -> int:
        """The number of crash states at ``crash_point``."""
        pending = self.pending(crash_point)
        directories = math.prod(self._entry_choices(len(ops)) for ops in pending.directory_ops.values())
        return directories * math.prod(len(self._fate_kinds(self.ops[i])) for i in pending.data_ops)

    def total(self) -> int:
        """The number of crash states over every crash point."""
        return sum(self.count(k) for k in self.crash_points)

    def states(self, crash_point: int, rng: random.Random, cap: int) -> Iterator[CrashState]:
        """Every state at ``crash_point`` when there are at most ``cap``; otherwise ``cap`` distinct ones:
        everything pending dropped, everything kept, then random draws."""
        pending = self.pending(crash_point)
        directories = sorted(pending.directory_ops)
        dir_choices = [range(self._entry_choices(len(pending.directory_ops[d]))) for d in directories]
        fate_choices = [self._fate_kinds(self.ops[i]) for i in pending.data_ops]

        def build(kept: tuple[int, ...], kinds: tuple[str, ...]) -> CrashState:
            fates = tuple((i, self._resolve(self.ops[i], kind, rng)) for i, kind in zip(pending.data_ops, kinds))
            return CrashState(crash_point, tuple(zip(directories, kept)), fates)

        if self.count(crash_point) <= cap:
            for kept in itertools.product(*dir_choices):
                for kinds in itertools.product(*fate_choices):
                    yield build(kept, kinds)
            return
        seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
        extremes = [(tuple(0 for _ in dir_choices), tuple("drop" for _ in fate_choices)),
                    (tuple(len(c) - 1 for c in dir_choices), tuple("keep" for _ in fate_choices))]
        attempts = 0
        while len(seen) < cap and attempts < 20 * cap:
            attempts += 1
            if extremes:
                kept, kinds = extremes.pop(0)
            else:
                kept = tuple(rng.choice(c) for c in dir_choices)
                kinds = tuple(rng.choice(c) for c in fate_choices)
            if (kept, kinds) in seen:
                continue
            seen.add((kept, kinds))
            yield build(kept, kinds)

    def random_state(self, rng: random.Random, crash_point: int | None = None) -> CrashState:
        """One state drawn at random (crash point too, unless given)."""
        point = rng.choice(self.crash_points) if crash_point is None else crash_point
        pending = self.pending(point)
        directories = sorted(pending.directory_ops)
        kept = tuple(rng.randrange(self._entry_choices(len(pending.directory_ops[d]))) for d in directories)
        fates = tuple((i, self._resolve(self.ops[i], rng.choice(self._fate_kinds(self.ops[i])), rng))
                      for i in pending.data_ops)
        return CrashState(point, tuple(zip(directories, kept)), fates)

    @staticmethod
    def _resolve(op: FsOp, kind: str, rng: random.Random) -> str:
        if kind != "torn":
            return kind
        return f"torn@{rng.choice(_tear_points(op))}"

    def materialise(self, state: CrashState) -> TreeState:
        """The tree the crash ``state`` leaves."""
        pending = self.pending(state.crash_point)
        persisted = set(pending.durable_directory_ops)
        for directory, choice in state.directory_kept:
            persisted.update(self.kept_entries(pending.directory_ops.get(directory, []), choice))
        fates = dict(state.fates)
        snapshot: Snapshot = self.trace.snapshot
        directories, names = set(snapshot.directories), dict(snapshot.files)
        for op in self.ops[:state.crash_point]:
            if op.kind in DIRECTORY_OPS and op.index in persisted:
                _apply_entry_op(op, directories, names)
        contents: dict[int, bytes] = {}
        for file_id in set(names.values()):
            contents[file_id] = self._contents(file_id, state.crash_point, pending, fates)
        reachable = {d for d in directories if _ancestors_exist(d, directories)}
        files = {name: i for name, i in names.items() if _parent(name) in reachable
                 and _ancestors_exist(_parent(name), directories)}
        return TreeState(reachable, files, {i: contents[i] for i in set(files.values())})

    def _contents(self, file_id: int, crash_point: int, pending: Pending, fates: dict[int, str]) -> bytes:
        data = bytearray(self.trace.snapshot.contents.get(file_id, b""))
        synced_until = pending.last_file_sync.get(file_id, -1)
        for op in self.ops[:crash_point]:
            if op.file_id != file_id or op.kind not in DATA_OPS:
                continue
            fate = "keep" if op.index < synced_until else fates.get(op.index, "keep")
            _apply_data_op(op, fate, data)
        return bytes(data)


def _tear_points(op: FsOp) -> list[int]:
    """Absolute sector boundaries strictly inside a write."""
    first = (op.offset // SECTOR + 1) * SECTOR
    return list(range(first, op.offset + op.length, SECTOR))


def _apply_data_op(op: FsOp, fate: str, data: bytearray) -> None:
    if fate == "drop":
        return
    if op.kind == "truncate":
        if op.length < len(data):
            del data[op.length:]
        else:
            data.extend(bytes(op.length - len(data)))
        return
    payload = op.data or b""
    end = op.offset + len(payload)
    if fate == "zero":
        if end > len(data):
            data.extend(bytes(end - len(data)))
        return
    if fate.startswith("torn@"):
        end = int(fate[5:])
        payload = payload[:end - op.offset]
    if op.offset > len(data):
        data.extend(bytes(op.offset - len(data)))
    data[op.offset:op.offset + len(payload)] = payload


def _apply_entry_op(op: FsOp, directories: set[str], names: dict[str, int]) -> None:
    if op.kind == "create":
        names[op.path] = op.file_id
    elif op.kind == "mkdir":
        directories.add(op.path)
    elif op.kind == "rmdir":
        directories.discard(op.path)
    elif op.kind == "unlink":
        names.pop(op.path, None)
    elif op.kind in ("rename", "link"):
        if op.path in names:
            names[op.target] = names[op.path]
            if op.kind == "rename":
                del names[op.path]
        elif op.path in directories and op.kind == "rename":
            prefix = op.path + "/"
            for directory in [d for d in directories if d == op.path or d.startswith(prefix)]:
                directories.discard(directory)
                directories.add(op.target + directory[len(op.path):])
            for name in [n for n in names if n.startswith(prefix)]:
                names[op.target + name[len(op.path):]] = names.pop(name)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _ancestors_exist(directory: str, directories: set[str]) -> bool:
    while directory:
        if directory not in directories:
            return False
        directory = _parent(directory)
    return True


def tree_of(root: Path) -> TreeState:
    """The tree under a real directory, in the form :meth:`CrashModel.materialise` returns."""
    snapshot = Snapshot.take(root)
    return TreeState(snapshot.directories, snapshot.files, snapshot.contents)


def replay_everything(trace: Trace) -> TreeState:
    """The state with every operation persisted (the last crash point, nothing pending lost)."""
    model = CrashModel(trace)
    point = len(trace.ops)
    pending = model.pending(point)
    return model.materialise(CrashState(point, tuple((d, len(ops)) for d, ops in pending.directory_ops.items()),
                                        tuple((i, "keep") for i in pending.data_ops)))


def tree_differences(actual: TreeState, expected: TreeState) -> list[str]:
    """How two trees differ (names, directories, bytes), one line each."""
    problems = [f"directory {d!r} only in the replay" for d in sorted(actual.directories - expected.directories)]
    problems += [f"directory {d!r} missing from the replay" for d in sorted(expected.directories - actual.directories)]
    for name in sorted(set(actual.files) | set(expected.files)):
        if name not in expected.files:
            problems.append(f"file {name!r} only in the replay")
        elif name not in actual.files:
            problems.append(f"file {name!r} missing from the replay")
        elif actual.contents[actual.files[name]] != expected.contents[expected.files[name]]:
            problems.append(f"file {name!r} differs: {len(actual.contents[actual.files[name]])} bytes replayed, "
                            f"{len(expected.contents[expected.files[name]])} on disk")
    return problems

