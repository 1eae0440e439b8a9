"""Warmer Jobs: one per node pool, in the training image, with the cache env.

The Job's name carries a hash of everything that changes the compiled program (image,
command or targets, env, accelerator, hosts, cache settings, and the re-warm token), so
the same spec always names the same Job and a change names a new one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cachewarm.agents import payload
from cachewarm.api import constants as c
from cachewarm.builders.injection import cache_env, torch_dir_mount, torch_dir_volume
from cachewarm.builders.placement import manifest_url, placement, pool_shape, quantity
from cachewarm.api.model import CacheSpec, Pool, Warmup

WARMER_DIR = "/cachewarm"
WARMER_FILE = f"{WARMER_DIR}/{payload.WARMER}"
# Where warmer_image/Dockerfile puts the file the init container copies.
WARMER_SOURCE = payload.in_image(payload.WARMER)
COORDINATOR_PORT = 8476
GKE_NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
# The manifest a local copy trusts (issue 28: version 2 with digests, its generation recorded
# from the warmer's own pod); part of a local-copy cache's specHash.
MANIFEST_TRUST = 2


def spec_hash(cache: CacheSpec, pool: Pool, token: str = "") -> str:
    """Short hash of what makes this pool's compiled programs what they are. Raises
    TpuShapeError (the shape is part of the program)."""
    assert cache.warmup is not None
    shape = pool_shape(pool)
    material = {
        # Who runs the warmer (its ServiceAccount) does not change the programs: not hashed,
        # so a new writer identity takes effect at the next warm without re-warming.
        "warmup": cache.warmup.model_dump(by_alias=True, exclude={"pools", "schedule", "backoff_limit",
                                                                   "active_deadline_seconds",
                                                                   "ttl_seconds_after_finished",
                                                                   "service_account_name"}),
        # The resolved shape, not the raw hosts/chipsPerHost: stating what the table derives
        # does not re-warm.
        "pool": pool.model_dump(by_alias=True, exclude={"name", "hosts", "chips_per_host"}),
        "shape": [shape.hosts, shape.chips_per_host],
        "env": cache_env(cache, "warmer"),
        "token": token,
        # A cache with a local copy trusts only a manifest whose generation its own warmer
        # reported (issue 28): pools warmed before there was one are warmed once more, so
        # their pods copy again; caches without a local copy keep their hash.
        **({"manifestTrust": MANIFEST_TRUST} if cache.injection.local_copy is not None else {}),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:10]


def _dns_part(name: str, limit: int) -> str:
    return name[:limit].replace(".", "-").rstrip("-")


def job_name(cache_name: str, pool: Pool, digest: str) -> str:
    """<cache>-<pool>-<hash>, so that the pod hostnames of an Indexed Job, <job>-<index>,
    are DNS labels too (the apiserver refuses the Job otherwise): at most 59 characters
    for up to 1000 hosts (index of 3 digits), one fewer per further digit of the pool's
    largest index (tpu-v5p-slice 16x16x24 has 1536 hosts). Raises TpuShapeError."""
    extra_digits = max(0, len(str(pool_shape(pool).hosts - 1)) - 3)
    return f"{_dns_part(cache_name, 27 - extra_digits)}-{pool.name}-{digest}"


def service_name(cache_name: str, pool_name: str) -> str:
    """The headless Service of a pool's multi-host warmers: one per pool, whatever the
    program, so its name has no spec hash. cw-<cache>-<pool>-<hash of both>: a DNS-1035
    label (starts with a letter) of at most 61 characters, distinct per (cache, pool)."""
    digest = hashlib.sha256(f"{cache_name}/{pool_name}".encode()).hexdigest()[:6]
    return f"cw-{_dns_part(cache_name, 30)}-{pool_name}-{digest}"



def same_node_pool(labels: Mapping[str, str]) -> dict[str, Any]:
    """Pod affinity that puts every pod of one multi-host Job on one GKE node pool (a TPU
    slice is one node pool, and its hosts share the interconnect the program compiles
    for), whichever pool the first pod lands on: the first pod schedules freely, as
    Kubernetes lets a pod match its own affinity when no pod matches yet. `labels` are
    the Job's pod labels; warmer-for, pool and spec-hash name one Job per namespace."""
    selector = {k: labels[k] for k in (c.LABEL_WARMER_FOR, c.LABEL_POOL, c.LABEL_SPEC_HASH)}
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": selector}, "topologyKey": GKE_NODE_POOL_LABEL}]}}


def _warmer_args(warmup: Warmup) -> list[str]:
    if warmup.targets:
        return [warmup.python, WARMER_FILE, "targets", f"--parallel={warmup.parallelism}", *warmup.targets]
    return [warmup.python, WARMER_FILE, "command", "--", *(warmup.command or [])]


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND, "name": owner["name"],
            "uid": owner["uid"], "controller": True, "blockOwnerDeletion": True}


def pool_labels(cache_name: str, pool_name: str) -> dict[str, str]:
    """Labels on every warmer Job, pod and Service of a pool (never CACHE_LABEL)."""
    return {c.MANAGED_BY_LABEL: c.MANAGED_BY, c.LABEL_WARMER_FOR: cache_name, c.LABEL_POOL: pool_name}


def headless_service(cache_name: str, namespace: str, pool: Pool, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The Service that gives each host of a pool's multi-host warmer a stable DNS name,
    <job>-<index>.<service>, before the pods are ready (the coordinator must be reachable
    while every process is still starting)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name(cache_name, pool.name), "namespace": namespace,
                     "ownerReferences": [owner_reference(owner)], "labels": pool_labels(cache_name, pool.name)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {c.LABEL_WARMER_FOR: cache_name, c.LABEL_POOL: pool.name},
                 "ports": [{"name": "coordinator", "port": COORDINATOR_PORT, "protocol": "TCP"}]},
    }


def warmer_env(cache: CacheSpec, *, cache_name: str, namespace: str, pool: Pool, name: str,
               hosts: int) -> list[dict[str, Any]]:
    """The warm container's env: the warmer's cache env, the spec's own, where to write the
    manifest, and for a pool of `hosts` > 1 how its processes find each other (`name`: the Job's)."""
    warmup = cache.warmup
    assert warmup is not None
    env: list[dict[str, Any]] = [
        *cache_env(cache, "warmer"),
        *({"name": e.name, "value": e.value} for e in warmup.env if e.name != c.ENV_MANIFEST),
        # Where process 0 writes the entries the warm relied on, for pods' local copies:
        # an object of this Job's own (`name`), never rewritten by a later warm. Not in
        # spec_hash: where the manifest goes does not change the program.
        {"name": c.ENV_MANIFEST, "value": manifest_url(cache.storage.gcs, namespace, cache_name, pool.name, name)},
    ]
    if hosts > 1:
        # Pod <job>-<index> in the pool's Service; process 0 hosts the coordinator.
        env += [
            {"name": c.ENV_COORDINATOR_ADDRESS,
             "value": f"{name}-0.{service_name(cache_name, pool.name)}:{COORDINATOR_PORT}"},
            {"name": c.ENV_NUM_PROCESSES, "value": str(hosts)},
            {"name": c.ENV_PROCESS_ID, "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        ]
    return env


def warmer_container(warmup: Warmup, env: list[dict[str, Any]], resources: Mapping[str, Any]) -> dict[str, Any]:
    """The container that runs the warmer in the training image, from the file the
    bootstrap init container copied into WARMER_DIR."""
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
    return container


def warmer_pod_spec(warmup: Warmup, container: dict[str, Any], *, warmer_image: str, selector: Mapping[str, str],
                    tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    """The warmer pod: the bootstrap init container that copies the warmer out of
    `warmer_image`, then the warm container, on the pool's nodes (`selector`, `tolerations`)."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "initContainers": [{
            "name": "cachewarm-bootstrap",
            "image": warmer_image,
            "command": ["cp", WARMER_SOURCE, WARMER_FILE],
            "volumeMounts": [{"name": "cachewarm", "mountPath": WARMER_DIR}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }],
        "containers": [container],
        "volumes": [{"name": "cachewarm", "emptyDir": {"sizeLimit": "16Mi"}}],
    }
    if warmup.service_account_name:
        pod_spec["serviceAccountName"] = warmup.service_account_name
    if selector:
        pod_spec["nodeSelector"] = selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return pod_spec


def warmer_job(
    cache: CacheSpec, *, cache_name: str, namespace: str, pool: Pool, digest: str,
    owner: Mapping[str, Any], warmer_image: str, generation: int = 0,
) -> dict[str, Any]:
    """The Job that warms `pool`. `owner` is {"name", "uid"} of the CompilationCache,
    `generation` its metadata.generation. Raises TpuShapeError."""
    warmup = cache.warmup
    assert warmup is not None
    name = job_name(cache_name, pool, digest)
    labels = {**pool_labels(cache_name, pool.name), c.LABEL_SPEC_HASH: digest}
    hosts = pool_shape(pool).hosts
    selector, tolerations, resources = placement(pool)
    env = warmer_env(cache, cache_name=cache_name, namespace=namespace, pool=pool, name=name, hosts=hosts)
    container = warmer_container(warmup, env, resources)
    pod_spec = warmer_pod_spec(warmup, container, warmer_image=warmer_image, selector=selector,
                               tolerations=tolerations)
    if cache.torch is not None:
        # Inductor's and Triton's directory (TORCHINDUCTOR_CACHE_DIR, the pods' path too):
        # the warm compiles into it, process 0 archives it.
        container["volumeMounts"].append(torch_dir_mount(cache))
        pod_spec["volumes"].append(torch_dir_volume())
    job_spec: dict[str, Any] = {
        # A multi-host warmer is one JAX distributed runtime: when one process fails, the
        # others leave it, so a retried pod of the same index would only wait out the
        # coordinator's timeout and fail again. The first pod failure fails the whole Job
        # (the Job controller then stops the other pods); the next warm is a new Job.
        # backoffLimit 0 rather than a podFailurePolicy: it counts every failure,
        # evictions and preemptions included, which break the runtime just the same.
        "backoffLimit": warmup.backoff_limit if hosts == 1 else 0,
        "activeDeadlineSeconds": warmup.active_deadline_seconds,
        "ttlSecondsAfterFinished": warmup.ttl_seconds_after_finished,
        "completions": hosts,
        "parallelism": hosts,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
    }
    if hosts > 1:
        # The Job controller names each pod's host <job>-<index>; with the subdomain it
        # resolves as <job>-<index>.<service>.
        job_spec["completionMode"] = "Indexed"
        pod_spec["subdomain"] = service_name(cache_name, pool.name)
        pod_spec["affinity"] = same_node_pool(labels)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "annotations": {c.GENERATION_ANNOTATION: str(generation)},
                     "ownerReferences": [owner_reference(owner)]},
        "spec": job_spec,
    }
