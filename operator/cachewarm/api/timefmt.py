"""Times as Kubernetes writes them in objects (RFC 3339, whole seconds, `Z`): the one
format of status, conditions and annotations cachewarm writes, and the one parser of the
times it reads there (which may carry fractions or an offset)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Final

FORMAT: Final = "%Y-%m-%dT%H:%M:%SZ"


def rfc3339(when: dt.datetime) -> str:
    """`when` as 2026-11-27T04:00:00Z (an aware time converted to UTC first)."""
    return (when.astimezone(dt.timezone.utc) if when.tzinfo is not None else when).strftime(FORMAT)


def parse(value: Any) -> dt.datetime:
    """An aware datetime from an RFC 3339 string (`Z` or an offset; a time without one is
    read as UTC). Raises ValueError for anything else."""
    when = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)


def parse_or_none(value: Any) -> dt.datetime | None:
    """parse, or None for an empty or unreadable value."""
    if not value:
        return None
    try:
        return parse(value)
    except ValueError:
        return None
