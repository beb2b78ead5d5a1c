"""Helpers shared by the object-tier and promotion tests (no tests here)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import torch

import ckptd
from ckptd.config import override
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

SMALL_CHUNK = 256 * 1024


def s3_client(server: EmbeddedS3) -> Any:
    """A plain boto3 client on the test server, for looking behind ckptd's back."""
    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def object_tier(bucket: str, options: dict[str, Any], prefix: str = "run") -> ObjectTier:
    return ObjectTier(f"s3://{bucket}/{prefix}", storage_options=options)


def model_state(seed: int, *, frozen_elements: int = 256 * 1024, trained_elements: int = 4096) -> dict[str, torch.Tensor]:
    """A fine-tuning-like state: a frozen part fixed by seed 0 and a trained part that depends on ``seed``."""
    frozen = torch.Generator().manual_seed(0)
    trained = torch.Generator().manual_seed(1000 + seed)
    return {"frozen": torch.randn(frozen_elements, generator=frozen),
            "trained": torch.randn(trained_elements, generator=trained)}


def save_local(directory: Path | str, states: dict[int, dict[str, torch.Tensor]], *,
               chunk_bytes: int = SMALL_CHUNK, keep_local: int | None = None,
               pack_below_bytes: int = 0) -> LocalTier:
    """Save each ``{step: state}`` to a local tier (no object tier) and return that tier. By default
    without packs, so that every chunk becomes its own object on the object tier (what the tests of
    dedup, GC and corruption of chunk objects look at; packs: tests/test_packed_chunks.py)."""
    with override(chunk_bytes=chunk_bytes, pack_below_bytes=pack_below_bytes):
        with ckptd.CheckpointManager(directory, capture_rng=False,
                                     policy=ckptd.Policy(keep_local=keep_local)) as manager:
            for step, state in sorted(states.items()):
                manager.save(step, state)
    return LocalTier(directory)


def zero_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in state.items()}


def same_bytes(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    """Whether two states hold identical bytes (not merely close values)."""
    return first.keys() == second.keys() and all(
        first[name].dtype == second[name].dtype
        and first[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        == second[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        for name in first)


def flip_bit(path: Path | str, offset: int) -> None:
    """Flip the lowest bit of one byte of a local file in place."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 1]))
        handle.flush()
        os.fsync(handle.fileno())
