"""Round trips through CheckpointManager, bit for bit: every dtype and tensor shape, views, containers,
Python and numpy values, modules, a real model with AdamW state, and every codec."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.format.codecs import CHECKPOINT_CODECS
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads, subnormals and -0.0 included)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def shaped_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One tensor of ``dtype`` per kind of shape and memory layout a state can hold."""
    base = random_tensor((6, 10), dtype, seed=1)
    return {
        "empty": random_tensor((0,), dtype),
        "empty_2d": random_tensor((3, 0, 2), dtype),
        "scalar_0d": random_tensor((), dtype, seed=2),
        "one": random_tensor((1,), dtype, seed=3),
        "matrix": random_tensor((33, 17), dtype, seed=4),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset_narrow": base.narrow(1, 3, 4),
        "expanded": random_tensor((1, 5), dtype, seed=5).expand(4, 5),
        "permuted": random_tensor((2, 3, 4), dtype, seed=6).permute(2, 0, 1),
    }


def save_and_restore(manager_factory: ManagerFactory, state: dict[str, Any], live: dict[str, Any] | None = None,
                     **options: Any) -> dict[str, Any]:
    """Save ``state`` as step 1, restore it through a second manager into ``live`` (default: empty)."""
    writer = manager_factory(**options)
    assert writer.save(1, state, force=True)
    writer.wait()
    writer.close()
    reader = manager_factory(**options)
    target = {} if live is None else live
    assert reader.restore(target) == 1
    reader.close()
    return target


@pytest.mark.parametrize("codec", CHECKPOINT_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips_bit_for_bit(manager_factory: ManagerFactory, dtype: torch.dtype,
                                                      codec: str) -> None:
    saved = shaped_tensors(dtype)
    fresh = save_and_restore(manager_factory, saved, codec=codec)
    assert_same_state(fresh, saved)
    assert all(tensor.is_contiguous() for tensor in fresh.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128, torch.bool], ids=str)
def test_restore_into_live_non_contiguous_tensors_writes_in_place(manager_factory: ManagerFactory,
                                                                  dtype: torch.dtype) -> None:
    saved = shaped_tensors(dtype)
    live = {name: torch.zeros(tensor.shape, dtype=dtype) for name, tensor in saved.items()}
    live["transposed"] = torch.zeros(6, 10, dtype=dtype).t()
    live["strided"] = torch.zeros(6, 10, dtype=dtype)[::2, 1::3]
    live["permuted"] = torch.zeros(2, 3, 4, dtype=dtype).permute(2, 0, 1)
    identities = {name: id(tensor) for name, tensor in live.items()}
    restored = save_and_restore(manager_factory, saved, live=live)
    assert_same_state(restored, saved)
    assert {name: id(tensor) for name, tensor in restored.items()} == identities


def test_views_of_one_storage_restore_as_equal_values_and_live_views_stay_views(
        manager_factory: ManagerFactory) -> None:
    """Documented behaviour: views are saved as separate values. Restored into an empty state they come
    back as equal values; restored into a live state whose tensors are views of one storage, the copy
    goes into that shared memory, so the live views stay views of their base."""
    def views_of(base: torch.Tensor) -> dict[str, torch.Tensor]:
        grid = base.view(4, 6)
        return {"base": base, "row": grid[1], "column": grid[:, 2], "transposed": grid.t(), "window": base[5:11]}

    saved = views_of(torch.arange(24, dtype=torch.float64) * 1.5)
    fresh = save_and_restore(manager_factory, saved)
    assert_same_state(fresh, saved)

    live_base = torch.zeros(24, dtype=torch.float64)
    live = views_of(live_base)
    restored = manager_factory().restore(live)
    assert restored == 1
    assert_same_state(live, saved)
    for name, view in live.items():
        assert view.untyped_storage().data_ptr() == live_base.untyped_storage().data_ptr(), name
    live_base.fill_(-1.0)
    assert bool((live["row"] == -1.0).all()) and bool((live["transposed"] == -1.0).all())


def test_conjugate_and_negative_views_round_trip(manager_factory: ManagerFactory) -> None:
    complex_values = random_tensor((3, 4), torch.complex64, seed=9).nan_to_num()
    saved = {"conj": complex_values.conj(), "neg_imag": complex_values.conj().imag}
    expected = {name: tensor.resolve_conj().resolve_neg().clone() for name, tensor in saved.items()}
    assert_same_state(save_and_restore(manager_factory, saved), expected)


def test_nested_containers_and_python_values_round_trip(manager_factory: ManagerFactory) -> None:
    saved = {
        "nested": {"list": [1, 2.5, "three", None, True, (4, [5.0, {"deep": torch.ones(2, 3)}])],
                   "tuple": (torch.arange(3), ("a", b"\x00\xffbytes")), 7: "int key", 2.5: "float key"},
        "ordered": collections.OrderedDict([("z", 1), ("a", torch.zeros(1))]),
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 5e-324, 1.7976931348623157e308],
        "big_int": 2**80, "negative": -(2**63), "text": "grüße 🚀 \n\t\"quoted\"", "empty": [{}, (), []],
        "numpy_scalars": [np.float32(1.5), np.int64(-7), np.bool_(True), np.complex128(1 - 2j), np.uint8(255)],
        "torch_values": [torch.float16, torch.Size([2, 3]), torch.device("cpu")],
    }
    assert_same_state(save_and_restore(manager_factory, saved), saved)


def test_live_containers_are_updated_in_place(manager_factory: ManagerFactory) -> None:
    saved = {"history": [1.0, 2.0, 3.0], "config": {"lr": 0.1, "name": "run"}, "weights": torch.ones(4)}
    live_history, live_config, live_weights = [0.0, 0.0, 0.0], {"lr": 0.0, "name": ""}, torch.zeros(4)
    live = {"history": live_history, "config": live_config, "weights": live_weights}
    save_and_restore(manager_factory, saved, live=live)
    assert live["history"] is live_history and live["config"] is live_config and live["weights"] is live_weights
    assert_same_state(live, saved)


NUMPY_ARRAYS: dict[str, Callable[[], np.ndarray]] = {
    "float16": lambda: np.linspace(-3, 3, 12, dtype=np.float16).reshape(3, 4),
    "float64_nan": lambda: np.array([np.nan, -0.0, np.inf, 1e-310]),
    "int8": lambda: np.arange(-5, 5, dtype=np.int8),
    "uint64": lambda: np.array([0, 2**64 - 1], dtype=np.uint64),
    "bool": lambda: np.array([[True, False], [False, True]]),
    "complex64": lambda: np.array([1 + 2j, -3j], dtype=np.complex64),
    "big_endian": lambda: np.arange(6, dtype=">i4"),
    "zero_d": lambda: np.array(3.25),
    "empty": lambda: np.zeros((0, 3), dtype=np.int32),
    "transposed": lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,
    "fortran": lambda: np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
}


def test_numpy_arrays_round_trip_with_dtype_and_shape(manager_factory: ManagerFactory) -> None:
    saved = {name: make() for name, make in NUMPY_ARRAYS.items()}
    assert_same_state(save_and_restore(manager_factory, saved), saved)


def test_numpy_arrays_restore_into_live_arrays_in_place(manager_factory: ManagerFactory) -> None:
    saved = {name: make() for name, make in NUMPY_ARRAYS.items()}
    live = {name: np.zeros_like(array) for name, array in saved.items()}
    identities = {name: id(array) for name, array in live.items()}
    save_and_restore(manager_factory, saved, live=live)
    assert_same_state(live, saved)
    assert {name: id(array) for name, array in live.items()} == identities


class Counter:
    """A user object with state_dict()/load_state_dict()."""

    def __init__(self, count: int = 0) -> None:
        self.count, self.history = count, [count]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.history = state["count"], list(state["history"])


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten(), torch.nn.Linear(24, 16),
                               torch.nn.BatchNorm1d(16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 10, (5, 3), generator=generator)
        loss = model(tokens).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_module_and_stateful_objects_load_into_fresh_instances(manager_factory: ManagerFactory) -> None:
    source_model, counter = small_model(seed=1), Counter(41)
    source_model.train()
    source_model(torch.randint(0, 10, (4, 3)))  # moves BatchNorm running stats and its counter
    fresh_model, fresh_counter = small_model(seed=2), Counter()
    save_and_restore(manager_factory, {"model": source_model, "counter": counter},
                     live={"model": fresh_model, "counter": fresh_counter})
    assert_same_state(fresh_model.state_dict(), source_model.state_dict())
    assert (fresh_counter.count, fresh_counter.history) == (41, [41])


@pytest.mark.parametrize("codec", CHECKPOINT_CODECS)
def test_model_and_adamw_state_restore_into_fresh_model_and_optimizer(manager_factory: ManagerFactory,
                                                                       codec: str) -> None:
    model = small_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, optimizer, steps=3, seed=7)
    fresh_model = small_model(seed=2)
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=5.0)
    save_and_restore(manager_factory, {"model": model, "optim": optimizer},
                     live={"model": fresh_model, "optim": fresh_optimizer}, codec=codec)
    assert_same_state(fresh_model.state_dict(), model.state_dict())
    assert_same_state(fresh_optimizer.state_dict(), optimizer.state_dict())
    train_steps(model, optimizer, steps=2, seed=8)
    train_steps(fresh_model, fresh_optimizer, steps=2, seed=8)
    assert_same_state(fresh_model.state_dict(), model.state_dict())


def test_a_file_url_names_the_same_local_directory(manager_factory: ManagerFactory, checkpoint_dir: Path) -> None:
    saved = shaped_tensors(torch.float32)
    writer = manager_factory(checkpoint_dir.resolve().as_uri())
    writer.save(3, saved, force=True)
    writer.close()
    restored: dict[str, Any] = {}
    assert manager_factory(checkpoint_dir).restore(restored) == 3
    assert_same_state(restored, saved)


@pytest.mark.parametrize("actual, expected", [
    (torch.tensor([0.0]), torch.tensor([-0.0])),
    (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int64)),
    (torch.tensor([1.0, 2.0]).t(), torch.tensor([1.0, 2.5])),
    (torch.tensor([True, False]), torch.tensor([True, True])),
    (np.array([0.0]), np.array([-0.0])),
    (float("nan"), -float("nan")),
    ((1, 2), [1, 2]),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
    (np.float32(1.0), np.float64(1.0)),
], ids=["negative-zero", "dtype", "value", "bool", "numpy", "nan-sign", "tuple-vs-list", "key-order", "np-scalar"])
def test_state_comparison_sees_every_bit(actual: Any, expected: Any) -> None:
    """The helper all these tests rely on fails on a single differing bit, type or order."""
    with pytest.raises(AssertionError):
        assert_same_state(actual, expected)
    assert_same_state(expected, expected)
