"""Property: any state built from containers, Python values and tensors of any dtype and shape comes
back from a save and a restore bit for bit (hypothesis generates the states)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.testing.compare import assert_same_state

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    raw = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return (tensor % 2).view(torch.bool).reshape(shape)
    tensor = tensor.view(dtype).reshape(shape)
    return tensor.t() if tensor.dim() == 2 and draw(st.booleans()) else tensor


# Python floats go through JSON, which keeps every finite and infinite value but only one NaN (tensors
# keep NaN payloads; see the dtype round trips).
leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                   st.text(max_size=12), st.binary(max_size=12), tensors())
keys = st.one_of(st.text(max_size=8), st.integers(-5, 5))
trees = st.recursive(leaves, lambda children: st.one_of(st.lists(children, max_size=4), st.tuples(children, children),
                                                         st.dictionaries(keys, children, max_size=4)), max_leaves=10)
states = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda key: not key.startswith("__ckptd")), trees,
                         max_size=4)


_steps = itertools.count(1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states)
def test_any_state_round_trips_bit_for_bit(tmp_path: Path, state: dict[str, Any]) -> None:
    """Each example saves a new step into one directory (keeping only the newest) with one manager and
    restores it with a fresh one, so the bytes come from disk, not from the saving process's memory."""
    step, options = next(_steps), {"policy": Policy(keep_local=1), "capture_rng": False}
    with CheckpointManager(tmp_path / "checkpoints", **options) as writer:
        writer.save(step, state, force=True)
    restored: dict[str, Any] = {}
    with CheckpointManager(tmp_path / "checkpoints", **options) as reader:
        assert reader.restore(restored) == step
    assert_same_state(restored, state)
