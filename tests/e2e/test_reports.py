"""Reports from training pods, end to end through the real apiserver: the token is one the
apiserver issued for the pod (TokenRequest, audience cachewarm, bound to the Pod object, as
the kubelet asks for a projected token), the operator has the apiserver review it
(TokenReview, with the manifests' RBAC) and matches it to the pod the report names; the
usage lands in status.usage and /metrics, and KeysMatch compares the pods' fingerprints
with the warmers'. The reporter in a pod is exercised in tests/integration/test_reporter.py;
what is not here yet is the webhook adding it to pods."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, scrape

pytestmark = pytest.mark.e2e

FINGERPRINT = {"jax": "0.10.2", "versions": {"jaxlib": "0.10.2"}, "platform": "cpu", "deviceKind": "cpu",
               "devices": 1, "processes": 1, "flagsHash": "e3b0c44298fc", "flagCount": 0}


def pod(name: str, cache: str = "llama") -> dict[str, Any]:
    """A training pod labelled for `cache` that stays Pending (no node matches): only its
    identity and label matter."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
            "spec": {"serviceAccountName": "trainer", "nodeSelector": {"cachewarm.test/nowhere": "true"},
                     "containers": [{"name": "train", "image": "demo/train:1"}]}}


def token(bed: Testbed, ns: str, pod_name: str, audience: str = "cachewarm") -> str:
    uid = bed.get_json("pod", pod_name, ns)["metadata"]["uid"]  # type: ignore[index]
    made = bed.kubectl_run("create", "token", "trainer", "-n", ns, f"--audience={audience}", "--duration=10m",
                           "--bound-object-kind=Pod", f"--bound-object-name={pod_name}", f"--bound-object-uid={uid}")
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def report(bed: Testbed, ns: str, pod_name: str, sequence: int = 1, hits: int = 3, requests: int = 4,
           cache: str = "llama", fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    uid = bed.get_json("pod", pod_name, ns)["metadata"]["uid"]  # type: ignore[index]
    return {"version": 1, "pod": {"namespace": ns, "name": pod_name, "uid": uid}, "cache": cache,
            "process": {"pid": 42, "started": 1_763_900_000, "index": 0}, "sequence": sequence,
            "counts": {"requests": requests, "hits": hits, "misses": requests - hits, "compileSecondsSaved": 9.5,
                       "compileSecondsSpent": 1.25, "compiles": requests - hits,
                       "lastMisses": [{"program": "jit_eval", "key": "jit_eval-" + "e" * 64}]},
            "fingerprint": fingerprint or FINGERPRINT}


def post(bed: Testbed, operator: OperatorHandle, body: bytes, bearer: str | None) -> tuple[int, str]:
    """POST /report/v1 over HTTPS, trusting only the CA the webhook configuration names."""
    config = json.loads(bed.kubectl_run("get", "mutatingwebhookconfiguration", "cachewarm-pod-injector",
                                        "-o", "json").stdout)
    context = ssl.create_default_context(cadata=base64.b64decode(config["webhooks"][0]["clientConfig"]["caBundle"])
                                         .decode())
    request = urllib.request.Request(operator.report_url, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {bearer}"} if bearer else {})})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_pods_report_is_taken_only_with_its_own_token_and_lands_in_usage_and_metrics(
    operator: OperatorHandle, installed: Testbed, namespace: str,
) -> None:
    bed = installed
    assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", namespace).returncode == 0
    bucket = f"rep-{uuid.uuid4().hex[:8]}"
    # llama, and a second cache whose usage shows that usage flushes ran (a flush goes over
    # every cache in one pass).
    for cache, gcs_bucket in (("llama", bucket), ("control", f"{bucket}-c")):
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": cache},
                   "spec": {"storage": {"gcs": {"bucket": gcs_bucket, "location": "us-central1"}}}}, namespace)
    for cache in ("llama", "control"):
        eventually(lambda: (bed.get_json("ccache", cache, namespace) or {}).get("status", {}).get("bucket"),
                   what=f"the cache {cache} reconciled")
    bed.apply(pod("trainer-a"), namespace)
    bed.apply(pod("trainer-b", cache="control"), namespace)
    unlabelled = pod("unlabelled")
    del unlabelled["metadata"]["labels"]  # a pod of the namespace, with a valid token: not one we watch
    bed.apply(unlabelled, namespace)
    mine, theirs = token(bed, namespace, "trainer-a"), token(bed, namespace, "trainer-b")
    scope = {"namespace": namespace, "cache": "llama"}
    hits_before = scrape(operator.metrics_url, "cachewarm_cache_hits_total", **scope)
    taken_before = scrape(operator.metrics_url, "cachewarm_reports_total", code="202")

    good = json.dumps(report(bed, namespace, "trainer-a")).encode()
    refused = {
        "no token": post(bed, operator, good, None),
        "forged token": post(bed, operator, good, "not-a-token"),
        "another pod's token": post(bed, operator, good, theirs),
        "the apiserver's audience": post(bed, operator, good, token(bed, namespace, "trainer-a", audience="https://kubernetes.default.svc")),
        "a cache in another namespace": post(bed, operator, json.dumps(report(bed, namespace, "trainer-a", cache="kube-system/llama")).encode(), mine),
        "a cache that does not exist": post(bed, operator, json.dumps(report(bed, namespace, "trainer-a", cache="nope")).encode(), mine),
        # Item 4: a pod's report counts only for the cache it is labelled for, even one
        # of its namespace that exists.
        "another cache than its label's": post(bed, operator, json.dumps(report(bed, namespace, "trainer-a", cache="control")).encode(), mine),
        "a pod the operator does not know": post(bed, operator, json.dumps(report(bed, namespace, "unlabelled")).encode(), token(bed, namespace, "unlabelled")),
        "malformed": post(bed, operator, b'{"version": 1, "pod": "trainer-a"}', mine),
        "oversized": post(bed, operator, b" " * 20_000 + good, mine),
    }
    assert {why: status for why, (status, _) in refused.items()} == {
        "no token": 401, "forged token": 401, "another pod's token": 403, "the apiserver's audience": 401,
        "a cache in another namespace": 403, "a cache that does not exist": 403,
        "another cache than its label's": 403, "a pod the operator does not know": 403, "malformed": 400,
        "oversized": 413}
    assert "bound to another pod" in refused["another pod's token"][1]
    assert "labelled for CompilationCache 'llama', not 'control'" in refused["another cache than its label's"][1]
    assert "not a labelled pod the operator knows" in refused["a pod the operator does not know"][1]
    # ...and they changed nothing: not the metrics (a report is counted before it is
    # answered), not status.usage once usage flushes ran after them. The flushes are seen in
    # the other cache's usage: two reports of trainer-b for it, each written by a later flush.
    assert scrape(operator.metrics_url, "cachewarm_cache_hits_total", **scope) == hits_before
    for pid in (1, 2):
        other = {**report(bed, namespace, "trainer-b", cache="control"),
                 "process": {"pid": pid, "started": 1_763_900_000, "index": 0}}
        assert post(bed, operator, json.dumps(other).encode(), theirs)[0] == 202
        eventually(lambda: (((bed.get_json("ccache", "control", namespace) or {}).get("status") or {})
                            .get("usage") or {}).get("processes") == pid, timeout=30, what=f"flush {pid} of usage")
    assert "usage" not in (bed.get_json("ccache", "llama", namespace) or {}).get("status", {})
    assert scrape(operator.metrics_url, "cachewarm_cache_hits_total", **scope) == hits_before

    assert post(bed, operator, good, mine)[0] == 202
    assert post(bed, operator, json.dumps(report(bed, namespace, "trainer-a", sequence=2)).encode(), mine)[0] == 429

    def usage() -> dict[str, Any] | None:
        return ((bed.get_json("ccache", "llama", namespace) or {}).get("status") or {}).get("usage")
    got = eventually(usage, timeout=30, what="status.usage")
    assert (got["pods"], got["compileRequests"], got["hits"], got["misses"], got["hitRatio"]) == (1, 4, 3, 1, 0.75)
    assert got["compileSecondsSaved"] == 9.5 and got["lastMisses"] == [
        {"pod": "trainer-a", "program": "jit_eval", "key": "jit_eval-" + "e" * 64}]
    assert scrape(operator.metrics_url, "cachewarm_cache_hits_total", **scope) == hits_before + 3
    assert scrape(operator.metrics_url, "cachewarm_reports_total", code="202") == taken_before + 3  # 2 for control


def test_keys_match_compares_the_pods_fingerprints_with_the_warmers_and_names_the_difference(
    operator: OperatorHandle, node_agent: Any, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", namespace).returncode == 0
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": f"keys-{uuid.uuid4().hex[:8]}", "prefix": "jax",
                                            "location": "us-central1"}},
                        "jax": {"minCompileTimeSecs": 0},
                        "warmup": {"image": "demo/train:1", "targets": ["train:targets"], "pools": [{"name": "cpu"}]}}},
              namespace)

    def conditions() -> dict[str, dict[str, Any]]:
        obj = bed.get_json("ccache", "llama", namespace) or {}
        return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
    eventually(lambda: conditions().get("Warmed", {}).get("status") == "True", timeout=180, what="Warmed")
    assert conditions()["KeysMatch"]["reason"] == "NoReports"
    [pool] = bed.get_json("ccache", "llama", namespace)["status"]["warmup"]["pools"]  # type: ignore[index]
    warmed = {k: v for k, v in pool["fingerprint"].items() if k != "image"}

    bed.apply(pod("same"), namespace)
    assert post(bed, operator, json.dumps(report(bed, namespace, "same", fingerprint=warmed)).encode(),
                token(bed, namespace, "same"))[0] == 202
    matched = eventually(lambda: conditions().get("KeysMatch", {}).get("status") == "True" and conditions()["KeysMatch"],
                         timeout=30, what="KeysMatch True")
    assert matched["reason"] == "FingerprintsMatch"

    bed.apply(pod("two-devices"), namespace)
    other = {**warmed, "devices": 2}
    assert post(bed, operator, json.dumps(report(bed, namespace, "two-devices", fingerprint=other)).encode(),
                token(bed, namespace, "two-devices"))[0] == 202
    differ = eventually(lambda: conditions().get("KeysMatch", {}).get("status") == "False" and conditions()["KeysMatch"],
                        timeout=30, what="KeysMatch False")
    assert differ["reason"] == "FingerprintsDiffer"
    assert "they run 2 devices; pool cpu was warmed with 1 devices" in differ["message"]
    events = [e for e in bed.events_for("llama", namespace) if e["reason"] == "FingerprintsDiffer"]
    assert len(events) == 1 and events[0]["type"] == "Warning" and "2 devices" in events[0]["message"]


def test_local_copies_land_in_usage_once_per_pod_and_a_cold_one_is_said_in_an_event(
    operator: OperatorHandle, installed: Testbed, namespace: str,
) -> None:
    """Pods with a local copy report it with every report of every process: status.usage
    counts each pod once (the CRD keeps the field), and a pod whose copy failed is named
    once in a LocalCopyCold Warning."""
    bed = installed
    assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", namespace).returncode == 0
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": f"lc-{uuid.uuid4().hex[:8]}", "location": "us-central1"}}}},
              namespace)
    eventually(lambda: (bed.get_json("ccache", "llama", namespace) or {}).get("status", {}).get("bucket"),
               what="the cache reconciled")
    copies = {"warm-pod": {"copied": 40, "present": 2, "bytes": 123_456_789, "failed": 0, "cold": False,
                           "seconds": 4.5, "source": "manifest"},
              "cold-pod": {"copied": 0, "present": 0, "bytes": 0, "failed": 3, "cold": True, "seconds": 30.25,
                           "source": "manifest", "error": "HTTPError 403: Forbidden"}}
    for name, local in copies.items():
        bed.apply(pod(name), namespace)
        mine = token(bed, namespace, name)
        for pid in (42, 43):  # two processes of the pod, the same copy
            body = {**report(bed, namespace, name), "process": {"pid": pid, "started": 1_763_900_000, "index": 0},
                    "localCopy": local}
            assert post(bed, operator, json.dumps(body).encode(), mine)[0] == 202
    malformed = {**report(bed, namespace, "warm-pod"), "localCopy": {**copies["warm-pod"], "copied": "40"}}
    assert post(bed, operator, json.dumps(malformed).encode(), token(bed, namespace, "warm-pod"))[0] == 400

    def local_copy() -> dict[str, Any] | None:
        usage = ((bed.get_json("ccache", "llama", namespace) or {}).get("status") or {}).get("usage") or {}
        return usage.get("localCopy") if usage.get("processes") == 4 else None
    got = eventually(local_copy, timeout=30, what="status.usage.localCopy")
    assert got == {"pods": 2, "coldPods": 1, "entriesCopied": 40, "entriesPresent": 2, "bytesCopied": 123_456_789,
                   "maxSeconds": 30.25}
    eventually(lambda: [e for e in bed.events_for("llama", namespace) if e["reason"] == "LocalCopyCold"],
               timeout=30, what="a LocalCopyCold Event")
    # Said once: two more usage flushes after it, each seen writing the usage of another
    # process of the cold pod (the same cold copy), post no second Event.
    cold = token(bed, namespace, "cold-pod")
    for pid, processes in ((44, 5), (45, 6)):
        body = {**report(bed, namespace, "cold-pod"), "process": {"pid": pid, "started": 1_763_900_000, "index": 0},
                "localCopy": copies["cold-pod"]}
        assert post(bed, operator, json.dumps(body).encode(), cold)[0] == 202
        eventually(lambda: (((bed.get_json("ccache", "llama", namespace) or {}).get("status") or {})
                            .get("usage") or {}).get("processes") == processes, timeout=30,
                   what=f"usage of {processes} processes written")
    said = [e for e in bed.events_for("llama", namespace) if e["reason"] == "LocalCopyCold"]
    assert len(said) == 1 and said[0]["type"] == "Warning"
    assert said[0]["message"].startswith("Pod cold-pod started without the cache's entries: the local copy failed "
                                         "(HTTPError 403: Forbidden)")
