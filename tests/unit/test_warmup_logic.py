"""Pure parts of the warmup reconcile: re-warm tokens, Job state, summaries, pods,
the stop-before-start plan, Warmed."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from cachewarm.builders.job import service_name
from cachewarm.api.model import parse_spec
from cachewarm.reconcile.warmplan import (
    ObservedJob,
    PodsView,
    PoolPlan,
    _job_state,
    image_pythonpath,
    warmed_condition,
    observe,
    plan_pool,
    pool_status,
    read_pods,
    read_summaries,
    rewarm_token,
)
from cachewarm.reconcile.warmup import WarmupOutcome, reconcile_warmup, release_waiting_pods
from memkube import MemoryKube


def spec(schedule: str | None = None, env: dict[str, str] | None = None) -> Any:
    warmup: dict[str, Any] = {"image": "i", "targets": ["m:f"], "pools": [{"name": "p"}]}
    if schedule:
        warmup["schedule"] = schedule
    if env:
        warmup["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": warmup})


def at(hour: int, minute: int = 0) -> dt.datetime:
    return dt.datetime(2026, 11, 22, hour, minute, tzinfo=dt.timezone.utc)


def test_cron_slot_changes_the_token_only_at_the_next_slot() -> None:
    daily = spec("0 3 * * *")
    assert rewarm_token(daily, {}, at(3, 1)) == rewarm_token(daily, {}, at(23, 59))
    assert rewarm_token(daily, {}, at(2, 59)) != rewarm_token(daily, {}, at(3, 0))


def test_manual_annotation_is_part_of_the_token() -> None:
    assert rewarm_token(spec(), {"cachewarm.dev/rewarm": "2"}, at(1)) != rewarm_token(spec(), {}, at(1))
    assert rewarm_token(spec(), {}, at(1)) == rewarm_token(spec(), {}, at(20))  # no schedule: time is irrelevant


def test_job_state_from_conditions() -> None:
    assert _job_state({"status": {}}) == "Pending"
    assert _job_state({"status": {"active": 1, "startTime": "t"}}) == "Running"
    assert _job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "Succeeded"
    assert _job_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "Failed"
    assert _job_state({"status": {"conditions": [{"type": "Failed", "status": "False"}], "active": 1}}) == "Running"


def pod(message: str, name: str = "warm") -> dict[str, Any]:
    return {"status": {"containerStatuses": [{"name": name, "state": {"terminated": {"message": message}}}]}}


def test_summaries_are_read_from_termination_messages() -> None:
    good = json.dumps({"entriesFound": 1, "entriesWritten": 2, "bytesWritten": 10, "compileSeconds": 3.5, "errors": []})
    assert read_summaries([pod(good), pod("", "other")]) == [json.loads(good)]
    assert read_summaries([pod("Traceback ... MemoryError")]) == [{"errors": ["Traceback ... MemoryError"]}]


def test_two_host_summaries_count_each_entry_once_from_process_0() -> None:
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}], "startTime": "s", "completionTime": "c"}}
    # Process 1 sees process 0's entries appear in the shared cache; only process 0's count.
    summaries = [{"processIndex": 1, "entriesFound": 0, "entriesWritten": 0, "bytesWritten": 0, "compileSeconds": 7},
                 {"processIndex": 0, "entriesFound": 0, "entriesWritten": 3, "bytesWritten": 30, "compileSeconds": 5}]
    pool = spec().warmup.pools[0]
    assert pool_status("j", pool, "h", job, summaries, PodsView(("node-a", "node-b"))) == {
        "name": "p", "job": "j", "specHash": "h", "state": "Succeeded", "startTime": "s", "completionTime": "c",
        "entriesFound": 0, "entriesWritten": 3, "bytesWritten": 30, "compileSeconds": 7.0,
        "nodes": ["node-a", "node-b"]}


def test_summaries_without_process_index_are_process_0() -> None:
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    status = pool_status("j", spec().warmup.pools[0], "h", job, [{"entriesWritten": 2, "bytesWritten": 9}])
    assert (status["entriesWritten"], status["bytesWritten"]) == (2, 9)


def test_a_refresh_that_was_refused_is_reported_without_failing_the_pool() -> None:
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    error = "permission denied setting customTime of gs://b/p/x-cache: ... needs storage.objects.update"
    summaries = [{"processIndex": 1, "entriesWritten": 0, "refreshFailed": 0},
                 {"processIndex": 0, "entriesWritten": 2, "refreshFailed": 4, "refreshError": error}]
    status = pool_status("j", spec().warmup.pools[0], "h", job, summaries)
    assert (status["state"], status["refreshFailed"], status["refreshError"]) == ("Succeeded", 4, error)
    assert "lastError" not in status
    clean = pool_status("j", spec().warmup.pools[0], "h", job, [{"entriesWritten": 2, "refreshFailed": 0}])
    assert "refreshFailed" not in clean and "refreshError" not in clean


UNSCHEDULABLE = ("0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                 "4 Insufficient google.com/tpu. preemption: 0/5 nodes are available.")


def scheduling_pod(node: str | None, unschedulable: bool) -> dict[str, Any]:
    conds = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHEDULABLE}] \
        if unschedulable else [{"type": "PodScheduled", "status": "True"}]
    return {"spec": {"nodeName": node} if node else {}, "status": {"conditions": conds}}


def test_unschedulable_pod_makes_the_pool_pending_with_the_schedulers_message() -> None:
    view = read_pods([scheduling_pod("tpu-0", False), scheduling_pod(None, True)])
    assert view == PodsView(("tpu-0",), UNSCHEDULABLE)
    running = {"status": {"active": 2, "startTime": "s"}}
    status = pool_status("j", spec().warmup.pools[0], "h", running, [], view)
    assert status["state"] == "Pending"
    assert status["reason"] == "Unschedulable"
    assert status["message"] == f"Unschedulable: {UNSCHEDULABLE}"
    assert status["nodes"] == ["tpu-0"]
    cond = warmed_condition([status], 0)
    assert cond.reason == "Unschedulable" and UNSCHEDULABLE in cond.message
    # Once the Job finished, a stale scheduling condition no longer says anything.
    done = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
    assert "reason" not in pool_status("j", spec().warmup.pools[0], "h", done, [], view)


def obs(name: str, state: str = "Running", deleting: bool = False, generation: int = 1,
        foreign: bool = False, stray: bool = False) -> ObservedJob:
    return ObservedJob(name, state, deleting, generation, foreign, stray)


@pytest.mark.parametrize(("jobs", "generation", "expected"), [
    pytest.param([], 1, PoolPlan(create=True), id="nothing-yet"),
    pytest.param([obs("new")], 1, PoolPlan(), id="current-exists"),
    pytest.param([obs("old", "Succeeded")], 1, PoolPlan(create=True), id="finished-old-does-not-block"),
    pytest.param([obs("old")], 2, PoolPlan(delete=("old",), waiting_for=("old",)), id="stale-deleted-then-wait"),
    pytest.param([obs("old", "Pending")], 2, PoolPlan(delete=("old",), waiting_for=("old",)), id="pending-is-unfinished"),
    pytest.param([obs("old", deleting=True)], 2, PoolPlan(waiting_for=("old",)), id="being-deleted-still-blocks"),
    pytest.param([obs("old", deleting=True), obs("older", generation=0)], 2,
                 PoolPlan(delete=("older",), waiting_for=("old", "older")), id="several"),
    pytest.param([obs("new", deleting=True)], 1, PoolPlan(waiting_for=("new",)), id="current-being-deleted"),
    pytest.param([obs("other", generation=3)], 2, PoolPlan(superseded=True), id="newer-generation-exists"),
    pytest.param([obs("other", "Succeeded", generation=3)], 2, PoolPlan(superseded=True), id="newer-finished"),
    pytest.param([obs("old", generation=2)], 2, PoolPlan(delete=("old",), waiting_for=("old",)),
                 id="same-generation-rewarm"),
    # Left by a deleted cache of the same name until the garbage collector removes them.
    pytest.param([obs("other", generation=3, foreign=True)], 2, PoolPlan(create=True), id="foreign-newer-generation"),
    pytest.param([obs("old", foreign=True)], 2, PoolPlan(create=True), id="foreign-running-is-not-deleted"),
    pytest.param([obs("new", generation=5, foreign=True)], 2, PoolPlan(waiting_for=("new",)),
                 id="foreign-holds-the-name"),
    # Strays: under the cache's warmer label, controlled by no CompilationCache (made by
    # anyone who may create Jobs, or orphaned). The one holding the desired name is stopped
    # whatever its state and never counts as the current Job; its forged generation
    # supersedes nothing.
    pytest.param([obs("new", "Succeeded", stray=True)], 2, PoolPlan(waiting_for=("new",), strays=("new",)),
                 id="stray-finished-holds-the-name"),
    pytest.param([obs("new", stray=True)], 2, PoolPlan(waiting_for=("new",), strays=("new",)),
                 id="stray-running-holds-the-name"),
    pytest.param([obs("new", "Succeeded", deleting=True, stray=True)], 2, PoolPlan(waiting_for=("new",)),
                 id="stray-holding-the-name-being-deleted"),
    pytest.param([obs("new", generation=99, stray=True)], 2, PoolPlan(waiting_for=("new",), strays=("new",)),
                 id="stray-newer-generation-supersedes-nothing"),
    pytest.param([obs("old", stray=True)], 2, PoolPlan(waiting_for=("old",), strays=("old",)),
                 id="stray-unfinished-is-stopped"),
    pytest.param([obs("old", "Failed", stray=True)], 2, PoolPlan(create=True), id="stray-finished-is-left"),
])
def test_never_two_warmers_for_one_pool(jobs: list[ObservedJob], generation: int, expected: PoolPlan) -> None:
    assert plan_pool(jobs, "new", generation) == expected


def test_a_pool_without_a_valid_job_only_stops_older_ones() -> None:
    assert plan_pool([obs("old"), obs("done", "Failed")], None, 2) == PoolPlan(delete=("old",), waiting_for=("old",))
    assert plan_pool([], None, 2) == PoolPlan()


def test_observe_reads_generation_and_deletion() -> None:
    mine = [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "uid": "u-1", "controller": True}]
    job = {"metadata": {"name": "j", "annotations": {"cachewarm.dev/generation": "4"}, "ownerReferences": mine,
                        "deletionTimestamp": "2026-11-22T00:00:00Z"}, "status": {"active": 1}}
    assert observe(job, "u-1") == ObservedJob("j", "Running", True, 4)
    assert observe({"metadata": {"name": "legacy", "ownerReferences": mine}, "status": {}}, "u-1") == \
        ObservedJob("legacy", "Pending", False, 0)


def test_invalid_tpu_shape_is_its_own_warmed_reason() -> None:
    bad = {"name": "v5p", "state": "Failed", "reason": "UnknownTpuShape", "message": "No GKE machine shape ..."}
    cond = warmed_condition([{"name": "a", "state": "Succeeded"}, bad], 3)
    assert (cond.status, cond.reason) == (False, "UnknownTpuShape")
    assert cond.message == "Cannot warm pool v5p: No GKE machine shape ..."


def test_warmed_needs_every_pool_and_entries_on_the_bucket() -> None:
    ok = {"name": "a", "state": "Succeeded"}
    assert warmed_condition([ok, {"name": "b", "state": "Running"}], 5).reason == "Warming"
    assert warmed_condition([ok, {"name": "b", "state": "Failed", "lastError": "boom"}], 5).message == "Warmer failed on b: boom"
    assert warmed_condition([ok], 0).reason == "CacheEmpty"
    assert warmed_condition([ok], 3).status is True


def test_a_rewarm_of_a_usable_cache_stays_warmed_and_a_first_warm_does_not() -> None:
    running = [{"name": "a", "state": "Succeeded"}, {"name": "b", "state": "Running"}]
    rewarm = warmed_condition(running, 5, warmed_before=True)
    assert (rewarm.status, rewarm.reason) == (True, "Rewarming")
    assert rewarm.message == "Re-warming: b Running; the 5 entries already cached stay in use"
    assert warmed_condition(running, 5, warmed_before=False).reason == "Warming"
    assert warmed_condition(running, 0, warmed_before=True).status is False  # nothing left to read
    failed = warmed_condition([{"name": "b", "state": "Failed", "lastError": "boom"}], 5, warmed_before=True)
    assert (failed.status, failed.reason) == (False, "WarmupFailed")


def gated_pod(name: str, created: str = "2026-01-01T00:00:00Z", cache: str = "llama") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": created,
                         "labels": {"cachewarm.dev/cache": cache}},
            "spec": {"schedulingGates": [{"name": "other"}, {"name": "cachewarm.dev/wait-for-warm"}]}}


def test_a_release_with_a_reason_frees_every_held_pod_of_that_cache_only() -> None:
    kube = MemoryKube(pods=[gated_pod("p1"), gated_pod("p2"), gated_pod("theirs", cache="other"),
                            {"metadata": {"name": "free", "namespace": "ml", "labels": {"cachewarm.dev/cache": "llama"}},
                             "spec": {}}])
    waiting, events = release_waiting_pods(kube, None, namespace="ml", name="llama", warmed=False,
                                           now=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
                                           why="the cache was deleted")
    assert waiting == 0 and kube.released == [("ml", "p1", 1), ("ml", "p2", 1)]
    assert [(e.reason, e.message) for e in events] == [
        ("PodReleased", "Released pod p1: the cache was deleted"), ("PodReleased", "Released pod p2: the cache was deleted")]
    assert [g["name"] for g in kube.pods[2]["spec"]["schedulingGates"]] == ["other", "cachewarm.dev/wait-for-warm"]


def test_a_pod_is_held_until_warm_or_timed_out() -> None:
    kube = MemoryKube(pods=[gated_pod("p1"), gated_pod("p2", created="2026-01-01T00:09:00Z")])
    cache = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                        "injection": {"waitForWarm": {"enabled": True, "timeoutSeconds": 600}}})
    held, events = release_waiting_pods(kube, cache, namespace="ml", name="llama", warmed=False,
                                        now=dt.datetime(2026, 1, 1, 0, 9, 59, tzinfo=dt.timezone.utc))
    assert held == 2 and events == [] and kube.released == []  # not yet warm and not timed out: still held
    held, events = release_waiting_pods(kube, cache, namespace="ml", name="llama", warmed=False,
                                        now=dt.datetime(2026, 1, 1, 0, 10, tzinfo=dt.timezone.utc))
    assert held == 1 and [n for _, n, _ in kube.released] == ["p1"]  # p1 waited its 600 s
    assert [(e.type, e.message) for e in events] == [("Warning", "Released pod p1: it waited 600s for the cache")]
    held, events = release_waiting_pods(kube, cache, namespace="ml", name="llama", warmed=True,
                                        now=dt.datetime(2026, 1, 1, 0, 10, tzinfo=dt.timezone.utc))
    assert held == 0 and [e.message for e in events] == ["Released pod p2: the cache is warm"]


@pytest.mark.parametrize("interim", ["FailureTarget", "SuccessCriteriaMet"])
def test_a_job_is_unfinished_until_complete_or_failed(interim: str) -> None:
    # Kubernetes 1.31+ sets these while the Job's pods still terminate.
    conditions = [{"type": interim, "status": "True"}]
    mine = [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "uid": "u-1", "controller": True}]
    job: dict[str, Any] = {"metadata": {"name": "old", "annotations": {"cachewarm.dev/generation": "1"},
                                        "ownerReferences": mine},
                           "status": {"startTime": "s", "conditions": conditions}}
    assert _job_state(job) == "Running"
    assert observe(job, "u-1").unfinished
    assert plan_pool([observe(job, "u-1")], "new", 2) == PoolPlan(delete=("old",), waiting_for=("old",))
    done = "Failed" if interim == "FailureTarget" else "Complete"
    conditions.append({"type": done, "status": "True"})
    assert _job_state(job) == ("Failed" if done == "Failed" else "Succeeded")
    assert plan_pool([observe(job, "u-1")], "new", 2) == PoolPlan(create=True)


def job_owned_by(*refs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "j", "annotations": {"cachewarm.dev/generation": "9"},
                         "ownerReferences": list(refs)}, "status": {"active": 1}}


def test_a_job_is_this_caches_only_by_its_cache_controller_uid() -> None:
    mine = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "name": "llama", "uid": "u-1",
            "controller": True}
    gone = {**mine, "uid": "u-0"}  # a deleted cache of the same name
    assert observe(job_owned_by(mine), "u-1").ours
    assert observe(job_owned_by(gone), "u-1").foreign
    # No controller (orphaned, or made by a tenant), a controller of another kind or group
    # with this cache's uid, or this cache as a mere owner: strays, never the cache's.
    for refs in ([], [{**mine, "controller": False}], [{**mine, "kind": "ConfigMap"}],
                 [{**mine, "apiVersion": "evil.example/v1"}]):
        seen = observe(job_owned_by(*refs), "u-1")
        assert seen.stray and not seen.ours and not seen.foreign, refs
    # The deleted cache's newer Job neither supersedes this cache nor is deleted by it;
    # a stray is stopped like any stale warmer.
    assert plan_pool([observe(job_owned_by(gone), "u-1")], "new", 2) == PoolPlan(create=True)
    assert plan_pool([observe({**job_owned_by(), "metadata": {"name": "j"}}, "u-1")], "new", 2) == \
        PoolPlan(waiting_for=("j",), strays=("j",))


WARMER_LABELS = {"cachewarm.dev/warmer-for": "llama", "cachewarm.dev/pool": "p"}


def cluster_of(jobs: list[dict[str, Any]], services: tuple[str, ...] = ()) -> MemoryKube:
    """This cache's warmer Jobs and Services as an apiserver would list them."""
    return MemoryKube(jobs=jobs, services=[{"metadata": {"name": s, "namespace": "ml", "labels": dict(WARMER_LABELS)}}
                                           for s in services])


def warm(kube: MemoryKube, cache: Any, generation: int = 2) -> WarmupOutcome:
    return reconcile_warmup(kube, cache, namespace="ml", name="llama", uid="u-1", annotations={}, previous=[],
                            cache_entries=0, warmer_image="w", now=at(1), generation=generation)


def test_a_deleted_caches_job_neither_supersedes_nor_is_deleted() -> None:
    left = {"metadata": {"name": "llama-p-0123456789", "namespace": "ml", "labels": dict(WARMER_LABELS),
                         "annotations": {"cachewarm.dev/generation": "7"},
                         "ownerReferences": [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "name": "llama", "uid": "u-0",
                                              "controller": True}]},
            "status": {"active": 1, "startTime": "s"}}
    cluster = cluster_of([left])
    outcome = warm(cluster, spec())
    assert cluster.deleted == []
    assert [o["kind"] for o in cluster.created] == ["Job"]
    assert outcome.pools[0]["state"] == "Pending"


def test_an_invalid_shape_keeps_the_service_while_old_warmers_stop() -> None:
    old: dict[str, Any] = {
        "metadata": {"name": "llama-p-0123456789", "namespace": "ml", "labels": dict(WARMER_LABELS),
                     "annotations": {"cachewarm.dev/generation": "1"},
                     "ownerReferences": [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "uid": "u-1", "controller": True}]},
        "status": {"active": 2, "startTime": "s"}}
    service = service_name("llama", "p")
    invalid = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": {
        "image": "i", "targets": ["m:f"], "pools": [{"name": "p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"},
                                                     "hosts": 3}]}})
    cluster = cluster_of([old], (service,))
    assert warm(cluster, invalid).pools[0]["reason"] == "InvalidTpuShape"
    assert cluster.deleted == [("Job", "llama-p-0123456789")]  # the Service stays: its pods may still run
    assert cluster.jobs[0]["metadata"]["deletionTimestamp"]  # foreground: still listed while its pods stop
    warm(cluster, invalid)
    assert ("Service", service) not in cluster.deleted
    cluster.jobs = []  # gone: now the Service goes too
    warm(cluster, invalid)
    assert cluster.deleted[-1] == ("Service", service) and cluster.services == []


def succeeded(keys: list[str] | None, not_cached: int = 0) -> dict[str, Any]:
    pool: dict[str, Any] = {"name": "p", "state": "Succeeded"}
    if keys is not None:
        pool["keys"] = keys
    if not_cached:
        pool["notCached"] = not_cached
    return pool


def test_warmed_only_when_every_reported_entry_is_in_the_bucket() -> None:
    assert warmed_condition([succeeded(["aa", "bb"])], 5, entry_keys=frozenset({"aa", "bb", "cc"})).status is True
    missing = warmed_condition([succeeded(["aa", "bb"])], 5, entry_keys=frozenset({"aa", "cc"}))
    assert (missing.status, missing.reason) == (False, "EntriesMissing")
    assert "p: 1 of 2" in missing.message


def test_an_entry_of_another_program_does_not_make_a_new_program_warmed() -> None:
    # The bucket holds an old image's entry; the new warm reported nothing it could rely on.
    cond = warmed_condition([succeeded([])], 1, entry_keys=frozenset({"old"}))
    assert (cond.status, cond.reason) == (False, "CacheEmpty")


def test_a_warmer_too_old_to_report_keys_falls_back_to_the_bucket_holding_entries() -> None:
    assert warmed_condition([succeeded(None)], 3, entry_keys=frozenset({"x"})).status is True
    assert warmed_condition([succeeded(None)], 0, entry_keys=frozenset()).reason == "CacheEmpty"


def test_programs_not_cached_are_named_in_warmed() -> None:
    cond = warmed_condition([succeeded(["aa"], not_cached=2)], 1, entry_keys=frozenset({"aa"}))
    assert cond.status is True and "2 programs of p" in cond.message


def failed_job(name: str, when: str = "2026-11-22T01:00:00Z", uid: str = "") -> dict[str, Any]:
    """The Job the operator created (`uid`: the one the apiserver gave it), as failed."""
    return {"metadata": {"name": name, "namespace": "ml", "labels": dict(WARMER_LABELS), "uid": uid,
                         "annotations": {"cachewarm.dev/generation": "2"},
                         "ownerReferences": [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "uid": "u-1", "controller": True}]},
            "status": {"startTime": "s", "conditions": [
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "lastTransitionTime": when}]}}


def test_a_failed_warmer_is_retried_after_backoff_then_left_failed() -> None:
    from cachewarm.reconcile.warmup import WarmRetry
    retry = WarmRetry(retries=2, delay_seconds=60)
    cluster = cluster_of([])
    first = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={}, previous=[],
                             cache_entries=0, warmer_image="w", now=at(1), generation=2, retry=retry)
    job = first.pools[0]["job"]
    assert first.pools[0]["attempt"] == 1
    assert first.pools[0]["jobUid"] == cluster.jobs[0]["metadata"]["uid"]  # pinned at its create
    cluster.jobs = [failed_job(job, uid=cluster.jobs[0]["metadata"]["uid"])]

    def step(previous: list[dict[str, Any]], now: dt.datetime) -> WarmupOutcome:
        return reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={},
                                previous=previous,
                                cache_entries=0, warmer_image="w", now=now, generation=2, retry=retry)

    failed = step(first.pools, at(1))  # failed at 01:00: retry 1 due at 01:01
    [pool] = failed.pools
    assert (pool["state"], pool["attempt"], pool["nextRetryTime"]) == ("Failed", 1, "2026-11-22T01:01:00Z")
    assert warmed_condition(failed.pools, 0).reason == "WarmupFailed" and "retrying at" in warmed_condition(failed.pools, 0).message
    assert step(failed.pools, at(1, 0) + dt.timedelta(seconds=59)).pools[0]["state"] == "Failed"  # not yet
    assert cluster.deleted == []
    due = step(failed.pools, at(1, 1))
    assert cluster.deleted == [("Job", job)]  # stopped first, then made again under the same name
    assert (due.pools[0]["state"], due.pools[0]["attempt"]) == ("Pending", 2)
    assert [e.reason for e in due.events] == ["WarmerRetried"]
    cluster.jobs = []  # gone: created again
    created = step(due.pools, at(1, 2))
    assert created.pools[0]["jobUid"] == cluster.jobs[0]["metadata"]["uid"]
    assert [o["metadata"]["name"] for o in cluster.created[1:]] == [job]
    assert created.pools[0]["attempt"] == 2
    # Attempt 2 fails at 01:05: retry 2 after twice the delay (01:07); attempt 3 is the last.
    cluster.jobs = [failed_job(job, "2026-11-22T01:05:00Z", cluster.jobs[0]["metadata"]["uid"])]
    second = step(created.pools, at(1, 5))
    assert second.pools[0]["nextRetryTime"] == "2026-11-22T01:07:00Z"
    stopped = step(second.pools, at(1, 7))
    cluster.jobs = []
    third = step(stopped.pools, at(1, 8))  # gone: created for attempt 3
    cluster.jobs = [failed_job(job, "2026-11-22T01:10:00Z", cluster.jobs[0]["metadata"]["uid"])]
    last = step(third.pools, at(1, 10))
    assert last.pools[0]["attempt"] == 3 and "nextRetryTime" not in last.pools[0]
    assert "no retry is left" in last.pools[0]["message"]
    assert step(last.pools, at(5)).pools[0]["state"] == "Failed" and len(cluster.created) == 3


def test_a_failed_pool_whose_job_expired_is_still_retried() -> None:
    from cachewarm.reconcile.warmup import WarmRetry
    cluster = cluster_of([])
    first = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={}, previous=[],
                             cache_entries=0, warmer_image="w", now=at(1), generation=2)
    previous = [{**first.pools[0], "state": "Failed", "attempt": 1, "failedTime": "2026-11-22T01:00:00Z",
                 "lastError": "boom"}]
    cluster.jobs = []  # expired by its TTL
    assert previous[0]["jobUid"]  # the expired Job's uid, pinned at its create

    def again(prev: list[dict[str, Any]]) -> WarmupOutcome:
        return reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={},
                                previous=prev, cache_entries=0, warmer_image="w", now=at(2), generation=2,
                                retry=WarmRetry(1, 60))
    # Status forgets the old uid first (a status write lost after the create would otherwise
    # leave it pinned, and the new Job of the same name would be stopped as a stray) ...
    out = again(previous)
    assert [o["kind"] for o in cluster.created] == ["Job"] and "jobUid" not in out.pools[0]
    assert (out.pools[0]["state"], out.pools[0]["attempt"]) == ("Pending", 2)
    assert [e.reason for e in out.events] == ["WarmerRetried"]
    # ... and the Job is made at the next reconcile, pinned by its new uid.
    made = again(out.pools)
    assert [o["kind"] for o in cluster.created] == ["Job", "Job"]
    assert (made.pools[0]["state"], made.pools[0]["attempt"]) == ("Pending", 2)
    assert made.pools[0]["jobUid"] == cluster.jobs[-1]["metadata"]["uid"] != previous[0]["jobUid"]
    # A status write lost after that create: the Job is still the operator's (unpinned), not a stray.
    lost = again(out.pools)
    assert cluster.deleted == [] and lost.events == [] and lost.pools[0]["jobUid"] == made.pools[0]["jobUid"]


def test_a_summary_with_more_keys_than_fit_keeps_the_count_and_says_it_was_cut(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from cachewarm.agents import warmer
    out = tmp_path / "termination-log"
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(out))
    keys = sorted(f"{i:016x}" for i in range(400))
    warmer.write_summary({"entriesWritten": 400, "keys": keys, "keyCount": 400, "errors": [], "targets": []})
    text = out.read_text()
    summary = json.loads(text)  # still whole JSON
    assert len(text) <= warmer.SUMMARY_LIMIT
    assert summary["keysTruncated"] is True and summary["keyCount"] == 400
    assert 100 < len(summary["keys"]) < 400 and set(summary["keys"]) <= set(keys)


def owner(job: dict[str, Any]) -> dict[str, Any]:
    """The controller reference the Job controller puts on the pods it makes."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"], "uid": job["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def test_a_warm_cycle_through_the_client_creates_once_reads_results_once_and_is_warmed() -> None:
    """reconcile_warmup against an in-memory cluster: the Job is created once, its pods'
    results are read when it finishes, and a later reconcile of the finished Job lists no
    pods again."""
    cluster = cluster_of([])
    first = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={}, previous=[],
                             cache_entries=0, warmer_image="w", now=at(1), generation=2)
    [job] = cluster.jobs
    assert job["kind"] == "Job" and job["metadata"]["labels"]["cachewarm.dev/warmer-for"] == "llama"
    assert first.pools[0]["state"] == "Pending" and [e.reason for e in first.events] == ["WarmerCreated"]
    again = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={},
                             previous=first.pools, cache_entries=0, warmer_image="w", now=at(1), generation=2)
    assert len(cluster.created) == 1 and again.events == []  # the same program: no second warmer
    job["status"] = {"startTime": "2026-11-22T01:00:00Z", "completionTime": "2026-11-22T01:03:00Z",
                     "conditions": [{"type": "Complete", "status": "True"}]}
    summary = {"entriesFound": 0, "entriesWritten": 2, "bytesWritten": 30, "compileSeconds": 4.0,
               "keys": ["aa", "bb"], "errors": []}
    cluster.pods = [{"metadata": {"name": "warm-0", "namespace": "ml",
                                  "labels": {"job-name": job["metadata"]["name"]}, "ownerReferences": [owner(job)]},
                     "spec": {"nodeName": "node-a"},
                     "status": {"containerStatuses": [{"name": "warm", "state": {"terminated": {
                         "message": json.dumps(summary)}}}]}}]
    done = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={},
                            previous=again.pools, cache_entries=2, warmer_image="w", now=at(2), generation=2,
                            entry_keys=frozenset({"aa", "bb"}))
    [pool] = done.pools
    assert (pool["state"], pool["entriesWritten"], pool["keys"], pool["nodes"]) == ("Succeeded", 2, ["aa", "bb"],
                                                                                    ["node-a"])
    assert (done.condition.status, done.condition.reason) == (True, "Warmed")
    assert [e.reason for e in done.events] == ["WarmerSucceeded"]
    cluster.calls.clear()
    later = reconcile_warmup(cluster, spec(), namespace="ml", name="llama", uid="u-1", annotations={},
                             previous=done.pools, cache_entries=2, warmer_image="w", now=at(3), generation=2,
                             entry_keys=frozenset({"aa", "bb"}))
    assert later.pools == done.pools and later.events == []
    assert "list_pods" not in cluster.calls and cluster.calls == ["list_jobs", "list_services"]


def test_the_pool_keeps_process_0s_fingerprint_typed_and_bounded_with_the_image_digest() -> None:
    from cachewarm.reconcile.warmplan import fingerprint_status

    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    zero = {"processIndex": 0, "entriesWritten": 1, "fingerprint": {
        "jax": "0.10.2", "versions": {"jaxlib": "0.10.2", "libtpu": "0.0.30"}, "platform": "tpu",
        "deviceKind": "TPU v5p", "devices": "8", "processes": 2, "topology": "2x2x2", "flagsHash": "abc",
        "flagCount": 3, "cacheDir": "gs://b/p", "unexpected": {"big": "x" * 5000}}}
    one = {"processIndex": 1, "fingerprint": {"jax": "0.9.0", "devices": 8}}
    pods = [{"spec": {"nodeName": "n"}, "status": {"containerStatuses": [
        {"name": "warm", "imageID": "us-docker.pkg.dev/team/train@sha256:" + "a" * 64}]}}]
    status = pool_status("j", spec().warmup.pools[0], "h", job, [one, zero], read_pods(pods))
    assert status["fingerprint"] == {
        "jax": "0.10.2", "versions": {"jaxlib": "0.10.2", "libtpu": "0.0.30"}, "platform": "tpu",
        "deviceKind": "TPU v5p", "devices": 8, "processes": 2, "topology": "2x2x2", "flagsHash": "abc",
        "flagCount": 3, "cacheDir": "gs://b/p", "image": "us-docker.pkg.dev/team/train@sha256:" + "a" * 64}
    assert fingerprint_status({"jax": "x" * 1000, "devices": "many"}, "")["jax"] == "x" * 300
    assert "devices" not in fingerprint_status({"devices": "many"}, "")
    # The warmer runs in the user's image: its text reaches conditions, Events and `cachewarm
    # inspect` as plain text, as the pods' side keeps it (a terminal escape or newline is `?`).
    dirty = fingerprint_status({"platform": "cpu\x1b]52;c;eA==\x07", "torchKey": "ab\ncd",
                                "versions": {"torch\x1b[2J": "2.15.0\r"}}, "")
    assert (dirty["platform"], dirty["torchKey"], dirty["versions"]) == \
        ("cpu?]52;c;eA==?", "ab?cd", {"torch?[2J": "2.15.0?"})
    # A warmer too old to report one (or an entrypoint in a child process): no fingerprint.
    assert "fingerprint" not in pool_status("j", spec().warmup.pools[0], "h", job, [{"entriesWritten": 1}])


# --- the image's PYTHONPATH, as the warmer saw it (imagePythonPath) --------------------

DONE = {"spec": {"template": {"spec": {"containers": [{"name": "warm", "image": "train:7"}]}}},
        "status": {"conditions": [{"type": "Complete", "status": "True"}]}}


def recorded(status: dict[str, Any]) -> str:
    """The PYTHONPATH a pool recorded, checked to be the Job's image's."""
    assert status["imagePythonPath"]["image"] == "train:7", status
    return str(status["imagePythonPath"]["value"])


def test_the_pool_records_the_pythonpath_process_0_reported() -> None:
    pool = spec().warmup.pools[0]
    summaries = [{"processIndex": 1, "imagePythonPath": "/other"},
                 {"processIndex": 0, "imagePythonPath": "/app/src:/opt/lib"}]
    assert recorded(pool_status("j", pool, "h", DONE, summaries)) == "/app/src:/opt/lib"
    # "" is what an image without PYTHONPATH reports: a known value, kept as such.
    assert recorded(pool_status("j", pool, "h", DONE, [{"processIndex": 0, "imagePythonPath": ""}])) == ""
    # A warmer that did not report one (too long, or an older warmer): none, not "".
    assert "imagePythonPath" not in pool_status("j", pool, "h", DONE, [{"processIndex": 0, "entriesWritten": 1}])
    assert "imagePythonPath" not in pool_status("j", pool, "h", DONE,
                                                [{"processIndex": 0}, {"processIndex": 1, "imagePythonPath": "/x"}])


def test_no_pythonpath_is_recorded_when_the_warmup_env_sets_one() -> None:
    """The warmer then saw spec.warmup.env's PYTHONPATH, not the image's."""
    summaries = [{"processIndex": 0, "imagePythonPath": "/from/warmup/env"}]
    status = pool_status("j", spec().warmup.pools[0], "h", DONE, summaries, env_sets_pythonpath=True)
    assert "imagePythonPath" not in status and status["state"] == "Succeeded"


@pytest.mark.parametrize("reported", ["/p" * 500 + "x", 42, ["/app"], None, "/bad\udcff"],
                         ids=["over-1000", "int", "list", "null", "undecodable"])
def test_a_pythonpath_status_could_not_hold_as_it_is_is_not_recorded(reported: Any) -> None:
    status = pool_status("j", spec().warmup.pools[0], "h", DONE, [{"processIndex": 0, "imagePythonPath": reported}])
    assert "imagePythonPath" not in status


@pytest.mark.parametrize("container", [
    {"name": "warm", "env": [{"name": "PYTHONPATH", "value": "/datadog-lib"}]},  # another webhook's
    {"name": "warm", "envFrom": [{"configMapRef": {"name": "team-env"}}]},  # may set one
])
def test_no_pythonpath_is_recorded_when_the_warm_containers_spec_sets_or_may_set_one(container: dict[str, Any]) -> None:
    """The warmer then saw that one, not the image's own; a pod given it would lose the
    image's paths."""
    pods = [{"spec": {"containers": [container]}, "status": {}}]
    summaries = [{"processIndex": 0, "imagePythonPath": "/datadog-lib"}]
    status = pool_status("j", spec().warmup.pools[0], "h", DONE, summaries, read_pods(pods))
    assert "imagePythonPath" not in status
    plain = [{"spec": {"containers": [{"name": "warm", "env": [{"name": "A", "value": "1"}]}]}, "status": {}}]
    assert recorded(pool_status("j", spec().warmup.pools[0], "h", DONE, summaries, read_pods(plain))) == "/datadog-lib"


def test_a_pythonpath_of_exactly_1000_characters_is_recorded() -> None:
    path = "/p" * 500
    status = pool_status("j", spec().warmup.pools[0], "h", DONE, [{"processIndex": 0, "imagePythonPath": path}])
    assert recorded(status) == path


def test_the_image_pythonpath_is_the_one_every_pool_of_that_image_agrees_on() -> None:
    def pool(name: str, value: str, image: str = "train:7") -> dict[str, Any]:
        return {"name": name, "imagePythonPath": {"image": image, "value": value}}
    tpu, gpu, pending = pool("tpu", "/app"), pool("gpu", "/app"), {"name": "cpu", "state": "Pending"}
    assert image_pythonpath([tpu, gpu, pending], "train:7") == "/app"
    assert image_pythonpath([pending, tpu], "train:7") == "/app"  # pools without one are left out
    assert image_pythonpath([tpu, pool("gpu", "/other")], "train:7") is None  # they disagree
    assert image_pythonpath([tpu, pool("gpu", "")], "train:7") is None  # "" disagrees with "/app"
    assert image_pythonpath([pending], "train:7") is None and image_pythonpath([], "train:7") is None  # nobody knows
    # An image that sets none: "" is known (PYTHONPATH is ours alone), unlike None.
    assert image_pythonpath([pool("tpu", ""), pending], "train:7") == ""
    # A value of an earlier warmup image (kept in status until the new warm ends, or after
    # a failed reconcile) is never the current image's.
    assert image_pythonpath([pool("tpu", "/old", image="train:6")], "train:7") is None
    assert image_pythonpath([pool("tpu", "/old", image="train:6"), gpu], "train:7") == "/app"


def finished_warm(cache: Any, reported: str) -> dict[str, Any]:
    """reconcile_warmup through a warm whose process 0 reported `reported` as its PYTHONPATH."""
    cluster = cluster_of([])
    first = reconcile_warmup(cluster, cache, namespace="ml", name="llama", uid="u-1", annotations={}, previous=[],
                             cache_entries=0, warmer_image="w", now=at(1), generation=2)
    [job] = cluster.jobs
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    summary = {"processIndex": 0, "entriesWritten": 1, "keys": ["aa"], "imagePythonPath": reported, "errors": []}
    cluster.pods = [{"metadata": {"name": "warm-0", "namespace": "ml", "labels": {"job-name": job["metadata"]["name"]},
                                  "ownerReferences": [owner(job)]},
                     "status": {"containerStatuses": [{"name": "warm", "state": {"terminated": {
                         "message": json.dumps(summary)}}}]}}]
    done = reconcile_warmup(cluster, cache, namespace="ml", name="llama", uid="u-1", annotations={},
                            previous=first.pools, cache_entries=1, warmer_image="w", now=at(2), generation=2)
    [pool] = done.pools
    assert pool["state"] == "Succeeded"
    return pool


def test_the_reconcile_records_the_image_pythonpath_unless_the_warmup_env_sets_pythonpath() -> None:
    assert finished_warm(spec(), "/app")["imagePythonPath"] == {"image": spec().warmup.image, "value": "/app"}
    assert finished_warm(spec(env={"PYTHONPATHS": "/x"}), "/app")["imagePythonPath"]["value"] == "/app"
    assert "imagePythonPath" not in finished_warm(spec(env={"PYTHONPATH": "/mine"}), "/mine")


def test_the_warmer_reports_its_pythonpath_and_empty_without_one() -> None:
    from cachewarm.agents import warmer

    assert warmer.image_pythonpath({"PYTHONPATH": "/app:/lib"}) == {"imagePythonPath": "/app:/lib"}
    assert warmer.image_pythonpath({}) == {"imagePythonPath": ""}
    assert warmer.image_pythonpath({"PYTHONPATH": "/p" * 500}) == {"imagePythonPath": "/p" * 500}
    assert warmer.image_pythonpath({"PYTHONPATH": "/p" * 500 + "x"}) == {}  # over 1000: left out, never cut
    assert warmer.image_pythonpath({"PYTHONPATH": "/bad\udcff"}) == {}  # undecodable bytes (surrogateescape)


def test_the_pythonpath_survives_the_summarys_trimming(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys, errors and targets are cut first; a 1000-character PYTHONPATH stays whole."""
    from cachewarm.agents import warmer
    out = tmp_path / "termination-log"
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(out))
    path = ":".join(f"/opt/venv/lib/python3.12/site-packages/p{i:03d}" for i in range(100))[:1000]
    keys = sorted(f"{i:016x}" for i in range(400))
    warmer.write_summary({"entriesWritten": 400, "keys": keys, "keyCount": 400, "errors": ["E" * 5000] * 10,
                          "targets": [{"target": "m:f", "item": i, "seconds": 1.0} for i in range(100)],
                          "fingerprint": {"jax": "0.10.2", "cacheDir": "gs://b/" + "p" * 200},
                          "refreshError": "r" * 300, "imagePythonPath": path})
    text = out.read_text()
    summary = json.loads(text)
    assert len(text) <= warmer.SUMMARY_LIMIT and summary["keysTruncated"] is True
    assert summary["imagePythonPath"] == path and len(path) == 1000


def test_a_pythonpath_that_cannot_fit_is_left_out_so_the_summary_stays_whole(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON escapes a non-ASCII character to 6 or 12: a 1000-character path may not fit even
    with no key left. Cut at the limit, the summary would not be JSON at all."""
    from cachewarm.agents import warmer
    out = tmp_path / "termination-log"
    monkeypatch.setenv("CACHEWARM_SUMMARY_FILE", str(out))
    warmer.write_summary({"entriesWritten": 3, "keys": ["aa", "bb"], "keyCount": 2, "errors": [], "targets": [],
                          "imagePythonPath": "\U0001f600" * 1000})
    summary = json.loads(out.read_text())
    assert "imagePythonPath" not in summary and summary["entriesWritten"] == 3 and summary["keysTruncated"] is True
