"""The local copy (spec.injection.localCopy): where the warmers' manifests live, and the
part of the webhook's pod patch that gives a training pod a local copy of the cache.

Pure: spec in, spec out.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from cachewarm.agents import payload
from cachewarm.api import constants as c
from cachewarm.builders import reporting as reporter
from cachewarm.builders.injection import boot_configmap_name as boot_configmap_name
from cachewarm.builders.injection import cache_configmap, configmap_hash, torch_max_archive_bytes
from cachewarm.builders.placement import is_pool_manifest, placement
from cachewarm.builders.tpu import TpuShapeError
from cachewarm.api.model import CacheSpec, GcsStorage, LocalCopy, Pool

# --- the webhook's part -------------------------------------------------------------------

LOCAL_DIR = c.LOCAL_COPY_DIR  # JAX_COMPILATION_CACHE_DIR of pods with a local copy
LOCAL_VOLUME = "cachewarm-cache"
COPIER_CONTAINER = c.LOCAL_COPY_CONTAINER
COPIER_FILE = f"{reporter.DIR}/{payload.COPIER}"
COPIER_SOURCE = payload.in_image(payload.COPIER)
SUMMARY_FILE = f"{reporter.DIR}/local-copy.json"  # the copier writes it, the reporter reads it
SUMMARY_ENV = c.ENV_LOCAL_COPY  # the reporter reads the copy's summary from there
# The kubelet evicts a pod whose emptyDir grows past its sizeLimit: the copy stops short.
BUDGET_SHARE = 0.9
# `sh -c SCRIPT PYTHON COPIER`: the training image's python runs the copier isolated from
# the image's PYTHONPATH and site-packages (it needs the standard library only); an image
# without that python still starts (cold), and says why.
RUN_COPIER = ('"$0" -I -S "$1" || { j="{\\"cold\\": true, \\"errors\\": [\\"could not run $0 (exit $?): the pod '
              'starts with an empty local cache\\"]}"; echo "{\\"cachewarm-copier\\": $j}"; '
              f'[ -z "${c.ENV_COPY_SUMMARY}" ] || printf %s "$j" > "${c.ENV_COPY_SUMMARY}"; }}; exit 0')
# The same, first recording the image's PYTHONPATH into `$2` for the reporter (what its
# recorder would do; _folds_recorder): a write that fails leaves no file, and the copy runs.
RECORD_AND_RUN_COPIER = 'printf %s "$PYTHONPATH" > "$2"; ' + RUN_COPIER
# The annotation kubectl reads to pick a pod's main container; the copier runs its image.
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
GPU, TPU = "nvidia.com/gpu", "google.com/tpu"
# A GCS object generation, as status.warmup.pools[].manifestGeneration holds it (decimal;
# an int64 in GCS: at most 19 digits).
GENERATION = re.compile(r"[0-9]{1,19}")


GIB = 2**30


# The default copy is given only where the cache's last listing holds at most this much:
# beyond it each pod would download (and hold on the node's disk) more than reading the
# few programs it runs from the bucket costs (BENCHMARKS.md: at 2 GB the copy was already
# slower than gs:// on loopback). A localCopy the user writes has no such cap.
DEFAULT_COPY_MAX_BYTES = 50 * 2**30
# A pod that authenticates with a key file or a workload identity federation config reads
# GCS with it through gcsfs; the copier asks only GKE's metadata server.
KEY_FILE_ENV = "GOOGLE_APPLICATION_CREDENTIALS"


def default_copy_refused(cache: CacheSpec, spec: Mapping[str, Any], manifests: Mapping[str, str],
                         cache_bytes: int) -> str:
    """Why a pod that would get the default local copy reads the bucket instead ("" for
    none): none of its pools has a manifest the operator recorded (the copy would be
    empty: every program compiled), its main container authenticates with a key file
    (GOOGLE_APPLICATION_CREDENTIALS in its env; the copier uses the metadata server
    only), or the cache's last listing is over DEFAULT_COPY_MAX_BYTES."""
    if cache.warmup is not None:
        pools = pools_for(spec, cache.warmup.pools)
        if not any(GENERATION.fullmatch(str(manifests.get(p, "")).rpartition("#")[2]) for p in pools):
            return ("no warmer of its pools (" + ", ".join(pools) + ") has recorded a manifest yet, so its copy "
                    "would be empty")
    if any(e.get("name") == KEY_FILE_ENV for ct in spec.get("containers") or [] for e in ct.get("env") or []):
        return (f"it sets {KEY_FILE_ENV}, and the copier authenticates only through the metadata server (GKE "
                "Workload Identity); set injection.localCopy to give it a copy anyway")
    if cache_bytes > DEFAULT_COPY_MAX_BYTES:
        return (f"the cache holds {cache_bytes / 2**30:.1f} GiB, over the default copy's "
                f"{DEFAULT_COPY_MAX_BYTES // 2**30} GiB; set injection.localCopy (with its sizeLimit) to give pods a "
                "copy anyway")
    return ""


def default_copy_size(size_limit: str, cache_bytes: int) -> str:
    """The default copy's sizeLimit: LocalCopy's default (`size_limit`, 10Gi), or where the
    cache's last listing holds more than the copier takes of that (BUDGET_SHARE of it), as
    many whole GiB as hold the listing within that share, plus one: the default copy takes
    the whole cache, as its user expects of a default, not the part that fits 10Gi."""
    needed = int(cache_bytes / BUDGET_SHARE) + 1
    if cache_bytes <= 0 or needed <= _bytes(size_limit):
        return size_limit
    return f"{-(-needed // GIB) + 1}Gi"

def _kind_of_pod(spec: Mapping[str, Any]) -> str:
    """gpu, tpu or cpu: what the pod's containers ask for."""
    asked: set[str] = set()
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            asked |= set((resources.get(kind) or {}))
    return "gpu" if GPU in asked else "tpu" if TPU in asked else "cpu"


def _kind_of_pool(pool: Pool) -> str:
    return "gpu" if pool.accelerator is not None else "tpu" if pool.tpu is not None else "cpu"


def _allowed_values(spec: Mapping[str, Any]) -> dict[str, set[str]]:
    """Node label -> the values the pod's scheduling constraints allow, for the labels it
    pins: its nodeSelector, and required node affinity `In` expressions when there is a
    single term (several terms are ORed: none of them pins a label)."""
    allowed = {k: {str(v)} for k, v in (spec.get("nodeSelector") or {}).items()}
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if len(terms) == 1:
        for expr in terms[0].get("matchExpressions") or []:
            if expr.get("operator") == "In" and expr.get("key"):
                values = {str(v) for v in expr.get("values") or []}
                allowed[expr["key"]] = allowed[expr["key"]] & values if expr["key"] in allowed else values
    return allowed


def pools_for(spec: Mapping[str, Any], pools: Sequence[Pool]) -> list[str]:
    """The pools whose warmers' entries a pod can use: those of the pod's kind (GPU, TPU or
    neither, from the resources it asks for) whose node labels the pod's nodeSelector and
    required node affinity allow. When none is left (the pod's node cannot be told at
    admission, or matches no pool) every pool: a copy of entries it cannot use costs
    bytes, a copy without the ones it can costs compiles."""
    kind = _kind_of_pod(spec)
    allowed = _allowed_values(spec)
    matched = []
    for pool in pools:
        if _kind_of_pool(pool) != kind:
            continue
        try:
            selector = placement(pool)[0]
        except TpuShapeError:
            continue
        if all(value in allowed[key] for key, value in selector.items() if key in allowed):
            matched.append(pool.name)
    return matched or [pool.name for pool in pools]


def _bytes(quantity: Any) -> Decimal:
    value: Decimal = parse_quantity(quantity)  # type: ignore[no-untyped-call]
    return value


def budget_bytes(size_limit: str, spec: Mapping[str, Any] | None = None, volume_kind: str = "EmptyDir") -> int:
    """The bytes the copier may copy into a volume of `size_limit` (a quantity the CRD
    checked, parsed by the Kubernetes client as the kubelet reads it): 90% of it, and for
    an emptyDir in a pod whose every container has an ephemeral-storage limit (the
    kubelet evicts the pod when its emptyDirs and containers together pass their sum) at
    most half that sum, the rest left to what the containers write themselves."""
    budget = _bytes(size_limit) * Decimal(str(BUDGET_SHARE))
    containers = list((spec or {}).get("containers") or [])
    limits = [((ct.get("resources") or {}).get("limits") or {}).get("ephemeral-storage") for ct in containers]
    if volume_kind == "EmptyDir" and containers and all(limit is not None for limit in limits):
        budget = min(budget, sum((_bytes(limit) for limit in limits), Decimal(0)) / 2)
    return int(budget)


# D1: the copy is each pod's own. A copy shared between pods (the withdrawn HostPath, a
# node's directory the cache's pods shared) is a writable mount another pod reads: one pod
# could plant an entry, or code, that every later pod of the cache on the node loads.
HOST_PATH_WITHDRAWN = ("asks for a HostPath local copy, which is no longer served: a copy shared between pods is "
                       "a writable mount that another pod reads (one pod could plant what every later pod of the "
                       "cache on the node loads); this pod gets its own EmptyDir copy")


def served(local: LocalCopy) -> LocalCopy:
    """The copy a pod gets for `local`: the one it asks for, except a HostPath copy (the
    CRD refuses it in new or changed specs; a cache stored with it parses), which is an
    EmptyDir of the same sizeLimit (the caller says so: HOST_PATH_WITHDRAWN)."""
    if local.volume == "HostPath":
        return local.model_copy(update={"volume": "EmptyDir", "host_path": None})
    return local


def local_mount() -> dict[str, Any]:
    """The copy's mount in the pod's containers (read-only; the copier's is not)."""
    return {"name": LOCAL_VOLUME, "mountPath": LOCAL_DIR, "readOnly": True}


def volume(local: LocalCopy) -> dict[str, Any]:
    """The pod volume that holds the copy: the pod's own, never one another pod mounts
    (an emptyDir, or an ephemeral claim made for this pod and deleted with it)."""
    if local.volume == "Ephemeral":
        claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                 "resources": {"requests": {"storage": local.size_limit}}}
        if local.storage_class_name:
            claim["storageClassName"] = local.storage_class_name
        return {"name": LOCAL_VOLUME, "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": {c.MANAGED_BY_LABEL: c.MANAGED_BY}}, "spec": claim}}}
    # EmptyDir, and HostPath (withdrawn) where a caller did not go through `served`.
    return {"name": LOCAL_VOLUME, "emptyDir": {"sizeLimit": local.size_limit}}


def pinned_manifests(cache: CacheSpec, namespace: str, cache_name: str, pools: Sequence[str],
                     manifests: Mapping[str, str] | None) -> str | None:
    """CACHEWARM_COPY_MANIFESTS (D3): `<object>#<generation>` for each of `pools` whose
    manifest the operator recorded from its own warmers (`manifests`, pool ->
    `<object>#<generation>` as status.warmup.pools[].manifestObject and manifestGeneration
    hold them; a value whose object is not a name this cache's warmers of that pool write,
    or whose generation is not one, is left out), comma separated; "" (set, empty: the
    copier trusts nothing and copies nothing) when the cache has warmup pools and none of
    these is known; None (unset: the copier copies the prefix, trusting whoever can write
    the bucket) for a cache without warmup."""
    if cache.warmup is None:
        return None
    known = manifests or {}
    pinned = []
    for pool in pools:
        obj, _, generation = str(known.get(pool, "")).rpartition("#")
        if GENERATION.fullmatch(generation) and is_pool_manifest(obj, cache.storage.gcs, namespace, cache_name, pool):
            pinned.append(f"{obj}#{generation}")
    return ",".join(pinned)


def copier_env(cache: CacheSpec, namespace: str, cache_name: str, pools: Sequence[str],
               spec: Mapping[str, Any] | None = None, dest: str = LOCAL_DIR,
               manifests: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """The copier's settings (agents/copier.py); its manifests as pinned_manifests says."""
    local = cache.injection.local_copy
    assert local is not None
    gcs = cache.storage.gcs
    pinned = pinned_manifests(cache, namespace, cache_name, pools, manifests)
    return [
        {"name": c.ENV_COPY_BUCKET, "value": gcs.bucket},
        {"name": c.ENV_COPY_PREFIX, "value": gcs.prefix},
        {"name": c.ENV_COPY_DEST, "value": dest},
        *([{"name": c.ENV_COPY_MANIFESTS, "value": pinned}] if pinned is not None else []),
        {"name": c.ENV_COPY_MAX_BYTES, "value": str(budget_bytes(local.size_limit, spec, local.volume))},
        {"name": c.ENV_COPY_WORKERS, "value": str(local.workers)},
        {"name": c.ENV_COPY_DEADLINE_SECONDS, "value": str(local.timeout_seconds)},
        {"name": c.ENV_COPY_SUMMARY, "value": SUMMARY_FILE},
        # A torch cache's copier extracts the archives it copied into the pod's torch
        # directory (spec.torch.cacheDir, mounted in it too: injection.add_torch_dir).
        *([{"name": c.ENV_TORCH_DIR, "value": cache.torch.cache_dir},
           {"name": c.ENV_TORCH_MAX_ARCHIVE_BYTES, "value": str(torch_max_archive_bytes(cache))}]
          if cache.torch is not None else []),
    ]


def local_copy_possible(spec: Mapping[str, Any], image: str | None) -> bool:
    """Whether add_local_copy can give this pod a copy: a warmer image to bring the copier,
    a Linux pod, a container with an image, and no volume of its own named like ours nor
    mount of its own where ours go, nor of a volume named like ours (a mount of a volume
    the pod lacks, which ours would complete: the user's container would mount the copy,
    or our token, writable where we mount it read-only). Ours, on reinvocation, come with
    our copier or our boot volume; the reporter's mounts with its volume."""
    names = {v.get("name") for v in spec.get("volumes") or []}
    inits = {ct.get("name") for ct in spec.get("initContainers") or []}
    if COPIER_CONTAINER in inits or in_process(spec):  # ours: a reinvocation
        return bool(image)
    mounts = [m for ct in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
              for m in ct.get("volumeMounts") or []]
    ours = {LOCAL_VOLUME, BOOT_VOLUME} | ({reporter.VOLUME, reporter.TOKEN_VOLUME} if reporter.VOLUME not in names
                                           else set())
    clash = bool({LOCAL_VOLUME, BOOT_VOLUME, reporter.TOKEN_VOLUME} & names) or \
        (reporter.VOLUME in names and reporter.COPY_CONTAINER not in inits) or any(
        str(m.get("mountPath") or "").rstrip("/") in (LOCAL_DIR, BOOT_DIR, COPY_DIR, reporter.DIR, reporter.TOKEN_DIR)
        or m.get("name") in ours for m in mounts)
    return bool(image) and not clash and (spec.get("os") or {}).get("name") != "windows" and \
        any(ct.get("image") for ct in spec.get("containers") or [])


def add_local_copy(spec: Mapping[str, Any], containers: Sequence[Mapping[str, Any]],
                   init_containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]], *,
                   cache: CacheSpec, namespace: str, cache_name: str, image: str,
                   annotations: Mapping[str, str] | None = None, manifests: Mapping[str, str] | None = None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(containers, initContainers, volumes) with the local copy added, each as the rest of
    the patch leaves them (the reporter's init containers, when there, come first), or None
    when there is nothing to do: already added and nothing to follow (webhook reinvocation:
    _reinvoked), or no copy possible (local_copy_possible).

    - a volume (LocalCopy.volume) at LOCAL_DIR, read-only in every container and init
      container of the pod's own (JAX_COMPILATION_CACHE_DIR points there: cache_env);
    - the reporter's copy init container (of the warmer image) also copies the copier and
      busybox, or one is added that does just that;
    - an init container of the training image (the main container's: its pull policy,
      env and envFrom, so it reaches GCS as the pod would, e.g. through its proxy; its
      user where not root, never its privileges (reporter.init_security); its CPU, memory
      and ephemeral-storage; its CA mounts) that runs the copier
      with the image's python, after the reporter's and before the pod's own init
      containers, recording the image's PYTHONPATH in place of the reporter's recorder
      where it can (_folds_recorder);
    - where the reporter is, CACHEWARM_LOCAL_COPY_SUMMARY, so it reports the copy.
    """
    local = cache.injection.local_copy
    assert local is not None
    if any(ct.get("name") == COPIER_CONTAINER for ct in init_containers):  # webhook reinvocation
        return _reinvoked(containers, init_containers, volumes, local, namespace, cache_name, annotations)
    if not local_copy_possible(spec, image):  # also a pod whose own volumes clash with ours
        return None
    # The pod's main container (kubectl's default-container annotation, else the first):
    # the copier runs its image, env and securityContext, not a sidecar's.
    original = _main_container(spec.get("containers") or [], annotations)
    pools = pools_for(spec, cache.warmup.pools) if cache.warmup is not None else []
    python = cache.warmup.python if cache.warmup is not None else "python"
    files = [COPIER_SOURCE, reporter.BUSYBOX]
    resources = reporter.resources_of(original)
    out_volumes = [copy.deepcopy(dict(v)) for v in volumes]
    init: list[dict[str, Any]] = []
    ours = (reporter.COPY_CONTAINER, reporter.PATH_CONTAINER)
    tools = next((c for c in init_containers if c.get("name") == reporter.COPY_CONTAINER), None)
    if tools is None:
        out_volumes.append({"name": reporter.VOLUME, "emptyDir": {"sizeLimit": "10Mi"}})
        init.append(reporter.copy_container(spec, image, files, resources, original))
    fold = _folds_recorder(init_containers, original)
    for container in init_containers:
        new = copy.deepcopy(dict(container))
        if container.get("name") == reporter.COPY_CONTAINER:
            command = list(new.get("command") or [])
            new["command"] = [*command[:-1], *(f for f in files if f not in command), command[-1]]
        if container.get("name") in ours and not (fold and container.get("name") == reporter.PATH_CONTAINER):
            init.append(new)
    mount = local_mount()
    script, args = (RECORD_AND_RUN_COPIER, [python, COPIER_FILE, reporter.RECORD_FILE]) if fold else \
        (RUN_COPIER, [python, COPIER_FILE])
    copier: dict[str, Any] = {
        "name": COPIER_CONTAINER, "image": original["image"],
        **({"imagePullPolicy": original["imagePullPolicy"]} if original.get("imagePullPolicy") else {}),
        "command": [f"{reporter.DIR}/busybox", "sh", "-c", script, *args],
        "env": [*(copy.deepcopy(e) for e in original.get("env") or [] if not e.get("name", "").startswith("CACHEWARM_COPY_")),
                *copier_env(cache, namespace, cache_name, pools, spec, manifests=manifests)],
        **({"envFrom": copy.deepcopy(original["envFrom"])} if original.get("envFrom") else {}),
        "volumeMounts": [*_ca_mounts(original, spec.get("volumes") or []),
                         {"name": reporter.VOLUME, "mountPath": reporter.DIR},
                         {k: v for k, v in mount.items() if k != "readOnly"}],
        # Never the main container's (privileged, root, capabilities): reporter.init_security.
        # It writes files 0644 and directories 0755, which every container of the pod reads.
        "securityContext": reporter.init_security(spec, original),
        **({"resources": resources} if resources else {}),
    }
    init.append(copier)
    init += [_mounted(ct, mount, summary=False) for ct in init_containers if ct.get("name") not in ours]
    out = [_mounted(ct, mount, summary=True) for ct in containers]
    out_volumes.append(volume(local))
    return out, init, out_volumes


def _folds_recorder(init_containers: Sequence[Mapping[str, Any]], original: Mapping[str, Any]) -> bool:
    """Whether the copier also records the image's PYTHONPATH for the reporter, in place of
    the reporter's recorder: one init container fewer, and each costs up to a second of the
    pod's start (the kubelet learns that an init container exited at its next relist, once
    a second with the generic PLEG; BENCHMARKS.md). Only when the two would record the same
    value: the recorder runs the copier's image, and the copier's env (the main
    container's) sets no PYTHONPATH of its own, nor may set one through envFrom."""
    recorder = next((ct for ct in init_containers if ct.get("name") == reporter.PATH_CONTAINER), None)
    return (recorder is not None and recorder.get("image") == original.get("image") and not original.get("envFrom")
            and not any(e.get("name") == "PYTHONPATH" for e in original.get("env") or []))


def _main_container(containers: Sequence[Mapping[str, Any]], annotations: Mapping[str, str] | None
                    ) -> Mapping[str, Any]:
    """The pod's main container (kubectl's default-container annotation, else the first
    with an image): the copier runs its image, env and securityContext, not a sidecar's."""
    main = (annotations or {}).get(DEFAULT_CONTAINER)
    with_image = [ct for ct in containers if ct.get("image")]
    return next((ct for ct in with_image if ct.get("name") == main), with_image[0])


# The variables that name CA files or directories (REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE
# the copier reads itself; SSL_CERT_* OpenSSL does).
CA_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")
# Volumes whose content is there before any container starts (the kubelet fills them):
# an emptyDir or a CSI volume may be filled or served by a container that runs after ours.
READY_VOLUMES = ("configMap", "secret", "projected", "downwardAPI", "hostPath")
# Where OpenSSL looks by default (Debian/Ubuntu/Alpine, RHEL/Fedora): a CA bundle mounted
# there (trust-manager's, a proxy's) is the one the main container uses without any env.
SYSTEM_CA_PATHS = ("/etc/ssl/certs/ca-certificates.crt", "/etc/ssl/cert.pem", "/etc/pki/tls/certs/ca-bundle.crt",
                   "/etc/pki/tls/cert.pem")


def _ca_mounts(original: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The main container's mounts that hold the CAs its env names (a literal value under
    the mount's path), read-only, for the copier. Only those: the copier runs before the
    pod's own init containers and sidecars, so a mount of a volume they fill or serve
    (an emptyDir over /etc/ssl/certs, a FUSE CSI volume) could shadow the image's files or
    keep the copier from starting, and a subPath into one that is not filled yet the
    kubelet would create as a directory. The mounts over OpenSSL's default bundles count
    too (SYSTEM_CA_PATHS). Never with Bidirectional propagation (a privileged container's
    only)."""
    ready = {v.get("name") for v in volumes if any(kind in v for kind in READY_VOLUMES)}
    paths = [*(str(e.get("value") or "") for e in original.get("env") or []
               if e.get("name") in CA_VARIABLES and "value" in e), *SYSTEM_CA_PATHS]
    out = []
    for m in original.get("volumeMounts") or []:
        where = str(m.get("mountPath") or "").rstrip("/")
        if m.get("name") not in ready or not where or where in (LOCAL_DIR, reporter.DIR) or \
                not any(p == where or p.startswith(f"{where}/") for p in paths):
            continue
        new = {k: copy.deepcopy(v) for k, v in m.items() if not (k == "mountPropagation" and v == "Bidirectional")}
        new["readOnly"] = True
        out.append(new)
    return out


def _reinvoked(containers: Sequence[Mapping[str, Any]],
               init_containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]],
               local: LocalCopy, namespace: str, cache_name: str, annotations: Mapping[str, str] | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """A pod with its copy already (webhook reinvocation). A container a later webhook
    added got JAX_COMPILATION_CACHE_DIR from the env injection, so it gets the copy's mount
    too (without it the directory would be an empty one of its own filesystem), unless it
    mounts something else there; and the copier takes the main container's CPU, memory
    and ephemeral storage again when a later webhook (VPA's) changed them. None when
    nothing changes."""
    mount = local_mount()
    ours = (reporter.COPY_CONTAINER, reporter.PATH_CONTAINER, COPIER_CONTAINER)
    # The main container as at the first admission: the annotation's, else the first of
    # the copier's image (a sidecar a later webhook put first has another image).
    copier = next(ct for ct in init_containers if ct.get("name") == COPIER_CONTAINER)
    named = (annotations or {}).get(DEFAULT_CONTAINER)
    main = next((ct for ct in containers if named and ct.get("name") == named), None) or \
        next((ct for ct in containers if ct.get("image") == copier.get("image")), None) or \
        _main_container(containers, annotations)
    wanted = reporter.resources_of(main)
    # The warmer image's copy container follows the reporter's resync when the reporter
    # is there (builders/reporter.py), this one's when it is not.
    reported = any(reporter.takes_reporter(ct) for ct in containers)
    followers = (COPIER_CONTAINER,) if reported else (COPIER_CONTAINER, reporter.COPY_CONTAINER)

    def lacks(ct: Mapping[str, Any]) -> bool:
        return ct.get("name") not in ours and not any(
            m.get("name") == LOCAL_VOLUME or str(m.get("mountPath") or "").rstrip("/") == LOCAL_DIR
            for m in ct.get("volumeMounts") or [])

    def stale(ct: Mapping[str, Any]) -> bool:
        return ct.get("name") in followers and reporter.resources_of(ct) != wanted
    if not any(lacks(ct) for ct in [*containers, *init_containers]) and not any(stale(ct) for ct in init_containers):
        return None
    out = [_mounted(ct, mount, summary=True) if lacks(ct) else copy.deepcopy(dict(ct)) for ct in containers]
    init = []
    for ct in init_containers:
        new = _mounted(ct, mount, summary=False) if lacks(ct) else copy.deepcopy(dict(ct))
        if stale(ct):
            new["resources"] = reporter.with_shared(new.get("resources") or {}, wanted)
            if not new["resources"]:
                del new["resources"]
        init.append(new)
    return out, init, [copy.deepcopy(dict(v)) for v in volumes]


def _mounted(container: Mapping[str, Any], mount: Mapping[str, Any], *, summary: bool) -> dict[str, Any]:
    new = copy.deepcopy(dict(container))
    new["volumeMounts"] = [*(new.get("volumeMounts") or []), dict(mount)]
    if summary and any(m.get("name") == reporter.VOLUME for m in new.get("volumeMounts") or []):
        new["env"] = [*(e for e in new.get("env") or [] if e.get("name") != SUMMARY_ENV),
                      {"name": SUMMARY_ENV, "value": SUMMARY_FILE}]
    return new


# --- in process: the copy without an init container --------------------------------------

# Each init container costs the pod up to a second of its start (the kubelet notices an
# init container's exit at its next relist, once a second with the generic PLEG;
# BENCHMARKS.md), and the copy itself takes a fraction of that. So where the webhook knows
# what PYTHONPATH the training container would have had, the copy runs in the container's
# first python process instead, at its start (our sitecustomize, before any of the
# program's code), from a ConfigMap volume the kubelet mounts before any container starts.
BOOT_DIR = "/cachewarm-boot"
BOOT_VOLUME = "cachewarm-boot"
# The copy's volume again, writable, where the copier writes (CACHEWARM_COPY_DEST): JAX's
# directory (LOCAL_DIR) stays read-only, so no JAX setting of the container's own makes
# it write entries into the copy (past an emptyDir's budget). The copy is the pod's own:
# what one process of it writes there, only this pod reads.
COPY_DIR = "/cachewarm-copy"
IN_PROCESS_ENV = c.ENV_COPY_IN_PROCESS
# The files of the boot ConfigMap (and of BOOT_DIR): agents/payload.py's list.
BOOT_FILES = tuple(payload.MODULES)


# Every python process of a pod that copies in process loads these files at its start, and
# a ConfigMap volume is read-only: python cannot cache their bytecode, so each process
# compiled them (copier 8 ms, reporter and warmer 12 ms, on this machine's CPU). The
# ConfigMap also holds their bytecode, compiled by the operator's python (service.
# boot_bytecode_files runs BYTECODE_SCRIPT), and the volume puts it where python's import
# looks for it (__pycache__/<module>.<cache tag>.pyc). A pod whose python is another
# version looks for another file name, finds none, and compiles as before. Checked-hash
# pycs (PEP 552): python uses one only while the hash of the source beside it matches, so
# an edited source is never run as stale bytecode.
BYTECODE_TAG = sys.implementation.cache_tag
# Run by a fresh `python -S -B`, the shipped texts as JSON on stdin, their pycs (hex) on
# stdout: each compiled at optimization level 0 (the level whose file name has no
# `.opt-N`) from its UTF-8 bytes, as the kubelet writes it, behind PEP 552's header (this
# python's magic, flags 0b11: hash-based and checked, the source's hash). In a fresh
# interpreter because marshal writes an object that has other references as a
# back-reference, so its bytes follow the reference counts of the process compiling: the
# same text compiled in two operator processes (replicas, or one after a restart) came out
# different, and a new leader would rewrite every cache's boot ConfigMap and the kubelet
# every pod's volume.
BYTECODE_SCRIPT = """
import importlib.util, json, marshal, sys
out = {}
for name, text in json.load(sys.stdin).items():
    source = text.encode("utf-8")
    code = compile(source, name, "exec", dont_inherit=True, optimize=0)
    out[name] = (importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little") + importlib.util.source_hash(source)
                 + marshal.dumps(code)).hex()
json.dump(out, sys.stdout)
"""


def bytecode_key(shipped: str, tag: str) -> str:
    """The boot ConfigMap's key (and the file name in __pycache__) of `shipped`'s bytecode
    for python `tag`: what importlib.util.cache_from_source names it."""
    return f"{shipped.removesuffix('.py')}.{tag}.pyc"


def boot_configmap(cache_name: str, namespace: str, owner: Mapping[str, Any], files: Mapping[str, str],
                   bytecode: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """The boot ConfigMap: `files` (BOOT_FILES' names -> their text) and `bytecode`
    (bytecode_key -> a pyc), owned by the cache (deleted with it), immutable, named by
    its content (boot_configmap_name)."""
    data = {name: files[name] for name in BOOT_FILES}
    return cache_configmap(boot_configmap_name(cache_name, configmap_hash(data, bytecode)), cache_name, namespace,
                           owner, data, bytecode)


def boot_volume(configmap: str, tag: str | None = BYTECODE_TAG) -> dict[str, Any]:
    """The pod's volume of the boot ConfigMap `configmap` (the one the operator verified:
    status.injection.configMaps.boot): each file at its name, its bytecode for
    python `tag` under __pycache__. Optional, and so is each key: a missing ConfigMap or
    key is a missing file, never a pod that cannot start (one admitted before the operator
    applied the ConfigMap starts cold; one whose ConfigMap has no bytecode compiles)."""
    items = [{"key": name, "path": name} for name in BOOT_FILES]
    if tag is not None:
        items += [{"key": bytecode_key(name, tag), "path": f"__pycache__/{bytecode_key(name, tag)}"}
                  for name in BOOT_FILES]
    return {"name": BOOT_VOLUME, "configMap": {"name": configmap, "optional": True,
                                               "items": items}}


def pythonpath_without_us(container: Mapping[str, Any], warmup_image: str | None,
                          image_pythonpath: str | None) -> str | None:
    """The PYTHONPATH python would have in `container` without cachewarm, when the webhook
    can know it: the literal value its spec sets, else (it sets none) the one its image
    sets, if it runs the warmup's image and the warmers reported that image's
    (`image_pythonpath`, "" for none). None: not known (a value from a reference or an
    envFrom source, another image, nothing reported): the container's PYTHONPATH cannot be
    set without perhaps losing the image's, so it gets no in-process copy."""
    if container.get("envFrom") or not container.get("image"):
        return None
    has_own, value = reporter.own_pythonpath(container)
    if has_own:
        return value
    return image_pythonpath if warmup_image and container.get("image") == warmup_image else None


def in_process(spec: Mapping[str, Any]) -> bool:
    """Whether the pod got the in-process copy already (webhook reinvocation)."""
    return any(v.get("name") == BOOT_VOLUME and "configMap" in v for v in spec.get("volumes") or []) and any(
        e.get("name") == IN_PROCESS_ENV for ct in spec.get("containers") or [] for e in ct.get("env") or [])


def _taker_pythonpath(container: Mapping[str, Any], *, main: Mapping[str, Any],
                      containers: Sequence[Mapping[str, Any]], warmup_image: str | None,
                      image_pythonpath: str | None) -> str | None:
    """The container's PYTHONPATH without us, if it takes the copy in process: one of the
    pod's `containers` (not an init container, whose limits may be small) of the `main`
    container's image, with no liveness or startup probe (they would count the copy's time,
    up to timeoutSeconds, against the container, which the copier init container's never
    did) and no exec readiness probe (one that starts python would wait for the copy)."""
    if container.get("image") != main.get("image") or not any(container is ct for ct in containers) or \
            container.get("startupProbe") or container.get("livenessProbe") or \
            "exec" in (container.get("readinessProbe") or {}):
        return None
    return pythonpath_without_us(container, warmup_image, image_pythonpath)


def _in_process_env(cache: CacheSpec, spec: Mapping[str, Any], *, namespace: str, cache_name: str,
                    reporting: reporter.Reporting | None, manifests: Mapping[str, str] | None
                    ) -> list[dict[str, Any]]:
    """What a taker's env gets: the copier's settings (writing to COPY_DIR), IN_PROCESS_ENV,
    and with `reporting` the reporter's env and where the copy's summary is."""
    pools = pools_for(spec, cache.warmup.pools) if cache.warmup is not None else []
    ours = [*copier_env(cache, namespace, cache_name, pools, spec, dest=COPY_DIR, manifests=manifests),
            {"name": IN_PROCESS_ENV, "value": "1"}]
    if reporting is not None:
        ours += [*reporter.report_env(cache_name, reporting, restore=False), {"name": SUMMARY_ENV, "value": SUMMARY_FILE}]
    return ours


def _in_process_mounts(local: LocalCopy, *, namespace: str, cache_name: str,
                       reporting: reporter.Reporting | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the copy's read-only mount at LOCAL_DIR, which every container gets; what a taker
    mounts: the boot files, the reporter's folder, the copy read-only and writable at
    COPY_DIR, and with `reporting` the token)."""
    mount = local_mount()
    writable = {**{k: v for k, v in mount.items() if k != "readOnly"}, "mountPath": COPY_DIR}
    mounts: list[dict[str, Any]] = [
        {"name": BOOT_VOLUME, "mountPath": BOOT_DIR, "readOnly": True},
        {"name": reporter.VOLUME, "mountPath": reporter.DIR}, dict(mount), writable,
        *([{"name": reporter.TOKEN_VOLUME, "mountPath": reporter.TOKEN_DIR, "readOnly": True}]
          if reporting is not None else [])]
    return mount, mounts


def _in_process_container(container: Mapping[str, Any], path: str | None, *, mount: Mapping[str, Any],
                          env: Sequence[Mapping[str, Any]], mounts: Sequence[Mapping[str, Any]],
                          summary: bool) -> dict[str, Any]:
    """A container of the pod as the in-process copy leaves it: a taker (`path`, its
    PYTHONPATH without us, not None) gets PYTHONPATH BOOT_DIR then that one, `env` and
    `mounts`; any other only the copy's volume read-only (`mount`)."""
    if path is None:
        return _mounted(container, mount, summary=summary)
    new = copy.deepcopy(dict(container))
    value = f"{BOOT_DIR}:{path}" if path else BOOT_DIR
    old_env = list(new.get("env") or [])
    if reporter.own_pythonpath(container)[0]:
        # In place: $(VAR) references in it still see the variables defined before it.
        old_env = [{"name": "PYTHONPATH", "value": value} if e.get("name") == "PYTHONPATH" else e for e in old_env]
    else:
        old_env.append({"name": "PYTHONPATH", "value": value})
    names = {e["name"] for e in env}
    new["env"] = [*(e for e in old_env if e.get("name") not in names), *copy.deepcopy(list(env))]
    new["volumeMounts"] = [*(new.get("volumeMounts") or []), *copy.deepcopy(list(mounts))]
    return new


def _in_process_volumes(volumes: Sequence[Mapping[str, Any]], local: LocalCopy, *, boot_configmap: str,
                        reporting: reporter.Reporting | None) -> list[dict[str, Any]]:
    """The pod's volumes, then the boot ConfigMap's (`boot_configmap`), the reporter's
    folder, with `reporting` the token's, and the copy's."""
    out_volumes = [copy.deepcopy(dict(v)) for v in volumes]
    out_volumes += [boot_volume(boot_configmap),
                    {"name": reporter.VOLUME, "emptyDir": {"sizeLimit": "10Mi"}}]
    if reporting is not None:
        out_volumes.append({"name": reporter.TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": "cachewarm", "expirationSeconds": reporter.TOKEN_SECONDS, "path": "token"}}]}})
    out_volumes.append(volume(local))
    return out_volumes


def add_local_copy_in_process(spec: Mapping[str, Any], containers: Sequence[Mapping[str, Any]],
                              init_containers: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]], *,
                              cache: CacheSpec, namespace: str, cache_name: str, image_pythonpath: str | None,
                              reporting: reporter.Reporting | None, boot_configmap: str | None,
                              annotations: Mapping[str, str] | None = None, manifests: Mapping[str, str] | None = None
                              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(containers, initContainers, volumes) with the local copy added in process, each
    as the rest of the patch leaves them (the env injection's; never the reporter's init
    containers: with `reporting`, the reporter comes in process too), or None when the pod
    cannot have it (pythonpath_without_us unknown for its main container, or no
    `boot_configmap`: no boot ConfigMap the operator verified, so no code of ours to put
    on its PYTHONPATH): then the caller adds the copy by init container (add_local_copy),
    which ships the code from the warmer image. On reinvocation, see
    _reinvoked_in_process.

    - the ConfigMap volume BOOT_VOLUME of `boot_configmap` at BOOT_DIR (optional: one
      deleted since it was verified is a pod that starts without our code, cold); an emptyDir at reporter.DIR for
      the copy's summary and lock (one copy per pod, whichever process starts first);
      the copy's volume (LocalCopy.volume);
    - the containers of the main container's image whose PYTHONPATH is known and that
      have no probe that would count the copy's time (the takers, see
      _taker_pythonpath):
      PYTHONPATH BOOT_DIR then that one, the copier's settings, the copy's
      volume read-only at LOCAL_DIR (JAX's) and writable at COPY_DIR (the copier's), and
      with `reporting` the reporter's env and token; the copy runs in the first of their
      processes to start (the main container's, or one of the same image), with that
      container's env, mounts, identity and resources, so it reaches GCS as the pod does,
      and the others wait for it;
    - every other container and init container: the copy's volume read-only (it reads
      what the takers copied; those of another image may start before the copy is done).
    """
    local = cache.injection.local_copy
    assert local is not None
    if in_process(spec):
        return _reinvoked_in_process(containers, init_containers, volumes, local, namespace, cache_name)
    if boot_configmap is None or any(ct.get("name") == COPIER_CONTAINER for ct in init_containers) or \
            any(v.get("name") == reporter.VOLUME for v in volumes):
        return None  # no verified code; by init container (reinvocation); or the reporter's are there already
    warmup_image = cache.warmup.image if cache.warmup is not None else None
    main = _main_container(containers, annotations)

    def path_of(container: Mapping[str, Any]) -> str | None:
        return _taker_pythonpath(container, main=main, containers=containers, warmup_image=warmup_image,
                                 image_pythonpath=image_pythonpath)
    if path_of(main) is None:
        return None
    env = _in_process_env(cache, spec, namespace=namespace, cache_name=cache_name, reporting=reporting,
                          manifests=manifests)
    mount, mounts = _in_process_mounts(local, namespace=namespace, cache_name=cache_name, reporting=reporting)
    out = [_in_process_container(ct, path_of(ct), mount=mount, env=env, mounts=mounts, summary=True)
           for ct in containers]
    init = [_in_process_container(ct, path_of(ct), mount=mount, env=env, mounts=mounts, summary=False)
            for ct in init_containers]
    return out, init, _in_process_volumes(volumes, local, boot_configmap=boot_configmap, reporting=reporting)


def _reinvoked_in_process(containers: Sequence[Mapping[str, Any]], init_containers: Sequence[Mapping[str, Any]],
                          volumes: Sequence[Mapping[str, Any]], local: LocalCopy, namespace: str, cache_name: str
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """A pod with its in-process copy already: a container a later webhook added (it got
    JAX_COMPILATION_CACHE_DIR from the env injection) gets the copy's volume read-only,
    unless it mounts something else there; no init container of ours to follow the main
    container's resources. None when nothing changes."""
    mount = local_mount()

    def lacks(ct: Mapping[str, Any]) -> bool:
        return not any(m.get("name") == LOCAL_VOLUME or str(m.get("mountPath") or "").rstrip("/") == LOCAL_DIR
                       for m in ct.get("volumeMounts") or [])
    if not any(lacks(ct) for ct in [*containers, *init_containers]):
        return None
    return ([_mounted(ct, mount, summary=True) if lacks(ct) else copy.deepcopy(dict(ct)) for ct in containers],
            [_mounted(ct, mount, summary=False) if lacks(ct) else copy.deepcopy(dict(ct)) for ct in init_containers],
            [copy.deepcopy(dict(v)) for v in volumes])
