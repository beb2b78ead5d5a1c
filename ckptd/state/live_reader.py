"""Reading saved tensors into a live state that may hold DTensors, without importing DCP.

Every restore wraps its tensor reader with :func:`live_reader`: a live DTensor target receives its local
shard in place and stays in the state. Kept apart from :mod:`ckptd.dcp` so that a plain restore does not
import ``torch.distributed.checkpoint`` (about 1.5 s of a rank's start under load).
"""

from __future__ import annotations

import sys

import torch

from ckptd.state.tree import TensorSource

#: Reads a saved tensor by name into ``out`` (or fresh), as :mod:`ckptd.state.tree` expects.
TensorReader = TensorSource


def live_reader(read: TensorReader) -> TensorReader:
    """Wrap a reader so that a live DTensor target receives its local shard in place and is returned
    itself (the state keeps its DTensors)."""

    def wrapped(name: str, out: torch.Tensor | None) -> torch.Tensor:
        local = _local(out)
        result = read(name, local)
        return out if out is not None and local is not out else result

    return wrapped


def _local(out: torch.Tensor | None) -> torch.Tensor | None:
    if out is None:
        return None
    # a DTensor exists only once its module was imported: a plain tensor never pays for that import
    tensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_module, "DTensor", None) if tensor_module is not None else None
    if dtensor is None or type(out) is torch.Tensor:
        return out
    return out.to_local() if isinstance(out, dtensor) else out
