"""kopf handlers: thin, at module level, wired by `register`.

Every replica of the operator runs all of them: it watches CompilationCaches (handing each
event to the controller, which reconciles on the leader only, and keeping the webhook's
index), watches labelled pods (counting injected ones, and, on the leader, releasing one
held for a cache that does not exist), and serves the admission webhook from its index
without API calls. No kopf change handler, timer or finalizer is used: reconciling is
cachewarm.runtime.controller's, so kopf keeps no state on the caches.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any

import kopf

from cachewarm.api import conditions, timefmt
from cachewarm.admission import admit
from cachewarm.reconcile.pods import REFUSED
from cachewarm.reconcile.status import was_warmed
from cachewarm.reconcile import warmup as warmups
from cachewarm.api import constants as c
from cachewarm.builders.reporting import Reporting

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
WEBHOOK_ID = "inject-cache"
log = logging.getLogger("cachewarm.handlers")


async def on_cache_event(body: kopf.Body, memo: Any, **kwargs: Any) -> None:
    """Every watch event of a cache (on the event loop: no thread hop, no await)."""
    memo.controller.observe(kwargs.get("type"), body)


async def on_pod_event(body: kopf.Body, memo: Any, caches: kopf.Index[Any, Any], **kwargs: Any) -> None:
    """Every labelled pod, at startup and on each change: counted if the webhook injected
    it; released (leader only) if it is held for a cache that does not exist. Kept in
    memo.pods too: a report counts only for the cache its pod is labelled for; and whether
    the webhook noted it as opted out of tokens (status.reports.podsOptedOut)."""
    if "pods" in memo:
        memo.pods.observe(kwargs.get("type"), body)
    memo.injections.observe_pod(kwargs.get("type"), body)
    if kwargs.get("type") == "DELETED":
        return
    meta = body.get("metadata") or {}
    if c.INJECTED_ANNOTATION in (meta.get("annotations") or {}) and meta.get("creationTimestamp"):
        created = timefmt.parse(meta["creationTimestamp"])
        memo.injections.record(str(meta.get("namespace") or ""), str((meta.get("labels") or {}).get(c.CACHE_LABEL)),
                               str(meta.get("uid") or meta.get("name")), created)
    if not memo.controller.leader.is_leader:
        return
    gates = [g.get("name") for g in (body.get("spec") or {}).get("schedulingGates") or []]
    if c.WAIT_GATE not in gates:
        return
    pod = copy.deepcopy(dict(body))
    await asyncio.to_thread(memo.controller.release_if_orphaned, pod,
                            lambda ns, n: next(iter(caches.get((ns, n), [])), None))


def index_caches(namespace: str | None, name: str, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status,
                 uid: str | None, **_: Any) -> Any:
    """The webhook's view of each cache, parsed once per change of the cache, not once
    per admitted pod."""
    bucket = conditions.get(status.get("conditions"), c.Condition.BUCKET_READY) or {}
    pools = (status.get("warmup") or {}).get("pools") or []
    configmaps = (status.get("injection") or {}).get("configMaps") or {}
    return {(namespace, name): admit.index_entry(spec, generation=int(meta.get("generation") or 0), uid=uid,
                                                   warmed=was_warmed(status),
                                                   refused=bucket.get("reason") in REFUSED,
                                                   image_pythonpath=warmups.image_pythonpath(
                                                       pools, str((spec.get("warmup") or {}).get("image") or "")),
                                                   manifests=warmups.recorded_manifests(pools),
                                                   env_configmap=_name(configmaps.get("env")),
                                                   boot_configmap=_name(configmaps.get("boot")),
                                                   cache_bytes=_bytes((status.get("cache") or {}).get("bytes")))}


def _bytes(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


async def inject(body: kopf.Body, patch: kopf.Patch, warnings: list[str], dryrun: bool,
                 caches: kopf.Index[Any, Any], memo: Any, **_: Any) -> None:
    """The mutating webhook: the cache's env (and wait-for-warm gate) into a labelled pod."""
    meta = body.get("metadata") or {}
    started = time.perf_counter()
    try:
        settings = memo.get("settings")
        answer = admit.admit_pod(body, lambda ns, n: next(iter(caches.get((ns, n), [])), None),
                                 _reporting(memo), settings.warmer_image if settings is not None else None)
    except Exception as exc:  # noqa: BLE001 - a pod is never refused on our account
        warnings.append(f"cachewarm could not inject this pod ({type(exc).__name__}: {exc}); admitted unchanged")
        _count_admission(memo, "error", started)
        return
    log.info("Admitted pod %s", "with the cache" if answer.injected else "unchanged",
             extra={"k8s_ref": {"kind": "Pod", "namespace": meta.get("namespace"),
                                "name": meta.get("name") or meta.get("generateName")},
                    "cache": (meta.get("labels") or {}).get(c.CACHE_LABEL)})
    for key, value in answer.spec.items():
        patch.spec[key] = value
    if answer.annotations:
        patch.metadata.setdefault("annotations", {}).update(answer.annotations)
    warnings.extend(answer.warnings)  # admission writes nothing (no Event): sideEffects None
    _count_admission(memo, "injected" if answer.injected else "unchanged", started)


def _reporting(memo: Any) -> Reporting | None:
    """Where pods report and the CA they trust: the certificate this replica serves (all
    replicas serve one CA). None while no real certificate is served (a stand-in's CA
    would not be trusted for long): pods then get no reporter."""
    keeper, settings = memo.get("keeper"), memo.get("settings")
    material = keeper.tls.material if keeper is not None and keeper.authoritative else None
    if settings is None or material is None or not material.ca_pem or not settings.report_url:
        return None
    return Reporting(image=settings.warmer_image, url=settings.report_url, ca_pem=material.ca_pem.decode())


def _count_admission(memo: Any, outcome: str, started: float) -> None:
    metrics = memo.get("metrics")
    if metrics is not None:
        metrics.admissions.labels(outcome).inc()
        metrics.admission_seconds.labels(outcome).observe(time.perf_counter() - started)


def register(registry: kopf.OperatorRegistry, *, webhook: bool) -> None:
    """Wire the handlers above into `registry` (the webhook only when it is served)."""
    kopf.on.event(*RESOURCE, id="observe", registry=registry)(on_cache_event)
    kopf.on.event("", "v1", "pods", id="labelled-pods", labels={c.CACHE_LABEL: kopf.PRESENT},
                  registry=registry)(on_pod_event)  # type: ignore[arg-type]  # `caches`: an index kwarg
    kopf.index(*RESOURCE, id="caches", registry=registry)(index_caches)
    if webhook:
        kopf.on.mutate("", "v1", "pods", id=WEBHOOK_ID, operation="CREATE",
                       labels={c.CACHE_LABEL: kopf.PRESENT}, registry=registry)(inject)  # type: ignore[arg-type]


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """Events from kopf's own warnings, named cachewarm; watch timeouts; pods by label."""
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "cachewarm"  # the "From" column of kubectl describe
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Pods are watched only for the release of held ones and the injection count: the
    # apiserver sends labelled pods only, never every pod of the cluster.
    settings.watching.label_selectors["", "pods"] = c.CACHE_LABEL
    # ConfigMaps are not watched: a watch (even by label) lists every labelled one at start,
    # which anyone with ConfigMap write can make in any number. The cache's own are checked
    # by name at every reconcile (resync) instead.
