"""kopf handlers: thin. Each unpacks kwargs, parses the spec, calls one reconcile function,
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
from cachewarm.clients.gcs import GcsClient, GcsError
from cachewarm.clients import kube
from cachewarm.builders.injection import INJECTED_ANNOTATION, inject_pod
from cachewarm.conditions import Cond
from cachewarm.injections import RecentInjections
from cachewarm.model import InvalidSpec, parse_spec
from cachewarm.reconcile import BucketOutcome, Event, delete_cache_data, reconcile_bucket
from cachewarm.settings import Settings

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
MAX_BACKOFF = 600.0


def backoff(settings: Settings, retry: int) -> float:
    """Delay before retry number `retry`: doubles from retry_delay_seconds up to 10 minutes."""
    return float(min(settings.retry_delay_seconds * (2 ** min(retry, 16)), MAX_BACKOFF))


def _post(body: kopf.Body, events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _write_status(
    patch: kopf.Patch, status: Mapping[str, Any], generation: int, outcome: BucketOutcome
) -> None:
    ready = Cond(
        c.Condition.READY,
        outcome.condition.status,
        c.Reason.RECONCILED if outcome.ready else c.Reason.BUCKET_NOT_READY,
        "The cache is ready for warmers and training pods" if outcome.ready else outcome.condition.message,
    )
    patch.status["conditions"] = conditions.merge(
        status.get("conditions"), [outcome.condition, ready],
        generation=generation, now=dt.datetime.now(dt.timezone.utc),
    )
    patch.status["observedGeneration"] = generation
    if outcome.status:
        patch.status["bucket"] = outcome.status
    if outcome.cache is not None:
        patch.status["cache"] = outcome.cache


def reconcile(
    *, settings: Settings, gcs: GcsClient, body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta,
    status: kopf.Status, patch: kopf.Patch, namespace: str, name: str, retry: int, raise_on_error: bool,
    injections: RecentInjections,
) -> None:
    """Shared by create, update, resume and the resync timer."""
    generation = int(meta.get("generation") or 0)
    patch.status["injection"] = injections.summary(namespace, name, dt.datetime.now(dt.timezone.utc))
    try:
        cache = parse_spec(spec)
    except InvalidSpec as exc:
        outcome = BucketOutcome(Cond(c.Condition.BUCKET_READY, False, "InvalidSpec", str(exc)))
        _write_status(patch, status, generation, outcome)
        raise kopf.PermanentError(str(exc)) from exc
    try:
        outcome = reconcile_bucket(
            gcs, cache.storage.gcs, namespace=namespace, name=name,
            spec_changed=status.get("observedGeneration") != generation,
        )
    except GcsError as exc:
        outcome = BucketOutcome(Cond(c.Condition.BUCKET_READY, False, exc.reason, f"{exc}; retrying"))
        _write_status(patch, status, generation, outcome)
        previous = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY)
        if previous is None or previous.get("reason") != exc.reason:
            kopf.event(body, type="Warning", reason=exc.reason, message=str(exc))
        if raise_on_error:
            raise kopf.TemporaryError(str(exc), delay=backoff(settings, retry)) from exc
        return
    _write_status(patch, status, generation, outcome)
    _post(body, outcome.events)


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Register every handler of the operator into `registry`."""

    def on_change(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch,
        namespace: str | None, name: str, retry: int, memo: Any, **_: Any,
    ) -> None:
        reconcile(settings=settings, gcs=memo.gcs, body=body, spec=spec, meta=meta, status=status,
                  patch=patch, namespace=namespace or "", name=name, retry=retry, raise_on_error=True,
                  injections=memo.injections)

    def on_resync(
        body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch,
        namespace: str | None, name: str, memo: Any, **_: Any,
    ) -> None:
        # Errors are written to status; the next tick retries, so no kopf backoff here.
        reconcile(settings=settings, gcs=memo.gcs, body=body, spec=spec, meta=meta, status=status,
                  patch=patch, namespace=namespace or "", name=name, retry=0, raise_on_error=False,
                  injections=memo.injections)

    def on_delete(
        body: kopf.Body, spec: kopf.Spec, namespace: str | None, name: str, retry: int, memo: Any, **_: Any,
    ) -> None:
        cache = parse_spec(spec)
        try:
            events = delete_cache_data(memo.gcs, cache.storage.gcs, namespace=namespace or "", name=name)
        except GcsError as exc:
            kopf.event(body, type="Warning", reason=exc.reason, message=f"Could not delete cache data: {exc}")
            raise kopf.TemporaryError(str(exc), delay=backoff(settings, retry)) from exc
        _post(body, events)

    kopf.on.resume(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.create(*RESOURCE, id="reconcile", registry=registry)(on_change)
    kopf.on.update(*RESOURCE, id="reconcile", field="spec", registry=registry)(on_change)
    # A finalizer only where deletion has work to do: deletionPolicy Delete.
    kopf.on.delete(*RESOURCE, id="delete-data", field="spec.storage.gcs.deletionPolicy", value="Delete",
                   registry=registry)(on_delete)
    def caches(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, uid: str | None, **_: Any) -> Any:
        # In-memory index for the webhook: no API call on the pod-admission path.
        return {(namespace, name): {"spec": dict(spec), "generation": int(meta.get("generation") or 0), "uid": uid}}

    kopf.index(*RESOURCE, id="caches", registry=registry)(caches)

    async def inject(
        body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: Any, dryrun: bool, **kwargs: Any,
    ) -> None:
        try:
            admit_pod(body, patch, warnings, kwargs["caches"], memo.injections, dryrun=dryrun)
        except Exception as exc:  # noqa: BLE001 - a pod is never refused on our account
            warnings.append(f"cachewarm could not inject this pod ({type(exc).__name__}: {exc}); admitted unchanged")
            patch.clear()

    if settings.webhook_enabled:
        kopf.on.mutate("", "v1", "pods", id=WEBHOOK_ID, operation="CREATE",
                       labels={c.CACHE_LABEL: kopf.PRESENT}, registry=registry)(inject)

    kopf.timer(*RESOURCE, id="resync", interval=settings.resync_seconds, initial_delay=settings.resync_seconds,
               idle=None, registry=registry)(on_resync)
    _timers_without_finalizer(registry)


WEBHOOK_ID = "inject-cache"


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
    log = logging.getLogger("cachewarm.webhook")

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
    resync timer has no deletion work, and a finalizer on every cache would block
    `kubectl delete` whenever the operator is down; kopf stops timers on the DELETED
    event anyway. kopf exposes no option for this, so the flag is cleared after
    registration (tests/e2e check that a Retain cache gets no finalizer)."""
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
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
