"""The env builder that pods and warmers share, and the pod patch the webhook makes."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.builders.injection import Kept, cache_env, env_configmap, env_configmap_name, inject_pod
from cachewarm.api.model import CacheSpec, parse_spec


def spec(mode: str = "ReadWrite", prefix: str = "llama", **jax: Any) -> CacheSpec:
    return parse_spec({
        "storage": {"gcs": {"bucket": "team-cache", "prefix": prefix, "location": "us-central1"}},
        "jax": jax, "injection": {"mode": mode},
    })


def as_dict(env: list[dict[str, str]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in env}


@pytest.mark.parametrize(("cache", "role", "min_compile"), [
    (spec("ReadWrite"), "pod", "1.0"),
    (spec("ReadOnly"), "pod", "1e9"),
    (spec("ReadOnly"), "warmer", "1.0"),
    (spec("ReadOnly", minCompileTimeSecs=0.25), "warmer", "0.25"),
    (spec("ReadWrite", minCompileTimeSecs=2), "pod", "2.0"),
])
def test_min_compile_time_by_role_and_mode(cache: CacheSpec, role: Any, min_compile: str) -> None:
    assert as_dict(cache_env(cache, role))["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == min_compile


def test_pod_and_warmer_point_at_the_same_cache_bytes() -> None:
    cache = spec("ReadOnly", enableXlaCaches="xla_gpu_per_fusion_autotune_cache_dir")
    pod, warmer = as_dict(cache_env(cache, "pod")), as_dict(cache_env(cache, "warmer"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        assert pod[name] == warmer[name]
    assert pod["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert as_dict(cache_env(spec(prefix=""), "pod"))["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache"


def test_every_container_and_init_container_gets_the_env() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {
        "initContainers": [{"name": "fetch"}],
        "containers": [{"name": "train", "env": [{"name": "OTHER", "value": "1"}]}, {"name": "sidecar"}]}}
    result = inject_pod(pod, "llama", 3, spec())
    assert result.changed and result.kept == []
    assert [e["name"] for e in result.containers[0]["env"]][0] == "OTHER"
    ours = as_dict(cache_env(spec(), "pod"))
    assert as_dict(result.containers[0]["env"]) == {"OTHER": "1", **ours}
    assert as_dict(result.containers[1]["env"]) == ours
    assert result.init_containers is not None and as_dict(result.init_containers[0]["env"]) == ours
    assert result.annotation == "llama (generation 3, ReadWrite, gs://team-cache/llama)"
    assert pod["spec"]["containers"][1] == {"name": "sidecar"}  # input not mutated


def test_injecting_twice_changes_nothing() -> None:
    pod: dict[str, Any] = {"metadata": {}, "spec": {"containers": [{"name": "train"}]}}
    first = inject_pod(pod, "llama", 1, spec())
    again_pod = {"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
                 "spec": {"containers": first.containers}}
    second = inject_pod(again_pod, "llama", 1, spec())
    assert not second.changed and second.kept == []
    assert second.containers == first.containers


@pytest.mark.parametrize("own", [
    {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/local"},
    {"name": "JAX_COMPILATION_CACHE_DIR", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
])
def test_user_env_wins_and_is_reported(own: dict[str, Any]) -> None:
    pod = {"spec": {"containers": [{"name": "train", "env": [own]}]}}
    result = inject_pod(pod, "llama", 1, spec())
    env = result.containers[0]["env"]
    assert env[0] == own
    assert [e["name"] for e in env].count("JAX_COMPILATION_CACHE_DIR") == 1
    assert result.kept == [Kept("train", "JAX_COMPILATION_CACHE_DIR")]


def test_user_env_equal_to_ours_is_not_a_conflict() -> None:
    pod = {"spec": {"containers": [{"name": "t", "env": [
        {"name": "JAX_COMPILATION_CACHE_DIR", "value": "gs://team-cache/llama"}]}]}}
    assert inject_pod(pod, "llama", 1, spec()).kept == []


def test_generation_change_updates_annotation_even_without_new_env() -> None:
    pod: dict[str, Any] = {"metadata": {}, "spec": {"containers": [{"name": "train"}]}}
    first = inject_pod(pod, "llama", 1, spec())
    moved = {"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
             "spec": {"containers": first.containers}}
    assert inject_pod(moved, "llama", 2, spec()).changed


CM = {"configMapRef": {"name": "cachewarm-llama-env", "optional": True}}


@pytest.mark.parametrize("sources", [
    [{"configMapRef": {"name": "team-env"}}],
    [{"secretRef": {"name": "team-secrets"}}],
    [{"prefix": "APP_", "configMapRef": {"name": "app"}}, {"secretRef": {"name": "s", "optional": True}}],
])
def test_a_container_with_env_from_reads_the_cache_env_first_so_its_own_sources_win(sources: list[Any]) -> None:
    pod = {"spec": {"containers": [{"name": "train", "envFrom": sources, "env": [{"name": "OTHER", "value": "1"}]}]}}
    result = inject_pod(pod, "llama", 1, spec())
    [container] = result.containers
    # Ours first: a later source (theirs) wins for a key both set, and env beats every source.
    assert container["envFrom"] == [CM, *sources]
    assert container["env"] == [{"name": "OTHER", "value": "1"}]  # no env entry would override their sources
    assert result.changed and result.kept == []


def test_env_from_and_a_users_own_env_entry_still_report_it_kept() -> None:
    own = {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/local"}
    pod = {"spec": {"containers": [{"name": "train", "envFrom": [{"secretRef": {"name": "s"}}], "env": [own]}]}}
    result = inject_pod(pod, "llama", 1, spec())
    assert result.containers[0]["env"] == [own]
    assert result.kept == [Kept("train", "JAX_COMPILATION_CACHE_DIR")]


def test_env_from_injection_is_idempotent_and_a_prefixed_ref_to_our_configmap_is_not_ours() -> None:
    pod: dict[str, Any] = {"metadata": {}, "spec": {"containers": [{"name": "t", "envFrom": [{"secretRef": {"name": "s"}}]}]}}
    first = inject_pod(pod, "llama", 1, spec())
    again = inject_pod({"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
                        "spec": {"containers": first.containers}}, "llama", 1, spec())
    assert not again.changed and again.containers == first.containers
    prefixed = {"prefix": "X_", "configMapRef": {"name": "cachewarm-llama-env"}}
    other = inject_pod({"spec": {"containers": [{"name": "t", "envFrom": [prefixed]}]}}, "llama", 1, spec())
    assert other.containers[0]["envFrom"] == [CM, prefixed]


def test_the_env_configmap_is_the_pod_env_owned_by_the_cache() -> None:
    cm = env_configmap(spec("ReadOnly"), "llama", "ml", {"name": "llama", "uid": "u-1"})
    assert cm["metadata"]["name"] == env_configmap_name("llama") == "cachewarm-llama-env"
    assert cm["data"] == as_dict(cache_env(spec("ReadOnly"), "pod"))
    assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                                  "name": "llama", "uid": "u-1", "controller": True,
                                                  "blockOwnerDeletion": True}]
