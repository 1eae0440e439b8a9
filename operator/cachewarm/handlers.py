"""kopf handlers: thin. Each unpacks kwargs, calls one function of cachewarm.service,
writes what it returns into kopf's patch, posts its events, and maps its errors to
kopf's retry errors. The indexes here keep the webhook free of API calls."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as dt
import logging
import threading
from typing import Any

import kopf

from cachewarm import conditions, service
from cachewarm import constants as c
from cachewarm.clients import kube
from cachewarm.clients.gcs import GcsError
from cachewarm.model import InvalidSpec
from cachewarm.reconcile import Event
from cachewarm.settings import Settings

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
MAX_BACKOFF = 600.0
WEBHOOK_ID = "inject-cache"
log = logging.getLogger("cachewarm.handlers")


def backoff(settings: Settings, retry: int) -> float:
    """Delay before retry number `retry`: doubles from retry_delay_seconds up to 10 minutes."""
    return float(min(settings.retry_delay_seconds * (2 ** min(retry, 16)), MAX_BACKOFF))


def _post(body: kopf.Body, events: list[Event]) -> None:
    meta = body.get("metadata") or {}
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        log.info(event.message, extra={"k8s_ref": {"kind": c.KIND, "namespace": meta.get("namespace"),
                                                   "name": meta.get("name")}})


def _claims(index: kopf.Index[Any, Any] | None) -> service.ClaimLookup:
    return lambda bucket: list(index.get(bucket, [])) if index is not None else []


def snapshot(body: kopf.Body) -> kopf.Body:
    """A private copy of the body kopf handed a handler. kopf gives sync handlers (run in
    threads) a live body, which the event loop moves to each newer version of the object
    while the handler runs; read from it, metadata.generation and spec could come from
    different versions and defeat the generation guard. Copied once, at handler entry: the
    loop swaps in each version whole (it never edits one in place), so the deep copy holds
    exactly one."""
    return copy.deepcopy(body)


def reconcile(body: kopf.Body, patch: kopf.Patch, *, namespace: str, name: str, memo: Any,
              claims: kopf.Index[Any, Any] | None, warmer_image: str, instance: str = c.DEFAULT_INSTANCE,
              only_if_needed: bool = False) -> service.Outcome | None:
    """One reconcile of the cache, spec, meta and status all read from one snapshot of
    `body`; with `only_if_needed`, none (None) unless service.needs_poll says there is work.
    Raises kopf.PermanentError for a spec that cannot be acted on."""
    frozen = snapshot(body)
    spec, meta, status = frozen.spec, frozen.meta, frozen.status
    if only_if_needed and not service.needs_poll(spec, status, int(meta.get("generation") or 0)):
        return None
    with memo.locks.of(namespace, name):
        outcome = service.reconcile_cache(
            gcs=memo.gcs, warmer_image=warmer_image, injections=memo.injections, spec=spec, meta=meta,
            status=status, namespace=namespace, name=name, claims=_claims(claims),
            now=dt.datetime.now(dt.timezone.utc), instance=instance,
        )
    for key, value in outcome.status.items():
        patch.status[key] = value
    _post(frozen, outcome.events)
    if outcome.invalid is not None:
        raise kopf.PermanentError(outcome.invalid)
    return outcome


class CacheLocks:
    """One lock per CompilationCache. kopf runs an object's timers and change handlers
    concurrently (sync handlers in threads); two reconciles of one cache at once could
    each decide the pool has no warmer and start one. Held for a whole reconcile."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def of(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Register every handler of the operator into `registry`."""

    def init_memo(memo: Any, **_: Any) -> None:
        # Before any per-object memo is copied from the global one, so all share it.
        memo.locks = CacheLocks()

    def on_change(body: kopf.Body, patch: kopf.Patch, namespace: str | None, name: str, retry: int, memo: Any,
                  **kwargs: Any) -> None:
        outcome = reconcile(body, patch, namespace=namespace or "", name=name, memo=memo,
                            claims=kwargs.get("claims"), warmer_image=settings.warmer_image, instance=settings.instance)
        if outcome is not None and outcome.failure is not None:
            raise kopf.TemporaryError(str(outcome.failure), delay=backoff(settings, retry)) from outcome.failure

    def on_timer(body: kopf.Body, patch: kopf.Patch, namespace: str | None, name: str, memo: Any,
                 **kwargs: Any) -> None:
        # Errors are already in status; the next tick retries, so no kopf backoff here.
        reconcile(body, patch, namespace=namespace or "", name=name, memo=memo, claims=kwargs.get("claims"),
                  warmer_image=settings.warmer_image, instance=settings.instance)

    def on_poll(body: kopf.Body, patch: kopf.Patch, namespace: str | None, name: str, memo: Any,
                **kwargs: Any) -> None:
        reconcile(body, patch, namespace=namespace or "", name=name, memo=memo, claims=kwargs.get("claims"),
                  warmer_image=settings.warmer_image, instance=settings.instance, only_if_needed=True)

    def on_delete(body: kopf.Body, namespace: str | None, name: str, retry: int, memo: Any, **kwargs: Any) -> None:
        body = snapshot(body)
        try:
            events = service.delete_cache(memo.gcs, body.spec, body.meta, namespace=namespace or "", name=name,
                                          claims=_claims(kwargs.get("claims")), instance=settings.instance)
        except InvalidSpec as exc:
            raise kopf.PermanentError(str(exc)) from exc
        except GcsError as exc:
            kopf.event(body, type="Warning", reason=exc.reason, message=f"Could not delete cache data: {exc}")
            raise kopf.TemporaryError(str(exc), delay=backoff(settings, retry)) from exc
        _post(body, events)

    def on_event(body: kopf.Body, namespace: str | None, name: str, **kwargs: Any) -> None:
        # A deleted cache (with or without our finalizer) releases the pods held for it. An
        # event handler sees DELETED without a finalizer; kopf's optional on.delete does not
        # run for an object that had none.
        if kwargs.get("type") != "DELETED":
            return
        try:
            events = service.release_pods_of_deleted_cache(namespace=namespace or "", name=name,
                                                           now=dt.datetime.now(dt.timezone.utc))
        except kube.KubeError as exc:
            log.warning("Could not release the pods of deleted cache %s/%s: %s", namespace, name, exc)
            return
        _post(body, events)

    def on_pod_event(body: kopf.Body, **kwargs: Any) -> None:
        # Every labelled pod, at startup and on each change: one held for a cache that no
        # longer exists is released (what the cache's own DELETED event may have missed).
        if kwargs.get("type") == "DELETED":
            return
        index = kwargs["caches"]
        try:
            event = service.release_orphaned_pod(body, lambda ns, n: next(iter(index.get((ns, n), [])), None))
        except kube.KubeError as exc:
            log.warning("Could not release pod %s/%s: %s", body.meta.get("namespace"), body.meta.get("name"), exc)
            return
        if event is not None:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
            log.info(event.message, extra={"k8s_ref": {"kind": "Pod", "namespace": body.meta.get("namespace"),
                                                       "name": body.meta.get("name")}})

    def caches(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status,
               uid: str | None, **_: Any) -> Any:
        # Parsed here, once per change of the cache, not once per admitted pod.
        bucket = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY) or {}
        return {(namespace, name): service.index_entry(spec, generation=int(meta.get("generation") or 0), uid=uid,
                                                       warmed=service.was_warmed(status),
                                                       refused=bucket.get("reason") in service.REFUSED)}

    def claims(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> Any:
        # Which caches use which bucket: they share its lifecycle rules and soft delete, and
        # a cache whose prefix overlaps an older one's must not manage it.
        claim = service.claim_of(spec, meta, namespace or "", name)
        return {} if claim is None else {(spec.get("storage") or {}).get("gcs", {}).get("bucket"): claim}

    async def inject(body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: Any, dryrun: bool,
                     **kwargs: Any) -> None:
        index = kwargs["caches"]
        meta = body.get("metadata") or {}
        try:
            answer = service.admit_pod(body, lambda ns, n: next(iter(index.get((ns, n), [])), None))
        except Exception as exc:  # noqa: BLE001 - a pod is never refused on our account
            warnings.append(f"cachewarm could not inject this pod ({type(exc).__name__}: {exc}); admitted unchanged")
            return
        log.info("Admitted pod %s", "with the cache" if answer.injected else "unchanged",
                 extra={"k8s_ref": {"kind": "Pod", "namespace": meta.get("namespace"),
                                    "name": meta.get("name") or meta.get("generateName")},
                        "cache": (meta.get("labels") or {}).get(c.CACHE_LABEL)})
        for key, value in answer.spec.items():
            patch.spec[key] = value
        if answer.annotations:
            patch.metadata.setdefault("annotations", {}).update(answer.annotations)
        warnings.extend(answer.warnings)
        if dryrun:
            return
        if answer.event is not None:
            _post_in_background(*answer.event)
        if answer.injected:
            memo.injections.record(str(meta.get("namespace") or ""), str(meta["labels"][c.CACHE_LABEL]),
                                   dt.datetime.now(dt.timezone.utc))

    kopf.on.startup(registry=registry)(init_memo)
    kopf.on.resume(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.create(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.update(*RESOURCE, id="reconcile", field="spec", registry=registry)(on_change)
    # cachewarm.dev/rewarm (and other annotation changes) re-run the reconcile.
    kopf.on.update(*RESOURCE, id="reconcile-annotations", field="metadata.annotations", registry=registry)(on_change)
    # A finalizer only where deletion has work to do: deletionPolicy Delete.
    kopf.on.delete(*RESOURCE, id="delete-data", field="spec.storage.gcs.deletionPolicy", value="Delete",
                   registry=registry)(on_delete)
    kopf.on.event(*RESOURCE, id="release-on-delete", registry=registry)(on_event)
    kopf.on.event("", "v1", "pods", id="release-orphans", labels={c.CACHE_LABEL: kopf.PRESENT},
                  registry=registry)(on_pod_event)
    # In-memory indexes: the webhook answers without API calls.
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


_background: set[asyncio.Future[None]] = set()


def _post_in_background(ref: dict[str, Any], event: Event) -> None:
    """Post an Event without holding up the admission response (kopf's event queue is
    not reachable from the webhook path)."""

    def post() -> None:
        try:
            kube.post_event(ref, type=event.type, reason=event.reason, message=event.message,
                            now=dt.datetime.now(dt.timezone.utc))
        except kube.KubeError as exc:
            log.warning("Could not post event %s: %s", event.reason, exc)

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
    # Pods are watched only for the release of held ones: the apiserver sends labelled pods
    # only, never every pod of the cluster.
    settings.watching.label_selectors["", "pods"] = c.CACHE_LABEL
