"""One reconcile of a CompilationCache and one deletion: the orchestration of the steps
(bucket, the ConfigMaps pods read, warmers, held pods, KeysMatch) into one status, free of
kopf. Inputs are plain mappings and lookups into the operator's in-memory indexes;
outputs are the status to write, the events to post and the error to retry on. Each step
lives in its own module; runtime/controller.py turns an Outcome into API writes."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import conditions
from cachewarm.api import constants as c
from cachewarm.api import timefmt
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec, InvalidSpec, parse_spec
from cachewarm.builders.bucket import Claim, CreationLimits
from cachewarm.clients.gcs import GcsClient, GcsError
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.reconcile.bucket import BucketOutcome, CreatedCounts, cache_inventory, delete_cache_data, reconcile_bucket
from cachewarm.reconcile.configmaps import publish_configmaps
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.reconcile import podsmode
from cachewarm.reconcile.keysmatch import keys_match
from cachewarm.reconcile.misses import KEY_UNSTABLE, programs_warm, unstable
from cachewarm.reconcile.pods import release_held_pods
from cachewarm.reconcile.status import Seen, assemble, changed, inventory_due, transition_events, was_warmed, \
    warmers_checked
from cachewarm.reconcile.warmup import (BUCKET_VERDICTS, WarmRetry, next_scheduled_warm, reconcile_warmup,
                                        release_waiting_pods, warmed_condition)

ClaimLookup = Callable[[str], Iterable[Claim]]  # bucket -> the caches on it
log = logging.getLogger("cachewarm.service")


@dataclass
class Outcome:
    """What a reconcile wants written and said. `failure` is worth a retry; `invalid`
    means the spec cannot be acted on until it changes; `requeue_at`: reconcile the cache
    again at this time (its next cron slot), which no watch event would mark."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    failure: Exception | None = None
    invalid: str | None = None
    requeue_at: dt.datetime | None = None


def claim_of(spec: Mapping[str, Any], meta: Mapping[str, Any], namespace: str, name: str) -> Claim | None:
    """A cache's claim on its bucket, for the operator's per-bucket index (None when the
    spec cannot be read: such a cache manages nothing)."""
    try:
        cache = parse_spec(spec)
    except InvalidSpec:
        return None
    return Claim.of(cache.storage.gcs, created=str(meta.get("creationTimestamp") or ""), namespace=namespace,
                    name=name)


@dataclass(frozen=True)
class Wiring:
    """What every reconcile of this operator shares: its clients, the warmer image, the
    webhook's record of recent injections, the per-bucket claim index, and its settings."""

    gcs: GcsClient
    kube: KubeClient
    warmer_image: str
    injections: RecentInjections
    claims: ClaimLookup
    instance: str = c.DEFAULT_INSTANCE
    limits: CreationLimits = CreationLimits()
    created_counts: CreatedCounts = field(default_factory=CreatedCounts)
    warm_retry: WarmRetry = WarmRetry()
    inventory_every: dt.timedelta = dt.timedelta(hours=1)


@dataclass(frozen=True)
class CacheObject:
    """The CompilationCache being reconciled, as the watch last saw it."""

    namespace: str
    name: str
    spec: Mapping[str, Any]
    meta: Mapping[str, Any]
    status: Mapping[str, Any]


@dataclass
class _Pass:
    """One reconcile of one cache: what it was given, and the Events and failure it gathers."""

    wiring: Wiring
    obj: CacheObject
    now: dt.datetime
    pod_fingerprints: Sequence[tuple[str, dict[str, Any]]]
    injection: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    failure: Exception | None = None

    @property
    def generation(self) -> int:
        return int(self.obj.meta.get("generation") or 0)

    def failed(self, exc: Exception) -> None:
        self.failure = self.failure or exc


def reconcile_cache(wiring: Wiring, obj: CacheObject, *, now: dt.datetime,
                    pod_fingerprints: Sequence[tuple[str, dict[str, Any]]] = ()) -> Outcome:
    """Bucket, then warmers, then pods waiting for the cache; one status at the end.
    `pod_fingerprints`: (pod, fingerprint) of the training pods that reported lately, for
    KeysMatch. Never raises: a failing step becomes a condition with a reason and a
    message, an Event, and `failure` (worth a retry), while what the other steps saw is
    still reported."""
    one = _Pass(wiring, obj, now, pod_fingerprints, injection=wiring.injections.summary(obj.namespace, obj.name, now))
    try:
        return _reconcile(one)
    except Exception as exc:  # noqa: BLE001 - a bug must still show in status, not as a blank row
        log.exception("Reconcile of %s/%s failed", obj.namespace, obj.name)
        return _crashed(one, exc)


def _crashed(one: _Pass, exc: Exception) -> Outcome:
    """The status of a reconcile that raised: Ready False, retried (Reconciling, not Stalled)."""
    message = f"Reconcile failed: {type(exc).__name__}: {exc}"[:1000]
    cond = Cond(c.Condition.READY, False, c.Reason.RECONCILE_ERROR, message)
    retrying = Cond(c.Condition.RECONCILING, True, c.Reason.RECONCILE_ERROR, message)
    # Retried, so not Stalled (a Stalled left from before would contradict Reconciling).
    not_stalled = Cond(c.Condition.STALLED, False, c.Reason.RECONCILE_ERROR, "A reconcile failed; retrying")
    out = {"conditions": conditions.merge(one.obj.status.get("conditions"), [cond, retrying, not_stalled],
                                          generation=one.generation, now=one.now),
           "observedGeneration": one.generation, "injection": one.injection}
    # The same error on every resync is said once, as the steps' own errors are.
    events = [Event("Warning", c.Reason.RECONCILE_ERROR, message)] if changed(one.obj.status, cond) else []
    return Outcome(out, events, failure=exc)


def _reconcile(one: _Pass) -> Outcome:
    try:
        cache = parse_spec(one.obj.spec)
    except InvalidSpec as exc:
        return _invalid(one, exc)
    # A cache with warmers lists its entries after their Jobs were read (see _warm): a
    # listing taken before could miss the last entries of a warmer that finished meanwhile.
    listing_due = inventory_due(one.obj.status, one.generation, one.now, one.wiring.inventory_every)
    seen = _bucket(one, cache, take_inventory=listing_due and cache.warmup is None)
    seen.injection, seen.configmaps = publish_configmaps(
        one.wiring.kube, cache, one.obj.status, one.events, namespace=one.obj.namespace, name=one.obj.name,
        uid=str(one.obj.meta.get("uid") or ""))
    if not seen.injection.status:
        one.failed(RuntimeError(seen.injection.message))
    try:
        _warm(one, cache, seen, listing_due=listing_due)
        release_held_pods(one.wiring.kube, cache, seen, one.obj.status, one.events, namespace=one.obj.namespace, name=one.obj.name,
                          now=one.now)
    except Exception as exc:  # noqa: BLE001 - KubeError, GcsError, or anything a library raised unexpectedly
        _warm_failed(one, cache, seen, exc)
    if cache.warmup is not None:
        _keys_match(one, seen)
    seen.programs_warm = programs_warm(one.obj.status.get("usage"))
    _opted_out(one, seen)
    # After the warm: whether its pools have a manifest generation the copier trusts.
    pools = seen.warmup.pools if seen.warmup is not None else (one.obj.status.get("warmup") or {}).get("pools") or []
    seen.spec = podsmode.spec_conditions(cache, one.obj.name, pools, bool(one.wiring.warmer_image))
    return Outcome(assemble(one.obj.status, one.generation, seen, one.injection, cache.warmup is not None, one.now,
                            one.failure is not None),
                   one.events, one.failure, requeue_at=next_scheduled_warm(cache, one.now))


def _invalid(one: _Pass, exc: InvalidSpec) -> Outcome:
    """A spec that cannot be read: BucketReady says why. Pods held for a cache that cannot be
    acted on would wait for nothing; a failed release is retried by the next resync (the
    spec stays invalid until it changes)."""
    seen = Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, c.Reason.INVALID_SPEC, str(exc))))
    released: list[Event] = []
    unreleased: Exception | None = None
    try:
        seen.waiting_pods, released = release_waiting_pods(
            one.wiring.kube, None, namespace=one.obj.namespace, name=one.obj.name, warmed=False, now=one.now,
            why=f"the cache's spec is invalid ({exc})"[:500])
    except KubeError as kube_exc:
        log.warning("Could not release the pods held for %s/%s: %s", one.obj.namespace, one.obj.name, kube_exc)
        unreleased = kube_exc
    return Outcome(assemble(one.obj.status, one.generation, seen, one.injection, False, one.now, unreleased is not None),
                   released, failure=unreleased, invalid=str(exc))


def _bucket(one: _Pass, cache: CacheSpec, *, take_inventory: bool) -> Seen:
    """The bucket step: what reconcile_bucket saw, or why it failed (as BucketReady)."""
    previous = conditions.get(one.obj.status.get("conditions"), c.Condition.BUCKET_READY)
    gcs_spec = cache.storage.gcs
    mine = Claim.of(gcs_spec, created=str(one.obj.meta.get("creationTimestamp") or ""), namespace=one.obj.namespace,
                    name=one.obj.name)
    # SoftDeleteApplied Reconciled is said only to the cache that owns the bucket-wide settings.
    soft = conditions.get(one.obj.status.get("conditions"), c.Condition.SOFT_DELETE_APPLIED)
    try:
        seen = Seen(reconcile_bucket(one.wiring.gcs, gcs_spec, mine=mine, claims=list(one.wiring.claims(gcs_spec.bucket)),
                                     spec_changed=one.obj.status.get("observedGeneration") != one.generation,
                                     instance=one.wiring.instance,
                                     settings_owned_before=soft is not None and soft.get("reason") == c.Reason.RECONCILED,
                                     take_inventory=take_inventory, limits=one.wiring.limits,
                                     counts=one.wiring.created_counts))
    except GcsError as exc:
        seen = Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, exc.reason, f"{exc}; retrying")))
        if previous is None or previous.get("reason") != exc.reason:
            one.events.append(Event("Warning", exc.reason, str(exc)))
        one.failed(exc)
        return seen
    except Exception as exc:  # noqa: BLE001 - e.g. the GCS library raising what it does not document
        log.exception("Bucket reconcile of %s/%s failed", one.obj.namespace, one.obj.name)
        seen = Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, c.Reason.RECONCILE_ERROR,
                                       f"Bucket reconcile failed: {type(exc).__name__}: {exc}; retrying"[:1000])))
        if changed(one.obj.status, seen.bucket.condition):
            one.events.append(Event("Warning", c.Reason.RECONCILE_ERROR, seen.bucket.condition.message))
        one.failed(exc)
        return seen
    if seen.bucket.entry_keys is not None:
        seen.bucket.cache = {**(seen.bucket.cache or {}), "listedTime": timefmt.rfc3339(one.now)}
    elif seen.bucket.ready:
        seen.bucket.cache = dict(one.obj.status.get("cache") or {}) or None  # as last listed
    one.events += seen.bucket.events
    one.events += transition_events(one.obj.status, seen.bucket)
    return seen


def _take_inventory(one: _Pass, cache: CacheSpec, seen: Seen) -> None:
    counts, seen.bucket.entry_keys = cache_inventory(one.wiring.gcs, cache.storage.gcs)
    seen.bucket.cache = {**counts, "listedTime": timefmt.rfc3339(one.now)}


def _warm(one: _Pass, cache: CacheSpec, seen: Seen, *, listing_due: bool) -> None:
    """The warm-up step (reconcile/warmup.py), then Warmed from the bucket's entries: listed
    when due, or when a warm finished since the listing that gave the last verdict."""
    if cache.warmup is None:
        return
    if not seen.bucket.ready:
        seen.warm_condition = Cond(c.Condition.WARMED, False, c.Reason.BUCKET_NOT_READY,
                                   "Warmers wait for the bucket to be ready")
        return
    status = one.obj.status
    seen.warmup = reconcile_warmup(
        one.wiring.kube, cache, namespace=one.obj.namespace, name=one.obj.name, uid=str(one.obj.meta.get("uid") or ""),
        annotations=one.obj.meta.get("annotations") or {},
        previous=(status.get("warmup") or {}).get("pools") or [],
        cache_entries=int((seen.bucket.cache or {}).get("entries", 0)),
        warmer_image=one.wiring.warmer_image, now=one.now, generation=one.generation,
        warmed_before=was_warmed(status), entry_keys=seen.bucket.entry_keys, retry=one.wiring.warm_retry,
    )

    def verdict() -> Cond:
        assert seen.warmup is not None
        return warmed_condition(seen.warmup.pools, int((seen.bucket.cache or {}).get("entries", 0)),
                                was_warmed(status), seen.bucket.entry_keys)

    if listing_due and seen.bucket.entry_keys is None:
        _take_inventory(one, cache, seen)  # due, and taken now that the warmers' Jobs have been read
        seen.warmup.condition = verdict()
    if seen.warmup.condition.reason in BUCKET_VERDICTS:
        checked = warmers_checked(seen.warmup.pools)
        previous = conditions.get(status.get("conditions"), c.Condition.WARMED)
        if seen.bucket.entry_keys is None and (status.get("cache") or {}).get("warmersChecked") == checked \
                and previous is not None and previous.get("reason") in BUCKET_VERDICTS:
            # Nothing changed since the listing that gave the last verdict.
            seen.warmup.condition = Cond(c.Condition.WARMED, previous.get("status") == "True",
                                         str(previous["reason"]), str(previous.get("message") or ""))
        else:
            if seen.bucket.entry_keys is None:
                _take_inventory(one, cache, seen)  # a warm finished since the last listing: check its entries now
                seen.warmup.condition = verdict()
            seen.bucket.cache = {**(seen.bucket.cache or {}), "warmersChecked": checked}
    seen.warm_condition = seen.warmup.condition
    one.events += seen.warmup.events


def _warm_failed(one: _Pass, cache: CacheSpec, seen: Seen, exc: Exception) -> None:
    """Warmed False saying why the warm-up (or the pods' release) step failed; retried."""
    if isinstance(exc, KubeError):
        reason, message = exc.reason, f"Warmers could not be reconciled: {exc}; retrying"
    elif isinstance(exc, GcsError):  # the listing of the entries the warmers wrote
        reason, message = exc.reason, f"The cache's entries could not be listed: {exc}; retrying"
    else:
        log.exception("Warmup reconcile of %s/%s failed", one.obj.namespace, one.obj.name)
        reason, message = c.Reason.RECONCILE_ERROR, f"Warmers could not be reconciled: {type(exc).__name__}: {exc}; retrying"
    error = Cond(c.Condition.WARMED, False, reason, message[:1000])
    if cache.warmup is not None and seen.warm_condition is None:
        # What the warmers last reported stays in status.warmup (rewritten only when they
        # were read in this reconcile); the condition says why it is not current.
        seen.warm_condition = error
    if changed(one.obj.status, error):
        one.events.append(Event("Warning", reason, message[:1000]))
    one.failed(exc)


def _opted_out(one: _Pass, seen: Seen) -> None:
    """status.reports.podsOptedOut: the cache's labelled pods, not finished nor being
    deleted, that the webhook gave no token and no reporter because they opted out of
    ServiceAccount tokens (D8; their own field, or their ServiceAccount's), as its
    annotation on each says. From the labelled pods the operator watches (no listing)."""
    seen.pods_opted_out = one.wiring.injections.opted_out(one.obj.namespace, one.obj.name)


def _keys_match(one: _Pass, seen: Seen) -> None:
    pools = seen.warmup.pools if seen.warmup is not None else (one.obj.status.get("warmup") or {}).get("pools") or []
    matched, reason, message = keys_match(list(pools), list(one.pod_fingerprints))
    changing = unstable(one.obj.status.get("usage"))
    if matched is True and changing:
        # Same fingerprints, yet another key: the keys do not match (status.usage says which).
        matched, reason, message = False, KEY_UNSTABLE, (
            f"The training pods' fingerprints match the warmers', but {', '.join(changing[:5])} got another key "
            "than the warmer's: a per-process value in its HLO (custom_partitioning, say); see ProgramsWarm")[:1000]
    seen.keys_match = Cond(c.Condition.KEYS_MATCH, matched, reason, message)
    if matched is False and changed(one.obj.status, seen.keys_match):
        one.events.append(Event("Warning", reason, message))


def delete_cache(gcs: GcsClient, spec: Mapping[str, Any], meta: Mapping[str, Any], *, namespace: str, name: str,
                 claims: ClaimLookup, instance: str = c.DEFAULT_INSTANCE) -> list[Event]:
    """deletionPolicy Delete, unless another cache uses the same prefix (then its data
    stays). Raises GcsError; InvalidSpec for a spec that cannot be read."""
    cache = parse_spec(spec)
    gcs_spec = cache.storage.gcs
    # Of the caches on the same prefix, delete_cache_data counts those the bucket is granted to.
    sharers = [o for o in claims(gcs_spec.bucket) if o.key != (namespace, name) and o.prefix == gcs_spec.prefix]
    return delete_cache_data(gcs, gcs_spec, namespace=namespace, name=name, instance=instance, sharers=sharers)
