"""Response timestamps parsed without dateutil (:mod:`ckptd.tiers.s3_timestamps`): the same instants as
botocore's own parser for every form S3 sends, and the object tier's listings and HEADs against moto's
server carry the store's times through the fast parser."""

from __future__ import annotations

import datetime
import time

import pytest
from botocore.utils import parse_timestamp as botocore_parse

from ckptd.tiers import s3_timestamps
from ckptd.tiers.s3_blocking import make_blocking_client
from ckptd.tiers.s3_timestamps import parse_timestamp
from test_promotion_support import object_tier


@pytest.mark.parametrize("value", [
    "2026-12-06T02:18:13.000Z",          # ListObjectsV2 in XML
    "2026-12-06T02:18:13Z",
    "2026-12-06T02:18:13.123456Z",
    "2026-12-06T02:18:13.5+02:00",
    "2026-12-06T02:18:13.5Z",            # one digit of fraction: Python 3.10 falls back to botocore
    "2026-12-06t02:18:13z",
    "2026-12-06T02:18:13",               # no zone: botocore's reading
    "Sun, 06 Dec 2026 02:18:13 GMT",     # Last-Modified header
    "1796523493",                        # epoch seconds
    1796523493.25,
])
def test_every_form_parses_to_the_instant_botocore_gives(value: object) -> None:
    parsed, expected = parse_timestamp(value), botocore_parse(value)
    assert (parsed.tzinfo is None) == (expected.tzinfo is None), "aware exactly where botocore's is"
    assert parsed.timestamp() == pytest.approx(expected.timestamp(), abs=1e-6)


def test_iso_dates_skip_dateutil(monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.utils

    def refuse(value: object) -> datetime.datetime:
        raise AssertionError(f"dateutil asked for {value!r}")

    monkeypatch.setattr(botocore.utils, "parse_timestamp", refuse)
    assert parse_timestamp("2026-12-06T02:18:13.000Z") == datetime.datetime(2026, 12, 6, 2, 18, 13,
                                                                            tzinfo=datetime.timezone.utc)
    with pytest.raises(AssertionError, match="dateutil asked"):
        parse_timestamp("Sun, 06 Dec 2026 02:18:13 GMT")


def test_not_a_date_is_an_error_as_before() -> None:
    with pytest.raises(ValueError):
        parse_timestamp("2026-13-45T99:99:99Z")


@pytest.mark.s3
def test_the_object_tier_lists_the_stores_times_through_the_fast_parser(
        s3_bucket: str, s3_options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = s3_timestamps.parse_timestamp

    def counted(value: object) -> datetime.datetime:
        calls.append(value)
        return real(value)

    monkeypatch.setattr(s3_timestamps, "parse_timestamp", counted)  # what use_fast_timestamps installs
    tier = object_tier(s3_bucket, s3_options, prefix="timestamps")
    before = time.time()
    for name in ("a", "b", "c"):
        tier.write_bytes(f"chunks/{name}", name.encode())
    listed = tier.list_objects("chunks")
    assert sorted(obj.path for obj in listed) == ["chunks/a", "chunks/b", "chunks/c"]
    # the store's clock and this one agree to within moto's one-second resolution
    assert all(before - 2 <= obj.modified <= time.time() + 2 for obj in listed)
    assert sum(isinstance(value, str) and value.endswith("Z") for value in calls) >= 3  # the listing's dates
    age = tier.age_s("chunks/a")
    assert age is not None and -2 <= age <= time.time() - before + 2


@pytest.mark.s3
def test_a_blocking_client_parses_with_the_fast_parser(s3_options: dict) -> None:
    from ckptd.tiers.s3_options import s3fs_options

    client = make_blocking_client(s3fs_options(s3_options))
    factory = client._endpoint._response_parser_factory
    assert factory._defaults["timestamp_parser"] is parse_timestamp
