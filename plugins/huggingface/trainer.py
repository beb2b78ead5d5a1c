"""``transformers.Trainer`` checkpoints through ckptd: :class:`CkptdCallback` saves, :func:`ckptd_resume` resumes.

Use::

    callback = CkptdCallback("/nvme/ckpt/run1", remote="s3://bucket/run1")
    trainer = Trainer(model, args, train_dataset=dataset, callbacks=[callback])
    trainer.train(resume_from_checkpoint=ckptd_resume(trainer))    # None on a fresh run
    callback.close()

**Saving.** The Trainer decides when to save (``save_strategy``, ``save_steps``, the last step). When its
``DefaultFlowCallback`` asks for a save at the end of a step or an epoch, the callback takes the request
(``control.should_save`` is cleared, so the Trainer writes no ``checkpoint-N`` directory of its own and
stalls for none) and saves once the Trainer has logged and evaluated that step, at the next callback event
(the next step's or epoch's start, the epoch's or the training's end): at the moment the Trainer would
have saved, with the same model, optimizer, scheduler, RNG and trainer state. The save returns once the
state is staged in host memory; writing, verification, the commit and promotion to ``remote`` run in the
background. Saves the Trainer decides only after evaluating (``save_strategy="best"``), and every save
with ``trainer_checkpoints=True`` (set by ``load_best_model_at_end``: the Trainer loads the best model from
its own checkpoint directory), leave the Trainer's own checkpoint in place and are also saved through ckptd
from ``on_save``. The local tier keeps the Trainer's ``save_total_limit`` newest steps unless ``policy=``
says otherwise.

**Resuming.** The Trainer reads a checkpoint only from a directory and skips the batches it already trained
on only when given one. :func:`ckptd_resume` restores the newest step intact on the nearest tier (local,
else the object tier) and writes a small resume directory under ``output_dir/ckptd-resume/``: the trainer
state (global step, log history, best metric, callback states), the RNG states and the model weights in
the Trainer's own formats (``trainer_state.json``, ``rng_state.pth``, ``model.safetensors``). The Trainer
then resumes through its own code: same epoch, same skipped batches (the data order is a function of seed
and epoch), RNG set after the skip. The optimizer, scheduler and gradient scaler never touch that
directory: the callback loads them from ckptd when the training begins (right after the Trainer created
them, before any step). One limit is the Trainer's own: a collator or dataset that draws from the global
generators in the main process (``dataloader_num_workers=0``, e.g. a masking collator) resumes bit for bit
at an epoch boundary, not in the middle of an epoch (the Trainer sets the RNG after it drew the first
resumed step's batches; its own checkpoints resume the same way).

**Distributed jobs** (``torchrun``, DDP): every rank runs the callback. Its manager is made once the
Trainer's arguments joined the process group (the ranks agree on commits through its store), with a
:class:`ckptd.Layout` of ``world_size`` data-parallel ranks that marks the model, optimizer and scheduler
replicated (DDP keeps them identical), so one rank writes them and every rank restores that copy; each
rank saves its own RNG states and trainer state. Each rank writes its own resume directory
(``ckptd-resume/rank-R/checkpoint-N``, with its ``rng_state_R.pth``), so ranks neither race on one
directory nor need a shared ``output_dir``; a resume removes the resume directories earlier ones wrote.
FSDP and DeepSpeed Trainer runs (sharded model or optimizer) are refused with
:class:`ckptd.errors.ConfigError`; pass ``layout=`` to state another layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import ckptd
from ckptd.errors import ConfigError
from ckptd.plugins.fallback import restore_pointed_step
from ckptd.plugins.huggingface.random_states import RandomStates
from ckptd.plugins.huggingface.requirements import require

transformers = require("transformers", needed_by="ckptd.plugins.huggingface.CkptdCallback")
import torch  # noqa: E402  (after the framework check)
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

log = logging.getLogger("ckptd.plugins.huggingface")

#: The directory under ``args.output_dir`` that holds the resume directory :func:`ckptd_resume` writes.
RESUME_DIRECTORY = "ckptd-resume"
#: Keys of the saved state: read by :func:`ckptd_resume` before the optimizer exists, and by the callback
#: when the training begins.
_RESUME_KEYS = ("model", "trainer_state", "rng")
_TRAINING_KEYS = ("optimizer", "scheduler")
_SCALER_KEY = "scaler"


class CkptdCallback(TrainerCallback):
    """Saves the checkpoints a ``transformers.Trainer`` asks for through ckptd (see the module docstring).

    ``local`` is ckptd's local tier (a directory); ``remote`` (``s3://bucket/prefix``) adds the object tier
    and ``storage_options`` reach it; ``policy`` decides what each tier keeps (default: the Trainer's
    ``save_total_limit`` newest steps locally, else 2; every step promoted). Other keyword arguments go to
    :class:`ckptd.CheckpointManager`. Pass ``manager=`` to use one made elsewhere instead.
    ``trainer_checkpoints=True`` keeps the Trainer's own ``checkpoint-N`` directories as well; it is set when
    the Trainer's arguments ask for ``load_best_model_at_end`` (the Trainer loads the best model only from
    its own checkpoint of that step).

    The manager is made on first use (:func:`ckptd_resume`, or the first save), once the Trainer's arguments
    have set up ``torch.distributed`` in a multi-process job; :meth:`close` waits for pending writes and
    uploads and releases it.
    """

    def __init__(self, local: str | os.PathLike[str] | None = None, *, remote: str | None = None,
                 storage_options: dict[str, Any] | None = None, policy: ckptd.Policy | None = None,
                 manager: Any = None, trainer_checkpoints: bool = False, **manager_options: Any) -> None:
        if manager is None and local is None:
            raise ConfigError("CkptdCallback needs a local directory (or manager=)",
                              hint="CkptdCallback('/nvme/ckpt/run1', remote='s3://bucket/run1')")
        if manager is not None and (local is not None or remote is not None):
            raise ConfigError("CkptdCallback takes either manager= or local=/remote=, not both")
        self._manager = manager
        self._manager_options = dict(manager_options, remote=remote, storage_options=storage_options,
                                     policy=policy)
        self._args: TrainingArguments | None = None  # the Trainer's arguments, from its first event
        self._local = local
        self.trainer_checkpoints = trainer_checkpoints
        #: The Trainer this callback serves, set by :func:`ckptd_resume` (for its callbacks' states and scaler).
        self.trainer: Any = None
        self._random_states = RandomStates()
        self._due: int | None = None  # a step whose save waits for the Trainer's logging and evaluation
        self._objects: dict[str, Any] = {}  # model, optimizer, scheduler, as the events pass them
        self._resumed_step: int | None = None
        self._last_saved: int | None = None

    @property
    def manager(self) -> Any:
        """The :class:`ckptd.CheckpointManager` every save and restore goes through, made on first use (by then
        the Trainer's arguments have joined the process group of a distributed job)."""
        if self._manager is None:
            options = dict(self._manager_options)
            world_size = self._args.world_size if self._args is not None else 1
            if world_size > 1 and options.get("layout") is None:
                options["layout"] = data_parallel_layout(world_size)
            if options["policy"] is None:
                options["policy"] = trainer_policy(self._args)
            self._manager = ckptd.CheckpointManager(self._local, capture_rng=False, **options)
        return self._manager

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._use(args)

    def _use(self, args: TrainingArguments) -> None:
        """Take the Trainer's arguments (at its construction, again when training begins: a callback added
        later sees no ``on_init_end``); refuse what the callback cannot serve."""
        self._args = args
        if args.load_best_model_at_end and not self.trainer_checkpoints:
            # the Trainer loads the best model only from its own checkpoint directory of that step
            log.info("load_best_model_at_end: the Trainer keeps its own checkpoints too (trainer_checkpoints=True)")
            self.trainer_checkpoints = True
        sharded = [name for name in ("fsdp", "deepspeed") if getattr(args, name, None)]
        if sharded:
            raise ConfigError(f"CkptdCallback does not cover Trainer runs with {' and '.join(sharded)} (a sharded "
                              "model or optimizer): it saves a data-parallel replica per rank",
                              hint="train with DDP (torchrun without --fsdp/--deepspeed), or checkpoint "
                                   "FSDP through ckptd's DCP writer")

    # --- saving -------------------------------------------------------------------------------
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._remember(kwargs)
        self._take_save_request(state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._remember(kwargs)
        self._save_due(state, control)  # the last step's save: the Trainer has logged and evaluated it by now
        self._take_save_request(state, control)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._save_due(state, control)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._save_due(state, control)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        self._remember(kwargs)
        if self._last_saved != state.global_step:  # a save the Trainer wrote itself (best, or trainer_checkpoints)
            self._save(state, control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._save_due(state, control)
        self.manager.wait_uploads()

    def _take_save_request(self, state: TrainerState, control: TrainerControl) -> None:
        if control.should_save and not self.trainer_checkpoints:
            control.should_save = False
            self._due = state.global_step

    def _save_due(self, state: TrainerState, control: TrainerControl) -> None:
        if self._due is not None and self._due == state.global_step:
            self._save(state, control)
        self._due = None

    def _remember(self, kwargs: dict[str, Any]) -> None:
        for name, key in (("model", "model"), ("optimizer", "optimizer"), ("lr_scheduler", "scheduler")):
            if kwargs.get(name) is not None:
                self._objects[key] = kwargs[name]

    def _save(self, state: TrainerState, control: TrainerControl) -> None:
        missing = [key for key in ("model", *_TRAINING_KEYS) if key not in self._objects]
        if missing:
            raise ConfigError(f"CkptdCallback cannot save step {state.global_step}: the Trainer passed no "
                              f"{', '.join(missing)}", step=state.global_step,
                              hint="use CkptdCallback with transformers.Trainer, through callbacks=[...]")
        self._update_callback_states(state, control)
        saved = self.manager.save(state.global_step, self._state(json.dumps(dataclasses.asdict(state),
                                                                            indent=2, sort_keys=True)), force=True)
        self._last_saved = state.global_step
        if saved:
            log.info("step %d staged for ckptd (written in the background)", state.global_step)

    def _state(self, trainer_state: str | None = None) -> dict[str, Any]:
        values: dict[str, Any] = {"model": self._objects.get("model"), "optimizer": self._objects.get("optimizer"),
                                  "scheduler": self._objects.get("scheduler"), "rng": self._random_states,
                                  "trainer_state": trainer_state}
        scaler = self._scaler()
        if scaler is not None:
            values[_SCALER_KEY] = scaler
        return values

    def _scaler(self) -> Any:
        accelerator = getattr(self.trainer, "accelerator", None)
        return getattr(accelerator, "scaler", None)

    def _update_callback_states(self, state: TrainerState, control: TrainerControl) -> None:
        """What the Trainer does before it writes ``trainer_state.json``: the states of its stateful callbacks
        (all of them once :func:`ckptd_resume` named the Trainer, else the control's), the control's as the
        Trainer records it while saving (``should_save`` set)."""
        callbacks = [] if self.trainer is None else self.trainer.callback_handler.callbacks
        for callback in [*callbacks, control]:
            if isinstance(callback, ExportableState):
                name = callback.__class__.__name__
                exported = callback.state()
                if callback is control:
                    exported["args"]["should_save"] = True
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(exported)
                else:
                    state.stateful_callbacks[name] = exported

    # --- resuming -----------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._use(args)
        self._remember(kwargs)
        if self._resumed_step is None:
            return
        keys = list(_TRAINING_KEYS) + ([_SCALER_KEY] if self._scaler() is not None else [])
        values = {key: self._state()[key] for key in keys}
        self.manager.restore(values, step=self._resumed_step, keys=keys)
        log.info("optimizer and scheduler of step %d restored from ckptd", self._resumed_step)
        self._resumed_step = None  # a later train() of the same Trainer starts from its own state

    def resume(self, trainer: Any, checkpoint: str | os.PathLike[str] | int | None = None) -> str | None:
        """Restore the newest intact step (or the one ``checkpoint`` names) for ``trainer`` and write its resume
        directory; see :func:`ckptd_resume`."""
        self.trainer = trainer
        self._args = trainer.args
        self._objects["model"] = trainer.model
        values: dict[str, Any] = {}

        def fresh() -> dict[str, Any]:
            values.clear()
            values.update(model=trainer.model, trainer_state=None, rng=self._random_states)
            return values

        if checkpoint is None:
            step = self.manager.restore(fresh(), keys=list(_RESUME_KEYS))
        elif isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            step = self.manager.restore(fresh(), step=checkpoint, keys=list(_RESUME_KEYS))
        else:
            step = restore_pointed_step(self.manager, fresh, checkpoint_step(checkpoint), checkpoint,
                                        keys=list(_RESUME_KEYS))
        if step is None:
            return None
        self._resumed_step = step
        directory = resume_directory(trainer.args, step)
        for earlier in directory.parent.glob("checkpoint-*"):  # an earlier resume's (a model's worth each)
            shutil.rmtree(earlier)
        directory.mkdir(parents=True)
        (directory / transformers.trainer.TRAINER_STATE_NAME).write_text(values["trainer_state"], encoding="utf-8")
        _write_random_states(self._random_states, directory, trainer.args)
        _write_model(trainer, directory)  # the Trainer loads the model only from a weights file
        log.info("step %d restored from ckptd tier(s) %s into %s", step,
                 ", ".join(getattr(self.manager.last_restore, "tiers", ()) or ()), directory)
        return str(directory)

    def close(self) -> None:
        """Wait for pending writes and uploads, then release the manager. Safe to call twice."""
        if self._manager is not None:
            self._manager.close()


def trainer_policy(args: TrainingArguments | None) -> ckptd.Policy:
    """The default policy: every step the Trainer asks for is saved; the local tier keeps the Trainer's
    ``save_total_limit`` newest steps (ckptd's default, 2, without one)."""
    limit = getattr(args, "save_total_limit", None)
    return ckptd.Policy(every_steps=1, **({"keep_local": int(limit)} if limit else {}))


def data_parallel_layout(world_size: int) -> ckptd.Layout:
    """The layout of a DDP Trainer job: ``world_size`` data-parallel ranks holding one model, optimizer and
    scheduler (one rank writes each; every rank restores that copy)."""
    replicated = ("dp",)
    return ckptd.Layout(mesh={"dp": world_size}, zero_stage=0,
                        replicated={"model": replicated, "optimizer": replicated, "scheduler": replicated})


def resume_directory(args: TrainingArguments, step: int) -> Path:
    """Where this process's resume directory of ``step`` goes: one per rank in a distributed job."""
    root = Path(args.output_dir) / RESUME_DIRECTORY
    if args.world_size > 1:
        root = root / f"rank-{args.process_index}"
    return root / f"checkpoint-{step}"


def _write_model(trainer: Any, directory: Path) -> None:
    """The model's weights as the Trainer reads them on resume (``model.safetensors``), written by this process
    (the Trainer's ``save_model`` writes only on the main process, and every rank loads the file)."""
    from safetensors.torch import save_model  # writes tied weights once, as save_pretrained does

    model = trainer.accelerator.unwrap_model(trainer.model)
    save_model(model, str(directory / transformers.utils.SAFE_WEIGHTS_NAME), metadata={"format": "pt"})


def _write_random_states(states: RandomStates, directory: Path, args: TrainingArguments) -> None:
    """``rng_state.pth`` as the Trainer writes it (tensors, tuples, a numpy array: it loads it with
    ``weights_only=True``), so that it sets the generators where it would for its own checkpoint."""
    saved = dict(states.saved or {})
    cuda = saved.pop("cuda", None)
    if cuda is not None:
        saved["cuda"] = cuda if args.world_size > 1 else cuda[torch.cuda.current_device()]
    name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    torch.save(saved, directory / name)


def _callback_of(trainer: Any) -> CkptdCallback:
    found = [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, CkptdCallback)]
    if len(found) != 1:
        raise ConfigError(f"ckptd_resume needs exactly one CkptdCallback among the Trainer's callbacks, found "
                          f"{len(found)}", hint="Trainer(..., callbacks=[CkptdCallback(local_dir)])")
    return found[0]


def ckptd_resume(trainer: Any, checkpoint: str | os.PathLike[str] | int | None = None) -> str | None:
    """Restore the newest step intact on the nearest ckptd tier for ``trainer``; returns the directory to pass
    as ``trainer.train(resume_from_checkpoint=...)``, or None when ckptd holds no step (a fresh run).

    Call it once, after building the Trainer (with a :class:`CkptdCallback` among its callbacks) and before
    ``train()``. Every chunk read is verified; a bad copy falls back to the next tier, then to an older step.
    The model is loaded now; the optimizer and scheduler when the training begins.

    ``checkpoint`` picks the step instead: a step number (restored exactly, or NotFoundError), or a Trainer
    checkpoint directory (``.../checkpoint-40``, the Trainer's or an earlier resume's), whose step is restored
    when some tier holds it intact, else the newest older committed step, with the warning every ckptd
    integration gives (:mod:`ckptd.plugins.fallback`).
    """
    return _callback_of(trainer).resume(trainer, checkpoint)


def checkpoint_step(checkpoint: str | os.PathLike[str]) -> int:
    """The step a Trainer checkpoint directory stands for: its ``trainer_state.json``'s ``global_step``, else
    the ``N`` of its name ``checkpoint-N``."""
    directory = Path(checkpoint)
    try:
        step = json.loads((directory / transformers.trainer.TRAINER_STATE_NAME).read_text(encoding="utf-8"))
        step = step.get("global_step") if isinstance(step, dict) else None
    except (OSError, ValueError):
        step = None
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    prefix, _, number = directory.name.rpartition("-")
    if prefix.endswith("checkpoint") and number.isdigit():
        return int(number)
    raise ConfigError(f"{directory} names no step: it is no Trainer checkpoint directory", path=str(directory),
                      hint="pass a directory named checkpoint-N (or holding trainer_state.json), or a step number")
