"""What the operator sends to the cluster for a torch cache (spec.torch, issue 31), through
the operator, the real kube-apiserver and kube-scheduler and the simulated GKE nodes
(cachewarm_testbed.nodes): each pool's warmer Job as the operator created it, placed by
the scheduler on a CPU and an H100 node, and a labelled pod as the operator's webhook
admits it, by init container and in process.

What runs in the warmer pods is not judged here: the testbed's images hold no torch
(the torch warm, end to end on the real node, is the lead's e2e); this file proves the
objects: the torch env and no JAX cache env, the writable emptyDir at spec.torch.cacheDir,
the copier told where to extract.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

CACHE_DIR = "/data/inductor"
# The names as the design spells them (written out, not read from the code under test).
TORCH_ENV = {"CACHEWARM_FRAMEWORK": "torch", "TORCHINDUCTOR_CACHE_DIR": CACHE_DIR,
             "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton"}
TORCH_MOUNT = {"name": "cachewarm-torch", "mountPath": CACHE_DIR}
TORCH_VOLUME = {"name": "cachewarm-torch", "emptyDir": {}}
# pool -> the nodes its warmers may land on (the scheduler decides, from the Job's
# selector, tolerations and resources)
POOLS = {"cpu": ({"name": "cpu"}, {"gke-cpu-0"}),
         "h100": ({"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}, {"gke-h100-0"})}


def torch_cache(name: str, bucket: str) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": bucket, "prefix": "torch", "location": "us-central1"}},
            "torch": {"cacheDir": CACHE_DIR, "maxArchiveSize": "1Gi"},
            # The spec's own local copy: the default one waits for a warmer's manifest,
            # which no warmer here writes (no torch in the testbed's images).
            "injection": {"mode": "ReadOnly", "localCopy": {}},
            "warmup": {"image": "demo/train:1", "command": ["python", "train_torch.py", "--steps", "1"],
                       "pools": [pool for pool, _ in POOLS.values()]},
        },
    }


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def jax_cache_env(container: dict[str, Any]) -> list[str]:
    return [name for name in env_of(container) if name.startswith("JAX_")]


def listed(bed: Testbed, kind: str, ns: str, selector: str) -> list[dict[str, Any]]:
    out = bed.kubectl_run("get", kind, "-n", ns, "-l", selector, "-o", "json")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["items"])


def test_each_pools_torch_warmer_job_carries_the_torch_env_and_directory_and_lands_on_its_node(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    bucket = f"torch-{uuid.uuid4().hex[:8]}"
    bed.apply(torch_cache("llama", bucket), namespace)

    def both_jobs() -> dict[str, dict[str, Any]] | None:
        found = {j["metadata"]["labels"]["cachewarm.dev/pool"]: j
                 for j in listed(bed, "jobs", namespace, "cachewarm.dev/warmer-for=llama")}
        return found if set(found) == set(POOLS) else None
    jobs = eventually(both_jobs, timeout=120, what="a warmer Job of each pool")
    for pool, job in jobs.items():
        pod_spec = job["spec"]["template"]["spec"]
        [warm] = pod_spec["containers"]
        env = env_of(warm)
        assert {k: env.get(k) for k in TORCH_ENV} == TORCH_ENV, (pool, env)
        assert env["CACHEWARM_CACHE_URL"] == f"gs://{bucket}/torch", pool
        assert env["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(2**30), pool
        assert env["CACHEWARM_MANIFEST"].startswith(f"gs://{bucket}/torch/.cachewarm/pools/{namespace}/llama/{pool}/")
        assert jax_cache_env(warm) == [], (pool, env)
        # As the apiserver stored it: writable (no readOnly), an emptyDir.
        assert TORCH_MOUNT in warm["volumeMounts"], (pool, warm["volumeMounts"])
        assert TORCH_VOLUME in pod_spec["volumes"], (pool, pod_spec["volumes"])

    # kube-scheduler places each pool's warmer pod by the Job's own placement.
    def bound(pool: str) -> str | None:
        names = [p["spec"].get("nodeName") for p in listed(bed, "pods", namespace,
                                                          f"cachewarm.dev/warmer-for=llama,cachewarm.dev/pool={pool}")]
        return next((n for n in names if n), None)
    for pool, (_, nodes) in POOLS.items():
        node = eventually(lambda: bound(pool), timeout=120, what=f"the {pool} warmer pod bound to a node")
        assert node in nodes, (pool, node)


def pod(name: str, *, pythonpath: str | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "train", "image": "demo/train:1", "command": ["python", "train_torch.py"],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if pythonpath is not None:  # a PYTHONPATH of its own: the webhook knows it, the copy runs in process
        container["env"] = [{"name": "PYTHONPATH", "value": pythonpath}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"cachewarm.dev/cache": "llama"}},
            "spec": {"restartPolicy": "Never", "containers": [container]}}


def admitted(bed: Testbed, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
    """The pod as the apiserver would store it after every admission (a server-side dry
    run: the webhook answers as for a create, nothing is stored or run)."""
    out = bed.kubectl_run("create", "--dry-run=server", "-o", "json", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.mark.parametrize("mode", ["init-container", "in-process"])
def test_a_labelled_pod_of_a_torch_cache_gets_the_torch_env_its_directory_and_a_copier_that_extracts_there(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str, mode: str,
) -> None:
    bed = controller_manager
    bed.apply(torch_cache("llama", f"torch-{uuid.uuid4().hex[:8]}"), namespace)
    body = pod("trainer", pythonpath="/app" if mode == "in-process" else None)

    def patched() -> dict[str, Any] | None:
        # Once the webhook's index has the cache (and, in process, its verified boot ConfigMap).
        got = admitted(bed, namespace, body)["spec"]
        inits = [c["name"] for c in got.get("initContainers") or []]
        done = "cachewarm-copy" in inits if mode == "init-container" else \
            any(v["name"] == "cachewarm-boot" for v in got.get("volumes") or [])
        return got if done else None
    spec = eventually(patched, timeout=120, what=f"the pod admitted with its local copy ({mode})")
    [train] = spec["containers"]
    env = env_of(train)
    assert {k: env.get(k) for k in TORCH_ENV} == TORCH_ENV, env
    assert jax_cache_env(train) == [] and "CACHEWARM_CACHE_URL" not in env, env
    assert TORCH_MOUNT in train["volumeMounts"], train["volumeMounts"]
    assert TORCH_VOLUME in spec["volumes"], spec["volumes"]
    if mode == "init-container":
        [copier] = [c for c in spec["initContainers"] if c["name"] == "cachewarm-copy"]
        copier_env, copier_mounts = env_of(copier), copier["volumeMounts"]
    else:  # the copy runs in the training container's first python process
        assert not spec.get("initContainers"), spec.get("initContainers")
        copier_env, copier_mounts = env, train["volumeMounts"]
        assert copier_env["CACHEWARM_COPY_IN_PROCESS"] == "1"
    assert copier_env["CACHEWARM_TORCH_DIR"] == CACHE_DIR, copier_env
    assert copier_env["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(2**30), copier_env
    assert TORCH_MOUNT in copier_mounts, copier_mounts
