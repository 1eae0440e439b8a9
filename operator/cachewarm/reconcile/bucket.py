"""Reconcile a CompilationCache's bucket: create or adopt, check the region, keep
cachewarm's lifecycle rules and (for the cache that created the bucket) soft delete
as the specs of the caches on the bucket say, and clean up on deletion.

Every step reads GCS first and writes only the difference, under the bucket's
metageneration: a concurrent edit by someone else makes the write fail (412), and the
bucket is read and merged again. So a reconcile interrupted at any point (or repeated)
converges without duplicate writes and without losing anyone's edit. Returns what
happened; the handler turns that into status, conditions and events.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.bucket import BucketInfo
from cachewarm.builders import bucket as b
from cachewarm.builders.placement import PACK_SUFFIX
from cachewarm.clients.gcs import GcsClient, GcsConflict, GcsForbidden, GcsPreconditionFailed
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import GcsStorage
from cachewarm.agents.warmer import key_hash

MERGE_ATTEMPTS = 5  # re-read and re-merge this often when the bucket changes under us
# Stamping entries without a customTime is one sequential object PATCH each, done inside the
# reconcile: in a kopf handler thread, holding the cache's lock (its timers and change
# handlers wait), after listing the whole prefix. A bucket full of unstamped entries (a
# training pod's first run, or a bucket adopted with years of entries) must not hold the
# cache for minutes, so each reconcile stamps at most STAMP_LIMIT entries and for at most
# STAMP_SECONDS; the rest are stamped on later reconciles and counted in
# status.cache.unstamped meanwhile.
STAMP_LIMIT = 1000
STAMP_SECONDS = 5.0


@dataclass
class BucketOutcome:
    """What reconcile_bucket found and did."""

    condition: Cond
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    cache: dict[str, Any] | None = None
    # The key hashes (warmer.key_hash) of the entries in the bucket under the prefix; None
    # when this reconcile did not list them (see `take_inventory`).
    entry_keys: frozenset[str] | None = None
    # LifecycleReady and SoftDeleteApplied, when the bucket could be read.
    settings: list[Cond] = field(default_factory=list)
    # Rules not cachewarm's that also delete this cache's entries ("#index {condition}"),
    # named in LifecycleReady's message.
    foreign_deleting: list[str] = field(default_factory=list)
    # The bucket is not granted to this cache: status.bucket and status.cache (what earlier
    # reconciles saw of it) are removed, not left as they were.
    withheld: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.condition.status)


def _changed_fields(patch: dict[str, Any]) -> str:
    return ", ".join(sorted(patch))


def _claims_with(claims: Sequence[b.Claim], mine: b.Claim) -> list[b.Claim]:
    """The index's claims on the bucket with this cache's current spec in place of its entry."""
    return [*(cl for cl in claims if cl.key != mine.key), mine]


# --- plan: what to do about the bucket as read (pure; no client) ----------------------------


@dataclass(frozen=True)
class Stop:
    """The bucket cannot be as the spec says: BucketReady False, with what status can still
    say about the bucket."""

    condition: Cond
    status: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Create:
    """Create the bucket with these labels and, in the same call, these settings (fields of
    builders.bucket.bucket_patch: lifecycle and its labels, soft delete, access)."""

    labels: dict[str, str]
    settings: dict[str, Any]


@dataclass(frozen=True)
class Update:
    """PATCH `patch` onto the bucket as read (empty: it already is as the caches on it need);
    `drift` says whether that undoes changes made outside cachewarm. `lifecycle` is
    cachewarm's rule plan for the bucket, which LifecycleReady reads."""

    lifecycle: b.LifecyclePlan
    patch: dict[str, Any]
    drift: bool


def plan_create(spec: GcsStorage, *, mine: b.Claim, claims: Sequence[b.Claim], instance: str,
                limits: b.CreationLimits = b.CreationLimits(), created_in_namespace: int | None = None) -> Stop | Create:
    """The bucket does not exist: create it (with its settings, as the plan for a bucket
    holding nothing yet says, so the next read finds nothing to patch) if the spec says so
    and the operator's admin allows it (`limits`; `created_in_namespace`: the buckets this
    operator created for the namespace that exist now)."""
    if not spec.create:
        return Stop(Cond(c.Condition.BUCKET_READY, False, c.Reason.BUCKET_NOT_FOUND,
                         f"Bucket {spec.bucket} does not exist and spec.storage.gcs.create is false; "
                         "create it or set create: true"))
    refusal = b.creation_refusal(spec, limits, created_in_namespace)
    if refusal is not None:
        return Stop(Cond(c.Condition.BUCKET_READY, False, c.Reason.CREATION_NOT_ALLOWED,
                         f"Bucket {spec.bucket} does not exist and cachewarm will not create it: {refusal}. "
                         "Ask the cluster's admin, or create the bucket yourself and grant it to this namespace "
                         "(docs/bucket-and-data-safety.md#bucket-consent)"))
    labels = b.owner_labels(mine.namespace, mine.name, instance)
    fresh = BucketInfo(name=spec.bucket, location=spec.location, storage_class=spec.storage_class,
                       labels=labels, uniform_access=True, public_access_prevention="enforced")
    claims = b.granted_claims(fresh, claims, instance)  # the new bucket is this namespace's alone
    return Create(labels, b.bucket_patch(
        fresh, spec, plan=b.plan_lifecycle(claims, b.rule_budget(fresh, instance)),
        owns_settings=b.settings_owner(claims, fresh, instance) == mine, created_by_us=True, instance=instance))


def not_granted(bucket: BucketInfo, spec: GcsStorage, *, mine: b.Claim, instance: str) -> BucketOutcome | None:
    """The outcome for a bucket whose owner has not consented to this namespace's use of the
    prefix (None when it has): nothing written, stamped, listed or deleted, nothing of the
    bucket reported (status.bucket and status.cache removed), and the label to add."""
    if b.consent(bucket, mine.namespace, spec.prefix, instance) is not None:
        return None
    key, value = b.grant_label(mine.namespace, spec.prefix, instance)
    where = f"prefix {spec.prefix!r}" if spec.prefix else "the whole bucket"
    # A bucket cachewarm made belongs to the operator's project: its admins grant it.
    owner = ("An admin of the operator's GCP project (cachewarm created this bucket for another namespace or "
             "operator instance)" if bucket.labels.get(c.GCS_LABEL_MANAGED_BY) == c.MANAGED_BY else "Its owner")
    why = (f"Bucket {spec.bucket} exists and its owner has not granted it to namespace {mine.namespace} (cachewarm "
           f"instance {instance}) for {where}: cachewarm writes, stamps, lists and deletes nothing in it and reports "
           f"nothing of it. {owner} grants it by adding the bucket label {key}={value}, e.g. `gcloud storage "
           f"buckets update gs://{spec.bucket} --update-labels={key}={value}` (it covers {spec.url} and everything "
           "under it; removing it revokes the grant); see docs/bucket-and-data-safety.md#bucket-consent")
    held = "cachewarm keeps no lifecycle rule and changes no setting on a bucket not granted to this namespace"
    return BucketOutcome(
        Cond(c.Condition.BUCKET_READY, False, c.Reason.BUCKET_NOT_GRANTED, why),
        settings=[Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.BUCKET_NOT_GRANTED, held),
                  Cond(c.Condition.SOFT_DELETE_APPLIED, False, c.Reason.BUCKET_NOT_GRANTED, held)],
        withheld=True,
    )


def plan_update(bucket: BucketInfo, spec: GcsStorage, *, mine: b.Claim, claims: Sequence[b.Claim], instance: str,
                settings_owned_before: bool, limits: b.CreationLimits = b.CreationLimits()) -> Stop | Update:
    """The bucket exists: refuse one in another location, or a storage class the admin
    does not allow for a bucket this cache created, else the smallest patch that brings it
    to what the caches on it (`claims`, mine included) need."""
    if not b.location_matches(bucket, spec):
        return Stop(Cond(c.Condition.BUCKET_READY, False, c.Reason.LOCATION_MISMATCH,
                         f"Bucket {spec.bucket} is in {bucket.location}, but spec asks for {spec.location}; "
                         "cachewarm never moves buckets: fix spec.storage.gcs.location or use another bucket"),
                    status=_status(bucket, spec, mine, instance))
    created = b.created_by(bucket, mine.namespace, mine.name, instance)
    if created and bucket.storage_class != spec.storage_class and limits.storage_classes \
            and spec.storage_class.upper() not in {s.upper() for s in limits.storage_classes}:
        return Stop(Cond(c.Condition.BUCKET_READY, False, c.Reason.CREATION_NOT_ALLOWED,
                         f"This cache created bucket {spec.bucket} ({bucket.storage_class}) and asks for storage class "
                         f"{spec.storage_class}, which this cluster's admin does not allow for buckets cachewarm creates "
                         f"(CACHEWARM_BUCKET_STORAGE_CLASSES: {', '.join(sorted(limits.storage_classes))}); "
                         "cachewarm changes nothing"),
                    status=_status(bucket, spec, mine, instance))
    lifecycle = b.plan_lifecycle(claims, b.rule_budget(bucket, instance))
    patch = b.bucket_patch(bucket, spec, plan=lifecycle,
                           owns_settings=b.settings_owner(claims, bucket, instance) == mine,
                           created_by_us=b.created_by(bucket, mine.namespace, mine.name, instance), instance=instance)
    drift = bool(patch) and b.changed_outside(bucket, patch, instance, settings_owned_before=settings_owned_before)
    return Update(lifecycle, patch, drift)


def created_event(spec: GcsStorage, settings: dict[str, Any]) -> Event:
    configured = f" with {_changed_fields(settings)}" if settings else ""
    return Event("Normal", c.Reason.BUCKET_CREATED,
                 f"Created bucket {spec.bucket} in {spec.location} ({spec.storage_class}){configured}")


def patched_event(spec: GcsStorage, update: Update, *, configuration: bool) -> Event:
    """The Event for a patch written: configuration (after a spec change or a creation),
    this cache taking over the bucket-wide settings, cachewarm's rules following the caches
    on the bucket, or drift undone."""
    fields = _changed_fields(update.patch)
    if configuration:
        return Event("Normal", c.Reason.BUCKET_CONFIGURED, f"Configured bucket {spec.bucket}: {fields}")
    if not update.drift and "softDeletePolicy" in update.patch:
        return Event("Normal", c.Reason.BUCKET_CONFIGURED,
                     f"Configured bucket {spec.bucket}: {fields} (this cache now owns its bucket-wide settings)")
    if not update.drift:
        return Event("Normal", c.Reason.BUCKET_CONFIGURED,
                     f"Updated cachewarm's lifecycle rules on bucket {spec.bucket} for the caches on it")
    return Event("Warning", c.Reason.DRIFT_CORRECTED,
                 f"Restored {fields} on bucket {spec.bucket}, changed outside cachewarm")


def refused_outcome(bucket: BucketInfo | None, spec: GcsStorage, *, mine: b.Claim, claims: Sequence[b.Claim],
                    refused_by: b.Claim, instance: str) -> BucketOutcome:
    """A cache whose prefix overlaps an older cache's (`refused_by`) manages nothing."""
    other = f"gs://{spec.bucket}/{refused_by.prefix}" if refused_by.prefix else f"gs://{spec.bucket}"
    # A refused cache has no rule of its own: LifecycleReady must not keep saying what the
    # rule it had before deletes.
    lifecycle = Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.PREFIX_IN_USE,
                     f"cachewarm keeps no lifecycle rule for {spec.url} while it overlaps {other}, the cache "
                     f"of {refused_by.ref}: its prefix leaves cachewarm's rules on that cache's next reconcile, "
                     "and then only that cache's rule (for its own prefix) and rules of others act on objects "
                     "under it")
    return BucketOutcome(
        Cond(c.Condition.BUCKET_READY, False, c.Reason.PREFIX_IN_USE,
             f"{spec.url} overlaps {other}, already the cache of {refused_by.ref}; give this "
             "CompilationCache its own bucket or a prefix that neither contains nor is contained in another's"),
        settings=[lifecycle, *([_soft_delete_condition(bucket, spec, mine, claims, instance)]
                               if bucket is not None else [])],
    )


def reconciled_outcome(bucket: BucketInfo, spec: GcsStorage, *, mine: b.Claim, claims: Sequence[b.Claim],
                       lifecycle: b.LifecyclePlan, instance: str, events: list[Event],
                       inventory: tuple[dict[str, Any], frozenset[str]] | None) -> BucketOutcome:
    """BucketReady True, and the settings' conditions for the bucket as the last write left it."""
    how = ("created by cachewarm" if b.created_by(bucket, mine.namespace, mine.name, instance)
           else f"adopted, {b.consent(bucket, mine.namespace, spec.prefix, instance)}")
    rules, foreign_deleting = _with_foreign_deletes(
        _lifecycle_condition(bucket, spec, mine, lifecycle, instance), bucket, spec,
        lifecycle.rule_of.get(mine.key), instance)
    return BucketOutcome(
        Cond(c.Condition.BUCKET_READY, True, c.Reason.RECONCILED,
             f"Bucket {spec.bucket} ({how}) is in {bucket.location}"),
        status=_status(bucket, spec, mine, instance),
        events=events,
        cache=inventory[0] if inventory is not None else None,
        entry_keys=inventory[1] if inventory is not None else None,
        settings=[rules, _soft_delete_condition(bucket, spec, mine, claims, instance)],
        foreign_deleting=foreign_deleting,
    )


# --- observe and apply ------------------------------------------------------------------------


def _create(gcs: GcsClient, spec: GcsStorage, create: Create) -> tuple[BucketInfo, bool] | None:
    """Create the bucket as planned: (the bucket, whether this call created it), or None
    when another project owns the name."""
    try:
        return gcs.create_bucket(spec.bucket, location=spec.location, storage_class=spec.storage_class,
                                 labels=create.labels, settings=create.settings), True
    except GcsConflict:
        # Either a concurrent reconcile of ours created it a moment ago (then we can read
        # it and carry on), or another project owns the name (then reading it is forbidden).
        try:
            bucket = gcs.get_bucket(spec.bucket)
        except GcsForbidden:
            bucket = None
        return (bucket, False) if bucket is not None else None


def _inventory(gcs: GcsClient, spec: GcsStorage, *, created_now: bool,
               take_inventory: bool) -> tuple[dict[str, Any], frozenset[str]] | None:
    if created_now:
        # Made by this reconcile a moment ago: nothing can be in it yet, no listing needed.
        return {"entries": 0, "bytes": 0, "unstamped": 0}, frozenset()
    return cache_inventory(gcs, spec) if take_inventory else None


class CreatedCounts:
    """How many buckets of the operator's project this operator created for each namespace
    (their creation labels), for CACHEWARM_BUCKETS_PER_NAMESPACE. One listing of the
    project's buckets serves every namespace for `ttl` seconds, and the creations this
    process makes meanwhile are added to it; a bucket deleted meanwhile is seen at the next
    listing (until then its namespace may be refused a creation it is allowed). Listed
    only when a cache is about to create a bucket; reconciles wait for one listing."""

    def __init__(self, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] | None = None
        self._listed = 0.0

    def count(self, gcs: GcsClient, namespace: str, instance: str) -> int:
        with self._lock:
            if self._counts is None or self._clock() - self._listed > self._ttl:
                counts: dict[tuple[str, str], int] = {}
                for _, labels in gcs.list_bucket_labels():
                    if labels.get(c.GCS_LABEL_MANAGED_BY) == c.MANAGED_BY and c.GCS_LABEL_NAMESPACE in labels:
                        key = (labels[c.GCS_LABEL_NAMESPACE], labels.get(c.GCS_LABEL_INSTANCE, c.DEFAULT_INSTANCE))
                        counts[key] = counts.get(key, 0) + 1
                self._counts, self._listed = counts, self._clock()
            return self._counts.get((namespace[:63], instance), 0)

    def created(self, namespace: str, instance: str) -> None:
        with self._lock:
            if self._counts is not None:
                key = (namespace[:63], instance)
                self._counts[key] = self._counts.get(key, 0) + 1


def reconcile_bucket(
    gcs: GcsClient, spec: GcsStorage, *, mine: b.Claim, claims: Sequence[b.Claim], spec_changed: bool,
    instance: str = c.DEFAULT_INSTANCE, settings_owned_before: bool = True, take_inventory: bool = True,
    limits: b.CreationLimits = b.CreationLimits(), counts: CreatedCounts | None = None,
) -> BucketOutcome:
    """Bring the bucket to the spec. Raises GcsError for failures worth retrying.

    `claims` are every cache the operator knows on this bucket; of them, those the bucket's
    owner consented to (builders.bucket.consent) decide which caches manage their prefix
    (none overlapping an older one), cachewarm's rules on the bucket and who owns soft
    delete. Nothing but a read of the bucket happens before this cache's own consent is
    checked (not_granted). `spec_changed` says whether this run follows a spec change
    (writes are then "configuration") or not (writes then undo drift made outside cachewarm).
    `instance` names this operator on the bucket (rules other instances recorded are foreign).
    `settings_owned_before` says whether this cache owned the bucket-wide settings at its
    previous reconcile; if not, its first soft delete write is configuration, not drift.
    `take_inventory` lists the cache's entries (cache_inventory); without it `cache` and
    `entry_keys` are None. `limits`: what the operator's admin allows a new bucket to be;
    `counts`: the buckets created per namespace (shared by the operator's reconciles; None
    lists them at each creation).

    Each round reads the bucket, decides (plan_create, not_granted, plan_update: pure) and
    writes what they decided; a write refused because the bucket changed since the read
    (412) starts the next round, with consent checked again on what was read.
    """
    claims = _claims_with(claims, mine)
    events: list[Event] = []
    created_now = False
    for _ in range(MERGE_ATTEMPTS):
        bucket = gcs.get_bucket(spec.bucket)
        if bucket is None:
            # A bucket made now would be granted to this namespace only: an older cache of it
            # on an overlapping prefix keeps this one from making it.
            first = b.refused_by([cl for cl in claims if cl.namespace == mine.namespace], mine)
            if first is not None:
                return refused_outcome(None, spec, mine=mine, claims=claims, refused_by=first, instance=instance)
            counts = counts if counts is not None else CreatedCounts(ttl=0)
            counted = (counts.count(gcs, mine.namespace, instance)
                       if spec.create and b.creation_refusal(spec, limits, None) is None else None)
            create = plan_create(spec, mine=mine, claims=claims, instance=instance, limits=limits,
                                 created_in_namespace=counted)
            if isinstance(create, Stop):
                return BucketOutcome(create.condition, status=create.status, events=events)
            made = _create(gcs, spec, create)
            if made is None:
                return BucketOutcome(Cond(c.Condition.BUCKET_READY, False, c.Reason.NAME_TAKEN,
                                          f"Bucket name {spec.bucket} is taken by another project; "
                                          "choose another name"))
            bucket, created = made
            if created:
                created_now = True
                counts.created(mine.namespace, instance)
                events.append(created_event(spec, create.settings))
        refused = not_granted(bucket, spec, mine=mine, instance=instance)
        if refused is not None:
            refused.events = events
            return refused
        granted = b.granted_claims(bucket, claims, instance)
        refused_by = b.refused_by(granted, mine)
        if refused_by is not None:
            return refused_outcome(bucket, spec, mine=mine, claims=granted, refused_by=refused_by, instance=instance)
        update = plan_update(bucket, spec, mine=mine, claims=granted, instance=instance,
                             settings_owned_before=settings_owned_before, limits=limits)
        if isinstance(update, Stop):
            return BucketOutcome(update.condition, status=update.status, events=events)
        if not update.patch:
            break
        try:
            bucket = gcs.patch_bucket(bucket, update.patch)
        except GcsPreconditionFailed:
            continue  # someone changed the bucket since we read it: read and merge again
        events.append(patched_event(spec, update, configuration=spec_changed or created_now))
        break
    else:
        raise GcsPreconditionFailed(f"Bucket {spec.bucket} changed {MERGE_ATTEMPTS} times while cachewarm merged "
                                    "its settings; retrying", status=412)
    return reconciled_outcome(bucket, spec, mine=mine, claims=granted, lifecycle=update.lifecycle, instance=instance,
                              events=events,
                              inventory=_inventory(gcs, spec, created_now=created_now, take_inventory=take_inventory))


def describe_rule(index: int, rule: Mapping[str, Any]) -> str:
    """How a message names a lifecycle rule: its position and its conditions."""
    return f"#{index} {json.dumps(rule.get('condition') or {}, sort_keys=True, separators=(',', ':'))}"


def _with_foreign_deletes(cond: Cond, bucket: BucketInfo, spec: GcsStorage, wanted: Mapping[str, Any] | None,
                          instance: str) -> tuple[Cond, list[str]]:
    """LifecycleReady as it is, its message also naming the rules of others that delete
    this cache's entries by their own conditions (cachewarm never changes them). A copy of
    the very rule the cache needs is already reported by IdenticalForeignRule."""
    if bucket.unreadable_rules:
        return cond, []
    found = [describe_rule(i, rule) for i, rule in b.foreign_rules_deleting_entries(bucket, spec.object_prefix, instance)
             if wanted is None or b.canonical(rule) != b.canonical(wanted)]
    if not found:
        return cond, []
    message = (f"{cond.message}. But lifecycle rule(s) {', '.join(found)} on bucket {spec.bucket}, not "
               f"cachewarm's, also delete JAX entries under {spec.url} by their own conditions, in use or not; "
               "cachewarm never changes them: narrow them (e.g. matchesPrefix outside this prefix) to keep "
               "entries in use")
    return dataclasses.replace(cond, message=message), found


def _lifecycle_condition(bucket: BucketInfo, spec: GcsStorage, mine: b.Claim, plan: b.LifecyclePlan,
                         instance: str) -> Cond:
    if bucket.unreadable_rules:
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.RULES_UNREADABLE,
                    f"Bucket {spec.bucket} has {bucket.unreadable_rules} lifecycle rules of an action type this "
                    "operator's GCS library does not know; writing the lifecycle would drop them, so cachewarm "
                    "leaves it alone. Upgrade cachewarm")
    if mine.key in plan.root_not_allowed:
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.BUCKET_ROOT_NOT_ALLOWED,
                    f"This cache is at the root of bucket {spec.bucket}, where GCS lifecycle conditions cannot tell "
                    "JAX's entries from any other object whose name ends in -cache or -atime (or .cachewarm-pack, "
                    "cachewarm's warmers' packs), in any folder; cachewarm wrote no lifecycle rule and nothing "
                    "expires. Give the cache a prefix, or set lifecycle.allowBucketRoot: true if no other object in "
                    "the bucket ends in -cache, -atime or .cachewarm-pack")
    if mine.key in plan.over_namespace_limit:
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.RULE_LIMIT_REACHED,
                    f"The caches of namespace {mine.namespace} on bucket {spec.bucket} already use "
                    f"{b.RULES_PER_NAMESPACE} distinct deleteAfterDays, the most cachewarm keeps rules for per "
                    f"namespace on one bucket (so that one namespace cannot take a shared bucket's rules and labels); "
                    f"no rule for {mine.delete_after_days} days. Nothing expires; use the deleteAfterDays of another "
                    "of this namespace's caches on the bucket (they share a rule)")
    if mine.key in plan.over_limit:
        foreign, ours = b.split_rules(bucket, instance)
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.RULE_LIMIT_REACHED,
                    f"Bucket {spec.bucket} holds {len(foreign)} lifecycle rules of others and {len(ours)} of "
                    f"cachewarm's (one per distinct deleteAfterDays); GCS allows {b.MAX_LIFECYCLE_RULES} rules and "
                    f"{b.MAX_BUCKET_LABELS} labels per bucket, so no rule for {mine.delete_after_days} days fits. "
                    "Nothing expires; use the deleteAfterDays of another cache on the bucket (they share a rule) "
                    "or another bucket")
    wanted = plan.rule_of.get(mine.key)
    if wanted is not None and b.identical_foreign(bucket, wanted, instance):
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.IDENTICAL_FOREIGN_RULE,
                    f"Bucket {spec.bucket} already holds the lifecycle rule this cache needs, byte for byte, but "
                    "not recorded as this operator's (someone else's, another cachewarm instance's, or a copy "
                    "whose cachewarm-rule label was removed, or two copies of it); cachewarm neither adds a second "
                    "copy nor takes one over. Entries expire as that rule says while it stays; remove the "
                    "unrecorded copies to let cachewarm manage the rule again")
    days = b.observed_delete_after_days(bucket, mine, instance)
    if days is None:
        return Cond(c.Condition.LIFECYCLE_READY, False, c.Reason.BUCKET_BUSY,
                    f"cachewarm's lifecycle rule for {spec.url} is not on the bucket yet; retrying")
    message = (f"Cache entries under {spec.url} (JAX's entries, torch's archives) are deleted {days} days after "
               "their customTime, which warmers "
               "move forward on every entry they write or find, and so are the warmers' packs (*.cachewarm-pack); "
               "other objects never match cachewarm's rules")
    others = b.other_instances(bucket, instance)
    if others:
        return Cond(c.Condition.LIFECYCLE_READY, True, c.Reason.SHARED_WITH_OTHER_OPERATOR,
                    f"{message}. Bucket {spec.bucket} is also used by cachewarm operator instance(s) "
                    f"{', '.join(others)} (this one is {instance}): each keeps only the rules it recorded and "
                    "leaves the others' as they are, but cannot see the other's caches, so prefixes are not "
                    "checked for overlap across operators and the bucket's rule limit is shared")
    return Cond(c.Condition.LIFECYCLE_READY, True, c.Reason.RECONCILED, message)


def _days(seconds: int | None) -> str:
    if seconds is None:
        return "not reported"
    return f"{seconds // b.DAY}d" if seconds else "off"


def _soft_delete_condition(bucket: BucketInfo, spec: GcsStorage, mine: b.Claim, claims: Sequence[b.Claim],
                          instance: str) -> Cond:
    owner = b.settings_owner(claims, bucket, instance)
    if owner is None:
        # Adopted (or its creating cache is gone): the policy protects whatever else is in
        # the bucket and is its owner's; cachewarm reports it and writes nothing.
        whose = ("was created by a CompilationCache that is no longer on it"
                 if bucket.labels.get(c.GCS_LABEL_MANAGED_BY) == c.MANAGED_BY else "was not created by cachewarm")
        return Cond(c.Condition.SOFT_DELETE_APPLIED, bucket.soft_delete_seconds == mine.soft_delete_days * b.DAY,
                    c.Reason.NOT_MANAGED,
                    f"Bucket {spec.bucket} {whose}; its soft delete policy belongs to its owner "
                    f"({_days(bucket.soft_delete_seconds)}) and cachewarm never changes it; this cache asks "
                    f"for {mine.soft_delete_days}d")
    if owner == mine:
        return Cond(c.Condition.SOFT_DELETE_APPLIED, True, c.Reason.RECONCILED,
                    f"This cache created bucket {spec.bucket} and owns its bucket-wide settings: soft delete "
                    f"{spec.soft_delete_days}d")
    if owner.soft_delete_days == mine.soft_delete_days:
        return Cond(c.Condition.SOFT_DELETE_APPLIED, True, c.Reason.SET_BY_OWNER,
                    f"Soft delete of {spec.bucket} is owned by CompilationCache {owner.ref}, which created the "
                    f"bucket, and is {owner.soft_delete_days}d, as this cache asks")
    return Cond(c.Condition.SOFT_DELETE_APPLIED, False, c.Reason.SOFT_DELETE_CONFLICT,
                f"Soft delete is bucket-wide: {spec.bucket} keeps {owner.soft_delete_days}d as CompilationCache "
                f"{owner.ref} asks (it created the bucket); this cache asks for {mine.soft_delete_days}d and "
                "does not change it")


def _status(bucket: BucketInfo, spec: GcsStorage, mine: b.Claim, instance: str) -> dict[str, Any]:
    soft = bucket.soft_delete_seconds
    return {
        "url": spec.url,
        "location": bucket.location,
        "storageClass": bucket.storage_class,
        "createdByCachewarm": b.created_by(bucket, mine.namespace, mine.name, instance),
        "deleteAfterDays": b.observed_delete_after_days(bucket, mine, instance),
        "softDeleteDays": soft // b.DAY if soft is not None else None,
    }


def cache_inventory(gcs: GcsClient, spec: GcsStorage, *,
                    clock: Callable[[], float] = time.monotonic) -> tuple[dict[str, int], frozenset[str]]:
    """Entries and bytes of this cache, counted on the bucket itself. Entries without a
    customTime (written by a training pod, or before cachewarm managed the bucket) get
    their creation time as customTime, so the last-use rule expires them too: at most
    STAMP_LIMIT of them and for at most STAMP_SECONDS per reconcile (see there); those
    left for later reconciles are counted in `unstamped`. Also returns the key hashes of
    the entries (as warmers report them), to check a warm's entries are all there."""
    keys: set[str] = set()
    entries = 0
    size = 0
    stamped = 0
    unstamped = 0
    deadline = clock() + STAMP_SECONDS
    # Only names directly under the prefix (GCS's `*` stops at '/'): for a cache at the root
    # of a bucket that also holds other data, its folders are not in the answer (their
    # pages may still be cut and billed: GCS does not say whether it globs before paging).
    for obj in gcs.list_objects(spec.bucket, spec.object_prefix, glob=f"{spec.object_prefix}*"):
        if not b.is_cache_entry(obj.name, spec):
            continue
        if obj.name.endswith("-cache"):
            entries += 1
            size += obj.size
            keys.add(key_hash(obj.name.rsplit("/", 1)[-1].removesuffix("-cache")))
        if obj.custom_time is None and obj.created is not None:
            if stamped < STAMP_LIMIT and clock() < deadline:
                # False: the object changed since it was listed (a warmer stamped it, or it
                # was replaced or deleted); nothing is left to do for it.
                gcs.set_custom_time(spec.bucket, obj, obj.created)
                stamped += 1
            else:
                unstamped += 1
    return {"entries": entries, "bytes": size, "unstamped": unstamped}, frozenset(keys)


def delete_cache_data(gcs: GcsClient, spec: GcsStorage, *, namespace: str, name: str,
                      instance: str = c.DEFAULT_INSTANCE, sharers: Sequence[b.Claim] = ()) -> list[Event]:
    """deletionPolicy Delete: remove this cache's entries and its warmers' manifests, and
    the bucket if this operator's cache made it and it is then empty. Nothing is deleted
    in a bucket not granted to the cache's namespace at its prefix (builders.bucket.consent,
    checked on the bucket as read now), nor under a prefix another granted cache uses
    (`sharers`: the operator's other caches on the same prefix). Objects that are neither JAX cache entries nor this cache's own manifests (another cache's are not) are
    never touched; nor is anything under a prefix another operator instance's rule names (a
    cache of that operator uses it). Raises GcsError (the finalizer stays and the deletion
    is retried)."""
    events: list[Event] = []
    bucket = gcs.get_bucket(spec.bucket)  # None when it is gone
    if bucket is None:
        return [Event("Normal", c.Reason.DATA_DELETED, f"Bucket {spec.bucket} is already gone")]
    if b.consent(bucket, namespace, spec.prefix, instance) is None:
        return [Event("Normal", c.Reason.DATA_RETAINED,
                      f"Kept the data under {spec.url}: the bucket is not granted to namespace {namespace}, so "
                      "cachewarm deletes nothing in it")]
    sharing = sorted(o for o in b.granted_claims(bucket, sharers, instance) if o.key != (namespace, name))
    if sharing:
        return [Event("Normal", c.Reason.DATA_RETAINED,
                      f"Kept the data under {spec.url}: CompilationCache {sharing[0].ref} uses the same prefix")]
    other = b.covered_by_other_instance(bucket, spec.object_prefix, instance)
    if other is not None:
        return [Event("Normal", c.Reason.DATA_RETAINED,
                      f"Kept the data under {spec.url}: a lifecycle rule of cachewarm operator instance {other} "
                      "names the same prefix, so a cache of that operator uses it")]
    deleted = 0
    manifests = 0
    packs = 0
    kept = 0
    for obj in gcs.list_objects(spec.bucket, spec.object_prefix):
        if b.is_cache_entry(obj.name, spec):
            gcs.delete_object(spec.bucket, obj)
            deleted += 1
        elif b.is_own_manifest(obj.name, spec, namespace, name):
            gcs.delete_object(spec.bucket, obj)
            packs += obj.name.endswith(PACK_SUFFIX)
            manifests += not obj.name.endswith(PACK_SUFFIX)
        else:
            kept += 1
    also = (f" and {manifests} warmer manifests" if manifests else "") + (f" and {packs} warmer packs" if packs else "")
    events.append(Event("Normal", c.Reason.DATA_DELETED,
                        f"Deleted {deleted} cache objects{also} under {spec.url}"))
    if not b.created_by(bucket, namespace, name, instance):
        events.append(Event("Normal", c.Reason.BUCKET_KEPT,
                            f"Kept bucket {spec.bucket}: cachewarm did not create it"))
        return events
    remaining = kept if spec.prefix == "" else sum(1 for _ in gcs.list_objects(spec.bucket, ""))
    if remaining:
        events.append(Event("Normal", c.Reason.BUCKET_KEPT,
                            f"Kept bucket {spec.bucket}: {remaining} objects that are not this cache's entries remain"))
        return events
    if not gcs.delete_bucket(spec.bucket):
        events.append(Event("Normal", c.Reason.BUCKET_KEPT,
                            f"Kept bucket {spec.bucket}: GCS refused to delete it because it is not empty "
                            "(objects were written to it after it was listed)"))
        return events
    events.append(Event("Normal", c.Reason.BUCKET_DELETED, f"Deleted bucket {spec.bucket}, created by cachewarm"))
    return events
