"""PodsReadOnly and LocalCopyAsSpecified say what a cache's spec makes of its pods: a
ReadWrite cache says how to switch; a cache stored with the withdrawn HostPath copy says its
pods get an EmptyDir copy instead."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.api import constants as c
from cachewarm.api.model import parse_spec
from cachewarm.reconcile.podsmode import local_copy_as_specified, pods_read_only, spec_conditions


WARMUP = {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}


def cache(injection: dict[str, Any]) -> Any:
    return parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "injection": injection,
                       "warmup": WARMUP})


@pytest.mark.parametrize(("injection", "status", "reason"), [
    pytest.param({}, True, "ReadOnly", id="default"),
    pytest.param({"mode": "ReadOnly"}, True, "ReadOnly", id="read-only"),
    pytest.param({"mode": "ReadWrite"}, False, "ReadWriteChosen", id="read-write"),
])
def test_pods_read_only(injection: dict[str, Any], status: bool, reason: str) -> None:
    cond = pods_read_only(cache(injection), "llama")
    assert (cond.type, cond.status, cond.reason) == ("PodsReadOnly", status, reason)


def test_read_write_says_why_and_how_to_switch() -> None:
    message = pods_read_only(cache({"mode": "ReadWrite"}), "llama").message
    assert f"{c.CACHE_LABEL}=llama" in message
    assert "runs as code" in message
    assert "kubectl patch compilationcache llama --type=merge" in message
    assert '{"spec":{"injection":{"mode":"ReadOnly"}}}' in message


@pytest.mark.parametrize(("local", "status", "reason", "said"), [
    pytest.param(None, True, "PerPodCopy", "own EmptyDir copy of at most 10Gi (the default: spec.injection sets "
                 "neither localCopy nor readFrom", id="none"),
    pytest.param({}, True, "PerPodCopy", "own EmptyDir copy of at most 10Gi;", id="empty-dir"),
    pytest.param({"volume": "Ephemeral"}, True, "PerPodCopy", "own Ephemeral copy", id="ephemeral"),
    pytest.param({"volume": "HostPath", "hostPath": "/mnt/ssd", "sizeLimit": "375Gi"}, False, "HostPathWithdrawn",
                 "EmptyDir copy of 375Gi instead", id="host-path"),
])
def test_local_copy_as_specified(local: dict[str, Any] | None, status: bool, reason: str, said: str) -> None:
    injection: dict[str, Any] = {"mode": "ReadOnly"}
    if local is not None:
        injection["localCopy"] = local
    cond = local_copy_as_specified(cache(injection), [{"name": "a", "manifestGeneration": "1"}])
    assert (cond.type, cond.status, cond.reason) == ("LocalCopyAsSpecified", status, reason)
    assert said in cond.message


@pytest.mark.parametrize(("spec", "said"), [
    pytest.param({"injection": {"readFrom": "Bucket"}}, "spec.injection.readFrom is Bucket", id="read-from-bucket"),
    pytest.param({"injection": {"mode": "ReadWrite"}}, "mode is ReadWrite", id="read-write"),
    pytest.param({"jax": {"enableXlaCaches": "all"}}, "enableXlaCaches is 'all'", id="xla-caches"),
    pytest.param({"warmup": None}, "the cache has no spec.warmup", id="no-warmup"),
])
def test_pods_that_read_the_bucket_are_told_why(spec: dict[str, Any], said: str) -> None:
    body = {"storage": {"gcs": {"bucket": "b", "location": "US"}}, "warmup": WARMUP, **spec}
    cond = local_copy_as_specified(parse_spec({k: v for k, v in body.items() if v is not None}))
    assert (cond.status, cond.reason) == (True, "NoLocalCopy")
    assert "Pods read the bucket (gs://b) directly" in cond.message and said in cond.message


def test_a_default_copy_without_a_recorded_manifest_says_pods_read_the_bucket() -> None:
    cond = local_copy_as_specified(cache({}), [])
    assert (cond.status, cond.reason) == (True, "NoTrustedManifest")
    assert "no pool's warmer has recorded a manifest yet: pods of those pools read the bucket" in cond.message


def test_host_path_message_says_why_and_what_to_do() -> None:
    message = local_copy_as_specified(cache({"localCopy": {"volume": "HostPath", "hostPath": "/mnt/ssd"}})).message
    assert "a copy shared between pods is a writable mount another pod reads" in message
    assert "Set localCopy.volume to EmptyDir or Ephemeral" in message


def test_spec_conditions_are_both_always() -> None:
    # Always both, so a spec change never leaves a stale one in status.
    assert [cd.type for cd in spec_conditions(cache({}), "llama")] == ["PodsReadOnly", "LocalCopyAsSpecified"]


def _warmed(pools: list[str]) -> Any:
    return parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
                       "injection": {"mode": "ReadOnly", "localCopy": {}},
                       "warmup": {"image": "img", "targets": ["m:f"], "pools": [{"name": p} for p in pools]}})


@pytest.mark.parametrize(("recorded", "status", "reason", "said"), [
    pytest.param({}, False, "NoTrustedManifest", "(cpu, gpu): pods' copies are empty", id="none-recorded"),
    pytest.param({"cpu": "17"}, True, "PerPodCopy", "give nothing (gpu)", id="one-of-two"),
    pytest.param({"cpu": "17", "gpu": "18"}, True, "PerPodCopy", "own EmptyDir copy", id="all-recorded"),
])
def test_pools_without_a_trusted_manifest_are_said(recorded: dict[str, str], status: bool, reason: str,
                                                   said: str) -> None:
    # Issue 28: a pool with no recorded manifest generation gives pods an empty copy; that
    # cold start is said in status, not only in each pod's copier summary.
    pools = [{"name": "cpu", "state": "Succeeded"}, {"name": "gpu", "state": "Running"}]
    pools = [{**p, **({"manifestGeneration": recorded[p["name"]]} if p["name"] in recorded else {})} for p in pools]
    cond = local_copy_as_specified(_warmed(["cpu", "gpu"]), pools)
    assert (cond.status, cond.reason) == (status, reason)
    assert said in cond.message
    if recorded == {"cpu": "17", "gpu": "18"}:
        assert "give nothing" not in cond.message


@pytest.mark.parametrize(("injection", "status"), [
    pytest.param({}, False, id="default-copy"),
    pytest.param({"mode": "ReadOnly", "localCopy": {}}, False, id="asked-for-copy"),
])
def test_an_operator_without_a_warmer_image_says_pods_read_the_bucket(injection: dict[str, Any], status: bool) -> None:
    # The webhook gives no pod a copy without the warmer image (builders/localcopy.local_copy_possible):
    # the condition must not say PerPodCopy then.
    cond = local_copy_as_specified(cache(injection), [{"name": "a", "manifestGeneration": "1"}], warmer_image=False)
    assert (cond.status, cond.reason) == (status, "NoWarmerImage")
    assert "Pods read the bucket (gs://b-1) directly" in cond.message and "CACHEWARM_WARMER_IMAGE" in cond.message
    assert [cd.reason for cd in spec_conditions(cache(injection), "x", [], False)][1] == "NoWarmerImage"
