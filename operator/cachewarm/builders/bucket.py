"""What a cache's bucket should look like, and the smallest patch that gets it there.

The operator owns exactly one lifecycle rule per cache: Delete at an age, scoped to the
cache's prefix. Every other rule on the bucket belongs to someone else and is kept as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm import constants as c
from cachewarm.model import GcsStorage

DAY = 86_400
# JAX names entries <module>-<sha256 hex>-cache (and -atime when its LRU is on);
# nothing else under a prefix is ours to delete.
ENTRY_NAME = re.compile(r"^[^/]+-[0-9a-f]{64}-(cache|atime)$")


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


def owner_labels(namespace: str, name: str) -> dict[str, str]:
    """Labels on a bucket cachewarm created, naming the cache that created it."""
    return {
        c.GCS_LABEL_MANAGED_BY: c.MANAGED_BY,
        c.GCS_LABEL_NAMESPACE: namespace[:63],
        c.GCS_LABEL_CACHE: name[:63],
    }


def created_by(bucket: BucketInfo, namespace: str, name: str) -> bool:
    """True when the bucket carries the labels of this cache's creation."""
    return all(bucket.labels.get(k) == v for k, v in owner_labels(namespace, name).items())


def lifecycle_rule(gcs: GcsStorage) -> dict[str, Any]:
    """The one rule this cache owns: delete entries older than deleteAfterDays."""
    condition: dict[str, Any] = {"age": gcs.lifecycle.delete_after_days}
    if gcs.object_prefix:
        condition["matchesPrefix"] = [gcs.object_prefix]
    return {"action": {"type": "Delete"}, "condition": condition}


def _is_owned(rule: Mapping[str, Any], gcs: GcsStorage) -> bool:
    action = rule.get("action") or {}
    cond = rule.get("condition") or {}
    if action.get("type") != "Delete" or set(cond) - {"age", "matchesPrefix"} or "age" not in cond:
        return False
    prefixes = list(cond.get("matchesPrefix") or [])
    return prefixes == ([gcs.object_prefix] if gcs.object_prefix else [])


def _normal(rule: Mapping[str, Any]) -> dict[str, Any]:
    cond = dict(rule.get("condition") or {})
    if "age" in cond:
        cond["age"] = int(cond["age"])
    return {"action": dict(rule.get("action") or {}), "condition": cond}


def merged_lifecycle(existing: Sequence[Mapping[str, Any]], gcs: GcsStorage) -> list[dict[str, Any]]:
    """Existing rules with ours set to the spec: others kept in order, ours last and once."""
    others = [_normal(r) for r in existing if not _is_owned(r, gcs)]
    return [*others, lifecycle_rule(gcs)]


def observed_delete_after_days(bucket: BucketInfo, gcs: GcsStorage) -> int | None:
    """Age of this cache's own lifecycle rule on the bucket, or None if it has none."""
    for rule in bucket.lifecycle_rules:
        if _is_owned(rule, gcs):
            return int(rule["condition"]["age"])
    return None


def location_matches(bucket: BucketInfo, gcs: GcsStorage) -> bool:
    return bucket.location.casefold() == gcs.location.casefold()


def bucket_patch(bucket: BucketInfo, gcs: GcsStorage, *, created_by_us: bool) -> dict[str, Any]:
    """The fields to PATCH so the bucket matches the spec; empty when it already does.

    Lifecycle and soft delete are managed on every bucket; access settings, storage class
    and labels only on buckets cachewarm created (an adopted bucket's are its owner's).
    """
    patch: dict[str, Any] = {}
    wanted_rules = merged_lifecycle(bucket.lifecycle_rules, gcs)
    if [_normal(r) for r in bucket.lifecycle_rules] != wanted_rules:
        patch["lifecycle"] = {"rule": wanted_rules}
    wanted_soft = gcs.soft_delete_days * DAY
    if bucket.soft_delete_seconds != wanted_soft:
        patch["softDeletePolicy"] = {"retentionDurationSeconds": wanted_soft}
    if created_by_us:
        if not bucket.uniform_access or bucket.public_access_prevention != "enforced":
            patch["iamConfiguration"] = {
                "uniformBucketLevelAccess": {"enabled": True},
                "publicAccessPrevention": "enforced",
            }
        if bucket.storage_class != gcs.storage_class:
            patch["storageClass"] = gcs.storage_class
    return patch


def is_cache_entry(object_name: str, gcs: GcsStorage) -> bool:
    """True for a JAX cache entry directly under this cache's prefix."""
    if not object_name.startswith(gcs.object_prefix):
        return False
    return ENTRY_NAME.match(object_name[len(gcs.object_prefix):]) is not None
