"""Both tiers pass the shipped conformance suite (the object tier against moto's server on loopback)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.testing.tier_conformance import TierConformance
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier


class TestLocalTierConformance(TierConformance):
    @pytest.fixture
    def tier(self, tmp_path) -> StorageTier:
        return LocalTier(tmp_path / "ckpt")


@pytest.mark.s3
class TestObjectTierConformance(TierConformance):
    @pytest.fixture
    def tier(self, s3_bucket: str, s3_options: dict[str, Any]) -> StorageTier:
        return ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options)


@pytest.mark.s3
class TestObjectTierAtBucketRootConformance(TierConformance):
    @pytest.fixture
    def tier(self, s3_bucket: str, s3_options: dict[str, Any]) -> StorageTier:
        return ObjectTier(f"s3://{s3_bucket}", storage_options=s3_options)
