"""What a bucket looks like to cachewarm: the fields of a GCS bucket it reads, as the GCS
client returns them and the builders compute patches from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BucketInfo:
    """A bucket as GCS reports it (the fields cachewarm reads)."""

    name: str
    location: str
    storage_class: str
    labels: Mapping[str, str] = field(default_factory=dict)
    lifecycle_rules: Sequence[Mapping[str, Any]] = ()
    soft_delete_seconds: int | None = None
    uniform_access: bool = False
    public_access_prevention: str = ""
    metageneration: int = 0
    # Rules the client library could not read (an action type it does not know): while
    # there are any, cachewarm never writes the lifecycle, which would drop them.
    unreadable_rules: int = 0
