"""Reconcile a CompilationCache's bucket: create or adopt, check the region, keep the
lifecycle rule and soft delete as the spec says, and clean up on deletion.

Every step reads GCS first and writes only the difference, so a reconcile interrupted at
any point (or repeated) converges without duplicate writes. Returns what happened; the
handler turns that into status, conditions and events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachewarm import constants as c
from cachewarm.builders import bucket as b
from cachewarm.clients.gcs import GcsClient, GcsConflict, GcsForbidden
from cachewarm.conditions import Cond
from cachewarm.model import GcsStorage


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class BucketOutcome:
    """What reconcile_bucket found and did."""

    condition: Cond
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    cache: dict[str, int] | None = None

    @property
    def ready(self) -> bool:
        return bool(self.condition.status)


def _changed_fields(patch: dict[str, Any]) -> str:
    return ", ".join(sorted(patch))


def reconcile_bucket(
    gcs: GcsClient, spec: GcsStorage, *, namespace: str, name: str, spec_changed: bool
) -> BucketOutcome:
    """Bring the bucket to the spec. Raises GcsError for failures worth retrying.

    `spec_changed` says whether this run follows a spec change (writes are then
    "configuration") or not (writes then undo drift made outside cachewarm).
    """
    events: list[Event] = []
    bucket = gcs.get_bucket(spec.bucket)
    if bucket is None:
        if not spec.create:
            return BucketOutcome(Cond(
                c.Condition.BUCKET_READY, False, c.Reason.BUCKET_NOT_FOUND,
                f"Bucket {spec.bucket} does not exist and spec.storage.gcs.create is false; "
                "create it or set create: true",
            ))
        try:
            bucket = gcs.create_bucket(
                spec.bucket, location=spec.location, storage_class=spec.storage_class,
                labels=b.owner_labels(namespace, name),
            )
        except GcsConflict:
            # Either a concurrent reconcile of ours created it a moment ago (then we can
            # read it and carry on), or another project owns the name (then reading it
            # is forbidden).
            try:
                bucket = gcs.get_bucket(spec.bucket)
            except GcsForbidden:
                bucket = None
            if bucket is None:
                return BucketOutcome(Cond(
                    c.Condition.BUCKET_READY, False, c.Reason.NAME_TAKEN,
                    f"Bucket name {spec.bucket} is taken by another project; choose another name",
                ))
        else:
            events.append(Event("Normal", c.Reason.BUCKET_CREATED,
                                f"Created bucket {spec.bucket} in {spec.location} ({spec.storage_class})"))

    if not b.location_matches(bucket, spec):
        return BucketOutcome(
            Cond(c.Condition.BUCKET_READY, False, c.Reason.LOCATION_MISMATCH,
                 f"Bucket {spec.bucket} is in {bucket.location}, but spec asks for {spec.location}; "
                 "cachewarm never moves buckets: fix spec.storage.gcs.location or use another bucket"),
            status=_status(bucket, spec, namespace, name),
            events=events,
        )

    mine = b.created_by(bucket, namespace, name)
    patch = b.bucket_patch(bucket, spec, created_by_us=mine)
    if patch:
        bucket = gcs.patch_bucket(spec.bucket, patch)
        if spec_changed or events:
            events.append(Event("Normal", c.Reason.BUCKET_CONFIGURED,
                                f"Configured bucket {spec.bucket}: {_changed_fields(patch)}"))
        else:
            events.append(Event("Warning", c.Reason.DRIFT_CORRECTED,
                                f"Restored {_changed_fields(patch)} on bucket {spec.bucket}, changed outside cachewarm"))

    how = "created by cachewarm" if mine else "adopted"
    return BucketOutcome(
        Cond(c.Condition.BUCKET_READY, True, c.Reason.RECONCILED,
             f"Bucket {spec.bucket} ({how}) is in {bucket.location} with lifecycle "
             f"{spec.lifecycle.delete_after_days}d and soft delete {spec.soft_delete_days}d"),
        status=_status(bucket, spec, namespace, name),
        events=events,
        cache=cache_inventory(gcs, spec),
    )


def _status(bucket: b.BucketInfo, spec: GcsStorage, namespace: str, name: str) -> dict[str, Any]:
    soft = bucket.soft_delete_seconds
    return {
        "url": spec.url,
        "location": bucket.location,
        "storageClass": bucket.storage_class,
        "createdByCachewarm": b.created_by(bucket, namespace, name),
        "deleteAfterDays": b.observed_delete_after_days(bucket, spec),
        "softDeleteDays": soft // b.DAY if soft is not None else None,
    }


def cache_inventory(gcs: GcsClient, spec: GcsStorage) -> dict[str, int]:
    """Entries and bytes of this cache, counted on the bucket itself."""
    entries = 0
    size = 0
    for obj in gcs.list_objects(spec.bucket, spec.object_prefix):
        if b.is_cache_entry(obj.name, spec) and obj.name.endswith("-cache"):
            entries += 1
            size += obj.size
    return {"entries": entries, "bytes": size}


def delete_cache_data(gcs: GcsClient, spec: GcsStorage, *, namespace: str, name: str) -> list[Event]:
    """deletionPolicy Delete: remove this cache's entries, and the bucket if cachewarm made it
    and it is then empty. Objects that are not JAX cache entries are never touched.
    Raises GcsError (the finalizer stays and the deletion is retried)."""
    events: list[Event] = []
    bucket = gcs.get_bucket(spec.bucket)  # None when it is gone
    if bucket is None:
        return [Event("Normal", c.Reason.DATA_DELETED, f"Bucket {spec.bucket} is already gone")]
    deleted = 0
    kept = 0
    for obj in gcs.list_objects(spec.bucket, spec.object_prefix):
        if b.is_cache_entry(obj.name, spec):
            gcs.delete_object(spec.bucket, obj.name)
            deleted += 1
        else:
            kept += 1
    events.append(Event("Normal", c.Reason.DATA_DELETED,
                        f"Deleted {deleted} cache objects under {spec.url}"))
    if not b.created_by(bucket, namespace, name):
        events.append(Event("Normal", c.Reason.BUCKET_KEPT,
                            f"Kept bucket {spec.bucket}: cachewarm did not create it"))
        return events
    remaining = kept if spec.prefix == "" else sum(1 for _ in gcs.list_objects(spec.bucket, ""))
    if remaining:
        events.append(Event("Normal", c.Reason.BUCKET_KEPT,
                            f"Kept bucket {spec.bucket}: {remaining} objects that are not this cache's entries remain"))
        return events
    gcs.delete_bucket(spec.bucket)
    events.append(Event("Normal", c.Reason.BUCKET_DELETED, f"Deleted bucket {spec.bucket}, created by cachewarm"))
    return events
