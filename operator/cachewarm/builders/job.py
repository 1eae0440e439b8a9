"""Warmer Jobs: one per node pool, in the training image, with the cache env.

The Job's name carries a hash of everything that changes the compiled program (image,
command or targets, env, accelerator, hosts, cache settings, and the re-warm token), so
the same spec always names the same Job and a change names a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from cachewarm import constants as c
from cachewarm.builders.injection import cache_env
from cachewarm.model import CacheSpec, Pool, Warmup

WARMER_DIR = "/cachewarm"
WARMER_FILE = f"{WARMER_DIR}/warm.py"
# Where warmer_image/Dockerfile puts the file the init container copies.
WARMER_SOURCE = "/opt/cachewarm/warm.py"
COORDINATOR_PORT = 8476
LABEL_WARMER_FOR = c.LABEL_WARMER_FOR
LABEL_POOL = c.LABEL_POOL
LABEL_SPEC_HASH = c.LABEL_SPEC_HASH
ANNOTATION_REWARM = c.REWARM_ANNOTATION


def spec_hash(cache: CacheSpec, pool: Pool, token: str = "") -> str:
    """Short hash of what makes this pool's compiled programs what they are."""
    assert cache.warmup is not None
    material = {
        "warmup": cache.warmup.model_dump(by_alias=True, exclude={"pools", "schedule", "backoff_limit",
                                                                   "active_deadline_seconds",
                                                                   "ttl_seconds_after_finished"}),
        "pool": pool.model_dump(by_alias=True, exclude={"name"}),
        "env": cache_env(cache, "warmer"),
        "token": token,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:10]


def job_name(cache_name: str, pool: Pool, digest: str) -> str:
    """<cache>-<pool>-<hash>, at most 63 characters (a label value and a DNS label)."""
    return f"{cache_name[:31].rstrip('-')}-{pool.name}-{digest}"


def _tpu_chips_per_host(pool: Pool) -> int:
    assert pool.tpu is not None
    if pool.chips_per_host:
        return pool.chips_per_host
    chips = math.prod(int(d) for d in pool.tpu.topology.split("x"))
    return max(1, chips // pool.hosts)


def placement(pool: Pool) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """nodeSelector, tolerations and resources for a pool, from GKE's labels and resource
    names, with the pool's own overrides on top."""
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    resources: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    if pool.accelerator is not None:
        selector["cloud.google.com/gke-accelerator"] = pool.accelerator.type
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        resources["limits"]["nvidia.com/gpu"] = pool.accelerator.count
    elif pool.tpu is not None:
        selector["cloud.google.com/gke-tpu-accelerator"] = pool.tpu.type
        selector["cloud.google.com/gke-tpu-topology"] = pool.tpu.topology
        tolerations.append({"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"})
        chips = _tpu_chips_per_host(pool)
        resources["requests"]["google.com/tpu"] = chips
        resources["limits"]["google.com/tpu"] = chips
    selector.update(pool.node_selector)
    tolerations.extend(dict(t) for t in pool.tolerations)
    for kind in ("requests", "limits"):
        resources[kind].update(pool.resources.get(kind, {}))
    return selector, tolerations, {k: v for k, v in resources.items() if v}


def _warmer_args(warmup: Warmup) -> list[str]:
    if warmup.targets:
        return [warmup.python, WARMER_FILE, "targets", f"--parallel={warmup.parallelism}", *warmup.targets]
    return [warmup.python, WARMER_FILE, "command", "--", *(warmup.command or [])]


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND, "name": owner["name"],
            "uid": owner["uid"], "controller": True, "blockOwnerDeletion": True}


def headless_service(cache_name: str, namespace: str, pool: Pool, name: str,
                     owner: Mapping[str, Any]) -> dict[str, Any]:
    """The Service that gives each host of a multi-host warmer a stable DNS name."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "ownerReferences": [owner_reference(owner)],
                     "labels": {c.MANAGED_BY_LABEL: c.MANAGED_BY, LABEL_WARMER_FOR: cache_name, LABEL_POOL: pool.name}},
        "spec": {"clusterIP": "None", "selector": {"job-name": name},
                 "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]},
    }


def warmer_job(
    cache: CacheSpec, *, cache_name: str, namespace: str, pool: Pool, digest: str,
    owner: Mapping[str, Any], warmer_image: str,
) -> dict[str, Any]:
    """The Job that warms `pool`. `owner` is {"name", "uid"} of the CompilationCache."""
    warmup = cache.warmup
    assert warmup is not None
    name = job_name(cache_name, pool, digest)
    labels = {c.MANAGED_BY_LABEL: c.MANAGED_BY, LABEL_WARMER_FOR: cache_name, LABEL_POOL: pool.name,
              LABEL_SPEC_HASH: digest}
    selector, tolerations, resources = placement(pool)
    env: list[dict[str, Any]] = [*cache_env(cache, "warmer"), *({"name": e.name, "value": e.value} for e in warmup.env)]
    if pool.hosts > 1:
        env += [
            {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{name}-0.{name}:{COORDINATOR_PORT}"},
            {"name": "JAX_NUM_PROCESSES", "value": str(pool.hosts)},
            {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        ]
    container: dict[str, Any] = {
        "name": "warm",
        "image": warmup.image,
        "command": _warmer_args(warmup),
        "env": env,
        "volumeMounts": [{"name": "cachewarm", "mountPath": WARMER_DIR, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if warmup.working_dir:
        container["workingDir"] = warmup.working_dir
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "initContainers": [{
            "name": "cachewarm-bootstrap",
            "image": warmer_image,
            "command": ["cp", WARMER_SOURCE, f"{WARMER_DIR}/warm.py"],
            "volumeMounts": [{"name": "cachewarm", "mountPath": WARMER_DIR}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }],
        "containers": [container],
        "volumes": [{"name": "cachewarm", "emptyDir": {"sizeLimit": "16Mi"}}],
    }
    if selector:
        pod_spec["nodeSelector"] = selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    job_spec: dict[str, Any] = {
        "backoffLimit": warmup.backoff_limit,
        "activeDeadlineSeconds": warmup.active_deadline_seconds,
        "ttlSecondsAfterFinished": warmup.ttl_seconds_after_finished,
        "completions": pool.hosts,
        "parallelism": pool.hosts,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
    }
    if pool.hosts > 1:
        job_spec["completionMode"] = "Indexed"
        pod_spec["subdomain"] = name
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "ownerReferences": [owner_reference(owner)]},
        "spec": job_spec,
    }
