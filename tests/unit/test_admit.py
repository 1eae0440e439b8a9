"""The webhook's decision for a pod (admission/admit.py), and when the fast timer has work (reconcile/status.needs_poll); no kopf, no I/O."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading

from typing import Any

import pytest

from cachewarm.admission import admit
from cachewarm.builders.reporting import Reporting
from cachewarm.clients.kube import KubeError
from cachewarm.reconcile.admitted import RecentInjections
from apitoken import given_api_token
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


def entry(spec: dict[str, Any], warmed: bool = False, **more: Any) -> dict[str, Any]:
    return admit.index_entry(spec, generation=4, uid="u-1", warmed=warmed, **more)


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
    # The default read path is a local copy; with no manifest recorded for its pool it would be empty.
    assert answer.warnings == ["cachewarm: CompilationCache 'llama' gives pods a local copy by default, but this "
                               "pod reads the bucket: no warmer of its pools (a) has recorded a manifest yet, so its "
                               "copy would be empty"]


def test_a_cache_that_sets_neither_local_copy_nor_read_from_gives_pods_the_default_local_copy() -> None:
    image = {"containers": [{"name": "train", "image": "team/train:1"}]}
    recorded = {"manifests": {"a": "p/.cachewarm/pools/ml/llama/a/llama-a-0123456789.json#17"}}
    answer = admit.admit_pod(pod(**image), lookup(entry({**SPEC, "warmup": WARMUP}, **recorded)),
                             warmer_image="w@sha256:" + "a" * 64)
    assert answer.annotations == {"cachewarm.dev/injected": "llama (generation 4, ReadOnly, gs://b-1/p, local copy)"}
    env = {e["name"]: e["value"] for e in answer.spec["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache" and answer.warnings == []
    assert [v["name"] for v in answer.spec["volumes"] if v["name"] == "cachewarm-cache"] == ["cachewarm-cache"]
    # readFrom Bucket: the pod reads gs:// directly, no copy.
    bucket = admit.admit_pod(pod(**image), lookup(entry({**SPEC, "warmup": WARMUP, "injection": {"readFrom": "Bucket"}})),
                             warmer_image="w@sha256:" + "a" * 64)
    env = {e["name"]: e["value"] for e in bucket.spec["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "gs://b-1/p" and "volumes" not in bucket.spec


@pytest.mark.parametrize(("container", "more", "said"), [
    pytest.param({"env": [{"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/k/key.json"}]}, {},
                 "it sets GOOGLE_APPLICATION_CREDENTIALS, and the copier authenticates only through the metadata "
                 "server", id="key-file"),
    pytest.param({}, {"cache_bytes": 51 * 2**30}, "the cache holds 51.0 GiB, over the default copy's 50 GiB",
                 id="over-the-cap"),
])
def test_a_pod_the_default_copy_would_fail_reads_the_bucket_and_is_told_why(
        container: dict[str, Any], more: dict[str, Any], said: str) -> None:
    recorded = {"a": "p/.cachewarm/pools/ml/llama/a/llama-a-0123456789.json#17"}
    spec = {"containers": [{"name": "train", "image": "team/train:1", **container}]}
    answer = admit.admit_pod(pod(**spec), lookup(entry({**SPEC, "warmup": WARMUP}, manifests=recorded, **more)),
                             warmer_image="w@sha256:" + "a" * 64)
    env = {e["name"]: e["value"] for e in answer.spec["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "gs://b-1/p" and "volumes" not in answer.spec
    assert [w for w in answer.warnings if said in w], answer.warnings
    # A localCopy the user set is given all the same.
    copied = admit.admit_pod(pod(**spec), lookup(entry({**SPEC, "warmup": WARMUP, "injection": {"localCopy": {}}},
                                                       manifests=recorded, **more)), warmer_image="w@sha256:" + "a" * 64)
    assert {e["name"]: e["value"] for e in copied.spec["containers"][0]["env"]}["JAX_COMPILATION_CACHE_DIR"] == \
        "/cachewarm-cache"


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


# --- D8 and issue 28 item 11: a pod's opt-out of tokens, its own or its ServiceAccount's ---

REPORTING = Reporting("cachewarm/warmer:1", "https://10.96.0.100/report/v1", "PEM")
REPORTS = {**SPEC, "injection": {"report": True}}


def token_volumes(spec: dict[str, Any]) -> list[str]:
    return [v["name"] for v in spec.get("volumes") or []
            if any("serviceAccountToken" in s for s in (v.get("projected") or {}).get("sources") or [])
            and not v["name"].startswith("kube-api-access-")]


@pytest.mark.parametrize("own", [True, False, None], ids=["pod-true", "pod-false", "pod-unset"])
@pytest.mark.parametrize("given", [True, False], ids=["apiserver-gave-a-token", "apiserver-gave-none"])
def test_a_pods_token_follows_its_own_field_else_what_the_apiserver_gave_it(own: bool | None, given: bool) -> None:
    """Kubernetes' rule: the pod's automountServiceAccountToken when set wins; unset, its
    ServiceAccount's, which the apiserver's ServiceAccount admission (before any webhook)
    applied: a pod that leaves its field unset and was given no token opted out through its
    ServiceAccount. No token means no reporter; the cache env comes either way."""
    p = pod(serviceAccountName="train", containers=[{"name": "train", "image": "train:1"}],
            **({} if own is None else {"automountServiceAccountToken": own}))
    if given:
        p["spec"] = given_api_token(p["spec"])
    answer = admit.admit_pod(p, lookup(entry(REPORTS)), REPORTING, None)
    opted_out = own is False or (own is None and not given)
    assert token_volumes(answer.spec) == ([] if opted_out else ["cachewarm-report-token"])
    assert ("cachewarm-reporter" in json.dumps(answer.spec)) is not opted_out
    assert "JAX_COMPILATION_CACHE_DIR" in json.dumps(answer.spec["containers"])
    note = answer.annotations["cachewarm.dev/injected"]
    assert note.endswith("; no token or reporter: opted out of ServiceAccount tokens") is opted_out
    said = [w for w in answer.warnings if "no ServiceAccount token" in w]
    assert len(said) == (1 if opted_out else 0)
    if own is None and not given:
        assert "its ServiceAccount 'train' sets automountServiceAccountToken false" in said[0]


def test_a_token_of_the_pods_own_where_kubernetes_puts_it_is_no_opt_out() -> None:
    """A container that mounts its own token at /var/run/secrets/kubernetes.io/serviceaccount
    gets none from the apiserver's plugin, and did not opt out: it gets our token."""
    own = pod(containers=[{"name": "train", "image": "train:1", "volumeMounts": [
        {"name": "mine", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}])
    assert admit.token_withheld(own["spec"]) == ("", False)
    unnamed = pod(volumes=[{"name": "kube-api-access-x", "configMap": {"name": "not-a-token"}}])
    assert admit.token_withheld(unnamed["spec"])[1] is True  # not a projected volume: no token


def watched(name: str, note: str | None, *, cache: str = "llama", phase: str = "Running",
            deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"u-{name}", "namespace": "ml", "labels": {"cachewarm.dev/cache": cache}}
    if note is not None:
        meta["annotations"] = {"cachewarm.dev/injected": f"{cache} (generation 1, ReadOnly, gs://b/p){note}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T06:59:00Z"
    return {"metadata": meta, "spec": {"automountServiceAccountToken": False}, "status": {"phase": phase}}


def test_pods_opted_out_counts_what_the_webhook_noted_on_live_watched_pods() -> None:
    """status.reports.podsOptedOut comes from the watched pods' annotations (what the
    webhook decided, the ServiceAccount case too), not from their spec: live ones only,
    under the cache each is labelled for now, gone when deleted."""
    opted = "; no token or reporter: opted out of ServiceAccount tokens"
    record = RecentInjections(60)
    for p in [watched("out-1", opted), watched("out-2", f"; kept its own train/X{opted}", phase="Pending"),
              watched("spec-only", None), watched("token", ""), watched("done", opted, phase="Succeeded"),
              watched("deleting", opted, deleting=True), watched("other", opted, cache="gpt")]:
        record.observe_pod(None, p)
    assert (record.opted_out("ml", "llama"), record.opted_out("ml", "gpt"), record.opted_out("x", "llama")) == (2, 1, 0)
    record.observe_pod("MODIFIED", watched("out-1", opted, phase="Failed"))
    record.observe_pod("DELETED", watched("out-2", opted))
    record.observe_pod("MODIFIED", watched("other", opted, cache="llama"))  # relabelled
    assert (record.opted_out("ml", "llama"), record.opted_out("ml", "gpt")) == (1, 0)
    record.observe_pod("MODIFIED", {**watched("other", opted), "metadata": {"uid": "u-other", "namespace": "ml"}})
    assert record.opted_out("ml", "llama") == 0  # its label removed
