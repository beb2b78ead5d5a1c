"""``transformers.Trainer`` checkpoints through ckptd: :class:`CkptdCallback` saves and resumes.

Use, as in ``run_clm.py``::

    trainer = Trainer(model, args, train_dataset=dataset,
                      callbacks=[CkptdCallback("/nvme/ckpt/run1", remote="s3://bucket/run1")])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))  # or =True

**Saving.** The Trainer decides when to save (``save_strategy``, ``save_steps``, the last step). When its
``DefaultFlowCallback`` asks for a save at the end of a step or an epoch, the callback takes the request
(``control.should_save`` is cleared, so the Trainer writes no checkpoint of its own and stalls for none)
and saves once the Trainer has logged and evaluated that step, at the next callback event (the next step's
or epoch's start, the epoch's or the training's end): at the moment the Trainer would have saved, with the
same model, optimizer, scheduler, RNG and trainer state. The save returns once the state is staged in host
memory; writing, verification, the commit and promotion to ``remote`` run in the background.

**The checkpoint-N directories.** When a step commits, the writer thread writes a small
``output_dir/checkpoint-N`` (:func:`write_checkpoint_directory`): the Trainer's ``trainer_state.json`` and
``rng_state.pth`` (``rng_state_R.pth`` per rank), a ``ckptd.json`` naming the ckptd step, and in place of
the weights a ``model.safetensors.index.json`` whose shard holds no tensor (a few hundred bytes): the
weights, optimizer, scheduler and scaler stay in ckptd. So ``get_last_checkpoint(output_dir)`` and
``train(resume_from_checkpoint=True)`` find the newest committed step, and the Trainer resumes through its
own code (same epoch, same skipped batches, RNG set after the skip); when the training begins the callback
loads the model, optimizer, scheduler and scaler of that step from the nearest tier holding it intact. The
directories follow the local tier's retention. When the newest one names a step no tier holds committed,
the callback warns when the Trainer is built (the warning of :mod:`ckptd.plugins.fallback`) and rewrites
it to the newest older committed step. ``export_safetensors=True`` also writes ``model.safetensors`` and
``config.json`` into each directory from the committed step, on a background thread (``ckptd export``'s
code), so ``from_pretrained("output_dir/checkpoint-N")`` loads it; a save never waits for it.

Saves the Trainer decides only after evaluating (``save_strategy="best"``), and every save with
``trainer_checkpoints=True`` (set by ``load_best_model_at_end``: the Trainer loads the best model from its
own checkpoint directory), leave the Trainer's own checkpoint in place (no ckptd directory is written then)
and are also saved through ckptd from ``on_save``. The local tier keeps the Trainer's ``save_total_limit``
newest steps unless ``policy=`` says otherwise.

**ckptd_resume.** :func:`ckptd_resume` (the earlier API, still served) restores the newest step intact on
the nearest tier (or the one it names, with the fallback of :mod:`ckptd.plugins.fallback`), loads the
model at once, writes that step's ``checkpoint-N`` directory and returns it for
``train(resume_from_checkpoint=...)``.

One limit is the Trainer's own: a collator or dataset that draws from the global generators in the main
process (``dataloader_num_workers=0``, e.g. a masking collator) resumes bit for bit at an epoch boundary,
not in the middle of an epoch (the Trainer sets the RNG after it drew the first resumed step's batches; its
own checkpoints resume the same way). A deterministic collator, or one that runs in the loader's workers
(``dataloader_num_workers > 0``), resumes bit for bit anywhere. Stateful callbacks other than the
Trainer's control (``EarlyStoppingCallback``) are saved with their state when the callback knows the
Trainer (:func:`ckptd_resume` names it); without it, with the state they had when the training began.

**Distributed jobs** (``torchrun``, DDP): every rank runs the callback. Its manager is made once the
Trainer's arguments joined the process group (the ranks agree on commits through its store), with a
:class:`ckptd.Layout` of ``world_size`` data-parallel ranks that marks the model, optimizer and scheduler
replicated (DDP keeps them identical), so one rank writes them and every rank restores that copy; each
rank saves its own RNG states and trainer state. In ``checkpoint-N`` each rank writes its
``rng_state_R.pth`` and the ranks that save for the Trainer (``args.should_save``) the rest, as the Trainer
does. FSDP and DeepSpeed Trainer runs (sharded model or optimizer) are refused with
:class:`ckptd.errors.ConfigError`; pass ``layout=`` to state another layout.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ckptd
from ckptd.background import TaskPool, result_within
from ckptd.config import settings
from ckptd.errors import CkptdError, ConfigError, NoIntactCheckpointError, NotFoundError
from ckptd.plugins.fallback import committed_on_any_tier, restore_pointed_step
from ckptd.plugins.huggingface.random_states import RandomStates
from ckptd.plugins.huggingface.requirements import require

transformers = require("transformers", needed_by="ckptd.plugins.huggingface.CkptdCallback")
import torch  # noqa: E402  (after the framework check)
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME  # noqa: E402

log = logging.getLogger("ckptd.plugins.huggingface")

#: The directory under ``args.output_dir`` where ckptd versions before the checkpoint-N directories wrote a
#: resume directory (with a full copy of the weights); a resume removes it.
RESUME_DIRECTORY = "ckptd-resume"
#: The file in ``checkpoint-N`` that marks it as ckptd's and names the ckptd step it stands for.
MARKER_NAME = "ckptd.json"
#: The shard the weight index of ``checkpoint-N`` names for every weight: a safetensors file with no tensor
#: (the Trainer loads nothing from it; the callback loads the weights from ckptd).
EMPTY_SHARD_NAME = "ckptd-weights-are-in-ckptd.safetensors"
_TRAINER_STATE_NAME = "trainer_state.json"
#: Keys of the saved state: read by :func:`ckptd_resume` before the optimizer exists, and by the callback
#: when the training begins.
_RESUME_KEYS = ("model", "trainer_state", "rng")
_TRAINING_KEYS = ("optimizer", "scheduler")
_SCALER_KEY = "scaler"
_EXPORTING = ".ckptd-export"  # the export's directory inside checkpoint-N, emptied into it when finished


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What ``checkpoint-N`` holds of a step besides ckptd's data: the Trainer's state (JSON), the RNG
    states (as :class:`RandomStates` holds them) and the model's weight names; ``pointed_step``: the step
    the directory was first written for, when it now stands for an older one (the fallback)."""

    step: int
    trainer_state: str
    random_states: dict[str, Any]
    weight_names: tuple[str, ...]
    pointed_step: int | None = None


class CkptdCallback(TrainerCallback):
    """Saves the checkpoints a ``transformers.Trainer`` asks for through ckptd and resumes from them (see the
    module docstring).

    ``local`` is ckptd's local tier (a directory); ``remote`` (``s3://bucket/prefix``) adds the object tier
    and ``storage_options`` reach it; ``policy`` decides what each tier keeps (default: the Trainer's
    ``save_total_limit`` newest steps locally, else 2; every step promoted). Other keyword arguments go to
    :class:`ckptd.CheckpointManager`. Pass ``manager=`` to use one made elsewhere instead.
    ``trainer_checkpoints=True`` keeps the Trainer's own ``checkpoint-N`` directories instead of ckptd's
    small ones; it is set when the Trainer's arguments ask for ``load_best_model_at_end`` (the Trainer loads
    the best model only from its own checkpoint of that step). ``export_safetensors=True`` writes
    ``model.safetensors`` and ``config.json`` into each committed step's ``checkpoint-N`` in the background.

    The manager is made on first use (the first save, a resume, or a Trainer built over an ``output_dir``
    holding ckptd's ``checkpoint-N`` directories), once the Trainer's arguments have set up
    ``torch.distributed`` in a multi-process job; :meth:`close` waits for pending writes, exports and
    uploads and releases it.
    """

    def __init__(self, local: str | os.PathLike[str] | None = None, *, remote: str | None = None,
                 storage_options: dict[str, Any] | None = None, policy: ckptd.Policy | None = None,
                 manager: Any = None, trainer_checkpoints: bool = False, export_safetensors: bool = False,
                 **manager_options: Any) -> None:
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
        self.export_safetensors = export_safetensors
        #: The Trainer this callback serves, set by :func:`ckptd_resume` (for its callbacks' states and scaler).
        self.trainer: Any = None
        self._random_states = RandomStates()
        self._due: int | None = None  # a step whose save waits for the Trainer's logging and evaluation
        self._objects: dict[str, Any] = {}  # model, optimizer, scheduler, as the events pass them
        self._resumed_step: int | None = None
        self._forget_after: int | None = None  # the resumed step: later steps' directories go after the first step
        self._last_saved: int | None = None
        self._hooked: Any = None  # the manager whose commits write checkpoint-N
        self._records: dict[int, StepRecord] = {}  # saved, not yet committed (the writer thread takes them)
        self._names: tuple[Any, tuple[str, ...]] = (None, ())  # the model's weight names, once per model
        self._directories = threading.Lock()  # the writer thread and the export thread both change them
        self._exports: TaskPool | None = None
        self._export_newest = -1  # the newest step queued for export; an older queued one is skipped
        self._export_futures: list[Future[None]] = []
        self._export_futures_lock = threading.Lock()  # queued on the writer thread, awaited on the training one

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
        if self._hooked is not self._manager:
            # the saver's commit hook runs on the writer thread, right after the local commit and retention
            self._manager.add_commit_callback(self._on_commit)
            self._hooked = self._manager
        return self._manager

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._use(args)
        self._remember(kwargs)
        if not self.trainer_checkpoints:
            self._check_newest_directory(args)

    def _use(self, args: TrainingArguments) -> None:
        """Take the Trainer's arguments (at its construction, again when training begins: a callback added
        later sees no ``on_init_end``); refuse what the callback cannot serve."""
        self._args = args
        if args.load_best_model_at_end and not self.trainer_checkpoints:
            # the Trainer loads the best model only from its own checkpoint directory
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
        if self._forget_after is not None:  # the Trainer has read the directory it resumed from (RNG included)
            self._forget_newer_directories(args, self._forget_after)
            self._forget_after = None
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
            self._save(state, control, record=False)  # its checkpoint-N is the Trainer's: ckptd writes none there

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

    def _save(self, state: TrainerState, control: TrainerControl, *, record: bool = True) -> None:
        missing = [key for key in ("model", *_TRAINING_KEYS) if key not in self._objects]
        if missing:
            raise ConfigError(f"CkptdCallback cannot save step {state.global_step}: the Trainer passed no "
                              f"{', '.join(missing)}", step=state.global_step,
                              hint="use CkptdCallback with transformers.Trainer, through callbacks=[...]")
        self._update_callback_states(state, control)
        trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True)
        manager = self.manager
        if record and not self.trainer_checkpoints:  # taken by the writer thread when the step commits
            model = self._objects["model"]
            if self._names[0] is not model:
                self._names = (model, _weight_names(model))
            self._records[state.global_step] = StepRecord(
                state.global_step, trainer_state, _captured(self._random_states.state_dict()), self._names[1])
        saved = manager.save(state.global_step, self._state(trainer_state), force=True)
        self._last_saved = state.global_step
        if saved:
            log.info("step %d staged for ckptd (written in the background)", state.global_step)
        else:
            self._records.pop(state.global_step, None)

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
        if accelerator is not None:
            return getattr(accelerator, "scaler", None)
        return getattr(self._objects.get("optimizer"), "scaler", None)  # accelerate's optimizer holds it too

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

    # --- the checkpoint-N directories ---------------------------------------------------------
    def _on_commit(self, step: int) -> None:
        """Writer thread: ``step`` is committed locally; write its ``checkpoint-N``, drop the ones the local
        tier let go, queue the export."""
        record = self._records.pop(step, None)
        for older in [saved for saved in list(self._records) if saved < step]:  # saves that never committed
            self._records.pop(older, None)
        args = self._args
        if record is None or args is None:
            return
        directory = checkpoint_directory(args, step)
        try:
            with self._directories:
                write_checkpoint_directory(directory, record, args)
                if args.should_save:
                    kept = set(self._manager.local.committed_steps())
                    _remove_directories(args, lambda _, marked: marked not in kept)
        except (OSError, CkptdError) as error:  # the step is committed; only the Trainer's view of it is missing
            log.warning("could not write %s for the committed step %d: %s", directory, step, error)
            return
        if self.export_safetensors and args.should_save:
            self._queue_export(step, directory)

    def _queue_export(self, step: int, directory: Path) -> None:
        if self._exports is None:
            self._exports = TaskPool("ckptd-hf-export", 1)
        self._export_newest = max(self._export_newest, step)
        future = self._exports.submit(self._export, step, directory, what=f"export of step {step} to {directory}")
        with self._export_futures_lock:
            self._export_futures = [*self._pending_exports(), future]

    def _export(self, step: int, directory: Path) -> None:
        """Export thread: ``model.safetensors`` (and ``config.json``) of the committed ``step`` into its
        ``checkpoint-N``; skipped when a newer step is queued (the newest is what an evaluation wants)."""
        if step < self._export_newest:
            log.info("export of step %d skipped: step %d is queued after it", step, self._export_newest)
            return
        try:
            export_model(self._manager.tiers, step, directory, self._objects.get("model"), lock=self._directories)
        except (OSError, CkptdError) as error:  # a step the local tier let go meanwhile, a full disk
            log.warning("model.safetensors of step %d was not written to %s: %s", step, directory, error)

    def _check_newest_directory(self, args: TrainingArguments) -> None:
        """When the Trainer is built: the newest ``checkpoint-N`` of ckptd in ``output_dir`` (the one
        ``get_last_checkpoint`` returns) must name a step some tier holds committed; else warn and rewrite it
        to the newest older committed step (the Trainer reads its state from it when it resumes)."""
        if args.should_save:  # directories a killed run was building aside
            for leftover in Path(args.output_dir).glob(f".{PREFIX_CHECKPOINT_DIR}-*.partial-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        found = checkpoint_directories(args.output_dir)
        incomplete = incomplete_directories(args.output_dir, max(found, default=-1))
        if incomplete:  # killed while writing it: get_last_checkpoint returns it, so it is made whole
            number = max(incomplete)
            directory, marked = incomplete[number], number
        elif not found:
            return
        else:
            directory = found[max(found)]
            marked = marker_step(directory)
            if marked is None:
                return
            if marked in committed_on_any_tier(self.manager):
                self._write_missing_random_states(directory, marked, args)
                return
        values: dict[str, Any] = {}

        def fresh() -> dict[str, Any]:
            values.clear()
            values.update(trainer_state=None, rng=RandomStates())
            return values

        step = restore_pointed_step(self.manager, fresh, marked, directory, keys=["trainer_state", "rng"])
        record = StepRecord(step, values["trainer_state"], values["rng"].saved,
                            _weight_names(self._objects.get("model")), pointed_step=marked)
        with self._directories:
            if args.should_save:  # step N's files (its exported weights too) are not step M's
                shutil.rmtree(directory)
            _barrier(args)
            write_checkpoint_directory(directory, record, args)
        _barrier(args)

    def _write_missing_random_states(self, directory: Path, step: int, args: TrainingArguments) -> None:
        """This rank's RNG file of ``checkpoint-N``, from ckptd, when the run was killed before this rank wrote it
        (each rank writes its own when the step commits): without it the Trainer resumes this rank with fresh
        RNG states, inexactly, and says so only at info level."""
        if args.world_size <= 1 and (directory / _random_states_name(args)).is_file():
            return
        values = {"rng": RandomStates()}
        self.manager.restore(values, step=step, keys=["rng"])  # on every rank: a restore may be collective
        if (directory / _random_states_name(args)).is_file():
            return
        _write_files(directory, {_random_states_name(args): _random_states_bytes(values["rng"].saved, args)})
        log.info("%s: this rank's RNG file of step %d written from ckptd (the run stopped before it was)",
                 directory, step)

    # --- resuming -----------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._use(args)
        self._remember(kwargs)
        if self._resumed_step is not None:  # ckptd_resume loaded the model already
            keys = list(_TRAINING_KEYS) + ([_SCALER_KEY] if self._scaler() is not None else [])
            values = {key: self._state()[key] for key in keys}
            self.manager.restore(values, step=self._resumed_step, keys=keys)
            log.info("optimizer and scheduler of step %d restored from ckptd", self._resumed_step)
            self._forget_after = self._resumed_step
            self._resumed_step = None  # a later train() of the same Trainer starts from its own state
        elif state.global_step > 0 and not self.trainer_checkpoints:
            self._restore_resumed_step(args, state.global_step)

    def _restore_resumed_step(self, args: TrainingArguments, step: int) -> None:
        """The Trainer resumed from a checkpoint directory of ``step`` (its trainer state and RNG files): load
        the model, optimizer, scheduler and scaler of that step from the nearest tier holding it intact."""
        try:
            self.manager.restore(self._state(), step=step)
        except NotFoundError as error:
            directory = next((found for found in checkpoint_directories(args.output_dir).values()
                              if marker_step(found) == step), None)
            if directory is None and not isinstance(error, NoIntactCheckpointError):
                log.warning("the Trainer resumed step %d from a directory ckptd did not write (ckptd holds no such "
                            "step): the model, optimizer and scheduler are what the Trainer loaded from it", step)
                return
            raise type(error)(f"the Trainer resumed step {step} from a ckptd checkpoint directory, but no tier "
                              f"holds that step intact ({error.message})", step=step,
                              path=str(directory or checkpoint_directory(args, step)),
                              hint="build the Trainer again and pass resume_from_checkpoint=ckptd_resume(trainer) "
                                   "(it falls back to the newest older intact step), or an older checkpoint-N"
                              ) from error
        log.info("step %d restored from ckptd tier(s) %s", step,
                 ", ".join(getattr(self.manager.last_restore, "tiers", ()) or ()))
        self._forget_after = step

    def _forget_newer_directories(self, args: TrainingArguments, step: int) -> None:
        """Training goes on from ``step``: ckptd's directories of later steps (set aside by the restore, or
        never committed) go, and so does the resume directory of earlier ckptd versions."""
        if not args.should_save:
            return
        with self._directories:
            _remove_directories(args, lambda number, marked: max(number, marked) > step)
        shutil.rmtree(Path(args.output_dir) / RESUME_DIRECTORY, ignore_errors=True)

    def resume(self, trainer: Any, checkpoint: str | os.PathLike[str] | int | None = None) -> str | None:
        """Restore the newest intact step (or the one ``checkpoint`` names) for ``trainer`` and write its
        ``checkpoint-N`` directory; see :func:`ckptd_resume`."""
        self.trainer = trainer
        self._use(trainer.args)
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
        directory = checkpoint_directory(trainer.args, step)
        record = StepRecord(step, values["trainer_state"], self._random_states.saved or {},
                            _weight_names(trainer.model))
        with self._directories:
            write_checkpoint_directory(directory, record, trainer.args)
        _barrier(trainer.args)
        log.info("step %d restored from ckptd tier(s) %s for %s", step,
                 ", ".join(getattr(self.manager.last_restore, "tiers", ()) or ()), directory)
        return str(directory)

    def wait(self) -> None:
        """Block until every pending save is committed, its ``checkpoint-N`` written and, with
        ``export_safetensors``, its export finished (each wait within ``CKPTD_WAIT_TIMEOUT_S``)."""
        if self._manager is None:
            return
        self._manager.wait()  # the commits queue their exports
        with self._export_futures_lock:
            waiting = list(self._export_futures)
        for future in waiting:
            result_within(future, settings().wait_timeout_s, "the export of a step to model.safetensors")
        with self._export_futures_lock:
            self._export_futures = self._pending_exports()

    def _pending_exports(self) -> list[Future[None]]:
        return [future for future in self._export_futures if not future.done()]

    def close(self) -> None:
        """Wait for pending writes, exports and uploads, then release the manager. Safe to call twice."""
        if self._manager is None:
            return
        try:
            if self._exports is not None and not self._exports.closed:
                self.wait()
                self._exports.close(cancel_queued=False)
        finally:
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


def _barrier(args: TrainingArguments) -> None:
    """In a distributed job: every rank's files of ``checkpoint-N`` are in place before any rank goes on."""
    if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def checkpoint_directory(args: TrainingArguments, step: int) -> Path:
    """``output_dir/checkpoint-N``, where the Trainer would write its checkpoint of ``step``."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def marker_step(directory: Path) -> int | None:
    """The ckptd step ``checkpoint-N`` stands for (its ``ckptd.json``); None for a directory not ckptd's."""
    try:
        marked = json.loads((directory / MARKER_NAME).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return marked if isinstance(marked, int) and not isinstance(marked, bool) else None


def _numbered_directories(output_dir: str | os.PathLike[str]) -> Iterator[tuple[int, Path]]:
    """(N, path) of every ``checkpoint-N`` directory in ``output_dir``, ckptd's or the Trainer's."""
    root = Path(output_dir)
    if not root.is_dir():
        return
    for directory in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        number = directory.name[len(PREFIX_CHECKPOINT_DIR) + 1:]
        if number.isdigit() and directory.is_dir():
            yield int(number), directory


def checkpoint_directories(output_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """ckptd's ``checkpoint-N`` directories in ``output_dir``, by N (the Trainer's own are left out)."""
    return {number: directory for number, directory in _numbered_directories(output_dir)
            if (directory / MARKER_NAME).is_file()}


def incomplete_directories(output_dir: str | os.PathLike[str], above: int) -> dict[int, Path]:
    """``checkpoint-N`` directories newer than ``above`` (the newest complete one of ckptd) that hold only what
    ckptd writes there and no marker yet: the callback was stopped while writing them."""
    found: dict[int, Path] = {}
    for number, directory in _numbered_directories(output_dir):
        names = os.listdir(directory) if number > above else [MARKER_NAME]
        if MARKER_NAME not in names and all(_written_by_ckptd(name) for name in names):
            found[number] = directory
    return found


def _written_by_ckptd(name: str) -> bool:
    return (name.startswith(("rng_state", ".")) or name in (_TRAINER_STATE_NAME, EMPTY_SHARD_NAME,
                                                             SAFE_WEIGHTS_INDEX_NAME, _EXPORTING))


def _remove_directories(args: TrainingArguments, remove: Callable[[int, int], bool]) -> None:
    """Remove ckptd's ``checkpoint-N`` directories that ``remove(N, step it stands for)`` picks."""
    for number, directory in checkpoint_directories(args.output_dir).items():
        marked = marker_step(directory)
        if marked is not None and remove(number, marked):
            shutil.rmtree(directory, ignore_errors=True)


def write_checkpoint_directory(directory: Path, record: StepRecord, args: TrainingArguments) -> None:
    """Write (or rewrite) ``checkpoint-N`` for ``record``: each rank its RNG file, the ranks that save for
    the Trainer (``args.should_save``) ``trainer_state.json``, ``ckptd.json`` and, unless weights were
    exported there, the weight index whose one shard holds no tensor. Every file is replaced atomically."""
    from safetensors.torch import save as safetensors_bytes

    files = {_random_states_name(args): _random_states_bytes(record.random_states, args)}
    if args.should_save:
        files[_TRAINER_STATE_NAME] = record.trainer_state.encode("utf-8")
        if not (directory / SAFE_WEIGHTS_NAME).is_file() and not (directory / SAFE_WEIGHTS_INDEX_NAME).is_file():
            note = "the weights of this step are in ckptd: CkptdCallback loads them when the training begins"
            files[EMPTY_SHARD_NAME] = safetensors_bytes({}, metadata={"format": "pt", "ckptd": note})
            files[SAFE_WEIGHTS_INDEX_NAME] = json.dumps({
                "metadata": {"ckptd": note, "total_size": 0},
                "weight_map": dict.fromkeys(record.weight_names, EMPTY_SHARD_NAME)}, indent=1).encode("utf-8")
        marker = {"step": record.step, "written_by": "ckptd.plugins.huggingface.CkptdCallback"}
        if record.pointed_step is not None:
            marker["pointed_step"] = record.pointed_step
        files[MARKER_NAME] = json.dumps(marker, indent=1).encode("utf-8")
    staging = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    if args.should_save and not directory.exists():  # a new directory appears whole: built aside, then renamed
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _write_files(staging, files)
        try:
            os.rename(staging, directory)
            return
        except OSError:  # another rank made it meanwhile (its RNG file): this rank's files go in one by one
            shutil.rmtree(staging, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    _write_files(directory, files)


def _write_files(directory: Path, files: dict[str, bytes]) -> None:
    from ckptd import write_file_atomically

    for name, data in files.items():
        write_file_atomically(directory / name, data, what=f"Trainer checkpoint file {name}",
                              hint="check that output_dir is writable")


def export_model(tiers: list[Any], step: int, directory: Path, model: Any, *,
                 lock: threading.Lock | None = None) -> None:
    """Write ``model.safetensors`` (shards and their index for a large model) of the committed ``step`` into
    ``checkpoint-N`` through :func:`ckptd.export.export_safetensors` (every chunk verified), and the model's
    ``config.json``, so that ``from_pretrained(directory)`` loads it. The files appear whole (the export
    writes a hidden directory inside ``checkpoint-N`` and each file is moved into place)."""
    from ckptd.export import ExportOptions, export_safetensors

    out = directory / _EXPORTING
    shutil.rmtree(out, ignore_errors=True)
    report = export_safetensors(tiers, step, out, ExportOptions(key_prefix="model."))
    with lock or threading.Lock():
        if marker_step(directory) != step:  # the local tier let the step go meanwhile (or it was rewritten)
            shutil.rmtree(out, ignore_errors=True)
            return
        config = getattr(model, "config", None)
        if config is not None:
            config.to_json_file(str(out / CONFIG_NAME))
        for name in (EMPTY_SHARD_NAME, SAFE_WEIGHTS_INDEX_NAME):
            (directory / name).unlink(missing_ok=True)
        for name in [*report.files, *([CONFIG_NAME] if config is not None else [])]:
            os.replace(out / name, directory / name)
        shutil.rmtree(out, ignore_errors=True)


def _captured(states: dict[str, Any]) -> dict[str, Any]:
    """The RNG states of :meth:`RandomStates.state_dict` as :class:`RandomStates` holds a loaded capture."""
    holder = RandomStates()
    holder.load_state_dict(states)
    return dict(holder.saved or {})


def _weight_names(model: Any) -> tuple[str, ...]:
    return tuple(model.state_dict().keys()) if model is not None else ()


def _random_states_name(args: TrainingArguments) -> str:
    return "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"


def _random_states_bytes(saved: dict[str, Any], args: TrainingArguments) -> bytes:
    """``rng_state.pth`` as the Trainer writes it (tensors, tuples, a numpy array: it loads it with
    ``weights_only=True``), so that it sets the generators where it would for its own checkpoint."""
    saved = dict(saved)
    cuda = saved.pop("cuda", None)
    if cuda is not None:
        saved["cuda"] = cuda if args.world_size > 1 else cuda[torch.cuda.current_device()]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def _callback_of(trainer: Any) -> CkptdCallback:
    found = [callback for callback in trainer.callback_handler.callbacks if isinstance(callback, CkptdCallback)]
    if len(found) != 1:
        raise ConfigError(f"ckptd_resume needs exactly one CkptdCallback among the Trainer's callbacks, found "
                          f"{len(found)}", hint="Trainer(..., callbacks=[CkptdCallback(local_dir)])")
    return found[0]


def ckptd_resume(trainer: Any, checkpoint: str | os.PathLike[str] | int | None = None) -> str | None:
    """Restore the newest step intact on the nearest ckptd tier for ``trainer``; returns the directory to pass
    as ``trainer.train(resume_from_checkpoint=...)``, or None when ckptd holds no step (a fresh run).

    Not needed with ``train(resume_from_checkpoint=True)`` or ``get_last_checkpoint``: the callback serves
    those itself. Call it once, after building the Trainer (with a :class:`CkptdCallback` among its callbacks)
    and before ``train()``. Every chunk read is verified; a bad copy falls back to the next tier, then to an
    older step. The model is loaded now; the optimizer and scheduler when the training begins. The returned
    ``output_dir/checkpoint-N`` holds no weights (see the module docstring).

    ``checkpoint`` picks the step instead: a step number (restored exactly, or NotFoundError), or a Trainer
    checkpoint directory (``.../checkpoint-40``, the Trainer's or ckptd's), whose step is restored when some
    tier holds it intact, else the newest older committed step, with the warning every ckptd integration
    gives (:mod:`ckptd.plugins.fallback`).
    """
    return _callback_of(trainer).resume(trainer, checkpoint)


def checkpoint_step(checkpoint: str | os.PathLike[str]) -> int:
    """The step a Trainer checkpoint directory stands for: its ``trainer_state.json``'s ``global_step``, else
    the ``N`` of its name ``checkpoint-N``."""
    directory = Path(checkpoint)
    try:
        step = json.loads((directory / _TRAINER_STATE_NAME).read_text(encoding="utf-8"))
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
