"""Reconcile a cache's warmers: one Job per pool for the current program, its result read
back from the pod's termination message, and pods waiting for the cache released.

Everything is derived from observed Jobs and Pods plus the previous status, so a restart
of the operator at any point (even mid-warm) finds the same Job by its deterministic name
and creates nothing twice. A pool never has two unfinished warmers: stale ones are deleted
(foreground) and the new one is created on a later reconcile, once they are gone; a
reconcile holding an older spec than a Job's generation annotation leaves the pool alone.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from croniter import croniter

from cachewarm.api import constants as c
from cachewarm.builders import job as jobs
from cachewarm.builders.placement import pool_shape
from cachewarm.builders.tpu import TpuShapeError
from cachewarm.clients.kube import KubeClient
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec, Pool

ACTIVE_STATES = ("Pending", "Running")
MAX_KEYS = 250  # key hashes kept per pool in status (a termination message holds about 200)
IMAGE_PYTHONPATH_LIMIT = 1000  # characters: the CRD's maxLength (warmer.IMAGE_PYTHONPATH_LIMIT)


@dataclass(frozen=True)
class WarmRetry:
    """How often a failed warmer runs again: `retries` more times, the first after
    `delay_seconds`, each later one after twice the one before (at most an hour)."""

    retries: int = 3
    delay_seconds: float = 60.0

    def delay(self, attempt: int) -> dt.timedelta:
        """The wait after failed attempt number `attempt` (1 is the first run)."""
        return dt.timedelta(seconds=min(self.delay_seconds * 2 ** max(0, attempt - 1), 3600.0))


@dataclass
class WarmupOutcome:
    condition: Cond
    pools: list[dict[str, Any]]
    events: list[Event] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return any(p.get("state") in ACTIVE_STATES for p in self.pools)


def last_slot(schedule: str, now: dt.datetime) -> dt.datetime:
    """The most recent slot of a cron `schedule` at `now` (UTC): the latest one not after
    `now`, so a slot counts from its very instant and not a moment before."""
    slot: dt.datetime = croniter(schedule, now).get_prev(dt.datetime)  # exclusive of `now`
    following: dt.datetime = croniter(schedule, slot).get_next(dt.datetime)
    return following if following <= now else slot


def next_slot(schedule: str, now: dt.datetime) -> dt.datetime:
    """The first slot of a cron `schedule` after `now` (UTC)."""
    slot: dt.datetime = croniter(schedule, now).get_next(dt.datetime)  # exclusive of `now`
    return slot


def scheduled_slot(cache: CacheSpec, now: dt.datetime) -> dt.datetime | None:
    """The cron slot the cache's warmers run for at `now` (None: no schedule)."""
    if cache.warmup is None or not cache.warmup.schedule:
        return None
    return last_slot(cache.warmup.schedule, now)


def next_scheduled_warm(cache: CacheSpec, now: dt.datetime) -> dt.datetime | None:
    """When the cache's next cron slot asks for a new warm (None: no schedule): the time
    the controller reconciles it again, since no event marks a slot's start."""
    if cache.warmup is None or not cache.warmup.schedule:
        return None
    return next_slot(cache.warmup.schedule, now)


def rewarm_token(cache: CacheSpec, annotations: Mapping[str, str], now: dt.datetime) -> str:
    """What forces a new warm for an unchanged program: the manual annotation and the most
    recent cron slot."""
    token = annotations.get(c.REWARM_ANNOTATION, "")
    slot = scheduled_slot(cache, now)
    if slot is not None:
        token += "|" + slot.strftime("%Y-%m-%dT%H:%MZ")
    return token


def _job_state(job: Mapping[str, Any]) -> str:
    """Succeeded or Failed only once the Job controller says the Job's pods are gone
    (Complete, Failed). SuccessCriteriaMet and FailureTarget (Kubernetes 1.31+) come
    while pods still terminate: a Job with only those is Running, so its pool gets no new
    warmer and keeps its Service until the old pods have stopped."""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") == "Complete":
            return "Succeeded"
        if cond.get("status") == "True" and cond.get("type") == "Failed":
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


@dataclass(frozen=True)
class PodsView:
    """What a Job's pods say beyond the Job's status: where they ran, and why one waits."""

    nodes: tuple[str, ...] = ()
    unschedulable: str = ""  # the scheduler's message, verbatim
    image: str = ""  # the image the warm container ran, by digest (its imageID), as the kubelet reports it
    # The warm container's spec, as admitted, sets PYTHONPATH or may (envFrom): another
    # webhook's (a tracer's library injection), or the warmup's env; the warmer then saw
    # that, not the image's own.
    pythonpath_set: bool = False


def read_pods(pods: Sequence[Mapping[str, Any]]) -> PodsView:
    nodes = sorted({str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")})
    unschedulable = ""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable" and not unschedulable):
                unschedulable = str(cond.get("message") or "no node fits the pod")
    # Every host runs the same image; a tag may have moved, the digest the kubelet pulled not.
    image = next((str(s["imageID"]) for p in pods for s in (p.get("status") or {}).get("containerStatuses") or []
                  if s.get("name") == "warm" and s.get("imageID")), "")
    warm = [ct for p in pods for ct in (p.get("spec") or {}).get("containers") or [] if ct.get("name") == "warm"]
    pythonpath_set = any(ct.get("envFrom") or any(e.get("name") == "PYTHONPATH" for e in ct.get("env") or [])
                         for ct in warm)
    return PodsView(tuple(nodes), unschedulable, image, pythonpath_set)


FINGERPRINT_TEXT = ("jax", "flagsHash", "cacheDir", "platform", "platformVersion", "deviceKind", "topology", "error")
FINGERPRINT_COUNTS = ("flagCount", "devices", "processes")


def fingerprint_status(reported: Mapping[str, Any], image: str) -> dict[str, Any]:
    """A warmer's fingerprint as status keeps it: the known fields only, typed and bounded
    (the summary is the warmer's, run in the user's image, so not trusted to be tidy)."""
    out: dict[str, Any] = {k: str(reported[k])[:300] for k in FINGERPRINT_TEXT if reported.get(k) not in (None, "")}
    for key in FINGERPRINT_COUNTS:
        try:
            out[key] = int(reported[key])
        except (KeyError, TypeError, ValueError):
            continue
    versions = reported.get("versions")
    if isinstance(versions, Mapping):
        out["versions"] = {str(k)[:100]: str(v)[:100] for k, v in list(versions.items())[:16]}
    if image:
        out["image"] = image[:300]
    return out


def _process_index(summary: Mapping[str, Any]) -> int:
    try:
        return int(summary.get("processIndex", 0))
    except (TypeError, ValueError):
        return 0


def _pythonpath(value: Any) -> str | None:
    """A reported imagePythonPath status can hold as it is: text of at most
    IMAGE_PYTHONPATH_LIMIT characters ("" is a value: the image sets none)."""
    if not isinstance(value, str) or len(value) > IMAGE_PYTHONPATH_LIMIT:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def pool_status(name: str, pool: Pool, digest: str, job: Mapping[str, Any] | None,
                summaries: Sequence[Mapping[str, Any]], pods: PodsView | None = None, *,
                env_sets_pythonpath: bool = False) -> dict[str, Any]:
    """One entry of status.warmup.pools. Only process 0 of a multi-host warmer writes cache
    entries, so entries and bytes are process 0's (each entry counted once); the compile
    time is the slowest host's; errors are every host's. `imagePythonPath` is process 0's
    PYTHONPATH, the image's own, unless `env_sets_pythonpath` (spec.warmup.env sets one,
    so the warmer saw that): then none is recorded."""
    state = _job_state(job) if job is not None else "Pending"
    jstatus = (job or {}).get("status") or {}
    out: dict[str, Any] = {"name": pool.name, "job": name, "specHash": digest, "state": state}
    if jstatus.get("startTime"):
        out["startTime"] = jstatus["startTime"]
    if jstatus.get("completionTime"):
        out["completionTime"] = jstatus["completionTime"]
    if pods is not None and pods.nodes:
        out["nodes"] = list(pods.nodes)
    if pods is not None and pods.unschedulable and state in ACTIVE_STATES:
        out["state"] = "Pending"
        out["reason"] = c.Reason.UNSCHEDULABLE
        out["message"] = f"Unschedulable: {pods.unschedulable}"[:1000]
    if summaries:
        writers = [s for s in summaries if _process_index(s) == 0] or list(summaries)
        out["entriesFound"] = max(int(s.get("entriesFound", 0)) for s in writers)
        out["entriesWritten"] = max(int(s.get("entriesWritten", 0)) for s in writers)
        out["bytesWritten"] = max(int(s.get("bytesWritten", 0)) for s in writers)
        out["compileSeconds"] = round(max(float(s.get("compileSeconds", 0)) for s in summaries), 3)
        # Process 0 alone refreshes customTime; a failure there does not fail the warm.
        failed = max(int(s.get("refreshFailed", 0) or 0) for s in writers)
        if failed:
            out["refreshFailed"] = failed
        refresh_error = next((str(s["refreshError"]) for s in writers if s.get("refreshError")), "")
        if refresh_error:
            out["refreshError"] = refresh_error[:1000]
        not_cached = max(int(s.get("notCached", 0) or 0) for s in writers)
        if not_cached:
            out["notCached"] = not_cached
        # The entries this warm relies on, by key hash (checked against the bucket).
        reported = next((s for s in writers if isinstance(s.get("keys"), list)), None)
        if reported is not None:
            out["keys"] = sorted({str(k) for k in reported["keys"]})[:MAX_KEYS]
            out["keyCount"] = int(reported.get("keyCount", len(out["keys"])) or 0)
        # What the keys were computed with (process 0's view), and the image by digest.
        found = next((s["fingerprint"] for s in writers if isinstance(s.get("fingerprint"), Mapping)
                      and s["fingerprint"]), None)
        if found is not None:
            out["fingerprint"] = fingerprint_status(found, pods.image if pods is not None else "")
        # The PYTHONPATH the image sets, for the webhook (image_pythonpath).
        if not env_sets_pythonpath and not (pods is not None and pods.pythonpath_set):
            path = next((p for p in (_pythonpath(s.get("imagePythonPath")) for s in writers) if p is not None), None)
            image = next((str(ct.get("image") or "") for ct in ((((job or {}).get("spec") or {}).get("template") or {})
                                                              .get("spec") or {}).get("containers") or []), "")
            if path is not None and image:
                # With the image the Job ran, as spec.warmup.image named it: what a pod's
                # image is compared with, so a value of an earlier warmup image is never
                # taken for the current one's.
                out["imagePythonPath"] = {"image": image[:1000], "value": path}
    errors = [e for s in summaries for e in s.get("errors", [])]
    if state == "Failed":
        out["lastError"] = "; ".join(errors)[:1000] or _job_failure(job or {}) or "warmer failed"
    return out


def image_pythonpath(pools: Sequence[Mapping[str, Any]], image: str) -> str | None:
    """The PYTHONPATH `image` (the current spec.warmup.image) sets, from
    status.warmup.pools: the value every pool whose warmer ran that image reports in
    `imagePythonPath` agrees on ("" when the image sets none); other pools are left out.
    None when none reports one, or when they disagree."""
    seen = {str(p["imagePythonPath"]["value"]) for p in pools
            if isinstance(p.get("imagePythonPath"), Mapping) and p["imagePythonPath"].get("image") == image
            and isinstance(p["imagePythonPath"].get("value"), str)}
    return seen.pop() if len(seen) == 1 else None


@dataclass(frozen=True)
class ObservedJob:
    """A warmer Job of one pool, as far as the stop-before-start decision needs it."""

    name: str
    state: str
    deleting: bool
    generation: int
    # Controlled by another object: a deleted cache of the same name whose Jobs the
    # garbage collector has yet to remove. Never ours to delete or to be superseded by.
    foreign: bool = False

    @property
    def unfinished(self) -> bool:
        return self.state in ACTIVE_STATES


def observe(job: Mapping[str, Any], uid: str) -> ObservedJob:
    """The Job as plan_pool sees it; `uid` is the cache's. A Job is the cache's when its
    controller is the cache, or when it has no controller (orphaned by a delete with
    cascade=orphan: adopted, so that it is stopped like any stale warmer)."""
    meta = job.get("metadata") or {}
    try:
        generation = int((meta.get("annotations") or {}).get(c.GENERATION_ANNOTATION, 0))
    except ValueError:
        generation = 0
    controllers = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    foreign = any(r.get("uid") != uid for r in controllers)
    return ObservedJob(str(meta.get("name")), _job_state(job), bool(meta.get("deletionTimestamp")), generation,
                       foreign)


@dataclass(frozen=True)
class PoolPlan:
    """What to do about one pool's Jobs. `superseded`: a Job from a newer generation of
    the spec exists, so this reconcile holds an older spec and touches nothing."""

    delete: tuple[str, ...] = ()
    create: bool = False
    waiting_for: tuple[str, ...] = ()
    superseded: bool = False


def plan_pool(observed: Sequence[ObservedJob], desired: str | None, generation: int) -> PoolPlan:
    """Never two warmers for one pool: every other unfinished Job of the pool is deleted,
    and the desired Job (None: the pool has none, e.g. its shape is invalid) is created
    only once none remains, counting those already being deleted. Nothing is done when a
    Job from a newer generation exists. Foreign Jobs (another owner's) are left to their
    owner's garbage collection; only one holding the desired name delays the create."""
    ours = [j for j in observed if not j.foreign]
    if any(j.generation > generation for j in ours):
        return PoolPlan(superseded=True)
    others = [j for j in ours if j.name != desired and j.unfinished]
    current = next((j for j in observed if j.name == desired), None)
    waiting = [j.name for j in others]
    if current is not None and (current.deleting or current.foreign):
        waiting.append(current.name)  # deleted by someone (or not ours); re-created once it is gone
    return PoolPlan(
        delete=tuple(j.name for j in others if not j.deleting),
        create=desired is not None and current is None and not waiting,
        waiting_for=tuple(waiting),
    )


def services_to_delete(services: Sequence[str], keep: set[str]) -> list[str]:
    """Pool Services no warmer needs any more."""
    return [s for s in services if s not in keep]


def _pool_of(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(c.LABEL_POOL, ""))


def _time(value: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None
    except ValueError:
        return None


def _iso(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def failed_at(job: Mapping[str, Any] | None) -> dt.datetime | None:
    """When the Job controller marked the Job Failed."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return _time(cond.get("lastTransitionTime"))
    return None


def plan_retry(entry: Mapping[str, Any], attempt: int, failed: dt.datetime, retry: WarmRetry,
               now: dt.datetime) -> tuple[dict[str, Any], bool]:
    """A failed pool's status with its attempt and, while retries are left, when the next
    one runs; and whether it is due now."""
    out = {**entry, "attempt": attempt, "failedTime": _iso(failed)}
    out.pop("nextRetryTime", None)
    if attempt > retry.retries:
        out["message"] = f"Failed {attempt} times; no retry is left (spec change or {c.REWARM_ANNOTATION} runs it again)"
        return out, False
    at = failed + retry.delay(attempt)
    out["nextRetryTime"] = _iso(at)
    out["message"] = f"Attempt {attempt} of {retry.retries + 1} failed; retrying at {_iso(at)}"
    return out, now >= at


def _retried(pool: str, job: str, attempt: int, retry: WarmRetry, prev: Mapping[str, Any]) -> Event:
    return Event("Normal", c.Reason.WARMER_RETRIED,
                 f"Pool {pool}: running warmer Job {job} again (attempt {attempt} of {retry.retries + 1}) after: "
                 f"{prev.get('lastError', 'a failure')}"[:1000])


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
    warmup = cache.warmup
    assert warmup is not None
    token = rewarm_token(cache, annotations, now)
    slot = scheduled_slot(cache, now)
    digests: dict[str, str] = {}  # pool -> the hash of its current program
    prev_by_pool = {p.get("name"): p for p in previous}
    selector = f"{c.LABEL_WARMER_FOR}={name}"
    observed = kube.list_jobs(namespace, selector)
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for j in observed:
        by_pool.setdefault(_pool_of(j), []).append(j)
    events: list[Event] = []
    pools: list[dict[str, Any]] = []
    owner = {"name": name, "uid": uid}
    keep_services: set[str] = set()
    untouchable: set[str] = set()  # pools superseded by a newer spec

    def stop(job_names: Sequence[str], why: str) -> None:
        for old in job_names:
            kube.delete_job(namespace, old)
            events.append(Event("Normal", c.Reason.WARMER_STOPPED, f"Stopped warmer Job {old}: {why}"))

    for pool in warmup.pools:
        mine = by_pool.get(pool.name, [])
        seen = [observe(j, uid) for j in mine]
        prev = prev_by_pool.get(pool.name) or {}
        try:
            digest = jobs.spec_hash(cache, pool, token)
            hosts = pool_shape(pool).hosts
        except TpuShapeError as exc:
            plan = plan_pool(seen, None, generation)
            if plan.superseded:
                untouchable.add(pool.name)
                pools.append(dict(prev) if prev else {"name": pool.name, "state": "Pending"})
                continue
            stop(plan.delete, "the pool's TPU shape is invalid")
            if plan.waiting_for:
                keep_services.add(jobs.service_name(name, pool.name))  # the stopping warmers may still use it
            invalid = {"name": pool.name, "state": "Failed", "reason": exc.reason, "message": str(exc),
                       "lastError": str(exc)}
            if prev.get("message") != invalid["message"]:
                events.append(Event("Warning", exc.reason, f"Pool {pool.name}: {exc}"))
            pools.append(invalid)
            continue
        digests[pool.name] = digest
        job_name = jobs.job_name(name, pool, digest)
        plan = plan_pool(seen, job_name, generation)
        if plan.superseded:
            untouchable.add(pool.name)
            pools.append(dict(prev) if prev else {"name": pool.name, "job": job_name, "state": "Pending"})
            continue
        current = next((j for j in mine if j["metadata"]["name"] == job_name), None)
        # Which run of this program this is: 1, then one more per retry after a failure.
        attempt = int(prev.get("attempt") or 1) if prev.get("specHash") == digest else 1
        if current is None and not plan.waiting_for and prev.get("specHash") == digest \
                and prev.get("state") in ("Succeeded", "Failed"):
            # Finished earlier; its Job may be gone (TTL). A failure may be due a retry.
            earlier: dict[str, Any] = dict(prev)
            due = False
            if prev.get("state") == "Failed":
                earlier, due = plan_retry(prev, attempt, _time(prev.get("failedTime")) or now, retry, now)
            if not due:
                pools.append(earlier)
                continue
            attempt += 1
            events.append(_retried(pool.name, job_name, attempt, retry, prev))
        stop(plan.delete, "the program changed")
        service = jobs.service_name(name, pool.name)
        if plan.waiting_for:
            if hosts > 1 or any(o.unfinished for o in seen):
                keep_services.add(service)  # the stopping warmers may still use it
            pools.append({"name": pool.name, "job": job_name, "specHash": digest, "state": "Pending",
                          "attempt": attempt, **({"lastError": prev["lastError"]} if attempt > 1 and
                                                 prev.get("lastError") else {}),
                          "message": f"Waiting for warmer Job {', '.join(plan.waiting_for)} to stop"})
            continue
        if plan.create:
            if hosts > 1:
                kube.create(jobs.headless_service(name, namespace, pool, owner))
                keep_services.add(service)
            body = jobs.warmer_job(cache, cache_name=name, namespace=namespace, pool=pool, digest=digest,
                                   owner=owner, warmer_image=warmer_image, generation=generation)
            if kube.create(body) is not None:
                events.append(Event("Normal", c.Reason.WARMER_CREATED, f"Created warmer Job {job_name} for pool {pool.name}"))
            pools.append({"name": pool.name, "job": job_name, "specHash": digest, "state": "Pending",
                          "attempt": attempt})
            continue
        assert current is not None
        state = _job_state(current)
        if state in ACTIVE_STATES and hosts > 1:
            keep_services.add(service)
        if state not in ACTIVE_STATES and prev.get("job") == job_name and prev.get("state") == state:
            # Finished and already read: no need to list its pods again.
            entry = dict(prev)
            due = False
            if state == "Failed":
                entry, due = plan_retry(prev, attempt, failed_at(current) or now, retry, now)
                if due:
                    # Stopped first (foreground): the same Job name runs again once it is gone.
                    kube.delete_job(namespace, job_name)
                    entry = {"name": pool.name, "job": job_name, "specHash": digest, "state": "Pending",
                             "attempt": attempt + 1, "lastError": prev.get("lastError", ""),
                             "message": f"Retrying after attempt {attempt} failed"}
                    events.append(_retried(pool.name, job_name, attempt + 1, retry, prev))
            pools.append(entry)
            continue
        pods = kube.list_pods(namespace, f"{c.JOB_NAME_LABEL}={job_name}")
        summaries = read_summaries(pods) if state not in ACTIVE_STATES else []
        status = pool_status(job_name, pool, digest, current, summaries, read_pods(pods),
                             env_sets_pythonpath=any(e.name == "PYTHONPATH" for e in warmup.env))
        status["attempt"] = attempt
        if state == "Failed":
            status, _ = plan_retry(status, attempt, failed_at(current) or now, retry, now)
        if status.get("reason") == c.Reason.UNSCHEDULABLE and status.get("message") != prev.get("message"):
            events.append(Event("Warning", c.Reason.UNSCHEDULABLE,
                                f"Warmer Job {job_name} cannot be scheduled: {status['message']}"[:1000]))
        if state != prev.get("state") or digest != prev.get("specHash"):
            if state == "Succeeded":
                events.append(Event("Normal", c.Reason.WARMER_SUCCEEDED,
                                    f"Warmer Job {job_name} finished: {status.get('entriesWritten', 0)} entries written, "
                                    f"{status.get('entriesFound', 0)} already cached"))
            elif state == "Failed":
                events.append(Event("Warning", c.Reason.WARMER_FAILED, f"Warmer Job {job_name} failed: {status['lastError']}"))
            if status.get("refreshError"):
                events.append(Event("Warning", c.Reason.LAST_USE_NOT_REFRESHED,
                                    f"Warmer Job {job_name} could not refresh entries' customTime: "
                                    f"{status['refreshError']}"[:1000]))
        pools.append(status)

    # Pools that left the spec: their warmers stop, and nothing replaces them.
    in_spec = {p.name for p in warmup.pools}
    for pool_name, gone in by_pool.items():
        if pool_name in in_spec:
            continue
        plan = plan_pool([observe(j, uid) for j in gone], None, generation)
        if plan.superseded:
            untouchable.add(pool_name)
            continue
        stop(plan.delete, f"pool {pool_name} was removed from the spec")
    services = kube.list_services(namespace, selector)
    for svc in services:
        svc_name = str(svc["metadata"]["name"])
        if _pool_of(svc) in untouchable or svc_name in keep_services:
            continue
        kube.delete_service(namespace, svc_name)
    if slot is not None:
        # The slot each pool's current warmer is for (the slot is part of its hash), so the
        # Job's creationTimestamp can be compared with the slot it was due at.
        for entry in pools:
            if entry.get("specHash") is not None and entry.get("specHash") == digests.get(str(entry.get("name"))):
                entry["scheduledTime"] = _iso(slot)
    return WarmupOutcome(warmed_condition(pools, cache_entries, warmed_before, entry_keys), pools, events)


def missing_entries(pools: Sequence[Mapping[str, Any]], entry_keys: frozenset[str]) -> dict[str, int]:
    """Per pool, how many entries its warmer reported are not in the bucket."""
    out = {}
    for pool in pools:
        missing = [k for k in pool.get("keys") or [] if k not in entry_keys]
        if missing:
            out[str(pool["name"])] = len(missing)
    return out


# Warmed reasons that come from the bucket's listing (every pool's warmer has finished).
BUCKET_VERDICTS = (c.Reason.WARMED, c.Reason.ENTRIES_MISSING, c.Reason.CACHE_EMPTY)


def warmed_condition(pools: Sequence[Mapping[str, Any]], cache_entries: int, warmed_before: bool = False,
            entry_keys: frozenset[str] | None = None) -> Cond:
    """Warmed once every pool succeeded and the entries their warmers reported (by key)
    are all in the bucket (`entry_keys`; a warmer too old to report keys: the bucket holds
    entries). A re-warm (Warmed was True before) of a bucket that still holds entries stays
    True, reason Rewarming, while its warmers run: the cache pods would read is usable, so
    they are not held. A first warm, and a re-warm that failed, are False."""
    invalid = [p for p in pools if p.get("reason") in (c.Reason.UNKNOWN_TPU_SHAPE, c.Reason.INVALID_TPU_SHAPE)]
    if invalid:
        detail = "; ".join(f"{p['name']}: {p.get('message', '')}" for p in invalid)
        return Cond(c.Condition.WARMED, False, str(invalid[0]["reason"]), f"Cannot warm pool {detail}"[:1000])
    failed = [p for p in pools if p.get("state") == "Failed"]
    if failed:
        detail = "; ".join(f"{p['name']}: {p.get('lastError', 'failed')}"
                           + (f" ({p['message']})" if p.get("attempt") and p.get("message") else "") for p in failed)
        return Cond(c.Condition.WARMED, False, c.Reason.WARMUP_FAILED, f"Warmer failed on {detail}"[:1000])
    waiting = [p for p in pools if p.get("state") != "Succeeded"]
    if waiting:
        detail = ", ".join(f"{p['name']} {p.get('state')}" + (f" ({p['message']})" if p.get("message") else "")
                           for p in waiting)
        if warmed_before and cache_entries > 0:
            return Cond(c.Condition.WARMED, True, c.Reason.REWARMING,
                        f"Re-warming: {detail}; the {cache_entries} entries already cached stay in use"[:1000])
        reason = c.Reason.UNSCHEDULABLE if any(p.get("reason") == c.Reason.UNSCHEDULABLE for p in waiting) \
            else c.Reason.WARMING
        return Cond(c.Condition.WARMED, False, reason, f"Warming: {detail}"[:1000])
    reporting = [p for p in pools if isinstance(p.get("keys"), list)]
    if entry_keys is not None and reporting:
        missing = missing_entries(reporting, entry_keys)
        if missing:
            detail = "; ".join(f"{pool}: {n} of {len(next(p for p in reporting if p['name'] == pool)['keys'])}"
                               for pool, n in sorted(missing.items()))
            return Cond(c.Condition.WARMED, False, c.Reason.ENTRIES_MISSING,
                        f"Entries the warmers reported are not in the bucket ({detail}): deleted since, or "
                        f"written elsewhere; set {c.REWARM_ANNOTATION} to warm again"[:1000])
    if cache_entries == 0 or (reporting and not any(p["keys"] for p in reporting)):
        return Cond(c.Condition.WARMED, False, c.Reason.CACHE_EMPTY,
                    "Every warmer succeeded but the bucket holds none of the entries they compiled under the prefix")
    relied = sum(len(p["keys"]) for p in reporting)
    message = (f"Every pool is warm: the {relied} entries its warmers reported are in the bucket "
               f"({cache_entries} entries in all)" if reporting else
               f"Every pool is warm; the cache holds {cache_entries} entries")
    not_cached = {str(p["name"]): int(p["notCached"]) for p in pools if p.get("notCached")}
    if not_cached:
        message += ("; not cached (below minCompileTimeSecs or minEntrySizeBytes, so pods compile them): "
                    + ", ".join(f"{n} programs of {pool}" for pool, n in sorted(not_cached.items())))
    return Cond(c.Condition.WARMED, True, c.Reason.WARMED, message[:1000])


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
        created = dt.datetime.fromisoformat(str(pod["metadata"]["creationTimestamp"]).replace("Z", "+00:00"))
        timed_out = now - created >= timeout
        if why or warmed or timed_out:
            kube.remove_scheduling_gate(namespace, pod["metadata"]["name"], gates.index(c.WAIT_GATE), c.WAIT_GATE)
            said = why or ("the cache is warm" if warmed else f"it waited {int(timeout.total_seconds())}s for the cache")
            events.append(Event("Normal" if why or warmed else "Warning", c.Reason.POD_RELEASED,
                                f"Released pod {pod['metadata']['name']}: {said}"))
        else:
            waiting += 1
    return waiting, events
