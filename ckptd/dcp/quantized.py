"""Quantized tensors (``qint8``, ``quint8``, ``qint32``) in DCP saves: integer values plus parameters.

A quantized tensor is stored as its integer representation (``int_repr()``: int8, uint8 or int32 bytes,
chunked and verified like any tensor) and its quantization parameters as JSON in the rank index's
``values["quantized"]`` (:mod:`ckptd.format.values`): the quantized dtype, the scheme and either
``scale``/``zero_point`` (per tensor) or ``scales``/``zero_points``/``axis`` (per channel). Python's
JSON writes floats exactly (shortest repr), so the scales round-trip bit for bit. Loading rebuilds the
quantized tensor and copies it into the target, which takes the saved parameters (a target of another
scheme is refused by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import FormatError

#: Quantized dtype -> the dtype of its integer representation.
INT_REPR_DTYPES = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}
_PER_TENSOR, _PER_CHANNEL = "per_tensor_affine", "per_channel_affine"


@dataclass(frozen=True)
class QuantParams:
    """How the integers of one stored tensor map back to a quantized tensor."""

    dtype: str
    scheme: str
    scale: float = 0.0
    zero_point: int = 0
    scales: tuple[float, ...] = ()
    zero_points: tuple[int, ...] = ()
    axis: int = 0

    def to_json(self) -> dict[str, Any]:
        if self.scheme == _PER_TENSOR:
            return {"dtype": self.dtype, "scheme": self.scheme, "scale": self.scale, "zero_point": self.zero_point}
        return {"dtype": self.dtype, "scheme": self.scheme, "scales": list(self.scales),
                "zero_points": list(self.zero_points), "axis": self.axis}

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class StagedQuantized:
    """A quantized tensor staged by ``async_save``: a copy of its integers and its parameters. DCP saves
    it as a value (the writer stores it as the tensor it stands for); unlike the quantized tensor, it
    reaches DCP's checkpoint process whole (PyTorch's multiprocessing drops the quantizer)."""

    integers: torch.Tensor
    params: QuantParams

    @classmethod
    def of(cls, tensor: torch.Tensor, *, name: str = "") -> StagedQuantized:
        integers, params = split(tensor.detach(), name=name)
        return cls(integers, params)


def split(tensor: torch.Tensor, *, name: str) -> tuple[torch.Tensor, QuantParams]:
    """The integer representation of a quantized tensor and its parameters; FormatError for a dtype or
    scheme ckptd does not store."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    scheme = str(tensor.qscheme()).removeprefix("torch.")
    if dtype not in INT_REPR_DTYPES or scheme not in (_PER_TENSOR, _PER_CHANNEL):
        raise FormatError(f"quantized tensor {name!r} ({dtype}, {scheme}) cannot be stored by ckptd",
                          hint="store qint8, quint8 or qint32 with an affine per-tensor or per-channel scheme")
    if scheme == _PER_TENSOR:
        params = QuantParams(dtype, scheme, scale=float(tensor.q_scale()), zero_point=int(tensor.q_zero_point()))
    else:
        params = QuantParams(dtype, scheme, scales=tuple(float(s) for s in tensor.q_per_channel_scales().tolist()),
                             zero_points=tuple(int(z) for z in tensor.q_per_channel_zero_points().tolist()),
                             axis=int(tensor.q_per_channel_axis()))
    return tensor.int_repr().contiguous(), params


def join(integers: torch.Tensor, params: QuantParams) -> torch.Tensor:
    """The quantized tensor ``integers`` and ``params`` stand for."""
    if params.scheme == _PER_TENSOR:
        return torch._make_per_tensor_quantized_tensor(integers, params.scale, params.zero_point)
    return torch._make_per_channel_quantized_tensor(integers, torch.tensor(params.scales, dtype=torch.float64),
                                                     torch.tensor(params.zero_points, dtype=torch.int64),
                                                     params.axis)


def parse(raw: Any, *, name: str, stored_dtype: str, path: str | None = None, step: int | None = None) -> QuantParams:
    """Validate one ``values["quantized"]`` entry against the stored integer dtype."""

    def fail(why: str) -> Any:
        raise FormatError(f"quantization record of {name!r} is malformed: {why}", path=path, step=step)

    if not isinstance(raw, dict) or INT_REPR_DTYPES.get(raw.get("dtype")) != stored_dtype:
        fail(f"its dtype does not match the stored {stored_dtype}")
    if raw.get("scheme") == _PER_TENSOR:
        scale, zero_point = raw.get("scale"), raw.get("zero_point")
        if not isinstance(scale, (int, float)) or not isinstance(zero_point, int):
            fail("scale must be a number and zero_point an integer")
        return QuantParams(raw["dtype"], _PER_TENSOR, scale=float(scale), zero_point=zero_point)
    if raw.get("scheme") == _PER_CHANNEL:
        scales, zero_points, axis = raw.get("scales"), raw.get("zero_points"), raw.get("axis")
        if not (isinstance(scales, list) and isinstance(zero_points, list) and len(scales) == len(zero_points)
                and all(isinstance(s, (int, float)) for s in scales) and all(isinstance(z, int) for z in zero_points)
                and isinstance(axis, int) and axis >= 0):
            fail("per-channel scales, zero_points and axis do not fit together")
        return QuantParams(raw["dtype"], _PER_CHANNEL, scales=tuple(float(s) for s in scales),
                           zero_points=tuple(zero_points), axis=axis)
    return fail(f"unknown scheme {raw.get('scheme')!r}")
