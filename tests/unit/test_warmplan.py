"""The warm-up planner (reconcile/warmplan.py) as a table: for each warm-up scenario the
e2e tests drive through the real operator, what the cluster holds (a WarmView) and what
the reconcile knows besides (a WarmContext, `now` passed in) against the plan: which
Jobs' pods it reads, its steps in order (creates, deletes, Events), each pool's status
entry and Warmed. No client and no clock: the e2e test that drives each scenario is
named beside it (`e2e`)."""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from cachewarm.api.model import CacheSpec, parse_spec
from cachewarm.builders import job as jobs
from cachewarm.builders.placement import pool_shape
from cachewarm.builders.tpu import TpuShapeError
from cachewarm.api.events import Event
from cachewarm.reconcile.warmplan import (Create, DeleteJob, DeleteService, Step, WarmContext, WarmRetry, WarmView,
                                          plan_warmup, results_to_read)

NS, NAME, UID = "ml", "llama", "u-1"
NOW = dt.datetime(2026, 11, 22, 1, 0, tzinfo=dt.timezone.utc)
STAMP = "2026-11-22T01:00:00Z"
CPU = {"name": "cpu"}
V5P = {"name": "v5p16", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}  # two hosts
ODD = {"name": "odd", "tpu": {"type": "tpu-v5p-slice", "topology": "3x3x3"}}  # no GKE shape
BAD_HOSTS = {"name": "cpu", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}, "hosts": 3}  # 2x2x2 is 2 hosts
H100 = {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}, "hosts": 2}
L4 = {"name": "l4", "accelerator": {"type": "nvidia-l4", "count": 1}}
RETRY_ONCE = WarmRetry(retries=1, delay_seconds=1)  # as the e2e session's operator (CACHEWARM_WARM_RETRIES=1)
NODES_FULL = ("0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector. "
              "preemption: 0/8 nodes are available.")


def spec(*pools: dict[str, Any], image: str = "train:1", targets: str = "train:targets",
         schedule: str | None = None) -> CacheSpec:
    warmup: dict[str, Any] = {"image": image, "targets": [targets], "pools": list(pools or [CPU])}
    if schedule:
        warmup["schedule"] = schedule
    return parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": warmup})


def digest(cache: CacheSpec, pool: str = "cpu", token: str = "") -> str:
    assert cache.warmup is not None
    return jobs.spec_hash(cache, next(p for p in cache.warmup.pools if p.name == pool), token)


def name_of(cache: CacheSpec, pool: str = "cpu", token: str = "") -> str:
    """The warmer Job's name for `pool` of `cache` (the builders' deterministic name)."""
    assert cache.warmup is not None
    return jobs.job_name(NAME, next(p for p in cache.warmup.pools if p.name == pool), digest(cache, pool, token))


def service(pool: str) -> dict[str, Any]:
    return {"metadata": {"name": jobs.service_name(NAME, pool), "namespace": NS,
                         "labels": {"cachewarm.dev/warmer-for": NAME, "cachewarm.dev/pool": pool}}}


def manifest(job_name: str, pool: str = "cpu") -> str:
    """The object warmer Job `job_name` of `pool` writes its manifest at (the Job's
    CACHEWARM_MANIFEST in bucket b-1), written out, not computed by the code under test."""
    return f".cachewarm/pools/{NS}/{NAME}/{pool}/{job_name}.json"


def job(name: str, pool: str = "cpu", state: str = "Running", *, generation: int = 2, deleting: bool = False,
        image: str = "train:1", failed: str = STAMP, manifest_url: str | None = None,
        owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A warmer Job as the apiserver lists it, in `state` as the Job controller says it;
    its container's CACHEWARM_MANIFEST is `manifest_url` (default: its own, as built);
    `owners`: its ownerReferences (default: the cache as its controller, as the operator
    makes it)."""
    status: dict[str, Any] = {
        "Pending": {},
        "Running": {"active": 1, "startTime": STAMP},
        "Succeeded": {"startTime": STAMP, "completionTime": STAMP,
                      "conditions": [{"type": "Complete", "status": "True"}]},
        "Failed": {"startTime": STAMP, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                       "lastTransitionTime": failed}]},
    }[state]
    meta: dict[str, Any] = {"name": name, "namespace": NS, "uid": job_uid(name),
                            "labels": {"cachewarm.dev/warmer-for": NAME, "cachewarm.dev/pool": pool},
                            "annotations": {"cachewarm.dev/generation": str(generation)},
                            "ownerReferences": owners if owners is not None else [
                                {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "name": NAME,
                                 "uid": UID, "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = STAMP
    env = [{"name": "CACHEWARM_MANIFEST", "value": manifest_url or f"gs://b-1/{manifest(name, pool)}"}]
    return {"metadata": meta, "spec": {"template": {"spec": {"containers": [{"name": "warm", "image": image,
                                                                              "env": env}]}}},
            "status": status}


def job_uid(name: str) -> str:
    return f"uid-of-{name}"


def owned_by(job_name: str, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`pods` as the Job controller makes them: their controller is the Job, by uid."""
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": job_uid(job_name), "controller": True}
    return [{**p, "metadata": {**p.get("metadata", {}), "ownerReferences": [ref]}} for p in pods]


def pod(node: str | None = "node-a", summary: dict[str, Any] | None = None, unschedulable: str = "",
        name: str = "") -> dict[str, Any]:
    """A pod labelled job-name=<Job>: where it runs, what its warm container said when it
    ended. Owned by nobody: the Case's `pods` are made the Job's own (owned_by), its
    `forged` pods stay as they are."""
    status: dict[str, Any] = {}
    if summary is not None:
        status["containerStatuses"] = [{"name": "warm", "imageID": "docker.io/train@sha256:" + "a" * 64,
                                        "state": {"terminated": {"message": json.dumps(summary)}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    return {"metadata": {"name": name} if name else {},
            "spec": {"containers": [{"name": "warm"}], **({"nodeName": node} if node else {})}, "status": status}


def pending(cache: CacheSpec, pool: str = "cpu", token: str = "", attempt: int = 1, **more: Any) -> dict[str, Any]:
    return {"name": pool, "job": name_of(cache, pool, token), "specHash": digest(cache, pool, token), "state": "Pending",
            "attempt": attempt, **more}


def shape_error(pool: dict[str, Any]) -> TpuShapeError:
    warmup = spec(pool).warmup
    assert warmup is not None
    with pytest.raises(TpuShapeError) as raised:
        pool_shape(warmup.pools[0])
    return raised.value


def said(step: Step) -> tuple[str, ...]:
    """A step as the table writes it: the object a write names, an Event by its text."""
    if isinstance(step, Create):
        made = (f"create {step.body['kind']}", step.body["metadata"]["name"])
        return made + ((step.said.reason, step.said.message) if step.said is not None else ())
    if isinstance(step, DeleteJob):
        return ("delete Job", step.name)
    if isinstance(step, DeleteService):
        return ("delete Service", step.name)
    assert isinstance(step, Event)
    return (step.type, step.reason, step.message)


@dataclass
class Case:
    e2e: str  # the e2e test that drives this scenario through the operator ("": none does)
    cache: CacheSpec
    jobs: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    pods: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # the Job's own pods the plan reads, by Job
    # Pods labelled job-name=<Job> that the Job did not create (listed with its own, after them).
    forged: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    previous: list[dict[str, Any]] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # more of WarmContext: now, annotations, retry, ...
    steps: list[tuple[str, ...]] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    warmed: tuple[bool | None, str] = (False, "Warming")
    warmed_says: str = ""  # a part of Warmed's message


WARMUP = "tests/e2e/test_warmup.py::"
POOLS = "tests/e2e/test_accelerator_pools.py::"
CRON = "tests/e2e/test_cron_wakeup.py::test_a_scheduled_warmer_is_created_at_its_slot_not_at_the_next_resync"
LAST_USE = ("tests/e2e/test_last_use.py::"
            "test_a_warmer_that_may_not_set_custom_time_is_said_in_status_and_an_event_and_entries_keep_their_last_refresh")
HIT = WARMUP + "test_warmed_cache_is_hit_by_an_ordinary_training_pod"
FAILS = WARMUP + "test_warmer_that_compiles_nothing_or_fails_leaves_warmed_false"
SWAP = WARMUP + "test_a_changed_program_stops_the_running_warmer_before_starting_the_new_one"
REWARMS = WARMUP + "test_image_change_rewarms_and_same_spec_does_not"
SLICE = POOLS + "test_multi_host_tpu_pool_warms_as_one_distributed_runtime_and_training_hits"

C = spec()
J = name_of(C)
H = digest(C)
SUMMARY = {"processIndex": 0, "entriesFound": 0, "entriesWritten": 2, "bytesWritten": 30, "compileSeconds": 4.0,
           "keys": ["aa", "bb"], "keyCount": 2, "fingerprint": {"platform": "cpu", "devices": 1, "jax": "0.4.35"},
           "imagePythonPath": "/app", "errors": []}
WARM = {"name": "cpu", "job": J, "specHash": H, "state": "Succeeded", "startTime": STAMP, "completionTime": STAMP,
        "nodes": ["node-a"], "entriesFound": 0, "entriesWritten": 2, "bytesWritten": 30, "compileSeconds": 4.0,
        "keys": ["aa", "bb"], "keyCount": 2,
        "fingerprint": {"platform": "cpu", "devices": 1, "jax": "0.4.35",
                        "image": "docker.io/train@sha256:" + "a" * 64},
        "imagePythonPath": {"image": "train:1", "value": "/app"}, "attempt": 1}
BOOM = {"processIndex": 0, "entriesWritten": 0, "errors": ["TypeError: targets() takes 0 arguments"]}
LAST_ERROR = "TypeError: targets() takes 0 arguments"
LACKS = "gs://b-1/jax needs a library which this image cannot use: it lacks etils[epath] and gcsfs"
FAILED_ONCE = {"name": "cpu", "job": J, "specHash": H, "state": "Failed", "startTime": STAMP, "nodes": ["node-a"],
               "entriesFound": 0, "entriesWritten": 0, "bytesWritten": 0, "compileSeconds": 0.0,
               "lastError": LAST_ERROR, "attempt": 1, "failedTime": STAMP, "nextRetryTime": "2026-11-22T01:00:01Z",
               "message": "Attempt 1 of 2 failed; retrying at 2026-11-22T01:00:01Z"}
GIVEN_UP = {**{k: v for k, v in FAILED_ONCE.items() if k != "nextRetryTime"}, "attempt": 2,
            "message": "Failed 2 times; no retry is left (spec change or cachewarm.dev/rewarm runs it again)"}
RETRYING = {"name": "cpu", "job": J, "specHash": H, "state": "Pending", "attempt": 2, "lastError": LAST_ERROR,
            "message": "Retrying after attempt 1 failed"}
RETRIED = ("Normal", "WarmerRetried",
           f"Pool cpu: running warmer Job {J} again (attempt 2 of 2) after: {LAST_ERROR}")
CREATED = ("create Job", J, "WarmerCreated", f"Created warmer Job {J} for pool cpu")

NEW_IMAGE = spec(image="train:2")
J2 = name_of(NEW_IMAGE)
NEW_PROGRAM = spec(targets="train:slow_targets")
JP = name_of(NEW_PROGRAM)
SLICED = spec(V5P)
JS, SVC = name_of(SLICED, "v5p16"), jobs.service_name(NAME, "v5p16")
GPU = spec(L4)
TWO = spec({"name": "a"}, {"name": "b"})
JA, JB = name_of(TWO, "a"), name_of(TWO, "b")
NIGHTLY = spec(schedule="* * * * *")
SLOT_1, SLOT_2 = "|2026-11-22T01:00Z", "|2026-11-22T01:01Z"  # the re-warm token of each slot
JN1, JN2 = name_of(NIGHTLY, token=SLOT_1), name_of(NIGHTLY, token=SLOT_2)
JR = name_of(C, token="1")  # after `cachewarm.dev/rewarm=1`
UNKNOWN = shape_error(ODD)
INVALID = shape_error(BAD_HOSTS)
REFRESH_ERROR = "permission denied setting customTime of gs://b-1/jax/x-cache: needs storage.objects.update"
REFRESHED = {**WARM, "job": JR, "specHash": digest(C, token="1"), "entriesFound": 2, "entriesWritten": 0,
             "bytesWritten": 0, "refreshFailed": 2, "refreshError": REFRESH_ERROR}
del REFRESHED["imagePythonPath"], REFRESHED["fingerprint"]

FORGED = WARMUP + "test_a_pod_the_warmer_job_did_not_create_cannot_forge_its_results"
# What a pod anyone may label job-name=<Job> claims: every field it could put in status.
FORGERY = {"processIndex": 0, "entriesFound": 0, "entriesWritten": 9999, "bytesWritten": 9999, "compileSeconds": 99.0,
           "keys": ["ff"], "keyCount": 1, "fingerprint": {"platform": "tpu", "devices": 64},
           "imagePythonPath": "/evil", "manifestGeneration": "666", "errors": ["forged"]}


STRAY = WARMUP + "test_a_job_the_cache_does_not_control_is_stopped_and_never_read"
STOPPED_STRAY = ("Warning", "WarmerJobNotOurs",
                 f"Stopped Job {J}: it is labelled as a warmer of this cache, but it is not the Job the operator made "
                 "for it (the cache is not its controller, or its uid is not the one status recorded); its pods' results "
                 "are never read")


def IGNORED(*pods: str) -> tuple[str, ...]:  # noqa: N802 - reads as the table's constants
    return ("Warning", "WarmerPodIgnored",
            f"Ignored {len(pods)} pod(s) labelled job-name={J} that warmer Job {J} did not create ({', '.join(pods)}): "
            "a warmer's results are read only from the Job's own pods")


CASES: dict[str, Callable[[], Case]] = {
    # --- A first warm, its Job running, its results read once ---------------------------
    "first-warm": lambda: Case(HIT, C, steps=[CREATED], pools=[pending(C)], warmed_says="Warming: cpu Pending"),
    "running": lambda: Case(
        HIT, C, jobs=[job(J)], pods={J: [pod()]}, previous=[pending(C)],
        pools=[{"name": "cpu", "job": J, "specHash": H, "state": "Running", "startTime": STAMP, "nodes": ["node-a"],
                "attempt": 1}]),
    "succeeded": lambda: Case(
        HIT, C, jobs=[job(J, state="Succeeded")], pods={J: [pod(summary=SUMMARY)]}, previous=[pending(C)],
        context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached")],
        pools=[WARM], warmed=(True, "Warmed"), warmed_says="the 2 entries its warmers reported are in the bucket"),
    "same-spec-again-reads-nothing": lambda: Case(
        REWARMS, C, jobs=[job(J, state="Succeeded")], previous=[WARM],
        context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})}, pools=[WARM], warmed=(True, "Warmed")),
    "an-entry-deleted-since": lambda: Case(
        WARMUP + "test_warmed_means_the_entries_the_warmer_reported_are_in_the_bucket", C,
        jobs=[job(J, state="Succeeded")], previous=[WARM], context={"cache_entries": 1, "entry_keys": frozenset({"aa"})},
        pools=[WARM], warmed=(False, "EntriesMissing"), warmed_says="(cpu: 1 of 2)"),
    "restarted-mid-warm-creates-nothing": lambda: Case(
        WARMUP + "test_operator_killed_mid_warm_leaves_one_job_per_pool", TWO,
        jobs=[job(JA, "a", "Pending"), job(JB, "b", "Pending")], pods={JA: [], JB: []},
        pools=[pending(TWO, "a"), pending(TWO, "b")]),
    # --- Results only from the Job's own pods (a pod labelled job-name=<Job> is anyone's) -
    "forged-pod-beside-the-warmer-is-ignored": lambda: Case(
        FORGED, C, jobs=[job(J, state="Succeeded")], pods={J: [pod(summary={**SUMMARY, "manifestGeneration": "17"})]},
        forged={J: [pod("node-x", FORGERY, name="forger")]}, previous=[pending(C)],
        context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached"),
               IGNORED("forger")],
        pools=[{**WARM, "manifestObject": manifest(J), "manifestGeneration": "17"}], warmed=(True, "Warmed")),
    "only-a-forged-pod-says-nothing-of-it": lambda: Case(
        FORGED, C, jobs=[job(J, state="Succeeded")], pods={J: []}, forged={J: [pod("node-x", FORGERY, name="f")]},
        previous=[pending(C)], context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 0 entries written, 0 already cached"),
               IGNORED("f")],
        pools=[{k: v for k, v in WARM.items() if k in ("name", "job", "specHash", "state", "startTime",
                                                       "completionTime", "attempt")}],
        warmed=(True, "Warmed")),
    "a-forged-pod-of-a-running-job-is-not-read-nor-said": lambda: Case(
        FORGED, C, jobs=[job(J)], pods={J: []}, forged={J: [pod("node-x", FORGERY, name="f")]}, previous=[pending(C)],
        pools=[{"name": "cpu", "job": J, "specHash": H, "state": "Running", "startTime": STAMP, "attempt": 1}]),
    # --- A Job of the pool's name that the cache does not control (a tenant's, made before
    # the operator's, or orphaned): never read, stopped, the cache's own made once it is gone
    "a-stray-job-holding-the-name-is-stopped-not-read": lambda: Case(
        STRAY, C, jobs=[job(J, state="Succeeded", owners=[])], forged={J: [pod(summary=FORGERY, name="f")]},
        previous=[pending(C)], steps=[("delete Job", J), STOPPED_STRAY],
        pools=[{**pending(C), "message": f"Waiting for warmer Job {J} to stop"}]),
    "a-stray-job-of-another-kinds-controller-is-stopped-not-read": lambda: Case(
        STRAY, C, jobs=[job(J, owners=[{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": UID,
                                        "controller": True}])],
        previous=[pending(C)], steps=[("delete Job", J), STOPPED_STRAY],
        pools=[{**pending(C), "message": f"Waiting for warmer Job {J} to stop"}]),
    # Where the Jobs policy is not installed, a Job of the name controlled by the cache but
    # not of the uid status pinned (deleted and made again by someone else) is a stray too.
    "a-job-of-another-uid-than-the-pinned-one-is-stopped-not-read": lambda: Case(
        STRAY, C, jobs=[job(J, state="Succeeded")], forged={J: [pod(summary=FORGERY, name="f")]},
        previous=[pending(C, jobUid="uid-the-operator-created")], steps=[("delete Job", J), STOPPED_STRAY],
        pools=[{**pending(C), "message": f"Waiting for warmer Job {J} to stop", "jobUid": "uid-the-operator-created"}]),
    "the-job-of-the-pinned-uid-is-read": lambda: Case(
        HIT, C, jobs=[job(J)], pods={J: [pod()]}, previous=[pending(C, jobUid=job_uid(J))],
        pools=[{"name": "cpu", "job": J, "specHash": H, "state": "Running", "startTime": STAMP, "nodes": ["node-a"],
                "attempt": 1, "jobUid": job_uid(J)}]),
    "a-stray-job-being-deleted-is-waited-for": lambda: Case(
        STRAY, C, jobs=[job(J, state="Succeeded", owners=[], deleting=True)], previous=[pending(C)],
        pools=[{**pending(C), "message": f"Waiting for warmer Job {J} to stop"}]),
    "a-stray-job-of-a-generation-ahead-supersedes-nothing": lambda: Case(
        STRAY, C, jobs=[job(J2, generation=99, owners=[])], previous=[pending(C)],
        steps=[("delete Job", J2), STOPPED_STRAY[:2] + (STOPPED_STRAY[2].replace(J, J2),)],
        pools=[{**pending(C), "message": f"Waiting for warmer Job {J2} to stop"}]),
    "a-stray-job-after-a-recorded-warm-is-stopped-and-the-warm-kept": lambda: Case(
        STRAY, C, jobs=[job(J, state="Succeeded", owners=[])], previous=[WARM],
        context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("delete Job", J), STOPPED_STRAY], pools=[WARM], warmed=(True, "Warmed")),
    # --- The manifest's generation (D3): recorded as reported, with the object the Job
    # writes (one per Job, from the Job, not the summary), both kept while the pool re-warms
    "manifest-generation-recorded-with-the-jobs-own-object": lambda: Case(
        "", C, jobs=[job(J, state="Succeeded")],
        pods={J: [pod(summary={**SUMMARY, "manifestGeneration": "17", "manifestObject": "forged.json"})]},
        previous=[pending(C)], context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached")],
        pools=[{**WARM, "manifestObject": manifest(J), "manifestGeneration": "17"}], warmed=(True, "Warmed")),
    "manifest-generation-of-a-job-writing-elsewhere-is-not-recorded": lambda: Case(
        "", C, jobs=[job(J, state="Succeeded", manifest_url=f"gs://other-bucket/{manifest(J)}")],
        pods={J: [pod(summary={**SUMMARY, "manifestGeneration": "17"})]},
        previous=[pending(C)], context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached")],
        pools=[WARM], warmed=(True, "Warmed")),
    "manifest-generation-of-another-pools-object-is-not-recorded": lambda: Case(
        "", C, jobs=[job(J, state="Succeeded", manifest_url=f"gs://b-1/{manifest(J, 'h100')}")],
        pods={J: [pod(summary={**SUMMARY, "manifestGeneration": "17"})]},
        previous=[pending(C)], context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached")],
        pools=[WARM], warmed=(True, "Warmed")),
    "manifest-generation-before-per-job-objects-kept-with-the-pools-one": lambda: Case(
        REWARMS, NEW_IMAGE, jobs=[job(J, state="Succeeded")], previous=[{**WARM, "manifestGeneration": "17"}],
        context={"cache_entries": 2, "warmed_before": True},
        steps=[("create Job", J2, "WarmerCreated", f"Created warmer Job {J2} for pool cpu")],
        pools=[pending(NEW_IMAGE, manifestObject=f".cachewarm/pools/{NS}/{NAME}/cpu.json", manifestGeneration="17")],
        warmed=(True, "Rewarming")),
    "manifest-generation-not-decimal-is-not-recorded": lambda: Case(
        "", C, jobs=[job(J, state="Succeeded")], pods={J: [pod(summary={**SUMMARY, "manifestGeneration": "1e9"})]},
        previous=[pending(C)], context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"})},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J} finished: 2 entries written, 0 already cached")],
        pools=[{**WARM, "message": "Ignored invalid fields of the warmer's summary: manifestGeneration"}],
        warmed=(True, "Warmed")),
    "manifest-generation-kept-while-rewarming": lambda: Case(
        REWARMS, NEW_IMAGE, jobs=[job(J, state="Succeeded")],
        previous=[{**WARM, "manifestObject": manifest(J), "manifestGeneration": "17"}],
        context={"cache_entries": 2, "warmed_before": True},
        steps=[("create Job", J2, "WarmerCreated", f"Created warmer Job {J2} for pool cpu")],
        pools=[pending(NEW_IMAGE, manifestObject=manifest(J), manifestGeneration="17")], warmed=(True, "Rewarming")),
    "manifest-generation-replaced-by-the-new-warmers": lambda: Case(
        REWARMS, NEW_IMAGE, jobs=[job(J2, state="Succeeded", image="train:2")],
        pods={J2: [pod(summary={**SUMMARY, "manifestGeneration": "18"})]},
        previous=[pending(NEW_IMAGE, manifestObject=manifest(J), manifestGeneration="17")],
        context={"cache_entries": 2, "entry_keys": frozenset({"aa", "bb"}), "warmed_before": True},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {J2} finished: 2 entries written, 0 already cached")],
        pools=[{**WARM, "job": J2, "specHash": digest(NEW_IMAGE), "manifestObject": manifest(J2), "manifestGeneration": "18",
                "imagePythonPath": {"image": "train:2", "value": "/app"}}], warmed=(True, "Warmed")),
    # --- A new program: a new Job, the old one stopped first ---------------------------
    "image-change-after-a-finished-warm": lambda: Case(
        REWARMS, NEW_IMAGE, jobs=[job(J, state="Succeeded")], previous=[WARM],
        context={"cache_entries": 2, "warmed_before": True},
        steps=[("create Job", J2, "WarmerCreated", f"Created warmer Job {J2} for pool cpu")],
        pools=[pending(NEW_IMAGE)], warmed=(True, "Rewarming")),
    "rewarm-annotation": lambda: Case(
        WARMUP + "test_a_pod_created_while_a_warmed_cache_rewarms_is_not_held", C, jobs=[job(J, state="Succeeded")],
        previous=[WARM], context={"annotations": {"cachewarm.dev/rewarm": "1"}, "cache_entries": 2,
                                  "warmed_before": True},
        steps=[("create Job", JR, "WarmerCreated", f"Created warmer Job {JR} for pool cpu")],
        pools=[pending(C, token="1")], warmed=(True, "Rewarming"),
        warmed_says="Re-warming: cpu Pending; the 2 entries already cached stay in use"),
    "program-change-stops-the-running-warmer": lambda: Case(
        SWAP, NEW_PROGRAM, jobs=[job(J, generation=1)], previous=[{**pending(C), "state": "Running"}],
        steps=[("delete Job", J), ("Normal", "WarmerStopped", f"Stopped warmer Job {J}: the program changed")],
        pools=[pending(NEW_PROGRAM, message=f"Waiting for warmer Job {J} to stop")]),
    "old-warmer-still-being-deleted": lambda: Case(
        SWAP, NEW_PROGRAM, jobs=[job(J, generation=1, deleting=True)],
        previous=[pending(NEW_PROGRAM, message=f"Waiting for warmer Job {J} to stop")],
        pools=[pending(NEW_PROGRAM, message=f"Waiting for warmer Job {J} to stop")]),
    "old-warmer-gone-the-new-one-starts": lambda: Case(
        SWAP, NEW_PROGRAM, previous=[pending(NEW_PROGRAM, message=f"Waiting for warmer Job {J} to stop")],
        steps=[("create Job", JP, "WarmerCreated", f"Created warmer Job {JP} for pool cpu")],
        pools=[pending(NEW_PROGRAM)]),
    # --- A failed warmer: retried after its delay, then left Failed ---------------------
    "failed": lambda: Case(
        FAILS, C, jobs=[job(J, state="Failed")], pods={J: [pod(summary=BOOM)]},
        previous=[{**pending(C), "state": "Running"}], context={"retry": RETRY_ONCE},
        steps=[("Warning", "WarmerFailed", f"Warmer Job {J} failed: {LAST_ERROR}")], pools=[FAILED_ONCE],
        warmed=(False, "WarmupFailed"), warmed_says=f"Warmer failed on cpu: {LAST_ERROR} (Attempt 1 of 2 failed"),
    "failed-in-an-image-without-the-gcs-libraries": lambda: Case(
        WARMUP + "test_a_warmer_in_an_image_without_the_gcs_libraries_fails_and_says_so", C,
        jobs=[job(J, state="Failed")], pods={J: [pod(summary={**BOOM, "errors": [LACKS]})]},
        previous=[{**pending(C), "state": "Running"}], context={"retry": RETRY_ONCE},
        steps=[("Warning", "WarmerFailed", f"Warmer Job {J} failed: {LACKS}")],
        pools=[{**FAILED_ONCE, "lastError": LACKS}], warmed=(False, "WarmupFailed"), warmed_says=LACKS),
    "failed-retry-not-due-yet": lambda: Case(
        FAILS, C, jobs=[job(J, state="Failed")], previous=[FAILED_ONCE], context={"retry": RETRY_ONCE},
        pools=[FAILED_ONCE], warmed=(False, "WarmupFailed")),
    "failed-retry-due-stops-the-job-first": lambda: Case(
        FAILS, C, jobs=[job(J, state="Failed")], previous=[FAILED_ONCE],
        context={"retry": RETRY_ONCE, "now": NOW + dt.timedelta(seconds=1)},
        steps=[("delete Job", J), RETRIED], pools=[RETRYING], warmed_says="cpu Pending (Retrying after attempt 1"),
    "retry-waits-while-its-job-is-deleted-foreground": lambda: Case(
        FAILS, C, jobs=[job(J, state="Failed", deleting=True)], previous=[RETRYING], context={"retry": RETRY_ONCE},
        pools=[{**RETRYING, "message": f"Waiting for warmer Job {J} to stop"}]),
    "retry-runs-the-same-job-again": lambda: Case(
        FAILS, C, previous=[RETRYING], context={"retry": RETRY_ONCE}, steps=[CREATED], pools=[pending(C, attempt=2)]),
    "retries-exhausted": lambda: Case(
        FAILS, C, jobs=[job(J, state="Failed")], pods={J: [pod(summary=BOOM)]},
        previous=[{**pending(C, attempt=2), "state": "Running"}], context={"retry": RETRY_ONCE},
        steps=[("Warning", "WarmerFailed", f"Warmer Job {J} failed: {LAST_ERROR}")],
        pools=[GIVEN_UP],
        warmed=(False, "WarmupFailed")),
    "failed-job-expired-retried-when-due": lambda: Case(
        FAILS, C, previous=[FAILED_ONCE], context={"retry": RETRY_ONCE, "now": NOW + dt.timedelta(seconds=5)},
        steps=[RETRIED, CREATED], pools=[pending(C, attempt=2)]),
    # --- Pools: one host, several (their Service), the scheduler's answer, invalid shapes ---
    "single-host-accelerator-pool": lambda: Case(
        POOLS + "test_single_host_pool_warms_on_its_node_and_a_training_pod_there_hits", GPU,
        steps=[("create Job", name_of(GPU, "l4"), "WarmerCreated", f"Created warmer Job {name_of(GPU, 'l4')} for pool l4")],
        pools=[pending(GPU, "l4")]),
    "multi-host-creates-its-service-first": lambda: Case(
        SLICE, SLICED, steps=[("create Service", SVC), ("create Job", JS, "WarmerCreated",
                                                       f"Created warmer Job {JS} for pool v5p16")],
        pools=[pending(SLICED, "v5p16")]),
    "multi-host-service-kept-while-its-warmer-runs": lambda: Case(
        SLICE, SLICED, jobs=[job(JS, "v5p16")], services=[service("v5p16")],
        pods={JS: [pod("gke-v5p16-0"), pod("gke-v5p16-1")]}, previous=[pending(SLICED, "v5p16")],
        pools=[{**pending(SLICED, "v5p16"), "state": "Running", "startTime": STAMP,
                "nodes": ["gke-v5p16-0", "gke-v5p16-1"]}]),
    "multi-host-service-deleted-once-finished": lambda: Case(
        SLICE, SLICED, jobs=[job(JS, "v5p16", "Succeeded")], services=[service("v5p16")],
        pods={JS: [pod("gke-v5p16-1", {"processIndex": 1, "entriesWritten": 0, "compileSeconds": 9.0, "errors": []}),
                   pod("gke-v5p16-0", {"processIndex": 0, "entriesWritten": 3, "bytesWritten": 90,
                                       "compileSeconds": 7.0, "errors": []})]},
        previous=[{**pending(SLICED, "v5p16"), "state": "Running"}], context={"cache_entries": 3},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {JS} finished: 3 entries written, 0 already cached"),
               ("delete Service", SVC)],
        pools=[{"name": "v5p16", "job": JS, "specHash": digest(SLICED, "v5p16"), "state": "Succeeded",
                "startTime": STAMP, "completionTime": STAMP, "nodes": ["gke-v5p16-0", "gke-v5p16-1"],
                "entriesFound": 0, "entriesWritten": 3, "bytesWritten": 90, "compileSeconds": 9.0, "attempt": 1}],
        warmed=(True, "Warmed")),
    "unschedulable": lambda: Case(
        POOLS + "test_pool_without_a_matching_node_reports_the_schedulers_reason", GPU,
        jobs=[job(name_of(GPU, "l4"), "l4", "Pending")], pods={name_of(GPU, "l4"): [pod(None, unschedulable=NODES_FULL)]},
        previous=[pending(GPU, "l4")],
        steps=[("Warning", "Unschedulable",
                f"Warmer Job {name_of(GPU, 'l4')} cannot be scheduled: Unschedulable: {NODES_FULL}")],
        pools=[pending(GPU, "l4", reason="Unschedulable", message=f"Unschedulable: {NODES_FULL}")],
        warmed=(False, "Unschedulable"), warmed_says="Warming: l4 Pending (Unschedulable: 0/8 nodes"),
    "unschedulable-said-once": lambda: Case(
        POOLS + "test_pool_without_a_matching_node_reports_the_schedulers_reason", GPU,
        jobs=[job(name_of(GPU, "l4"), "l4", "Pending")], pods={name_of(GPU, "l4"): [pod(None, unschedulable=NODES_FULL)]},
        previous=[pending(GPU, "l4", reason="Unschedulable", message=f"Unschedulable: {NODES_FULL}")],
        pools=[pending(GPU, "l4", reason="Unschedulable", message=f"Unschedulable: {NODES_FULL}")],
        warmed=(False, "Unschedulable")),
    # No e2e changes a multi-host pool's program or hosts: the Service stays while a
    # stopping warmer may still use it, whatever the new warmer needs.
    "multi-host-program-change-keeps-the-service-while-the-old-warmer-stops": lambda: Case(
        "", spec(V5P, targets="train:slow_targets"), jobs=[job(JS, "v5p16", generation=1)],
        services=[service("v5p16")],
        steps=[("delete Job", JS), ("Normal", "WarmerStopped", f"Stopped warmer Job {JS}: the program changed")],
        pools=[pending(spec(V5P, targets="train:slow_targets"), "v5p16",
                       message=f"Waiting for warmer Job {JS} to stop")]),
    "one-host-now-keeps-the-service-while-the-two-host-warmer-stops": lambda: Case(
        "", spec({**H100, "hosts": 1}), jobs=[job(name_of(spec(H100), "h100"), "h100", generation=1)],
        services=[service("h100")],
        steps=[("delete Job", name_of(spec(H100), "h100")),
               ("Normal", "WarmerStopped", f"Stopped warmer Job {name_of(spec(H100), 'h100')}: the program changed")],
        pools=[pending(spec({**H100, "hosts": 1}), "h100",
                       message=f"Waiting for warmer Job {name_of(spec(H100), 'h100')} to stop")]),
    "unknown-tpu-shape": lambda: Case(
        POOLS + "test_unknown_tpu_shape_is_a_condition_and_the_bucket_is_still_reported", spec(ODD),
        steps=[("Warning", "UnknownTpuShape", f"Pool odd: {UNKNOWN}")],
        pools=[{"name": "odd", "state": "Failed", "reason": "UnknownTpuShape", "message": str(UNKNOWN),
                "lastError": str(UNKNOWN)}],
        warmed=(False, "UnknownTpuShape"), warmed_says=f"Cannot warm pool odd: {UNKNOWN}"),
    "unknown-tpu-shape-said-once": lambda: Case(
        POOLS + "test_unknown_tpu_shape_is_a_condition_and_the_bucket_is_still_reported", spec(ODD),
        previous=[{"name": "odd", "state": "Failed", "reason": "UnknownTpuShape", "message": str(UNKNOWN),
                   "lastError": str(UNKNOWN)}],
        pools=[{"name": "odd", "state": "Failed", "reason": "UnknownTpuShape", "message": str(UNKNOWN),
                "lastError": str(UNKNOWN)}], warmed=(False, "UnknownTpuShape")),
    "invalid-shape-stops-old-warmers-keeping-their-service": lambda: Case(
        POOLS + "test_unknown_tpu_shape_is_a_condition_and_the_bucket_is_still_reported", spec(BAD_HOSTS),
        jobs=[job(J, generation=1)], services=[service("cpu")],
        steps=[("delete Job", J), ("Normal", "WarmerStopped", f"Stopped warmer Job {J}: the pool's TPU shape is invalid"),
               ("Warning", "InvalidTpuShape", f"Pool cpu: {INVALID}")],
        pools=[{"name": "cpu", "state": "Failed", "reason": "InvalidTpuShape", "message": str(INVALID),
                "lastError": str(INVALID)}], warmed=(False, "InvalidTpuShape")),
    "a-newer-specs-warmer-is-left-alone": lambda: Case(
        POOLS + "test_operator_kills_while_the_spec_changes_leave_one_warmer_per_pool", SLICED,
        jobs=[job("llama-v5p16-newer", "v5p16", generation=3)], services=[service("v5p16")],
        previous=[{"name": "v5p16", "job": "llama-v5p16-newer", "specHash": "newer", "state": "Pending"}],
        pools=[{"name": "v5p16", "job": "llama-v5p16-newer", "specHash": "newer", "state": "Pending"}]),
    # No e2e removes a pool; its warmers are stopped the third way the planner has.
    "pool-removed-from-the-spec": lambda: Case(
        "", spec({"name": "a"}),
        jobs=[job(name_of(spec({"name": "a"}), "a"), "a", "Succeeded"), job("llama-v5p16-old", "v5p16")],
        services=[service("v5p16")], previous=[{**WARM, "name": "a", "job": name_of(spec({"name": "a"}), "a"),
                                                 "specHash": digest(spec({"name": "a"}), "a")}],
        context={"cache_entries": 2},
        steps=[("delete Job", "llama-v5p16-old"),
               ("Normal", "WarmerStopped", "Stopped warmer Job llama-v5p16-old: pool v5p16 was removed from the spec"),
               ("delete Service", SVC)],
        pools=[{**WARM, "name": "a", "job": name_of(spec({"name": "a"}), "a"), "specHash": digest(spec({"name": "a"}), "a")}],
        warmed=(True, "Warmed")),
    # --- A cron schedule: each slot a new program, its slot recorded --------------------
    "cron-slot-first-warm": lambda: Case(
        CRON, NIGHTLY, context={"now": NOW + dt.timedelta(seconds=30)},
        steps=[("create Job", JN1, "WarmerCreated", f"Created warmer Job {JN1} for pool cpu")],
        pools=[pending(NIGHTLY, token=SLOT_1, scheduledTime=STAMP)]),
    "cron-next-slot-new-warmer": lambda: Case(
        CRON, NIGHTLY, jobs=[job(JN1, state="Succeeded")],
        previous=[{**WARM, "job": JN1, "specHash": digest(NIGHTLY, token=SLOT_1), "scheduledTime": STAMP}],
        context={"now": NOW + dt.timedelta(seconds=61), "cache_entries": 2, "warmed_before": True},
        steps=[("create Job", JN2, "WarmerCreated", f"Created warmer Job {JN2} for pool cpu")],
        pools=[pending(NIGHTLY, token=SLOT_2, scheduledTime="2026-11-22T01:01:00Z")], warmed=(True, "Rewarming")),
    "cron-next-slot-stops-a-warmer-still-running": lambda: Case(
        CRON, NIGHTLY, jobs=[job(JN1)], previous=[{**pending(NIGHTLY, token=SLOT_1), "state": "Running"}],
        context={"now": NOW + dt.timedelta(seconds=60)},
        steps=[("delete Job", JN1), ("Normal", "WarmerStopped", f"Stopped warmer Job {JN1}: the program changed")],
        pools=[pending(NIGHTLY, token=SLOT_2, message=f"Waiting for warmer Job {JN1} to stop",
                       scheduledTime="2026-11-22T01:01:00Z")]),
    # --- Last use not refreshed: said in status and one Warning, the warm a success ------
    "refresh-refused": lambda: Case(
        LAST_USE, C, jobs=[job(JR, state="Succeeded")],
        pods={JR: [pod(summary={"processIndex": 0, "entriesFound": 2, "entriesWritten": 0, "keys": ["aa", "bb"],
                                "keyCount": 2, "compileSeconds": 4.0, "refreshFailed": 2,
                                "refreshError": REFRESH_ERROR, "errors": []})]},
        previous=[pending(C, token="1")],
        context={"annotations": {"cachewarm.dev/rewarm": "1"}, "cache_entries": 2,
                 "entry_keys": frozenset({"aa", "bb"}), "warmed_before": True},
        steps=[("Normal", "WarmerSucceeded", f"Warmer Job {JR} finished: 0 entries written, 2 already cached"),
               ("Warning", "LastUseNotRefreshed",
                f"Warmer Job {JR} could not refresh entries' customTime: {REFRESH_ERROR}")],
        pools=[REFRESHED], warmed=(True, "Warmed")),
    "refresh-refused-said-once": lambda: Case(
        LAST_USE, C, jobs=[job(JR, state="Succeeded")], previous=[REFRESHED],
        context={"annotations": {"cachewarm.dev/rewarm": "1"}, "cache_entries": 2,
                 "entry_keys": frozenset({"aa", "bb"})},
        pools=[REFRESHED], warmed=(True, "Warmed")),
}


@pytest.mark.parametrize("scenario", sorted(CASES))
def test_the_plan_of_each_warmup_scenario(scenario: str) -> None:
    case = CASES[scenario]()
    ctx = WarmContext(case.cache, NS, NAME, UID, warmer_image="w", generation=2, previous=case.previous,
                      **{"now": NOW, **case.context})
    assert results_to_read(ctx, case.jobs) == list(case.pods)
    listed = {j: [*owned_by(j, pods), *case.forged.get(j, [])] for j, pods in case.pods.items()}
    plan = plan_warmup(ctx, WarmView(case.jobs, case.services, listed))
    assert [said(s) for s in plan.steps] == case.steps
    # The uid of the Job an entry was read from (or that the plan found pinned) is pinned in
    # it: checked here against the listed Jobs and left out of the table's entries.
    uids = {j["metadata"]["name"]: j["metadata"]["uid"] for j in case.jobs}
    for entry, expected in zip(plan.pools, case.pools):
        if "jobUid" in entry and "jobUid" not in expected:
            assert entry.pop("jobUid") == uids.get(entry["job"]), entry
    assert plan.pools == case.pools
    assert (plan.condition.status, plan.condition.reason) == case.warmed, plan.condition
    assert case.warmed_says in plan.condition.message


def test_each_case_names_an_e2e_test_that_exists() -> None:
    """So that a renamed or removed e2e test shows here, where its scenario's plan is."""
    root = pathlib.Path(__file__).resolve().parents[2]
    for scenario, case in ((s, make()) for s, make in CASES.items()):
        if case.e2e:
            path, _, test = case.e2e.partition("::")
            assert f"def {test}(" in (root / path).read_text(), (scenario, case.e2e)


def test_the_created_objects_are_the_builders_for_this_cache() -> None:
    """Create carries what the builders make for this pool (golden-pinned there), owned by
    this cache, with the generation the reconcile holds."""
    plan = plan_warmup(WarmContext(SLICED, NS, NAME, UID, NOW, "w", 7), WarmView())
    service_body, job_body = (s.body for s in plan.steps if isinstance(s, Create))
    assert SLICED.warmup is not None
    pool = SLICED.warmup.pools[0]
    owner = {"name": NAME, "uid": UID}
    assert service_body == jobs.headless_service(NAME, NS, pool, owner)
    assert job_body == jobs.warmer_job(SLICED, cache_name=NAME, namespace=NS, pool=pool, digest=digest(SLICED, "v5p16"),
                                       owner=owner, warmer_image="w", generation=7)


def test_the_plan_reads_only_the_view_it_is_given() -> None:
    """The same view and context plan the same, and planning changes neither: the plan is a
    value, safe to compute again after a failed apply."""
    view = WarmView([job(J, state="Succeeded")], [service("cpu")], {J: owned_by(J, [pod(summary=SUMMARY)])})
    before = json.dumps([view.jobs, view.services, view.pods], sort_keys=True)
    ctx = WarmContext(C, NS, NAME, UID, NOW, "w", 2, previous=[pending(C)])
    assert plan_warmup(ctx, view) == plan_warmup(ctx, view)
    assert json.dumps([view.jobs, view.services, view.pods], sort_keys=True) == before


def test_a_current_job_whose_pods_were_not_read_is_an_error_not_an_empty_result() -> None:
    ctx = WarmContext(C, NS, NAME, UID, NOW, "w", 2)
    with pytest.raises(KeyError):
        plan_warmup(ctx, WarmView([job(J, state="Succeeded")]))


def test_only_a_batch_job_controller_reference_makes_a_pod_the_jobs() -> None:
    """The Job's uid under another group's "Job" (which manifests/policy/warmer_pods.yaml does
    not refuse, it matches batch/ only) is not the Job's: the pod is one of the others."""
    from cachewarm.reconcile.warmplan import owned_pods

    the_job = {"metadata": {"name": J, "uid": job_uid(J)}}
    [real] = owned_by(J, [pod()])
    ref = {"apiVersion": "evil.example/v1", "kind": "Job", "name": J, "uid": job_uid(J), "controller": True}
    fake = {**pod(), "metadata": {"name": "fake", "ownerReferences": [ref]}}
    assert owned_pods(the_job, [real, fake]) == ([real], [fake])
