"""status.conditions in the Kubernetes style: one entry per type, lastTransitionTime
changes only when the status does, so a repeated reconcile writes identical bytes."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachewarm.api import timefmt


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool | None  # None is "Unknown"
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def merge(
    existing: Sequence[Mapping[str, Any]] | None,
    updates: Sequence[Cond],
    *,
    generation: int,
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """Existing conditions with `updates` applied, sorted by type."""
    by_type = {str(c["type"]): dict(c) for c in existing or []}
    for cond in updates:
        old = by_type.get(cond.type)
        changed = old is None or old.get("status") != cond.status_text
        by_type[cond.type] = {
            "type": cond.type,
            "status": cond.status_text,
            "reason": cond.reason,
            "message": cond.message,
            "observedGeneration": generation,
            "lastTransitionTime": (
                timefmt.rfc3339(now) if changed or old is None else old["lastTransitionTime"]
            ),
        }
    return [by_type[k] for k in sorted(by_type)]


def get(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None
