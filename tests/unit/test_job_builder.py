"""Warmer Jobs and Services for GPU, single-host and multi-host TPU pools, field by field."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.api import constants as c
from cachewarm.agents import warmer
from cachewarm.builders import job as jb
from cachewarm.builders import placement
from cachewarm.builders.tpu import TpuShapeError
from cachewarm.clients import kube
from cachewarm.api.model import CacheSpec, Pool, parse_spec

OWNER = {"name": "llama", "uid": "0000-1111"}


def cache(pools: list[dict[str, Any]], **warmup: Any) -> CacheSpec:
    return parse_spec({
        "storage": {"gcs": {"bucket": "team-cache", "prefix": "llama", "location": "us-central1"}},
        "jax": {"minCompileTimeSecs": 2},
        "warmup": {"image": "us-docker.pkg.dev/team/train:2026-11-20", "targets": ["train.warm:targets"],
                   "pools": pools, **warmup},
    })


def build(spec: CacheSpec, index: int = 0) -> dict[str, Any]:
    assert spec.warmup is not None
    pool = spec.warmup.pools[index]
    return jb.warmer_job(spec, cache_name="llama", namespace="ml", pool=pool, digest=jb.spec_hash(spec, pool),
                         owner=OWNER, warmer_image="cachewarm/warmer:0.1.0", generation=7)


def env(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_h100_pool() -> None:
    spec = cache([{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}],
                 env=[{"name": "XLA_FLAGS", "value": "--xla_gpu_enable_latency_hiding_scheduler=true"}])
    job = build(spec)
    meta, jspec = job["metadata"], job["spec"]
    pod = jspec["template"]["spec"]
    [container] = pod["containers"]
    assert meta["name"] == f"llama-h100-{jb.spec_hash(spec, spec.warmup.pools[0])}"  # type: ignore[union-attr]
    assert meta["namespace"] == "ml"
    assert meta["labels"] == {"app.kubernetes.io/managed-by": "cachewarm", "cachewarm.dev/warmer-for": "llama",
                              "cachewarm.dev/pool": "h100", "cachewarm.dev/spec-hash": meta["name"].rsplit("-", 1)[1]}
    assert "cachewarm.dev/cache" not in jspec["template"]["metadata"]["labels"]  # the webhook must not touch it
    assert meta["ownerReferences"] == [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                        "name": "llama", "uid": "0000-1111", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert (jspec["backoffLimit"], jspec["activeDeadlineSeconds"], jspec["ttlSecondsAfterFinished"]) == (1, 3600, 86400)
    assert (jspec["completions"], jspec["parallelism"]) == (1, 1)
    assert "completionMode" not in jspec
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}  # quantities are strings
    assert meta["annotations"] == {"cachewarm.dev/generation": "7"}
    assert container["image"] == "us-docker.pkg.dev/team/train:2026-11-20"
    assert container["command"] == ["python", "/cachewarm/warm.py", "targets", "--parallel=1", "train.warm:targets"]
    assert env(job) == {
        "JAX_COMPILATION_CACHE_DIR": "gs://team-cache/llama",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.0",  # the warmer writes every program (warmup.minCompileTimeSecs unset); jax.minCompileTimeSecs is the pods'
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
        "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true",
        "CACHEWARM_MANIFEST": f"gs://team-cache/llama/.cachewarm/pools/ml/llama/h100/{meta['name']}.json",
    }
    [init] = pod["initContainers"]
    assert init["image"] == "cachewarm/warmer:0.1.0"
    assert init["command"] == ["cp", "/opt/cachewarm/warm.py", "/cachewarm/warm.py"]
    assert pod["volumes"] == [{"name": "cachewarm", "emptyDir": {"sizeLimit": "16Mi"}}]
    assert container["volumeMounts"] == [{"name": "cachewarm", "mountPath": "/cachewarm", "readOnly": True}]


def test_tpu_v5p_pool() -> None:
    job = build(cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}}]))
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x1"}
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["resources"] == {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)
    assert "subdomain" not in pod and "completionMode" not in job["spec"]


def test_v5p_2x2x2_is_two_hosts_without_saying_hosts() -> None:
    spec = cache([{"name": "v5p16", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}])
    job = build(spec)
    name = job["metadata"]["name"]
    service = jb.service_name("llama", "v5p16")
    jspec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (jspec["completions"], jspec["parallelism"], jspec["completionMode"]) == (2, 2, "Indexed")
    assert pod["subdomain"] == service
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
    e = env(job)
    assert e["JAX_COORDINATOR_ADDRESS"] == f"{name}-0.{service}:8476"
    assert e["JAX_NUM_PROCESSES"] == "2"
    assert e["JAX_PROCESS_ID"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    svc = jb.headless_service("llama", "ml", spec.warmup.pools[0], OWNER)  # type: ignore[union-attr]
    assert svc["metadata"]["name"] == service
    assert svc["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "cachewarm",
                                         "cachewarm.dev/warmer-for": "llama", "cachewarm.dev/pool": "v5p16"}
    assert svc["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True,
                           "selector": {"cachewarm.dev/warmer-for": "llama", "cachewarm.dev/pool": "v5p16"},
                           "ports": [{"name": "coordinator", "port": 8476, "protocol": "TCP"}]}
    # The selector matches the pods' labels.
    assert svc["spec"]["selector"].items() <= jspec["template"]["metadata"]["labels"].items()


def test_service_name_is_per_pool_not_per_program_and_a_dns_label() -> None:
    a = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}])
    b = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}], image="other:2")
    assert build(a)["metadata"]["name"] != build(b)["metadata"]["name"]
    assert build(a)["spec"]["template"]["spec"]["subdomain"] == build(b)["spec"]["template"]["spec"]["subdomain"]
    assert jb.service_name("a-b", "c") != jb.service_name("a", "b-c")
    long = jb.service_name("1" + "x.y" * 17, "p" * 20)
    assert len(long) <= 63 and long[0].isalpha() and "." not in long


def test_tpu_shape_unknown_to_the_table_raises_with_the_known_topologies() -> None:
    spec = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "3x3x3"}}])
    with pytest.raises(TpuShapeError) as err:
        build(spec)
    assert err.value.reason == "UnknownTpuShape"
    assert "2x2x1, 2x2x2" in str(err.value)


def test_user_overrides_merge_over_derived_placement() -> None:
    pools = [{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8},
              "nodeSelector": {"cloud.google.com/gke-nodepool": "train-a"},
              "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
              "resources": {"requests": {"memory": "64Gi"}, "limits": {"nvidia.com/gpu": 4}}}]
    pod = build(cache(pools))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
                                   "cloud.google.com/gke-nodepool": "train-a"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert pod["containers"][0]["resources"] == {"requests": {"memory": "64Gi"}, "limits": {"nvidia.com/gpu": "4"}}


def test_user_quantities_become_strings() -> None:
    pools = [{"name": "cpu", "resources": {"requests": {"cpu": 8, "memory": "1Gi"}, "limits": {"cpu": 16}}}]
    container = build(cache(pools))["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "1Gi"}, "limits": {"cpu": "16"}}


def test_command_mode_runs_the_entrypoint_through_the_warmer() -> None:
    spec = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": {
        "image": "img", "command": ["python", "-m", "train", "--steps=1"], "python": "python3",
        "pools": [{"name": "cpu"}]}})
    container = build(spec)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python3", "/cachewarm/warm.py", "command", "--", "python", "-m", "train", "--steps=1"]


@pytest.mark.parametrize(("change", "same"), [
    ({"image": "us-docker.pkg.dev/team/train:2026-11-21"}, False),
    ({"targets": ["train.warm:other"]}, False),
    ({"env": [{"name": "XLA_FLAGS", "value": "--x"}]}, False),
    ({"backoffLimit": 3, "ttlSecondsAfterFinished": 10}, True),
    ({"serviceAccountName": "cache-writer"}, True),  # who writes is not what is compiled
])
def test_hash_changes_only_with_what_changes_the_program(change: dict[str, Any], same: bool) -> None:
    base = cache([{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}])
    other = cache([{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}], **change)
    pool: Pool = base.warmup.pools[0]  # type: ignore[union-attr]
    assert (jb.spec_hash(base, pool) == jb.spec_hash(other, pool)) is same


def test_hash_changes_with_jax_settings_accelerator_and_token() -> None:
    base = cache([{"name": "g", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}])
    pool: Pool = base.warmup.pools[0]  # type: ignore[union-attr]
    digest = jb.spec_hash(base, pool)
    bigger = cache([{"name": "g", "accelerator": {"type": "nvidia-h100-80gb", "count": 4}}])
    assert jb.spec_hash(bigger, bigger.warmup.pools[0]) != digest  # type: ignore[union-attr]
    assert jb.spec_hash(base, pool, token="manual-1") != digest


def test_a_local_copy_cache_is_warmed_again_for_a_trusted_manifest() -> None:
    # Issue 28: a local copy trusts only a manifest whose generation the warmer's own pod
    # reported; pools warmed before that get a new hash (one more warm). Caches without a
    # local copy keep theirs (no re-warm on upgrade).
    pools = [{"name": "g", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]
    default = cache(pools)
    plain = default.model_copy(update={"injection": default.injection.model_copy(update={"local_copy": None})})
    copied = plain.model_copy(update={"injection": plain.injection.model_copy(
        update={"local_copy": parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
                                          "injection": {"mode": "ReadOnly", "localCopy": {}}}).injection.local_copy})})
    pool: Pool = plain.warmup.pools[0]  # type: ignore[union-attr]
    # (That a cache without a local copy keeps the hash it had is pinned by the golden
    # snapshots, tests/golden/operator-*.json, whose specHash values predate issue 28.)
    assert jb.spec_hash(copied, pool) != jb.spec_hash(plain, pool)
    # Issue 30: the local copy is the default, so a cache that sets neither localCopy nor
    # readFrom is a local-copy cache: its pools are warmed again on upgrade (CHANGELOG).
    assert jb.spec_hash(default, pool) == jb.spec_hash(copied, pool)


@pytest.mark.parametrize(("pool", "hosts"), [
    ({}, 1),
    ({"hosts": 256}, 256),  # the CRD's maximum
    ({"tpu": {"type": "tpu-v4-podslice", "topology": "16x16x16"}}, 1024),
    ({"tpu": {"type": "tpu-v5p-slice", "topology": "16x16x24"}}, 1536),  # the table's largest
])
def test_job_name_leaves_room_for_indexed_pod_hostnames(pool: dict[str, Any], hosts: int) -> None:
    p = Pool.model_validate({"name": "a" * 20, **pool})
    assert placement.pool_shape(p).hosts == hosts
    name = jb.job_name("c" * 52, p, "0123456789")
    assert len(f"{name}-{hosts - 1}") <= 63
    # Up to 1000 hosts the name is what it always was (no re-warm on upgrade).
    assert name.startswith("c" * 27 + "-") if hosts <= 1000 else name.startswith("c" * 26 + "-")


def test_stating_the_derived_shape_does_not_change_the_hash() -> None:
    derived = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}])
    stated = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}, "hosts": 2,
                     "chipsPerHost": 4}])
    assert jb.spec_hash(derived, derived.warmup.pools[0]) == jb.spec_hash(stated, stated.warmup.pools[0])  # type: ignore[union-attr]


@pytest.mark.parametrize("pool", [
    {"name": "cpu", "resources": {"requests": {"cpu": 2}}},
    {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
    {"name": "v5e", "tpu": {"type": "tpu-v5-lite-podslice", "topology": "4x4"}},
    {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}},
], ids=["cpu", "gpu", "tpu-multi-host", "tpu-single-host"])
def test_builder_objects_are_what_the_typed_client_sends(pool: dict[str, Any]) -> None:
    # kube.typed builds the client's model and checks it serializes back unchanged: the
    # same validation create_namespaced_job runs on its arguments (tests/e2e sends them).
    spec = cache([pool])
    job = build(spec)
    assert kube.typed(job) is not None
    assert kube.typed(jb.headless_service("llama", "ml", spec.warmup.pools[0], OWNER)) is not None  # type: ignore[union-attr]


def test_the_typed_client_refuses_integer_quantities_and_unknown_fields() -> None:
    job = build(cache([{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]))
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 8
    with pytest.raises(kube.KubeError) as err:
        kube.typed(job)
    assert err.value.reason == "InvalidObject" and "nvidia.com/gpu" in str(err.value)
    job = build(cache([{"name": "cpu"}]))
    job["spec"]["template"]["spec"]["hostnam"] = "x"
    with pytest.raises(kube.KubeError, match="refused the object") as err:
        kube.typed(job)
    assert err.value.reason == "InvalidObject" and "spec.template.spec.hostnam" in str(err.value)


def test_a_multi_host_job_fails_on_the_first_pod_failure() -> None:
    # A retried host cannot rejoin a JAX runtime the others have left.
    multi = build(cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}], backoffLimit=3))
    gpus = build(cache([{"name": "h100x2", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}, "hosts": 2}],
                       backoffLimit=3))
    single = build(cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}}], backoffLimit=3))
    assert (multi["spec"]["backoffLimit"], gpus["spec"]["backoffLimit"]) == (0, 0)
    assert single["spec"]["backoffLimit"] == 3


def test_the_pods_of_a_multi_host_job_share_one_node_pool() -> None:
    job = build(cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}]))
    pod = job["spec"]["template"]["spec"]
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "cloud.google.com/gke-nodepool"
    selector = term["labelSelector"]["matchLabels"]
    # The Job's own pods, and only them: the first pod matches itself (so it may land
    # anywhere) and the spec hash tells this Job's pods from another program's.
    assert selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert selector["cachewarm.dev/spec-hash"] == job["metadata"]["labels"]["cachewarm.dev/spec-hash"]
    assert selector["cachewarm.dev/pool"] == "v5p" and selector["cachewarm.dev/warmer-for"] == "llama"
    assert "affinity" not in build(cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}}]))[
        "spec"]["template"]["spec"]


@pytest.mark.parametrize(("pool", "hosts", "per_host"), [
    # Stored while the CRD defaulted hosts to 1: the table's 2 hosts, not InvalidTpuShape.
    ({"hosts": 1}, 2, 4),
    # Where the table says 1 host, or does not know the slice, hosts: 1 is what it says.
    ({"tpu": {"type": "tpu-v6e-slice", "topology": "2x4"}, "hosts": 1}, 1, 8),
    ({"tpu": {"type": "tpu-v9-slice", "topology": "2x2x2"}, "hosts": 1}, 1, 8),
], ids=["legacy-default-on-multi-host", "single-host-slice", "unknown-slice"])
def test_a_stored_hosts_1_reads_as_derived_on_a_multi_host_slice(pool: dict[str, Any], hosts: int,
                                                                  per_host: int) -> None:
    p = Pool.model_validate({"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}, **pool})
    shape = placement.pool_shape(p)
    assert (shape.hosts, shape.chips_per_host) == (hosts, per_host)


def test_a_legacy_hosts_1_does_not_change_the_hash() -> None:
    derived = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}])
    legacy = cache([{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}, "hosts": 1}])
    assert jb.spec_hash(derived, derived.warmup.pools[0]) == jb.spec_hash(legacy, legacy.warmup.pools[0])  # type: ignore[union-attr]
    assert build(legacy)["spec"]["completions"] == 2


@pytest.mark.parametrize("override", [
    {"hosts": 1, "chipsPerHost": 4},  # stated together: a real contradiction
    {"hosts": 1, "chipsPerHost": 8},
    {"hosts": 3},
    {"hosts": 2, "chipsPerHost": 2},
])
def test_other_contradictions_stay_invalid(override: dict[str, int]) -> None:
    p = Pool.model_validate({"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}, **override})
    with pytest.raises(TpuShapeError) as err:
        placement.pool_shape(p)
    assert err.value.reason == "InvalidTpuShape"


def test_warmers_run_as_the_writer_identity_when_one_is_named() -> None:
    named = build(cache([{"name": "cpu"}], serviceAccountName="cache-writer"))
    assert named["spec"]["template"]["spec"]["serviceAccountName"] == "cache-writer"
    unnamed = build(cache([{"name": "cpu"}]))
    assert "serviceAccountName" not in unnamed["spec"]["template"]["spec"]  # the namespace's default
    kube.typed(named)  # the client takes it as built


def test_each_pools_warmer_is_told_where_its_manifest_goes() -> None:
    """CACHEWARM_MANIFEST: the object the local copy reads for this Job (per namespace,
    cache, pool and Job: a re-warm writes another, never over it), under the cache's
    prefix, or at the bucket root for a root cache; the warmer reads the same name. A
    user's value for it does not move it."""
    assert warmer.MANIFEST_ENV == c.ENV_MANIFEST == "CACHEWARM_MANIFEST"
    pools = [{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
             {"name": "v5p16", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}]
    spec = cache(pools, env=[{"name": "CACHEWARM_MANIFEST", "value": "gs://elsewhere/x.json"}])
    for index, pool in enumerate(("h100", "v5p16")):
        job = build(spec, index)
        names = [e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]]
        assert names.count("CACHEWARM_MANIFEST") == 1
        url = env(job)["CACHEWARM_MANIFEST"]
        name = job["metadata"]["name"]
        assert url == f"gs://team-cache/llama/.cachewarm/pools/ml/llama/{pool}/{name}.json"
        assert url == placement.manifest_url(spec.storage.gcs, "ml", "llama", pool, name)
        assert warmer.manifest_pool(url) == pool  # what the warmer writes into it
    root = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": {
        "image": "img", "targets": ["t:t"], "pools": [{"name": "cpu"}]}})
    built = build(root)
    assert env(built)["CACHEWARM_MANIFEST"] == f"gs://b-1/.cachewarm/pools/ml/llama/cpu/{built['metadata']['name']}.json"
    kube.typed(build(spec))
