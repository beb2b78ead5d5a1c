"""Type aliases shared across ckptd."""

from __future__ import annotations

from typing import Union

#: Anything that exposes contiguous bytes through the buffer protocol.
Buffer = Union[bytes, bytearray, memoryview]
