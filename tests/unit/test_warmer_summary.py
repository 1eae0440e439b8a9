"""A warmer's summary (its termination message) is the user's image's output: reconcile/warmplan.py
reads it through one strict, bounded model (WarmerSummary). Each bad field is dropped alone and
named in the pool's message; the reconcile completes and pods held for the cache are released
(issue 28: a raise there used to skip the release). Kubernetes is the in-memory KubeClient."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from cachewarm.api.bucket import BucketInfo
from cachewarm.builders.bucket import grant_label
from cachewarm.reconcile import cache as service
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.reconcile.warmplan import parse_summary, pool_status
from cachewarm.api.model import parse_spec
from memkube import MemoryKube

NOW = dt.datetime(2026, 11, 22, 7, 0, tzinfo=dt.timezone.utc)
META = {"generation": 3, "uid": "u-1", "creationTimestamp": "2026-11-22T00:00:00Z"}
GOOD = {"processIndex": 0, "entriesFound": 1, "entriesWritten": 2, "bytesWritten": 30, "compileSeconds": 4.0,
        "keys": ["aa", "bb"], "keyCount": 2, "manifestGeneration": "17", "errors": []}
BIG = 10**30

# (field, bad value): each must be dropped, with the rest of the summary kept.
BAD: list[tuple[str, Any]] = [
    ("entriesFound", "12"), ("entriesFound", -1), ("entriesFound", True), ("entriesFound", BIG),
    ("entriesWritten", [1]), ("bytesWritten", 2**64), ("bytesWritten", 1.5),
    ("compileSeconds", "nan"), ("compileSeconds", float("nan")), ("compileSeconds", float("inf")),
    ("compileSeconds", -1.0), ("compileSeconds", 1e300),
    ("keyCount", "2"), ("keyCount", -5), ("keys", "aabb"), ("keys", [1, 2]), ("keys", ["x" * 65]),
    ("keys", ["k"] * 5000), ("refreshFailed", "x"), ("notCached", {"a": 1}), ("refreshError", 7),
    ("refreshError", "e" * 5000), ("manifestGeneration", 17), ("manifestGeneration", "1e9"),
    ("processIndex", "zero"), ("processIndex", -3), ("fingerprint", ["cpu"]), ("fingerprint", {str(i): i for i in range(99)}),
    ("imagePythonPath", 5), ("imagePythonPath", "/p" * 600), ("errors", "boom"), ("errors", [{"x": 1}]),
    ("errors", ["e"] * 101),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_field_is_dropped_alone(field: str, value: Any) -> None:
    parsed, dropped = parse_summary({**GOOD, field: value})
    assert dropped == (field,)
    kept = parsed.model_dump()
    for name, good in GOOD.items():
        if name != field:
            assert kept[name] == good, name


def test_a_good_summary_drops_nothing_and_unknown_fields_are_ignored() -> None:
    parsed, dropped = parse_summary({**GOOD, "fingerprint": {"platform": "cpu", "devices": 1}, "future": {"x": 1}})
    assert dropped == () and parsed.entriesWritten == 2 and parsed.fingerprint == {"platform": "cpu", "devices": 1}


def test_a_fingerprint_count_that_is_not_a_bounded_int_is_left_out() -> None:
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    pool = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                       "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}}).warmup
    assert pool is not None
    fingerprint = {"platform": "cpu", "devices": float("inf"), "processes": "2x", "flagCount": True}
    out = pool_status("j", pool.pools[0], "h", job, [{**GOOD, "fingerprint": fingerprint}])
    assert out["fingerprint"] == {"platform": "cpu"}
    assert pool_status("j", pool.pools[0], "h", job, [{**GOOD, "fingerprint": {"devices": "1" * 10}}]
                       )["fingerprint"] == {}


class Gcs:
    """A configured bucket holding the summary's two entries."""

    def __init__(self) -> None:
        self.bucket = BucketInfo(name="b-1", location="US", storage_class="STANDARD",
                                 labels=dict([grant_label("ml", "")]),  # its owner granted it to namespace ml
                                 soft_delete_seconds=7 * 86400, metageneration=1)

    def get_bucket(self, name: str) -> BucketInfo:
        return self.bucket

    def patch_bucket(self, current: BucketInfo, patch: dict[str, Any]) -> BucketInfo:
        return self.bucket

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Any:
        return iter(())


BODY = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
        "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]},
        "injection": {"waitForWarm": {"enabled": True, "timeoutSeconds": 60}}}


def reconcile(kube: MemoryKube, status: dict[str, Any] | None = None) -> service.Outcome:
    wiring = service.Wiring(gcs=Gcs(), kube=kube, warmer_image="w", injections=RecentInjections(60),
                            claims=lambda bucket: [])
    return service.reconcile_cache(wiring, service.CacheObject("ml", "llama", BODY, META, status or {}), now=NOW)


def finished_with(kube: MemoryKube, message: str) -> None:
    """The reconcile's Job finished (Failed: Warmed then releases held pods whatever the
    entries), with one pod of its own whose warm container ended with `message`."""
    [job] = kube.jobs
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
                     "startTime": "2026-11-22T06:00:00Z"}
    kube.pods.append(job_pod(job, message))


def job_pod(job: dict[str, Any], message: str) -> dict[str, Any]:
    """The Job's own pod (its controller reference: the Job's uid) whose warm container
    ended with `message`."""
    name = job["metadata"]["name"]
    return {
        "metadata": {"name": f"{name}-0", "namespace": "ml", "labels": {"job-name": name},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "uid": job["metadata"]["uid"],
                                          "controller": True}]},
        "spec": {"nodeName": "n"},
        "status": {"containerStatuses": [{"name": "warm", "state": {"terminated": {"message": message}}}]}}


SUMMARIES = [
    json.dumps({**GOOD, "compileSeconds": "nan"}),
    '{"processIndex": "0", "entriesFound": "x", "keyCount": {}, "refreshFailed": [1], "notCached": NaN,'
    ' "compileSeconds": Infinity, "errors": [1, 2]}',
    json.dumps({**GOOD, "bytesWritten": BIG, "keys": "aa", "errors": "boom"}),
    "[1, 2]", "not json", "",
]


@pytest.mark.parametrize("message", SUMMARIES)
def test_a_bad_summary_never_fails_the_reconcile_and_held_pods_are_released(message: str) -> None:
    kube = MemoryKube()
    reconcile(kube)  # creates the Job
    finished_with(kube, message)
    kube.pods.append({"metadata": {"name": "held", "namespace": "ml", "creationTimestamp": "2026-11-22T06:59:00Z",
                                   "labels": {"cachewarm.dev/cache": "llama"}},
                      "spec": {"schedulingGates": [{"name": "cachewarm.dev/wait-for-warm"}]}})
    outcome = reconcile(kube)
    assert outcome.failure is None, outcome.failure
    assert [name for _, name, _ in kube.released] == ["held"]
    [pool] = outcome.status["warmup"]["pools"]
    assert pool["state"] == "Failed"
    json.dumps(outcome.status, allow_nan=False)  # status holds no NaN nor infinity
