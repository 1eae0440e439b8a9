"""The heart of cachewarm, end to end: the operator's warmer Job fills the bucket, the
cache turns Warmed, and an ordinary training pod admitted through the webhook loads every
warmed program from the cache and compiles none of its own. Pods run on the stand-in
kubelet (cachewarm.testbed.nodeagent); Jobs, pods and status go through the real
apiserver and kube-controller-manager."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml
from google.cloud import storage

from cachewarm.testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm.testbed.processes import Proc

pytestmark = pytest.mark.e2e


def warm_cache(name: str, bucket: str, warmup: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
            "jax": {"minCompileTimeSecs": 0},
            "warmup": {"image": "demo/train:1", "pools": [{"name": "cpu"}], **warmup},
            **spec,
        },
    }


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def wait_warmed(bed: Testbed, ns: str, name: str, status: str = "True", timeout: float = 180) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns)
        warmed = conditions(obj).get("Warmed")
        if warmed and warmed["status"] == status and (status == "True" or warmed["reason"] != "Warming"):
            return obj
        return None
    return eventually(check, timeout=timeout, what=f"Warmed={status} on {ns}/{name}")


def jobs(bed: Testbed, ns: str, cache: str) -> list[dict[str, Any]]:
    out = bed.kubectl_run("get", "jobs", "-n", ns, "-l", f"cachewarm.dev/warmer-for={cache}", "-o", "json")
    return list(json.loads(out.stdout)["items"])


def train_in_pod(bed: Testbed, ns: str, cache: str, name: str = "trainer") -> dict[str, Any]:
    """Create an ordinary training pod through the webhook, let the node agent run it,
    and return the training script's report plus its log."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": "demo/train:1", "command": ["python", "train.py", "--steps", "2"],
               "env": [{"name": "JAX_LOG_COMPILES", "value": "1"}]}]}}
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(pod))
    assert created.returncode == 0, created.stderr

    def done() -> str | None:
        phase = ((bed.get_json("pod", name, ns) or {}).get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None
    phase = eventually(done, timeout=180, what=f"pod {name} finished")
    log = (bed.workdir / "pods" / ns / name / "train.log").read_text()
    assert phase == "Succeeded", log[-3000:]
    return {**json.loads(log.strip().splitlines()[-1]), "log": log}


@pytest.mark.parametrize("mode", ["targets", "command"])
def test_warmed_cache_is_hit_by_an_ordinary_training_pod(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client, mode: str,
) -> None:
    bucket = f"warm-{uuid.uuid4().hex[:8]}"
    warmup = {"targets": ["train:targets"]} if mode == "targets" else {
        "command": ["python", "train.py", "--steps", "1"]}
    controller_manager.apply(warm_cache("llama", bucket, warmup), namespace)
    obj = wait_warmed(controller_manager, namespace, "llama")

    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["state"] == "Succeeded" and pool["name"] == "cpu"
    assert pool["entriesWritten"] >= 1 and pool["bytesWritten"] > 0
    entries = [b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    assert len(entries) == pool["entriesWritten"] == obj["status"]["cache"]["entries"]
    assert any("jit_train_step" in b.name for b in entries)
    [job] = jobs(controller_manager, namespace, "llama")
    assert job["metadata"]["name"] == pool["job"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "CompilationCache"
    reasons = [e["reason"] for e in controller_manager.events_for("llama", namespace)]
    assert "WarmerCreated" in reasons and "WarmerSucceeded" in reasons

    run = train_in_pod(controller_manager, namespace, "llama")
    assert run["cache_dir"] == f"gs://{bucket}/jax"
    assert run["cache_hits"] >= 1
    assert run["compiled"] == 0, run["log"][-3000:]
    assert "Persistent compilation cache hit for 'jit_train_step'" in run["log"]
    # Nothing new was written by the training run.
    assert len([b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]) == len(entries)


@pytest.mark.parametrize(("target", "error"), [
    ("train:broken_targets", "TypeError"),
    ("train:no_targets", "produced nothing to compile"),
])
def test_warmer_that_compiles_nothing_or_fails_leaves_warmed_false(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, target: str, error: str,
) -> None:
    controller_manager.apply(warm_cache("bad", f"bad-{uuid.uuid4().hex[:8]}", {"targets": [target]},
                                        ), namespace)
    obj = wait_warmed(controller_manager, namespace, "bad", status="False")
    warmed = conditions(obj)["Warmed"]
    assert warmed["reason"] == "WarmupFailed"
    assert error in warmed["message"]
    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["state"] == "Failed" and error in pool["lastError"]


def test_image_change_rewarms_and_same_spec_does_not(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bucket = f"rw-{uuid.uuid4().hex[:8]}"
    spec = warm_cache("rw", bucket, {"targets": ["train:targets"]})
    controller_manager.apply(spec, namespace)
    first = wait_warmed(controller_manager, namespace, "rw")["status"]["warmup"]["pools"][0]["job"]

    controller_manager.apply(spec, namespace)  # the same spec again
    assert [j["metadata"]["name"] for j in jobs(controller_manager, namespace, "rw")] == [first]

    spec["spec"]["warmup"]["image"] = "demo/train:2"
    controller_manager.apply(spec, namespace)

    def rewarmed() -> str | None:
        obj = controller_manager.get_json("ccache", "rw", namespace)
        pool = ((obj or {}).get("status", {}).get("warmup") or {}).get("pools", [{}])[0]
        return pool["job"] if pool.get("job") != first and pool.get("state") == "Succeeded" else None
    second = eventually(rewarmed, timeout=180, what="a second warm for the new image")
    assert sorted(j["metadata"]["name"] for j in jobs(controller_manager, namespace, "rw")) == sorted([first, second])
    obj = wait_warmed(controller_manager, namespace, "rw")
    # The same program in a new image is found in the cache: nothing new written.
    assert obj["status"]["warmup"]["pools"][0]["entriesFound"] >= 1

    annotated = controller_manager.kubectl_run("annotate", "ccache", "rw", "-n", namespace, "cachewarm.dev/rewarm=1")
    assert annotated.returncode == 0, annotated.stderr
    eventually(lambda: len(jobs(controller_manager, namespace, "rw")) == 3, timeout=60, what="manual re-warm Job")


def test_operator_killed_mid_warm_leaves_one_job_per_pool(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    controller_manager.apply(warm_cache("crash", f"crash-{uuid.uuid4().hex[:8]}", {
        "targets": ["train:targets"], "pools": [{"name": "a"}, {"name": "b"}]}), namespace)
    eventually(lambda: len(jobs(controller_manager, namespace, "crash")) == 2, timeout=60, what="two warmer Jobs")
    operator.restart()
    obj = wait_warmed(controller_manager, namespace, "crash")
    names = sorted(j["metadata"]["name"] for j in jobs(controller_manager, namespace, "crash"))
    assert len(names) == 2
    assert sorted(p["job"] for p in obj["status"]["warmup"]["pools"]) == names
