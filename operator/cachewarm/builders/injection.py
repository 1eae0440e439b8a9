"""The cache env a training pod or a warmer gets, and the pod patch the webhook makes.

One function builds the env for both, so a warmer and the pods it warms for compute the
same cache keys: JAX_COMPILATION_CACHE_DIR is the same normalized string (it enters the
key whenever XLA's extra caches are on), and the XLA-cache setting is the same.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cachewarm.api import constants as c
from cachewarm.builders.reporting import COPY_CONTAINER, PATH_CONTAINER
from cachewarm.api.model import CacheSpec

# JAX writes an entry only when a compile took at least this long: a reader with this
# threshold reads hits and never writes (verified with jax 0.10.2, no warnings).
READ_ONLY_MIN_COMPILE_SECS = "1e9"
# The reporter's and the local copy's init containers (builders/reporting.py,
# builders/localcopy.py) compile nothing: no cache env.
OWN_INIT_CONTAINERS = (COPY_CONTAINER, PATH_CONTAINER, c.LOCAL_COPY_CONTAINER)

Role = Literal["pod", "warmer"]


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else f"{float(value):.1f}"


def cache_env(cache: CacheSpec, role: Role, *, local: bool = True) -> list[dict[str, str]]:
    """Env vars (name/value dicts, in a stable order) that point JAX at this cache.

    A `warmer` always writes, every program that took warmup.minCompileTimeSecs (default 0);
    a `pod` writes only in ReadWrite mode (jax.minCompileTimeSecs), and reads its local
    copy where spec.injection.localCopy is set (ReadOnly only: the CRD says so) unless
    `local` is false (the ConfigMap for envFrom containers, which may be in a pod that got
    no copy: they read the bucket).
    """
    if cache.torch is not None:
        return torch_env(cache, role)
    gcs = cache.storage.gcs
    directory = c.LOCAL_COPY_DIR if role == "pod" and local and cache.injection.local_copy is not None else gcs.url
    if role == "warmer":  # the one writer, writing once: every program unless the cache says otherwise
        min_compile = _number(cache.warmup.min_compile_time_secs if cache.warmup is not None else 0.0)
    elif cache.injection.mode == "ReadOnly":
        min_compile = READ_ONLY_MIN_COMPILE_SECS
    else:
        min_compile = _number(cache.jax.min_compile_time_secs)
    return [
        {"name": c.ENV_CACHE_DIR, "value": directory},
        {"name": c.ENV_MIN_COMPILE_TIME, "value": min_compile},
        {"name": c.ENV_MIN_ENTRY_SIZE, "value": str(cache.jax.min_entry_size_bytes)},
        {"name": c.ENV_ENABLE_XLA_CACHES, "value": cache.jax.enable_xla_caches},
    ]


def torch_env(cache: CacheSpec, role: Role) -> list[dict[str, str]]:
    """The env of a torch cache's (spec.torch) warmers and pods: the framework, Inductor's
    and Triton's directories (spec.torch.cacheDir, the same in both, a writable emptyDir
    there: torch_dir_volume), and for a `warmer` where it uploads its archive and the most
    bytes that archive may hold. No JAX cache env: a torch cache is not JAX's."""
    torch = cache.torch
    assert torch is not None
    env = [
        {"name": c.ENV_FRAMEWORK, "value": "torch"},
        {"name": c.ENV_TORCHINDUCTOR_CACHE_DIR, "value": torch.cache_dir},
        {"name": c.ENV_TRITON_CACHE_DIR, "value": f"{torch.cache_dir}/{c.TRITON_SUBDIR}"},
    ]
    if role == "warmer":
        env += [{"name": c.ENV_CACHE_URL, "value": cache.storage.gcs.url},
                {"name": c.ENV_TORCH_MAX_ARCHIVE_BYTES, "value": str(torch_max_archive_bytes(cache))}]
    return env


def torch_max_archive_bytes(cache: CacheSpec) -> int:
    """spec.torch.maxArchiveSize in bytes (the warmer's upload bound, the copier's extraction bound)."""
    assert cache.torch is not None
    return cache.torch.max_archive_bytes


def torch_dir_volume() -> dict[str, Any]:
    """The pod volume at spec.torch.cacheDir of warmers and training pods: their own,
    writable (Inductor takes lock files even to read, and a pod adds what it compiles). No
    sizeLimit: what a pod compiles is bounded as whatever else it writes, by its node's
    ephemeral storage and its containers' limits (a sizeLimit would evict a pod that
    compiles more than its warmer did)."""
    return {"name": c.TORCH_VOLUME, "emptyDir": {}}


def torch_dir_mount(cache: CacheSpec) -> dict[str, Any]:
    """The writable mount of torch_dir_volume at spec.torch.cacheDir."""
    assert cache.torch is not None
    return {"name": c.TORCH_VOLUME, "mountPath": cache.torch.cache_dir}


@dataclass(frozen=True)
class Kept:
    """A variable a container already set to something else; the user's value wins."""

    container: str
    name: str


@dataclass
class PodInjection:
    """The webhook's decision for one pod."""

    containers: list[dict[str, Any]]
    init_containers: list[dict[str, Any]] | None
    annotation: str
    kept: list[Kept] = field(default_factory=list)
    changed: bool = False
    # Containers with envFrom sources that got no cache env: no verified env ConfigMap.
    without_env: list[str] = field(default_factory=list)


# The annotation on our ConfigMaps with the sha256 (hex) of their content (configmap_sha256).
CONTENT_SHA256_ANNOTATION = f"{c.GROUP}/content-sha256"
HASH_CHARS = 10  # of the sha256's hex in a ConfigMap's name


def configmap_sha256(data: Mapping[str, str], binary_data: Mapping[str, bytes] | None = None) -> str:
    """The sha256 (hex) of a ConfigMap's content: its data and binaryData pairs sorted by
    key, each as a kind byte (d: data, its value's UTF-8; b: binaryData, its bytes), the
    key's UTF-8 and the value, each part prefixed by its length (8 bytes, big-endian), so
    no two contents share a byte stream. The apiserver keeps a key in one of the two."""
    pairs = [(key, b"d", value.encode("utf-8")) for key, value in data.items()]
    pairs += [(key, b"b", bytes(value)) for key, value in (binary_data or {}).items()]
    digest = hashlib.sha256()
    for key, kind, value in sorted(pairs):
        for part in (kind, key.encode("utf-8"), value):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest()


def configmap_hash(data: Mapping[str, str], binary_data: Mapping[str, bytes] | None = None) -> str:
    """The first HASH_CHARS hex of configmap_sha256: the part of a ConfigMap's name that
    says its content."""
    return configmap_sha256(data, binary_data)[:HASH_CHARS]


def body_sha256(body: Mapping[str, Any]) -> str:
    """configmap_sha256 of a ConfigMap as the API returns it (binaryData in base64).
    Raises ValueError (binascii.Error) on binaryData that is not base64."""
    binary = {key: base64.b64decode(value, validate=True) for key, value in (body.get("binaryData") or {}).items()}
    return configmap_sha256(body.get("data") or {}, binary)


def env_configmap_name(cache_name: str, content_hash: str) -> str:
    """The ConfigMap holding a cache's pod env, in the cache's namespace; `content_hash`
    is configmap_hash of its content, so another content is another ConfigMap."""
    return f"cachewarm-{cache_name}-env-{content_hash}"


def boot_configmap_name(cache_name: str, content_hash: str) -> str:
    """The ConfigMap holding the in-process copy's code (and the reporter's), in the
    cache's namespace; `content_hash` as for env_configmap_name."""
    return f"cachewarm-{cache_name}-boot-{content_hash}"


def cache_configmap(name: str, cache_name: str, namespace: str, owner: Mapping[str, Any], data: Mapping[str, str],
                    binary_data: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """A ConfigMap of the cache's, in its namespace, owned by it (deleted with it),
    immutable, its content's sha256 in CONTENT_SHA256_ANNOTATION; with `binary_data`,
    those keys' bytes too (binaryData, base64 as the API has them). `name` is the
    caller's (env_configmap_name, boot_configmap_name)."""
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {c.MANAGED_BY_LABEL: c.MANAGED_BY, c.ENV_FOR_LABEL: cache_name},
                     "annotations": {CONTENT_SHA256_ANNOTATION: configmap_sha256(data, binary_data)},
                     "ownerReferences": [{"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                                          "name": owner["name"], "uid": owner["uid"], "controller": True,
                                          "blockOwnerDeletion": True}]},
        "immutable": True,
        "data": dict(data),
    }
    if binary_data:
        body["binaryData"] = {key: base64.b64encode(value).decode("ascii") for key, value in binary_data.items()}
    return body


def env_configmap(cache: CacheSpec, cache_name: str, namespace: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The ConfigMap of the env training pods get (cache_env, role pod), owned by the cache
    (deleted with it), named by its content (env_configmap_name). Containers with envFrom
    sources read the cache env from it, once the operator verified it (D4: the webhook
    references only the name in status.injection.configMaps.env)."""
    data = {var["name"]: var["value"] for var in cache_env(cache, "pod", local=False)}
    return cache_configmap(env_configmap_name(cache_name, configmap_hash(data)), cache_name, namespace, owner, data)


def _inject(container: Mapping[str, Any], env: Sequence[Mapping[str, str]], configmap: str | None,
            kept: list[Kept], without_env: list[str]) -> tuple[dict[str, Any], bool]:
    """The cache env for one container, so that whatever the user set wins.

    A container without envFrom gets the variables it lacks as `env` entries (visible in
    the pod spec). A container with envFrom sources could be setting one of them there,
    which an `env` entry would override (env beats every envFrom source); it gets the
    cache's ConfigMap as its first envFrom source instead (optional, so a missing one never
    stops the pod), and the kubelet resolves the rest as for any pod: the container's
    own env and every later envFrom source, ConfigMap or Secret, win. cachewarm reads
    none of them. With no `configmap` (none the operator verified) such a container gets
    nothing, and its name goes into `without_env`."""
    out = copy.deepcopy(dict(container))
    existing = {e.get("name"): e for e in out.get("env") or []}
    for var in env:
        have = existing.get(var["name"])
        if have is not None and (have.get("value") != var["value"] or "valueFrom" in have):
            kept.append(Kept(str(out.get("name", "")), var["name"]))
    sources = list(out.get("envFrom") or [])
    if sources:
        if configmap is None:
            without_env.append(str(out.get("name", "")))
            return out, False
        if any((s.get("configMapRef") or {}).get("name") == configmap and not s.get("prefix") for s in sources):
            return out, False
        out["envFrom"] = [{"configMapRef": {"name": configmap, "optional": True}}, *sources]
        return out, True
    added = [dict(var) for var in env if var["name"] not in existing]
    if added:
        out["env"] = [*(out.get("env") or []), *added]
    return out, bool(added)


# The reporter's init containers compile nothing and extract nothing: no torch directory.
# The copier's (c.LOCAL_COPY_CONTAINER) gets it: it extracts the archives there.
NO_TORCH_DIR = (COPY_CONTAINER, PATH_CONTAINER)


@dataclass
class TorchDir:
    """The torch directory's part of the pod patch (add_torch_dir)."""

    containers: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    changed: bool = False
    # Containers that mount a volume of their own at spec.torch.cacheDir: theirs wins.
    kept: list[str] = field(default_factory=list)
    # Why the pod got no torch directory at all ("" when it got one).
    refused: str = ""


def add_torch_dir(cache: CacheSpec, containers: Sequence[Mapping[str, Any]],
                  init_containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]]) -> TorchDir:
    """A torch cache's pod: the writable emptyDir (torch_dir_volume) at spec.torch.cacheDir
    in every container and init container of the pod's own and in the copier (which
    extracts the archives there), as the rest of the patch leaves them. A container that
    mounts something at that path already keeps it (`kept`; ours, on reinvocation, too);
    a pod with a volume of its own named like ours gets none (`refused`), as then ours
    could not be told from its. Applying the result again changes nothing."""
    mount = torch_dir_mount(cache)
    out = TorchDir([copy.deepcopy(dict(ct)) for ct in containers],
                   [copy.deepcopy(dict(ct)) for ct in init_containers], [copy.deepcopy(dict(v)) for v in volumes])
    same = [v for v in volumes if v.get("name") == c.TORCH_VOLUME]
    if same and dict(same[0]) != torch_dir_volume():
        out.refused = (f"it has a volume of its own named {c.TORCH_VOLUME}, so cachewarm mounts no torch cache "
                       f"directory at {mount['mountPath']}")
        return out
    takers = [*out.containers, *(ct for ct in out.init_containers if ct.get("name") not in NO_TORCH_DIR)]
    for ct in takers:
        mounts = list(ct.get("volumeMounts") or [])
        if any(str(m.get("mountPath") or "").rstrip("/") == mount["mountPath"] for m in mounts):
            if not any(m.get("name") == c.TORCH_VOLUME for m in mounts):
                out.kept.append(str(ct.get("name") or ""))
            continue
        ct["volumeMounts"] = [*mounts, dict(mount)]
        out.changed = True
    if not same and any(m.get("name") == c.TORCH_VOLUME for ct in takers for m in ct.get("volumeMounts") or []):
        out.volumes.append(torch_dir_volume())
        out.changed = True
    return out


def annotation_value(cache_name: str, generation: int, cache: CacheSpec) -> str:
    local = ", local copy" if cache.injection.local_copy is not None else ""
    return f"{cache_name} (generation {generation}, {cache.injection.mode}, {cache.storage.gcs.url}{local})"


def inject_pod(pod: Mapping[str, Any], cache_name: str, generation: int, cache: CacheSpec,
               configmap: str | None) -> PodInjection:
    """Add the cache env to every container and init container that lacks it (see
    `_inject`: as env entries, or through `configmap`, the cache's env ConfigMap the
    operator verified, for containers with envFrom sources; with None, those get nothing:
    listed in `without_env`).

    Env a container already has wins (listed in `kept` when its value differs). Applying
    the result again changes nothing, so webhook reinvocation yields the same pod.
    """
    env = cache_env(cache, "pod")
    spec = pod.get("spec") or {}
    kept: list[Kept] = []
    without_env: list[str] = []
    changed = False
    containers = []
    for container in spec.get("containers") or []:
        new, did = _inject(container, env, configmap, kept, without_env)
        containers.append(new)
        changed |= did
    init_containers = None
    if spec.get("initContainers"):
        init_containers = []
        for container in spec["initContainers"]:
            if container.get("name") in OWN_INIT_CONTAINERS:  # the reporter's, on reinvocation
                init_containers.append(copy.deepcopy(dict(container)))
                continue
            new, did = _inject(container, env, configmap, kept, without_env)
            init_containers.append(new)
            changed |= did
    annotation = annotation_value(cache_name, generation, cache)
    current = ((pod.get("metadata") or {}).get("annotations") or {}).get(c.INJECTED_ANNOTATION)
    return PodInjection(containers, init_containers, annotation, kept, changed or current != annotation, without_env)
