"""A torch cache as a user runs it, on the real node (issue 31's proof).

The torch demo's training image (demo/torch/Dockerfile: torch 2.15.0 from PyPI and g++, 5.4 GB,
built from our Dockerfile and imported into the real node's containerd) holds a
torch.compile'd training step and eval (demo/torch/train_torch.py, Inductor's C++ backend on
CPU). The operator is installed from manifests/ as in test_real_install.py. Then, through the
operator only:

- a CompilationCache with `spec.torch: {}` gets a warmer Job that runs the real entrypoint
  (`python train_torch.py --steps 1`) in that image; its process 0 uploads the Inductor
  directory as one archive and a manifest that names it; the operator reads the summary from
  the termination message the kubelet wrote, and the cache turns Warmed;
- a labelled training pod gets the torch env, a writable local directory and the local copy
  from the in-cluster webhook; the copy seeds the directory from the archive before the
  program compiles, and the program's own counters (torch's FX graph and AOTAutograd caches)
  count hits and no miss; its reporter's report reaches status.usage.torch, with seconds
  saved against the warmer's own compile;
- a pod with an Inductor setting that enters the key (TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1 in
  its own env) misses, and KeysMatch names that variable.

What differs from GKE: as in test_real_install.py (the GCS emulator behind the testbed's
proxy, a CPU node, no cluster DNS). Timings are not asserted here: bench/torch_start.py
measures cold, warm-from-bucket and the local floor in one run (BENCHMARKS.md). Needs root.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachewarm_testbed import images, install
from cachewarm_testbed.cluster import Testbed, eventually
from cachewarm_testbed.realnode import RealNode

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="a real kubelet and containerd need root"),
    # The module's set-up imports the 5.4 GB torch image into the node (74 s here) and warms
    # the program cold (~25 s of compile in a pod): more than the suite's 300 s default.
    pytest.mark.timeout(900),
]

PROGRAM = ["python", "train_torch.py", "--steps", "1"]
CACHE = "mlp"
# An Inductor setting read from the env that enters every FX graph's key (measured: with it
# all 3 FX graphs and both AOTAutograd entries of the program miss a cache warmed without it).
KEYED_SETTING = {"name": "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE", "value": "1"}


@dataclass
class Installed:
    bed: Testbed
    node: RealNode
    gcs_env: list[dict[str, str]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Installed]:
    with install.on_real_node({"CACHEWARM_WARM_POLL_SECONDS": "2", "CACHEWARM_USAGE_FLUSH_SECONDS": "2"},
                              torch=True) as (bed, node, _):
        env = bed.env()
        yield Installed(bed, node, [{"name": k, "value": env[k]} for k in install.GCS_ENV])


def torch_cache(bucket: str, gcs_env: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": CACHE},
        "spec": {
            "storage": {"gcs": {"bucket": bucket, "prefix": CACHE, "location": "us-central1"}},
            "torch": {},
            "warmup": {"image": images.TORCH_TRAIN_IMAGE, "command": PROGRAM, "pools": [{"name": "cpu"}],
                       "env": gcs_env},
        },
    }


@dataclass
class Warmed:
    ns: str
    bucket: str
    cache: dict[str, Any]
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def warmed(cluster: Installed) -> Warmed:
    """A torch cache the operator warmed (once for the module: a cold compile of the
    program takes ~25 s of this VM's CPU)."""
    bed = cluster.bed
    ns = f"torch-{uuid.uuid4().hex[:8]}"
    assert bed.kubectl_run("create", "namespace", ns).returncode == 0
    eventually(lambda: bed.get_json("serviceaccount", "default", ns), what="default ServiceAccount")
    bucket = f"torch-{uuid.uuid4().hex[:10]}"
    bed.apply(torch_cache(bucket, cluster.gcs_env), ns)

    def done() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", CACHE, ns) or {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        if conds.get("Warmed", {}).get("reason") == "WarmupFailed":
            pytest.fail(f"warmup failed: {conds['Warmed']['message']}")
        return obj if conds.get("Warmed", {}).get("status") == "True" else None
    obj = eventually(done, timeout=420, what="the torch cache to be Warmed")
    [pool] = obj["status"]["warmup"]["pools"]
    pods = json.loads(bed.kubectl_run("get", "pods", "-n", ns, "-l", f"job-name={pool['job']}", "-o", "json").stdout)
    [warmer] = pods["items"]
    [main] = warmer["status"]["containerStatuses"]
    return Warmed(ns, bucket, obj, json.loads(main["state"]["terminated"]["message"]))


def program_line(logs: str) -> dict[str, Any]:
    """The program's JSON line (its last): the container's log interleaves torch's warnings on
    stderr with it (a warning's source line can come last)."""
    for text in reversed(logs.strip().splitlines()):
        if text.startswith("{") and '"counters"' in text:
            line: dict[str, Any] = json.loads(text)
            return line
    raise AssertionError(f"no line of the program's in its log:\n{logs[-3000:]}")


def run_pod(bed: Testbed, ns: str, name: str, env: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A labelled training pod run to its end: (the pod as stored at the end, the program's JSON line)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": CACHE}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": images.TORCH_TRAIN_IMAGE, "command": PROGRAM, "env": env}]}}
    bed.apply(pod, ns)

    def finished() -> dict[str, Any] | None:
        got = bed.get_json("pod", name, ns) or {}
        return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    done = eventually(finished, timeout=300, what=f"training pod {name} to finish")
    logs = bed.kubectl_run("logs", name, "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", logs.stdout[-3000:] + logs.stderr[-3000:]
    return done, program_line(logs.stdout)


def usage_of(bed: Testbed, ns: str, pods: int) -> dict[str, Any]:
    def got() -> dict[str, Any] | None:
        usage = ((bed.get_json("ccache", CACHE, ns) or {}).get("status") or {}).get("usage") or {}
        return usage if (usage.get("torch") or {}).get("pods", 0) >= pods else None
    return eventually(got, timeout=90, what=f"status.usage.torch from {pods} training pod(s)")


def keys_match(bed: Testbed, ns: str, status: str) -> dict[str, Any]:
    def got() -> dict[str, Any] | None:
        conds = ((bed.get_json("ccache", CACHE, ns) or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "KeysMatch" and c["status"] == status), None)
    return eventually(got, timeout=90, what=f"KeysMatch {status}")


def test_a_torch_cache_is_warmed_by_its_job_and_a_labelled_pod_compiles_no_graph(
        cluster: Installed, warmed: Warmed) -> None:
    bed, ns = cluster.bed, warmed.ns
    [pool] = warmed.cache["status"]["warmup"]["pools"]
    summary = warmed.summary
    # The warmer compiled the program cold (every FX graph a miss) and uploaded one archive.
    assert summary["torch"]["fxGraphMisses"] >= 1 and summary["torch"]["fxGraphHits"] == 0, summary
    assert pool["state"] == "Succeeded" and pool["entriesWritten"] == 1, pool
    fp = pool["fingerprint"]
    # The PyPI wheel's version names its CUDA build even on CPU.
    assert (fp["framework"], fp["platform"], fp["versions"]["torch"]) == ("torch", "cpu", "2.15.0+cu132"), fp
    gcs = storage.Client(project="test", credentials=AnonymousCredentials(),
                         client_options={"api_endpoint": bed.env()["STORAGE_EMULATOR_HOST"]})
    archives = [b.name for b in gcs.list_blobs(warmed.bucket, prefix=f"{CACHE}/torch-inductor-")]
    assert len(archives) == 1 and archives[0].endswith("-cache"), archives

    stored, line = run_pod(bed, ns, "train", cluster.gcs_env)
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0]["env"]}
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/cachewarm-torch" and "JAX_COMPILATION_CACHE_DIR" not in env, env
    inductor, aot = line["counters"]["inductor"], line["counters"]["aotAutograd"]
    # Every FX graph and AOTAutograd entry of the program came from the warmer's archive.
    assert inductor.get("fxgraph_cache_hit", 0) >= 1 and inductor.get("fxgraph_cache_miss", 0) == 0, line
    assert aot.get("autograd_cache_hit", 0) >= 1 and aot.get("autograd_cache_miss", 0) == 0, line

    usage = usage_of(bed, ns, pods=1)["torch"]
    assert (usage["fxGraphHits"], usage["fxGraphMisses"]) == (inductor["fxgraph_cache_hit"], 0), usage
    assert (usage["aotAutogradHits"], usage["aotAutogradMisses"]) == (aot["autograd_cache_hit"], 0), usage
    # Measured, not assumed: the warmer's own compile seconds against this pod's.
    assert usage["warmerCompileSeconds"] > usage["compileSeconds"] >= 0, usage
    assert usage["secondsSaved"] > 0 and usage["hitButNotSaved"] == 0, usage
    assert keys_match(bed, ns, "True")["reason"] == "FingerprintsMatch"


def test_a_pod_with_an_inductor_setting_in_its_key_misses_and_keysmatch_names_the_setting(
        cluster: Installed, warmed: Warmed) -> None:
    bed, ns = cluster.bed, warmed.ns
    _, line = run_pod(bed, ns, "keyed", [*cluster.gcs_env, KEYED_SETTING])
    assert line["counters"]["inductor"].get("fxgraph_cache_miss", 0) >= 1, line
    cond = keys_match(bed, ns, "False")
    assert cond["reason"] == "FingerprintsDiffer" and KEYED_SETTING["name"] in cond["message"], cond
