"""api/timefmt.py: the one RFC 3339 format and parser."""

from __future__ import annotations

import datetime as dt

import pytest

from cachewarm.api import timefmt

UTC = dt.timezone.utc


def test_times_are_written_in_utc_whole_seconds_with_z() -> None:
    assert timefmt.rfc3339(dt.datetime(2026, 11, 27, 4, 0, 1, 999_999, tzinfo=UTC)) == "2026-11-27T04:00:01Z"
    plus2 = dt.timezone(dt.timedelta(hours=2))
    assert timefmt.rfc3339(dt.datetime(2026, 11, 27, 6, 0, 0, tzinfo=plus2)) == "2026-11-27T04:00:00Z"


@pytest.mark.parametrize("text,expected", [
    ("2026-11-27T04:00:00Z", dt.datetime(2026, 11, 27, 4, 0, tzinfo=UTC)),
    ("2026-11-27T04:00:00.250000Z", dt.datetime(2026, 11, 27, 4, 0, 0, 250_000, tzinfo=UTC)),
    ("2026-11-27T06:00:00+02:00", dt.datetime(2026, 11, 27, 4, 0, tzinfo=UTC)),
    ("2026-11-27T04:00:00", dt.datetime(2026, 11, 27, 4, 0, tzinfo=UTC)),
])
def test_what_the_apiserver_writes_is_read_as_an_aware_time(text: str, expected: dt.datetime) -> None:
    got = timefmt.parse(text)
    assert got == expected and got.tzinfo is not None


def test_unreadable_times_raise_or_read_as_none() -> None:
    with pytest.raises(ValueError):
        timefmt.parse("yesterday")
    assert timefmt.parse_or_none("yesterday") is None and timefmt.parse_or_none(None) is None
    assert timefmt.parse_or_none("2026-11-27T04:00:00Z") == dt.datetime(2026, 11, 27, 4, 0, tzinfo=UTC)
