"""Reconcile a cache's warmers: one Job per pool for the current program, its result read
back from the pod's termination message, and pods waiting for the cache released.

observe → plan → apply (STYLE.md item 15): observe_warmers lists the cache's Jobs,
Services and the pods whose results are due into a WarmView; reconcile.warmplan decides,
without a client, what to write, each pool's status and the Events (plan_warmup); apply_plan
performs the writes in order. Every write is safe to repeat: names are deterministic and a
restart at any point plans again from what the cluster then holds.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api import timefmt
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec
from cachewarm.clients.kube import KubeClient
from cachewarm.reconcile.warmplan import (ACTIVE_STATES, BUCKET_VERDICTS, MANIFEST_OBJECT, Create, DeleteJob, DeleteService, WarmContext,
                                          observe,
                                          WarmPlan, WarmRetry, WarmView, image_pythonpath, last_slot,
                                          manifest_generation, missing_entries,
                                          next_scheduled_warm, next_slot, plan_warmup, results_to_read, rewarm_token,
                                          warmed_condition)

# What the rest of the operator imports from here (the decisions live in warmplan).
__all__ = ["ACTIVE_STATES", "BUCKET_VERDICTS", "WarmRetry", "WarmupOutcome", "apply_plan", "image_pythonpath",
           "last_slot", "recorded_manifests", "missing_entries", "next_scheduled_warm", "next_slot", "observe_warmers", "reconcile_warmup",
           "release_waiting_pods", "rewarm_token", "warmed_condition"]


@dataclass
class WarmupOutcome:
    condition: Cond
    pools: list[dict[str, Any]]
    events: list[Event] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return any(p.get("state") in ACTIVE_STATES for p in self.pools)


def recorded_manifests(pools: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Pool name -> `<object>#<generation>` of its manifest, from status.warmup.pools
    (manifestObject and manifestGeneration, those with both valid only; the webhook gives
    pods' copiers these and no other, after checking the object is one of the pool's)."""
    out: dict[str, str] = {}
    for pool in pools:
        generation = manifest_generation(pool.get("manifestGeneration"))
        obj = pool.get("manifestObject")
        if (generation is not None and isinstance(pool.get("name"), str) and isinstance(obj, str)
                and MANIFEST_OBJECT.fullmatch(obj)):
            out[pool["name"]] = f"{obj}#{generation}"
    return out


def observe_warmers(kube: KubeClient, ctx: WarmContext) -> WarmView:
    """The cache's warmer Jobs and pool Services, and the pods of the Jobs whose results
    the plan reads (which: warmplan.results_to_read, so a finished warm already in status
    lists no pods). Raises KubeError."""
    selector = f"{c.LABEL_WARMER_FOR}={ctx.name}"
    listed = kube.list_jobs(ctx.namespace, selector)
    services = kube.list_services(ctx.namespace, selector)
    pods = {job: kube.list_pods(ctx.namespace, f"{c.JOB_NAME_LABEL}={job}") for job in results_to_read(ctx, listed)}
    return WarmView(listed, services, pods)


def apply_plan(kube: KubeClient, namespace: str, plan: WarmPlan,
               previous: Sequence[Mapping[str, Any]] = ()) -> list[Event]:
    """Perform the plan's writes in order. Returns its Events, less a create's where the
    apiserver answered that the object exists. Raises KubeError: the writes before it are
    done, and the next reconcile plans from what they left. A Job whose create finds one of
    its name that the cache does not control (made without the warmer label, so never
    listed as the cache's) is named in the pool's message (squatted_job)."""
    events: list[Event] = []
    for step in plan.steps:
        if isinstance(step, Event):
            events.append(step)
        elif isinstance(step, DeleteJob):
            kube.delete_job(namespace, step.name, uid=step.uid or None)
        elif isinstance(step, DeleteService):
            kube.delete_service(namespace, step.name)
        elif isinstance(step, Create):
            created = kube.create(step.body)
            if created is not None:
                if step.said is not None:
                    events.append(step.said)
                if step.body.get("kind") == "Job":
                    _pin(plan.pools, created)
            elif step.body.get("kind") == "Job":
                events += squatted_job(kube, namespace, step.body, plan.pools, previous)
    return events


def _pin(pools: Sequence[dict[str, Any]], created: Mapping[str, Any]) -> None:
    """The uid the apiserver gave the Job the operator just created, in its pool's entry:
    a Job of that name with another uid is then never taken for it (warmplan.observe)."""
    meta = created.get("metadata") or {}
    for entry in pools:
        if entry.get("job") == meta.get("name") and meta.get("uid"):
            entry["jobUid"] = str(meta["uid"])


def squatted_job(kube: KubeClient, namespace: str, body: Mapping[str, Any],
                 pools: Sequence[dict[str, Any]], previous: Sequence[Mapping[str, Any]] = ()) -> list[Event]:
    """The warmer's create found a Job of its name. One the cache controls is its own
    (created before a restart): nothing to say. Any other holds the name without the
    cache's warmer label (a labelled one is a stray, stopped by the plan): it is not the
    operator's to delete, so the pool says whose move it is, and a Warning says it once."""
    name = body["metadata"]["name"]
    existing = kube.read_job(namespace, name)
    if existing is None:
        return []
    uid = next((r.get("uid") for r in body["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    if observe(existing, str(uid)).ours:
        return []
    message = (f"Job {name} exists and this cache is not its controller: the warmer cannot be created "
               f"until it is deleted (it lacks the {c.LABEL_WARMER_FOR} label, so the operator leaves it)")
    said: list[Event] = []
    for entry in pools:
        if entry.get("job") == name:
            if not any(p.get("name") == entry.get("name") and p.get("message") == message for p in previous):
                said.append(Event("Warning", c.Reason.WARMER_JOB_NOT_OURS, message))
            entry["message"] = message
    return said


def reconcile_warmup(
    kube: KubeClient, cache: CacheSpec, *, namespace: str, name: str, uid: str, annotations: Mapping[str, str],
    previous: Sequence[Mapping[str, Any]], cache_entries: int, warmer_image: str, now: dt.datetime,
    generation: int = 0, warmed_before: bool = False, entry_keys: frozenset[str] | None = None,
    retry: WarmRetry = WarmRetry(),
) -> WarmupOutcome:
    """Make sure each pool has run the warmer for the current program, one Job at a time
    per pool, and that multi-host pools have their Service while (and only while) a warmer
    needs it. `warmed_before`: Warmed was True at the previous reconcile (a re-warm, not a
    first warm). Raises KubeError."""
    ctx = WarmContext(cache, namespace, name, uid, now, warmer_image, generation, annotations, previous, retry,
                      cache_entries, warmed_before, entry_keys)
    plan = plan_warmup(ctx, observe_warmers(kube, ctx))
    return WarmupOutcome(plan.condition, plan.pools, apply_plan(kube, namespace, plan, previous))


def release_waiting_pods(kube: KubeClient, cache: CacheSpec | None, *, namespace: str, name: str, warmed: bool,
                         now: dt.datetime, why: str = "") -> tuple[int, list[Event]]:
    """Remove our scheduling gate from this cache's pods once it is Warmed or a pod has
    waited timeoutSeconds; with `why` (the cache was deleted, refused, or no longer waits
    for warm), from every one of its pods at once. Returns (pods still waiting, events).
    Raises KubeError."""
    if cache is None and not why:
        raise ValueError("a release without a readable spec needs a reason")
    timeout = dt.timedelta(seconds=cache.injection.wait_for_warm.timeout_seconds if cache else 0)
    waiting = 0
    events: list[Event] = []
    for pod in kube.list_pods(namespace, f"{c.CACHE_LABEL}={name}"):
        gates = [g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
        if c.WAIT_GATE not in gates:
            continue
        created = timefmt.parse(pod["metadata"]["creationTimestamp"])
        timed_out = now - created >= timeout
        if why or warmed or timed_out:
            kube.remove_scheduling_gate(namespace, pod["metadata"]["name"], gates.index(c.WAIT_GATE), c.WAIT_GATE)
            said = why or ("the cache is warm" if warmed else f"it waited {int(timeout.total_seconds())}s for the cache")
            events.append(Event("Normal" if why or warmed else "Warning", c.Reason.POD_RELEASED,
                                f"Released pod {pod['metadata']['name']}: {said}"))
        else:
            waiting += 1
    return waiting, events
