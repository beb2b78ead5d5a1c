"""Exporting one committed step as a Hugging Face safetensors layout for inference.

:func:`plan_export` reads the manifest and every rank's index of a step from the nearest tier
that holds it (a checkpoint of any world size, written by a CheckpointManager or by ``dcp.save``),
picks the tensors under a key prefix (:mod:`ckptd.export.selection`), checks everything that can be
checked from the metadata (sharded tensors need ``consolidate``; pieces tile their tensor; every dtype
fits safetensors) and plans the output files by size (:mod:`ckptd.export.hf_layout`);
:func:`write_export` then writes them tensor by tensor: each tensor is read whole and verified chunk by chunk
(:mod:`ckptd.export.assembly`), cast when asked, and written, while the next one is read: memory holds
the tensor being written (and its cast copy) and the next one, in buffers reused from tensor to tensor.

The output appears at once: everything is written into a hidden temporary directory beside ``out``,
fsynced, and renamed to ``out`` (which must not exist, or be an empty directory other than the current
one: the rename replaces it). A failure removes the temporary directory; a process killed mid-export
leaves it behind under a ``.<out>.tmp-<12 hex digits>`` name, which the next export to ``out`` removes.
An export holds an exclusive ``flock`` on its temporary directory while it writes, so only directories
no live process holds are removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.errors import ConfigError, StorageError
from ckptd.export.assembly import TensorFeed, check_pieces
from ckptd.export.hf_layout import DEFAULT_MAX_SHARD_SIZE, INDEX_FILE_NAME, ShardFile, index_bytes, \
    parse_shard_size, plan_shards
from ckptd.export.safetensors_file import TensorSlot, safetensors_dtype, write_safetensors
from ckptd.export.selection import SavedTensor, select, step_contents
from ckptd.format.layout import TEMP_MARKER
from ckptd.stepio.step_reader import StepReader
from ckptd.tiers import open_tier
from ckptd.tiers.base import StorageTier
from ckptd.tiers.direct_io import aligned_empty
from ckptd.tiers.local import fsync_directory, write_file_atomically

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: ``--dtype`` names and the torch dtype each stands for.
DTYPE_CHOICES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "fp32": "float32", "float32": "float32"}
CONFIG_FILE_NAME = "config.json"


@dataclass(frozen=True)
class ExportOptions:
    """How to export. ``dtype``: cast floating tensors to it (``bf16``, ``fp16``, ``fp32``; float8
    tensors, which hold quantized values with separate scales, are never cast). ``key_prefix``: export
    the sub-tree under it with the prefix stripped (``model.`` picks a model out of a training state).
    ``exclude``: sub-trees to leave out (full keys, such as ``optimizer`` and ``train_state`` of a
    torchtitan-style state whose model keys sit at the top level).
    ``consolidate``: assemble tensors stored in pieces over several ranks (without it they are refused).
    ``config_file``: a ``config.json`` to copy in, so that ``from_pretrained`` can load the directory."""

    consolidate: bool = False
    dtype: str | None = None
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    key_prefix: str | None = None
    exclude: tuple[str, ...] = ()
    config_file: Path | None = None


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: the files (names inside ``out``), tensor count and bytes, and how long it took."""

    step: int
    out: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "out": self.out, "files": list(self.files), "tensors": self.tensors,
                "total_size": self.total_size, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class ExportPlan:
    """An export worked out from the step's metadata, before any tensor is read: the output files and
    the tensors each holds, and the readers of every saved rank (chunks are verified as they are read)."""

    step: int
    out: Path
    shards: tuple[ShardFile, ...]
    tensors: dict[str, SavedTensor]
    readers: tuple[StepReader, ...]
    config: bytes | None = None
    max_shard_bytes: int = parse_shard_size(DEFAULT_MAX_SHARD_SIZE)

    @property
    def total_size(self) -> int:
        """Bytes of all exported tensors (as written, after any cast)."""
        return sum(shard.nbytes for shard in self.shards)

    @property
    def files(self) -> tuple[str, ...]:
        """Names of the files the export writes into ``out``."""
        return tuple(shard.name for shard in self.shards) + ((INDEX_FILE_NAME,) if len(self.shards) > 1 else ()) \
            + ((CONFIG_FILE_NAME,) if self.config is not None else ())


def plan_export(tiers: list[StorageTier], step: int, out: str | os.PathLike[str],
                options: ExportOptions = ExportOptions()) -> ExportPlan:
    """Read the manifest and indexes of ``step`` from ``tiers`` (nearest first) and plan its export into
    the directory ``out``. Everything that can be refused from the metadata is refused here: NotFoundError
    for a step no tier holds or an empty selection, ConfigError for a selection that holds non-tensor
    values, a sharded tensor without ``consolidate``, a dtype safetensors cannot hold, an ``out`` that
    exists and is not empty."""
    from ckptd.dcp.reader import open_step

    target = Path(os.path.abspath(out))  # "." names its directory: the temporary sits beside it
    _check_target(target)
    max_bytes = parse_shard_size(options.max_shard_size)
    cast = _dtype(options.dtype)
    config = _read_config(options.config_file)
    manifest, readers = open_step(tiers, step)
    tensors = select(step_contents([reader.index for reader in readers]), options.key_prefix,
                     tuple(options.exclude))
    slots: list[TensorSlot] = []
    for tensor in tensors:
        check_pieces(tensor, step=step, consolidate=options.consolidate)
        dtype = _output_dtype(tensor.dtype, cast)
        safetensors_dtype(dtype, key=tensor.key, step=manifest.step)
        slots.append(TensorSlot(tensor.key, dtype, tensor.shape))
    return ExportPlan(step=manifest.step, out=target, shards=tuple(plan_shards(slots, max_bytes)),
                      tensors={tensor.key: tensor for tensor in tensors}, readers=tuple(readers), config=config,
                      max_shard_bytes=max_bytes)


def write_export(plan: ExportPlan, *, progress: Callable[[int], None] | None = None) -> ExportReport:
    """Write a planned export: tensor by tensor into a temporary directory, then renamed to ``plan.out``.
    ``progress`` is called with the bytes of each tensor written. Raises IntegrityError for a chunk that
    fails its digest on every tier; nothing appears at ``out`` unless the whole export succeeded."""
    started = time.monotonic()
    _check_target(plan.out)
    remove_stale_temporaries(plan.out)
    staging = plan.out.with_name(f".{plan.out.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}")
    staging.mkdir(parents=True)
    held = _hold(staging)
    try:
        _write_layout(staging, plan, progress)
        _publish(staging, plan.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(held)
    return ExportReport(step=plan.step, out=str(plan.out), files=plan.files,
                        tensors=sum(len(shard.slots) for shard in plan.shards), total_size=plan.total_size,
                        seconds=time.monotonic() - started)


def export_safetensors(tiers: str | list[StorageTier], step: int, out: str | os.PathLike[str],
                       options: ExportOptions = ExportOptions(), *,
                       progress: Callable[[int], None] | None = None) -> ExportReport:
    """Export ``step`` from ``tiers`` (a root URL, or tiers nearest first) into the directory ``out``:
    :func:`plan_export`, then :func:`write_export` (their errors)."""
    opened = [open_tier(tiers)] if isinstance(tiers, str) else []
    try:
        plan = plan_export(opened or list(tiers), step, out, options)
        return write_export(plan, progress=progress)
    finally:
        for tier in opened:
            tier.close()


def _write_layout(directory: Path, plan: ExportPlan, progress: Callable[[int], None] | None) -> None:
    metadata = {"format": "pt", "ckptd_step": str(plan.step)}
    order = [slot for shard in plan.shards for slot in shard.slots]
    position = {slot.key: number for number, slot in enumerate(order)}
    feed = TensorFeed([plan.tensors[slot.key] for slot in order], list(plan.readers),
                      prefetch_limit=plan.max_shard_bytes)
    cast_buffer: list[torch.Tensor] = []

    def produce(slot: TensorSlot) -> torch.Tensor:
        whole = feed.take(position[slot.key])
        if whole.dtype == slot.dtype:
            return whole
        return _cast(whole, slot, cast_buffer)

    try:
        for shard in plan.shards:
            write_safetensors(directory / shard.name, list(shard.slots), produce, metadata, sync_directory=False,
                              progress=progress)
    finally:
        feed.close()
    extra = [] if len(plan.shards) == 1 else [(INDEX_FILE_NAME, index_bytes(plan.shards))]
    if plan.config is not None:
        extra.append((CONFIG_FILE_NAME, plan.config))
    for name, data in extra:
        write_file_atomically(directory / name, data, sync_directory=False)
    fsync_directory(directory)


def _cast(tensor: torch.Tensor, slot: TensorSlot, reused: list[torch.Tensor]) -> torch.Tensor:
    """``tensor`` cast to the slot's dtype, in a buffer reused from one tensor to the next (grown as needed)."""
    import torch

    if not reused or reused[0].numel() < slot.nbytes:
        reused[:] = []
        reused.append(aligned_empty((slot.nbytes,), torch.uint8))
    out = reused[0][:slot.nbytes].view(slot.dtype).view(slot.shape)
    out.copy_(tensor)
    return out


def _check_target(target: Path) -> None:
    if target.is_symlink() or (target.exists() and (not target.is_dir() or any(target.iterdir()))):
        raise ConfigError("the export directory exists and is not empty", path=str(target),
                          hint="choose a new --out directory (an export never writes into an existing one)")
    if target.exists() and _is_current_directory(target):
        raise ConfigError("the export directory is the current directory, which the finished export would "
                          "replace", path=str(target),
                          hint="name a new directory, such as --out ./model, or run the export from the "
                               "directory above")


def _is_current_directory(target: Path) -> bool:
    try:
        return os.path.samefile(target, os.getcwd())
    except OSError:  # no current directory (removed under the process)
        return False


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary directories that killed exports to ``target`` left beside it
    (``.<name>.tmp-<12 hex digits>``); one that a running export holds (its ``flock``) is kept.
    Returns the directories removed."""
    pattern = re.compile(re.escape(f".{target.name}{TEMP_MARKER}") + r"[0-9a-f]{12}")
    removed: list[Path] = []
    try:
        names = os.listdir(target.parent)
    except OSError:  # no parent yet (the export creates it), or one the export cannot write either
        return removed
    for name in names:
        candidate = target.parent / name
        if not pattern.fullmatch(name) or candidate.is_symlink() or not candidate.is_dir():
            continue
        try:
            held = _hold(candidate)
        except BlockingIOError:
            continue  # a live export is writing it
        except OSError:
            continue  # vanished, or not ours to open
        try:
            shutil.rmtree(candidate)
        except OSError as exc:
            log.warning("could not remove the stale export directory %s: %s", candidate, exc)
        else:
            removed.append(candidate)
            log.warning("removed %s, left by an export that did not finish", candidate)
        finally:
            os.close(held)
    return removed


def _hold(directory: Path) -> int:
    """An open descriptor of ``directory`` holding an exclusive ``flock`` on it (BlockingIOError when
    another process holds it); the lock ends when the descriptor is closed or the process dies."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished directory to ``target`` (replacing an empty directory) and fsync its parent."""
    try:
        os.rename(staging, target)
    except OSError as exc:
        raise StorageError(f"could not move the finished export into place: {exc.strerror or exc}",
                           path=str(target), hint="the export directory must not exist or be empty") from exc
    fsync_directory(target.parent)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    import torch

    try:
        return getattr(torch, DTYPE_CHOICES[name.lower()])  # type: ignore[no-any-return]
    except KeyError:
        raise ConfigError(f"unknown --dtype {name!r}", hint=f"use one of {', '.join(DTYPE_CHOICES)}") from None


def _output_dtype(stored: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """``cast`` for floating tensors other than float8 ones, else the stored dtype."""
    if cast is None or not stored.is_floating_point or stored.itemsize == 1:
        return stored
    return cast


def _read_config(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
        parsed = json.loads(data)
    except OSError as exc:
        raise ConfigError(f"cannot read the model config: {exc.strerror or exc}", path=str(path)) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"the model config is not JSON ({exc})", path=str(path),
                          hint="pass the model's config.json (for example from config.save_pretrained)") from exc
    if not isinstance(parsed, dict):
        raise ConfigError("the model config is not a JSON object", path=str(path))
    return data
