"""``accelerate``'s ``save_state``/``load_state`` through ckptd: :class:`CkptdAccelerate`.

Use, in the shape of accelerate's checkpointing example (its defaults: ``DataLoader(shuffle=True)``, nothing
else)::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    hooks = CkptdAccelerate(accelerator, "/nvme/ckpt/run1", remote="s3://bucket/run1", step=lambda: overall_step)
    overall_step = hooks.restore() or 0                      # the newest step, verified, no pickle, no directory
    starting_epoch = overall_step // len(loader)
    for epoch in range(starting_epoch, num_epochs):
        for batch in loader:                                 # a resumed epoch goes on with the next batch
            ...
            overall_step += 1
            if overall_step % checkpointing_steps == 0:
                accelerator.save_state(f"out/step_{overall_step}")   # only ckptd-step.json is written there

    hooks.restore(100)                                       # a given step
    hooks.restore("out/step_100")                            # the step save_state noted there (or an older one)

**Saving.** ``accelerator.save_state`` is replaced on this accelerator instance (:meth:`CkptdAccelerate.remove`
puts accelerate's back): it stages everything accelerate tracks as one ckptd step (the prepared models,
optimizers, schedulers, the gradient scaler, the objects registered with ``register_for_checkpointing``,
each prepared dataloader's position, accelerate's counters and the RNG states) and writes only the step
marker ``ckptd-step.json`` into the output directory; ckptd writes, verifies, commits and promotes the step
in the background. The directory is named as accelerate names it (``ProjectConfiguration``'s automatic
naming and ``total_limit`` included) and returned. Other ``register_save_state_pre_hook`` hooks still run.
Under FSDP, DeepSpeed and Megatron-LM accelerate's own ``save_state`` runs, with a pre-hook that stages the
same step and takes the model weights out of accelerate's write (accelerate writes its other files there).

**The data position.** Each prepared dataloader is saved with its position: ckptd notes, when each epoch's
iterator starts, the random states the epoch's order is drawn from (the global torch generator, the
sampler's and the loader's generators: what ``shuffle=True`` depends on) and counts the batches handed out.
A restore puts the epoch back (``set_epoch``), and the loader's next iterator draws the same order and skips
the batches already trained on (they are loaded again and dropped, so a dataset that draws random numbers in
its workers gets the same ones; not with ``persistent_workers``, whose new workers cannot get the old ones'
seeds), then the generators go back to their saved states. With ``use_stateful_dataloader``
(``DataLoaderConfiguration``) the loader's own state is saved too and it skips by itself; ckptd still gives
its iterator the epoch's random states (its fast-forward draws the order again). ``for batch in loader``
thus continues with the next batch: no ``accelerator.skip_first_batches`` (it builds another loader, which
draws a new order). A loader whose position cannot be captured (accelerate's ``DataLoaderDispatcher``
without ``use_stateful_dataloader``) is named in a warning at the first save
(:func:`ckptd.data.warn_unresumable_loader`).

**Resuming.** :meth:`CkptdAccelerate.restore` reads only ckptd's verified step and needs no accelerate
directory (the node lost its disk: the step comes from the object tier). Given an output directory it reads
the step its ``ckptd-step.json`` names; when no tier holds that step intact (the process died before it
committed) it warns, naming the directory, the step and the step it goes back to, and restores the newest
older committed step, as every ckptd integration does (:mod:`ckptd.plugins.fallback`).
``accelerator.load_state(directory)`` of a directory holding only the marker does the same. A directory that
holds accelerate's own files (saved without ckptd's ``save_state``) would be unpickled after the load
pre-hook (``custom_checkpoint_N.pkl`` with ``weights_only=False``, whatever the caller asks) and loaded over
ckptd's values, so that is refused with :class:`ckptd.errors.PickleRefusedError` (naming the step and the
files, before anything is read) unless the caller opted in with ``allow_pickle=True``.

:meth:`CkptdAccelerate.save` stages the same step without any directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ckptd
from ckptd.errors import ConfigError, FormatError, NotFoundError, PickleRefusedError, ResumeMismatchError
from ckptd.plugins.fallback import restore_pointed_step
from ckptd.plugins.huggingface.random_states import RandomStates
from ckptd.plugins.huggingface.requirements import require
from ckptd.data import warn_unresumable_loader

require("accelerate", needed_by="ckptd.plugins.huggingface.CkptdAccelerate")

from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

log = logging.getLogger("ckptd.plugins.huggingface")

#: The file in an accelerate output directory that names the ckptd step saved with it.
STEP_FILE = "ckptd-step.json"
#: What ``accelerator.load_state`` reads with ``torch.load`` (pickle) after the load pre-hook.
_PICKLED_FILES = ("optimizer*.bin", "scheduler*.bin", "sampler*.bin", "dl_state_dict*.bin", "scaler.pt",
                  "random_states_*.pkl", "custom_checkpoint_*.pkl")
#: Where accelerate saves through its own ``save_state`` (the pre-hook path): it writes the model shards itself.
_OWN_SAVING = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


# --- the data position ------------------------------------------------------------------------
@dataclass
class _Epoch:
    """One iterator of a prepared loader: the states its order was drawn from, and how far it got."""

    epoch: int
    torch_state: torch.Tensor
    generators: list[torch.Tensor]
    produced: int = 0  # batches the torch DataLoader handed to accelerate (one ahead of the training loop)
    exhausted: bool = False
    reused: bool = False  # the epoch ran on the persistent workers of an earlier epoch


@dataclass
class _Replay:
    """What the first iterator after a restore does: draw the order from ``torch_state``/``generators``
    and skip ``skip`` batches."""

    epoch: int
    skip: int
    torch_state: torch.Tensor
    generators: list[torch.Tensor] = field(default_factory=list)
    reused: bool = False


def _innermost_sampler(loader: Any) -> Any:
    """The sampler under accelerate's batch samplers (``BatchSamplerShard`` wraps the user's ``BatchSampler``)."""
    batch_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    while hasattr(batch_sampler, "batch_sampler"):
        batch_sampler = batch_sampler.batch_sampler
    return getattr(batch_sampler, "sampler", None)


class _TrackedLoader:
    """Takes the place of a prepared loader's ``base_dataloader`` (the torch DataLoader accelerate iterates):
    notes the random states each epoch's order is drawn from and counts the batches it hands out, and
    replays an epoch after a restore. Everything else is the DataLoader's."""

    def __init__(self, inner: Any, shard: Any) -> None:
        self._inner = inner
        self._shard = shard
        self._current: _Epoch | None = None
        self._pending: _Replay | None = None
        self._seed_aside = False  # the run being resumed kept its persistent workers: see _iterate

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(loader, DataLoader) stays True, as accelerate wants
        return self._inner.__class__

    def __len__(self) -> int:
        return len(self._inner)

    def __reduce_ex__(self, protocol: Any) -> Any:  # a pickled or copied loader is the plain DataLoader
        return self._inner.__reduce_ex__(protocol)

    def generators(self) -> list[torch.Generator]:
        """The generators the order is drawn from besides the global one: the sampler's and the loader's
        (the workers' base seed). A ``SeedableRandomSampler`` seeds its own from the epoch."""
        found: list[torch.Generator] = []
        sampler = _innermost_sampler(self._inner)
        owners = [self._inner] if isinstance(sampler, SeedableRandomSampler) else [sampler, self._inner]
        for owner in owners:
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
                found.append(generator)
        return found

    def __iter__(self) -> Iterator[Any]:
        replay, self._pending = self._pending, None
        epoch = int(self._shard.iteration)
        if replay is not None and replay.epoch != epoch:  # the user moved to another epoch (set_epoch)
            replay = None
        if replay is None:
            record = _Epoch(epoch, torch.get_rng_state(), [g.get_state() for g in self.generators()],
                            reused=self._keeps_workers())
            self._current = record
            seed_aside, self._seed_aside = self._seed_aside, False
            return self._count(self._iterate(seed_aside), record)
        generators = self.generators()
        if len(generators) != len(replay.generators):
            raise ResumeMismatchError(
                f"the restored data position of epoch {replay.epoch} was drawn from {len(replay.generators)} "
                f"generator(s), the live loader has {len(generators)}",
                hint="build the DataLoader as when saving (the same generator= and sampler)")
        kept_torch, kept = torch.get_rng_state(), [g.get_state() for g in generators]

        def put_back_kept() -> None:
            torch.set_rng_state(kept_torch)
            for generator, state in zip(generators, kept):
                generator.set_state(state)

        torch.set_rng_state(replay.torch_state)
        for generator, state in zip(generators, replay.generators):
            generator.set_state(state)
        record = _Epoch(epoch, replay.torch_state, list(replay.generators), reused=replay.reused)
        self._current = record
        self._seed_aside = False
        batches = self._count(self._iterate(replay.reused), record)
        if not replay.skip:  # a sampler may draw at the first batch (one process, or a stateful loader's skip)
            return self._then(batches, put_back_kept)
        try:
            for _ in range(replay.skip):
                next(batches)
        except StopIteration:
            raise ResumeMismatchError(
                f"the restored data position is batch {replay.skip} of epoch {epoch}, but the loader has only "
                f"{record.produced} batches",
                hint="resume with the dataset and batch size the run saved with") from None
        finally:
            put_back_kept()
        return batches

    def _keeps_workers(self) -> bool:
        """Whether the next iterator runs on the workers of an earlier one (``persistent_workers``)."""
        inner = self._inner
        return bool(inner.persistent_workers and inner.num_workers > 0 and getattr(inner, "_iterator", None)
                    is not None and not getattr(self._shard, "use_stateful_dataloader", False))

    def _iterate(self, seed_aside: bool) -> Iterator[Any]:
        """``iter()`` of the DataLoader. ``seed_aside``: where the run being resumed kept its persistent workers
        (their seeds were drawn once, at its first epoch), new workers draw their base seed from a generator of
        their own, so that the epoch's order is drawn from the same state as in that run."""
        inner = self._inner
        if not seed_aside or getattr(inner, "_iterator", None) is not None:
            return iter(inner)
        generator = inner.generator
        inner.generator = torch.Generator()
        try:
            return iter(inner)
        finally:
            inner.generator = generator

    @staticmethod
    def _then(batches: Iterator[Any], after_first: Callable[[], None]) -> Iterator[Any]:
        """``batches``, calling ``after_first`` once the first one was drawn (or there was none)."""
        try:
            first = next(batches)
        except StopIteration:
            return
        finally:
            after_first()
        yield first
        yield from batches

    @staticmethod
    def _count(batches: Iterator[Any], record: _Epoch) -> Iterator[Any]:
        for batch in batches:
            record.produced += 1
            yield batch
        record.exhausted = True

    def position(self, *, skip: bool = True) -> dict[str, Any]:
        """Where the training loop stands: the epoch and, within it, the replay that gets back there
        (``skip=False``: a loader that positions itself; the replay only draws the same order)."""
        iteration = int(self._shard.iteration)
        generators = [g.get_state() for g in self.generators()]
        replay, record = self._pending, self._current
        if replay is None and record is not None:
            if record.exhausted:  # the last batch was handed out: the next iterator starts the next epoch
                iteration = record.epoch + 1 if iteration == record.epoch else iteration
            else:  # accelerate fetches one batch ahead of the one the loop holds
                replay = _Replay(record.epoch, max(record.produced - 1, 0) if skip else 0, record.torch_state,
                                 record.generators, record.reused)
        if replay is None:
            return {"iteration": iteration, "generators": generators, "replay": None,
                    "workers_kept": record is not None and self._keeps_workers()}
        return {"iteration": replay.epoch, "generators": generators,
                "replay": {"skip": replay.skip, "torch": replay.torch_state, "generators": list(replay.generators),
                           "reused": replay.reused}}

    def put_back(self, state: dict[str, Any]) -> None:
        """Set the generators to their saved states and replay the saved epoch at the next iterator."""
        generators = self.generators()
        saved = list(state.get("generators") or [])
        if saved and len(saved) != len(generators):
            raise ResumeMismatchError(
                f"the checkpoint holds {len(saved)} data loader generator state(s), the live loader has "
                f"{len(generators)}", hint="build the DataLoader as when saving (the same generator= and sampler)")
        for generator, value in zip(generators, saved):
            generator.set_state(value)
        replay = state.get("replay")
        self._current = None
        self._seed_aside = bool(state.get("workers_kept"))
        self._pending = None if replay is None else _Replay(
            int(state["iteration"]), int(replay["skip"]), replay["torch"], list(replay.get("generators") or []),
            bool(replay.get("reused")))


def _tracked(loader: Any) -> _TrackedLoader | None:
    """The tracker of a prepared loader (installed on first sight), None when its position cannot be
    captured that way (a dispatcher reads on process 0 only)."""
    if type(loader) is not DataLoaderShard:
        return None
    base = loader.base_dataloader
    if isinstance(base, _TrackedLoader):
        return base
    if not isinstance(base, torch.utils.data.DataLoader):  # torchdata's StatefulDataLoader is one
        return None
    tracker = _TrackedLoader(base, loader)
    loader.base_dataloader = tracker
    return tracker


def _untrack(loader: Any) -> None:
    base = getattr(loader, "__dict__", {}).get("base_dataloader")
    if isinstance(base, _TrackedLoader):
        loader.base_dataloader = base._inner


class _LoaderPosition:
    """A prepared dataloader's position as a state item (see the module docstring): its epoch
    (``iteration``), ckptd's replay of the epoch and, with ``use_stateful_dataloader``, the loader's own state."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def state_dict(self) -> dict[str, Any]:
        stateful = bool(getattr(self.loader, "use_stateful_dataloader", False))
        tracker = _tracked(self.loader)
        if tracker is not None:  # a stateful loader skips itself, but draws its order again when it resumes
            return tracker.position(skip=not stateful) | ({"loader": self.loader.state_dict()} if stateful else {})
        if stateful:
            return {"iteration": int(getattr(self.loader, "iteration", 0)), "loader": self.loader.state_dict()}
        why = ("accelerate's DataLoaderDispatcher (dispatch_batches) reads every batch on process 0"
               if type(self.loader) is DataLoaderDispatcher else
               f"ckptd does not track the batches a {type(self.loader).__name__} hands out")
        warn_unresumable_loader(self.loader, self.name, why + " and keeps no position of its own; with accelerate, "
                                "DataLoaderConfiguration(use_stateful_dataloader=True) saves it")
        return {"iteration": int(getattr(self.loader, "iteration", 0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(state["iteration"]))
        if "loader" in state:
            self.loader.load_state_dict(state["loader"])
        tracker = _tracked(self.loader)
        if tracker is not None:
            tracker.put_back(state)


class _Counters:
    """Accelerate's own counters: ``step`` (gradient accumulation) and the save ``iteration``."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.saving = False  # inside save_state: its iteration is counted up after the state is taken

    def state_dict(self) -> dict[str, int]:
        iteration = self.accelerator.project_configuration.iteration
        return {"step": int(self.accelerator.step), "iteration": int(iteration) + (1 if self.saving else 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = int(state["step"])
        self.accelerator.project_configuration.iteration = int(state["iteration"])


def _checkpoint_number(folder: str) -> int:
    """accelerate's order of its automatically named folders: the last number in the name."""
    numbers = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)
    return int(numbers[0]) if numbers else -1


class CkptdAccelerate:
    """Routes ``accelerator.save_state()``/``load_state()`` through ckptd (see the module docstring).

    ``local`` is ckptd's local tier, ``remote`` (``s3://bucket/prefix``) the object tier and
    ``storage_options`` reach it; ``policy`` decides what each tier keeps. Other keyword arguments go to
    :class:`ckptd.CheckpointManager`; ``manager=`` uses one made elsewhere instead. The manager's
    ``allow_pickle`` (``allow_pickle=True`` here) also lets ``accelerator.load_state()`` unpickle accelerate's
    own files in a directory saved without ckptd. ``step`` returns the ckptd step of a save (e.g. the training
    step); by default saves are numbered 1, 2, ... (accelerate's save iteration plus one). Construction
    replaces ``save_state``/``load_state`` on this accelerator, registers the pre-hooks and starts tracking
    the prepared dataloaders; :meth:`remove` undoes all of it. Construct it after ``accelerator.prepare`` and
    before the first epoch (the objects are looked up at each save and load, so later registrations count
    as well; a loader prepared later is tracked from its next epoch).
    """

    def __init__(self, accelerator: Any, local: str | os.PathLike[str] | None = None, *, remote: str | None = None,
                 storage_options: dict[str, Any] | None = None, policy: ckptd.Policy | None = None,
                 manager: Any = None, step: Callable[[], int] | None = None, **manager_options: Any) -> None:
        if manager is None:
            if local is None:
                raise ConfigError("CkptdAccelerate needs a local directory (or manager=)",
                                  hint="CkptdAccelerate(accelerator, '/nvme/ckpt/run1', remote='s3://bucket/run1')")
            manager = ckptd.CheckpointManager(local, remote=remote, storage_options=storage_options,
                                              policy=policy or ckptd.Policy(every_steps=1), capture_rng=False,
                                              **manager_options)
        elif local is not None or remote is not None:
            raise ConfigError("CkptdAccelerate takes either manager= or local=/remote=, not both")
        self.accelerator = accelerator
        #: The ckptd manager every save and restore goes through.
        self.manager = manager
        self._step = step
        self._counters = _Counters(accelerator)
        self._random_states = RandomStates()
        self._handles = [accelerator.register_save_state_pre_hook(self._before_save),
                         accelerator.register_load_state_pre_hook(self._before_load)]
        self._wrapped: dict[str, Callable[..., Any]] = {}
        if accelerator.distributed_type not in _OWN_SAVING:
            self._wrapped = {"save_state": self._save_state, "load_state": self._load_state}
            for name, method in self._wrapped.items():
                setattr(accelerator, name, method)
        for loader in accelerator._dataloaders:
            _tracked(loader)

    # --- the state accelerate tracks ----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        accelerator = self.accelerator
        state: dict[str, Any] = {
            "models": {str(i): model for i, model in enumerate(accelerator._models)},
            "optimizers": {str(i): optimizer for i, optimizer in enumerate(accelerator._optimizers)},
            "schedulers": {str(i): scheduler for i, scheduler in enumerate(accelerator._schedulers)},
            "dataloaders": {str(i): _LoaderPosition(loader, f"accelerator dataloader {i}")
                            for i, loader in enumerate(accelerator._dataloaders)},
            "objects": {str(i): obj for i, obj in enumerate(accelerator._custom_objects)},
            "accelerate": self._counters,
            "rng": self._random_states,
        }
        if accelerator.scaler is not None:
            state["scaler"] = accelerator.scaler
        return state

    def _next_step(self) -> int:
        if self._step is not None:
            return int(self._step())
        return int(self.accelerator.project_configuration.iteration) + 1

    # --- saving -------------------------------------------------------------------------------
    def save(self, step: int | None = None) -> int:
        """Stage everything accelerate tracks as ckptd step ``step`` (default: see ``step=``) and return it;
        nothing of accelerate's is written. Returns once the state is in host memory."""
        step = self._next_step() if step is None else step
        self.manager.save(step, self._state(), force=True)
        return step

    def _save_in_iteration(self) -> int:
        self._counters.saving = True
        try:
            return self.save()
        finally:
            self._counters.saving = False

    def _save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                    **save_model_func_kwargs: Any) -> str:
        """``accelerator.save_state`` through ckptd: the step is staged, only its marker is written to the
        directory accelerate would have used, which is returned."""
        accelerator = self.accelerator
        directory = self._output_dir(output_dir)
        others = [hook for hook in accelerator._save_model_state_pre_hook.values() if hook != self._before_save]
        if others:  # their contract: the models, their weights and the directory (ckptd saves the weights)
            weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
            for hook in others:
                hook(accelerator._models, weights, directory)
        step = self._save_in_iteration()
        if self._writes_marker():
            _write_marker(directory, step)
        accelerator.project_configuration.iteration += 1
        log.info("accelerate save_state: step %d staged for ckptd, only %s written to %s", step, STEP_FILE, directory)
        return directory

    def _writes_marker(self) -> bool:
        accelerator = self.accelerator
        if accelerator.project_configuration.save_on_each_node:
            return bool(accelerator.is_local_main_process)
        return bool(accelerator.is_main_process)

    def _output_dir(self, output_dir: str | os.PathLike[str] | None) -> str:
        """The directory accelerate's ``save_state`` would use, made as it makes it; with automatic naming
        the oldest folders beyond ``total_limit`` are removed first, as accelerate removes them."""
        accelerator = self.accelerator
        project = accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            output_dir = os.path.join(accelerator.project_dir, "checkpoints")
        if output_dir is None:
            raise ConfigError("accelerator.save_state() needs an output directory",
                              hint="pass one, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        output_dir = os.fspath(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        if project.automatic_checkpoint_naming:
            folders = sorted((os.path.join(output_dir, name) for name in os.listdir(output_dir)),
                             key=_checkpoint_number)
            if project.total_limit is not None and len(folders) + 1 > project.total_limit \
                    and accelerator.is_main_process:
                for folder in folders[: len(folders) + 1 - project.total_limit]:
                    shutil.rmtree(folder)
            output_dir = os.path.join(output_dir, f"checkpoint_{accelerator.save_iteration}")
            if os.path.isdir(output_dir) and all(name == STEP_FILE or name.startswith(".")
                                                 for name in os.listdir(output_dir)):
                # ckptd's marker of a step this run saves again (a resume went back past it): the same iteration
                log.info("%s is reused: it held only ckptd's marker of an earlier save at this iteration", output_dir)
            elif os.path.exists(output_dir):
                raise ConfigError(f"checkpoint directory {output_dir} ({accelerator.save_iteration}) already exists",
                                  path=output_dir, hint="set accelerator.project_configuration.iteration to the "
                                  "save iteration to start with, as accelerate asks")
            accelerator.wait_for_everyone()
        os.makedirs(output_dir, exist_ok=True)
        return output_dir

    def _before_save(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        """accelerate's own ``save_state`` (FSDP, DeepSpeed, Megatron-LM, or called on the class): stage the
        step, keep the weights out of accelerate's write and note the step."""
        step = self._save_in_iteration()
        weights.clear()  # accelerate's documented way to take over model saving: it writes no weights file
        _write_marker(output_dir, step)
        log.info("accelerate save_state: step %d staged for ckptd, no weights written to %s", step, output_dir)

    # --- restoring ----------------------------------------------------------------------------
    def restore(self, step: int | str | os.PathLike[str] | None = None) -> int | None:
        """Load the newest intact step (or ``step``) into everything accelerate tracks, from the nearest tier,
        and set the RNG states; returns the step, or None when ckptd holds none. Needs no accelerate directory.
        Each prepared dataloader goes back to its epoch, and its next iterator continues with the batch after
        the last one trained on.

        ``step`` may be an output directory of ``save_state``: the step its ``ckptd-step.json`` names, or, when
        no tier holds that one intact, the newest older committed step, with a warning (NotFoundError when
        there is none). A step number given as an int is restored exactly or raises NotFoundError."""
        if isinstance(step, (str, os.PathLike)):
            restored: int | None = restore_pointed_step(self.manager, self._state, saved_step(step),
                                                        Path(step, STEP_FILE))
        else:
            restored = self.manager.restore(self._state(), step=step)
        if restored is not None:
            self._random_states.apply()
            log.info("step %d restored from ckptd tier(s) %s", restored,
                     ", ".join(self.manager.last_restore.tiers) if self.manager.last_restore else "")
        return restored

    def _load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
                    **load_model_func_kwargs: Any) -> None:
        """``accelerator.load_state`` through ckptd: a directory holding only ckptd's marker is
        ``restore(directory)``; one with accelerate's files goes to accelerate (and the load pre-hook)."""
        accelerator = self.accelerator
        original = type(accelerator).load_state.__get__(accelerator)
        if input_dir is None and accelerator.project_configuration.automatic_checkpoint_naming:
            folders = os.path.join(accelerator.project_dir, "checkpoints")
            found = sorted((os.path.join(folders, name) for name in os.listdir(folders)), key=_checkpoint_number) \
                if os.path.isdir(folders) else []
            input_dir = found[-1] if found else None
        if input_dir is not None:
            directory = Path(os.path.expanduser(os.fspath(input_dir)))
            if (directory / STEP_FILE).is_file() and not _pickled_files(directory):
                self.restore(directory)
                return None
        return original(input_dir, load_kwargs, **load_model_func_kwargs)

    def _before_load(self, models: list[Any], input_dir: str) -> None:
        marker = Path(input_dir, STEP_FILE)
        if not marker.is_file():
            raise ResumeMismatchError(f"{input_dir} was not saved through ckptd (it has no {STEP_FILE})",
                                      path=str(marker), hint="load it without CkptdAccelerate, or call "
                                      "CkptdAccelerate.restore() to resume from ckptd's newest step")
        step = saved_step(input_dir)
        if not self.manager.allow_pickle:
            pickled = _pickled_files(Path(input_dir))
            raise PickleRefusedError(
                f"accelerator.load_state({str(input_dir)!r}) would unpickle accelerate's own files after ckptd "
                f"restored step {step} ({', '.join(pickled) or 'none there yet'}) and load them over it",
                path=str(input_dir), step=step,
                hint=f"call CkptdAccelerate.restore({step}) instead (ckptd's verified step, no pickle; "
                     f"restore({str(input_dir)!r}) goes back to an older step when that one is lost), or pass "
                     "allow_pickle=True to CkptdAccelerate to let accelerate read its files")
        try:
            self.restore(step)
        except NotFoundError as error:  # accelerate's files there are of that step: no fallback under them
            raise NotFoundError(f"accelerator.load_state({str(input_dir)!r}): {error.message}", step=step,
                                path=str(marker), tier=error.tier,
                                hint=f"CkptdAccelerate.restore({str(input_dir)!r}) goes back to the newest older "
                                     "committed step, with a warning (without accelerate's files)") from error
        models.clear()  # loaded: accelerate reads no weights file

    # --- lifecycle ----------------------------------------------------------------------------
    def remove(self) -> None:
        """Unregister the hooks, give the accelerator its own ``save_state``/``load_state`` back and stop
        tracking the dataloaders (they work as without ckptd again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for name, method in self._wrapped.items():
            if self.accelerator.__dict__.get(name) is method:
                delattr(self.accelerator, name)
        self._wrapped = {}
        for loader in self.accelerator._dataloaders:
            _untrack(loader)

    def close(self) -> None:
        """Unregister the hooks, wait for pending writes and uploads and release the manager."""
        self.remove()
        self.manager.close()


def _pickled_files(directory: Path) -> list[str]:
    """accelerate's files in ``directory`` that its ``load_state`` unpickles."""
    return sorted(path.name for pattern in _PICKLED_FILES for path in directory.glob(pattern))


def _write_marker(directory: str | os.PathLike[str], step: int) -> None:
    """``ckptd-step.json`` naming ``step``, written whole and durably (a reader never sees half of it)."""
    ckptd.write_file_atomically(Path(directory, STEP_FILE), (json.dumps({"step": step}) + "\n").encode("utf-8"),
                                what="accelerate's ckptd step marker", hint="check that the output directory is "
                                "writable")


def saved_step(output_dir: str | os.PathLike[str]) -> int:
    """The ckptd step that ``save_state`` noted in ``output_dir`` (its ``ckptd-step.json``)."""
    marker = Path(output_dir, STEP_FILE)
    try:
        body = json.loads(marker.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise NotFoundError(f"{output_dir} holds no {STEP_FILE}: it was not saved through CkptdAccelerate",
                            path=str(marker), hint="pass a directory accelerator.save_state() wrote with "
                            "CkptdAccelerate registered, or a step number") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{STEP_FILE} cannot be read: {exc}", path=str(marker),
                          hint="the directory was damaged; restore a step number instead") from exc
    step = body.get("step") if isinstance(body, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"{STEP_FILE} names no step", path=str(marker),
                          hint="the directory was damaged; restore a step number instead")
    return step
