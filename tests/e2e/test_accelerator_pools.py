"""Warmers on GPU and TPU pools, through the operator and the real kube-scheduler.

The testbed's nodes are shaped like GKE's (cachewarm_testbed.nodes): labels, taints and
nvidia.com/gpu / google.com/tpu capacity of a3-highgpu-8g, ct5lp-hightpu-8t and
ct5p-hightpu-4t machines. kube-scheduler decides where each warmer and training pod runs,
so a wrong selector, toleration or chip count leaves the pod Pending here as on GKE. The
node agent then runs the bound pods with JAX on the CPU standing in for the accelerator:
what these tests prove is the placement, the Jobs the operator sends, the warm-then-hit
path and the multi-host runtime, not accelerator numerics.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from typing import Any

import pytest
import yaml
from google.cloud import storage
from kubernetes import client, watch
from kubernetes import config as k8s_config

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
TPU_TOLERATION = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}

# pool as a user writes it -> (nodes its warmers may land on, how a training pod of that
# node pool asks for it: nodeSelector, tolerations, resources)
SINGLE_HOST = {
    "h100": (
        {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
        {"gke-h100-0"},
        ({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, [GPU_TOLERATION],
         {"limits": {"nvidia.com/gpu": "8"}}),
    ),
    "v5e": (
        {"name": "v5e", "tpu": {"type": "tpu-v5-lite-podslice", "topology": "2x4"}},
        {"gke-v5e-0"},
        ({"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
          "cloud.google.com/gke-tpu-topology": "2x4"}, [TPU_TOLERATION],
         {"requests": {"google.com/tpu": "8"}, "limits": {"google.com/tpu": "8"}}),
    ),
    # A pool with the user's own placement on top: integer quantities in the spec, a node
    # selector of GKE's node-pool label and an extra toleration.
    "cpu-overrides": (
        {"name": "cpu", "nodeSelector": {"cloud.google.com/gke-nodepool": "cpu"},
         "tolerations": [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
         "resources": {"requests": {"cpu": 2, "memory": "1Gi"}, "limits": {"memory": "4Gi"}}},
        {"gke-cpu-0"},
        ({"cloud.google.com/gke-nodepool": "cpu"}, [], {"requests": {"cpu": "1"}}),
    ),
    "v5p": (
        {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}},
        {"gke-v5p-0"},
        ({"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x1"},
         [TPU_TOLERATION], {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}),
    ),
}


def cache(name: str, bucket: str, warmup: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
            "jax": {"minCompileTimeSecs": 0},
            "injection": {"mode": "ReadOnly"},
            "warmup": warmup,
            **spec,
        },
    }


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def wait_warmed(bed: Testbed, ns: str, name: str, timeout: float = 300) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns)
        warmed = conditions(obj).get("Warmed", {})
        if warmed.get("reason") == "WarmupFailed":
            pytest.fail(f"warmup failed: {warmed.get('message')}")
        return obj if warmed.get("status") == "True" else None
    return eventually(check, timeout=timeout, what=f"Warmed=True on {ns}/{name}")


def pods(bed: Testbed, ns: str, selector: str) -> list[dict[str, Any]]:
    out = bed.kubectl_run("get", "pods", "-n", ns, "-l", selector, "-o", "json")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["items"])


def jobs(bed: Testbed, ns: str, cache_name: str) -> list[dict[str, Any]]:
    out = bed.kubectl_run("get", "jobs", "-n", ns, "-l", f"cachewarm.dev/warmer-for={cache_name}", "-o", "json")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["items"])


def finished(bed: Testbed, ns: str, name: str, timeout: float = 240) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod = bed.get_json("pod", name, ns) or {}
        return pod if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    return eventually(done, timeout=timeout, what=f"pod {name} finished")


def report(bed: Testbed, ns: str, pod: dict[str, Any], container: str = "train") -> dict[str, Any]:
    """The training program's last line (its JSON report) plus its log."""
    log = bed.pod_log(ns, pod["metadata"]["name"], container)
    assert pod["status"]["phase"] == "Succeeded", log[-3000:]
    return {**json.loads(log.strip().splitlines()[-1]), "log": log}


@pytest.mark.parametrize(("kind", "mode"), [*((k, "targets") for k in sorted(SINGLE_HOST)), ("h100", "command")])
def test_single_host_pool_warms_on_its_node_and_a_training_pod_there_hits(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client, kind: str, mode: str,
) -> None:
    bed = controller_manager
    pool, nodes, (selector, tolerations, resources) = SINGLE_HOST[kind]
    bucket = f"{kind}-{uuid.uuid4().hex[:8]}"
    program = {"targets": ["train:targets"]} if mode == "targets" else {
        "command": ["python", "train.py", "--steps", "1"]}
    bed.apply(cache("llama", bucket, {"image": "demo/train:1", "pools": [pool], **program}), namespace)
    obj = wait_warmed(bed, namespace, "llama")

    [status] = obj["status"]["warmup"]["pools"]
    [job] = jobs(bed, namespace, "llama")
    assert job["metadata"]["name"] == status["job"]
    warmers = pods(bed, namespace, f"job-name={status['job']}")
    assert warmers and {p["spec"]["nodeName"] for p in warmers} <= nodes, [p["spec"]["nodeName"] for p in warmers]
    for key, value in pool.get("nodeSelector", {}).items():
        assert warmers[0]["spec"]["nodeSelector"][key] == value
    for toleration in pool.get("tolerations", []):
        assert toleration in warmers[0]["spec"]["tolerations"]
    if "resources" in pool:  # the spec's integers arrive as the quantities the apiserver keeps
        assert warmers[0]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "1Gi"}
    entries = [b.name for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    assert entries and status["entriesWritten"] == len(entries) == obj["status"]["cache"]["entries"]

    # An ordinary training pod of the same node pool, opted in by its label only.
    train = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "trainer", "labels": {"cachewarm.dev/cache": "llama"}},
             "spec": {"restartPolicy": "Never", "nodeSelector": selector, "tolerations": tolerations,
                      "containers": [{"name": "train", "image": "demo/train:1", "resources": resources,
                                      "command": ["python", "train.py", "--steps", "2"],
                                      "env": [{"name": "JAX_LOG_COMPILES", "value": "1"}]}]}}
    created = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(train))
    assert created.returncode == 0, created.stderr
    pod = finished(bed, namespace, "trainer")
    assert pod["spec"]["nodeName"] in nodes
    run = report(bed, namespace, pod)
    # The default read path: the pod's local copy (the node agent mounts the pod's volume
    # at run["cache_dir"]), not the bucket.
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache" and not run["cache_dir"].startswith("gs://")
    assert run["cache_hits"] >= 1 and run["compiled"] == 0, run["log"][-3000:]


def test_multi_host_tpu_pool_warms_as_one_distributed_runtime_and_training_hits(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client,
) -> None:
    """tpu-v5p-slice 2x2x2 is two ct5p-hightpu-4t hosts: the operator derives that from the
    table (the user gives no `hosts`), runs an Indexed Job of two pods with 4 chips each, on
    the two hosts of ONE slice (the testbed has two such node pools, so a Job that does not
    keep its pods together can be split), and the two warmer processes form one JAX runtime
    through the pool's headless Service. (Pods share the host's network here: this proves the
    coordinator's name resolves through the Service, not which pod answers; the address
    itself is checked by the Job builder's unit tests.)"""
    bed = controller_manager
    bucket = f"v5p16-{uuid.uuid4().hex[:8]}"
    pool = {"name": "v5p16", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}
    bed.apply(cache("slice", bucket, {"image": "test/targets:1", "targets": ["dist_train:targets"],
                                       "pools": [pool]}), namespace)
    obj = wait_warmed(bed, namespace, "slice")

    [status] = obj["status"]["warmup"]["pools"]
    [job] = jobs(bed, namespace, "slice")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    warmers = pods(bed, namespace, f"job-name={status['job']}")
    assert sorted(p["spec"]["nodeName"] for p in warmers) in (["gke-v5p16-0", "gke-v5p16-1"],
                                                              ["gke-v5p16b-0", "gke-v5p16b-1"])
    summaries: dict[int, dict[str, Any]] = {}  # each warmer process's own summary, by rank
    for p in warmers:
        [container] = p["spec"]["containers"]
        assert container["resources"]["limits"]["google.com/tpu"] == "4"
        assert p["status"]["phase"] == "Succeeded"
        [state] = p["status"]["containerStatuses"]
        summary = json.loads(state["state"]["terminated"]["message"])
        summaries[summary["processIndex"]] = summary
    assert sorted(summaries) == [0, 1], summaries
    writer, other = summaries[0], summaries[1]
    entries = [b.name for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    # Only process 0 writes; the pool counts each entry once.
    assert entries and status["entriesWritten"] == len(entries)
    assert any("train_step" in name for name in entries)
    # Process 0 compiled each program and wrote each one: the bucket holds its entries and
    # no more. Rank 1 compiled the same programs (its part of the collective program) and
    # wrote none: on XLA:CPU its keys differ from rank 0's (DESIGN.md), so an entry of its
    # own would be a name more in the bucket; it found none, reports none written, and
    # leaves the refresh, the keys and the fingerprint to process 0.
    assert writer["errors"] == [] and writer["programs"] >= 1
    assert writer["entriesWritten"] == writer["programs"] == len(entries), (writer, entries)
    assert other["errors"] == [] and other["programs"] == writer["programs"], other
    assert (other["entriesFound"], other["entriesWritten"], other["bytesWritten"], other["entriesRefreshed"]) == (
        0, 0, 0, 0), other
    assert not {"keys", "fingerprint"} & set(other), other

    # A two-host training Job on the same slice, labelled for the cache, in the user's own
    # multi-host setup (its own headless Service and JAX distributed env).
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "trainers"},
           "spec": {"clusterIP": "None", "selector": {"job-name": "train"}, "publishNotReadyAddresses": True,
                    "ports": [{"name": "coordinator", "port": 8476}]}}
    selector = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x2"}
    train = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
             "spec": {"completions": 2, "parallelism": 2, "completionMode": "Indexed", "backoffLimit": 0,
                      "template": {"metadata": {"labels": {"cachewarm.dev/cache": "slice"}},
                                   "spec": {"restartPolicy": "Never", "subdomain": "trainers",
                                            "nodeSelector": selector, "tolerations": [TPU_TOLERATION],
                                            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                                                {"labelSelector": {"matchLabels": {"job-name": "train"}},
                                                 "topologyKey": "cloud.google.com/gke-nodepool"}]}},
                                            "containers": [{
                                                "name": "train", "image": "test/targets:1",
                                                "command": ["python", "dist_train.py"],
                                                "resources": {"limits": {"google.com/tpu": "4"}},
                                                "env": [
                                                    {"name": "JAX_COORDINATOR_ADDRESS", "value": "train-0.trainers:8476"},
                                                    {"name": "JAX_NUM_PROCESSES", "value": "2"},
                                                    {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
                                                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                                                ]}]}}}}
    for obj_ in (svc, train):
        created = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj_))
        assert created.returncode == 0, created.stderr
    eventually(lambda: len(pods(bed, namespace, "job-name=train")) == 2, timeout=60, what="two training pods")
    runs = {}
    for p in pods(bed, namespace, "job-name=train"):
        done = finished(bed, namespace, p["metadata"]["name"])
        assert done["spec"]["nodeName"].startswith("gke-v5p16")
        run = report(bed, namespace, done)
        runs[run["process_index"]] = run
    assert sorted(runs) == [0, 1] and runs[0]["process_count"] == runs[1]["process_count"] == 2
    # Process 0 loads every program from the cache.
    assert runs[0]["cache_hits"] == runs[0]["requests"] >= 1 and runs[0]["compiled"] == 0, runs[0]["log"][-3000:]
    # Not shown here: rank 1 hitting warmed entries (TPU ranks share keys; XLA:CPU's differ from rank 0's, DESIGN.md).
    # What rank 1 does here: the same programs asked of the cache, none found, each compiled.
    assert runs[1]["requests"] == runs[0]["requests"] and runs[1]["cache_hits"] == 0, runs[1]["log"][-3000:]
    assert runs[1]["compiled"] == runs[1]["requests"]
    # Neither rank wrote (a ReadOnly cache's pods write nothing; JAX counts a miss only for
    # an entry written), and the bucket holds what the warmer left.
    assert runs[0]["cache_misses"] == runs[1]["cache_misses"] == 0
    assert sorted(b.name for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")) == sorted(entries)


def test_pool_without_a_matching_node_reports_the_schedulers_reason(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    pool = {"name": "l4", "accelerator": {"type": "nvidia-l4", "count": 1}}
    bed.apply(cache("nol4", f"nol4-{uuid.uuid4().hex[:8]}", {"image": "demo/train:1", "targets": ["train:targets"],
                                                            "pools": [pool]}), namespace)

    def unschedulable() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "nol4", namespace) or {}
        pools = ((obj.get("status") or {}).get("warmup") or {}).get("pools") or []
        return pools[0] if pools and "Unschedulable" in pools[0].get("message", "") else None
    # The operator polls every second in the tests; the scheduler answers at once.
    status = eventually(unschedulable, timeout=30, what="the pool status to say why its warmer cannot be placed")
    assert status["state"] == "Pending"
    assert "0/8 nodes are available" in status["message"]
    assert "didn't match Pod's node affinity/selector" in status["message"]
    warmed = conditions(bed.get_json("ccache", "nol4", namespace))["Warmed"]
    assert warmed["status"] == "False" and "Unschedulable" in warmed["message"]


class JobWatch:
    """Every change of a cache's warmer Jobs, in the apiserver's order (a watch, not
    samples, so no overlap between two Jobs can slip between two looks). `peak[pool]` is
    the most Jobs of that pool that were unfinished at the same time, counting Jobs being
    deleted until they are gone."""

    def __init__(self, bed: Testbed, namespace: str, cache_name: str) -> None:
        self.api = client.BatchV1Api(k8s_config.new_client_from_config(config_file=str(bed.kubeconfig)))
        self.namespace = namespace
        self.selector = f"cachewarm.dev/warmer-for={cache_name}"
        self.alive: dict[str, set[str]] = {}
        self.peak: dict[str, int] = {}
        self.events = 0
        self.error: BaseException | None = None
        self.stopped = False
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.follow()
        except BaseException as exc:  # noqa: BLE001 - a watch that died must fail the test, not undercount
            if not self.stopped:
                self.error = exc

    def follow(self) -> None:
        for event in self.watch.stream(self.api.list_namespaced_job, self.namespace, label_selector=self.selector,
                                       timeout_seconds=900):
            job = event["object"]
            pool = job.metadata.labels["cachewarm.dev/pool"]
            done = any(c.status == "True" and c.type in ("Complete", "Failed") for c in job.status.conditions or [])
            names = self.alive.setdefault(pool, set())
            if event["type"] == "DELETED" or done:
                names.discard(job.metadata.name)
            else:
                names.add(job.metadata.name)
            self.peak[pool] = max(self.peak.get(pool, 0), len(names))
            self.events += 1

    def stop(self) -> None:
        assert self.error is None, f"the Job watch failed: {self.error!r}"
        self.stopped = True
        self.watch.stop()


def test_operator_kills_while_the_spec_changes_leave_one_warmer_per_pool(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """20 SIGKILLs of the operator while the warmup keeps changing: at no point do two
    unfinished Jobs exist for one pool, and at the end each pool has exactly one, for the
    latest spec."""
    bed = controller_manager
    rng = random.Random(8)
    spec = cache("churn", f"churn-{uuid.uuid4().hex[:8]}", {
        "image": "test/targets:1", "targets": ["warm_targets:stuck_targets"],
        "pools": [{"name": "a"}, {"name": "b"}], "env": [{"name": "ROUND", "value": "0"}]})
    seen = JobWatch(bed, namespace, "churn")
    bed.apply(spec, namespace)
    eventually(lambda: len(seen.alive.get("a", ())) == len(seen.alive.get("b", ())) == 1, timeout=60,
               what="the first warmers")
    for round_ in range(1, 21):
        spec["spec"]["warmup"]["env"] = [{"name": "ROUND", "value": str(round_)}]
        bed.apply(spec, namespace)
        time.sleep(rng.uniform(0, 2.5))
        operator.restart()

    def settled() -> list[dict[str, Any]] | None:
        current = jobs(bed, namespace, "churn")
        return current if len(current) == 2 and all(j["metadata"].get("deletionTimestamp") is None
                                                     for j in current) else None
    final = eventually(settled, timeout=120, what="one Job per pool")
    seen.stop()
    assert seen.peak == {"a": 1, "b": 1}, (seen.peak, seen.events)
    assert seen.events > 40  # every round replaced both warmers: creations, deletions, changes
    assert sorted(j["metadata"]["labels"]["cachewarm.dev/pool"] for j in final) == ["a", "b"]
    for job in final:
        env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["ROUND"] == "20", env
    obj = bed.get_json("ccache", "churn", namespace) or {}
    assert sorted(p["job"] for p in obj["status"]["warmup"]["pools"]) == sorted(j["metadata"]["name"] for j in final)
    bed.kubectl_run("delete", "ccache", "churn", "-n", namespace, "--wait=false")


def test_unknown_tpu_shape_is_a_condition_and_the_bucket_is_still_reported(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """A TPU type/topology pair GKE has no machine shape for: no Job (it could only ever be
    Pending), a Warmed condition naming the problem and the shapes that exist, an Event, and
    the bucket part of the reconcile still in status: never a blank row."""
    bed = controller_manager
    bucket = f"odd-{uuid.uuid4().hex[:8]}"
    pool = {"name": "odd", "tpu": {"type": "tpu-v5p-slice", "topology": "3x3x3"}}
    bed.apply(cache("odd", bucket, {"image": "demo/train:1", "targets": ["train:targets"], "pools": [pool]}),
              namespace)

    def reported() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "odd", namespace) or {}
        return obj if conditions(obj).get("Warmed", {}).get("reason") == "UnknownTpuShape" else None
    obj = eventually(reported, timeout=30, what="Warmed=False UnknownTpuShape")
    warmed = conditions(obj)["Warmed"]
    assert warmed["status"] == "False" and "3x3x3" in warmed["message"] and "2x2x2" in warmed["message"]
    assert conditions(obj)["BucketReady"]["status"] == "True"
    assert obj["status"]["bucket"]["url"] == f"gs://{bucket}/jax"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert jobs(bed, namespace, "odd") == []
    eventually(lambda: any(e["reason"] == "UnknownTpuShape" for e in bed.events_for("odd", namespace)),
               timeout=20, what="an UnknownTpuShape event")
