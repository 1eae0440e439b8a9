"""What the webhook answers for a labelled pod being created: the cache's env, the
wait-for-warm gate, the reporter and the local copy, or a warning saying why not; and the
entry of the webhook's in-memory index of caches it reads them from. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.model import CacheSpec, InvalidSpec, LocalCopy, parse_spec
from cachewarm.builders.injection import add_torch_dir, inject_pod
from cachewarm.builders.localcopy import HOST_PATH_WITHDRAWN, add_local_copy, add_local_copy_in_process
from cachewarm.builders.localcopy import default_copy_refused, default_copy_size, local_copy_possible, served
from cachewarm.builders.localcopy import in_process as is_in_process
from cachewarm.builders.reporting import Reporting, add_reporter
from cachewarm.reconcile.admitted import OPTED_OUT_NOTE
from cachewarm.reconcile.pods import CacheLookup



def index_entry(spec: Mapping[str, Any], *, generation: int, uid: str | None, warmed: bool,
                refused: bool = False, image_pythonpath: str | None = None,
                manifests: Mapping[str, str] | None = None, env_configmap: str | None = None,
                boot_configmap: str | None = None, cache_bytes: int = 0) -> dict[str, Any]:
    """What the webhook needs of a cache, parsed once: the typed spec (or why it is
    invalid), whether it is Warmed, whether it is refused (BucketReady reason in
    REFUSED: no pod is held for it), the PYTHONPATH the warmup's image sets, as its
    warmers reported it (reconcile/warmup.image_pythonpath; None: not known), the
    manifest of each pool its own warmers wrote (`manifests`, pool name ->
    `<object>#<generation>`, status.warmup.pools[].manifestObject and manifestGeneration),
    and the env and boot
    ConfigMaps the operator verified (status.injection.configMaps; None: none verified,
    and the webhook references none), and the bytes under the cache's prefix at its last
    listing (status.cache.bytes: the default copy is sized from it, default_copy_size)."""
    try:
        cache: CacheSpec | None = parse_spec(spec)
        error = ""
    except InvalidSpec as exc:
        cache, error = None, str(exc)
    return {"cache": cache, "error": error, "generation": generation, "uid": uid, "warmed": warmed,
            "refused": refused, "image_pythonpath": image_pythonpath, "manifests": dict(manifests or {}),
            "env_configmap": env_configmap, "boot_configmap": boot_configmap, "cache_bytes": cache_bytes}



# Where Kubernetes puts a pod's ServiceAccount token, and the volume its ServiceAccount
# admission plugin adds for it (kube-api-access-<random>, a projected volume).
API_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_TOKEN_VOLUME_PREFIX = "kube-api-access-"


def _given_api_token(pod_spec: Mapping[str, Any]) -> bool:
    """The pod has its ServiceAccount token: the apiserver's ServiceAccount admission,
    which runs before any admission webhook, gave it the kube-api-access volume, or one
    of its containers mounts a token of its own where Kubernetes puts it (then the
    plugin adds none)."""
    if any(str(v.get("name") or "").startswith(API_TOKEN_VOLUME_PREFIX) and v.get("projected")
           for v in pod_spec.get("volumes") or []):
        return True
    return any(str(m.get("mountPath") or "").rstrip("/") == API_TOKEN_DIR
               for ct in [*(pod_spec.get("containers") or []), *(pod_spec.get("initContainers") or [])]
               for m in ct.get("volumeMounts") or [])


def token_withheld(pod_spec: Mapping[str, Any]) -> tuple[str, bool]:
    """(why the pod takes no ServiceAccount token from us, whether that is its opt-out);
    ('', False) when it takes one. Kubernetes' rule: the pod's automountServiceAccountToken
    when set, else its ServiceAccount's. The apiserver applied that rule before this
    webhook runs (its ServiceAccount admission plugin), so a pod that leaves its field
    unset and was given no token opted out through its ServiceAccount: read from the pod,
    with no ServiceAccount read (nothing a tenant can make slow or large)."""
    own = pod_spec.get("automountServiceAccountToken")
    if own is False:
        return "this pod sets automountServiceAccountToken false", True
    if own is True or _given_api_token(pod_spec):
        return "", False
    account = str(pod_spec.get("serviceAccountName") or "default")
    return (f"the apiserver gave this pod no ServiceAccount token (its ServiceAccount {account!r} sets "
            "automountServiceAccountToken false, and the pod leaves its own unset)"), True


def _with_local(cache: CacheSpec, local: LocalCopy | None) -> CacheSpec:
    return cache.model_copy(update={"injection": cache.injection.model_copy(update={"local_copy": local})})


def _without_copy(cache: CacheSpec) -> str:
    """What a pod without its local copy reads: the bucket, or for a torch cache (Inductor
    reads a local directory only) nothing."""
    return "starts with an empty torch cache directory (cold)" if cache.torch is not None else "reads the bucket"


def _served(cache: CacheSpec, pod_spec: Mapping[str, Any], cache_name: str, reporting: Reporting | None,
            warmer_image: str | None, warnings: list[str], cache_bytes: int = 0,
            manifests: Mapping[str, str] | None = None) -> tuple[CacheSpec, Reporting | None, str]:
    """(the cache as this pod gets it, the reporting it gets, what its annotation says of
    a token withheld), each difference from what the cache asks for said in `warnings`: a
    HostPath copy is an EmptyDir one (D1); no copy where the pod cannot have one (it reads
    the bucket); no reporter, and so no token, for a pod whose owner opted out of
    ServiceAccount tokens (D8), itself or through its ServiceAccount."""
    local = cache.injection.local_copy
    if local is not None and cache.injection.local_copy_by_default:
        why = default_copy_refused(cache, pod_spec, manifests or {}, cache_bytes)
        if why:
            warnings.append(f"cachewarm: CompilationCache {cache_name!r} gives pods a local copy by default, but "
                            f"this pod {_without_copy(cache)}: {why}")
            return _served(_with_local(cache, None), pod_spec, cache_name, reporting, warmer_image, warnings)
        size = default_copy_size(local.size_limit, cache_bytes)
        if size != local.size_limit:
            cache = _with_local(cache, local.model_copy(update={"size_limit": size}))
    if local is not None and local.volume == "HostPath":
        warnings.append(f"cachewarm: CompilationCache {cache_name!r} {HOST_PATH_WITHDRAWN} "
                        f"(sizeLimit {local.size_limit})")
        cache = _with_local(cache, served(local))
    if cache.injection.local_copy is not None and not local_copy_possible(pod_spec, warmer_image):
        # No copy (no warmer image configured, a Windows pod): the pod reads the bucket.
        cache = _with_local(cache, None)
        asks = "gives pods a local copy by default" if cache.injection.local_copy_by_default else \
            "asks for a local copy"
        warnings.append(f"cachewarm: CompilationCache {cache_name!r} {asks}, which this pod "
                        "cannot get (a Windows pod, a volume of its own named cachewarm-cache, cachewarm-boot, "
                        "cachewarm-reporter or cachewarm-report-token, or a mount of one, or one mounted at "
                        "/cachewarm-cache, /cachewarm-boot, /cachewarm-copy, /cachewarm-reporter or "
                        f"/var/run/secrets/cachewarm, or no warmer image configured); it {_without_copy(cache)}")
    reports = reporting if cache.injection.report else None
    why, opted_out = token_withheld(pod_spec) if reports is not None else ("", False)
    if not opted_out:
        return cache, reports, ""
    warnings.append(f"cachewarm: {why}, so cachewarm gives it no ServiceAccount token either, and no reporter: "
                    f"CompilationCache {cache_name!r} gets no report from it")
    return cache, None, OPTED_OUT_NOTE


def _claim_root(cache: CacheSpec, pod_spec: Mapping[str, Any]) -> list[str]:
    """A warning where the copier init container (never root: D7) may find the root of the
    pod's Ephemeral claim not writable: the pod sets no fsGroup, which the kubelet would
    give the volume to (and our container is in). Not on reinvocation (the copier is there)."""
    local = cache.injection.local_copy
    if local is None or local.volume != "Ephemeral" or (pod_spec.get("securityContext") or {}).get("fsGroup") \
            is not None or any(ct.get("name") == c.LOCAL_COPY_CONTAINER for ct in pod_spec.get("initContainers") or []):
        return []
    return ["cachewarm: the local copy's init container runs as a non-root user, and this pod sets no "
            "securityContext.fsGroup: the root of its Ephemeral volume may not be writable by that user (then the "
            "pod starts with an empty copy, and its report says why); set a pod fsGroup"]


def _without_env(containers: list[str], cache_name: str) -> list[str]:
    """Warnings for the containers with envFrom sources that got no cache env (D4: no env
    ConfigMap the operator verified)."""
    return [f"cachewarm: container {name!r} has envFrom sources and got no cache env: CompilationCache "
            f"{cache_name!r} has no env ConfigMap the operator verified (see its InjectionReady condition); "
            "it reads no cache" for name in containers]


def _add_torch_dir(out: Admission, cache: CacheSpec, cache_name: str, containers: list[dict[str, Any]],
                   init_containers: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> None:
    """A torch cache's pod: its torch directory (injection.add_torch_dir) in the patch as the
    env injection and the local copy left it (`out.spec`, else the given lists), said in
    warnings where a container keeps its own or the pod gets none."""
    torch = add_torch_dir(cache, out.spec.get("containers", containers),
                          out.spec.get("initContainers", init_containers), out.spec.get("volumes", volumes))
    if torch.changed:
        out.spec["containers"], out.spec["volumes"] = torch.containers, torch.volumes
        if torch.init_containers:
            out.spec["initContainers"] = torch.init_containers
        out.injected = True
    out.warnings += [f"cachewarm: container {name!r} mounts its own volume at the torch cache directory; "
                     f"CompilationCache {cache_name!r}'s was not mounted in it" for name in torch.kept]
    if torch.refused:
        out.warnings.append(f"cachewarm: CompilationCache {cache_name!r}: {torch.refused}; torch compiles "
                            "into the container's own filesystem, cold")


def _torch_dir_kept(cache: CacheSpec, name: str) -> str:
    """What a torch cache's container that keeps its own cache dir loses: torch reads only
    that directory, so what the copy seeded is never read ('' for any other variable)."""
    if cache.torch is None or name not in (c.ENV_TORCHINDUCTOR_CACHE_DIR, c.ENV_TRITON_CACHE_DIR):
        return ""
    seeded = cache.torch.cache_dir + ("/triton" if name == c.ENV_TRITON_CACHE_DIR else "")
    what = "its Triton kernels compile" if name == c.ENV_TRITON_CACHE_DIR else "it compiles"
    return (f"; torch reads only its own {name}, so {what} cold: the copy seeds {seeded}, a directory "
            "torch does not read there")


@dataclass
class Admission:
    """The webhook's answer for one pod: fields to set, annotations, warnings. Nothing to
    post: admission has no side effects (the webhook declares sideEffects: None, and a
    dry-run or a forged review must write nothing)."""

    spec: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    injected: bool = False


def admit_pod(pod: Mapping[str, Any], lookup: CacheLookup, reporting: Reporting | None = None,
              warmer_image: str | None = None) -> Admission:
    """Add the named cache's env (and, with waitForWarm, a scheduling gate; with
    `reporting` and spec.injection.report, the reporter, unless the pod opted out of
    tokens, itself or through its ServiceAccount (token_withheld); with spec.injection.localCopy and
    the `warmer_image` that carries the copier, the local copy) to a pod being created, or
    say in a warning why not. Raises only on a bug; the caller admits anyway."""
    meta = pod.get("metadata") or {}
    namespace = str(meta.get("namespace") or "")
    cache_name = str((meta.get("labels") or {}).get(c.CACHE_LABEL) or "")
    entry = lookup(namespace, cache_name)
    out = Admission()
    if entry is None:
        out.warnings.append(f"cachewarm: no CompilationCache {cache_name!r} in namespace {namespace!r} "
                            f"(label {c.CACHE_LABEL}); pod admitted without the cache")
        return out
    cache: CacheSpec | None = entry["cache"]
    if cache is None:
        out.warnings.append(f"cachewarm: CompilationCache {cache_name!r} is invalid ({entry['error']}); "
                            "pod admitted without the cache")
        return out
    pod_spec = pod.get("spec") or {}
    cache, reports, withheld = _served(cache, pod_spec, cache_name, reporting, warmer_image, out.warnings,
                                       int(entry.get("cache_bytes") or 0), entry.get("manifests"))
    result = inject_pod(pod, cache_name, entry["generation"], cache, entry.get("env_configmap"))
    if result.changed:
        out.spec["containers"] = result.containers
        if result.init_containers is not None:
            out.spec["initContainers"] = result.init_containers
        out.annotations[c.INJECTED_ANNOTATION] = result.annotation
        out.injected = True
    containers = result.containers
    init_containers = result.init_containers if result.init_containers is not None else pod_spec.get("initContainers") or []
    volumes = list(pod_spec.get("volumes") or [])
    in_process = None
    if cache.injection.local_copy is not None and warmer_image:
        # In process where the pod's PYTHONPATH is known: no init container at all.
        in_process = add_local_copy_in_process(
            pod_spec, containers, init_containers, volumes, cache=cache, namespace=namespace, cache_name=cache_name,
            image_pythonpath=entry.get("image_pythonpath"), reporting=reports,
            boot_configmap=entry.get("boot_configmap"), annotations=meta.get("annotations"),
            manifests=entry.get("manifests"))
        if in_process is not None:
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = in_process
            out.injected = True
    # Else by init containers (as at the first admission, on reinvocation).
    by_init = in_process is None and not is_in_process(pod_spec)
    if by_init and reports is not None:
        added = add_reporter(pod_spec, containers, init_containers, cache_name, reports)
        if added is not None:
            containers, init_containers, volumes = added
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = added
            out.injected = True
    if by_init and cache.injection.local_copy is not None and warmer_image:
        copied = add_local_copy(pod_spec, containers, init_containers, volumes, cache=cache, namespace=namespace,
                                cache_name=cache_name, image=warmer_image, annotations=meta.get("annotations"),
                                manifests=entry.get("manifests"))
        if copied is not None:
            out.spec["containers"], out.spec["initContainers"], out.spec["volumes"] = copied
            out.injected = True
            out.warnings += _claim_root(cache, pod_spec)
    if cache.torch is not None:
        _add_torch_dir(out, cache, cache_name, containers, init_containers, volumes)
    gates = list((pod.get("spec") or {}).get("schedulingGates") or [])
    if cache.injection.wait_for_warm.enabled and cache.warmup is not None and not entry["warmed"] \
            and not entry.get("refused"):
        if not any(g.get("name") == c.WAIT_GATE for g in gates):
            out.spec["schedulingGates"] = [*gates, {"name": c.WAIT_GATE}]
    out.warnings += _without_env(result.without_env, cache_name)
    for kept in result.kept:
        out.warnings.append(f"cachewarm: container {kept.container!r} keeps its own {kept.name}; the value from "
                            f"CompilationCache {cache_name!r} was not applied to it{_torch_dir_kept(cache, kept.name)}")
    if result.kept and c.INJECTED_ANNOTATION in out.annotations:
        # Said on the pod itself (no Event: admission writes nothing).
        names = ", ".join(sorted({f"{k.container}/{k.name}" for k in result.kept}))
        out.annotations[c.INJECTED_ANNOTATION] += f"; kept its own {names}"
    if withheld and c.INJECTED_ANNOTATION in out.annotations:
        # What status.reports.podsOptedOut counts (reconcile/admitted.py): what was decided here.
        out.annotations[c.INJECTED_ANNOTATION] += f"; {withheld}"
    return out
