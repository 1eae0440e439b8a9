"""The webhook's decision for a pod (admission/admit.py), and when the fast timer has work (reconcile/status.needs_poll); no kopf, no I/O."""

from __future__ import annotations

import datetime as dt

from typing import Any


from cachewarm.admission import admit
from cachewarm.reconcile import status as cache_status
from cachewarm.reconcile import pods as held_pods
from cachewarm.api.conditions import Cond
from cachewarm.api.model import parse_spec
from memkube import MemoryKube

SPEC: dict[str, Any] = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}}}
WARMUP = {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "trainer", "namespace": "ml", "labels": {"cachewarm.dev/cache": "llama"}},
            "spec": {"containers": [{"name": "train"}], **spec}}


def lookup(entry: dict[str, Any] | None) -> held_pods.CacheLookup:
    return lambda ns, name: entry if (ns, name) == ("ml", "llama") else None


def entry(spec: dict[str, Any], warmed: bool = False) -> dict[str, Any]:
    return admit.index_entry(spec, generation=4, uid="u-1", warmed=warmed)


def test_missing_cache_admits_unchanged_with_warning() -> None:
    answer = admit.admit_pod(pod(), lookup(None))
    assert answer.spec == {} and answer.annotations == {} and not answer.injected
    assert answer.warnings == ["cachewarm: no CompilationCache 'llama' in namespace 'ml' "
                               "(label cachewarm.dev/cache); pod admitted without the cache"]


def test_invalid_cache_admits_unchanged_with_the_reason() -> None:
    answer = admit.admit_pod(pod(), lookup(entry({"storage": {"gcs": {"location": "US"}}})))
    assert answer.spec == {} and not answer.injected
    assert "CompilationCache 'llama' is invalid (spec.storage.gcs.bucket: Field required)" in answer.warnings[0]


def test_injection_sets_env_and_annotation_without_gate_by_default() -> None:
    answer = admit.admit_pod(pod(), lookup(entry({**SPEC, "warmup": WARMUP})))
    assert answer.injected and "schedulingGates" not in answer.spec
    # A spec without a mode reads only (D6: the CRD's default, and the model's).
    assert answer.annotations == {"cachewarm.dev/injected": "llama (generation 4, ReadOnly, gs://b-1/p)"}
    assert answer.warnings == []


def test_wait_for_warm_gates_only_until_warmed_and_keeps_other_gates() -> None:
    spec = {**SPEC, "warmup": WARMUP, "injection": {"waitForWarm": {"enabled": True}}}
    cold = admit.admit_pod(pod(schedulingGates=[{"name": "other"}]), lookup(entry(spec)))
    assert cold.spec["schedulingGates"] == [{"name": "other"}, {"name": "cachewarm.dev/wait-for-warm"}]
    assert "schedulingGates" not in admit.admit_pod(pod(), lookup(entry(spec, warmed=True))).spec
    no_warmup = {**SPEC, "injection": {"waitForWarm": {"enabled": True}}}
    assert "schedulingGates" not in admit.admit_pod(pod(), lookup(entry(no_warmup))).spec


def test_kept_user_env_gives_a_warning_and_says_so_in_the_pods_annotation() -> None:
    # No Event: admission has no side effects (D5); the pod itself carries the fact.
    p = pod()
    p["spec"]["containers"][0]["env"] = [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/local"}]
    answer = admit.admit_pod(p, lookup(entry(SPEC)))
    assert not hasattr(answer, "event")
    assert any("keeps its own JAX_COMPILATION_CACHE_DIR" in w for w in answer.warnings)
    assert answer.annotations["cachewarm.dev/injected"].endswith("; kept its own train/JAX_COMPILATION_CACHE_DIR")


def test_poll_only_when_something_can_change() -> None:
    warmup_spec = {**SPEC, "warmup": WARMUP}
    done = {"observedGeneration": 2, "warmup": {"pools": [{"name": "a", "state": "Succeeded"}]},
            "conditions": [{"type": "Warmed", "status": "True"}]}
    assert not cache_status.needs_poll(warmup_spec, done, 2)
    assert cache_status.needs_poll(warmup_spec, done, 3)  # a generation not yet observed
    running = {**done, "warmup": {"pools": [{"name": "a", "state": "Running"}]}}
    assert cache_status.needs_poll(warmup_spec, running, 2)
    assert not cache_status.needs_poll(SPEC, {"observedGeneration": 2}, 2)
    waiting = {**SPEC, "injection": {"waitForWarm": {"enabled": True}}}
    assert cache_status.needs_poll(waiting, {"observedGeneration": 2}, 2)
    # A failed warmer waiting for its retry: polled once the retry is due, not before.
    failed = {**done, "warmup": {"pools": [{"name": "a", "state": "Failed", "nextRetryTime": "2026-11-22T01:01:00Z"}]}}
    assert not cache_status.needs_poll(warmup_spec, failed, 2, now=dt.datetime(2026, 11, 22, 1, 0, tzinfo=dt.timezone.utc))
    assert cache_status.needs_poll(warmup_spec, failed, 2, now=dt.datetime(2026, 11, 22, 1, 1, tzinfo=dt.timezone.utc))


def test_a_refused_cache_or_one_without_wait_for_warm_gates_no_pod() -> None:
    spec = {**SPEC, "warmup": WARMUP, "injection": {"waitForWarm": {"enabled": True}}}
    refused = admit.index_entry(spec, generation=4, uid="u-1", warmed=False, refused=True)
    answer = admit.admit_pod(pod(), lookup(refused))
    assert answer.injected and "schedulingGates" not in answer.spec
    off = {**SPEC, "warmup": WARMUP, "injection": {"waitForWarm": {"enabled": False}}}
    assert "schedulingGates" not in admit.admit_pod(pod(), lookup(entry(off))).spec


def test_held_pods_are_all_released_when_refused_or_when_wait_for_warm_is_turned_off() -> None:
    on = parse_spec({**SPEC, "warmup": WARMUP, "injection": {"waitForWarm": {"enabled": True}}})
    off = parse_spec({**SPEC, "warmup": WARMUP})
    ok = Cond("BucketReady", True, "Reconciled", "")
    refused = Cond("BucketReady", False, "PrefixInUse", "overlaps")
    waited = {"injection": {"waitingPods": 2}}
    assert held_pods.release_all_because(on, refused, {}) == "the cache is refused (PrefixInUse)"
    assert held_pods.release_all_because(on, ok, waited) == ""
    assert held_pods.release_all_because(off, ok, waited) == "the cache no longer waits for warm (waitForWarm is off)"
    assert held_pods.release_all_because(off, ok, {"injection": {"waitingPods": 0}}) != ""
    # A cache that never waited (no waitingPods in status) lists no pods.
    assert held_pods.release_all_because(off, ok, {"injection": {}}) == ""


def test_a_warmed_cache_is_rewarmed_not_first_warmed() -> None:
    assert cache_status.was_warmed({"conditions": [{"type": "Warmed", "status": "True", "reason": "Rewarming"}]})
    assert not cache_status.was_warmed({"conditions": [{"type": "Warmed", "status": "False", "reason": "Warming"}]})
    assert not cache_status.was_warmed({})


def test_a_pod_held_for_a_cache_that_does_not_exist_is_released() -> None:
    held = pod(schedulingGates=[{"name": "other"}, {"name": "cachewarm.dev/wait-for-warm"}])
    kube = MemoryKube(pods=[held])
    event = held_pods.release_orphaned_pod(kube, held, lookup(None))
    assert kube.released == [("ml", "trainer", 1)]
    assert event is not None and event.reason == "PodReleased"
    assert event.message == "Released pod trainer: its CompilationCache llama does not exist"
    # The cache exists: its own reconcile decides. Not held by us: nothing to do.
    kube = MemoryKube(pods=[pod(schedulingGates=[{"name": "cachewarm.dev/wait-for-warm"}])])
    assert held_pods.release_orphaned_pod(kube, kube.pods[0], lookup(entry(SPEC))) is None
    assert held_pods.release_orphaned_pod(kube, pod(schedulingGates=[{"name": "other"}]), lookup(None)) is None
    assert kube.released == [] and kube.calls == []
