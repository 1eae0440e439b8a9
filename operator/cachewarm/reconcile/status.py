"""A CompilationCache's status from what one reconcile saw: the conditions (kstatus's
Reconciling and Stalled derived from the others, Ready), the Events worth posting when a
condition changes, and the small questions asked of the last status (was it warmed, is a
listing or a fast poll due). Pure."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import conditions
from cachewarm.api import constants as c
from cachewarm.api import timefmt
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.reconcile.bucket import BucketOutcome
from cachewarm.reconcile.warmup import ACTIVE_STATES, WarmupOutcome


@dataclass
class Seen:
    bucket: BucketOutcome
    warmup: WarmupOutcome | None = None
    warm_condition: Cond | None = None
    waiting_pods: int | None = None
    injection: Cond | None = None
    keys_match: Cond | None = None
    programs_warm: Cond | None = None  # from status.usage (reconcile/misses.py)
    # status.injection.configMaps: role -> the verified ConfigMap (None: none; removed by the merge patch)
    configmaps: dict[str, str | None] | None = None
    pods_opted_out: int | None = None
    spec: list[Cond] = field(default_factory=list)  # what the spec alone says (reconcile/podsmode.py)  # None: not counted this time (status keeps the last count)


# What only a person can fix: the bucket (BucketReady) or the warm (Warmed) stays as it is
# until the spec, the bucket or IAM changes. A failed warm is one only once no retry is left.
STALLED_BUCKET = (c.Reason.INVALID_SPEC, c.Reason.BUCKET_NOT_FOUND, c.Reason.LOCATION_MISMATCH, c.Reason.NAME_TAKEN,
                  c.Reason.PREFIX_IN_USE, c.Reason.ACCESS_DENIED, c.Reason.BUCKET_NOT_GRANTED,
                  c.Reason.CREATION_NOT_ALLOWED)


STALLED_WARM = (c.Reason.UNKNOWN_TPU_SHAPE, c.Reason.INVALID_TPU_SHAPE, c.Reason.ENTRIES_MISSING,
                c.Reason.CACHE_EMPTY)


def progress(bucket: Cond, injection: Cond | None, warm: Cond | None, pools: Sequence[Mapping[str, Any]],
             failing: bool) -> tuple[Cond, Cond]:
    """The kstatus conditions, Reconciling and Stalled, from the others: Stalled when only a
    person can move the cache on, else Reconciling while anything is under way or retried
    (`failing`: a step failed and the reconcile is retried). A reconcile of a new generation
    needs no condition: kstatus reads observedGeneration behind generation as InProgress."""
    stalled: Cond | None = None
    if bucket.status is False and bucket.reason in STALLED_BUCKET:
        stalled = bucket
    elif warm is not None and warm.status is False and (
            warm.reason in STALLED_WARM
            or (warm.reason == c.Reason.WARMUP_FAILED
                and not any(p.get("state") in ACTIVE_STATES or p.get("nextRetryTime") for p in pools))):
        stalled = warm
    elif injection is not None and injection.status is False and injection.reason == c.Reason.CONFIGMAP_NOT_OURS:
        # Someone else's ConfigMap holds our name: only a person can remove it (the operator
        # never deletes what it did not create); it is checked again at every resync.
        stalled = injection
    if stalled is not None:
        waits_for = ("a person removes that ConfigMap (checked again at every resync)" if stalled is injection
                     else "the spec, the bucket or the operator's permissions change")
        return (Cond(c.Condition.RECONCILING, False, stalled.reason, f"Nothing is retried until {waits_for}"),
                Cond(c.Condition.STALLED, True, stalled.reason, stalled.message))
    under_way = next((cd for cd in (bucket, injection, warm)
                      if cd is not None and (not cd.status or cd.reason == c.Reason.REWARMING)), None)
    not_stalled = Cond(c.Condition.STALLED, False, c.Reason.RECONCILED, "Nothing needs a person")
    if under_way is not None:
        return Cond(c.Condition.RECONCILING, True, under_way.reason, under_way.message), not_stalled
    if failing:
        return Cond(c.Condition.RECONCILING, True, c.Reason.RECONCILE_ERROR, "A step failed; retrying"), not_stalled
    return Cond(c.Condition.RECONCILING, False, c.Reason.RECONCILED, "The cache is as its spec says"), not_stalled


def assemble(status: Mapping[str, Any], generation: int, seen: Seen, injection: dict[str, Any],
            has_warmup: bool, now: dt.datetime, failing: bool) -> dict[str, Any]:
    bucket = seen.bucket
    reconciling, stalled = progress(bucket.condition, seen.injection, seen.warm_condition,
                                    seen.warmup.pools if seen.warmup else [], failing)
    if not bucket.ready:
        ready = Cond(c.Condition.READY, False, c.Reason.BUCKET_NOT_READY, bucket.condition.message)
    elif seen.injection is not None and not seen.injection.status:
        ready = Cond(c.Condition.READY, False, seen.injection.reason, seen.injection.message)
    elif stalled.status:
        ready = Cond(c.Condition.READY, False, stalled.reason, stalled.message)
    else:
        ready = Cond(c.Condition.READY, True, c.Reason.RECONCILED, "The cache is ready for warmers and training pods")
    updates = [bucket.condition, ready, reconciling, stalled, *bucket.settings,
               *([seen.warm_condition] if seen.warm_condition else []), *([seen.injection] if seen.injection else []),
               *([seen.keys_match] if seen.keys_match else []),
               *([seen.programs_warm] if seen.programs_warm else []), *seen.spec]
    existing = [cd for cd in status.get("conditions") or []
                if has_warmup or cd.get("type") not in (c.Condition.WARMED, c.Condition.KEYS_MATCH)]
    out: dict[str, Any] = {
        "conditions": conditions.merge(existing, updates, generation=generation, now=now),
        "observedGeneration": generation,
    }
    if bucket.status:
        out["bucket"] = bucket.status
    if bucket.cache is not None:
        out["cache"] = bucket.cache
    if bucket.withheld:
        # Not granted (any more): what earlier reconciles saw of the bucket goes (a merge patch).
        out["bucket"] = out["cache"] = None
    if seen.warmup is not None:
        out["warmup"] = {"pools": seen.warmup.pools}
    elif not has_warmup and status.get("warmup") is not None:
        out["warmup"] = None
    if seen.waiting_pods is not None:
        injection = {**injection, "waitingPods": seen.waiting_pods}
    elif (status.get("injection") or {}).get("waitingPods") is not None:
        injection = {**injection, "waitingPods": None}  # no longer waits: removed (a merge patch)
    if seen.configmaps is not None:
        injection = {**injection, "configMaps": seen.configmaps}
    out["injection"] = injection
    if seen.pods_opted_out is not None:
        out["reports"] = {**(status.get("reports") or {}), "podsOptedOut": seen.pods_opted_out}
    return out


_ANNOUNCED = (c.Reason.SOFT_DELETE_CONFLICT, c.Reason.RULE_LIMIT_REACHED, c.Reason.BUCKET_ROOT_NOT_ALLOWED,
              c.Reason.RULES_UNREADABLE, c.Reason.SHARED_WITH_OTHER_OPERATOR, c.Reason.IDENTICAL_FOREIGN_RULE)


def transition_events(status: Mapping[str, Any], bucket: BucketOutcome) -> list[Event]:
    """A Warning event when a condition enters a problem it was not in before; never a
    repeat of the same one (no event flood on every resync)."""
    out: list[Event] = []
    for cond in [bucket.condition, *bucket.settings]:
        previous = conditions.get(status.get("conditions"), cond.type)
        if previous is not None and previous.get("reason") == cond.reason:
            continue
        if (cond.type == c.Condition.BUCKET_READY and cond.status is False) or cond.reason in _ANNOUNCED:
            out.append(Event("Warning", cond.reason, cond.message))
    # Foreign rules deleting this cache's entries leave LifecycleReady's reason as it is;
    # each is announced once, when LifecycleReady's message did not name it yet.
    previous = conditions.get(status.get("conditions"), c.Condition.LIFECYCLE_READY)
    said = str((previous or {}).get("message") or "")
    new = [rule for rule in bucket.foreign_deleting if rule not in said]
    if new:
        out.append(Event("Warning", c.Reason.FOREIGN_RULE_DELETES_ENTRIES,
                         f"Lifecycle rule(s) {', '.join(new)} on the bucket are not cachewarm's and also delete "
                         "this cache's JAX entries, in use or not; cachewarm never changes them"))
    return out


def changed(status: Mapping[str, Any], cond: Cond) -> bool:
    """Whether a condition differs from the one in status (an Event is worth posting)."""
    old = conditions.get(status.get("conditions"), cond.type)
    return old is None or old.get("reason") != cond.reason or old.get("message") != cond.message


def inventory_due(status: Mapping[str, Any], generation: int, now: dt.datetime, every: dt.timedelta) -> bool:
    """Whether this reconcile lists the cache's entries on the bucket: never listed, a new
    spec, entries left unstamped by the last listing, or `every` passed since it. A warm
    that finished since is checked on its own (see _warm), so a resync of a cache nothing
    happened to costs no listing: the inventory's cost follows change, not time."""
    listed = (status.get("cache") or {}).get("listedTime")
    if not listed or status.get("observedGeneration") != generation or (status.get("cache") or {}).get("unstamped"):
        return True
    try:
        at = timefmt.parse(listed)
    except ValueError:
        return True
    return now - at >= every


def was_warmed(status: Mapping[str, Any]) -> bool:
    """Whether the previous reconcile left Warmed True (a warm now is a re-warm)."""
    warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
    return bool(warmed and warmed.get("status") == "True")


def warmers_checked(pools: Sequence[Mapping[str, Any]]) -> str:
    """What a Warmed verdict depends on besides the bucket (each pool's run and the keys its
    warmer reported), as a short digest kept in status.cache.warmersChecked: the same
    digest and no listing since means the last verdict stands."""
    basis = [(p.get("name"), p.get("job"), p.get("state"), p.get("completionTime"), p.get("keys")) for p in pools]
    return hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode()).hexdigest()[:16]


def needs_poll(spec: Mapping[str, Any], status: Mapping[str, Any], generation: int,
               now: dt.datetime | None = None) -> bool:
    """Whether the fast poll has work: warmers running, a failed warmer's retry due, or
    pods that may be waiting."""
    if status.get("observedGeneration") != generation:
        return True
    pools = (status.get("warmup") or {}).get("pools")
    if spec.get("warmup") and (not pools or any(p.get("state") in ACTIVE_STATES for p in pools)):
        return True
    at = now or dt.datetime.now(dt.timezone.utc)
    if spec.get("warmup") and any(p.get("nextRetryTime") and str(p["nextRetryTime"]) <= timefmt.rfc3339(at)
                                  for p in pools or []):
        return True
    wait = ((spec.get("injection") or {}).get("waitForWarm") or {}).get("enabled")
    warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
    return bool(wait) and (warmed is None or warmed.get("status") != "True"
                           or bool((status.get("injection") or {}).get("waitingPods")))


