"""kopf handlers: thin. Each unpacks kwargs, parses the spec, calls the reconcile services,
writes status, posts events, and maps domain errors to kopf's retry errors."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from cachewarm import conditions
from cachewarm import constants as c
from cachewarm.builders.injection import INJECTED_ANNOTATION, inject_pod
from cachewarm.clients import kube
from cachewarm.clients.gcs import GcsError
from cachewarm.conditions import Cond
from cachewarm.injections import RecentInjections
from cachewarm.model import CacheSpec, InvalidSpec, parse_spec
from cachewarm.reconcile import BucketOutcome, Event, delete_cache_data, reconcile_bucket
from cachewarm.settings import Settings
from cachewarm.warmups import ACTIVE_STATES, WAIT_GATE, WarmupOutcome, reconcile_warmup, release_waiting_pods

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
MAX_BACKOFF = 600.0
WEBHOOK_ID = "inject-cache"
log = logging.getLogger("cachewarm.handlers")


def backoff(settings: Settings, retry: int) -> float:
    """Delay before retry number `retry`: doubles from retry_delay_seconds up to 10 minutes."""
    return float(min(settings.retry_delay_seconds * (2 ** min(retry, 16)), MAX_BACKOFF))


def _post(body: kopf.Body, events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        log.info(event.message, extra={"k8s_ref": {"kind": c.KIND, "namespace": body.get("metadata", {}).get(
            "namespace"), "name": body.get("metadata", {}).get("name")}})


@dataclasses.dataclass
class Observed:
    """What one reconcile found; turned into status in one place."""

    bucket: BucketOutcome
    warmup: WarmupOutcome | None = None
    warm_condition: Cond | None = None
    waiting_pods: int | None = None


def _write_status(patch: kopf.Patch, status: Mapping[str, Any], generation: int, seen: Observed,
                  injection: dict[str, Any], has_warmup: bool) -> None:
    bucket = seen.bucket
    ready = Cond(
        c.Condition.READY, bucket.condition.status,
        c.Reason.RECONCILED if bucket.ready else c.Reason.BUCKET_NOT_READY,
        "The cache is ready for warmers and training pods" if bucket.ready else bucket.condition.message,
    )
    updates = [bucket.condition, ready]
    if seen.warm_condition is not None:
        updates.append(seen.warm_condition)
    existing = [cd for cd in status.get("conditions") or [] if has_warmup or cd.get("type") != c.Condition.WARMED]
    patch.status["conditions"] = conditions.merge(existing, updates, generation=generation,
                                                  now=dt.datetime.now(dt.timezone.utc))
    patch.status["observedGeneration"] = generation
    if bucket.status:
        patch.status["bucket"] = bucket.status
    if bucket.cache is not None:
        patch.status["cache"] = bucket.cache
    if seen.warmup is not None:
        patch.status["warmup"] = {"pools": seen.warmup.pools}
    elif not has_warmup and status.get("warmup") is not None:
        patch.status["warmup"] = None
    if seen.waiting_pods is not None:
        injection["waitingPods"] = seen.waiting_pods
    patch.status["injection"] = injection


def reconcile(
    *, settings: Settings, memo: Any, body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta,
    status: kopf.Status, patch: kopf.Patch, namespace: str, name: str, retry: int, raise_on_error: bool,
    claims: kopf.Index[Any, Any] | None = None,
) -> None:
    """Shared by create, update, resume and both timers: bucket, then warmers, then pods
    waiting for the cache; status written once at the end."""
    generation = int(meta.get("generation") or 0)
    now = dt.datetime.now(dt.timezone.utc)
    injection = memo.injections.summary(namespace, name, now)
    try:
        cache = parse_spec(spec)
    except InvalidSpec as exc:
        seen = Observed(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, "InvalidSpec", str(exc))))
        _write_status(patch, status, generation, seen, injection, has_warmup=False)
        raise kopf.PermanentError(str(exc)) from exc
    events: list[Event] = []
    failure: Exception | None = None
    owner = prefix_owner(claims, cache, str(meta.get("creationTimestamp") or ""), namespace, name)
    if owner is not None:
        message = (f"{cache.storage.gcs.url} is already the cache of {owner[0]}/{owner[1]}; "
                   "give this CompilationCache its own bucket or prefix")
        seen = Observed(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, "PrefixInUse", message)))
        previous = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY)
        if previous is None or previous.get("reason") != "PrefixInUse":
            events.append(Event("Warning", "PrefixInUse", message))
        _write_status(patch, status, generation, seen, injection, has_warmup=False)
        _post(body, events)
        return
    try:
        seen = Observed(reconcile_bucket(
            memo.gcs, cache.storage.gcs, namespace=namespace, name=name,
            spec_changed=status.get("observedGeneration") != generation,
        ))
        events += seen.bucket.events
    except GcsError as exc:
        seen = Observed(BucketOutcome(Cond(c.Condition.BUCKET_READY, False, exc.reason, f"{exc}; retrying")))
        previous = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY)
        if previous is None or previous.get("reason") != exc.reason:
            events.append(Event("Warning", exc.reason, str(exc)))
        failure = exc
    try:
        _reconcile_warm(settings, cache, seen, events, status=status, meta=meta, namespace=namespace,
                        name=name, uid=str(meta.get("uid") or ""), now=now)
    except kube.KubeError as exc:
        events.append(Event("Warning", "KubernetesError", str(exc)))
        failure = failure or exc
    _write_status(patch, status, generation, seen, injection, has_warmup=cache.warmup is not None)
    _post(body, events)
    if failure is not None and raise_on_error:
        raise kopf.TemporaryError(str(failure), delay=backoff(settings, retry)) from failure


def prefix_owner(claims: kopf.Index[Any, Any] | None, cache: CacheSpec, created: str, namespace: str,
                 name: str) -> tuple[str, str] | None:
    """The (namespace, name) of an older cache on the same bucket+prefix, if any; the
    oldest claim wins (ties broken by namespace/name), so exactly one cache manages it."""
    if claims is None:
        return None
    gcs = cache.storage.gcs
    mine = (created, namespace, name)
    others = [tuple(v) for v in claims.get((gcs.bucket, gcs.prefix), []) if tuple(v) != mine]
    older = sorted(o for o in others if o < mine)
    return (older[0][1], older[0][2]) if older else None


def _reconcile_warm(settings: Settings, cache: CacheSpec, seen: Observed, events: list[Event], *,
                    status: Mapping[str, Any], meta: Mapping[str, Any], namespace: str, name: str, uid: str,
                    now: dt.datetime) -> None:
    if cache.warmup is not None:
        if seen.bucket.ready:
            seen.warmup = reconcile_warmup(
                cache, namespace=namespace, name=name, uid=uid, annotations=meta.get("annotations") or {},
                previous=(status.get("warmup") or {}).get("pools") or [],
                cache_entries=(seen.bucket.cache or {}).get("entries", 0),
                warmer_image=settings.warmer_image, now=now,
            )
            seen.warm_condition = seen.warmup.condition
            events += seen.warmup.events
        else:
            seen.warm_condition = Cond(c.Condition.WARMED, False, c.Reason.BUCKET_NOT_READY,
                                       "Warmers wait for the bucket to be ready")
    if cache.injection.wait_for_warm.enabled:
        warmed = cache.warmup is None or bool(seen.warm_condition and seen.warm_condition.status)
        seen.waiting_pods, released = release_waiting_pods(cache, namespace=namespace, name=name,
                                                           warmed=warmed, now=now)
        events += released


def needs_poll(spec: Mapping[str, Any], status: Mapping[str, Any], generation: int) -> bool:
    """Whether the fast timer has work: warmers running, or pods that may be waiting."""
    if status.get("observedGeneration") != generation:
        return True
    pools = (status.get("warmup") or {}).get("pools")
    if spec.get("warmup") and (not pools or any(p.get("state") in ACTIVE_STATES for p in pools)):
        return True
    wait = ((spec.get("injection") or {}).get("waitForWarm") or {}).get("enabled")
    warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
    return bool(wait) and (warmed is None or warmed.get("status") != "True"
                           or bool((status.get("injection") or {}).get("waitingPods")))


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Register every handler of the operator into `registry`."""

    def on_change(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch,
        namespace: str | None, name: str, retry: int, memo: Any, **kwargs: Any,
    ) -> None:
        reconcile(settings=settings, memo=memo, body=body, spec=spec, meta=meta, status=status, patch=patch,
                  namespace=namespace or "", name=name, retry=retry, raise_on_error=True,
                  claims=kwargs.get("claims"))

    def on_timer(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch,
        namespace: str | None, name: str, memo: Any, **kwargs: Any,
    ) -> None:
        # Errors are written to status; the next tick retries, so no kopf backoff here.
        reconcile(settings=settings, memo=memo, body=body, spec=spec, meta=meta, status=status, patch=patch,
                  namespace=namespace or "", name=name, retry=0, raise_on_error=False,
                  claims=kwargs.get("claims"))

    def on_poll(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch,
        namespace: str | None, name: str, memo: Any, **kwargs: Any,
    ) -> None:
        if needs_poll(spec, status, int(meta.get("generation") or 0)):
            on_timer(body=body, spec=spec, meta=meta, status=status, patch=patch, namespace=namespace,
                     name=name, memo=memo, **kwargs)

    def on_delete(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, namespace: str | None, name: str, retry: int,
        memo: Any, **kwargs: Any,
    ) -> None:
        cache = parse_spec(spec)
        gcs = cache.storage.gcs
        mine = (str(meta.get("creationTimestamp") or ""), namespace, name)
        sharing = [tuple(v) for v in kwargs["claims"].get((gcs.bucket, gcs.prefix), []) if tuple(v) != mine]
        if sharing:
            _post(body, [Event("Normal", c.Reason.DATA_RETAINED,
                               f"Kept the data under {gcs.url}: CompilationCache {sharing[0][1]}/{sharing[0][2]} "
                               "uses the same prefix")])
            return
        try:
            events = delete_cache_data(memo.gcs, cache.storage.gcs, namespace=namespace or "", name=name)
        except GcsError as exc:
            kopf.event(body, type="Warning", reason=exc.reason, message=f"Could not delete cache data: {exc}")
            raise kopf.TemporaryError(str(exc), delay=backoff(settings, retry)) from exc
        _post(body, events)

    def caches(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status,
               uid: str | None, **_: Any) -> Any:
        # In-memory index for the webhook: no API call on the pod-admission path.
        warmed = conditions.get(status.get("conditions"), c.Condition.WARMED)
        return {(namespace, name): {"spec": dict(spec), "generation": int(meta.get("generation") or 0), "uid": uid,
                                    "warmed": bool(warmed and warmed.get("status") == "True")}}

    async def inject(
        body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: Any, dryrun: bool, **kwargs: Any,
    ) -> None:
        try:
            admit_pod(body, patch, warnings, kwargs["caches"], memo.injections, dryrun=dryrun)
        except Exception as exc:  # noqa: BLE001 - a pod is never refused on our account
            warnings.append(f"cachewarm could not inject this pod ({type(exc).__name__}: {exc}); admitted unchanged")
            patch.clear()

    kopf.on.resume(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.create(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.update(*RESOURCE, id="reconcile", field="spec", registry=registry)(on_change)
    # cachewarm.dev/rewarm (and other annotation changes) re-run the reconcile.
    kopf.on.update(*RESOURCE, id="reconcile-annotations", field="metadata.annotations", registry=registry)(on_change)
    # A finalizer only where deletion has work to do: deletionPolicy Delete.
    kopf.on.delete(*RESOURCE, id="delete-data", field="spec.storage.gcs.deletionPolicy", value="Delete",
                   registry=registry)(on_delete)
    def claims(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> Any:
        # Which caches use which bucket+prefix: two caches on one prefix would fight over
        # its lifecycle rule and, with deletionPolicy Delete, delete each other's entries.
        gcs = ((spec.get("storage") or {}).get("gcs") or {})
        return {(gcs.get("bucket"), gcs.get("prefix", "")): (str(meta.get("creationTimestamp") or ""), namespace, name)}

    kopf.index(*RESOURCE, id="caches", registry=registry)(caches)
    kopf.index(*RESOURCE, id="claims", registry=registry)(claims)
    if settings.webhook_enabled:
        kopf.on.mutate("", "v1", "pods", id=WEBHOOK_ID, operation="CREATE",
                       labels={c.CACHE_LABEL: kopf.PRESENT}, registry=registry)(inject)
    kopf.timer(*RESOURCE, id="resync", interval=settings.resync_seconds, initial_delay=settings.resync_seconds,
               registry=registry)(on_timer)
    kopf.timer(*RESOURCE, id="poll", interval=settings.warm_poll_seconds, initial_delay=settings.warm_poll_seconds,
               registry=registry)(on_poll)
    _timers_without_finalizer(registry)


def admit_pod(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], caches: kopf.Index[Any, Any],
    injections: RecentInjections, *, dryrun: bool,
) -> None:
    """Add the named cache's env to a pod being created, or say in a warning why not."""
    meta = body.get("metadata") or {}
    namespace = str(meta.get("namespace") or "")
    cache_name = str((meta.get("labels") or {}).get(c.CACHE_LABEL) or "")
    pod_name = meta.get("name") or f"{meta.get('generateName', '')}<generated>"
    entry = next(iter(caches.get((namespace, cache_name), [])), None)
    log.info("Admitted pod %s", "with the cache" if entry else "without the cache",
             extra={"k8s_ref": {"kind": "Pod", "namespace": namespace, "name": pod_name}, "cache": cache_name})
    if entry is None:
        warnings.append(
            f"cachewarm: no CompilationCache {cache_name!r} in namespace {namespace!r} "
            f"(label {c.CACHE_LABEL}); pod admitted without the cache"
        )
        return
    cache = parse_spec(entry["spec"])
    result = inject_pod(body, cache_name, entry["generation"], cache)
    if result.changed:
        patch.spec["containers"] = result.containers
        if result.init_containers is not None:
            patch.spec["initContainers"] = result.init_containers
        patch.metadata.setdefault("annotations", {})[INJECTED_ANNOTATION] = result.annotation
    gates = list((body.get("spec") or {}).get("schedulingGates") or [])
    if cache.injection.wait_for_warm.enabled and not entry["warmed"] and cache.warmup is not None:
        if not any(g.get("name") == WAIT_GATE for g in gates):
            patch.spec["schedulingGates"] = [*gates, {"name": WAIT_GATE}]
    for kept in result.kept:
        warnings.append(
            f"cachewarm: container {kept.container!r} keeps its own {kept.name}; "
            f"the value from CompilationCache {cache_name!r} was not applied to it"
        )
    if dryrun:
        return
    ref = {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
           "metadata": {"name": cache_name, "namespace": namespace, "uid": entry["uid"]}}
    if result.kept:
        names = ", ".join(sorted({f"{k.container}/{k.name}" for k in result.kept}))
        _post_in_background(ref, "Warning", c.Reason.ENV_KEPT, f"Pod {pod_name} kept its own {names}")
    if result.changed:
        injections.record(namespace, cache_name, dt.datetime.now(dt.timezone.utc))


_background: set[asyncio.Future[None]] = set()


def _post_in_background(ref: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Post an Event without holding up the admission response (kopf's event queue is
    not reachable from the webhook path)."""

    def post() -> None:
        try:
            kube.post_event(ref, type=type_, reason=reason, message=message, now=dt.datetime.now(dt.timezone.utc))
        except kube.KubeError as exc:
            log.warning("Could not post event %s: %s", reason, exc)

    future = asyncio.get_running_loop().run_in_executor(None, post)
    _background.add(future)
    future.add_done_callback(_background.discard)


def _timers_without_finalizer(registry: kopf.OperatorRegistry) -> None:
    """kopf marks every timer as needing a finalizer (to stop it cleanly on deletion). Our
    timers have no deletion work, and a finalizer on every cache would block `kubectl
    delete` whenever the operator is down; kopf stops timers on the DELETED event anyway.
    kopf exposes no option for this, so the flag is cleared after registration
    (tests/e2e check that a Retain cache gets no finalizer)."""
    spawning = registry._spawning  # noqa: SLF001 - no public API for this flag
    spawning._handlers = [  # noqa: SLF001
        dataclasses.replace(h, requires_finalizer=False) for h in spawning._handlers  # noqa: SLF001
    ]


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf state in status (not annotations), our finalizer name, events for warnings."""
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field=c.KOPF_STATUS_PROGRESS)
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field=c.KOPF_STATUS_DIFFBASE)
    settings.persistence.finalizer = c.FINALIZER
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "cachewarm"  # the "From" column of kubectl describe
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
