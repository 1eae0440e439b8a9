"""The reconcile policy of CompilationCaches over a generic work queue (runtime/queue.py:
one key per cache, a few workers, on the leader only).

kopf watches the caches (on every replica, for the webhook's index) and hands each watch
event to `Controller.observe`, which keeps the watch store (runtime/store.py) and decides
whether the event is worth a reconcile (a new cache, a new generation, changed annotations
or finalizers, a deletion); the controller's own timers add the periodic resync, the fast
poll of caches with warmers running or pods waiting, and a wake-up at the time a reconcile
asked for (a cron schedule's next slot, which no watch event marks). The queue's rules
(one reconcile of a cache at a time, a change meanwhile reconciled after, backoff) are the
queue's; what is the controller's:

- leader only: the queue is gated on the lead; a new leader queues every cache and
  releases pods held for caches that are gone, a replica that lost it drops its wake-ups;
- every reconcile starts by reading the cache from the apiserver, so it acts on the
  latest spec, whatever the event that queued it carried;
- a failed reconcile is retried with the operator's backoff; a spec that cannot be acted
  on is not retried until it changes (or the next resync);
- status is written only when merging the reconcile's patch changes it.

The finalizer is ours too: added only to caches whose deletionPolicy is Delete (so
`kubectl delete` of any other cache never waits for the operator), removed once their
data is deleted, or when the policy changes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as dt
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from cachewarm.api import constants as c
from cachewarm.api import timefmt
from cachewarm.reconcile.bucket import CreatedCounts
from cachewarm.reconcile.cache import CacheObject, Outcome, Wiring, claim_of, delete_cache, reconcile_cache
from cachewarm.reconcile import pods as held_pods
from cachewarm.reconcile import status as cache_status
from cachewarm.reconcile.misses import stale as programs_stale
from cachewarm.builders.bucket import Claim, CreationLimits
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.clients.gcs import GcsClient, GcsError
from cachewarm.api.events import Event
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.api.metrics import Metrics
from cachewarm.reports.store import Store, cold_message
from cachewarm.api.model import InvalidSpec
from cachewarm.runtime.queue import WorkQueue, backoff
from cachewarm.runtime.settings import Settings
from cachewarm.runtime.store import CacheStore, Key
from cachewarm.reconcile.warmup import WarmRetry

log = logging.getLogger("cachewarm.controller")


class Leader(Protocol):
    @property
    def is_leader(self) -> bool: ...


def _older_than(when: Any, limit: dt.datetime) -> bool:
    """Whether an RFC 3339 time (as status holds it) is before `limit`; unreadable: yes."""
    try:
        return timefmt.parse(when) < limit
    except ValueError:
        return True


def worth_reconciling(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether a watch event of a cache asks for a reconcile: the cache is new to us, or
    its spec (generation), annotations (cachewarm.dev/rewarm), finalizers or deletion
    changed. A change of status alone (our own writes) is not: it would loop."""
    if old is None:
        return True
    o, n = old.get("metadata") or {}, new.get("metadata") or {}
    return any(o.get(f) != n.get(f) for f in ("generation", "annotations", "finalizers", "deletionTimestamp"))


def deletion_policy(spec: Mapping[str, Any]) -> str:
    return str(((spec.get("storage") or {}).get("gcs") or {}).get("deletionPolicy") or "Retain")


def merged(target: Any, patch: Any) -> Any:
    """`target` after a JSON merge patch (RFC 7386): objects merge, None removes a key,
    anything else replaces."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out.get(key), value)
    return out


def wanted_finalizers(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> list[str] | None:
    """The finalizers the cache should have (None: they are right as they are). Ours only
    while deletionPolicy is Delete and the cache is not being deleted; others' untouched."""
    have = list(meta.get("finalizers") or [])
    want = deletion_policy(spec) == "Delete" and not meta.get("deletionTimestamp")
    if want and c.FINALIZER not in have:
        return [*have, c.FINALIZER]
    if not want and c.FINALIZER in have and not meta.get("deletionTimestamp"):
        return [f for f in have if f != c.FINALIZER]
    return None


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclasses.dataclass
class Result:
    """How a reconcile ended: `retry` asks for a retry with backoff, `again` for an
    immediate one (the object changed under us), `requeue_at` for one at that time (the
    cache's next cron slot)."""

    retry: bool = False
    again: bool = False
    requeue_at: dt.datetime | None = None


class Controller:
    def __init__(self, settings: Settings, gcs: GcsClient, kube: KubeClient, injections: RecentInjections,
                 leader: Leader, metrics: Metrics | None = None, reports: Store | None = None,
                 clock: Callable[[], dt.datetime] = utcnow) -> None:
        """`clock`: the time a reconcile acts at and wake-ups are counted from (tests
        drive it)."""
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.reports = reports or Store(dt.timedelta(seconds=settings.report_window_seconds))
        self._fingerprints_seen: dict[Key, str] = {}  # what the last reconcile compared with the warmers
        self.gcs = gcs
        self.kube = kube
        self.injections = injections
        self.leader = leader
        self.caches = CacheStore()
        # One key per cache, reconciled on the leader only (the queue drops what it is
        # given on any other replica).
        self.queue: WorkQueue[Key] = WorkQueue(self._reconcile, workers=settings.workers,
                                               retry_delay_seconds=settings.retry_delay_seconds,
                                               active=lambda: self.leader.is_leader, clock=clock, name="reconcile")
        self.wiring = Wiring(
            gcs=gcs, kube=kube, warmer_image=settings.warmer_image, injections=injections, claims=self.claims,
            instance=settings.instance,
            limits=CreationLimits(frozenset(settings.bucket_locations), frozenset(settings.bucket_storage_classes),
                                  settings.buckets_per_namespace),
            created_counts=CreatedCounts(ttl=settings.bucket_count_seconds),
            warm_retry=WarmRetry(settings.warm_retries, settings.warm_retry_seconds),
            inventory_every=dt.timedelta(seconds=settings.inventory_seconds))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(settings.workers, thread_name_prefix="reconcile")
        self._tasks: list[asyncio.Task[None]] = []

    # --- what the caches look like (every replica) ---

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of a cache (on the event loop). Keeps the store and the
        per-bucket claims current and queues the cache when the event asks for it."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if event_type == "DELETED":
            self.caches.remove(key)
            self.queue.forget(key)
            self.queue.cancel_delayed(key)
            self.metrics.forget_cache(*key)
            self._release_deleted(body)
            return
        spec = body.get("spec") or {}
        claim = claim_of(spec, meta, *key)
        old = self.caches.put(key, body, claim)
        if worth_reconciling(old, body):
            self.enqueue(key)

    @property
    def store(self) -> dict[Key, dict[str, Any]]:
        """The latest body seen of each cache (the watch store's)."""
        return self.caches.bodies

    def claims(self, bucket: str) -> list[Claim]:
        return self.caches.claims(bucket)

    # --- the queue ---

    def enqueue(self, key: Key) -> None:
        """Queue the cache for a reconcile (leader only: a new leader queues them all)."""
        self.queue.add(key)

    @property
    def running(self) -> bool:
        """Whether the queue takes caches (run() listed them all and started its workers)."""
        return self.queue.running

    @property
    def queued(self) -> frozenset[Key]:
        """The caches waiting in the queue for a worker."""
        return self.queue.queued

    @property
    def busy(self) -> bool:
        """Whether a cache is queued, being reconciled or due again right after (backoff
        timers and wake-ups are not counted: they queue it later)."""
        return self.queue.busy

    def enqueue_all(self) -> None:
        for key in list(self.store):
            self.enqueue(key)

    def leadership_changed(self, leading: bool) -> None:
        """From the election's thread: a new leader reconciles every cache and releases
        pods held for caches that are gone (what it missed while it did not lead); a
        replica that lost the lead drops its wake-ups."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_lead if leading else self._on_lose)
        except RuntimeError:  # the loop closed: the process is stopping
            pass

    def _on_lead(self) -> None:
        self.enqueue_all()
        assert self._loop is not None
        self._loop.run_in_executor(self._executor, self.release_orphans)

    def _on_lose(self) -> None:
        """The lead went: this replica's wake-ups are the new leader's business now (its
        first reconcile of each cache asks for them again)."""
        for key in self.queue.delayed():
            self.queue.cancel_delayed(key)

    async def _prime(self) -> None:
        """Every cache, listed once before the first reconcile: a reconcile plans a
        bucket's lifecycle rules for all the caches on it, so it must know them all."""
        assert self._loop is not None
        retry = 0
        while True:
            try:
                caches = await self._loop.run_in_executor(self._executor, self.kube.list_caches,
                                                          self.settings.namespaces)
            except KubeError as exc:
                delay = backoff(self.settings.retry_delay_seconds, retry)
                log.warning("Could not list the caches (retrying in %.0fs): %s", delay, exc)
                retry += 1
                await asyncio.sleep(delay)
                continue
            for body in caches:
                meta = body.get("metadata") or {}
                if (meta.get("namespace"), meta.get("name")) not in self.store:
                    self.observe(None, body)
            return

    async def run(self) -> None:
        """Workers and timers, until cancelled."""
        self._loop = asyncio.get_running_loop()
        await self._prime()
        workers = self.queue.start()
        self._tasks = [
            asyncio.create_task(self._every(self.settings.resync_seconds, self._resync), name="resync"),
            asyncio.create_task(self._every(self.settings.warm_poll_seconds, self._poll), name="poll"),
            asyncio.create_task(self._every(self.settings.usage_flush_seconds, self._flush_usage_computed_aside),
                                name="usage"),
        ]
        if self.leader.is_leader:
            self._on_lead()
        try:
            await asyncio.gather(*workers, *self._tasks)
        finally:
            self.queue.stop()  # its workers and wake-ups
            for task in self._tasks:
                task.cancel()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _every(self, seconds: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                done = fn()
                if inspect.isawaitable(done):
                    await done
            except Exception:  # noqa: BLE001 - a bug in one tick must not stop the timers
                log.exception("Periodic %s failed", getattr(fn, "__name__", "task"))

    async def drain(self, timeout: float) -> bool:
        """At shutdown, after leadership stopped: wait (at most `timeout` seconds) for the
        reconciles in flight to end, so no other replica starts one of the same cache
        while this one still writes. Returns whether they all ended."""
        return await self.queue.drain(timeout)

    def _resync(self) -> None:
        self.enqueue_all()
        if self.leader.is_leader and self._loop is not None:
            self._loop.run_in_executor(self._executor, self.release_orphans)

    def has_cache(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self.store

    async def _flush_usage_computed_aside(self) -> None:
        """_flush_usage with each reported cache's usage computed in a reconcile thread, not
        on this loop, which serves admission and reports too: a usage pass over many
        processes takes long (attacker review: a namespace can make it seconds)."""
        if not self.leader.is_leader or self._loop is None:
            return
        now = dt.datetime.now(dt.timezone.utc)
        reported = set(self.reports.caches())
        bodies = [(key, body) for key, body in list(self.store.items()) if key in reported]

        def compute() -> dict[Key, dict[str, Any] | None]:
            return {key: self.reports.usage(*key, now, body) for key, body in bodies}

        self._flush_usage(now, await self._loop.run_in_executor(self._executor, compute))

    def _flush_usage(self, now: dt.datetime | None = None, computed: Mapping[Key, dict[str, Any] | None] | None = None
                     ) -> None:
        """Leader only: write status.usage of each cache pods reported for, when it differs
        from what status holds, and remove it where its window emptied (the last report
        older than the window; a usage this leader has not heard of yet, after a leader
        change, stays until then). A cache whose pods' distinct fingerprints changed is
        reconciled (KeysMatch). Pods that newly reported a cold local copy are said in one
        LocalCopyCold Warning on the cache."""
        if not self.leader.is_leader or self._loop is None:
            return
        now = now or dt.datetime.now(dt.timezone.utc)
        self.reports.prune(now, set(self.store))
        reported = set(self.reports.caches())
        for key, body in list(self.store.items()):
            written = (body.get("status") or {}).get("usage")
            if key in reported:
                usage = computed[key] if computed is not None and key in computed else self.reports.usage(*key, now, body)
            elif written and _older_than(written.get("lastReportTime"), now - self.reports.window):
                usage = None
            else:
                usage = written
            if usage != written:
                if usage is not None and isinstance(written, Mapping):
                    # A merge patch keeps what it does not name: a field usage no longer has
                    # (hitRatio, localCopy) is removed by name.
                    usage = {**{field: None for field in written if field not in usage}, **usage}
                self._loop.run_in_executor(self._executor, self._write_usage, key, usage)
            cold = self.reports.newly_cold(*key, now)
            if cold:
                self._loop.run_in_executor(self._executor, self._post, body,
                                           [Event("Warning", c.Reason.LOCAL_COPY_COLD, cold_message(cold))])
            seen = repr(sorted({repr(sorted(f.items())) for _, f in self.reports.fingerprints(*key, now)}))
            if self._fingerprints_seen.get(key, "[]") != seen:
                self._fingerprints_seen[key] = seen
                self.enqueue(key)
            elif written is not None and programs_stale(body.get("status") or {}):
                self.enqueue(key)  # ProgramsWarm is behind the usage status holds (reconcile/misses.py)
        for key in set(self._fingerprints_seen) - set(self.store):
            del self._fingerprints_seen[key]

    def _write_usage(self, key: Key, usage: dict[str, Any] | None) -> None:
        try:
            self.kube.patch_cache_status(*key, {"usage": usage})
        except KubeError as exc:
            log.warning("Could not write the usage of %s/%s: %s", *key, exc)

    def _poll(self) -> None:
        for key, body in list(self.store.items()):
            meta = body.get("metadata") or {}
            if cache_status.needs_poll(body.get("spec") or {}, body.get("status") or {}, int(meta.get("generation") or 0)):
                self.enqueue(key)

    async def _reconcile(self, key: Key) -> Result:
        """What a queue worker does with a cache: reconcile_one in a reconcile thread, then
        the wake-up it asked for (the queue sees to its retry)."""
        assert self._loop is not None
        try:
            result = await self._loop.run_in_executor(self._executor, self.reconcile_one, key)
        except Exception:  # noqa: BLE001 - a bug in one reconcile must not stop the worker
            log.exception("Reconcile of %s/%s failed", *key)
            return Result(retry=True)
        if result.requeue_at is not None:
            self.wake_at(key, result.requeue_at)
        return result

    def wake_at(self, key: Key, when: dt.datetime) -> None:
        """Queue the cache at `when` (by self.clock), leader only. One wake-up per cache,
        the earliest asked for: a later one is dropped (the reconcile at the earlier one
        asks again). A cache that is gone gets none."""
        if key in self.store:
            self.queue.add_at(key, when)

    def wakeups(self) -> dict[Key, dt.datetime]:
        """The pending wake-ups: when each cache is queued again."""
        return self.queue.delayed()

    # --- one reconcile (a worker thread) ---

    def reconcile_one(self, key: Key) -> Result:
        """Read the cache as stored now, then finalizer, then bucket, warmers and pods, and
        its status. Raises nothing a retry cannot cure: API errors are retried."""
        namespace, name = key
        try:
            body = self.kube.get_cache(namespace, name)
        except KubeError as exc:
            log.warning("Could not read %s %s/%s: %s", c.KIND, namespace, name, exc)
            self.metrics.reconcile_errors.labels(exc.reason).inc()
            return Result(retry=True)
        if body is None:
            return Result()
        meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
        if meta.get("deletionTimestamp"):
            return self._finalize(body)
        finalizers = wanted_finalizers(meta, spec)
        if finalizers is not None:
            try:
                if not self.kube.set_cache_finalizers(namespace, name, finalizers, str(meta.get("resourceVersion"))):
                    return Result(again=True)  # changed meanwhile: read it again
            except KubeError as exc:
                log.warning("Could not set the finalizers of %s/%s: %s", namespace, name, exc)
                return Result(retry=True)
        now = self.clock()
        outcome = reconcile_cache(
            self.wiring, CacheObject(namespace, name, spec, meta, status), now=now,
            pod_fingerprints=self.reports.fingerprints(namespace, name, now))
        return self._write_status(key, body, outcome)

    def _write_status(self, key: Key, body: Mapping[str, Any], outcome: Outcome) -> Result:
        """The reconcile's status patch, written when merging it changes what the cache
        holds (leader only), then its Events and metrics; how the reconcile ended."""
        namespace, name = key
        status = body.get("status") or {}
        patch = dict(outcome.status)
        if "kopf" in status:
            patch["kopf"] = None  # state of the kopf handlers that reconciled caches before
        if not self.leader.is_leader:
            # Leadership went during this reconcile: the new leader writes status now.
            log.warning("Lost the lead while reconciling %s/%s; its status is left to the new leader", namespace, name)
            return Result()
        after = merged(status, patch)
        try:
            if after != status:  # a resync that changed nothing writes nothing
                self.kube.patch_cache_status(namespace, name, patch)
        except KubeError as exc:
            log.warning("Could not write the status of %s/%s: %s", namespace, name, exc)
            self.metrics.reconcile_errors.labels(exc.reason).inc()
            self._post(body, outcome.events)
            return Result(retry=True, requeue_at=outcome.requeue_at)
        failure = outcome.failure
        self.metrics.record_reconcile(namespace, name, status, after, None if failure is None else
                                      str(getattr(failure, "reason", None) or c.Reason.RECONCILE_ERROR))
        self._post(body, outcome.events)
        if outcome.invalid is not None:
            log.warning("%s %s/%s cannot be acted on: %s", c.KIND, namespace, name, outcome.invalid)
            return Result()
        return Result(retry=outcome.failure is not None, requeue_at=outcome.requeue_at)

    def _finalize(self, body: Mapping[str, Any]) -> Result:
        """A cache being deleted: with our finalizer, delete its data (deletionPolicy
        Delete) and then remove the finalizer; without it, nothing is ours to do."""
        meta = body.get("metadata") or {}
        namespace, name = str(meta["namespace"]), str(meta["name"])
        if c.FINALIZER not in (meta.get("finalizers") or []):
            return Result()
        events: list[Event] = []
        if deletion_policy(body.get("spec") or {}) == "Delete":
            try:
                events = delete_cache(self.gcs, body.get("spec") or {}, meta, namespace=namespace,
                                              name=name, claims=self.claims, instance=self.settings.instance)
            except InvalidSpec as exc:
                events = [Event("Warning", c.Reason.INVALID_SPEC,
                                f"Kept the cache's data: its spec cannot be read ({exc})")]
            except GcsError as exc:
                self._post(body, [Event("Warning", exc.reason, f"Could not delete cache data: {exc}; retrying")])
                return Result(retry=True)
        self._post(body, events)
        try:
            done = self.kube.set_cache_finalizers(namespace, name, [f for f in meta.get("finalizers") or []
                                                               if f != c.FINALIZER], str(meta.get("resourceVersion")))
        except KubeError as exc:
            log.warning("Could not remove the finalizer of %s/%s: %s", namespace, name, exc)
            return Result(retry=True)
        return Result(again=not done)

    def _post(self, body: Mapping[str, Any], events: list[Event]) -> None:
        meta = body.get("metadata") or {}
        kind = str(body.get("kind") or c.KIND)
        ref = {"apiVersion": body.get("apiVersion") or f"{c.GROUP}/{c.VERSION}", "kind": kind,
               "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")}}
        for event in events:
            log.info(event.message, extra={"k8s_ref": {"kind": kind, "namespace": meta.get("namespace"),
                                                       "name": meta.get("name")}, "reason": event.reason})
            try:
                self.kube.post_event(ref, type=event.type, reason=event.reason, message=event.message,
                                now=dt.datetime.now(dt.timezone.utc))
            except KubeError as exc:
                log.warning("Could not post event %s: %s", event.reason, exc)

    # --- pods held for caches that are gone (leader only) ---

    def _release_deleted(self, body: Mapping[str, Any]) -> None:
        if self._loop is None or not self.leader.is_leader:
            return
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")

        def release() -> None:
            try:
                events = held_pods.release_pods_of_deleted_cache(self.kube, namespace=namespace, name=name,
                                                               now=dt.datetime.now(dt.timezone.utc))
            except KubeError as exc:
                log.warning("Could not release the pods of deleted cache %s/%s: %s", namespace, name, exc)
                return
            self._post(body, events)

        self._loop.run_in_executor(self._executor, release)

    def release_orphans(self) -> None:
        """Release every labelled pod held for a cache that does not exist. Pods are listed
        before caches: a pod was gated only while its cache existed, so a cache missing
        from the later list was deleted (no cache created after the pod list can be one
        such a pod waits for)."""
        if not self.leader.is_leader:
            return
        try:
            pods = self.kube.list_labelled_pods(self.settings.namespaces, c.CACHE_LABEL)
            caches = self.kube.list_caches(self.settings.namespaces)
        except KubeError as exc:
            log.warning("Could not look for pods held for deleted caches: %s", exc)
            return
        existing = {((b.get("metadata") or {}).get("namespace"), (b.get("metadata") or {}).get("name"))
                    for b in caches}
        for pod in pods:
            self.release_if_orphaned(pod, lambda ns, n: {} if (ns, n) in existing else None)

    def release_if_orphaned(self, pod: Mapping[str, Any], lookup: held_pods.CacheLookup) -> Event | None:
        """Release one held pod whose cache `lookup` does not find (leader only)."""
        if not self.leader.is_leader:
            return None
        meta = pod.get("metadata") or {}
        try:
            event = held_pods.release_orphaned_pod(self.kube, pod, lookup)
        except KubeError as exc:
            log.warning("Could not release pod %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
            return None
        if event is not None:
            ref = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")}}
            self._post(ref, [event])
        return event
