"""Fault-matrix rows 31-35: hostile input (L4: a typed error, nothing touched outside the root, no code run).

Every scenario commits steps 1 and 2, forges step 2 (what it forges is drawn from ``ctx.rng``; forged
metadata stays self-consistent through :mod:`ckptd.testing.tamper`, so that a reader must refuse the
forgery itself, not a digest mismatch) and checks that:

- reading the forged step's metadata raises a :class:`~ckptd.errors.CkptdError` (no crash, no untyped
  exception);
- a restore falls back to step 1 bit-exact (L1);
- nothing outside the root was opened or changed (L4; an audit hook records every file the process
  opens during the restore, and a canary directory beside the root is snapshotted before and after);
- a pickle payload never ran (its sentinel file stays absent).

Rows 32 and 35 restore in a child process (forked from the crash injector's forkserver) whose address
space is capped (``RLIMIT_AS``), so an attempt to allocate what a forged size claims fails the run
instead of the machine. Row 34 feeds a hostile tar to the only archive reader ckptd has, the WebDataset
shard reader of the verified data loader (ckptd never extracts archives).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shutil
import sys
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ckptd.config import override
from ckptd.errors import CkptdError
from ckptd.format.hashing import chunk_digest
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness import invariants as inv
from ckptd.testing import tamper
from harness.matrix import Outcome, RunContext, crash_injector, row
from harness.workloads import synthetic_state
from ckptd.tiers.local import LocalTier

STATE_BYTES = 64 * 1024
CHUNK_BYTES = 4096
GOOD, FORGED = 1, 2
WORKLOAD = inv.SyntheticWorkload(STATE_BYTES)
#: Address space a bounded restore may take beyond what the child holds when it starts.
HEADROOM_BYTES = 1024 * 1024 * 1024


# --- shared: two committed steps, the forged step's metadata, a restore -------------------------------

def commit_two_steps(ctx: RunContext, codec: str = "raw", extra: dict[str, Any] | None = None) -> Path:
    """Steps 1 and 2 committed in ``ctx.path('root')`` with 4 KiB chunks (``extra`` added to both states)."""
    root = ctx.path("root")
    with override(chunk_bytes=CHUNK_BYTES):
        with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, codec=codec) as manager:
            for step in (GOOD, FORGED):
                manager.save(step, {**synthetic_state(step, STATE_BYTES), **(extra or {})}, force=True)
    return root


def metadata_error(root: Path, step: int = FORGED) -> tuple[str, str]:
    """(kind, message) of reading ``step``'s manifest and rank indexes: kind ``typed`` (a CkptdError),
    ``untyped`` (any other exception: the finding) or ``accepted`` (nothing raised)."""
    from ckptd.stepio.step_reader import load_rank_index, load_step_manifest

    tier = LocalTier(root)
    try:
        manifest = load_step_manifest(tier, step)
        for entry in manifest.ranks:
            load_rank_index(tier, manifest, entry.rank)
    except CkptdError as error:
        return "typed", f"{type(error).__name__}: {error}"
    except BaseException as error:  # noqa: BLE001 - an untyped error is what the row looks for
        return "untyped", f"{type(error).__name__}: {error}"
    finally:
        tier.close()
    return "accepted", ""


def check_typed(root: Path, what: str, names: str | None = None) -> inv.Check:
    kind, message = metadata_error(root)
    if kind != "typed":
        return inv.Check("L4", False, f"{what}: reading step {FORGED}'s metadata: {kind} {message}")
    if names is not None and names not in message:
        return inv.Check("L4", False, f"{what}: the error does not name {names!r}: {message}")
    return inv.Check("L4", True, message)


def check_falls_back(root: Path, workload: inv.Workload = WORKLOAD) -> inv.Check:
    """L1: a restarted job's restore skips the forged step and loads step 1 bit-exact."""
    found = inv.check_newest_restores(workload, root, expected_step=GOOD)
    return found if found.ok else inv.Check("L1", False, found.detail, lost_bytes(root, workload))


def lost_bytes(root: Path, workload: inv.Workload = WORKLOAD) -> int:
    """The bytes of step 1 (the intact step) when it no longer reads back bit-exact, else 0."""
    return 0 if inv.check_step_restores(workload, root, GOOD).ok else step_bytes(GOOD)


def step_bytes(step: int) -> int:
    state = synthetic_state(step, STATE_BYTES)
    return sum(value.numel() * value.element_size() for value in state.values() if hasattr(value, "numel"))


# --- who opens what: an audit hook (installed once per process, active only inside watched_opens) -------

@dataclass(frozen=True)
class Opened:
    """A path the process opened (as given, made absolute) and whether it opened it for writing."""

    path: str
    writes: bool


_WATCH: list[list[Opened]] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _WATCH or event not in ("open", "os.listdir", "os.scandir") or not args \
            or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    flags = args[2] if event == "open" and len(args) > 2 and isinstance(args[2], int) else 0
    path = os.fsdecode(args[0])
    _WATCH[-1].append(Opened(os.path.abspath(path), bool(flags & _WRITE_FLAGS)))


_HOOKED = False


@contextmanager
def watched_opens() -> Iterator[list[Opened]]:
    """The paths this process opens (files, directory listings) inside the block."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    opened: list[Opened] = []
    _WATCH.append(opened)
    try:
        yield opened
    finally:
        _WATCH.remove(opened)


def _under(path: str, directory: Path) -> bool:
    base = os.path.realpath(directory)
    resolved = os.path.realpath(path)
    return resolved == base or resolved.startswith(base + os.sep)


def check_no_io_outside(opened: list[Opened], root: Path, outside: Path, *,
                        writable: tuple[Path, ...] = ()) -> inv.Check:
    """L4: nothing under ``outside`` was opened, directly or through a link inside the root, and nothing
    was opened for writing anywhere but under ``writable``."""
    escaped = sorted({item.path for item in opened if _under(item.path, outside)})
    writes = sorted({item.path for item in opened if item.writes and not any(_under(item.path, place)
                                                                            for place in writable)})
    if escaped or writes:
        return inv.Check("L4", False, f"beside the root {root.name}: opened {escaped[:4]}, written {writes[:4]}")
    return inv.Check("L4", True, f"{len(opened)} opens, none outside the root")


# --- row 31: paths that leave the root ---------------------------------------------------------------

def _escape(ctx: RunContext, root: Path, target: Path) -> str:
    """A name for ``target`` (outside the root) as a forged manifest would write it: relative with
    ``../``, or absolute."""
    if ctx.rng.random() < 0.5:
        return str(target)
    return os.path.relpath(target, tamper.step_path(root, FORGED))


def _outside_copies(root: Path, outside: Path) -> dict[str, Path]:
    """Copies of step 2's files outside the root (so a forged path to them is self-consistent)."""
    step = tamper.step_path(root, FORGED)
    copies = {}
    for path in step.iterdir():
        copies[path.name] = outside / f"copy-{path.name}"
        shutil.copyfile(path, copies[path.name])
    shutil.copytree(step, outside / step.name)
    return copies


NAME_FORGERIES = ("manifest-index-path", "data-path")
LINK_FORGERIES = ("symlink-data", "symlink-index", "symlink-step-directory", "symlink-manifest")


def _forge_paths(ctx: RunContext, root: Path, outside: Path, kinds: tuple[str, ...]) -> str:
    """Make step 2 point outside the root (to self-consistent copies of its own files) in one of ``kinds``."""
    copies = _outside_copies(root, outside)
    index_name = tamper.index_path(root, FORGED).name
    data_name = tamper.read_json(tamper.index_path(root, FORGED))["data_files"][0][0]
    step = tamper.step_path(root, FORGED)
    kind = ctx.rng.choice(kinds)
    if kind == "manifest-index-path":
        name = _escape(ctx, root, copies[index_name])
        tamper.rewrite_manifest(root, FORGED, lambda body: body["ranks"][0].update(index_file=name))
    elif kind == "data-path":
        name = _escape(ctx, root, copies[data_name])

        def rename(entries: list[list[Any]]) -> list[list[Any]]:
            return [[name, *entries[0][1:]], *entries[1:]]
        tamper.rewrite_index(root, FORGED, lambda body: body.update(data_files=rename(body["data_files"])))
        tamper.rewrite_manifest(root, FORGED,
                                lambda body: body["ranks"][0].update(data_files=rename(body["ranks"][0]["data_files"])))
    elif kind.startswith("symlink-") and kind != "symlink-step-directory":
        name = {"symlink-data": data_name, "symlink-index": index_name, "symlink-manifest": "manifest.json"}[kind]
        (step / name).unlink()
        (step / name).symlink_to(copies[name] if ctx.rng.random() < 0.5 else os.path.relpath(copies[name], step))
    else:
        shutil.rmtree(step)
        step.symlink_to(outside / step.name, target_is_directory=True)
    return kind


def _paths_leave_the_root(ctx: RunContext, kinds: tuple[str, ...]) -> Outcome:
    root = commit_two_steps(ctx)
    outside = ctx.path("outside")
    canary = inv.plant_canary(outside)
    kind = _forge_paths(ctx, root, outside, kinds)
    before = inv.snapshot_tree(outside)
    ctx.stopwatch.fault()
    with watched_opens() as opened:
        typed = check_typed(root, kind)
        restored = check_falls_back(root)
    recovery = ctx.stopwatch.since_fault() if restored.ok else None
    checks = [typed, restored, check_no_io_outside(opened, root, outside, writable=(root,)),
              inv.check_untouched(before), inv.check_canary(canary)]
    return inv.outcome(checks, recovery_s=recovery, detail=kind)


@row(31, "Manifest with ../, absolute paths or symlinks")
def row31_names_leave_the_root(ctx: RunContext) -> Outcome:
    """A manifest or index naming a file with ``../`` or an absolute path."""
    return _paths_leave_the_root(ctx, NAME_FORGERIES)


@row(31, "Manifest with ../, absolute paths or symlinks")
def row31_symlinks_leave_the_root(ctx: RunContext) -> Outcome:
    """A data file, index, manifest or the whole step directory replaced by a symbolic link to an
    identical copy outside the root (so only the link itself can give it away)."""
    return _paths_leave_the_root(ctx, LINK_FORGERIES)


# --- rows 32 and 35: a restore in a child with a capped address space ---------------------------------

def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def bounded_restore(channel: Any, root: str, headroom: int) -> tuple[int | None, tuple[str, ...], str]:
    """Crash-injector target: restore ``root`` with the address space capped at what the child holds now
    plus ``headroom``. Returns (step, differences from the saved state, error) where error is
    ``typed ...`` for a CkptdError and ``untyped ...`` for anything else (MemoryError included)."""
    import ctypes
    import resource

    from ckptd.testing.compare import state_differences

    try:
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX: reader threads must not each reserve an arena
    except (OSError, AttributeError):
        pass
    limit = _address_space_bytes() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    live = WORKLOAD.template()
    try:
        with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
            step = manager.restore(live)
    except CkptdError as error:
        return None, (), f"typed {type(error).__name__}: {error}"
    except BaseException as error:  # noqa: BLE001 - MemoryError and the like are the finding
        return None, (), f"untyped {type(error).__name__}: {error}"
    return step, tuple(state_differences(live, WORKLOAD.state(step))) if step is not None else (), ""


def started(channel: Any) -> bool:
    """Crash-injector target that does nothing: run before the fault so that the forkserver's start (an
    import of torch, seconds on a busy machine, once per process) is not counted as recovery time."""
    return True


def check_bounded_fallback(root: Path, what: str) -> inv.Check:
    """L1 in a child with a capped address space: the restore loads step 1 bit-exact, nothing blew up."""
    child = crash_injector().run(bounded_restore, str(root), HEADROOM_BYTES)
    if child.error or child.value is None:
        return inv.Check("L1", False, f"{what}: the bounded child died (exit {child.exitcode}): "
                                      f"{(child.error or '')[-600:]}", lost_bytes(root))
    step, differences, error = child.value
    if error or step != GOOD or differences:
        return inv.Check("L1", False, f"{what}: bounded restore gave step {step} {error} {differences[:3]}",
                         lost_bytes(root))
    return inv.Check("L1", True, f"{what}: step {GOOD} restored bit-exact within the address-space cap")


def _chunk_edit(root: Path, position: int, **fields: Any) -> None:
    """Set fields (by name) of the ``position``-th chunk record (in file order) of step 2's index."""
    slots = {"offset": 0, "length": 1, "raw_length": 2, "codec": 3, "digest": 4, "part": 5}
    _, target = tamper.chunk_records(root, FORGED)[position]
    target = list(target)

    def change(body: dict[str, Any]) -> None:
        for tensor in body["tensors"].values():
            for chunk in tensor["chunks"]:
                if chunk == target:
                    for name, value in fields.items():
                        chunk[slots[name]] = value
    tamper.rewrite_index(root, FORGED, change)


def _write_index_bytes(root: Path, raw: bytes) -> None:
    """Replace step 2's index by ``raw`` and record its size and digest in the manifest."""
    tamper.index_path(root, FORGED).write_bytes(raw)

    def record(body: dict[str, Any]) -> None:
        body["ranks"][0]["index_size"], body["ranks"][0]["index_digest"] = len(raw), chunk_digest(raw)
    tamper.rewrite_manifest(root, FORGED, record)


def _forge_extents(ctx: RunContext, root: Path) -> str:
    records = tamper.chunk_records(root, FORGED)
    position = ctx.rng.randrange(len(records))
    huge = 2 ** ctx.rng.choice([40, 48, 62, 63])
    kind = ctx.rng.choice(["huge-length", "huge-raw-length", "negative-offset", "huge-offset", "overlap",
                           "huge-shape", "overflowing-shape", "huge-data-file", "huge-index-size",
                           "nested-index", "many-ranks", "chunk-count"])
    if kind == "huge-length":
        _chunk_edit(root, position, length=huge)
    elif kind == "huge-raw-length":
        _chunk_edit(root, position, raw_length=huge)
    elif kind == "negative-offset":
        _chunk_edit(root, position, offset=-ctx.rng.randint(1, huge))
    elif kind == "huge-offset":
        _chunk_edit(root, position, offset=huge)
    elif kind == "overlap":
        other = records[(position + 1) % len(records)][1]
        _chunk_edit(root, position, offset=int(other[0]) + ctx.rng.randrange(1, int(other[1])), part=other[5])
    elif kind in ("huge-shape", "overflowing-shape"):
        name = records[position][0]
        shape = [huge] if kind == "huge-shape" else [huge, huge, huge]
        tamper.rewrite_index(root, FORGED, lambda body: body["tensors"][name].update(shape=shape))
    elif kind == "huge-data-file":
        def grow(entries: list[list[Any]]) -> list[list[Any]]:
            return [[entries[0][0], huge, *entries[0][2:]], *entries[1:]]
        tamper.rewrite_index(root, FORGED, lambda body: body.update(data_files=grow(body["data_files"])))
        tamper.rewrite_manifest(root, FORGED,
                                lambda body: body["ranks"][0].update(data_files=grow(body["ranks"][0]["data_files"])))
    elif kind == "huge-index-size":
        tamper.rewrite_manifest(root, FORGED, lambda body: body["ranks"][0].update(index_size=huge))
    elif kind == "nested-index":
        depth = ctx.rng.randint(10_000, 200_000)
        body = tamper.read_json(tamper.index_path(root, FORGED))
        text = json.dumps(body, separators=(",", ":"))
        _write_index_bytes(root, (text[:-1] + ',"deep":' + "[" * depth + "]" * depth + "}").encode())
    elif kind == "many-ranks":
        tamper.rewrite_manifest(root, FORGED, lambda body: body.update(world_size=huge))
    else:  # a tensor claiming 2^40 chunks: its shape says so, its list holds one
        name = records[position][0]
        tamper.rewrite_index(root, FORGED, lambda body: body["tensors"][name].update(
            shape=[CHUNK_BYTES * 2 ** 40 // 8]))
    return f"{kind} (chunk {position}, 2^{huge.bit_length() - 1})"


@row(32, "Manifest with huge sizes, negative or overlapping offsets, or 2^40 chunks")
def row32_impossible_extents(ctx: RunContext) -> Outcome:
    root = commit_two_steps(ctx)
    kind = _forge_extents(ctx, root)
    crash_injector().run(started)
    ctx.stopwatch.fault()
    typed = check_typed(root, kind)
    restored = check_bounded_fallback(root, kind)
    recovery = ctx.stopwatch.since_fault() if restored.ok else None
    return inv.outcome([typed, restored], recovery_s=recovery, detail=kind)


# --- row 33: pickle payloads --------------------------------------------------------------------------

class SentinelPayload:
    """Unpickling this creates ``path``: proof that pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def _payload(sentinel: Path) -> bytes:
    return pickle.dumps(SentinelPayload(sentinel))


@dataclass(frozen=True)
class PayloadWorkload:
    """The synthetic state plus ``blob``: a uint8 tensor holding a pickle payload's bytes (plain data)."""

    payload: bytes

    def state(self, step: int, rank: int = 0) -> dict[str, Any]:
        import torch

        blob = torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)
        return {**synthetic_state(step, STATE_BYTES), "blob": blob}

    def template(self, rank: int = 0) -> dict[str, Any]:
        import torch

        return {**WORKLOAD.template(), "blob": torch.zeros(len(self.payload), dtype=torch.uint8)}


def _cli(*args: str) -> tuple[int, str, bool]:
    """Run a ckptd command: (exit code, output, whether it ended in an exception other than a clean exit)."""
    from click.testing import CliRunner

    from ckptd.cli.main import cli

    result = CliRunner().invoke(cli, list(args))
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    return result.exit_code, result.output + (f" {type(result.exception).__name__}: {result.exception}"
                                              if crashed else ""), crashed


def _skeleton_node(body: dict[str, Any], key: str) -> list[Any]:
    values = body["values"]
    skeleton = values["skeleton"] if "skeleton" in values else values
    return next(item for item in skeleton["dict"] if item[0] == key)


def _cli_readers(ctx: RunContext, root: Path) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
    """The CLI's ways of reading a step: inspect, verify, restore --out (torch and safetensors) and
    export. Each returns (ended without an untyped crash, what it said)."""
    out = ctx.path("exports")

    def command(*args: str) -> Callable[[], tuple[bool, str]]:
        def run() -> tuple[bool, str]:
            code, said, crashed = _cli(*args)
            return not crashed, f"exit {code}: {said[-300:]}"
        return run

    return [
            ("cli-inspect", command("inspect", str(root), "--step", str(FORGED))),
            ("cli-verify", command("verify", str(root))),
            ("cli-restore-torch", command("restore", str(root), "--step", str(FORGED), "--out", str(out / "s.pt"))),
            ("cli-restore-safetensors", command("restore", str(root), "--step", str(FORGED), "--out",
                                                str(out / "s.safetensors"))),
            ("cli-export", command("export", str(root), "--step", str(FORGED), "--out", str(out / "hf")))]


def _restore_forged(root: Path, where: str, workload: inv.Workload) -> inv.Check:
    """Restoring the forged step by number: a pickled node is refused (PickleRefusedError), a torch.save
    file in place of ckptd's metadata is a typed error; bytes and unknown fields are only data."""
    from ckptd.errors import PickleRefusedError

    expected: type[CkptdError] | None = PickleRefusedError if where.startswith("skeleton-") else \
        CkptdError if where.startswith("pt-as-") else None
    live = workload.template()
    try:
        with CheckpointManager(root, capture_rng=False, policy=Policy(keep_local=None), daemon="off") as manager:
            step = manager.restore(live, step=FORGED)
    except CkptdError as error:
        ok = expected is None or isinstance(error, expected)
        return inv.Check("L4", ok, f"{where}: restore of step {FORGED}: {type(error).__name__}: {error}")
    except Exception as error:  # noqa: BLE001 - an untyped error is the finding
        return inv.Check("L4", False, f"{where}: restore of step {FORGED}: untyped {type(error).__name__}: {error}")
    return inv.Check("L4", expected is None, f"{where}: restore of step {FORGED} loaded step {step}")


@row(33, "Pickle __reduce__ payload in a manifest field or .pt file")
def row33_pickle_payloads(ctx: RunContext) -> Outcome:
    """A pickle payload where ckptd reads values (a forged skeleton node, a bytes value, an unknown
    manifest field) or a torch.save file where ckptd expects its own files: never unpickled."""
    import torch

    sentinel = ctx.path("canary") / "payload-ran"
    workload = PayloadWorkload(_payload(sentinel))
    payload = workload.payload
    root = commit_two_steps(ctx, extra={"blob": workload.state(GOOD)["blob"]})
    where = ctx.rng.choice(["skeleton-pickle-node", "skeleton-torch-node", "bytes-value", "manifest-field",
                            "pt-as-manifest", "pt-as-index", "pt-given-to-cli"])
    pt_file = ctx.path("inputs") / "model.pt"
    torch.save({"weights": torch.ones(2), "trap": SentinelPayload(sentinel)}, pt_file)
    if where in ("skeleton-pickle-node", "skeleton-torch-node"):
        def forge(body: dict[str, Any]) -> None:
            node = _skeleton_node(body, "blob")
            node[1] = {"pickle": node[1]["tensor"], "torch": where == "skeleton-torch-node"}
        tamper.rewrite_index(root, FORGED, forge)
    elif where == "bytes-value":
        tamper.rewrite_index(root, FORGED, lambda body: _skeleton_node(body, "meta").__setitem__(
            1, {"bytes": base64.b64encode(payload).decode()}))
    elif where == "manifest-field":
        field = ctx.rng.choice(["extra", "payload", "created"])
        tamper.rewrite_manifest(root, FORGED, lambda body: body.update(
            {field: {"pickle": payload.decode("latin-1")} if field == "extra" else payload.decode("latin-1")}))
    elif where == "pt-as-manifest":
        shutil.copyfile(pt_file, tamper.manifest_path(root, FORGED))
    elif where == "pt-as-index":
        _write_index_bytes(root, pt_file.read_bytes())
    checks = []
    ctx.stopwatch.fault()
    if where == "pt-given-to-cli":
        for args in (["inspect", str(pt_file)], ["verify", str(pt_file)], ["ls", str(pt_file)],
                     ["restore", str(pt_file), "--step", "1", "--out", str(ctx.path("exports") / "x.pt")],
                     ["export", str(pt_file), "--step", "1", "--out", str(ctx.path("exports") / "hf")]):
            code, said, crashed = _cli(*args)
            checks.append(inv.Check("L4", code != 0 and not crashed,
                                    f"ckptd {args[0]} model.pt: exit {code} {said[-200:]}"))
    else:
        checks.append(_restore_forged(root, where, workload))
        readers = _cli_readers(ctx, root)
        ctx.rng.shuffle(readers)
        for name, read in readers[:2]:
            clean, said = read()
            checks.append(inv.Check("L4", clean and not sentinel.exists(), f"{where} via {name}: {said[:300]}"))
        if where.startswith("pt-as-"):
            checks.append(check_falls_back(root, workload))
        elif where == "manifest-field":
            checks.append(inv.check_newest_restores(workload, root, allowed_steps=(GOOD, FORGED)))
    checks.append(inv.check_absent(sentinel))
    recovery = ctx.stopwatch.since_fault()
    return inv.outcome(checks, recovery_s=recovery, detail=where)


# --- row 34: archives (WebDataset tar shards) ----------------------------------------------------------

def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"",
            link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, data


def _hostile_members(ctx: RunContext, outside: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    target = str(outside / "canary.txt")
    candidates = [
        _member("../escape.txt", data=b"escaped"),
        _member("../../escape2.txt", data=b"escaped"),
        _member(f"{outside}/absolute.txt", data=b"absolute"),
        _member("/tmp/ckptd-absolute.txt", data=b"absolute"),
        _member("a/../../up.txt", data=b"up"),
        _member("link.txt", tarfile.SYMTYPE, link=target),
        _member("rel-link.txt", tarfile.SYMTYPE, link="../../outside/canary.txt"),
        _member("hard.txt", tarfile.LNKTYPE, link=target),
        _member("dev.null", tarfile.CHRTYPE),
        _member("dev.block", tarfile.BLKTYPE),
        _member("pipe.fifo", tarfile.FIFOTYPE),
        _member("dir", tarfile.DIRTYPE),
    ]
    return ctx.rng.sample(candidates, ctx.rng.randint(1, 4))


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return buffer.getvalue()


def _unsafe(name: str) -> bool:
    return name.startswith("/") or ".." in name.split("/")


@row(34, "Archive import with ../ entries, symlinks or device files")
def row34_hostile_tar_shard(ctx: RunContext) -> Outcome:
    """A WebDataset shard with hostile members among real samples: indexed and read without writing
    anything outside (ckptd never extracts); links, devices and escaping names are filtered or refused
    (a typed error naming the shard), and no sample ever carries an escaping name."""
    from ckptd.data import ShardDataset, ShardLoader, index_dataset

    outside, data_dir = ctx.path("outside"), ctx.path("data")
    canary = inv.plant_canary(outside)
    samples = [_member(f"s{i:03d}.{ext}", data=f"{i}-{ext}".encode()) for i in range(8) for ext in ("txt", "cls")]
    hostile = _hostile_members(ctx, outside)
    members = list(samples)
    for member in hostile:
        members.insert(2 * ctx.rng.randrange(len(samples) // 2 + 1), member)  # between samples, never inside one
    (data_dir / "shard-000.tar").write_bytes(_tar(members))
    watched = [outside, ctx.workdir.parent, Path.cwd(), Path("/tmp")]
    before = {str(place): inv.snapshot_tree(place) if place == outside else set(os.listdir(place))
              for place in watched}
    names = ", ".join(info.name for info, _ in hostile)
    ctx.stopwatch.fault()
    checks = []
    with watched_opens() as opened:
        try:
            manifest = index_dataset(str(data_dir), "webdataset").manifest
            loader = ShardLoader(ShardDataset(manifest, seed=ctx.seed, cache_dir=ctx.path("cache"),
                                              global_batch_size=1, shuffle=False))
            keys = [key for batch in loader for key in batch["__key__"]]
            bad = [key for key in keys if _unsafe(key) or not key.startswith("s")]
            checks.append(inv.Check("L4", not bad and len(keys) == 8,
                                    f"{names}: samples {keys[:10]} (unsafe or extra: {bad[:4]})"))
        except CkptdError as error:
            checks.append(inv.Check("L4", "shard-000.tar" in str(error), f"{names}: refused: {error}"))
        except Exception as error:  # noqa: BLE001 - an untyped error is a finding
            checks.append(inv.Check("L4", False, f"{names}: untyped {type(error).__name__}: {error}"))
    checks.append(check_no_io_outside(opened, data_dir, outside, writable=(ctx.workdir / "cache",)))
    checks.append(inv.check_untouched(before[str(outside)]))
    for place in watched[1:]:
        appeared = sorted(set(os.listdir(place)) - before[str(place)])
        escaped = [name for name in appeared if "escape" in name or "absolute" in name or name == "up.txt"]
        checks.append(inv.Check("L4", not escaped, f"written into {place}: {escaped}"))
    checks.append(inv.check_canary(canary))
    return inv.outcome(checks, recovery_s=ctx.stopwatch.since_fault(), detail=names)


# --- row 35: zstd bombs and corrupt frames -------------------------------------------------------------

@lru_cache(maxsize=4)
def zstd_bomb(inflated: int, declare_size: bool) -> bytes:
    """A zstd frame of ``inflated`` zero bytes (a few KiB), with or without its size in the header."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    out = io.BytesIO()
    block = bytes(1 << 20)
    with compressor.stream_writer(out, size=inflated if declare_size else -1, closefd=False) as writer:
        for _ in range(inflated // len(block)):
            writer.write(block)
    return out.getvalue()


def _bad_frame(ctx: RunContext, stored: bytes, raw_length: int) -> tuple[str, bytes]:
    import zstandard

    kind = ctx.rng.choice(["bomb-declared", "bomb-undeclared", "one-byte-more", "flipped-byte", "truncated",
                           "random-bytes", "empty", "skippable-only", "two-frames"])
    if kind == "bomb-declared":
        return kind, zstd_bomb(2 * HEADROOM_BYTES, True)
    if kind == "bomb-undeclared":
        return kind, zstd_bomb(2 * HEADROOM_BYTES, False)
    if kind == "one-byte-more":
        return kind, zstandard.ZstdCompressor(write_content_size=ctx.rng.random() < 0.5).compress(
            bytes(raw_length + 1))
    if kind == "flipped-byte":
        at = ctx.rng.randrange(len(stored))
        return f"{kind} at {at}", stored[:at] + bytes([stored[at] ^ (1 << ctx.rng.randrange(8))]) + stored[at + 1:]
    if kind == "truncated":
        keep = ctx.rng.randrange(len(stored))
        return f"{kind} to {keep}", stored[:keep]
    if kind == "random-bytes":
        return kind, bytes(ctx.rng.randrange(256) for _ in range(ctx.rng.randint(1, 64)))
    if kind == "empty":
        return kind, b""
    if kind == "skippable-only":
        return kind, b"\x50\x2a\x4d\x18" + (8).to_bytes(4, "little") + bytes(8)
    return kind, stored + stored


def _replace_stored_chunk(root: Path, position: int, stored: bytes) -> None:
    """Append ``stored`` to step 2's data file of chunk ``position`` and point the chunk at it (sizes
    in index and manifest updated, so the step stays self-consistent)."""
    _, record = tamper.chunk_records(root, FORGED)[position]
    part = int(record[5])
    entries = tamper.read_json(tamper.index_path(root, FORGED))["data_files"]
    path = tamper.step_path(root, FORGED) / entries[part][0]
    offset = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(stored)
    size = path.stat().st_size

    def resize(files: list[list[Any]]) -> list[list[Any]]:
        return [[*entry[:1], size, *entry[2:]] if number == part else entry for number, entry in enumerate(files)]

    def change(body: dict[str, Any]) -> None:
        body["data_files"] = resize(body["data_files"])
        for tensor in body["tensors"].values():
            for chunk in tensor["chunks"]:
                if chunk == list(record):
                    chunk[0], chunk[1] = offset, len(stored)
    tamper.rewrite_index(root, FORGED, change)
    tamper.rewrite_manifest(root, FORGED,
                            lambda body: body["ranks"][0].update(data_files=resize(body["ranks"][0]["data_files"])))


@row(35, "zstd bomb or corrupt frame")
def row35_zstd_bomb(ctx: RunContext) -> Outcome:
    from ckptd.format import codecs

    root = commit_two_steps(ctx, codec="zstd")
    records = tamper.chunk_records(root, FORGED)
    position = ctx.rng.randrange(len(records))
    _, record = records[position]
    data_files = tamper.read_json(tamper.index_path(root, FORGED))["data_files"]
    data = tamper.step_path(root, FORGED) / data_files[record[5]][0]
    with open(data, "rb") as handle:
        handle.seek(int(record[0]))
        stored = handle.read(int(record[1]))
    kind, bad = _bad_frame(ctx, stored, int(record[2]))
    _replace_stored_chunk(root, position, bad)
    what = f"{kind} in chunk {position} ({len(bad)} bytes)"
    crash_injector().run(started)
    ctx.stopwatch.fault()
    try:
        inflated = codecs.decode(str(record[3]), bad, int(record[2]))
        decoded = inv.Check("L4", chunk_digest(inflated) != record[4] or bad == stored,
                            f"{what}: decoded to {len(inflated)} bytes")
        harmless = chunk_digest(inflated) == record[4]
    except CkptdError as error:
        decoded, harmless = inv.Check("L4", True, f"{what}: {type(error).__name__}: {error}"), False
    except Exception as error:  # noqa: BLE001 - an untyped error is the finding
        decoded, harmless = inv.Check("L4", False, f"{what}: untyped {type(error).__name__}: {error}"), False
    if harmless:  # a frame that still inflates to the saved bytes (two frames: ckptd reads the first)
        restored = inv.check_newest_restores(WORKLOAD, root, expected_step=FORGED)
    else:
        restored = check_bounded_fallback(root, what)
    recovery = ctx.stopwatch.since_fault() if restored.ok else None
    return inv.outcome([decoded, restored], recovery_s=recovery, detail=what)
