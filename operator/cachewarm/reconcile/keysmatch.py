"""KeysMatch: whether the training pods that reported compute their cache keys as the
cache's warmers did, compared field by field from their fingerprints (what JAX puts in a
key). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# What JAX puts in a key and a fingerprint shows: jaxlib and plugin versions (below), the
# backend's platform and its version (the CUDA or libtpu build), the device kind, count and
# topology, the XLA flags it hashes. Not compared: jax's own version, the process count, the
# image (a pod's report does not know its digest) and the cache dir (in keys only while
# XLA's GPU caches are on; the webhook gives pods and warmers the same string anyway).
_COMPARED = ("platform", "platformVersion", "deviceKind", "devices", "topology", "flagsHash")


def _describe(fp: Mapping[str, Any], fields: list[str]) -> str:
    words = []
    for f in fields:
        if f.startswith("versions."):
            words.append(f"{f.removeprefix('versions.')} {(fp.get('versions') or {}).get(f.removeprefix('versions.'), 'none')}")
        elif f == "devices":
            words.append(f"{fp.get('devices', '?')} devices")
        elif f == "processes":
            words.append(f"{fp.get('processes', '?')} processes")
        elif f == "flagsHash":
            words.append(f"XLA flags {fp.get('flagsHash', '?')}")
        elif f == "cacheDir":
            words.append(f"cache dir {fp.get('cacheDir') or '(none)'}")
        elif f == "deviceKind":
            words.append(str(fp.get("deviceKind", "?")))
        else:
            words.append(f"{f} {fp.get(f, '?')}")
    return ", ".join(words)


def differences(warmed: Mapping[str, Any], pod: Mapping[str, Any]) -> list[str]:
    """The fingerprint fields (versions.<dist> for jaxlib and plugins) that differ."""
    fields = [f for f in _COMPARED if (f in warmed or f in pod) and warmed.get(f) != pod.get(f)]
    versions_w, versions_p = dict(warmed.get("versions") or {}), dict(pod.get("versions") or {})
    fields += [f"versions.{d}" for d in sorted(set(versions_w) | set(versions_p)) if versions_w.get(d) != versions_p.get(d)]
    return fields


def keys_match(pools: list[Mapping[str, Any]], pods: list[tuple[str, dict[str, Any]]]
               ) -> tuple[bool | None, str, str]:
    """KeysMatch of a cache: (status, reason, message). A pod matches when its fingerprint
    equals some pool's in everything keys depend on; the message names, for the first pod
    that matches no pool, what differs from the closest pool, in words ("pods run jaxlib
    0.10.1 on 4 devices; the cache was warmed with jaxlib 0.10.2 on 8 devices"). None
    (Unknown) while no pool or no pod has a fingerprint."""
    warmed = [(str(p.get("name")), dict(p["fingerprint"])) for p in pools
              if p.get("fingerprint") and p.get("state") == "Succeeded"]
    if not warmed:
        return None, "NotWarmed", ("No warmer of this cache has succeeded with a fingerprint (targets and python "
                                   "command warmers report one)")
    if not pods:
        return None, "NoReports", "No training pod reported in the window"
    found = []
    for _, fp in sorted(pods, key=lambda p: p[0]):
        fields, pool_name, closest = min(((differences(w, fp), name, w) for name, w in warmed),
                                         key=lambda d: len(d[0]))
        if fields:
            found.append((fields, pool_name, closest, fp))
    if found:
        # Said the same way while the difference stays the same (one Event, not one per pod).
        fields, pool_name, closest, fp = found[0]
        return False, "FingerprintsDiffer", (
            f"Training pods compute other keys than the warmers and miss: they run {_describe(fp, fields)}; pool "
            f"{pool_name} was warmed with {_describe(closest, fields)}")[:1000]
    return True, "FingerprintsMatch", ("The training pods that reported compute their keys as the warmers did "
                                       "(versions, platform, devices, topology, XLA flags)")
