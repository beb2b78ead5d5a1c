"""Turning one rank's list of samples into the batch the training step receives.

The default, :func:`tensor_batch`, gives torch tensors: samples that are numpy arrays of one shape are
stacked into one tensor (integer arrays, such as token windows, become ``int64``, what embedding layers
and ``cross_entropy`` targets take; other dtypes are kept); dicts, tuples, numbers and strings are
collated field by field as :func:`torch.utils.data.default_collate` does (strings stay lists).
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


def _stack_arrays(arrays: list[np.ndarray], *, collate_fn_map: Any = None) -> torch.Tensor:
    stacked = np.stack(arrays)
    if stacked.dtype.kind in "iub":
        stacked = stacked.astype(np.int64, copy=False)
    return torch.from_numpy(stacked)


_COLLATE_MAP: dict[Any, Any] = {**default_collate_fn_map, np.ndarray: _stack_arrays}


def list_batch(samples: list[Any]) -> list[Any]:
    """The samples as the reader produced them, in order (numpy arrays for tokens, dicts for JSON lines)."""
    return samples


def tensor_batch(samples: list[Any]) -> Any:
    """Samples collated into tensors (see the module docstring); an empty list stays an empty list
    (a batch whose samples all came from skipped shards, with ``on_corrupt="skip"``)."""
    if not samples:
        return []
    return collate(samples, collate_fn_map=_COLLATE_MAP)


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


class SplitTargets:
    """A collate function that applies ``collate_fn`` and then :func:`next_token_split` (picklable)."""

    def __init__(self, collate_fn: CollateFn) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        if isinstance(batch, list) and not batch:
            return batch
        return next_token_split(batch)
