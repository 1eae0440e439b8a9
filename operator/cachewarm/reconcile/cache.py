"""One reconcile of a CompilationCache, one deletion, one pod admission: the operator's
logic, free of kopf. Inputs are plain mappings and lookups into the operator's in-memory
indexes; outputs are the status to write, the events to post and the error to retry on.
handlers.py turns these into kopf patches and errors."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import conditions
from cachewarm.reports import store as reports
from cachewarm.agents import payload
from cachewarm.api import constants as c
from cachewarm.builders.bucket import Claim
from cachewarm.builders.injection import env_configmap, env_configmap_name, inject_pod
from cachewarm.builders.localcopy import (
    BOOT_FILES,
    BYTECODE_SCRIPT,
    BYTECODE_TAG,
    add_local_copy,
    add_local_copy_in_process,
    boot_configmap,
    boot_configmap_name,
    bytecode_key,
    local_copy_possible,
)
from cachewarm.builders.localcopy import in_process as is_in_process
from cachewarm.builders.reporting import Reporting, add_reporter
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.clients.gcs import GcsClient, GcsError
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.reconcile.injections import RecentInjections
from cachewarm.api.model import CacheSpec, InvalidSpec, parse_spec
from cachewarm.reconcile.bucket import BucketOutcome, cache_inventory, delete_cache_data, reconcile_bucket
from cachewarm.reconcile.warmup import (ACTIVE_STATES, BUCKET_VERDICTS, WarmRetry, WarmupOutcome, next_scheduled_warm,
                               reconcile_warmup, release_waiting_pods, warmed_condition)

ClaimLookup = Callable[[str], Iterable[Claim]]  # bucket -> the caches on it
CacheLookup = Callable[[str, str], Mapping[str, Any] | None]  # (namespace, name) -> webhook index entry
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


@dataclass
class _Seen:
    bucket: BucketOutcome
    warmup: WarmupOutcome | None = None
    warm_condition: Cond | None = None
    waiting_pods: int | None = None
    injection: Cond | None = None
    keys_match: Cond | None = None


# What only a person can fix: the bucket (BucketReady) or the warm (Warmed) stays as it is
# until the spec, the bucket or IAM changes. A failed warm is one only once no retry is left.
STALLED_BUCKET = (c.Reason.INVALID_SPEC, c.Reason.BUCKET_NOT_FOUND, c.Reason.LOCATION_MISMATCH, c.Reason.NAME_TAKEN,
                  c.Reason.PREFIX_IN_USE, c.Reason.ACCESS_DENIED)
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
    if stalled is not None:
        return (Cond(c.Condition.RECONCILING, False, stalled.reason, "Nothing is retried until the spec, the bucket "
                     "or the operator's permissions change"),
                Cond(c.Condition.STALLED, True, stalled.reason, stalled.message))
    under_way = next((cd for cd in (bucket, injection, warm)
                      if cd is not None and (not cd.status or cd.reason == c.Reason.REWARMING)), None)
    not_stalled = Cond(c.Condition.STALLED, False, c.Reason.RECONCILED, "Nothing needs a person")
    if under_way is not None:
        return Cond(c.Condition.RECONCILING, True, under_way.reason, under_way.message), not_stalled
    if failing:
        return Cond(c.Condition.RECONCILING, True, c.Reason.RECONCILE_ERROR, "A step failed; retrying"), not_stalled
    return Cond(c.Condition.RECONCILING, False, c.Reason.RECONCILED, "The cache is as its spec says"), not_stalled


def _status(status: Mapping[str, Any], generation: int, seen: _Seen, injection: dict[str, Any],
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
               *([seen.keys_match] if seen.keys_match else [])]
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
    if seen.warmup is not None:
        out["warmup"] = {"pools": seen.warmup.pools}
    elif not has_warmup and status.get("warmup") is not None:
        out["warmup"] = None
    if seen.waiting_pods is not None:
        injection = {**injection, "waitingPods": seen.waiting_pods}
    elif (status.get("injection") or {}).get("waitingPods") is not None:
        injection = {**injection, "waitingPods": None}  # no longer waits: removed (a merge patch)
    out["injection"] = injection
    return out


def claim_of(spec: Mapping[str, Any], meta: Mapping[str, Any], namespace: str, name: str) -> Claim | None:
    """A cache's claim on its bucket, for the operator's per-bucket index (None when the
    spec cannot be read: such a cache manages nothing)."""
    try:
        cache = parse_spec(spec)
    except InvalidSpec:
        return None
    return Claim.of(cache.storage.gcs, created=str(meta.get("creationTimestamp") or ""), namespace=namespace,
                    name=name)


_ANNOUNCED = (c.Reason.SOFT_DELETE_CONFLICT, c.Reason.RULE_LIMIT_REACHED, c.Reason.BUCKET_ROOT_NOT_ALLOWED,
              c.Reason.RULES_UNREADABLE, c.Reason.SHARED_WITH_OTHER_OPERATOR, c.Reason.IDENTICAL_FOREIGN_RULE)


def _transition_events(status: Mapping[str, Any], bucket: BucketOutcome) -> list[Event]:
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


def reconcile_cache(
    *, gcs: GcsClient, kube: KubeClient, warmer_image: str, injections: RecentInjections, spec: Mapping[str, Any],
    meta: Mapping[str, Any], status: Mapping[str, Any], namespace: str, name: str, claims: ClaimLookup,
    now: dt.datetime, instance: str = c.DEFAULT_INSTANCE, warm_retry: WarmRetry = WarmRetry(),
    inventory_every: dt.timedelta = dt.timedelta(hours=1),
    pod_fingerprints: Sequence[tuple[str, dict[str, Any]]] = (),
) -> Outcome:
    """Bucket, then warmers, then pods waiting for the cache; one status at the end. Never
    raises: a failing step becomes a condition with a reason and a message, an Event, and
    `failure` (worth a retry), while what the other steps saw is still reported."""
    generation = int(meta.get("generation") or 0)
    injection = injections.summary(namespace, name, now)
    try:
        return _reconcile(gcs=gcs, kube=kube, warmer_image=warmer_image, spec=spec, meta=meta, status=status,
                          namespace=namespace, name=name, claims=claims, now=now, generation=generation,
                          injection=injection, instance=instance, warm_retry=warm_retry,
                          inventory_every=inventory_every, pod_fingerprints=pod_fingerprints)
    except Exception as exc:  # noqa: BLE001 - a bug must still show in status, not as a blank row
        log.exception("Reconcile of %s/%s failed", namespace, name)
        message = f"Reconcile failed: {type(exc).__name__}: {exc}"[:1000]
        cond = Cond(c.Condition.READY, False, c.Reason.RECONCILE_ERROR, message)
        retrying = Cond(c.Condition.RECONCILING, True, c.Reason.RECONCILE_ERROR, message)
        # Retried, so not Stalled (a Stalled left from before would contradict Reconciling).
        not_stalled = Cond(c.Condition.STALLED, False, c.Reason.RECONCILE_ERROR, "A reconcile failed; retrying")
        out = {"conditions": conditions.merge(status.get("conditions"), [cond, retrying, not_stalled],
                                              generation=generation,
                                              now=now),
               "observedGeneration": generation, "injection": injection}
        # The same error on every resync is said once, as the steps' own errors are.
        events = [Event("Warning", c.Reason.RECONCILE_ERROR, message)] if _changed(status, cond) else []
        return Outcome(out, events, failure=exc)


def _changed(status: Mapping[str, Any], cond: Cond) -> bool:
    """Whether a condition differs from the one in status (an Event is worth posting)."""
    old = conditions.get(status.get("conditions"), cond.type)
    return old is None or old.get("reason") != cond.reason or old.get("message") != cond.message


def _reconcile(
    *, gcs: GcsClient, kube: KubeClient, warmer_image: str, spec: Mapping[str, Any], meta: Mapping[str, Any],
    status: Mapping[str, Any], namespace: str, name: str, claims: ClaimLookup, now: dt.datetime,
    generation: int, injection: dict[str, Any], instance: str, warm_retry: WarmRetry,
    inventory_every: dt.timedelta, pod_fingerprints: Sequence[tuple[str, dict[str, Any]]] = (),
) -> Outcome:
    try:
        cache = parse_spec(spec)
    except InvalidSpec as exc:
        seen = _Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, c.Reason.INVALID_SPEC, str(exc))))
        # Pods held for a cache that cannot be acted on would wait for nothing. A failed
        # release is retried by the next resync (the spec stays invalid until it changes).
        released: list[Event] = []
        unreleased: Exception | None = None
        try:
            seen.waiting_pods, released = release_waiting_pods(
                kube, None, namespace=namespace, name=name, warmed=False, now=now,
                why=f"the cache's spec is invalid ({exc})"[:500])
        except KubeError as kube_exc:
            log.warning("Could not release the pods held for %s/%s: %s", namespace, name, kube_exc)
            unreleased = kube_exc
        return Outcome(_status(status, generation, seen, injection, False, now, unreleased is not None), released,
                       failure=unreleased, invalid=str(exc))
    events: list[Event] = []
    previous = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY)
    gcs_spec = cache.storage.gcs
    mine = Claim.of(gcs_spec, created=str(meta.get("creationTimestamp") or ""), namespace=namespace, name=name)
    failure: Exception | None = None
    # SoftDeleteApplied Reconciled is said only to the cache that owns the bucket-wide settings.
    soft = conditions.get(status.get("conditions"), c.Condition.SOFT_DELETE_APPLIED)
    # A cache with warmers lists its entries after their Jobs were read (see _warm): a
    # listing taken before could miss the last entries of a warmer that finished meanwhile.
    listing_due = inventory_due(status, generation, now, inventory_every)
    try:
        seen = _Seen(reconcile_bucket(gcs, gcs_spec, mine=mine, claims=list(claims(gcs_spec.bucket)),
                                      spec_changed=status.get("observedGeneration") != generation,
                                      instance=instance,
                                      settings_owned_before=soft is not None and soft.get("reason") == c.Reason.RECONCILED,
                                      take_inventory=listing_due and cache.warmup is None))
        if seen.bucket.entry_keys is not None:
            seen.bucket.cache = {**(seen.bucket.cache or {}), "listedTime": _iso(now)}
        elif seen.bucket.ready:
            seen.bucket.cache = dict(status.get("cache") or {}) or None  # as last listed
        events += seen.bucket.events
        events += _transition_events(status, seen.bucket)
    except GcsError as exc:
        seen = _Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, exc.reason, f"{exc}; retrying")))
        if previous is None or previous.get("reason") != exc.reason:
            events.append(Event("Warning", exc.reason, str(exc)))
        failure = exc
    except Exception as exc:  # noqa: BLE001 - e.g. the GCS library raising what it does not document
        log.exception("Bucket reconcile of %s/%s failed", namespace, name)
        seen = _Seen(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, c.Reason.RECONCILE_ERROR,
                                        f"Bucket reconcile failed: {type(exc).__name__}: {exc}; retrying"[:1000])))
        if _changed(status, seen.bucket.condition):
            events.append(Event("Warning", c.Reason.RECONCILE_ERROR, seen.bucket.condition.message))
        failure = exc
    seen.injection = _publish_env(kube, cache, status, events, namespace=namespace, name=name,
                                  uid=str(meta.get("uid") or ""))
    if not seen.injection.status:
        failure = failure or RuntimeError(seen.injection.message)
    try:
        _warm(kube, cache, seen, events, warmer_image=warmer_image, status=status, meta=meta, namespace=namespace,
              name=name, now=now, generation=generation, retry=warm_retry, listing_due=listing_due,
              inventory=lambda: _take_inventory(gcs, cache, seen, now))
    except Exception as exc:  # noqa: BLE001 - KubeError, GcsError, or anything a library raised unexpectedly
        if isinstance(exc, KubeError):
            reason, message = exc.reason, f"Warmers could not be reconciled: {exc}; retrying"
        elif isinstance(exc, GcsError):  # the listing of the entries the warmers wrote
            reason, message = exc.reason, f"The cache's entries could not be listed: {exc}; retrying"
        else:
            log.exception("Warmup reconcile of %s/%s failed", namespace, name)
            reason, message = c.Reason.RECONCILE_ERROR, f"Warmers could not be reconciled: {type(exc).__name__}: {exc}; retrying"
        error = Cond(c.Condition.WARMED, False, reason, message[:1000])
        if cache.warmup is not None and seen.warm_condition is None:
            # What the warmers last reported stays in status.warmup (rewritten only when they
            # were read in this reconcile); the condition says why it is not current.
            seen.warm_condition = error
        if _changed(status, error):
            events.append(Event("Warning", reason, message[:1000]))
        failure = failure or exc
    if cache.warmup is not None:
        pools = seen.warmup.pools if seen.warmup is not None else (status.get("warmup") or {}).get("pools") or []
        matched, reason, message = reports.keys_match(list(pools), list(pod_fingerprints))
        seen.keys_match = Cond(c.Condition.KEYS_MATCH, matched, reason, message)
        if matched is False and _changed(status, seen.keys_match):
            events.append(Event("Warning", reason, message))
    return Outcome(_status(status, generation, seen, injection, cache.warmup is not None, now, failure is not None),
                   events, failure, requeue_at=next_scheduled_warm(cache, now))


def _publish_env(kube: KubeClient, cache: CacheSpec, status: Mapping[str, Any], events: list[Event], *, namespace: str, name: str,
                 uid: str) -> Cond:
    """The ConfigMap containers with envFrom sources read the cache env from, applied
    (created, or restored if someone changed it) on every reconcile. Its condition; a
    Warning Event when it newly fails."""
    configmap = env_configmap_name(name)
    owner = {"name": name, "uid": uid}
    try:
        kube.apply_configmap(env_configmap(cache, name, namespace, owner))
    except KubeError as exc:
        cond = Cond(c.Condition.INJECTION_READY, False, exc.reason,
                    f"ConfigMap {configmap} with the cache env could not be applied: {exc}; pods whose containers "
                    "have envFrom sources may start without the cache env; retrying"[:1000])
        if _changed(status, cond):
            events.append(Event("Warning", exc.reason, cond.message))
        return cond
    boot = ""
    if cache.injection.local_copy is not None:
        try:
            kube.apply_configmap(boot_configmap(name, namespace, owner, boot_files(), boot_bytecode_files()))
        except KubeError as exc:
            cond = Cond(c.Condition.INJECTION_READY, False, exc.reason,
                        f"ConfigMap {boot_configmap_name(name)} with the local copy's code could not be applied: "
                        f"{exc}; pods that copy in process start cold; retrying"[:1000])
            if _changed(status, cond):
                events.append(Event("Warning", exc.reason, cond.message))
            return cond
        boot = f"; ConfigMap {boot_configmap_name(name)} holds the code of the local copy pods make in process"
    return Cond(c.Condition.INJECTION_READY, True, c.Reason.RECONCILED,
                f"ConfigMap {configmap} holds the cache env; containers with envFrom sources read it first, so "
                f"their own env and envFrom values win{boot}")


@functools.cache
def boot_files() -> dict[str, str]:
    """The text of the boot ConfigMap's files (agents/payload.py), as installed, read once."""
    return {shipped: payload.source(shipped).read_text(encoding="utf-8") for shipped in BOOT_FILES}


def compile_boot(files: Mapping[str, str], tag: str | None = BYTECODE_TAG) -> dict[str, bytes]:
    """`files` (shipped name -> text) compiled by a fresh interpreter of this python
    (localcopy.BYTECODE_SCRIPT): bytecode_key(name, tag) -> its checked-hash pyc. None
    when this python caches no bytecode (tag None) or cannot be run again (no
    sys.executable, or it fails: logged); then pods compile the files, as they always could."""
    if tag is None or not sys.executable:
        return {}
    # -S: no site (nothing of the environment's loaded first), -B: writes nothing (a
    # read-only root), -P: not the working directory on sys.path. Of the environment only
    # what running python itself may need, and a fixed hash seed.
    env = {k: v for k, v in os.environ.items() if k in ("LD_LIBRARY_PATH", "PYTHONHOME")}
    try:
        done = subprocess.run([sys.executable, "-S", "-B", "-P", "-c", BYTECODE_SCRIPT], input=json.dumps(dict(files)),
                              capture_output=True, text=True, timeout=60, env={**env, "PYTHONHASHSEED": "0"},
                              check=True)
        return {bytecode_key(name, tag): bytes.fromhex(pyc) for name, pyc in json.loads(done.stdout).items()}
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None) or ""
        log.warning("the boot ConfigMap goes without bytecode (pods compile its files): %s %s", exc, stderr[-500:])
        return {}


_bytecode: dict[str, bytes] | None = None
_bytecode_failed_at = -float("inf")
_bytecode_lock = threading.Lock()
BYTECODE_RETRY_SECONDS = 300.0


def boot_bytecode_files() -> dict[str, bytes]:
    """The boot ConfigMap's bytecode (compile_boot of boot_files): compiled once, by one
    reconcile while the others wait; a failure is not kept, but tried again at most every
    BYTECODE_RETRY_SECONDS (meanwhile, and until then, the ConfigMap goes without it), so a
    passing failure does not leave this replica applying ConfigMaps unlike another's."""
    global _bytecode, _bytecode_failed_at  # noqa: PLW0603 - the process's one compile
    with _bytecode_lock:
        if _bytecode is None and time.monotonic() - _bytecode_failed_at >= BYTECODE_RETRY_SECONDS:
            compiled = compile_boot(boot_files())
            if compiled or BYTECODE_TAG is None:
                _bytecode = compiled
            else:
                _bytecode_failed_at = time.monotonic()
        return _bytecode or {}


def inventory_due(status: Mapping[str, Any], generation: int, now: dt.datetime, every: dt.timedelta) -> bool:
    """Whether this reconcile lists the cache's entries on the bucket: never listed, a new
    spec, entries left unstamped by the last listing, or `every` passed since it. A warm
    that finished since is checked on its own (see _warm), so a resync of a cache nothing
    happened to costs no listing: the inventory's cost follows change, not time."""
    listed = (status.get("cache") or {}).get("listedTime")
    if not listed or status.get("observedGeneration") != generation or (status.get("cache") or {}).get("unstamped"):
        return True
    try:
        at = dt.datetime.strptime(str(listed), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return True
    return now - at >= every


def _take_inventory(gcs: GcsClient, cache: CacheSpec, seen: _Seen, now: dt.datetime) -> None:
    counts, seen.bucket.entry_keys = cache_inventory(gcs, cache.storage.gcs)
    seen.bucket.cache = {**counts, "listedTime": _iso(now)}


def _iso(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def warmers_checked(pools: Sequence[Mapping[str, Any]]) -> str:
    """What a Warmed verdict depends on besides the bucket (each pool's run and the keys its
    warmer reported), as a short digest kept in status.cache.warmersChecked: the same
    digest and no listing since means the last verdict stands."""
    basis = [(p.get("name"), p.get("job"), p.get("state"), p.get("completionTime"), p.get("keys")) for p in pools]
    return hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _warm(kube: KubeClient, cache: CacheSpec, seen: _Seen, events: list[Event], *, warmer_image: str, status: Mapping[str, Any],
          meta: Mapping[str, Any], namespace: str, name: str, now: dt.datetime, generation: int,
          retry: WarmRetry, listing_due: bool, inventory: Callable[[], None]) -> None:
    if cache.warmup is not None:
        if seen.bucket.ready:
            seen.warmup = reconcile_warmup(
                kube, cache, namespace=namespace, name=name, uid=str(meta.get("uid") or ""),
                annotations=meta.get("annotations") or {},
                previous=(status.get("warmup") or {}).get("pools") or [],
                cache_entries=int((seen.bucket.cache or {}).get("entries", 0)),
                warmer_image=warmer_image, now=now, generation=generation,
                warmed_before=was_warmed(status), entry_keys=seen.bucket.entry_keys, retry=retry,
            )
            if listing_due and seen.bucket.entry_keys is None:
                inventory()  # due, and taken now that the warmers' Jobs have been read
                seen.warmup.condition = warmed_condition(
                    seen.warmup.pools, int((seen.bucket.cache or {}).get("entries", 0)),
                    was_warmed(status), seen.bucket.entry_keys)
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
                        inventory()  # a warm finished since the last listing: check its entries now
                        seen.warmup.condition = warmed_condition(
                            seen.warmup.pools, int((seen.bucket.cache or {}).get("entries", 0)),
                            was_warmed(status), seen.bucket.entry_keys)
                    seen.bucket.cache = {**(seen.bucket.cache or {}), "warmersChecked": checked}
            seen.warm_condition = seen.warmup.condition
            events += seen.warmup.events
        else:
            seen.warm_condition = Cond(c.Condition.WARMED, False, c.Reason.BUCKET_NOT_READY,
                                       "Warmers wait for the bucket to be ready")
    why = release_all_because(cache, seen.bucket.condition, status)
    if why:
        _, released = release_waiting_pods(kube, cache, namespace=namespace, name=name, warmed=False, now=now,
                                           why=why)
        events += released
        if cache.injection.wait_for_warm.enabled:
            seen.waiting_pods = 0
    elif cache.injection.wait_for_warm.enabled:
        warmed = cache.warmup is None or bool(seen.warm_condition and seen.warm_condition.status)
        seen.waiting_pods, released = release_waiting_pods(kube, cache, namespace=namespace, name=name,
                                                           warmed=warmed, now=now)
        events += released


# BucketReady reasons that refuse the cache until its spec (or another cache) changes:
# no warmer runs, so pods held for it would wait for nothing.
REFUSED = (c.Reason.PREFIX_IN_USE,)


def was_warmed(status: Mapping[str, Any]) -> bool:
    """Whether the previous reconcile left Warmed True (a warm now is a re-warm)."""
    warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
    return bool(warmed and warmed.get("status") == "True")


def release_all_because(cache: CacheSpec, bucket: Cond, status: Mapping[str, Any]) -> str:
    """Why every pod held for this cache is released now ('' when they keep waiting):
    the cache is refused, or waitForWarm is off. With waitForWarm off the pods are looked
    up only while status.injection still has waitingPods (written only while waitForWarm
    was on, removed by this release), so a cache that never waited costs no pod list."""
    if bucket.reason in REFUSED:
        return f"the cache is refused ({bucket.reason})"
    if not cache.injection.wait_for_warm.enabled and (status.get("injection") or {}).get("waitingPods") is not None:
        return "the cache no longer waits for warm (waitForWarm is off)"
    return ""


def release_orphaned_pod(kube: KubeClient, pod: Mapping[str, Any], lookup: CacheLookup) -> Event | None:
    """Release one labelled pod held by our gate for a cache that does not exist (deleted,
    also while the operator was down, or in the instant the webhook admitted the pod).
    The Event is the pod's: its cache is gone. Raises KubeError."""
    meta = pod.get("metadata") or {}
    gates = [g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    cache_name = str((meta.get("labels") or {}).get(c.CACHE_LABEL) or "")
    if c.WAIT_GATE not in gates or meta.get("deletionTimestamp") or lookup(namespace, cache_name) is not None:
        return None
    kube.remove_scheduling_gate(namespace, name, gates.index(c.WAIT_GATE), c.WAIT_GATE)
    return Event("Normal", c.Reason.POD_RELEASED,
                 f"Released pod {name}: its CompilationCache {cache_name} does not exist")


def release_pods_of_deleted_cache(kube: KubeClient, *, namespace: str, name: str, now: dt.datetime) -> list[Event]:
    """Release every pod still held for a cache that no longer exists. Raises KubeError."""
    _, events = release_waiting_pods(kube, None, namespace=namespace, name=name, warmed=False, now=now,
                                     why="the cache was deleted")
    return events


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
    if spec.get("warmup") and any(p.get("nextRetryTime") and str(p["nextRetryTime"]) <= at.strftime("%Y-%m-%dT%H:%M:%SZ")
                                  for p in pools or []):
        return True
    wait = ((spec.get("injection") or {}).get("waitForWarm") or {}).get("enabled")
    warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
    return bool(wait) and (warmed is None or warmed.get("status") != "True"
                           or bool((status.get("injection") or {}).get("waitingPods")))


def delete_cache(gcs: GcsClient, spec: Mapping[str, Any], meta: Mapping[str, Any], *, namespace: str, name: str,
                 claims: ClaimLookup, instance: str = c.DEFAULT_INSTANCE) -> list[Event]:
    """deletionPolicy Delete, unless another cache uses the same prefix (then its data
    stays). Raises GcsError; InvalidSpec for a spec that cannot be read."""
    cache = parse_spec(spec)
    gcs_spec = cache.storage.gcs
    others = sorted(o for o in claims(gcs_spec.bucket)
                    if o.key != (namespace, name) and o.prefix == gcs_spec.prefix)
    if others:
        return [Event("Normal", c.Reason.DATA_RETAINED,
                      f"Kept the data under {gcs_spec.url}: CompilationCache {others[0].ref} uses the same prefix")]
    return delete_cache_data(gcs, gcs_spec, namespace=namespace, name=name, instance=instance)


def index_entry(spec: Mapping[str, Any], *, generation: int, uid: str | None, warmed: bool,
                refused: bool = False, image_pythonpath: str | None = None) -> dict[str, Any]:
    """What the webhook needs of a cache, parsed once: the typed spec (or why it is
    invalid), whether it is Warmed, whether it is refused (BucketReady reason in
    REFUSED: no pod is held for it), and the PYTHONPATH the warmup's image sets, as its
    warmers reported it (warmups.image_pythonpath; None: not known)."""
    try:
        cache: CacheSpec | None = parse_spec(spec)
        error = ""
    except InvalidSpec as exc:
        cache, error = None, str(exc)
    return {"cache": cache, "error": error, "generation": generation, "uid": uid, "warmed": warmed,
            "refused": refused, "image_pythonpath": image_pythonpath}


@dataclass
class Admission:
    """The webhook's answer for one pod: fields to set, warnings, an event to post."""

    spec: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    event: tuple[dict[str, Any], Event] | None = None
    injected: bool = False


def admit_pod(pod: Mapping[str, Any], lookup: CacheLookup, reporting: Reporting | None = None,
              warmer_image: str | None = None) -> Admission:
    """Add the named cache's env (and, with waitForWarm, a scheduling gate; with
    `reporting` and spec.injection.report, the reporter; with spec.injection.localCopy and
    the `warmer_image` that carries the copier, the local copy) to a pod being created, or
    say in a warning why not. Raises only on a bug; the caller admits anyway."""
    meta = pod.get("metadata") or {}
    namespace = str(meta.get("namespace") or "")
    cache_name = str((meta.get("labels") or {}).get(c.CACHE_LABEL) or "")
    pod_name = meta.get("name") or f"{meta.get('generateName', '')}<generated>"
    entry = lookup(namespace, cache_name)
    out = Admission()
    if entry is None:
        out.warnings.append(f"cachewarm: no CompilationCache {cache_name!r} in namespace {namespace!r} "
                            f"(label {c.CACHE_LABEL}); pod admitted without the cache")
        return out
    cache: CacheSpec | None = entry["cache"]
    if cache is None:
        out.warnings.append(f"cachewarm: CompilationCache {cache_name!r} is invalid ({entry['error']}); "
                            "pod admitted without the cache")
        return out
    pod_spec = pod.get("spec") or {}
    if cache.injection.local_copy is not None and not local_copy_possible(pod_spec, warmer_image):
        # No copy (no warmer image configured, a Windows pod): the pod reads the bucket.
        cache = cache.model_copy(update={"injection": cache.injection.model_copy(update={"local_copy": None})})
        out.warnings.append(f"cachewarm: CompilationCache {cache_name!r} asks for a local copy, which this pod "
                            "cannot get (a Windows pod, a volume of its own named cachewarm-cache, cachewarm-boot, "
                            "cachewarm-reporter or cachewarm-report-token, or mounted at /cachewarm-cache, "
                            "/cachewarm-boot, /cachewarm-copy, /cachewarm-reporter or /var/run/secrets/cachewarm, or no warmer image configured); it reads the bucket")
    result = inject_pod(pod, cache_name, entry["generation"], cache)
    if result.changed:
        out.spec["containers"] = result.containers
        if result.init_containers is not None:
            out.spec["initContainers"] = result.init_containers
        out.annotations[c.INJECTED_ANNOTATION] = result.annotation
        out.injected = True
    containers = result.containers
    init_containers = result.init_containers if result.init_containers is not None else pod_spec.get("initContainers") or []
    volumes = list(pod_spec.get("volumes") or [])
    reports = reporting if cache.injection.report else None
    in_process = None
    if cache.injection.local_copy is not None and warmer_image:
        # In process where the pod's PYTHONPATH is known: no init container at all.
        in_process = add_local_copy_in_process(
            pod_spec, containers, init_containers, volumes, cache=cache, namespace=namespace, cache_name=cache_name,
            image_pythonpath=entry.get("image_pythonpath"), reporting=reports, annotations=meta.get("annotations"))
        if in_process is not None:
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = in_process
            out.injected = True
    # Else by init containers (as at the first admission, on reinvocation).
    by_init = in_process is None and not is_in_process(pod_spec)
    if by_init and reports is not None:
        added = add_reporter(pod_spec, containers, init_containers, cache_name, reports)
        if added is not None:
            containers, init_containers, volumes = added
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = added
            out.injected = True
    if by_init and cache.injection.local_copy is not None and warmer_image:
        copied = add_local_copy(pod_spec, containers, init_containers, volumes, cache=cache, namespace=namespace,
                                cache_name=cache_name, image=warmer_image, annotations=meta.get("annotations"))
        if copied is not None:
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = copied
            out.injected = True
    gates = list((pod.get("spec") or {}).get("schedulingGates") or [])
    if cache.injection.wait_for_warm.enabled and cache.warmup is not None and not entry["warmed"] \
            and not entry.get("refused"):
        if not any(g.get("name") == c.WAIT_GATE for g in gates):
            out.spec["schedulingGates"] = [*gates, {"name": c.WAIT_GATE}]
    for kept in result.kept:
        out.warnings.append(f"cachewarm: container {kept.container!r} keeps its own {kept.name}; "
                            f"the value from CompilationCache {cache_name!r} was not applied to it")
    if result.kept:
        names = ", ".join(sorted({f"{k.container}/{k.name}" for k in result.kept}))
        ref = {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
               "metadata": {"name": cache_name, "namespace": namespace, "uid": entry["uid"]}}
        out.event = (ref, Event("Warning", c.Reason.ENV_KEPT, f"Pod {pod_name} kept its own {names}"))
    return out
