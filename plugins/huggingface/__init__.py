"""Hugging Face integrations: ``transformers.Trainer`` and ``accelerate`` save through ckptd's tiers.

- :class:`CkptdCallback` (a ``transformers.TrainerCallback``) takes the Trainer's checkpoints: each save the
  Trainer's ``save_strategy`` asks for is staged and written asynchronously to ckptd's local tier, verified,
  and promoted to the object tier when ``remote=`` is given; :func:`ckptd_resume` restores the newest intact
  step for ``trainer.train(resume_from_checkpoint=...)``.
- :class:`CkptdAccelerate` registers ``accelerate``'s save/load pre-hooks so that ``accelerator.save_state()``
  and ``load_state()`` keep the models, optimizers, schedulers, registered objects and RNG states in ckptd.

The names are imported on first use; without ``transformers``/``accelerate`` that raises
:class:`ckptd.errors.PluginError` with the install hint ``pip install 'ckptd[huggingface]'``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module of this package that defines it (and imports its framework).
_LAZY: dict[str, str] = {
    "CkptdCallback": "trainer",
    "ckptd_resume": "trainer",
    "CkptdAccelerate": "accelerate_hooks",
}


def __getattr__(name: str) -> Any:
    """A public name, imported with its framework on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["CkptdAccelerate", "CkptdCallback", "ckptd_resume"]
