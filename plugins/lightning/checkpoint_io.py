"""``CkptdCheckpointIO``: Lightning saves and restores through ckptd's tiers.

Lightning's ``Strategy`` calls a ``CheckpointIO`` on the training thread: ``save_checkpoint(checkpoint,
path)`` on global rank 0 for every checkpoint ``ModelCheckpoint`` (or ``trainer.save_checkpoint``) makes,
``load_checkpoint(path)`` on every rank when ``fit(ckpt_path=...)`` resumes, ``remove_checkpoint(path)``
when ``save_top_k`` drops one, ``teardown()`` at the end of a stage. This one maps them onto one
:class:`ckptd.CheckpointManager`:

- **save**: the checkpoint dict (weights, ``optimizer_states``, ``lr_schedulers``, ``loops``,
  ``callbacks``, the data module's state, ``hyper_parameters``...) is saved as ckptd step
  ``global_step``. The call returns once the tensors are copied into host buffers (the only blocking
  part, like Lightning's ``AsyncCheckpointIO``, which clones them); hashing, writing, the commit and the
  upload to ``remote`` run in the background. A pointer file naming the step is written at ``path``,
  so that Lightning's own logic (``ckpt_path="last"``, ``save_top_k``) sees its files. Several paths at
  one global step (``epoch=0-step=40.ckpt`` and ``last.ckpt``) share the step saved first.
- **load**: the pointer names the step; it is read from the nearest tier with an intact copy (local,
  then S3), every chunk verified. A step that never committed (the process died while writing it) falls
  back to the newest older committed step, with the warning every ckptd integration gives
  (:mod:`ckptd.plugins.fallback`). RNG states of torch, numpy and ``random`` are
  restored with it (``capture_rng``, every rank's own: :mod:`ckptd.plugins.lightning.rank_rng`). The
  training loader's position is in the checkpoint when the loader has one (``state_dict()``, which
  Lightning's loops save): with torchdata's ``StatefulDataLoader`` or ckptd's
  :class:`~ckptd.plugins.lightning.LightningShardLoader` (any ``num_workers``) a resume from a checkpoint
  saved in the middle of an epoch continues with the next batch, bit for bit; under DDP a
  ``StatefulDataLoader`` needs :class:`~ckptd.plugins.lightning.sampler.ResumableDistributedSampler` in
  place of ``shuffle=True``. A plain shuffled ``DataLoader`` continues as it would have only from a
  checkpoint at an epoch's end (its next epoch's order is drawn from the restored RNG); inside an epoch its
  position is nowhere, and the first save warns, naming the loader and the fix.
- **remove**: the pointer goes; the step is deleted from the tiers at the next commit once no path
  points to it: those of this process and the pointers an earlier run left in the same directories (see
  :mod:`ckptd.plugins.lightning.retention`).
- **teardown**: waits for pending writes and uploads (:meth:`ckptd.CheckpointManager.close`).
- **a plain state dict** (no ``global_step``: the last weights ``ddp_spawn`` hands from rank 0 to the main
  process through a temporary path) is not a training checkpoint: it is saved, synchronously, as step 0 of
  its own ckptd root beside the path (``<path>.ckptd``), loaded from there and removed with its pointer.

With several processes (DDP), Lightning saves and removes on global rank 0 only, and loads on every rank:
rank 0 restores from the tiers and hands the checkpoint to the other ranks over the process group
(``broadcast_object_list``, as Lightning's own strategies share objects between the job's processes); the
other ranks never open the checkpoint directory. A failure on rank 0 is raised on every rank. Every rank's
RNG states are saved and each rank gets its own back: :class:`ckptd.plugins.lightning.rank_rng.CkptdRankRNG`,
a callback Lightning adds to every Trainer through ckptd's ``lightning.pytorch.callbacks_factory`` entry
point, gathers them while Lightning builds the checkpoint (on every rank).

Nothing is pickled: values that need pickle (an object in ``hyper_parameters``) raise
``PickleRefusedError`` naming the entry unless ``allow_pickle=True`` (then loading needs it too). The
manager saves as one process (rank 0 of world size 1), as Lightning's checkpoint is the full state that
global rank 0 writes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

import ckptd
from ckptd.errors import CkptdError, CommitError, ConfigError, FormatError, NotFoundError
from ckptd.plugins.fallback import restore_pointed_step
from ckptd.plugins.lightning.pointer import Pointer, pointers_beside, read_pointer, remove_pointer, write_pointer
from ckptd.plugins.lightning.retention import PointerRetention

log = logging.getLogger("ckptd.plugins.lightning")


def _path_key(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.normpath(os.path.abspath(text))


def _plain_state_root(path: str | os.PathLike[str]) -> str:
    """The ckptd root of a plain state dict saved at ``path`` (see :meth:`CkptdCheckpointIO.save_checkpoint`)."""
    return _path_key(path) + ".ckptd"


def _distributed_world() -> int:
    """The size of the default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((key, _to_device(child, device)) for key, child in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(child, device) for child in value)
    return value


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptd to ``local`` (then ``remote``) and restores
    from the nearest intact tier (see the module docstring)::

        io = CkptdCheckpointIO("/nvme/ckpt/run1", remote="s3://bucket/run1")
        trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_train_steps=100, save_last=True)])
        trainer.fit(model, datamodule=data, ckpt_path="last")

    ``storage_options`` go to s3fs (endpoint, credentials). ``codec``, ``capture_rng``,
    ``allow_pickle``, ``daemon`` and ``repopulate_local`` are those of :class:`ckptd.CheckpointManager`;
    ``remote_every_steps`` promotes only the global steps that are multiples of it (default: every one).
    The manager is opened on first use and closed by :meth:`teardown`.
    """

    def __init__(self, local: str | os.PathLike[str], *, remote: str | None = None,
                 storage_options: dict[str, Any] | None = None, codec: str | None = None,
                 capture_rng: bool = True, allow_pickle: bool = False, daemon: str | None = None,
                 repopulate_local: bool = False, remote_every_steps: int | None = None) -> None:
        super().__init__()
        self.local = os.fspath(local)
        self.remote = remote
        self.capture_rng = capture_rng
        self._manager_options: dict[str, Any] = {
            "remote": remote, "storage_options": storage_options, "codec": codec, "capture_rng": capture_rng,
            "allow_pickle": allow_pickle, "daemon": daemon, "repopulate_local": repopulate_local}
        self._retention = PointerRetention()
        self._policy = ckptd.Policy(every_steps=1, remote_every_steps=remote_every_steps,
                                    keep_local=self._retention, keep_remote=self._retention)
        self._manager: ckptd.CheckpointManager | None = None
        self._steps_here: dict[int, frozenset[str]] = {}  # saved or loaded here (their top-level keys)
        self._other_tiers_steps: dict[int, str] | None = None  # committed on the peer/object tiers, at first save
        self._pointer_dirs: set[str] = set()  # directories whose earlier pointers the retention knows

    @property
    def manager(self) -> ckptd.CheckpointManager:
        """The CheckpointManager behind this plugin (opened now if it is not open)."""
        if self._manager is None:
            self._manager = ckptd.CheckpointManager(self.local, policy=self._policy, rank=0, world_size=1,
                                                    **self._manager_options)
        return self._manager

    def __getstate__(self) -> dict[str, Any]:  # strategies that spawn copy their plugins: no open manager
        state = dict(self.__dict__)
        state["_manager"] = None
        return state

    # --- Lightning's CheckpointIO ------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as ckptd step ``checkpoint["global_step"]`` and write the pointer at ``path``;
        returns once the state is staged (the write and the upload run in the background)."""
        if storage_options is not None:
            raise ConfigError("CkptdCheckpointIO takes no storage_options per save",
                              hint="pass storage_options= (s3fs options) to CkptdCheckpointIO itself")
        if "global_step" not in checkpoint:
            self._save_plain_state(checkpoint, path)
            return
        step = int(checkpoint["global_step"])
        manager = self.manager
        stored = self._steps_here.get(step)
        if stored is None:
            if step in manager.committed_steps():
                raise CommitError(f"global step {step} is committed already by an earlier run and is never "
                                  f"overwritten", step=step, path=self.local,
                                  hint="resume from the newest checkpoint (ckpt_path='last') or use a new directory")
            elsewhere = self._steps_on_other_tiers(manager).get(step)
            if elsewhere is not None:
                raise CommitError(f"global step {step} is committed already on the {elsewhere} tier by an earlier run "
                                  f"(the local directory does not hold it: a lost node?) and is never overwritten",
                                  step=step, path=self.local,
                                  hint="resume from it: keep ModelCheckpoint's dirpath on storage that outlives the "
                                       "node and pass ckpt_path='last'; `ckptd ls` lists the steps; or use a "
                                       "new directory")
            manager.save(step, checkpoint, force=True)
            self._steps_here[step] = frozenset(checkpoint)
        elif not set(checkpoint) <= stored:  # a weights-only save came first: this one cannot share its step
            raise CommitError(f"global step {step} is saved already without {sorted(set(checkpoint) - stored)}; "
                              f"{os.fspath(path)} cannot point to it", step=step, path=self.local,
                              hint="make weights-only copies with `ckptd export` or torch.save, not through the "
                                   "Trainer at a step ModelCheckpoint also saves")
        self._learn_pointers_beside(path)
        epoch = checkpoint.get("epoch")
        write_pointer(path, Pointer(step=step, epoch=epoch if isinstance(epoch, int) else None,
                                    local=os.path.abspath(self.local), remote=self.remote))
        self._retention.point(_path_key(path), step)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint the pointer at ``path`` names, read from the nearest intact tier and verified.
        ``weights_only`` changes nothing: ckptd unpickles nothing unless built with ``allow_pickle=True``.
        Every rank of a process group calls it; rank 0 reads, the others receive (see the module docstring)."""
        if _distributed_world() > 1:
            state = self._load_on_rank_zero(path)
        else:
            state = self._load_here(path)
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
            state = _to_device(state, torch.device(map_location))
        return state

    @classmethod
    def read_pointed(cls, path: str | os.PathLike[str], pointer: Pointer | None = None,
                     map_location: Any | None = None) -> dict[str, Any]:
        """The checkpoint the pointer at ``path`` names, read by this process alone from the tiers the pointer
        names (its ``local`` root, then its ``remote``, with s3fs's default credentials): for reading a
        checkpoint outside the training job, as ``Model.load_from_checkpoint(path)`` does (see
        :mod:`ckptd.plugins.lightning.loading`). Deletes nothing."""
        pointer = read_pointer(path) if pointer is None else pointer
        if pointer.local is None:
            raise FormatError(f"{os.fspath(path)} names ckptd step {pointer.step} but not the ckptd root holding it",
                              path=os.fspath(path),
                              hint="read it with CkptdCheckpointIO(<the root the run saved to>).load_checkpoint(path)")
        local, scratch = pointer.local, None
        if not os.path.isdir(local):  # another machine's root: read the remote through a scratch root
            if pointer.remote is None:
                raise NotFoundError(f"{os.fspath(path)} names ckptd step {pointer.step} in {local}, which is not "
                                    "on this machine, and no remote tier", path=os.fspath(path), step=pointer.step,
                                    hint="read it where the run saved it, or copy the root here (`ckptd restore`)")
            local = scratch = tempfile.mkdtemp(prefix="ckptd-read-pointed-")
        io = cls(local, remote=pointer.remote, capture_rng=False)  # the caller's RNG is not the training's
        try:
            state = io._load_here(path)
        finally:
            io.teardown()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
            state = _to_device(state, torch.device(map_location))
        return state

    def _load_on_rank_zero(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        import torch.distributed as dist

        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = ("ok", self._load_here(path))
            except Exception as error:  # the other ranks wait in the broadcast: they must hear of it
                box[0] = ("error", f"rank 0 could not load the checkpoint: {error}")
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        outcome, value = box[0]
        if outcome != "ok":
            raise CkptdError(value, path=os.fspath(path))
        return value

    def _load_here(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        pointer = read_pointer(path)
        if pointer.kind == "state":
            return self._load_plain_state(pointer, path)
        manager = self.manager
        state: dict[str, Any] = {}
        step = self._restore(manager, state, pointer.step, path)
        self._steps_here[step] = frozenset(state)
        self._learn_pointers_beside(path)
        self._retention.point(_path_key(path), step)
        report = manager.last_restore
        log.info("restored Lightning checkpoint %s from ckptd step %d (tiers: %s)", os.fspath(path), step,
                 ", ".join(report.tiers) if report is not None else "?")
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the pointer at ``path``; its step leaves the tiers once no other path points to it."""
        root = _plain_state_root(path)
        if os.path.isdir(root):  # a plain state dict's own root goes with its pointer
            shutil.rmtree(root)
        remove_pointer(path)
        self._retention.unpoint(_path_key(path))

    def teardown(self) -> None:
        """Wait for pending writes and uploads and release the tiers (reopened on next use)."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    # --- helpers -----------------------------------------------------------------------------------
    def _plain_manager(self, root: str) -> ckptd.CheckpointManager:
        options = self._manager_options
        return ckptd.CheckpointManager(root, rank=0, world_size=1, capture_rng=False, codec=options["codec"],
                                       allow_pickle=options["allow_pickle"])

    def _save_plain_state(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """A dict that is no trainer checkpoint: step 0 of its own root beside ``path``, committed on return."""
        if "://" in os.fspath(path):
            raise ConfigError(f"{os.fspath(path)}: a state dict that is not a Lightning checkpoint (no global_step) "
                              f"is saved to a local path only", path=os.fspath(path),
                              hint="save the trainer's checkpoint (trainer.save_checkpoint) or use a local path")
        root = _plain_state_root(path)
        if os.path.isdir(root):
            shutil.rmtree(root)  # an earlier plain state saved at this path: the pointer names the new one
        manager = self._plain_manager(root)
        try:
            manager.save(0, state, force=True)
        finally:
            manager.close()
        write_pointer(path, Pointer(step=0, local=root, kind="state"))

    def _load_plain_state(self, pointer: Pointer, path: str | os.PathLike[str]) -> dict[str, Any]:
        root = _plain_state_root(path)
        if not os.path.isdir(root):
            raise NotFoundError("the state dict this pointer names is gone", path=root,
                                hint="it is kept beside the pointer, as <path>.ckptd")
        manager = self._plain_manager(root)
        try:
            state: dict[str, Any] = {}
            self._restore(manager, state, pointer.step, path)
        finally:
            manager.close()
        return state

    def _steps_on_other_tiers(self, manager: ckptd.CheckpointManager) -> dict[int, str]:
        """The steps the peer and object tiers held committed when this process first saved (earlier runs'
        steps: this process's own are in ``_steps_here``); a tier that cannot answer counts as empty."""
        if self._other_tiers_steps is None:
            found: dict[int, str] = {}
            for tier in manager.tiers[1:]:
                try:
                    steps = tier.committed_steps()
                except CkptdError as error:
                    log.warning("could not list the committed steps of %s: %s", tier, error)
                    continue
                for step in steps:
                    found.setdefault(step, getattr(tier, "kind", None) or type(tier).__name__)
            self._other_tiers_steps = found
        return self._other_tiers_steps

    def _learn_pointers_beside(self, path: str | os.PathLike[str]) -> None:
        """Once per directory: the pointers an earlier run left there that name steps of this root count for
        retention like this process's own (a step they name is kept; removing them releases it)."""
        directory = os.path.dirname(_path_key(path))
        if directory in self._pointer_dirs:
            return
        self._pointer_dirs.add(directory)
        here = _path_key(self.local)
        for other, pointer in pointers_beside(path):
            key = _path_key(other)
            if self._retention.step_of(key) is None and (pointer.local is None or _path_key(pointer.local) == here):
                self._retention.point(key, pointer.step)

    @staticmethod
    def _restore(manager: ckptd.CheckpointManager, state: dict[str, Any], step: int,
                 path: str | os.PathLike[str]) -> int:
        def emptied() -> dict[str, Any]:
            state.clear()
            return state

        return restore_pointed_step(manager, emptied, step, path)
