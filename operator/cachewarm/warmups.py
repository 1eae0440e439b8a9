"""Reconcile a cache's warmers: one Job per pool for the current program, its result read
back from the pod's termination message, and pods waiting for the cache released.

Everything is derived from observed Jobs and Pods plus the previous status, so a restart
of the operator at any point (even mid-warm) finds the same Job by its deterministic name
and creates nothing twice.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from croniter import croniter

from cachewarm import constants as c
from cachewarm.builders import job as jobs
from cachewarm.clients import kube
from cachewarm.conditions import Cond
from cachewarm.model import CacheSpec, Pool
from cachewarm.reconcile import Event

WAIT_GATE = c.WAIT_GATE
ACTIVE_STATES = ("Pending", "Running")


@dataclass
class WarmupOutcome:
    condition: Cond
    pools: list[dict[str, Any]]
    events: list[Event] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return any(p.get("state") in ACTIVE_STATES for p in self.pools)


def rewarm_token(cache: CacheSpec, annotations: Mapping[str, str], now: dt.datetime) -> str:
    """What forces a new warm for an unchanged program: the manual annotation and the most
    recent cron slot."""
    token = annotations.get(jobs.ANNOTATION_REWARM, "")
    if cache.warmup is not None and cache.warmup.schedule:
        # get_prev is exclusive of `now`; a slot that starts this very second counts.
        slot = croniter(cache.warmup.schedule, now + dt.timedelta(seconds=1)).get_prev(dt.datetime)
        token += "|" + slot.strftime("%Y-%m-%dT%H:%MZ")
    return token


def _job_state(job: Mapping[str, Any]) -> str:
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "Succeeded"
        if cond.get("status") == "True" and cond.get("type") in ("Failed", "FailureTarget"):
            return "Failed"
    return "Running" if status.get("active") or status.get("startTime") else "Pending"


def _job_failure(job: Mapping[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Failed", "FailureTarget") and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip(": ")
    return ""


def read_summaries(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The warmers' JSON summaries from their terminated containers' messages."""
    out = []
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("name") != "warm":
                continue
            message = ((status.get("state") or {}).get("terminated") or {}).get("message") or ""
            try:
                summary = json.loads(message)
            except ValueError:
                summary = {"errors": [message.strip()[-500:]]} if message.strip() else None
            if isinstance(summary, dict):
                out.append(summary)
    return out


def pool_status(name: str, pool: Pool, digest: str, job: Mapping[str, Any] | None,
                summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    state = _job_state(job) if job is not None else "Pending"
    jstatus = (job or {}).get("status") or {}
    out: dict[str, Any] = {"name": pool.name, "job": name, "specHash": digest, "state": state}
    if jstatus.get("startTime"):
        out["startTime"] = jstatus["startTime"]
    if jstatus.get("completionTime"):
        out["completionTime"] = jstatus["completionTime"]
    if summaries:
        out["entriesFound"] = max(int(s.get("entriesFound", 0)) for s in summaries)
        out["entriesWritten"] = sum(int(s.get("entriesWritten", 0)) for s in summaries)
        out["bytesWritten"] = sum(int(s.get("bytesWritten", 0)) for s in summaries)
        out["compileSeconds"] = round(max(float(s.get("compileSeconds", 0)) for s in summaries), 3)
    errors = [e for s in summaries for e in s.get("errors", [])]
    if state == "Failed":
        out["lastError"] = "; ".join(errors)[:1000] or _job_failure(job or {}) or "warmer failed"
    return out


def reconcile_warmup(
    cache: CacheSpec, *, namespace: str, name: str, uid: str, annotations: Mapping[str, str],
    previous: Sequence[Mapping[str, Any]], cache_entries: int, warmer_image: str, now: dt.datetime,
) -> WarmupOutcome:
    """Make sure each pool has run the warmer for the current program. Raises KubeError."""
    warmup = cache.warmup
    assert warmup is not None
    token = rewarm_token(cache, annotations, now)
    prev_by_pool = {p.get("name"): p for p in previous}
    observed = kube.list_jobs(namespace, f"{jobs.LABEL_WARMER_FOR}={name}")
    events: list[Event] = []
    pools: list[dict[str, Any]] = []
    for pool in warmup.pools:
        digest = jobs.spec_hash(cache, pool, token)
        job_name = jobs.job_name(name, pool, digest)
        mine = [j for j in observed if j["metadata"]["labels"].get(jobs.LABEL_POOL) == pool.name]
        current = next((j for j in mine if j["metadata"]["name"] == job_name), None)
        prev = prev_by_pool.get(pool.name) or {}
        if current is None and prev.get("specHash") == digest and prev.get("state") in ("Succeeded", "Failed"):
            pools.append(dict(prev))  # finished earlier; its Job may be gone (TTL)
            continue
        stale = [j for j in mine if j["metadata"]["name"] != job_name and _job_state(j) in ACTIVE_STATES]
        if current is None and stale:
            for old in stale:
                kube.delete_job(namespace, old["metadata"]["name"])
                events.append(Event("Normal", c.Reason.WARMER_STOPPED,
                                    f"Stopped warmer Job {old['metadata']['name']}: the program changed"))
            pools.append({"name": pool.name, "job": job_name, "specHash": digest, "state": "Pending"})
            continue
        if current is None:
            owner = {"name": name, "uid": uid}
            if pool.hosts > 1:
                kube.create(jobs.headless_service(name, namespace, pool, job_name, owner))
            body = jobs.warmer_job(cache, cache_name=name, namespace=namespace, pool=pool, digest=digest,
                                   owner=owner, warmer_image=warmer_image)
            if kube.create(body):
                events.append(Event("Normal", c.Reason.WARMER_CREATED, f"Created warmer Job {job_name} for pool {pool.name}"))
            pools.append({"name": pool.name, "job": job_name, "specHash": digest, "state": "Pending"})
            continue
        state = _job_state(current)
        if state not in ACTIVE_STATES and prev.get("job") == job_name and prev.get("state") == state:
            pools.append(dict(prev))  # finished and already read: no need to list its pods again
            continue
        summaries = read_summaries(kube.list_pods(namespace, f"job-name={job_name}")) if state not in ACTIVE_STATES else []
        status = pool_status(job_name, pool, digest, current, summaries)
        if state != prev.get("state") or digest != prev.get("specHash"):
            if state == "Succeeded":
                events.append(Event("Normal", c.Reason.WARMER_SUCCEEDED,
                                    f"Warmer Job {job_name} finished: {status.get('entriesWritten', 0)} entries written, "
                                    f"{status.get('entriesFound', 0)} already cached"))
            elif state == "Failed":
                events.append(Event("Warning", c.Reason.WARMER_FAILED, f"Warmer Job {job_name} failed: {status['lastError']}"))
        pools.append(status)
    return WarmupOutcome(_warmed(pools, cache_entries), pools, events)


def _warmed(pools: Sequence[Mapping[str, Any]], cache_entries: int) -> Cond:
    failed = [p for p in pools if p.get("state") == "Failed"]
    if failed:
        detail = "; ".join(f"{p['name']}: {p.get('lastError', 'failed')}" for p in failed)
        return Cond(c.Condition.WARMED, False, c.Reason.WARMUP_FAILED, f"Warmer failed on {detail}"[:1000])
    waiting = [p for p in pools if p.get("state") != "Succeeded"]
    if waiting:
        detail = ", ".join(f"{p['name']} {p.get('state')}" for p in waiting)
        return Cond(c.Condition.WARMED, False, c.Reason.WARMING, f"Warming: {detail}")
    if cache_entries == 0:
        return Cond(c.Condition.WARMED, False, c.Reason.CACHE_EMPTY,
                    "Every warmer succeeded but the bucket holds no cache entries under the prefix")
    return Cond(c.Condition.WARMED, True, c.Reason.WARMED,
                f"Every pool is warm; the cache holds {cache_entries} entries")


def release_waiting_pods(cache: CacheSpec, *, namespace: str, name: str, warmed: bool,
                         now: dt.datetime) -> tuple[int, list[Event]]:
    """Remove our scheduling gate from this cache's pods once it is Warmed or a pod has
    waited timeoutSeconds. Returns (pods still waiting, events). Raises KubeError."""
    timeout = dt.timedelta(seconds=cache.injection.wait_for_warm.timeout_seconds)
    waiting = 0
    events: list[Event] = []
    for pod in kube.list_pods(namespace, f"{c.CACHE_LABEL}={name}"):
        gates = [g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
        if WAIT_GATE not in gates:
            continue
        created = dt.datetime.fromisoformat(str(pod["metadata"]["creationTimestamp"]).replace("Z", "+00:00"))
        timed_out = now - created >= timeout
        if warmed or timed_out:
            kube.remove_scheduling_gate(namespace, pod["metadata"]["name"], gates.index(WAIT_GATE), WAIT_GATE)
            why = "the cache is warm" if warmed else f"it waited {int(timeout.total_seconds())}s for the cache"
            events.append(Event("Normal" if warmed else "Warning", c.Reason.POD_RELEASED,
                                f"Released pod {pod['metadata']['name']}: {why}"))
        else:
            waiting += 1
    return waiting, events
