"""What a cache's spec makes of its training pods, said as conditions: PodsReadOnly (only
warmers write, or pods may write entries every later reader runs) and LocalCopyAsSpecified
(which copy pods read, the default one included, or why they read the bucket; a cache stored
with the withdrawn HostPath copy gets an EmptyDir one; pools whose warmers
recorded no manifest generation give pods an empty copy). Pure: from the spec and the
pools' status, so a repeated reconcile says the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.conditions import Cond
from cachewarm.api.model import CacheSpec


def pods_read_only(cache: CacheSpec, name: str) -> Cond:
    """PodsReadOnly: True for mode ReadOnly; False (ReadWriteChosen) for ReadWrite, with why
    it matters and how to switch."""
    if cache.injection.mode == "ReadOnly":
        return Cond(c.Condition.PODS_READ_ONLY, True, c.Reason.READ_ONLY,
                    "Training pods only read the cache; only warmers write it. The mode is not a permission: "
                    "give the pods' identity read-only access to the bucket (docs/security.md)")
    return Cond(c.Condition.PODS_READ_ONLY, False, c.Reason.READ_WRITE_CHOSEN,
                f"spec.injection.mode is ReadWrite: every pod labelled {c.CACHE_LABEL}={name} can write entries "
                "that every later reader of the cache runs as code. To make the pods readers, set "
                "spec.injection.mode to ReadOnly (kubectl patch compilationcache "
                f"{name} --type=merge -p '{{\"spec\":{{\"injection\":{{\"mode\":\"ReadOnly\"}}}}}}') "
                "and let only the warmers write")


def untrusted_pools(cache: CacheSpec, pools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The spec's pools with no manifest generation recorded in status (`pools`,
    status.warmup.pools): the copier trusts no manifest of theirs, so it copies nothing of
    them. [] for a cache without warmup (its copies take the prefix)."""
    if cache.warmup is None:
        return []
    recorded = {str(p.get("name")) for p in pools if p.get("manifestGeneration")}
    return [p.name for p in cache.warmup.pools if p.name not in recorded]


def local_copy_as_specified(cache: CacheSpec, pools: Sequence[Mapping[str, Any]] = (), warmer_image: bool = True) -> Cond:
    """LocalCopyAsSpecified: for a copy while the operator has no warmer image
    (`warmer_image` False; the webhook then gives no pod a copy): False (NoWarmerImage),
    for the default copy too (an operator-wide misconfiguration puts every such cache's pods
    on the slow path: a signal a team alerting on False sees); False (HostPathWithdrawn)
    for a cache stored with volume HostPath, whose pods get an EmptyDir copy of the same sizeLimit; False
    (NoTrustedManifest) while every pool lacks a manifest generation (pods' copies are
    empty: a silent cold start otherwise); True otherwise, naming pools still without one."""
    local = cache.injection.local_copy
    _, why = cache.read_path()
    if local is None:
        return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, True, c.Reason.NO_LOCAL_COPY,
                    f"Pods read the bucket ({cache.storage.gcs.url}) directly, with no local copy: {why}"[:1000])
    if not warmer_image:
        by_default = cache.injection.local_copy_by_default
        return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, False, c.Reason.NO_WARMER_IMAGE,
                    f"Pods read the bucket ({cache.storage.gcs.url}) directly: the cache "
                    f"{'gives pods a local copy by default' if by_default else 'asks for a local copy'}, which needs the "
                    "warmer image, and the operator runs with none (CACHEWARM_WARMER_IMAGE is empty); set it to the "
                    "warmer image (manifests/ sets it)"[:1000])
    if local.volume == "HostPath":
        return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, False, c.Reason.HOST_PATH_WITHDRAWN,
                    f"localCopy.volume HostPath is withdrawn: a copy shared between pods is a writable mount another "
                    f"pod reads, so pods get an EmptyDir copy of {local.size_limit} instead and hostPath is not "
                    "mounted. Set localCopy.volume to EmptyDir or Ephemeral and remove localCopy.hostPath")
    untrusted = untrusted_pools(cache, pools)
    if untrusted and cache.warmup is not None and cache.injection.local_copy_by_default:
        # The webhook gives the default copy only to pods of pools with a manifest
        # (builders/localcopy.default_copy_refused): the others read the bucket.
        some = ("no pool's warmer has" if len(untrusted) == len(cache.warmup.pools) else
                f"pools {', '.join(untrusted)} have no warmer that has")
        return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, True, c.Reason.NO_TRUSTED_MANIFEST,
                    f"Pods get a local copy by default ({why}), but {some} recorded a manifest yet: pods of "
                    "those pools read the bucket directly until a warm of their pool records one"[:1000])
    if untrusted and cache.warmup is not None and len(untrusted) == len(cache.warmup.pools):
        return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, False, c.Reason.NO_TRUSTED_MANIFEST,
                    f"No pool's warmer has recorded a manifest generation yet ({', '.join(untrusted)}): pods' "
                    "copies are empty and they start cold until a warm of their pool writes one (a warmer whose "
                    "programs run in a python started with -S, -I or -E, or with a PYTHONPATH of its own, cannot "
                    "name its entries: give warmup.targets)"[:1000])
    some = (f"; pools without a recorded manifest give nothing ({', '.join(untrusted)}): pods of only those "
            "pools start cold" if untrusted else "")
    default = (f" ({why}; larger where the cache's last listing needs more; operators before this one gave such "
               "a cache no copy: its pods read the bucket, see CHANGELOG.md)" if cache.injection.local_copy_by_default else "")
    return Cond(c.Condition.LOCAL_COPY_AS_SPECIFIED, True, c.Reason.PER_POD_COPY,
                f"Each pod gets its own {local.volume} copy of at most {local.size_limit}{default}{some}; a pod that "
                "cannot have one (a Windows pod, volumes of its own named like cachewarm's) reads the bucket, and "
                "the webhook's warning and the pod's cachewarm.dev/injected annotation say so"[:1000])


def spec_conditions(cache: CacheSpec, name: str, pools: Sequence[Mapping[str, Any]] = (),
                    warmer_image: bool = True) -> list[Cond]:
    """The conditions above, for status.assemble's updates (`pools`: status.warmup.pools;
    `warmer_image`: whether the operator has one to give pods the copier with)."""
    return [pods_read_only(cache, name), local_copy_as_specified(cache, pools, warmer_image)]
