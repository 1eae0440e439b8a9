"""Where things go: a pool's shape and placement on GKE's nodes (nodeSelector,
tolerations, resources), and where in the bucket a pool's warmer writes its manifest. Read
by the warmer Job and the local copy's builders alike. Pure.
"""

from __future__ import annotations

import re

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


def manifest_object(storage: GcsStorage, namespace: str, cache_name: str, pool: str, job: str) -> str:
    """The object name (in the cache's bucket) of the manifest warmer Job `job` of `pool`
    writes: the entries its warm relied on. One object per Job, never rewritten by a later
    warm (a retry of the same Job writes the same name), so a pod whose copier was pinned
    to it before a re-warm still finds it on a bucket without object versioning. Beside
    the entries, under the cache's prefix, but in a sub-folder, so neither JAX, nor the
    lifecycle rule (entries directly under the prefix, by suffix), nor the copier's listing
    of entries (matchGlob `<prefix>*`) sees it; per namespace and cache, so two caches that
    share a prefix keep their own."""
    return f"{manifest_folder(storage, namespace, cache_name)}{pool}/{job}.json"


# The pack a warmer Job writes beside its manifest (the manifest's name, `.json` replaced by
# this): the manifest's small entries in one object, so a pod's copy takes them in one
# request (agents/warmer.py's and agents/copier.py's PACK_SUFFIX; tests/unit/test_layout.py
# checks the three spellings agree). Expired by the cache's lifecycle rule as entries are.
PACK_SUFFIX = ".cachewarm-pack"


def pack_object(storage: GcsStorage, namespace: str, cache_name: str, pool: str, job: str) -> str:
    """The object name of the pack warmer Job `job` of `pool` writes beside its manifest."""
    return manifest_object(storage, namespace, cache_name, pool, job).removesuffix(".json") + PACK_SUFFIX


def manifest_folder(storage: GcsStorage, namespace: str, cache_name: str) -> str:
    """The folder (ends in /) of one cache's manifests: `<pool>/<job>.json` under it, and
    `<pool>.json` as warmers before per-Job manifests wrote them (legacy_manifest_object)."""
    return f"{storage.object_prefix}{MANIFEST_DIR}/{namespace}/{cache_name}/"


def legacy_manifest_object(storage: GcsStorage, namespace: str, cache_name: str, pool: str) -> str:
    """The one manifest per pool that warmers wrote before per-Job manifests (rewritten in
    place by each warm): still read for a Job that was created with it, and deleted with the
    cache's data."""
    return f"{manifest_folder(storage, namespace, cache_name)}{pool}.json"


# A pool's or a Job's name: a DNS label (what a Kubernetes name in the manifest's path can be).
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def is_pool_manifest(object_name: str, storage: GcsStorage, namespace: str, cache_name: str, pool: str) -> bool:
    """True for exactly a name a warmer Job of this cache's `pool` writes its manifest at
    (manifest_object, for a Job name that can be one), or the pool's legacy one
    (legacy_manifest_object); nothing else in the folder, nor another cache's or pool's."""
    if object_name == legacy_manifest_object(storage, namespace, cache_name, pool):
        return True
    folder = f"{manifest_folder(storage, namespace, cache_name)}{pool}/"
    if not object_name.startswith(folder) or not object_name.endswith(".json"):
        return False
    job = object_name[len(folder):].removesuffix(".json")
    return DNS_LABEL.fullmatch(job) is not None and manifest_object(storage, namespace, cache_name, pool, job) == object_name


def is_pool_pack(object_name: str, storage: GcsStorage, namespace: str, cache_name: str, pool: str) -> bool:
    """True for exactly a name a warmer Job of this cache's `pool` writes its pack at
    (pack_object, for a Job name that can be one); nothing else, nor another cache's."""
    folder = f"{manifest_folder(storage, namespace, cache_name)}{pool}/"
    if not object_name.startswith(folder) or not object_name.endswith(PACK_SUFFIX):
        return False
    job = object_name[len(folder):].removesuffix(PACK_SUFFIX)
    return DNS_LABEL.fullmatch(job) is not None and pack_object(storage, namespace, cache_name, pool, job) == object_name


def manifest_url(storage: GcsStorage, namespace: str, cache_name: str, pool: str, job: str) -> str:
    """manifest_object as a gs:// URL (what the warmer writes with gcsfs)."""
    return f"gs://{storage.bucket}/{manifest_object(storage, namespace, cache_name, pool, job)}"
