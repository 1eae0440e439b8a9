"""What a GitOps pipeline sees: every version of a CompilationCache the apiserver served
(a watch, started before the apply) evaluated by kstatus itself (sigs.k8s.io/cli-utils,
the library of Flux's and kpt's health checks; tests/conftest.py builds it). A cache is
InProgress until the operator has reconciled it and while it warms, Current once Ready, and
Failed when only a person can move it on, so a pipeline fails fast instead of waiting out
its timeout."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from google.cloud import storage
from kubernetes import client, config, watch

from cachewarm_testbed.buckets import grant
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

KStatus = Callable[[dict], dict]


def cache(name: str, bucket: str, warmup: dict[str, Any] | None = None, **gcs: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1", **gcs}},
                            "jax": {"minCompileTimeSecs": 0}}
    if warmup is not None:
        spec["warmup"] = {"image": "demo/train:1", "pools": [{"name": "cpu"}], **warmup}
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": spec}


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


@contextmanager
def versions(bed: Testbed, namespace: str, name: str) -> Iterator[list[dict[str, Any]]]:
    """Every version of the object the apiserver sends a watcher, from before it exists
    until the block ends: a watch from the resourceVersion of a list made before the
    block, so a create right after is seen as it was created (a watch still connecting
    when the object is created would start from a later version)."""
    api = client.CustomObjectsApi(config.new_client_from_config(str(bed.kubeconfig)))
    where = ("cachewarm.dev", "v1alpha1", namespace, "compilationcaches")
    selector = f"metadata.name={name}"
    listed = api.list_namespaced_custom_object(*where, field_selector=selector)
    seen: list[dict[str, Any]] = []
    stream = watch.Watch()

    stopped = threading.Event()

    def read() -> None:
        try:
            for event in stream.stream(api.list_namespaced_custom_object, *where, field_selector=selector,
                                       resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=600):
                seen.append(event["object"])
        except Exception:
            if not stopped.is_set():  # the watch broke during the block: its versions are incomplete
                seen.append({"watchFailed": True})
                raise
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield seen
    finally:
        stopped.set()
        stream.stop()
        reader.join(timeout=10)


def latest(seen: list[dict[str, Any]]) -> dict[str, Any]:
    return seen[-1] if seen else {}


def test_a_cache_is_in_progress_until_reconciled_then_current(
    operator: OperatorHandle, installed: Testbed, namespace: str, kstatus: KStatus,
) -> None:
    """The first version (no reconcile yet: observedGeneration defaults to 0 in the CRD) is
    InProgress, not the Current kstatus assumes for an object without status; the Ready one
    is Current."""
    with versions(installed, namespace, "plain") as seen:
        installed.apply(cache("plain", f"plain-{uuid.uuid4().hex[:8]}"), namespace)
        eventually(lambda: conditions(latest(seen)).get("Ready", {}).get("status") == "True",
                   timeout=60, what="Ready in the watch")
    first, last = seen[0], seen[-1]
    assert first["status"]["observedGeneration"] == 0 and "conditions" not in first["status"]
    assert kstatus(first)["status"] == "InProgress"
    assert kstatus(last) == {"name": "plain", "status": "Current", "message": "Resource is Ready"}
    conds = conditions(last)
    assert conds["Reconciling"]["status"] == "False" and conds["Stalled"]["status"] == "False"


def test_a_warming_cache_is_in_progress_until_warmed_then_current(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, kstatus: KStatus,
) -> None:
    """Ready (the bucket is usable) but still warming reads InProgress, with the warm's
    progress as the message; Warmed reads Current. No version in between reads Failed."""
    bed = controller_manager
    with versions(bed, namespace, "warming") as seen:
        bed.apply(cache("warming", f"warming-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"]}), namespace)
        eventually(lambda: conditions(latest(seen)).get("Warmed", {}).get("reason") == "Warmed",
                   timeout=180, what="Warmed in the watch")
    results = [(conditions(v).get("Warmed", {}).get("reason"), kstatus(v)) for v in seen]
    warming = [r for reason, r in results if reason == "Warming"]
    assert warming, [reason for reason, _ in results]
    assert all(r["status"] == "InProgress" and r["message"].startswith("Warming: cpu") for r in warming), warming
    assert all(r["status"] != "Failed" for _, r in results), results
    assert results[-1][1]["status"] == "Current"


@pytest.mark.parametrize(("reason", "gcs_kwargs"), [
    ("BucketNotFound", {"create": False}),
    ("LocationMismatch", {"create": False, "location": "europe-west4"}),
])
def test_an_adopted_bucket_that_cannot_be_used_is_failed_until_it_can(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, kstatus: KStatus,
    reason: str, gcs_kwargs: dict[str, Any],
) -> None:
    """A missing adopted bucket, or one in another region than the spec says: Stalled, so
    kstatus says Failed with the reason in words, and Ready is False. Stalled is not
    terminal: once the bucket is there as the spec says, the next resync makes it Current."""
    bucket = f"adopt-{uuid.uuid4().hex[:8]}"
    if reason == "LocationMismatch":
        gcs.create_bucket(bucket, location="us-central1")
        grant(gcs, bucket, namespace)
    installed.apply(cache("adopt", bucket, **gcs_kwargs), namespace)

    def stalled() -> dict[str, Any] | None:
        obj = installed.get_json("ccache", "adopt", namespace) or {}
        return obj if conditions(obj).get("Stalled", {}).get("status") == "True" else None
    obj = eventually(stalled, timeout=60, what="Stalled")
    conds = conditions(obj)
    assert conds["Stalled"]["reason"] == reason and conds["Ready"]["status"] == "False"
    assert conds["Reconciling"]["status"] == "False"
    result = kstatus(obj)
    assert result["status"] == "Failed" and result["message"] == conds["BucketReady"]["message"]

    if reason == "BucketNotFound":
        gcs.create_bucket(bucket, location="us-central1")
        grant(gcs, bucket, namespace)
    else:
        fixed = cache("adopt", bucket, **{**gcs_kwargs, "location": "us-central1"})
        installed.apply(fixed, namespace)
    eventually(lambda: kstatus(installed.get_json("ccache", "adopt", namespace) or {})["status"] == "Current",
               timeout=60, what="Current once the bucket is usable")


def test_a_pool_with_an_unknown_tpu_shape_is_failed(
    operator: OperatorHandle, installed: Testbed, namespace: str, kstatus: KStatus,
) -> None:
    """No warmer can ever run for a TPU shape GKE does not have: Failed, not Current."""
    pool = {"name": "odd", "tpu": {"type": "tpu-v5p-slice", "topology": "3x3x3"}}
    installed.apply(cache("odd", f"odd-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"], "pools": [pool]}),
                    namespace)

    def evaluated() -> dict[str, Any] | None:
        result = kstatus(installed.get_json("ccache", "odd", namespace) or {})
        return result if result["status"] == "Failed" else None
    result = eventually(evaluated, timeout=60, what="kstatus Failed")
    assert "3x3x3" in result["message"]


def test_a_warm_that_failed_after_its_retries_is_failed(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, kstatus: KStatus,
) -> None:
    """While a retry is pending the failed warm is InProgress (the operator will run it
    again); once no retry is left (CACHEWARM_WARM_RETRIES=1 in the suite) it is Failed."""
    bed = controller_manager
    with versions(bed, namespace, "broken") as seen:
        bed.apply(cache("broken", f"broken-{uuid.uuid4().hex[:8]}",
                        {"targets": ["warm_targets:broken_targets"], "image": "test/targets:1"}), namespace)
        eventually(lambda: conditions(latest(seen)).get("Stalled", {}).get("status") == "True",
                   timeout=180, what="Stalled in the watch")
    pending = [v for v in seen if any(p.get("nextRetryTime") for p in
                                      ((v.get("status") or {}).get("warmup") or {}).get("pools") or [])]
    assert pending, "no version showed the pending retry"
    assert all(kstatus(v)["status"] == "InProgress" for v in pending)
    last = seen[-1]
    result = kstatus(last)
    assert result["status"] == "Failed" and "TypeError" in result["message"]
    assert conditions(last)["Stalled"]["reason"] == "WarmupFailed"
    assert conditions(last)["Ready"]["status"] == "False"
