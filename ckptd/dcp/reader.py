"""A DCP ``StorageReader`` over ckptd's tiers: verified reads, tier fallback, resharding by DCP.

Use it with ``torch.distributed.checkpoint.load``::

    dcp.load(state_dict, storage_reader=CkptdStorageReader("/nvme/ckpt/run1", step=100))

DCP calls, on every rank: :meth:`reset`, :meth:`read_metadata` (which reads the manifest and every
rank's index and derives DCP's ``Metadata`` from them, see :mod:`ckptd.dcp.metadata`),
:meth:`set_up_storage_reader`, :meth:`prepare_local_plan`; on the coordinator
:meth:`prepare_global_plan`; then on every rank :meth:`read_data`, which reads each stored piece once,
verifies every chunk against its xxh3-128 digest (falling back chunk by chunk to the next tier that has
the step) and copies the requested regions into the planner's tensors. The world size may differ from
the one that saved: DCP's planners decide which regions each rank reads.

``tiers`` may be a root path or a list of tiers, nearest first. Without ``step`` the newest step
committed on any of them is read, looked up again by every load (a reader kept for several loads reads
each time the newest), and the coordinator's choice is the one every rank reads. A checkpoint id passed
to ``dcp.load`` may name a step directory (``<root>/step-<12 digits>``) or any directory a
:class:`~ckptd.dcp.writer.CkptdStorageWriter` saved to (its newest committed step). Values saved as JSON
come back as the same values, ``io.BytesIO`` values as ``io.BytesIO`` with the same bytes; values saved
with pickle are refused unless ``allow_pickle=True``.

A step saved with ``dcp.save(..., use_collectives=False)`` is committed when every rank has written its
part (:mod:`ckptd.dcp.parts`); a load that names a step some ranks have not finished raises
:class:`~ckptd.errors.PartialStepError` naming them. :meth:`CkptdStorageReader.validate_checkpoint_id`
accepts local paths, ``file://`` URLs and URLs of the schemes a tier is registered for
(:func:`~ckptd.tiers.registry.registered_schemes`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import defaultdict
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptd.dcp import quantized as quantization
from ckptd.format.values import parse_values
from ckptd.dcp.metadata import PieceKey, StoredPiece, derive_metadata
from ckptd.dcp.parts import partial_step_error
from ckptd.dcp.writer import split_checkpoint_id
from ckptd.errors import CkptdError, ConfigError, NotFoundError, PickleRefusedError, ResumeMismatchError
from ckptd.format.layout import step_dir
from ckptd.format.records import Manifest
from ckptd.stepio.step_reader import ChunkSource, StepReader, load_step_manifest, load_rank_index, settle_all
from ckptd.state.tree import rebuild
from ckptd.tiers import open_tier
from ckptd.tiers.local import local_root
from ckptd.tiers.registry import registered_schemes, scheme_of
from ckptd.tiers.base import StorageTier


def open_step(tiers: list[StorageTier], step: int) -> tuple[Manifest, list[StepReader]]:
    """The manifest of ``step`` from the nearest tier that has it, and a reader per saved rank whose
    sources are every tier holding a usable copy of that rank (nearest first)."""
    manifest: Manifest | None = None
    errors: list[str] = []
    holders: list[tuple[StorageTier, Manifest]] = []
    for tier in tiers:
        try:
            found = load_step_manifest(tier, step)
        except CkptdError as error:  # reported below if no tier has it
            errors.append(str(error))
            continue
        manifest = manifest or found
        holders.append((tier, found))
    if manifest is None:
        raise NotFoundError(f"no tier has a committed copy of step {step}: " + " | ".join(errors), step=step)
    readers = []
    for rank in range(manifest.world_size):
        sources = []
        for tier, found in holders:
            try:
                sources.append(ChunkSource(tier, load_rank_index(tier, found, rank)))
            except CkptdError as error:  # the next tier may have it
                errors.append(str(error))
        if not sources:
            raise NotFoundError(f"no tier has a usable index of rank {rank}: " + " | ".join(errors), step=step)
        readers.append(StepReader(sources))
    return manifest, readers


def newest_committed_step(tiers: list[StorageTier]) -> int:
    """The newest step committed on any of ``tiers``; NotFoundError naming them when none has one."""
    newest: int | None = None
    errors: list[str] = []
    for tier in tiers:
        try:
            steps = tier.committed_steps()
        except CkptdError as error:  # another tier may answer
            errors.append(str(error))
            continue
        if steps:
            newest = steps[-1] if newest is None else max(newest, steps[-1])
    if newest is None:
        where = ", ".join(tier.label for tier in tiers)
        raise NotFoundError(f"no committed step in {where}" + (": " + " | ".join(errors) if errors else ""),
                            hint="pass the directory a save wrote to, or a step directory")
    return newest


class CkptdStorageReader(StorageReader):
    """Reads one committed step (``root``/list of tiers + ``step``, or a step directory as checkpoint id)."""

    def __init__(self, tiers: str | os.PathLike[str] | list[StorageTier] | None = None, step: int | None = None,
                 *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        #: The step this load reads (resolved by :meth:`read_metadata` when none was asked for).
        self.step = step
        self._requested_step = step
        #: The step asked for: ``step``, or the one a step directory given as checkpoint id names.
        self._asked_step = step
        self.load_id = uuid.uuid4().hex
        self._tiers: list[StorageTier] | None = None
        #: A root given by path or URL, opened when first read (it may not exist yet when the reader is made).
        self._root: str | None = None
        if isinstance(tiers, list):
            self._tiers = tiers
        elif tiers is not None:
            self._root = os.fspath(tiers)
        self._readers: list[StepReader] = []
        self._pieces: dict[PieceKey, StoredPiece] = {}
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Every rank, first: a checkpoint id (a step directory) overrides the tiers and step."""
        if checkpoint_id is not None:
            root, id_step = split_checkpoint_id(checkpoint_id)
            self._asked_step = id_step if id_step is not None else self._requested_step
            self.step = self._asked_step
            self._tiers, self._root = None, root
        self.load_id = uuid.uuid4().hex
        self._readers, self._pieces, self.manifest = [], {}, None

    @property
    def checkpoint_id(self) -> str | None:
        where = self._root if self._tiers is None else self._tiers[0].url
        if where is None or self.step is None:
            return None
        return f"{where.rstrip('/')}/{step_dir(self.step)}"

    def read_metadata(self) -> Metadata:
        """Every rank, at the start of each load: read the manifest and all indexes (digest-checked) and
        derive DCP's Metadata (of the newest committed step, unless a step was asked for)."""
        if self._tiers is None and self._root is not None:
            self._tiers = [open_tier(self._root)]
        if not self._tiers:
            raise ConfigError("CkptdStorageReader needs tiers (or a directory as checkpoint_id)",
                              hint="CkptdStorageReader(root, step=N), or dcp.load(..., checkpoint_id=DIR)")
        # DCP calls reset() only when given a checkpoint id: a reader kept for another load starts here.
        return self._open(self._asked_step if self._asked_step is not None else newest_committed_step(self._tiers))

    def _open(self, step: int) -> Metadata:
        self.step = step
        try:
            self.manifest, self._readers = open_step(self._tiers, step)  # type: ignore[arg-type]
        except NotFoundError as error:
            partial = partial_step_error(self._tiers, step)  # type: ignore[arg-type]
            if partial is not None:
                raise partial from error
            raise
        metadata, self._pieces = derive_metadata([r.index for r in self._readers], self.manifest.extra,
                                                 checkpoint_id=self.checkpoint_id,
                                                 manifest_version=self.manifest.format_version)
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def step_reader(self, rank: int) -> StepReader:
        """The reader of one saved rank's share (after :meth:`read_metadata`)."""
        if not self._readers:
            self.read_metadata()
        return self._readers[rank]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._readers:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: send the step it reads to every rank (in each plan's ``storage_data``), so that all
        read one step even when a save committed a newer one while the ranks looked up the newest."""
        return [dataclasses.replace(plan, storage_data=self.step) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank: read and verify each stored piece the plan needs, once, and hand it to the planner."""
        chosen = plan.storage_data
        if isinstance(chosen, int) and not isinstance(chosen, bool) and chosen != self.step:
            self._open(chosen)  # this rank found another newest step than the coordinator
        groups: dict[StoredPiece, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            offsets = None if item.type == LoadItemType.BYTE_IO else tuple(int(o) for o in item.storage_index.offset)
            piece = self._pieces.get((item.storage_index.fqn, offsets))
            if piece is None:
                raise NotFoundError(f"{item.storage_index.fqn!r} at offsets {offsets} is not in the checkpoint",
                                    step=self.step, path=self.checkpoint_id)
            groups[piece].append(item)
        arriving: list[tuple[ReadItem, torch.Tensor]] = []
        try:
            for piece, items in groups.items():
                if piece.kind == "quantized":
                    self._read_quantized(piece, items, planner)
                elif piece.kind == "tensor":
                    self._read_tensor(piece, items, planner, arriving)
                else:
                    data = self._value_bytes(piece)
                    for item in items:
                        planner.load_bytes(item, io.BytesIO(data))
        except BaseException:
            settle_all(self._readers, raise_errors=False)
            raise
        settle_all(self._readers)
        for item, target in arriving:
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether this reader can serve ``checkpoint_id``: a local path or ``file://`` URL, or a URL of a
        scheme some tier is registered for (in-process or by a plugin's entry point). Other URLs are
        declined, so that DCP's storage auto-detection picks another reader for them."""
        try:
            root, _ = split_checkpoint_id(checkpoint_id)
            scheme = scheme_of(root)
            if scheme == "file":
                local_root(root)
                return True
            return scheme in registered_schemes()
        except (CkptdError, TypeError, ValueError):
            return False

    # --- internals ----------------------------------------------------------------------------
    def _read_tensor(self, piece: StoredPiece, items: list[ReadItem], planner: LoadPlanner,
                     arriving: list[tuple[ReadItem, torch.Tensor]]) -> None:
        """Hand the planner its pieces of one stored tensor; a read straight into the destination is only
        started, and ``arriving`` gets the item to commit once every read has settled."""
        reader = self._readers[piece.rank]
        record = reader.record(piece.name)
        if len(items) == 1:
            item = items[0]
            target = planner.resolve_tensor(item).detach()
            if tuple(item.lengths) == record.shape and tuple(target.shape) == record.shape:
                arriving.append((item, reader.read_tensor(piece.name, target, defer=True)))
                return
        stored = reader.read_tensor(piece.name)
        for item in items:
            target = planner.resolve_tensor(item).detach()
            region = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            with torch.no_grad():
                target.copy_(region)
            planner.commit_tensor(item, target)

    def _read_quantized(self, piece: StoredPiece, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Rebuild a quantized tensor from its integers and parameters and copy it into each target,
        which takes the saved scale(s) and zero point(s)."""
        reader = self._readers[piece.rank]
        record = reader.record(piece.name)
        params = quantization.parse(parse_values(reader.index.values).quantized.get(piece.name), name=piece.name,
                                    stored_dtype=record.dtype, step=self.step)
        stored = quantization.join(reader.read_tensor(piece.name), params)
        for item in items:
            # The state's own tensor, not the view resolve_tensor gives: a view's copy_ would leave the
            # state's quantization parameters as they were.
            lookup = getattr(planner, "lookup_tensor", None)
            target = lookup(item.dest_index) if lookup is not None else planner.resolve_tensor(item)
            if not target.is_quantized or target.dtype != stored.dtype or target.qscheme() != stored.qscheme() \
                    or tuple(target.shape) != tuple(stored.shape):
                raise ResumeMismatchError(
                    f"{piece.name!r} was saved as a {params.dtype} tensor ({params.scheme}) of shape "
                    f"{tuple(stored.shape)}; the target is {target.dtype} of shape {tuple(target.shape)}",
                    step=self.step, path=self.checkpoint_id,
                    hint="load into a quantized tensor of the same dtype, scheme and shape")
            with torch.no_grad():
                target.copy_(stored)
            planner.commit_tensor(item, target)

    def _value_bytes(self, piece: StoredPiece) -> bytes:
        reader = self._readers[piece.rank]
        if piece.kind == "bytesio":
            buffer = io.BytesIO()  # DCP's load_bytes expects torch.save bytes; built here from the raw bytes
            torch.save(io.BytesIO(bytes(reader.read_tensor(piece.name).numpy())), buffer)
            return buffer.getvalue()
        if piece.kind == "pickled":
            if not self.allow_pickle:
                raise PickleRefusedError(f"{piece.name!r} was saved with pickle; ckptd does not unpickle by default",
                                         step=self.step, path=self.checkpoint_id,
                                         hint="pass allow_pickle=True only if you trust this checkpoint")
            return bytes(reader.read_tensor(piece.name).numpy())
        values = parse_values(reader.index.values)
        value = rebuild(values.objects[piece.name], lambda name, out: reader.read_tensor(name, out))
        buffer = io.BytesIO()
        torch.save(value["value"], buffer)  # DCP's load_bytes expects torch.save bytes; built here from JSON
        return buffer.getvalue()
