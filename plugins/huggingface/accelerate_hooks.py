"""``accelerate``'s ``save_state``/``load_state`` through ckptd: :class:`CkptdAccelerate`.

Use::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(progress)          # any object with state_dict()/load_state_dict()
    hooks = CkptdAccelerate(accelerator, "/nvme/ckpt/run1", remote="s3://bucket/run1", step=lambda: progress.step)
    ...
    accelerator.save_state("out/step-100")                   # staged for ckptd, written in the background
    hooks.restore()                                          # the newest step, verified, no pickle, no directory
    hooks.restore(100)                                       # a given step
    hooks.restore("out/step-100")                            # the step save_state noted there (or an older one)

**What the hooks do.** The save pre-hook (``register_save_state_pre_hook``) stages everything accelerate
tracks for one ckptd step: the prepared models, optimizers, schedulers, the gradient scaler, the objects
registered with ``register_for_checkpointing``, each prepared dataloader's epoch (and its state when
``use_stateful_dataloader`` is on), accelerate's step counters and the RNG states. It then takes the model
weights out of accelerate's own write (its documented way to replace model saving), so ``save_state`` writes
no weights file; ckptd writes, verifies, commits and promotes them in the background. The step saved is
noted in ``ckptd-step.json`` in the output directory. Accelerate still writes its other files (optimizer,
scheduler, sampler, RNG, registered objects): its hooks cannot stop that (``save_state`` hands them the
models' weights only; the other lists are the accelerator's own).

**Resuming without pickle.** :meth:`CkptdAccelerate.restore` is the way to resume: it reads only ckptd's
verified step (``restore(step)`` for the step a directory's ``ckptd-step.json`` names) and needs no accelerate
directory (the node lost its disk: the step comes from the object tier). Given an output directory,
``restore(directory)`` reads the step its ``ckptd-step.json`` names; when no tier holds that step intact (the
process died before it committed) it warns, naming the directory, the step and the step it goes back to,
and restores the newest older committed step, as every ckptd integration does
(:mod:`ckptd.plugins.fallback`). ``accelerator.load_state()`` cannot
be kept from reading accelerate's files after the load pre-hook: it unpickles them (``custom_checkpoint_N.pkl``
with ``weights_only=False``, whatever the caller asks) and sets the optimizers, schedulers, RNG and registered
objects from them, over ckptd's verified values. So the load pre-hook refuses with
:class:`ckptd.errors.PickleRefusedError` (naming the step and the files, before anything is read) unless the
caller opted in with ``allow_pickle=True``; then it restores the step from ckptd and accelerate reloads its
files (the same values when they are the ones that save wrote).

:meth:`CkptdAccelerate.save` writes nothing of accelerate's. Within an epoch, the data position is what the
training loop counts (accelerate tracks none without a stateful dataloader): keep the step in a registered
object and skip with ``accelerator.skip_first_batches``, as accelerate's own examples do.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckptd
from ckptd.errors import ConfigError, FormatError, NotFoundError, PickleRefusedError, ResumeMismatchError
from ckptd.plugins.fallback import restore_pointed_step
from ckptd.plugins.huggingface.random_states import RandomStates
from ckptd.plugins.huggingface.requirements import require

require("accelerate", needed_by="ckptd.plugins.huggingface.CkptdAccelerate")

log = logging.getLogger("ckptd.plugins.huggingface")

#: The file in an accelerate output directory that names the ckptd step saved with it.
STEP_FILE = "ckptd-step.json"
#: What ``accelerator.load_state`` reads with ``torch.load`` (pickle) after the load pre-hook.
_PICKLED_FILES = ("optimizer*.bin", "scheduler*.bin", "sampler*.bin", "dl_state_dict*.bin", "scaler.pt",
                  "random_states_*.pkl", "custom_checkpoint_*.pkl")


class _LoaderPosition:
    """What accelerate tracks of a prepared dataloader: its epoch (``iteration``, the sampler's seed offset)
    and, with ``use_stateful_dataloader``, the dataloader's own state."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": int(getattr(self.loader, "iteration", 0))}
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(state["iteration"]))
        if "loader" in state:
            self.loader.load_state_dict(state["loader"])


class _Counters:
    """Accelerate's own counters: ``step`` (gradient accumulation) and the save ``iteration``."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.saving = False  # inside save_state: its iteration is counted up after the pre-hook

    def state_dict(self) -> dict[str, int]:
        iteration = self.accelerator.project_configuration.iteration
        return {"step": int(self.accelerator.step), "iteration": int(iteration) + (1 if self.saving else 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = int(state["step"])
        self.accelerator.project_configuration.iteration = int(state["iteration"])


class CkptdAccelerate:
    """Routes ``accelerator.save_state()``/``load_state()`` through ckptd (see the module docstring).

    ``local`` is ckptd's local tier, ``remote`` (``s3://bucket/prefix``) the object tier and
    ``storage_options`` reach it; ``policy`` decides what each tier keeps. Other keyword arguments go to
    :class:`ckptd.CheckpointManager`; ``manager=`` uses one made elsewhere instead. The manager's
    ``allow_pickle`` (``allow_pickle=True`` here) also lets ``accelerator.load_state()`` unpickle accelerate's
    own files; without it ``load_state`` is refused and :meth:`restore` resumes. ``step`` returns the ckptd
    step of a save (e.g. the training step); by default saves are numbered 1, 2, ... (accelerate's save
    iteration plus one). The hooks are registered at construction; :meth:`remove` unregisters them.
    Construct it after ``accelerator.prepare`` and ``register_for_checkpointing`` (the objects are looked up
    at each save and load, so later registrations count as well).
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

    # --- the state accelerate tracks ----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        accelerator = self.accelerator
        state: dict[str, Any] = {
            "models": {str(i): model for i, model in enumerate(accelerator._models)},
            "optimizers": {str(i): optimizer for i, optimizer in enumerate(accelerator._optimizers)},
            "schedulers": {str(i): scheduler for i, scheduler in enumerate(accelerator._schedulers)},
            "dataloaders": {str(i): _LoaderPosition(loader) for i, loader in enumerate(accelerator._dataloaders)},
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

    def _before_save(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        self._counters.saving = True
        try:
            step = self.save()
        finally:
            self._counters.saving = False
        weights.clear()  # accelerate's documented way to take over model saving: it writes no weights file
        Path(output_dir, STEP_FILE).write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")
        log.info("accelerate save_state: step %d staged for ckptd, no weights written to %s", step, output_dir)

    # --- restoring ----------------------------------------------------------------------------
    def restore(self, step: int | str | os.PathLike[str] | None = None) -> int | None:
        """Load the newest intact step (or ``step``) into everything accelerate tracks, from the nearest tier,
        and set the RNG states; returns the step, or None when ckptd holds none. Needs no accelerate directory.

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

    def _before_load(self, models: list[Any], input_dir: str) -> None:
        marker = Path(input_dir, STEP_FILE)
        if not marker.is_file():
            raise ResumeMismatchError(f"{input_dir} was not saved through ckptd (it has no {STEP_FILE})",
                                      path=str(marker), hint="load it without CkptdAccelerate, or call "
                                      "CkptdAccelerate.restore() to resume from ckptd's newest step")
        step = saved_step(input_dir)
        if not self.manager.allow_pickle:
            pickled = sorted(path.name for pattern in _PICKLED_FILES for path in Path(input_dir).glob(pattern))
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
        """Unregister the hooks (``save_state``/``load_state`` work as without ckptd again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """Unregister the hooks, wait for pending writes and uploads and release the manager."""
        self.remove()
        self.manager.close()


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
