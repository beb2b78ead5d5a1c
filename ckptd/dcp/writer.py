"""A DCP ``StorageWriter`` that writes ckptd's format: chunks, xxh3-128 digests, codecs, manifest last.

Use it with ``torch.distributed.checkpoint.save`` or ``async_save``::

    dcp.save(state_dict, storage_writer=CkptdStorageWriter("/nvme/ckpt/run1", step=100))

DCP calls, on every rank: :meth:`reset`, :meth:`set_up_storage_writer`, :meth:`prepare_local_plan`; on
the coordinator: :meth:`prepare_global_plan`; on every rank: :meth:`write_data`, which writes this rank's
data file and index through :class:`~ckptd.stepio.rank_writer.RankWriter` (the same code the
CheckpointManager uses); then on the coordinator only: :meth:`finish`, which writes the commit manifest
last. If any rank's ``write_data`` fails, DCP fails the save on every rank and no manifest is written.

With ``async_save`` the writer is also the stager (:meth:`stage`): tensors are copied into reusable host
buffers (:class:`~ckptd.state.staging.Stager`) on the training thread, and DCP runs the rest on its
own thread. Like DCP's ``FileSystemWriter``, all ranks must see the same directory (a shared file system).

Which step a save writes (the checkpoint id, see :func:`split_checkpoint_id`):

- ``CkptdStorageWriter(root, step=N)``, or ``checkpoint_id="<root>/step-<12 digits>"``: step ``N``.
- ``CkptdStorageWriter(root)`` or ``checkpoint_id="/ckpt/epoch_3"`` (any directory, as users of DCP's
  ``FileSystemWriter`` pass): that directory is a ckptd root and the save writes its next step (one
  past the highest step directory there), chosen by the coordinator in :meth:`prepare_global_plan`,
  claimed by creating its directory (two jobs sharing a root never write one step) and sent to every
  rank in its plan's ``storage_data`` (:class:`SaveTarget`). Saving twice to one directory therefore
  never rewrites the committed step; :class:`~ckptd.dcp.reader.CkptdStorageReader` given that
  directory reads its newest committed step.

``overwrite`` follows DCP's ``FileSystemWriter``: with ``overwrite=False`` a save raises
:class:`~ckptd.errors.CheckpointExistsError` ("Checkpoint already exists") when the step it names is
committed, or, for a root, when the root holds any committed step. With ``overwrite=True`` (DCP's
default) a save to a root writes its next step (a load of the root then reads it); a committed step is
never rewritten, so naming one raises :class:`~ckptd.errors.AlreadyCommittedError` either way.

``dcp.save(..., use_collectives=False)``: each rank writes its files and a part record, and the rank that
finds every rank's part commits the step (:mod:`ckptd.dcp.parts`). The ranks cannot agree on a root's
next step without collectives, so such a save must name its step (``step=N`` or a step directory as
checkpoint id); a load that names a step whose parts are not all written raises
:class:`~ckptd.errors.PartialStepError` naming the ranks missing.

One writer serves any number of saves, with or without a checkpoint id (DCP calls :meth:`reset` only
with one; :meth:`set_up_storage_writer` then begins the save), and ``async_save`` calls may overlap:
each stage waits until the previous save has written its staged copy, and the commit takes the step,
root and save id from the ranks' results, not from the writer, which the next save already reset.

The writer is picklable (``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
sends it to DCP's checkpoint process with every save): its pickled state holds only settings; the tier,
the staging buffers and their event are made again where it runs.

Non-tensor values are kept as JSON (:mod:`ckptd.format.values`), ``io.BytesIO`` values as their bytes
(a uint8 tensor, chunked and verified like any tensor); a value neither can hold is refused unless
``allow_pickle=True``. DCP's ``Metadata`` is never pickled: readers rebuild it from the indexes.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptd.config import settings
from ckptd.format.values import SavedValues, ShardPlacement
from ckptd.dcp import quantized as quantization
from ckptd.dcp.metadata import MANIFEST_KEY, StoredPiece, planner_data_to_json
from ckptd.dcp.parts import HINT as PARTS_HINT
from ckptd.dcp.parts import RankPart, delete_part, part_matches_index, read_parts, write_part
from ckptd.errors import (AlreadyCommittedError, CheckpointExistsError, CommitError, ConfigError,
                          PickleRefusedError, StorageError)
from ckptd.format import codecs
from ckptd.format.layout import MANIFEST_NAME, parse_step_dir, step_dir, step_file
from ckptd.stepio.rank_writer import RankWriter
from ckptd.format.records import FORMAT_VERSION, Manifest, RankEntry
from ckptd.format.values import VALUE_KEYS_SINCE
from ckptd.state.staging import Stager, stage_tree
from ckptd.state.tree import flatten
from ckptd.tiers.atomicity import step_commit
from ckptd.tiers.local import LocalTier, local_root
from ckptd.tiers.registry import scheme_of

log = logging.getLogger("ckptd.dcp")

#: fqn prefix of the one extra WriteResult per rank that carries its manifest entry to the coordinator.
_RANK_ENTRY_FQN = "__ckptd_rank_entry__"


def split_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[str, int | None]:
    """``<root>/step-<12 digits>`` -> (root, step); any other directory or URL -> (it, None): a root
    whose step the caller chooses. ConfigError for an empty id."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"checkpoint id {checkpoint_id!r} is empty",
                          hint="pass a directory, <root>/step-<12-digit step>, or root= and step=")
    text = text.rstrip("/") or text
    name = text.rsplit("/", 1)[-1]
    step = parse_step_dir(name)
    if step is None:
        return text, None
    parent = text[:-len(name)]
    return (parent.rstrip("/") or "/") if parent else ".", step


@dataclass(frozen=True)
class SaveTarget:
    """The ``storage_data`` of every rank's plan: the step the coordinator chose and its save id."""

    step: int
    save_id: str


@dataclass(frozen=True)
class _RankShare:
    """What one rank's write sends to the coordinator's :meth:`CkptdStorageWriter.finish`: its manifest
    entry and the save it belongs to, so that the commit never reads the writer's attributes, which the
    next save with the same writer may already have reset."""

    entry: RankEntry
    root: str
    target: SaveTarget


class CkptdStorageWriter(StorageWriter):
    """Writes one step of a checkpoint root (``root`` + ``step``, a step directory as checkpoint id, or
    the next step of a root: see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 codec: str | None = None, allow_pickle: bool = False, stager: Stager | None = None,
                 overwrite: bool = True) -> None:
        super().__init__()
        #: DCP's ``FileSystemWriter`` option: False refuses a save to a committed step or a root holding one.
        self.overwrite = overwrite
        self.codec = codecs.chosen_codec(codec)
        self.allow_pickle = allow_pickle
        self.root = None if root is None else os.fspath(root)
        #: The step this save writes (None until chosen, when the writer picks the root's next step).
        self.step = step
        self._requested_step = step
        self.save_id = uuid.uuid4().hex
        self.rank, self.is_coordinator = 0, True
        self.world_size = 1
        self.use_collectives = True
        self._stager = stager
        self._staged_elsewhere = False
        self._buffers_free = threading.Event()
        self._buffers_free.set()
        #: The thread of the save that reads the staged copy (it ends, failed or not, when that save does).
        self._save_thread: threading.Thread | None = None
        self._tier: LocalTier | None = None
        #: Whether :meth:`reset` began the current save (DCP calls it only when given a checkpoint id).
        self._began = False

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in DCP's checkpoint process gets: settings only (no tier, buffers or event)."""
        state = dict(self.__dict__)
        for name in ("_stager", "_buffers_free", "_tier", "_save_thread"):
            state.pop(name, None)
        if not self._buffers_free.is_set():
            # This process cannot see when the copy is done with the staged buffers: the next stage()
            # here stages into new ones, and need not wait for this save any longer.
            self._staged_elsewhere = True
            self._buffers_free.set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stager, self._tier, self._staged_elsewhere, self._save_thread = None, None, False, None
        self._began = False
        self._buffers_free = threading.Event()
        self._buffers_free.set()

    # --- DCP interface, in call order ------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Every rank, first: the root and step to write (a checkpoint id overrides the root, and the
        step when it names a step directory) and a new save id."""
        self.step = self._requested_step
        if checkpoint_id is not None:
            self.root, id_step = split_checkpoint_id(checkpoint_id)
            if id_step is not None:
                self.step = id_step
        if self.root is None:
            raise ConfigError("CkptdStorageWriter needs a root (or a directory as checkpoint_id)",
                              hint="CkptdStorageWriter(root, step=N), or dcp.save(..., checkpoint_id=DIR)")
        self.save_id = uuid.uuid4().hex
        self._tier = LocalTier(self.root)
        self._began = True

    @property
    def checkpoint_id(self) -> str | None:
        """The step directory this save writes (the root while the step is not chosen yet)."""
        if self.root is None:
            return None
        return self.root if self.step is None else f"{self.root.rstrip('/')}/{step_dir(self.step)}"

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank: learn this rank's number and whether it writes the manifest."""
        import torch.distributed as dist

        self.is_coordinator = is_coordinator
        distributed = dist.is_available() and dist.is_initialized()
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        self.rank = int(rank)
        self.world_size = dist.get_world_size() if distributed else 1
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        if not self._buffers_free.is_set():
            self._save_thread = threading.current_thread()
        try:
            if not self._began:  # a save without checkpoint id: DCP did not call reset for it
                self.reset()
            self._began = False
            if not self.use_collectives and self.world_size > 1 and self.step is None:
                raise ConfigError("dcp.save(..., use_collectives=False) needs the step to write: without "
                                  "collectives the ranks cannot agree on a root's next step", path=self.root,
                                  hint="pass CkptdStorageWriter(root, step=N) or checkpoint_id="
                                  "'<root>/step-<12-digit step>'")
            self._check_overwrite()
            if self.step is not None:
                step_commit(self._local).check_writable(self.step)
                if not self.use_collectives and self.world_size > 1:
                    # A part record of this rank left by an earlier attempt would let another rank commit
                    # that attempt's files of this rank with this attempt's of its own: delete it before
                    # writing anything of the step (this rank's new one is written after its index).
                    delete_part(self._local, self.step, self.rank)
        except BaseException:
            self._buffers_free.set()  # this save ends here: the staged copy is not read
            raise

    def _check_overwrite(self) -> None:
        """With ``overwrite=False``: CheckpointExistsError when the step (or, for a root, any step) is committed."""
        if self.overwrite:
            return
        if self.step is not None:
            committed = [self.step] if self._local.is_committed(self.step) else []
            where = f"step {self.step} of {self.root} is committed"
        else:
            committed = self._local.committed_steps()
            where = f"{self.root} holds committed step(s) {committed[-3:]}"
        if committed:
            raise CheckpointExistsError(f"Checkpoint already exists and overwrite=False: {where}",
                                        step=committed[-1], path=self.root,
                                        hint="pass overwrite=True (DCP's default: a save to a root writes its "
                                        "next step and keeps the older ones), or save to another directory")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: choose the step (the root's next one unless given) and send it, with this save's
        id, to every rank in its plan's ``storage_data``."""
        if self.step is None:
            self.step = self._claim_next_step()
        target = SaveTarget(step=self.step, save_id=self.save_id)
        return [dataclasses.replace(plan, storage_data=target) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: write this rank's items and index; the future is already done when returned."""
        future: Future[list[WriteResult]] = Future()
        try:
            if isinstance(plan.storage_data, SaveTarget):
                self.step, self.save_id = plan.storage_data.step, plan.storage_data.save_id
            if self.step is None:
                raise ConfigError("CkptdStorageWriter got a plan without its step (prepare_global_plan was "
                                  "not called)", path=self.root, hint="save with dcp.save or dcp.async_save")
            future.set_result(self._write(plan.items, planner))
        except BaseException as error:  # DCP gathers it and fails the save on every rank
            future.set_exception(error)
        finally:
            self._buffers_free.set()  # the staged copy is no longer read
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only, after every rank wrote: write the commit manifest (last). Without collectives,
        every rank: write this rank's part; the rank that finds every part commits (:mod:`ckptd.dcp.parts`)."""
        if not self.use_collectives and self.world_size > 1:
            self._finish_part(metadata, results)
            return
        shares = sorted((r.storage_data for rank_results in results for r in rank_results
                         if isinstance(r.storage_data, _RankShare)), key=lambda s: s.entry.rank)
        if len({s.target for s in shares}) != 1:
            raise CommitError(f"rank {self.rank} got the results of {len({s.target for s in shares})} saves to "
                              "commit as one; nothing was committed", step=self.step, path=self.checkpoint_id,
                              hint="save with dcp.save or dcp.async_save")
        own = next((s for s in shares if s.entry.rank == self.rank), shares[0])  # the root this rank wrote to
        root, target = own.root, own.target
        step, path = target.step, f"{root.rstrip('/')}/{step_dir(target.step)}"
        entries = [s.entry for s in shares]
        ranks = [e.rank for e in entries]
        # With collectives, DCP hands the coordinator one result list per rank of its process group (which
        # may be a subgroup); without them each rank gets only its own, and the job's size says how many
        # took part.
        world_size = len(results) if self.use_collectives else self.world_size
        if ranks != list(range(world_size)):
            how = "" if self.use_collectives else (" (dcp.save(..., use_collectives=False) gives each rank's "
                                                   "finish only its own results)")
            raise CommitError(f"rank {self.rank} got index entries of ranks {ranks} for a {world_size}-rank "
                              f"save{how}; nothing was committed", step=step, path=path,
                              hint="save with use_collectives=True, or use ckptd.CheckpointManager, whose ranks "
                              "agree through the job's store")
        extra = {MANIFEST_KEY: {"planner_data": planner_data_to_json(metadata.planner_data),
                                "version": metadata.version, "save_id": target.save_id}}
        pieces = {r.index: r.storage_data for rank_results in results for r in rank_results
                  if isinstance(r.storage_data, StoredPiece)}
        # Values kept under the keys 'buffers' and 'quantized' are read wrongly by readers of older formats:
        # such a step says it needs a reader that knows them, which older ones refuse by its version.
        newer_values = any(piece.kind in ("bytesio", "quantized") for piece in pieces.values())
        manifest = Manifest(step=step, world_size=world_size, ranks=tuple(entries), codec=self.codec, extra=extra,
                            format_version=max(FORMAT_VERSION, VALUE_KEYS_SINCE) if newer_values else FORMAT_VERSION)
        step_commit(LocalTier(root)).commit(step, manifest.to_json_bytes(), world_size=world_size)
        metadata.storage_data = pieces
        metadata.storage_meta = StorageMeta(checkpoint_id=path, save_id=target.save_id)

    def _finish_part(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        shares = [r.storage_data for rank_results in results for r in rank_results
                  if isinstance(r.storage_data, _RankShare)]
        if len(shares) != 1 or shares[0].entry.rank != self.rank:
            raise CommitError(f"rank {self.rank} got {len(shares)} index entries to commit as its part of a save "
                              "without collectives; nothing was committed", step=self.step,
                              path=self.checkpoint_id, hint="save with dcp.save or dcp.async_save")
        share = shares[0]
        root, step = share.root, share.target.step
        tier = LocalTier(root)
        pieces = {r.index: r.storage_data for rank_results in results for r in rank_results
                  if isinstance(r.storage_data, StoredPiece)}
        newer_values = any(piece.kind in ("bytesio", "quantized") for piece in pieces.values())
        path = f"{root.rstrip('/')}/{step_dir(step)}"
        if tier.is_committed(step):
            # Another rank committed the step without this rank's part of this save (which is not written
            # yet): its files are not this save's, unless the manifest records exactly them.
            self._check_committed_entry(tier, step, share.entry, path)
        else:
            write_part(tier, step, RankPart(entry=share.entry, world_size=self.world_size, codec=self.codec,
                                            save_id=share.target.save_id,
                                            planner_data=planner_data_to_json(metadata.planner_data),
                                            version=metadata.version, newer_values=newer_values))
            parts = read_parts(tier, step)
            if set(parts) >= set(range(self.world_size)):
                self._commit_parts(tier, step, parts, path, share.entry)
        metadata.storage_data = pieces
        metadata.storage_meta = StorageMeta(checkpoint_id=path, save_id=share.target.save_id)

    def _commit_parts(self, tier: LocalTier, step: int, parts: dict[int, RankPart], path: str,
                      own: RankEntry) -> None:
        """Write the manifest of a step saved without collectives from every rank's part, when each part
        records the index file now on disk (``own``: this rank's entry, just written as its part)."""
        odd = {rank: (part.world_size, part.codec) for rank, part in parts.items()
               if (part.world_size, part.codec) != (self.world_size, self.codec)}
        if odd or set(parts) != set(range(self.world_size)):
            raise CommitError(f"the parts of step {step} disagree with rank {self.rank}'s save ({self.world_size} "
                              f"ranks, codec {self.codec}): ranks {sorted(parts)}, (world size, codec) {odd}; "
                              "nothing was committed", step=step, path=path,
                              hint=f"every rank must save with the same world size and codec; {PARTS_HINT}")
        changed = sorted(rank for rank, part in parts.items() if not part_matches_index(tier, step, part))
        if changed:
            # Their index files are not the ones their parts record: those ranks are writing the step again
            # (their part of this attempt is not written yet), or their files are gone. The rank that writes
            # the last part of this attempt commits.
            log.info("step %d: not committing yet: the index files of ranks %s do not match their part records "
                     "(left by an earlier attempt)", step, changed)
            return
        planner_data: dict[str, Any] = {}
        for part in parts.values():
            if isinstance(part.planner_data, dict):
                planner_data.update(part.planner_data)
        first = parts[0]
        extra = {MANIFEST_KEY: {"planner_data": planner_data or None, "version": first.version,
                                "save_id": first.save_id}}
        newer_values = any(part.newer_values for part in parts.values())
        manifest = Manifest(step=step, world_size=self.world_size,
                            ranks=tuple(parts[rank].entry for rank in range(self.world_size)), codec=self.codec,
                            extra=extra,
                            format_version=max(FORMAT_VERSION, VALUE_KEYS_SINCE) if newer_values else FORMAT_VERSION)
        try:
            step_commit(tier).commit(step, manifest.to_json_bytes(), world_size=self.world_size)
        except AlreadyCommittedError:
            if not tier.is_committed(step):
                raise
            # Another rank found every part at the same time and committed first: with this rank's part of
            # this save, unless it read one left by an earlier attempt.
            self._check_committed_entry(tier, step, own, path)

    def _check_committed_entry(self, tier: LocalTier, step: int, own: RankEntry, path: str) -> None:
        """CommitError unless ``step``'s manifest records this rank's index exactly as this save wrote it."""
        manifest_path = step_file(step, MANIFEST_NAME)
        manifest = Manifest.from_json_bytes(tier.read_bytes(manifest_path), path=manifest_path, step=step,
                                            tier=tier.label)
        committed = next((entry for entry in manifest.ranks if entry.rank == own.rank), None)
        key = (own.index_file, own.index_size, own.index_digest)
        if committed is None or (committed.index_file, committed.index_size, committed.index_digest) != key:
            raise CommitError(f"step {step} was committed by another rank with a part of rank {own.rank} that is "
                              f"not the one this save wrote (a part left by an earlier attempt): the committed "
                              f"step does not hold rank {own.rank}'s state of this save", step=step, path=path,
                              tier=tier.label, hint=PARTS_HINT)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether this writer can save to ``checkpoint_id``: a local path or ``file://`` URL (a step
        directory, or a root whose next step a save writes) under a writable directory. Other URLs are
        declined, so that DCP's storage auto-detection picks another writer for them."""
        local = _local_directory(checkpoint_id)
        if local is None:
            return False
        for directory in (local, *local.parents):
            if directory.exists():
                return directory.is_dir() and os.access(directory, os.W_OK)
        return False

    def storage_meta(self) -> StorageMeta | None:
        """This save's checkpoint id (its step directory, once chosen) and save id."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # --- async_save staging (AsyncStager protocol) ------------------------------------------------
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Training thread, in ``async_save``: copy the state into reusable host buffers.

        The buffers are reused, so this waits (up to ``CKPTD_COMMIT_TIMEOUT_S``) until the previous
        save with this writer has written them or ended (back-pressure), then raises CommitError. A
        staged copy sent to DCP's checkpoint process is left to it: the next one gets new buffers.
        """
        self._wait_for_buffers()
        if self._staged_elsewhere:  # the last staged copy went to DCP's checkpoint process: keep it intact
            self._stager, self._staged_elsewhere = None, False
        self._save_thread = None
        if self._stager is None:
            self._stager = Stager()
        staged = stage_tree(self._stager, _hold_quantized(state_dict))
        self._buffers_free.clear()
        return staged

    def synchronize_staging(self) -> None:
        """Staging is complete when :meth:`stage` returns."""

    def close(self) -> None:
        """Release the staging buffers."""
        if self._stager is not None:
            self._stager.release()

    # --- internals ----------------------------------------------------------------------------
    def _wait_for_buffers(self) -> None:
        """Until the previous save with this writer no longer reads the staged copy: it wrote it, sent it to
        DCP's checkpoint process, or its thread ended (a save that failed before writing)."""
        deadline = time.monotonic() + settings().commit_timeout_s
        while not self._buffers_free.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            thread = self._save_thread
            if thread is not None and not thread.is_alive():
                self._buffers_free.set()
                return
            if time.monotonic() >= deadline:
                raise CommitError("the previous async_save with this writer is still writing its staged copy "
                                  f"after {settings().commit_timeout_s:g} s", step=self.step,
                                  path=self.checkpoint_id, hint="wait for its future before the next "
                                  "async_save, use another writer, or raise CKPTD_COMMIT_TIMEOUT_S")

    def _claim_next_step(self) -> int:
        """The root's next step (one past the highest step directory), claimed by creating its directory,
        which fails when another save (another job sharing the root) made it first: then the one after."""
        step = max(self._local.list_step_numbers(), default=-1) + 1
        while True:
            directory = self._local.root / step_dir(step)
            try:
                directory.mkdir()
                return step
            except FileExistsError:
                step += 1
            except OSError as error:
                raise StorageError(f"cannot create the step directory: {error}", path=str(directory),
                                   step=step, tier=self._local.label) from error

    @property
    def _local(self) -> LocalTier:
        if self._tier is None:
            self.reset()
        return self._tier  # type: ignore[return-value]

    def _refuse_committed(self, tier: LocalTier, step: int) -> None:
        """Raise before writing a file of ``step`` when it is committed (a committed step is never changed):
        CheckpointExistsError with ``overwrite=False``, else AlreadyCommittedError."""
        if not tier.is_committed(step):
            return
        path = f"{os.fspath(tier.root).rstrip('/')}/{step_dir(step)}"
        if not self.overwrite:
            raise CheckpointExistsError(f"Checkpoint already exists and overwrite=False: step {step} was committed "
                                        f"while rank {self.rank} was saving it; nothing more was written",
                                        step=step, path=path, tier=tier.label,
                                        hint=f"{PARTS_HINT}, or save to another directory")
        raise AlreadyCommittedError(f"step {step} was committed while rank {self.rank} was saving it; a committed "
                                    "step is never rewritten, so nothing more was written", step=step, path=path,
                                    tier=tier.label, hint=PARTS_HINT if not self.use_collectives else
                                    "save under a new step number, or delete the step first (`ckptd gc`)")

    def _write(self, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        self._refuse_committed(self._local, self.step)  # type: ignore[arg-type]
        writer = RankWriter(self._local, self.step, self.rank, codec=self.codec,  # type: ignore[arg-type]
                            chunk_bytes=settings().chunk_bytes)
        shards: dict[str, tuple[str, ShardPlacement]] = {}
        objects: dict[str, Any] = {}
        pickled: set[str] = set()
        buffers: set[str] = set()
        quantized: dict[str, Any] = {}
        results: list[WriteResult] = []
        try:
            for item in items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    results.append(self._write_value(item, planner, writer, objects, pickled, buffers, quantized))
                    continue
                tensor = planner.resolve_data(item).detach()  # type: ignore[union-attr]
                local = tensor.to("cpu").contiguous()
                chunk = item.tensor_data.chunk  # type: ignore[union-attr]
                offsets = tuple(int(o) for o in chunk.offsets)
                global_shape = tuple(int(s) for s in item.tensor_data.size)  # type: ignore[union-attr]
                name = fqn if not any(offsets) else f"{fqn}@{','.join(map(str, offsets))}"
                kind = "tensor"
                if local.is_quantized:
                    if name != fqn or global_shape != tuple(local.shape):
                        raise ConfigError(f"quantized tensor {fqn!r} is sharded; ckptd stores whole quantized "
                                          "tensors only", step=self.step, path=self.checkpoint_id)
                    local, params = quantization.split(local, name=fqn)
                    quantized[name], kind = params.to_json(), "quantized"
                writer.add(name, local)
                if name != fqn or global_shape != tuple(local.shape):
                    shards[name] = (fqn, ShardPlacement(global_shape, offsets))
                results.append(WriteResult(index=item.index, size_in_bytes=local.numel() * local.element_size(),
                                           storage_data=StoredPiece(self.rank, name, kind)))
            values = SavedValues(shards=shards, objects=objects, pickled=frozenset(pickled),
                                 buffers=frozenset(buffers), quantized=quantized)
            # The data files and the index are renamed into place by finish: not into a committed step.
            self._refuse_committed(self._local, self.step)  # type: ignore[arg-type]
            entry: RankEntry = writer.finish(values.to_json())
        except BaseException:
            writer.abort()
            raise
        share = _RankShare(entry=entry, root=self.root,  # type: ignore[arg-type]
                           target=SaveTarget(step=self.step, save_id=self.save_id))  # type: ignore[arg-type]
        results.append(WriteResult(index=MetadataIndex(f"{_RANK_ENTRY_FQN}{self.rank}"), size_in_bytes=0,
                                   storage_data=share))
        return results

    def _write_value(self, item: WriteItem, planner: SavePlanner, writer: RankWriter, objects: dict[str, Any],
                     pickled: set[str], buffers: set[str], quantized: dict[str, Any]) -> WriteResult:
        fqn = item.index.fqn
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:
            value = lookup(item.index)
            if isinstance(value, quantization.StagedQuantized):  # a quantized tensor async_save staged
                writer.add(fqn, value.integers)
                quantized[fqn] = value.params.to_json()
                size = value.integers.numel() * value.integers.element_size()
                return WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data=StoredPiece(self.rank, fqn, "quantized"))
            if isinstance(value, io.BytesIO):
                data = bytearray(value.getbuffer())
                writer.add(fqn, _bytes_tensor(data))
                buffers.add(fqn)
                return WriteResult(index=item.index, size_in_bytes=len(data),
                                   storage_data=StoredPiece(self.rank, fqn, "bytesio"))
            try:
                flat = flatten({"value": value}, loader_markers=False)  # DCP rebuilds values: no marker
            except PickleRefusedError:
                flat = None
            if flat is not None and not flat.tensors:
                objects[fqn] = flat.skeleton
                return WriteResult(index=item.index, size_in_bytes=0,
                                   storage_data=StoredPiece(self.rank, fqn, "object"))
        if not self.allow_pickle:
            raise PickleRefusedError(f"state entry {fqn!r} on rank {self.rank} can only be saved with pickle",
                                     step=self.step, hint="pass allow_pickle=True to CkptdStorageWriter and "
                                     "CkptdStorageReader if you trust this checkpoint")
        data = bytearray(planner.resolve_data(item).getbuffer())  # type: ignore[union-attr]
        writer.add(fqn, _bytes_tensor(data))
        pickled.add(fqn)
        return WriteResult(index=item.index, size_in_bytes=len(data),
                           storage_data=StoredPiece(self.rank, fqn, "pickled"))


def _local_directory(checkpoint_id: str | os.PathLike[str]) -> Any:
    """The local directory a checkpoint id names (its root for a step directory), None when it is not a
    local path or ``file://`` URL."""
    try:
        root, _ = split_checkpoint_id(checkpoint_id)
        if scheme_of(root) != "file":
            return None
        return local_root(root)
    except (ConfigError, TypeError, ValueError):
        return None


def _hold_quantized(node: Any) -> Any:
    """``node`` with each quantized tensor as its integers and parameters: the staging buffers hold plain
    dtypes only, and a quantized tensor sent to DCP's checkpoint process arrives without its quantizer."""
    if isinstance(node, torch.Tensor):
        return quantization.StagedQuantized.of(node) if node.is_quantized else node
    if isinstance(node, Mapping):
        return {key: _hold_quantized(child) for key, child in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_hold_quantized(child) for child in node)
    return node


def _bytes_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
