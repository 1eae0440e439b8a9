"""Where things go: a pool's shape and placement on GKE's nodes (nodeSelector,
tolerations, resources), and where in the bucket a pool's warmer writes its manifest. Read
by the warmer Job and the local copy's builders alike. Pure.
"""

from __future__ import annotations

from typing import Any

from cachewarm.api.model import GcsStorage, Pool
from cachewarm.builders.tpu import TpuShape, table_hosts, tpu_shape


def pool_shape(pool: Pool) -> TpuShape:
    """Hosts (pods of the Job) and TPU chips per host of a pool. TPU pools come from GKE's
    machine shapes (builders/tpu.py) with the pool's hosts/chipsPerHost as overrides; other
    pools run on `hosts` hosts (default 1), chips_per_host 0. Raises TpuShapeError.

    A TPU pool's `hosts: 1` without chipsPerHost, where the table says the slice has more
    hosts, reads as unset: objects stored while the CRD defaulted hosts to 1 carry it
    without the user having written it, and a single host could never run such a slice."""
    if pool.tpu is not None:
        hosts = pool.hosts
        if hosts == 1 and pool.chips_per_host is None and (table_hosts(pool.tpu.type, pool.tpu.topology) or 1) > 1:
            hosts = None
        return tpu_shape(pool.tpu.type, pool.tpu.topology, hosts=hosts, chips_per_host=pool.chips_per_host)
    return TpuShape(hosts=pool.hosts or 1, chips_per_host=0)


def quantity(value: int | str) -> str:
    """A resource quantity as the API's typed clients want it: a string ("8", "64Gi")."""
    return str(value)


def placement(pool: Pool) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, dict[str, str]]]:
    """nodeSelector, tolerations and resources for a pool, from GKE's labels and resource
    names, with the pool's own overrides on top. Quantities are strings. Raises
    TpuShapeError."""
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    if pool.accelerator is not None:
        selector["cloud.google.com/gke-accelerator"] = pool.accelerator.type
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
        resources["limits"]["nvidia.com/gpu"] = quantity(pool.accelerator.count)
    elif pool.tpu is not None:
        selector["cloud.google.com/gke-tpu-accelerator"] = pool.tpu.type
        selector["cloud.google.com/gke-tpu-topology"] = pool.tpu.topology
        tolerations.append({"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"})
        chips = quantity(pool_shape(pool).chips_per_host)
        resources["requests"]["google.com/tpu"] = chips
        resources["limits"]["google.com/tpu"] = chips
    selector.update(pool.node_selector)
    tolerations.extend(dict(t) for t in pool.tolerations)
    for kind in ("requests", "limits"):
        resources[kind].update({k: quantity(v) for k, v in pool.resources.get(kind, {}).items()})
    return selector, tolerations, {k: v for k, v in resources.items() if v}


MANIFEST_DIR = ".cachewarm/pools"


def manifest_object(storage: GcsStorage, namespace: str, cache_name: str, pool: str) -> str:
    """The object name (in the cache's bucket) of the manifest the warmer of `pool` writes:
    the entries its last warm relied on. Beside the entries, under the cache's prefix, but
    in a sub-folder, so neither JAX, nor the lifecycle rule (entries directly under the
    prefix, by suffix), nor the copier's listing of entries (matchGlob `<prefix>*`) sees it;
    per namespace and cache, so two caches that share a prefix keep their own."""
    return f"{storage.object_prefix}{MANIFEST_DIR}/{namespace}/{cache_name}/{pool}.json"


def manifest_url(storage: GcsStorage, namespace: str, cache_name: str, pool: str) -> str:
    """manifest_object as a gs:// URL (what the warmer writes with gcsfs)."""
    return f"gs://{storage.bucket}/{manifest_object(storage, namespace, cache_name, pool)}"
