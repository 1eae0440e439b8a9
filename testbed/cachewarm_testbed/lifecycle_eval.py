"""GCS Object Lifecycle Management, evaluated as data: which rules would act on an object.

The emulator stores lifecycle rules but never runs them, so tests check the rules the
operator wrote against GCS's documented semantics, here and only here
(https://cloud.google.com/storage/docs/lifecycle):

- A rule acts on an object when the object meets *all* of the rule's conditions; several
  rules with the same action act when *any* of them matches.
- matchesPrefix / matchesSuffix: lists; met when any entry is a plain string prefix /
  suffix of the object's name (no globbing, '/' is an ordinary character).
- age: met once the object is at least that many days past its creation time.
- daysSinceCustomTime: met once that many days have passed since the object's customTime.
  "If no custom timestamp is specified on an object, the condition does not apply"
  (JSON API reference): read here as *not met*, the reading under which an entry without
  a customTime is never deleted by such a rule (the cautious one for our claims).
- isLive / numNewerVersions / daysSinceNoncurrentTime / noncurrentTimeBefore: objects
  here are live versions (isLive met only by true, numNewerVersions only by 0, the
  noncurrent ones never).

A condition this module does not know raises, so a test never passes by ignoring one.
tests/unit/test_lifecycle_gcs_docs.py pins each reading above to the sentence of GCS's
documentation it comes from.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DAY = dt.timedelta(days=1)


@dataclass(frozen=True)
class ObjectState:
    name: str
    created: dt.datetime
    custom_time: dt.datetime | None = None
    storage_class: str = "STANDARD"


def _date(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value[:10]).replace(tzinfo=dt.timezone.utc)


def name_conditions_met(rule: Mapping[str, Any], name: str) -> bool:
    """Whether the rule's name conditions (matchesPrefix, matchesSuffix) hold for `name`:
    the rule can act on this object at some time. A rule without them matches every name."""
    cond = rule.get("condition") or {}
    if "matchesPattern" in cond:
        raise NotImplementedError("matchesPattern (RE2) is not evaluated")
    prefixes = cond.get("matchesPrefix")
    suffixes = cond.get("matchesSuffix")
    if prefixes is not None and not any(name.startswith(p) for p in prefixes):
        return False
    return suffixes is None or any(name.endswith(s) for s in suffixes)


def _condition_met(key: str, value: Any, obj: ObjectState, now: dt.datetime) -> bool:
    if key in ("matchesPrefix", "matchesSuffix"):
        return name_conditions_met({"condition": {key: value}}, obj.name)
    if key == "age":
        return now - obj.created >= int(value) * DAY
    if key == "createdBefore":
        return obj.created < _date(str(value))
    if key == "daysSinceCustomTime":
        return obj.custom_time is not None and now - obj.custom_time >= int(value) * DAY
    if key == "customTimeBefore":
        return obj.custom_time is not None and obj.custom_time < _date(str(value))
    if key == "matchesStorageClass":
        return obj.storage_class in value
    if key == "isLive":
        return bool(value)
    if key == "numNewerVersions":
        return int(value) == 0
    if key in ("daysSinceNoncurrentTime", "noncurrentTimeBefore"):
        return False
    raise NotImplementedError(f"lifecycle condition {key!r} is not evaluated")


def acts_on(rule: Mapping[str, Any], obj: ObjectState, now: dt.datetime) -> bool:
    """Whether this rule's action applies to the object at `now` (all conditions met)."""
    cond = rule.get("condition") or {}
    if not cond:
        raise ValueError("a lifecycle rule needs at least one condition")
    return all(_condition_met(k, v, obj, now) for k, v in cond.items())


def deletes(rules: Iterable[Mapping[str, Any]], obj: ObjectState, now: dt.datetime) -> bool:
    """Whether GCS would delete the object at `now`: any Delete rule acts on it."""
    return any((r.get("action") or {}).get("type") == "Delete" and acts_on(r, obj, now) for r in rules)


def rules_matching_name(rules: Iterable[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    """The rules whose name conditions hold for `name` (those that may ever act on it)."""
    return [r for r in rules if name_conditions_met(r, name)]
