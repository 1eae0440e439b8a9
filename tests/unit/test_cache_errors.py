"""reconcile_cache (reconcile/cache.py) never leaves a blank status: every failing step becomes a
condition with a reason and a message and an Event, and what did succeed (the bucket) is
still reported. GCS is a stand-in object here and Kubernetes an in-memory KubeClient
whose calls fail the way the client does; the e2e tests cover the real thing."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest

from cachewarm.reconcile import cache as service
from cachewarm.api.bucket import BucketInfo
from cachewarm.builders.bucket import grant_label
from cachewarm.clients.kube import KubeError
from cachewarm.clients.gcs import GcsUnavailable, ObjectInfo
from cachewarm.reconcile.admitted import RecentInjections
from memkube import MemoryKube

NOW = dt.datetime(2026, 11, 22, 7, 0, tzinfo=dt.timezone.utc)
META = {"generation": 3, "uid": "u-1", "creationTimestamp": "2026-11-22T00:00:00Z"}


class FakeGcs:
    """A bucket that exists and keeps what is patched into it (so a second reconcile finds
    it configured), holding two entries; or, with `fail`, a GCS that raises it on the first
    call."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.bucket = BucketInfo(name="b-1", location="US", storage_class="STANDARD",
                                 labels=dict([grant_label("ml", "")]),  # its owner granted it to namespace ml
                                 soft_delete_seconds=7 * 86400, metageneration=1)

    def get_bucket(self, name: str) -> BucketInfo:
        if self.fail is not None:
            raise self.fail
        return self.bucket

    def patch_bucket(self, current: BucketInfo, patch: dict[str, Any]) -> BucketInfo:
        labels = dict(self.bucket.labels)
        for key, value in (patch.get("labels") or {}).items():
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
        rules = patch["lifecycle"]["rule"] if "lifecycle" in patch else self.bucket.lifecycle_rules
        self.bucket = dataclasses.replace(self.bucket, labels=labels, lifecycle_rules=rules,
                                          metageneration=self.bucket.metageneration + 1)
        return self.bucket

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Iterator[ObjectInfo]:
        yield ObjectInfo("p/jit_f-" + "a" * 64 + "-cache", 10, custom_time=NOW)
        yield ObjectInfo("p/jit_g-" + "b" * 64 + "-cache", 20, custom_time=NOW)


@pytest.fixture(autouse=True)
def kube() -> MemoryKube:
    """The cluster every reconcile of a test talks to."""
    return MemoryKube()


def spec(pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": pools or [{"name": "a"}]}}


def reconcile(kube: MemoryKube, gcs: Any, body: dict[str, Any], status: dict[str, Any] | None = None,
              injections: RecentInjections | None = None) -> service.Outcome:
    wiring = service.Wiring(gcs=gcs, kube=kube, warmer_image="w", injections=injections or RecentInjections(60),
                            claims=lambda bucket: [])
    return service.reconcile_cache(wiring, service.CacheObject("ml", "llama", body, META, status or {}), now=NOW)


def conds(outcome: service.Outcome) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in outcome.status["conditions"]}


def test_gcs_unavailable_is_a_condition_and_an_event(kube: MemoryKube) -> None:
    outcome = reconcile(kube, FakeGcs(GcsUnavailable("reading bucket b-1: GCS answered 503 (busy)", status=503)), spec())
    c = conds(outcome)
    assert c["BucketReady"]["status"] == "False" and c["BucketReady"]["reason"] == "GCSUnavailable"
    assert "503" in c["BucketReady"]["message"]
    assert c["Ready"]["status"] == "False"
    assert c["Warmed"]["reason"] == "BucketNotReady"
    assert outcome.status["observedGeneration"] == 3
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "GCSUnavailable")]
    assert isinstance(outcome.failure, GcsUnavailable)


def test_an_unexpected_exception_from_the_gcs_library_is_reported_too(kube: MemoryKube) -> None:
    outcome = reconcile(kube, FakeGcs(KeyError("softDeletePolicy")), spec())
    c = conds(outcome)
    assert c["BucketReady"]["reason"] == "ReconcileError"
    assert c["BucketReady"]["message"].startswith("Bucket reconcile failed: KeyError: 'softDeletePolicy'")
    assert any(e.reason == "ReconcileError" for e in outcome.events)
    assert outcome.failure is not None


def test_a_kubernetes_error_is_the_warmed_condition_and_the_bucket_is_still_reported(kube: MemoryKube) -> None:
    kube.fail["list_jobs"] = KubeError("listing Jobs in ml: 403 Forbidden: jobs.batch is forbidden", 403)
    previous = {"warmup": {"pools": [{"name": "a", "state": "Running"}]}}
    gcs = FakeGcs()
    outcome = reconcile(kube, gcs, spec(), previous)
    c = conds(outcome)
    assert c["BucketReady"]["status"] == "True" and c["Ready"]["status"] == "True"
    assert outcome.status["bucket"]["url"] == "gs://b-1/p"
    # The entries are listed after the warmers' Jobs are read, so not in this round: the
    # retry lists them (a listing before could miss a warmer's last entries).
    assert "cache" not in outcome.status
    assert c["Warmed"]["status"] == "False" and c["Warmed"]["reason"] == "KubernetesError"
    assert "jobs.batch is forbidden" in c["Warmed"]["message"]
    assert "warmup" not in outcome.status  # the last reported pools stay as they are
    # (The bucket step may also report configuring the stand-in bucket: a Normal event.)
    assert [(e.type, e.reason) for e in outcome.events if e.type == "Warning"] == [("Warning", "KubernetesError")]
    # The same error again changes nothing and says nothing new.
    again = reconcile(kube, gcs, spec(), {**previous, "conditions": outcome.status["conditions"]})
    assert again.events == [] and conds(again)["Warmed"] == c["Warmed"]


def test_a_client_validation_error_becomes_a_condition(kube: MemoryKube) -> None:
    class Quantity(pydantic.BaseModel):
        value: str

    try:
        Quantity.model_validate({"value": 8})
    except pydantic.ValidationError as exc:
        kube.fail["list_jobs"] = exc
    outcome = reconcile(kube, FakeGcs(), spec())
    warmed = conds(outcome)["Warmed"]
    assert warmed["reason"] == "ReconcileError"
    assert "ValidationError" in warmed["message"] and "valid string" in warmed["message"]
    assert outcome.status["bucket"]["url"] == "gs://b-1/p"


def test_unknown_tpu_shape_is_a_clear_condition_not_a_job(kube: MemoryKube) -> None:
    outcome = reconcile(kube, FakeGcs(), spec([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x3"}}]))
    warmed = conds(outcome)["Warmed"]
    assert (warmed["status"], warmed["reason"]) == ("False", "UnknownTpuShape")
    assert "known topologies of tpu-v5p-slice: 2x2x1, 2x2x2" in warmed["message"]
    [pool] = outcome.status["warmup"]["pools"]
    assert pool["state"] == "Failed" and pool["reason"] == "UnknownTpuShape"
    assert kube.created == []
    assert [e.reason for e in outcome.events if e.type == "Warning"] == ["UnknownTpuShape"]


def test_a_bug_anywhere_still_writes_a_condition(monkeypatch: pytest.MonkeyPatch, kube: MemoryKube) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError("'NoneType' object has no attribute 'get'")

    monkeypatch.setattr(service.Claim, "of", broken)  # outside every step's own error handling
    outcome = reconcile(kube, FakeGcs(), spec())
    ready = conds(outcome)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ReconcileError")
    assert "AttributeError" in ready["message"]
    assert outcome.status["observedGeneration"] == 3 and outcome.failure is not None
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "ReconcileError")]
    # Retried, so not Stalled, even when the cache was Stalled before (kstatus: InProgress).
    stalled_before = [{"type": "Stalled", "status": "True", "reason": "BucketNotFound", "message": "",
                       "lastTransitionTime": "2026-11-22T06:00:00Z"}]
    assert conds(reconcile(kube, FakeGcs(), spec(), {"conditions": stalled_before}))["Stalled"]["status"] == "False"
    # The same failure on the next reconcile is still in status, but no new Event.
    again = reconcile(kube, FakeGcs(), spec(), {"conditions": outcome.status["conditions"]})
    assert conds(again)["Ready"]["message"] == ready["message"] and again.failure is not None
    assert again.events == []


def held(kube: MemoryKube) -> MemoryKube:
    """One pod of the cache held by the wait-for-warm gate."""
    kube.pods = [{"metadata": {"name": "held", "namespace": "ml", "creationTimestamp": "2026-11-22T06:59:00Z",
                               "labels": {"cachewarm.dev/cache": "llama"}},
                  "spec": {"schedulingGates": [{"name": "cachewarm.dev/wait-for-warm"}]}}]
    return kube


def released(kube: MemoryKube) -> list[str]:
    return [name for _, name, _ in kube.released]


def test_an_invalid_spec_releases_the_pods_held_for_it(kube: MemoryKube) -> None:
    outcome = reconcile(held(kube), FakeGcs(), {"storage": {"gcs": {"location": "US"}}})
    assert outcome.invalid is not None and released(kube) == ["held"]
    assert [e.reason for e in outcome.events] == ["PodReleased"]
    assert outcome.events[0].message.startswith("Released pod held: the cache's spec is invalid")


def test_wait_for_warm_turned_off_releases_held_pods_once(kube: MemoryKube) -> None:
    was = {"observedGeneration": 2, "injection": {"waitingPods": 1}}
    outcome = reconcile(held(kube), FakeGcs(), spec(), was)
    assert released(kube) == ["held"]
    assert [e.message for e in outcome.events if e.reason == "PodReleased"] == [
        "Released pod held: the cache no longer waits for warm (waitForWarm is off)"]
    assert outcome.status["injection"]["waitingPods"] is None  # removed: the next reconcile lists no pods
    reconcile(held(kube), FakeGcs(), spec(), {**was, "injection": {}})
    assert released(kube) == ["held"]  # the pod held again is not released a second time


def test_a_warm_cache_that_rewarms_stays_warmed(kube: MemoryKube) -> None:
    was = {"conditions": [{"type": "Warmed", "status": "True", "reason": "Warmed", "message": "",
                           "lastTransitionTime": "2026-11-22T06:00:00Z"}]}
    waiting = {**spec(), "injection": {"waitForWarm": {"enabled": True}}}
    warmed = conds(reconcile(held(kube), FakeGcs(), waiting, was))["Warmed"]
    assert (warmed["status"], warmed["reason"]) == ("True", "Rewarming")
    assert released(kube) == ["held"]  # Warmed: pods held from before are released as for a warm cache
    first = conds(reconcile(MemoryKube(), FakeGcs(), waiting))["Warmed"]
    assert (first["status"], first["reason"]) == ("False", "Warming")


def test_an_env_configmap_that_cannot_be_read_is_a_condition_and_the_rest_is_reported(kube: MemoryKube) -> None:
    kube.fail["read_configmap"] = KubeError("reading ConfigMap ml/cachewarm-llama-env-0: 403 Forbidden", 403)
    outcome = reconcile(kube, FakeGcs(), spec())
    c = conds(outcome)
    assert c["InjectionReady"]["status"] == "False" and "403" in c["InjectionReady"]["message"]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == c["InjectionReady"]["reason"]
    assert c["BucketReady"]["status"] == "True"  # what worked is still reported
    assert outcome.failure is not None
    assert [e.reason for e in outcome.events if e.type == "Warning"] == ["KubernetesError"]
    # The same failure again: no second Event.
    again = reconcile(kube, FakeGcs(), spec(), status=outcome.status)
    assert [e for e in again.events if e.type == "Warning"] == []


def test_the_env_configmap_holds_the_pod_env_and_is_owned_by_the_cache(kube: MemoryKube) -> None:
    outcome = reconcile(kube, FakeGcs(), {**spec(), "injection": {"mode": "ReadOnly", "readFrom": "Bucket"}})
    [cm] = kube.configmaps.values()
    assert cm["metadata"]["name"].startswith("cachewarm-llama-env-") and cm["metadata"]["namespace"] == "ml"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert cm["data"]["JAX_COMPILATION_CACHE_DIR"] == "gs://b-1/p"
    assert cm["data"]["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "1e9"  # the pod role: ReadOnly reads only
    assert conds(outcome)["InjectionReady"]["status"] == "True"
    assert outcome.status["injection"]["configMaps"] == {"env": cm["metadata"]["name"], "boot": None}


class UnlistableGcs(FakeGcs):
    """A bucket that answers, whose listing fails (GCS busy)."""

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Iterator[ObjectInfo]:
        raise GcsUnavailable("listing gs://b-1/p: GCS answered 503 (busy)", status=503)


def test_a_listing_that_fails_after_the_warmers_were_read_is_a_gcs_condition_not_a_bug(kube: MemoryKube) -> None:
    outcome = reconcile(kube, UnlistableGcs(), spec())
    warmed = conds(outcome)["Warmed"]
    assert (warmed["status"], warmed["reason"]) == ("False", "GCSUnavailable")
    assert warmed["message"].startswith("The cache's entries could not be listed: listing gs://b-1/p: GCS answered 503")
    assert isinstance(outcome.failure, GcsUnavailable)
    assert conds(outcome)["BucketReady"]["status"] == "True"


def labelled(name: str, *, automount: bool | None, phase: str = "Running", deleting: bool = False,
             cache: str = "llama", noted: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"u-{name}", "namespace": "ml", "labels": {"cachewarm.dev/cache": cache}}
    if noted and automount is False:  # as the webhook notes it (the ServiceAccount case: tests/unit/test_admit.py)
        meta["annotations"] = {"cachewarm.dev/injected": f"{cache} (generation 1, ReadOnly, gs://b-1/p); "
                                                         "no token or reporter: opted out of ServiceAccount tokens"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T06:59:00Z"
    pod_spec = {} if automount is None else {"automountServiceAccountToken": automount}
    return {"metadata": meta, "spec": pod_spec, "status": {"phase": phase}}


def test_pods_that_opted_out_of_tokens_are_counted_in_status(kube: MemoryKube) -> None:
    """D8: status.reports.podsOptedOut counts the cache's live labelled pods the webhook
    noted as opted out of tokens (their annotation, what it decided), from the labelled
    pods the operator watches (no listing): not those it gave a token, finished, being
    deleted, labelled for another cache, or whose spec says false without its note."""
    watched = RecentInjections(60)
    for p in [labelled("out-1", automount=False), labelled("out-2", automount=False, phase="Pending"),
              labelled("unset", automount=None), labelled("in", automount=True),
              labelled("done", automount=False, phase="Succeeded"), labelled("gone", automount=False, deleting=True),
              labelled("other", automount=False, cache="gpt"), labelled("unnoted", automount=False, noted=False)]:
        watched.observe_pod(None, p)
    kube.fail["list_pods"] = KubeError("listing Pods in ml: 503", 503)  # not asked
    outcome = reconcile(kube, FakeGcs(), spec(), {"reports": {"podsOptedOut": 9}}, injections=watched)
    assert outcome.status["reports"] == {"podsOptedOut": 2}


def test_the_specs_own_conditions_are_in_status(kube: MemoryKube) -> None:
    """PodsReadOnly and LocalCopyAsSpecified (reconcile/podsmode.py) come with every
    reconcile of a readable spec, as that spec says."""
    writer = conds(reconcile(kube, FakeGcs(), {**spec(), "injection": {"mode": "ReadWrite"}}))
    assert (writer["PodsReadOnly"]["status"], writer["PodsReadOnly"]["reason"]) == ("False", "ReadWriteChosen")
    reader = conds(reconcile(kube, FakeGcs(), {**spec(), "injection": {"mode": "ReadOnly"}}))
    assert reader["PodsReadOnly"]["status"] == "True" and "LocalCopyAsSpecified" in reader
