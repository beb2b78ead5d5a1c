"""Turning one rank's list of samples into the batch the training step receives.

The default, :func:`tensor_batch`, gives torch tensors: samples that are numpy arrays of one shape are
stacked into one tensor (integer arrays, such as token windows, become ``int64``, what embedding layers
and ``cross_entropy`` targets take; other dtypes are kept); dicts, tuples, numbers and strings are
collated field by field as :func:`torch.utils.data.default_collate` does (strings stay lists). It runs
in two halves: :func:`stack_samples` where the batch is built (stacked numpy arrays keep the shard's
compact dtype, so a DataLoader worker sends a quarter of the bytes of ``int64`` tokens, pickled rather
than through a shared-memory segment per batch) and :func:`as_tensors` in the training process (in
DataLoader's pinning thread when ``pin_memory=True``).
:func:`list_batch` keeps the list of samples as the reader produced them. :func:`next_token_split`
cuts a ``[batch, seq_len]`` token batch into ``(inputs, targets)`` for next-token prediction.

Collate functions run where the batch is built: in a DataLoader worker when ``num_workers > 0`` (the
tensors then reach the training process through shared memory), else in the training process. They
must be module-level functions, so that workers started with ``spawn`` can import them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from ckptd.errors import ConfigError

#: A collate function: the samples of one rank's batch -> the batch.
CollateFn = Callable[[list[Any]], Any]


def _stack_arrays(arrays: list[np.ndarray], *, collate_fn_map: Any = None) -> np.ndarray:
    return np.stack(arrays)


_COLLATE_MAP: dict[Any, Any] = {**default_collate_fn_map, np.ndarray: _stack_arrays}


def stack_samples(samples: list[Any]) -> Any:
    """The first half of :func:`tensor_batch`: numpy arrays stacked (dtype kept), every other field
    collated as ``default_collate`` does; an empty list stays an empty list."""
    if not samples:
        return []
    return collate(samples, collate_fn_map=_COLLATE_MAP)


def as_tensors(batch: Any) -> Any:
    """The second half of :func:`tensor_batch`: every numpy array in ``batch`` (through dicts, lists and
    tuples) becomes a tensor, integer arrays as ``int64``."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch.astype(np.int64) if batch.dtype.kind in "iub" else batch)
    if isinstance(batch, dict):
        return {key: as_tensors(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [as_tensors(value) for value in batch]
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return tuple(as_tensors(value) for value in batch)
    return batch


def list_batch(samples: list[Any]) -> list[Any]:
    """The samples as the reader produced them, in order (numpy arrays for tokens, dicts for JSON lines);
    arrays that are views into a shard (token windows) are copied, so a kept sample does not keep its
    whole shard in memory."""
    return [sample.copy() if isinstance(sample, np.ndarray) and sample.base is not None else sample
            for sample in samples]


def tensor_batch(samples: list[Any]) -> Any:
    """Samples collated into tensors (see the module docstring); an empty list stays an empty list
    (a batch whose samples all came from skipped shards, with ``on_corrupt="skip"``)."""
    return as_tensors(stack_samples(samples))


def next_token_split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets) = (tokens[:, :-1], tokens[:, 1:])`` of a ``[batch, seq_len]`` integer tensor,
    both contiguous: with token windows of ``seq_len = block_size + 1`` each is ``[batch, block_size]``."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point \
            or batch.shape[1] < 2:
        described = f"a tensor of shape {list(batch.shape)} and dtype {batch.dtype}" \
            if isinstance(batch, torch.Tensor) else f"a {type(batch).__name__}"
        raise ConfigError(f"split_targets needs batches of token ids shaped [batch, seq_len >= 2], got {described}",
                          hint="use it with the tokens format (and the default tensor batches)")
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class Finish:
    """What the training process applies to a collated batch: :func:`as_tensors` (after the default
    :func:`stack_samples`), then :func:`next_token_split` when ``split_targets``. Picklable."""

    def __init__(self, *, tensors: bool, split_targets: bool) -> None:
        self.tensors, self.split_targets = tensors, split_targets

    def __call__(self, batch: Any) -> Any:
        if self.tensors:
            batch = as_tensors(batch)
        if self.split_targets and not (isinstance(batch, list) and not batch):
            batch = next_token_split(batch)
        return batch
