"""The env builder that pods and warmers share, and the pod patch the webhook makes."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.builders import injection
from cachewarm.builders.injection import Kept, cache_env, env_configmap, env_configmap_name, inject_pod
from cachewarm.api.model import CacheSpec, InvalidSpec, parse_spec


def spec(mode: str = "ReadWrite", prefix: str = "llama", **jax: Any) -> CacheSpec:
    return parse_spec({
        "storage": {"gcs": {"bucket": "team-cache", "prefix": prefix, "location": "us-central1"}},
        "jax": jax, "injection": {"mode": mode},
    })


ENV_CM = "cachewarm-llama-env-0123456789"  # the env ConfigMap the operator verified


def as_dict(env: list[dict[str, str]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in env}


@pytest.mark.parametrize(("cache", "role", "min_compile"), [
    (spec("ReadWrite"), "pod", "1.0"),
    (spec("ReadOnly"), "pod", "1e9"),
    # The warmer writes every program (issue 30): jax.minCompileTimeSecs is the pods' (ReadWrite).
    (spec("ReadOnly"), "warmer", "0.0"),
    (spec("ReadOnly", minCompileTimeSecs=0.25), "warmer", "0.0"),
    (spec("ReadWrite", minCompileTimeSecs=2), "pod", "2.0"),
])
def test_min_compile_time_by_role_and_mode(cache: CacheSpec, role: Any, min_compile: str) -> None:
    assert as_dict(cache_env(cache, role))["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == min_compile


def test_the_warmers_threshold_is_warmup_min_compile_time_secs() -> None:
    warmup = {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}
    body = {"storage": {"gcs": {"bucket": "b", "location": "US"}}, "jax": {"minCompileTimeSecs": 2}}
    cache = parse_spec({**body, "warmup": {**warmup, "minCompileTimeSecs": 0.5}})
    assert as_dict(cache_env(cache, "warmer"))["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.5"
    assert as_dict(cache_env(parse_spec({**body, "warmup": warmup}), "warmer"))[
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.0"
    with pytest.raises(InvalidSpec, match=r"spec\.warmup\.minCompileTimeSecs"):
        parse_spec({**body, "warmup": {**warmup, "minCompileTimeSecs": -1}})


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
    result = inject_pod(pod, "llama", 3, spec(), ENV_CM)
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
    first = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    again_pod = {"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
                 "spec": {"containers": first.containers}}
    second = inject_pod(again_pod, "llama", 1, spec(), ENV_CM)
    assert not second.changed and second.kept == []
    assert second.containers == first.containers


@pytest.mark.parametrize("own", [
    {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/local"},
    {"name": "JAX_COMPILATION_CACHE_DIR", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
])
def test_user_env_wins_and_is_reported(own: dict[str, Any]) -> None:
    pod = {"spec": {"containers": [{"name": "train", "env": [own]}]}}
    result = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    env = result.containers[0]["env"]
    assert env[0] == own
    assert [e["name"] for e in env].count("JAX_COMPILATION_CACHE_DIR") == 1
    assert result.kept == [Kept("train", "JAX_COMPILATION_CACHE_DIR")]


def test_user_env_equal_to_ours_is_not_a_conflict() -> None:
    pod = {"spec": {"containers": [{"name": "t", "env": [
        {"name": "JAX_COMPILATION_CACHE_DIR", "value": "gs://team-cache/llama"}]}]}}
    assert inject_pod(pod, "llama", 1, spec(), ENV_CM).kept == []


def test_generation_change_updates_annotation_even_without_new_env() -> None:
    pod: dict[str, Any] = {"metadata": {}, "spec": {"containers": [{"name": "train"}]}}
    first = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    moved = {"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
             "spec": {"containers": first.containers}}
    assert inject_pod(moved, "llama", 2, spec(), ENV_CM).changed


CM = {"configMapRef": {"name": ENV_CM, "optional": True}}


@pytest.mark.parametrize("sources", [
    [{"configMapRef": {"name": "team-env"}}],
    [{"secretRef": {"name": "team-secrets"}}],
    [{"prefix": "APP_", "configMapRef": {"name": "app"}}, {"secretRef": {"name": "s", "optional": True}}],
])
def test_a_container_with_env_from_reads_the_cache_env_first_so_its_own_sources_win(sources: list[Any]) -> None:
    pod = {"spec": {"containers": [{"name": "train", "envFrom": sources, "env": [{"name": "OTHER", "value": "1"}]}]}}
    result = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    [container] = result.containers
    # Ours first: a later source (theirs) wins for a key both set, and env beats every source.
    assert container["envFrom"] == [CM, *sources]
    assert container["env"] == [{"name": "OTHER", "value": "1"}]  # no env entry would override their sources
    assert result.changed and result.kept == []


def test_env_from_and_a_users_own_env_entry_still_report_it_kept() -> None:
    own = {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/local"}
    pod = {"spec": {"containers": [{"name": "train", "envFrom": [{"secretRef": {"name": "s"}}], "env": [own]}]}}
    result = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    assert result.containers[0]["env"] == [own]
    assert result.kept == [Kept("train", "JAX_COMPILATION_CACHE_DIR")]


def test_env_from_injection_is_idempotent_and_a_prefixed_ref_to_our_configmap_is_not_ours() -> None:
    pod: dict[str, Any] = {"metadata": {}, "spec": {"containers": [{"name": "t", "envFrom": [{"secretRef": {"name": "s"}}]}]}}
    first = inject_pod(pod, "llama", 1, spec(), ENV_CM)
    again = inject_pod({"metadata": {"annotations": {"cachewarm.dev/injected": first.annotation}},
                        "spec": {"containers": first.containers}}, "llama", 1, spec(), ENV_CM)
    assert not again.changed and again.containers == first.containers
    prefixed = {"prefix": "X_", "configMapRef": {"name": ENV_CM}}
    other = inject_pod({"spec": {"containers": [{"name": "t", "envFrom": [prefixed]}]}}, "llama", 1, spec(), ENV_CM)
    assert other.containers[0]["envFrom"] == [CM, prefixed]


def test_the_env_configmap_is_the_pod_env_owned_by_the_cache() -> None:
    cm = env_configmap(spec("ReadOnly"), "llama", "ml", {"name": "llama", "uid": "u-1"})
    h = injection.configmap_hash(cm["data"])
    assert cm["metadata"]["name"] == env_configmap_name("llama", h) == f"cachewarm-llama-env-{h}"
    assert cm["immutable"] is True and cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cachewarm"
    assert cm["metadata"]["annotations"] == {"cachewarm.dev/content-sha256": injection.configmap_sha256(cm["data"])}
    assert injection.body_sha256(cm) == injection.configmap_sha256(cm["data"])
    # Its containers may be in a pod that got no copy: they read the bucket.
    assert cm["data"] == as_dict(cache_env(spec("ReadOnly"), "pod", local=False))
    assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                                  "name": "llama", "uid": "u-1", "controller": True,
                                                  "blockOwnerDeletion": True}]


def test_without_a_verified_env_configmap_an_env_from_container_gets_nothing_and_is_named() -> None:
    """D4: the webhook references only a ConfigMap the operator verified; with none, a
    container with envFrom sources gets no source of ours (an env entry would override its
    own sources), one without gets the env entries as ever."""
    pod = {"spec": {"containers": [{"name": "train", "envFrom": [{"secretRef": {"name": "s"}}]}, {"name": "side"}]}}
    result = inject_pod(pod, "llama", 1, spec(), None)
    train, side = result.containers
    assert train == pod["spec"]["containers"][0]
    assert as_dict(side["env"]) == as_dict(cache_env(spec(), "pod"))
    assert result.without_env == ["train"]


def test_the_content_hash_is_stable_and_changes_with_any_byte_key_or_kind() -> None:
    data = {"a": "1", "b": "two"}
    binary = {"c.pyc": b"\x00\x01"}
    first = injection.configmap_sha256(data, binary)
    assert first == injection.configmap_sha256(dict(reversed(data.items())), binary)  # order of keys is not content
    assert injection.configmap_hash(data, binary) == first[:10] and len(first) == 64
    others = [
        ({"a": "1", "b": "twO"}, binary), ({"a": "1", "b": "two", "d": ""}, binary), ({"a": "1"}, binary),
        ({"a": "1", "B": "two"}, binary), (data, {"c.pyc": b"\x00\x02"}), (data, {"c.pyc": b"\x00\x01\x00"}),
        (data, {}), ({**data, "c.pyc": "\x00\x01"}, {}),  # the same bytes as data, not binaryData
        ({"a1": "", "b": "two"}, binary),  # the same characters, split elsewhere
    ]
    assert len({first, *(injection.configmap_sha256(d, b) for d, b in others)}) == len(others) + 1
    assert injection.configmap_hash({}) == injection.configmap_hash({}, {}) != injection.configmap_hash({"": ""})


def test_another_cache_env_is_another_configmap_name() -> None:
    owner = {"name": "llama", "uid": "u-1"}
    names = {env_configmap(cache, "llama", "ml", owner)["metadata"]["name"]
             for cache in (spec("ReadOnly"), spec("ReadWrite"), spec("ReadOnly", prefix="other"))}
    assert len(names) == 3 and all(n.startswith("cachewarm-llama-env-") and len(n) == 30 for n in names)
    assert env_configmap(spec("ReadOnly"), "llama", "ml", owner) == env_configmap(spec("ReadOnly"), "llama", "ml", owner)


def test_body_sha256_reads_binary_data_as_base64_and_refuses_what_is_not() -> None:
    body = injection.cache_configmap("n", "llama", "ml", {"name": "llama", "uid": "u"}, {"a": "1"}, {"b": b"\xff"})
    assert body["binaryData"] == {"b": "/w=="}
    assert injection.body_sha256(body) == body["metadata"]["annotations"]["cachewarm.dev/content-sha256"]
    assert injection.body_sha256({**body, "binaryData": {"b": "/g=="}}) != injection.body_sha256(body)
    with pytest.raises(ValueError):
        injection.body_sha256({**body, "binaryData": {"b": "not base64!"}})
