"""Bit-exact comparison of training states, for tests of "a restore returns the bytes that were saved".

:func:`state_differences` walks two states side by side and lists every difference: types, structure,
dtypes, shapes and the raw bytes of tensors and numpy arrays (so NaN payloads, ``-0.0`` and subnormals
count). Floats compare by bit pattern. Objects with ``state_dict()`` are compared through it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor in row-major order, as a flat uint8 tensor (conjugate and negative
    views resolved; no copy when the tensor is already a plain contiguous CPU tensor)."""
    plain = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if plain.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return plain.reshape(-1).view(torch.uint8)


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def state_differences(actual: Any, expected: Any, path: str = "state") -> list[str]:
    """Every way ``actual`` differs from ``expected``, one line each; empty when they are bit-identical."""
    if hasattr(expected, "state_dict") and callable(expected.state_dict) and not isinstance(expected, Mapping):
        if not (hasattr(actual, "state_dict") and callable(actual.state_dict)):
            return [f"{path}: expected an object with state_dict(), got {type(actual).__name__}"]
        return state_differences(actual.state_dict(), expected.state_dict(), f"{path}.state_dict()")
    if type(actual) is not type(expected):
        return [f"{path}: type {type(actual).__name__} != {type(expected).__name__}"]
    if isinstance(expected, torch.Tensor):
        return _tensor_differences(actual, expected, path)
    if isinstance(expected, np.ndarray):
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [f"{path}: array {actual.dtype}{actual.shape} != {expected.dtype}{expected.shape}"]
        same = np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes()
        return [] if same else [f"{path}: array bytes differ"]
    if isinstance(expected, Mapping):
        if list(actual.keys()) != list(expected.keys()):
            return [f"{path}: keys {list(actual.keys())!r} != {list(expected.keys())!r}"]
        return [line for key in expected for line in state_differences(actual[key], expected[key], f"{path}[{key!r}]")]
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return [f"{path}: length {len(actual)} != {len(expected)}"]
        return [line for i, (item, wanted) in enumerate(zip(actual, expected))
                for line in state_differences(item, wanted, f"{path}[{i}]")]
    if isinstance(expected, float):
        return [] if _float_bits(actual) == _float_bits(expected) else [f"{path}: {actual!r} != {expected!r}"]
    if isinstance(expected, np.generic):
        same = actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes()
        return [] if same else [f"{path}: {actual!r} != {expected!r}"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def _tensor_differences(actual: torch.Tensor, expected: torch.Tensor, path: str) -> list[str]:
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return [f"{path}: tensor {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}"]
    if not torch.equal(tensor_bytes(actual), tensor_bytes(expected)):
        return [f"{path}: tensor bytes differ ({expected.dtype}{list(expected.shape)})"]
    return []


def assert_same_state(actual: Any, expected: Any) -> None:
    """Raise AssertionError listing every difference between two states (see :func:`state_differences`)."""
    differences = state_differences(actual, expected)
    if differences:
        shown = "\n".join(differences[:20])
        more = f"\n... and {len(differences) - 20} more" if len(differences) > 20 else ""
        raise AssertionError(f"states differ:\n{shown}{more}")
