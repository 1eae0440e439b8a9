"""What the operator sends to the cluster for a torch cache (spec.torch, issue 31): the
warmer Job of a CPU and a GPU pool, and a training pod's patch by init container and in
process: the torch env (no JAX cache env), the writable emptyDir at spec.torch.cacheDir,
the copier told where to extract."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from apitoken import given_api_token
from cachewarm.admission import admit as admission
from cachewarm.builders import injection
from cachewarm.builders import job as jb
from cachewarm.builders.reporting import Reporting
from cachewarm.api.model import CacheSpec, InvalidSpec, parse_spec

OWNER = {"name": "llama", "uid": "0000-1111"}
WARMER = "cachewarm/warmer:0.1.0"
ENV_CM, BOOT_CM = "cachewarm-llama-env-0123456789", "cachewarm-llama-boot-abcdef0123"
POOLS = [{"name": "cpu"}, {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]
MANIFESTS = {"cpu": "llama/.cachewarm/pools/team/llama/cpu/llama-cpu-1.json#1700000000000001",
             "h100": "llama/.cachewarm/pools/team/llama/h100/llama-h100-1.json#1700000000000002"}
# The names as the design spells them (written out, not read from the code under test).
TORCH_POD_ENV = {"CACHEWARM_FRAMEWORK": "torch", "TORCHINDUCTOR_CACHE_DIR": "/cachewarm-torch",
                 "TRITON_CACHE_DIR": "/cachewarm-torch/triton"}
TORCH_VOLUME = {"name": "cachewarm-torch", "emptyDir": {}}
JAX_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"}
TORCH_MOUNT = {"name": "cachewarm-torch", "mountPath": "/cachewarm-torch"}


def torch_spec(torch: dict[str, Any] | None = None, local: dict[str, Any] | None = None,
               **warmup: Any) -> dict[str, Any]:
    return {"storage": {"gcs": {"bucket": "team-cache", "location": "us-central1", "prefix": "llama"}},
            "torch": {} if torch is None else torch,
            "injection": {"mode": "ReadOnly", **({"localCopy": local} if local is not None else {})},
            "warmup": {"image": "train:1", "command": ["python", "train_torch.py", "--steps", "1"], "pools": POOLS,
                       **warmup}}


def build(spec: CacheSpec, pool: str) -> dict[str, Any]:
    assert spec.warmup is not None
    [chosen] = [p for p in spec.warmup.pools if p.name == pool]
    return jb.warmer_job(spec, cache_name="llama", namespace="team", pool=chosen, digest=jb.spec_hash(spec, chosen),
                         owner=OWNER, warmer_image=WARMER, generation=2)


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def no_jax_cache_env(container: dict[str, Any]) -> bool:
    return not [name for name in env(container) if name.startswith("JAX_")]


# --- the warmer Job -------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["cpu", "h100"])
def test_a_torch_warmer_job_gets_the_torch_env_and_its_directory_on_cpu_and_gpu_pools(pool: str) -> None:
    job = build(parse_spec(torch_spec()), pool)
    pod = job["spec"]["template"]["spec"]
    [warm] = pod["containers"]
    got = env(warm)
    assert {k: got[k] for k in TORCH_POD_ENV} == TORCH_POD_ENV
    assert got["CACHEWARM_CACHE_URL"] == "gs://team-cache/llama"
    assert got["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(4 * 2**30)  # the default, 4Gi
    assert got["CACHEWARM_MANIFEST"].startswith("gs://team-cache/llama/.cachewarm/pools/team/llama/")
    assert no_jax_cache_env(warm), got
    assert TORCH_MOUNT in warm["volumeMounts"]  # writable: no readOnly
    assert {"name": "cachewarm", "mountPath": "/cachewarm", "readOnly": True} in warm["volumeMounts"]
    assert TORCH_VOLUME in pod["volumes"]
    assert warm["command"][:4] == ["python", "/cachewarm/warm.py", "command", "--"]
    if pool == "h100":
        assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        assert warm["resources"]["limits"]["nvidia.com/gpu"] == "8"
    else:
        assert "nodeSelector" not in pod and "resources" not in warm


def test_a_torch_warmer_job_uses_the_specs_directory_and_archive_bound() -> None:
    job = build(parse_spec(torch_spec({"cacheDir": "/data/inductor", "maxArchiveSize": "500Mi"})), "cpu")
    [warm] = job["spec"]["template"]["spec"]["containers"]
    got = env(warm)
    assert (got["TORCHINDUCTOR_CACHE_DIR"], got["TRITON_CACHE_DIR"]) == ("/data/inductor", "/data/inductor/triton")
    assert got["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(500 * 2**20)
    assert {"name": "cachewarm-torch", "mountPath": "/data/inductor"} in warm["volumeMounts"]


def test_a_two_host_torch_pool_tells_each_warmer_its_process_index_and_no_jax_cache_env() -> None:
    """The torch warmer reads its process index where the JAX one does (process 0 alone
    uploads the archive); that is not a cache setting, and no JAX cache env comes with it."""
    spec = parse_spec(torch_spec(pools=[{"name": "h100x2", "hosts": 2,
                                         "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]))
    job = build(spec, "h100x2")
    [warm] = job["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in warm["env"]}
    assert {"JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS"} <= names
    assert not names & JAX_CACHE_ENV, names
    assert env(warm)["TORCHINDUCTOR_CACHE_DIR"] == "/cachewarm-torch" and job["spec"]["completions"] == 2


def test_a_tpu_pool_the_model_refuses_for_torch_does_not_crash_the_job_builder() -> None:
    """The CRD and the model refuse a torch cache with a TPU pool (torch_xla); a spec that
    got past them (model_copy does not validate) still builds a Job, as any pool's."""
    tpu = [{"name": "v5e", "tpu": {"type": "tpu-v5-lite-podslice", "topology": "2x4"}}]
    with pytest.raises(InvalidSpec, match="TPU"):
        parse_spec(torch_spec(pools=tpu))
    jax = parse_spec({k: v for k, v in torch_spec(pools=tpu).items() if k != "torch"})
    spec = jax.model_copy(update={"torch": parse_spec(torch_spec()).torch})
    [warm] = build(spec, "v5e")["spec"]["template"]["spec"]["containers"]
    assert env(warm)["CACHEWARM_FRAMEWORK"] == "torch" and TORCH_MOUNT in warm["volumeMounts"]


def test_the_torch_settings_enter_the_warmers_spec_hash() -> None:
    """Another directory is another key (it is the pods' TORCHINDUCTOR_CACHE_DIR too), and a
    torch cache's warm is not its JAX twin's."""
    torch = parse_spec(torch_spec())
    pool = torch.warmup.pools[0]  # type: ignore[union-attr]
    moved = parse_spec(torch_spec({"cacheDir": "/data/inductor"}))
    jax = parse_spec({k: v for k, v in torch_spec().items() if k != "torch"})
    hashes = {jb.spec_hash(spec, pool) for spec in (torch, moved, jax)}
    assert len(hashes) == 3


# --- the training pod -----------------------------------------------------------------------

def training_pod(*extra: dict[str, Any], own_env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    container = {"name": "train", "image": "train:1", "command": ["python", "train_torch.py"],
                 "env": [{"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs:9023"}, *(own_env or [])]}
    return {"metadata": {"name": "p", "namespace": "team", "labels": {"cachewarm.dev/cache": "llama"}},
            "spec": given_api_token({"containers": [container, *extra]})}


def admit(pod: dict[str, Any], spec: dict[str, Any], image_pythonpath: str | None) -> admission.Admission:
    """The webhook's answer; `image_pythonpath` None: the copy by init container, else in process."""
    entry = admission.index_entry(spec, generation=3, uid="uid-1", warmed=True, image_pythonpath=image_pythonpath,
                                  env_configmap=ENV_CM, boot_configmap=BOOT_CM, manifests=MANIFESTS)
    return admission.admit_pod(pod, lambda ns, name: entry if (ns, name) == ("team", "llama") else None,
                               Reporting(WARMER, "https://10.96.0.100/report/v1", "PEM"), WARMER)


def patched(pod: dict[str, Any], answer: admission.Admission) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["spec"].update(copy.deepcopy(answer.spec))
    out["metadata"].setdefault("annotations", {}).update(answer.annotations)
    return out


def assert_valid(spec: dict[str, Any]) -> None:
    """What the apiserver checks that a patch could break: volume names unique, and in each
    container env names and mount paths unique, every mount of a volume of the pod."""
    names = [v["name"] for v in spec["volumes"]]
    assert len(names) == len(set(names)), names
    for ct in [*spec["containers"], *(spec.get("initContainers") or [])]:
        paths = [m["mountPath"] for m in ct.get("volumeMounts") or []]
        assert len(paths) == len(set(paths)), (ct["name"], paths)
        env_names = [e["name"] for e in ct.get("env") or []]
        assert len(env_names) == len(set(env_names)), (ct["name"], env_names)
        assert all(m["name"] in names for m in ct.get("volumeMounts") or []), ct["name"]


def test_a_torch_pod_by_init_container_gets_the_torch_env_its_directory_and_a_copier_that_extracts_there() -> None:
    sidecar = {"name": "eval", "image": "other:2", "command": ["python", "eval.py"]}
    answer = admit(training_pod(sidecar), torch_spec(), image_pythonpath=None)
    spec = answer.spec
    assert_valid(spec)
    assert answer.warnings == []
    for ct in spec["containers"]:
        got = env(ct)
        assert {k: got[k] for k in TORCH_POD_ENV} == TORCH_POD_ENV, ct["name"]
        assert no_jax_cache_env(ct), (ct["name"], got)
        assert "CACHEWARM_CACHE_URL" not in got  # only the warmer uploads
        assert TORCH_MOUNT in ct["volumeMounts"], ct["name"]
    inits = {ct["name"]: ct for ct in spec["initContainers"]}
    copier = inits["cachewarm-copy"]
    got = env(copier)
    assert got["CACHEWARM_TORCH_DIR"] == "/cachewarm-torch"
    assert got["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(4 * 2**30)
    assert TORCH_MOUNT in copier["volumeMounts"]  # writable: it extracts there
    # The reporter's tools container compiles and extracts nothing.
    assert all(m["name"] != "cachewarm-torch" for m in inits["cachewarm-reporter"].get("volumeMounts") or [])
    assert TORCH_VOLUME in spec["volumes"]


def test_a_torch_pod_in_process_gets_the_copiers_torch_settings_in_its_taker() -> None:
    answer = admit(training_pod(), torch_spec(), image_pythonpath="/app")
    spec = answer.spec
    assert_valid(spec)
    assert not spec.get("initContainers"), spec.get("initContainers")
    [train] = spec["containers"]
    got = env(train)
    assert got["CACHEWARM_COPY_IN_PROCESS"] == "1" and got["PYTHONPATH"] == "/cachewarm-boot:/app"
    assert {k: got[k] for k in TORCH_POD_ENV} == TORCH_POD_ENV and no_jax_cache_env(train)
    assert got["CACHEWARM_TORCH_DIR"] == "/cachewarm-torch"
    assert got["CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"] == str(4 * 2**30)
    assert TORCH_MOUNT in train["volumeMounts"]
    assert TORCH_VOLUME in spec["volumes"]


@pytest.mark.parametrize("image_pythonpath", [None, "/app"], ids=["by-init-container", "in-process"])
def test_reinvocation_of_a_torch_pod_changes_nothing(image_pythonpath: str | None) -> None:
    pod = training_pod()
    once = patched(pod, admit(pod, torch_spec(), image_pythonpath))
    again = admit(once, torch_spec(), image_pythonpath)
    assert again.spec == {} and not again.injected and not again.warnings


def test_a_container_a_later_webhook_added_gets_the_torch_directory_on_reinvocation() -> None:
    pod = training_pod()
    once = patched(pod, admit(pod, torch_spec(), None))
    once["spec"]["containers"].append({"name": "eval", "image": "train:1"})
    again = admit(once, torch_spec(), None)
    assert_valid(again.spec)
    [train, evaluator] = again.spec["containers"]
    assert TORCH_MOUNT in evaluator["volumeMounts"] and env(evaluator)["TORCHINDUCTOR_CACHE_DIR"] == "/cachewarm-torch"
    assert [m["name"] for m in train["volumeMounts"]].count("cachewarm-torch") == 1


@pytest.mark.parametrize("image_pythonpath", [None, "/app"], ids=["by-init-container", "in-process"])
def test_a_pods_own_torchinductor_cache_dir_is_kept_and_said(image_pythonpath: str | None) -> None:
    pod = training_pod(own_env=[{"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/mine"}])
    answer = admit(pod, torch_spec(), image_pythonpath)
    [train] = answer.spec["containers"]
    got = env(train)
    assert got["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    assert [e["name"] for e in train["env"]].count("TORCHINDUCTOR_CACHE_DIR") == 1
    assert got["TRITON_CACHE_DIR"] == "/cachewarm-torch/triton"
    assert "cachewarm: container 'train' keeps its own TORCHINDUCTOR_CACHE_DIR; the value from CompilationCache " \
        "'llama' was not applied to it; torch reads only its own TORCHINDUCTOR_CACHE_DIR, so it compiles cold: the " \
        "copy seeds /cachewarm-torch, a directory torch does not read there" in answer.warnings
    assert answer.annotations["cachewarm.dev/injected"].endswith("; kept its own train/TORCHINDUCTOR_CACHE_DIR")


def test_a_pods_own_triton_cache_dir_is_said_to_compile_its_kernels_cold() -> None:
    pod = training_pod(own_env=[{"name": "TRITON_CACHE_DIR", "value": "/mine"}])
    answer = admit(pod, torch_spec(), None)
    assert any(w.startswith("cachewarm: container 'train' keeps its own TRITON_CACHE_DIR;") and
               w.endswith("so its Triton kernels compile cold: the copy seeds /cachewarm-torch/triton, a directory "
                          "torch does not read there") for w in answer.warnings)
    # Another variable of its own is only said kept: it takes nothing from the seeded directory.
    other = admit(training_pod(own_env=[{"name": "CACHEWARM_FRAMEWORK", "value": "jax"}]), torch_spec(), None)
    assert [w for w in other.warnings if "keeps its own" in w] == [
        "cachewarm: container 'train' keeps its own CACHEWARM_FRAMEWORK; the value from CompilationCache 'llama' was "
        "not applied to it"]


def test_a_container_that_mounts_its_own_volume_at_the_torch_directory_keeps_it() -> None:
    pod = training_pod()
    pod["spec"]["volumes"].append({"name": "mine", "emptyDir": {}})
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": "/cachewarm-torch/"}]
    answer = admit(pod, torch_spec(), None)
    assert_valid(answer.spec)
    [train] = answer.spec["containers"]
    assert [m["name"] for m in train["volumeMounts"] if m["mountPath"].rstrip("/") == "/cachewarm-torch"] == ["mine"]
    assert any("container 'train' mounts its own volume at the torch cache directory" in w for w in answer.warnings)
    # The copier still extracts into ours (the pod's other containers read it).
    copier = next(ct for ct in answer.spec["initContainers"] if ct["name"] == "cachewarm-copy")
    assert TORCH_MOUNT in copier["volumeMounts"] and TORCH_VOLUME in answer.spec["volumes"]


def test_a_pod_with_its_own_volume_named_like_ours_gets_no_torch_directory_and_is_told() -> None:
    pod = training_pod()
    pod["spec"]["volumes"].append({"name": "cachewarm-torch", "configMap": {"name": "mine"}})
    answer = admit(pod, torch_spec(), "/app")
    assert_valid(answer.spec)
    assert all(m["name"] != "cachewarm-torch" for m in answer.spec["containers"][0]["volumeMounts"])
    assert [v for v in answer.spec["volumes"] if v["name"] == "cachewarm-torch"] == \
        [{"name": "cachewarm-torch", "configMap": {"name": "mine"}}]
    assert any("has a volume of its own named cachewarm-torch" in w for w in answer.warnings)


def test_a_torch_pod_without_its_copy_gets_the_env_and_directory_and_is_told_it_starts_cold() -> None:
    entry = admission.index_entry(torch_spec(), generation=3, uid="uid-1", warmed=True, manifests={})
    answer = admission.admit_pod(training_pod(), lambda ns, name: entry, None, WARMER)
    [train] = answer.spec["containers"]
    assert {k: env(train)[k] for k in TORCH_POD_ENV} == TORCH_POD_ENV and no_jax_cache_env(train)
    assert TORCH_MOUNT in train["volumeMounts"] and TORCH_VOLUME in answer.spec["volumes"]
    assert not answer.spec.get("initContainers")
    assert answer.warnings == ["cachewarm: CompilationCache 'llama' gives pods a local copy by default, but this pod "
                               "starts with an empty torch cache directory (cold): no warmer of its pools (cpu) has "
                               "recorded a manifest yet, so its copy would be empty"]


def test_the_env_configmap_of_a_torch_cache_holds_the_torch_env() -> None:
    cm = injection.env_configmap(parse_spec(torch_spec()), "llama", "team", OWNER)
    assert cm["data"] == TORCH_POD_ENV


def test_a_jax_cache_gets_no_torch_env_nor_directory() -> None:
    jax = {k: v for k, v in torch_spec().items() if k != "torch"}
    answer = admit(training_pod(), jax, None)
    [train] = answer.spec["containers"]
    assert not {"CACHEWARM_FRAMEWORK", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"} & set(env(train))
    assert all(v["name"] != "cachewarm-torch" for v in answer.spec["volumes"])
    job = build(parse_spec(jax), "cpu")
    assert all(v["name"] != "cachewarm-torch" for v in job["spec"]["template"]["spec"]["volumes"])
