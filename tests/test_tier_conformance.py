"""Every tier in the registry passes the shipped conformance suite (the object tier against moto's
server on loopback). A scheme registered without a setup here fails ``test_every_scheme_is_covered``."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptd.testing.tier_conformance import TierConformance
from ckptd.tiers import direct_io, open_tier, registered_schemes
from ckptd.tiers.base import StorageTier


@contextlib.contextmanager
def _local_write_fault(tier: StorageTier) -> Iterator[None]:
    """Writes put half their bytes on disk and then fail with ENOSPC (the real write, cut short)."""
    original = direct_io.pwrite_all

    def half_then_full(fd: int, view: memoryview, offset: int) -> None:
        original(fd, view[: len(view) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    direct_io.pwrite_all = half_then_full  # type: ignore[assignment]
    try:
        yield
    finally:
        direct_io.pwrite_all = original  # type: ignore[assignment]


@contextlib.contextmanager
def _object_write_fault(tier: StorageTier) -> Iterator[None]:
    """A single PUT is lost on the wire; a multipart upload loses its second part (the others go up)."""
    active = [True]

    def failing(method: str, params: dict[str, Any]) -> None:
        if active[0] and (method == "put_object" or (method == "upload_part" and params.get("PartNumber") == 2)):
            raise ConnectionError(f"injected: {method} lost")

    tier.on_call(failing)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        active[0] = False


@dataclass(frozen=True)
class _Setup:
    """How the suite opens a fresh, empty tier of one scheme, and breaks its writes."""

    name: str
    open: Callable[[pytest.FixtureRequest, Path], StorageTier]
    write_fault: Callable[[StorageTier], Any]
    marks: tuple[Any, ...] = ()


def _s3(prefix: str) -> Callable[[pytest.FixtureRequest, Path], StorageTier]:
    def opener(request: pytest.FixtureRequest, tmp_path: Path) -> StorageTier:
        bucket, options = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_options")
        return open_tier(f"s3://{bucket}{prefix}", storage_options=options)

    return opener


def _peer(request: pytest.FixtureRequest, tmp_path: Path) -> StorageTier:
    """A replica namespace of a peer server in this process (whose real writes _local_write_fault breaks)."""
    from harness.peer_server import served_replica_tier

    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    return stack.enter_context(served_replica_tier(tmp_path / "replicas"))


SETUPS: dict[str, list[_Setup]] = {
    "file": [_Setup("local", lambda request, tmp_path: open_tier(str(tmp_path / "ckpt"), create=True),
                    _local_write_fault),
             _Setup("local-url", lambda request, tmp_path: open_tier(f"file://{tmp_path}/ckpt", create=True),
                    _local_write_fault)],
    "s3": [_Setup("s3-prefix", _s3("/run1"), _object_write_fault, (pytest.mark.s3,)),
           _Setup("s3-bucket-root", _s3(""), _object_write_fault, (pytest.mark.s3,))],
    "peer": [_Setup("peer-replica", _peer, _local_write_fault)],
}

_CASES = [pytest.param(setup, id=f"{scheme}:{setup.name}", marks=list(setup.marks))
          for scheme in registered_schemes() for setup in SETUPS.get(scheme, [])]


def test_every_scheme_is_covered() -> None:
    schemes = registered_schemes()
    assert {"file", "s3"} <= set(schemes)
    assert set(schemes) <= set(SETUPS), f"no conformance setup for {sorted(set(schemes) - set(SETUPS))}"


class TestRegisteredTiers(TierConformance):
    @pytest.fixture(params=_CASES)
    def setup(self, request: pytest.FixtureRequest) -> _Setup:
        return request.param

    @pytest.fixture
    def tier(self, setup: _Setup, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageTier]:
        opened = setup.open(request, tmp_path)
        try:
            yield opened
        finally:
            opened.close()

    @pytest.fixture
    def write_fault(self, setup: _Setup) -> Callable[[StorageTier], Any]:
        return setup.write_fault
