"""KeysMatch: whether the training pods that reported compute their cache keys as the
cache's warmers did, compared field by field from their fingerprints (what JAX or torch
puts in a key). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# What JAX puts in a key and a fingerprint shows: jaxlib and plugin versions (below), the
# backend's platform and its version (the CUDA or libtpu build), the device kind, count and
# topology, the XLA flags it hashes. Not compared: jax's own version, the process count, the
# image (a pod's report does not know its digest) and the cache dir (in keys only while
# XLA's GPU caches are on; the webhook gives pods and warmers the same string anyway).
_COMPARED = ("platform", "platformVersion", "deviceKind", "devices", "topology", "flagsHash")
# What torch.compile (Inductor) puts in its FX graph and AOTAutograd keys and a torch
# fingerprint (agents/warmer.torch_fingerprint) shows: torch and Triton versions (below),
# the platform and its CUDA/ROCm version, the device's name, a hash of Inductor's portable
# config, the hash of torch's own sources (torchKey), and, one by one, the env settings and
# the config values set in code that change that config; and the cache dir where both name
# one (not in a key, but torch reads only its TORCHINDUCTOR_CACHE_DIR: a pod that keeps its
# own never reads the directory cachewarm seeded, so every graph misses). Not compared: the
# device count (keys take the device's properties, not how many there are), and the device
# kind where one side did not read it (a pod reads it only once it initialized CUDA itself).
_TORCH_COMPARED = ("platform", "platformVersion", "inductorConfigHash", "torchKey")
_TORCH_MAPS = ("inductorEnv", "inductorChanged")


def one_line(value: str) -> str:
    """`value` as one line of plain text (control characters become `?`): how a
    fingerprint's names and values are kept, by the warmers' side and the pods' alike, so
    that the same setting compares equal and no text reaches a message unprintable."""
    return "".join(ch if ch.isprintable() else "?" for ch in value)


def framework(fp: Mapping[str, Any]) -> str:
    """The framework a fingerprint is of: "torch" where it says so, else "jax" (JAX's
    fingerprints name none)."""
    return str(fp.get("framework") or "jax")


def _word(fp: Mapping[str, Any], f: str) -> str:
    """One differing field of `fp` in words."""
    for prefix in _TORCH_MAPS:
        if f.startswith(prefix + "."):
            name, values = f.removeprefix(prefix + "."), fp.get(prefix)
            value = values.get(name) if isinstance(values, Mapping) else None
            if prefix == "inductorEnv":
                return f"{name}={value}" if value is not None else f"{name} unset"
            return (f"torch._inductor.config.{name} = {value} (set in the program)" if value is not None
                    else f"torch._inductor.config.{name} at its default")
    if f.startswith("versions."):
        return f"{f.removeprefix('versions.')} {(fp.get('versions') or {}).get(f.removeprefix('versions.'), 'none')}"
    words = {"framework": lambda: {"jax": "JAX"}.get(framework(fp), framework(fp)),
             "devices": lambda: f"{fp.get('devices', '?')} devices",
             "processes": lambda: f"{fp.get('processes', '?')} processes",
             "flagsHash": lambda: f"XLA flags {fp.get('flagsHash', '?')}",
             "cacheDir": lambda: (f"TORCHINDUCTOR_CACHE_DIR {fp.get('cacheDir')}" if framework(fp) == "torch"
                                  else f"cache dir {fp.get('cacheDir') or '(none)'}"),
             "deviceKind": lambda: str(fp.get("deviceKind", "?")),
             "inductorConfigHash": lambda: f"the Inductor config (set in the program) {fp.get(f, 'none')}",
             "torchKey": lambda: f"torch sources {fp.get(f, 'none')} (torchKey)"}
    found = words.get(f)
    return found() if found is not None else f"{f} {fp.get(f, '?')}"


def _describe(fp: Mapping[str, Any], fields: list[str]) -> str:
    return ", ".join(_word(fp, f) for f in fields)


def differences(warmed: Mapping[str, Any], pod: Mapping[str, Any]) -> list[str]:
    """The fingerprint fields (versions.<dist> for jaxlib, plugins, torch and triton;
    inductorEnv.<NAME> and inductorChanged.<key> for torch's) that differ. A pod of
    another framework than the warm differs in that alone."""
    if framework(warmed) != framework(pod):
        return ["framework"]
    if framework(warmed) == "torch":
        fields = [f for f in _TORCH_COMPARED if (f in warmed or f in pod) and warmed.get(f) != pod.get(f)]
        fields += [f for f in ("deviceKind", "cacheDir") if f in warmed and f in pod and warmed[f] != pod[f]]
        # An env setting or a config value set in code enters the keys through the config
        # the hash covers: where both hashes are known and equal, one that differs (a
        # TORCH_COMPILE_DEBUG in the pods) does not change a key and is not named.
        config = "inductorConfigHash"
        if config in fields or config not in warmed or config not in pod:
            named = [f"{m}.{name}" for m in _TORCH_MAPS for name in _changed(warmed.get(m), pod.get(m))]
            if named and config in fields:
                fields.remove(config)  # the settings named are why it differs
            fields += named
    else:
        fields = [f for f in _COMPARED if (f in warmed or f in pod) and warmed.get(f) != pod.get(f)]
    versions_w, versions_p = dict(warmed.get("versions") or {}), dict(pod.get("versions") or {})
    fields += [f"versions.{d}" for d in sorted(set(versions_w) | set(versions_p)) if versions_w.get(d) != versions_p.get(d)]
    return fields


def _changed(warmed: Any, pod: Any) -> list[str]:
    """The names whose values differ between two {name: value} maps (absent: unset)."""
    w = warmed if isinstance(warmed, Mapping) else {}
    p = pod if isinstance(pod, Mapping) else {}
    return sorted(str(name) for name in set(w) | set(p) if w.get(name) != p.get(name))


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
        # One line of plain text: a pod's fingerprint is its own to say (and a warmer's its
        # image's), and the message reaches a condition and an Event.
        if fields == ["cacheDir"] and framework(fp) == "torch":
            return False, "FingerprintsDiffer", one_line(
                f"Training pods do not read the seeded directory and miss: they use {_describe(fp, fields)}; pool "
                f"{pool_name}'s warm was seeded at {closest.get('cacheDir')} (torch reads only its "
                "TORCHINDUCTOR_CACHE_DIR: remove the pods' own value)")[:1000]
        return False, "FingerprintsDiffer", one_line(
            f"Training pods compute other keys than the warmers and miss: they run {_describe(fp, fields)}; pool "
            f"{pool_name} was warmed with {_describe(closest, fields)}")[:1000]
    if all(framework(fp) == "torch" for _, fp in warmed):
        return True, "FingerprintsMatch", ("The training pods that reported compute their keys as the warmers did "
                                           "(torch and Triton versions, platform, device, Inductor config and "
                                           "settings, torch sources)")
    return True, "FingerprintsMatch", ("The training pods that reported compute their keys as the warmers did "
                                       "(versions, platform, devices, topology, XLA flags)")
