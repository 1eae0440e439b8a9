"""Training pods held by the wait-for-warm gate: when every pod of a cache is released
(refused, waitForWarm off, deleted), and the release of a pod whose cache is gone."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec
from cachewarm.clients.kube import KubeClient
from cachewarm.reconcile.status import Seen
from cachewarm.reconcile.warmup import release_waiting_pods

CacheLookup = Callable[[str, str], Mapping[str, Any] | None]  # (namespace, name) -> webhook index entry


# BucketReady reasons that refuse the cache until its spec (or another cache) changes:
# no warmer runs, so pods held for it would wait for nothing.
REFUSED = (c.Reason.PREFIX_IN_USE,)


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


def release_held_pods(kube: KubeClient, cache: CacheSpec, seen: Seen, status: Mapping[str, Any], events: list[Event],
                      *, namespace: str, name: str, now: dt.datetime) -> None:
    """The pods step of a reconcile: release every held pod when release_all_because says
    so, else (waitForWarm on) those of a warmed cache; count the ones still waiting into
    `seen`. Raises KubeError."""
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
