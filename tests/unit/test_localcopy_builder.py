"""The local copy's part of the webhook's pod patch (builders/localcopy.py), pure: which
pools' manifests a pod gets, the volume, the copier init container, the mounts."""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import marshal
import subprocess
import sys
from typing import Any

import pytest

import apitoken
from apitoken import given_api_token

from cachewarm.admission import admit as admission
from cachewarm.reconcile import configmaps
from cachewarm.agents import payload
from cachewarm.builders import injection
from cachewarm.builders import localcopy as lc
from cachewarm.builders.reporting import Reporting
from cachewarm.api.model import parse_spec

POOLS = [
    {"name": "cpu"},
    {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
    {"name": "a100", "accelerator": {"type": "nvidia-tesla-a100", "count": 8}},
    {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}},
]
WARMER = "cachewarm/warmer:0.1.0"
# The ConfigMaps the operator verified (status.injection.configMaps), as the index has them.
ENV_CM, BOOT_CM = "cachewarm-llama-env-0123456789", "cachewarm-llama-boot-abcdef0123"

def m(pool: str, generation: str, job: str | None = None, cache: str = "llama") -> str:
    """`<object>#<generation>` of the manifest warmer Job `job` (default llama-<pool>-1)
    of `pool` wrote, as the index has it (status.warmup.pools[].manifestObject and
    manifestGeneration); written out, not computed by the code under test."""
    return f"llama/.cachewarm/pools/team/{cache}/{pool}/{job or f'llama-{pool}-1'}.json#{generation}"


# The manifest of each pool the operator recorded from its own warmers.
MANIFESTS = {"cpu": m("cpu", "1700000000000001"), "h100": m("h100", "1700000000000002"), "a100": m("a100", "3"),
             "v5p": m("v5p", "4")}


def cache_spec(local: dict[str, Any] | None = None, report: bool = True, pools: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
    injection: dict[str, Any] = {"mode": "ReadOnly", "report": report}
    if local is not None:
        injection["localCopy"] = local
    return {"storage": {"gcs": {"bucket": "team-cache", "location": "us-central1", "prefix": "llama"}},
            "injection": injection,
            "warmup": {"image": "train:1", "targets": ["train:targets"], "pools": pools if pools is not None else POOLS}}


def training_pod(**spec: Any) -> dict[str, Any]:
    container = {"name": "train", "image": "train:1", "command": ["python", "train.py"],
                 "env": [{"name": "STORAGE_EMULATOR_HOST", "value": "http://gcs:9023"}],
                 "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}
    # As the webhook gets it: the apiserver's ServiceAccount admission gave it its token.
    return {"metadata": {"name": "p", "namespace": "team", "labels": {"cachewarm.dev/cache": "llama"}},
            "spec": ({"containers": [container], **spec} if spec.get("automountServiceAccountToken") is False
                     else given_api_token({"containers": [container], **spec}))}


def admit(pod: dict[str, Any], spec: dict[str, Any], *, warmer: str | None = WARMER,
          reporting: bool = True, boot: str | None = BOOT_CM,
          manifests: dict[str, str] | None = None) -> admission.Admission:
    entry = admission.index_entry(spec, generation=3, uid="uid-1", warmed=True, env_configmap=ENV_CM,
                                  boot_configmap=boot, manifests=MANIFESTS if manifests is None else manifests)
    return admission.admit_pod(pod, lambda ns, name: entry if (ns, name) == ("team", "llama") else None,
                             Reporting(WARMER, "https://10.96.0.100/report/v1", "PEM") if reporting else None, warmer)


def patched(pod: dict[str, Any], answer: admission.Admission) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["spec"].update(copy.deepcopy(answer.spec))
    out["metadata"].setdefault("annotations", {}).update(answer.annotations)
    return out


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def pools_of(pod_spec: dict[str, Any]) -> list[str]:
    return lc.pools_for(pod_spec, parse_spec(cache_spec()).warmup.pools)  # type: ignore[union-attr]


@pytest.mark.parametrize(("pod_spec", "pools"), [
    pytest.param({"containers": [{"name": "c"}]}, ["cpu"], id="cpu-pod-cpu-pool"),
    pytest.param({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 8}}}],
                  "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}, ["h100"], id="gpu-selector"),
    pytest.param({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 8}}}]},
                 ["h100", "a100"], id="gpu-any-gpu-pool"),
    pytest.param({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 8}}}],
                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                      {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In",
                                             "values": ["nvidia-tesla-a100"]}]}]}}}}, ["a100"], id="gpu-affinity"),
    pytest.param({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 8}}}],
                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                      {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In",
                                             "values": ["nvidia-tesla-a100"]}]},
                      {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In",
                                             "values": ["nvidia-h100-80gb"]}]}]}}}}, ["h100", "a100"],
                 id="gpu-affinity-two-terms"),
    pytest.param({"containers": [{"name": "c", "resources": {"requests": {"google.com/tpu": 4},
                                                              "limits": {"google.com/tpu": 4}}}],
                  "nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2x1"}}, ["v5p"], id="tpu"),
    pytest.param({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 8}}}],
                  "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}, ["cpu", "h100", "a100", "v5p"],
                 id="no-pool-matches-every-pool"),
])
def test_the_copy_is_of_the_pools_whose_nodes_the_pod_can_run_on(pod_spec: dict[str, Any], pools: list[str]) -> None:
    assert pools_of(pod_spec) == pools


def test_a_pod_with_a_local_copy_reads_it_and_the_copier_gets_its_pools_manifests() -> None:
    pod = training_pod(nodeSelector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"})
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "8"
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox", "command": ["true"]}]
    answer = admit(pod, cache_spec({"sizeLimit": "20Gi", "workers": 8, "timeoutSeconds": 120}))
    spec = answer.spec
    assert answer.annotations["cachewarm.dev/injected"] == "llama (generation 3, ReadOnly, gs://team-cache/llama, local copy)"
    [train] = spec["containers"]
    assert env(train)["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert env(train)["CACHEWARM_LOCAL_COPY_SUMMARY"] == "/cachewarm-reporter/local-copy.json"
    assert {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True} in train["volumeMounts"]
    names = [c["name"] for c in spec["initContainers"]]
    # The reporter's copy first, then the copier (which also records the image's PYTHONPATH
    # in place of the reporter's recorder), then the pod's own (which reads the copy too).
    assert names == ["cachewarm-reporter", "cachewarm-copy", "fetch"]
    tools, copier, fetch = spec["initContainers"]
    assert tools["command"].count("/opt/cachewarm/busybox") == 1
    assert "/opt/cachewarm/cachewarm_copier.py" in tools["command"] and tools["command"][-1] == "/cachewarm-reporter"
    assert copier["image"] == "train:1" and copier["command"][-3:] == [
        "python", "/cachewarm-reporter/cachewarm_copier.py", "/cachewarm-reporter/image-pythonpath"]
    assert copier["command"][3].startswith('printf %s "$PYTHONPATH" > "$2"; ')
    assert copier["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}  # not the GPUs
    assert {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache"} in copier["volumeMounts"]
    got = env(copier)
    assert got["STORAGE_EMULATOR_HOST"] == "http://gcs:9023"  # the training container's env, as it reaches GCS
    assert got["CACHEWARM_COPY_MANIFESTS"] == "llama/.cachewarm/pools/team/llama/h100/llama-h100-1.json#1700000000000002"
    assert (got["CACHEWARM_COPY_BUCKET"], got["CACHEWARM_COPY_PREFIX"], got["CACHEWARM_COPY_DEST"]) == (
        "team-cache", "llama", "/cachewarm-cache")
    assert got["CACHEWARM_COPY_MAX_BYTES"] == str(int(20 * 2**30 * 0.9))
    assert (got["CACHEWARM_COPY_WORKERS"], got["CACHEWARM_COPY_DEADLINE_SECONDS"]) == ("8", "120")
    assert "JAX_COMPILATION_CACHE_DIR" not in got  # ours compile nothing
    assert env(fetch)["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True} in fetch["volumeMounts"]
    assert {"name": "cachewarm-cache", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]


@pytest.mark.parametrize(("local", "volume"), [
    pytest.param({"volume": "Ephemeral"},
                 {"ephemeral": {"volumeClaimTemplate": {
                     "metadata": {"labels": {"app.kubernetes.io/managed-by": "cachewarm"}},
                     "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}}},
                 id="Ephemeral-default-class"),
    pytest.param({}, {"emptyDir": {"sizeLimit": "10Gi"}}, id="EmptyDir"),
    # Withdrawn (D1): a cache stored with it gets an EmptyDir of its sizeLimit.
    pytest.param({"volume": "HostPath", "hostPath": "/mnt/disks/ssd0/jax", "sizeLimit": "30Gi"},
                 {"emptyDir": {"sizeLimit": "30Gi"}}, id="HostPath"),
    pytest.param({"volume": "Ephemeral", "sizeLimit": "50Gi", "storageClassName": "premium-rwo"},
                 {"ephemeral": {"volumeClaimTemplate": {
                     "metadata": {"labels": {"app.kubernetes.io/managed-by": "cachewarm"}},
                     "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}},
                              "storageClassName": "premium-rwo"}}}}, id="Ephemeral"),
])
def test_each_volume_kind(local: dict[str, Any], volume: dict[str, Any]) -> None:
    spec = admit(training_pod(), cache_spec(local)).spec
    assert {"name": "cachewarm-cache", **volume} in spec["volumes"]


def test_without_the_reporter_the_copier_still_gets_its_files_and_no_pythonpath_is_set() -> None:
    spec = admit(training_pod(), cache_spec({}, report=False)).spec
    tools, copier = spec["initContainers"]
    assert tools["name"] == "cachewarm-reporter" and tools["image"] == WARMER
    assert tools["command"] == ["cp", "/opt/cachewarm/cachewarm_copier.py", "/opt/cachewarm/busybox", "/cachewarm-reporter"]
    assert copier["name"] == "cachewarm-copy"
    [train] = spec["containers"]
    assert "PYTHONPATH" not in env(train) and "CACHEWARM_LOCAL_COPY_SUMMARY" not in env(train)
    assert {v["name"] for v in spec["volumes"]} == {"cachewarm-reporter", "cachewarm-cache", apitoken.VOLUME["name"]}


def test_without_a_warmer_image_the_pod_reads_the_bucket_and_is_told() -> None:
    answer = admit(training_pod(), cache_spec({}), warmer=None, reporting=False)
    assert env(answer.spec["containers"][0])["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert "initContainers" not in answer.spec
    assert any("local copy" in w for w in answer.warnings)


def test_a_windows_pod_reads_the_bucket() -> None:
    answer = admit(training_pod(os={"name": "windows"}), cache_spec({}))
    assert env(answer.spec["containers"][0])["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert "cachewarm-cache" not in {v["name"] for v in answer.spec.get("volumes") or []}


@pytest.mark.parametrize("report", [True, False])
@pytest.mark.parametrize("image_pythonpath", [None, "/app"], ids=["by-init-container", "in-process"])
def test_reinvocation_changes_nothing(report: bool, image_pythonpath: str | None) -> None:
    pod = training_pod()
    spec = cache_spec({}, report=report)
    once = patched(pod, admit_known(pod, spec, image_pythonpath))
    # The path this case is about was taken.
    assert ("cachewarm-copy" in [ct["name"] for ct in once["spec"].get("initContainers") or []]) is \
        (image_pythonpath is None)
    again = admit_known(once, spec, image_pythonpath)
    assert again.spec == {} and not again.injected and not again.warnings


def test_a_container_a_later_webhook_added_gets_the_copys_mount_on_reinvocation() -> None:
    """It got JAX_COMPILATION_CACHE_DIR=/cachewarm-cache from the env injection; without
    the mount that would be an empty directory of its own filesystem."""
    pod = training_pod()
    once = patched(pod, admit(pod, cache_spec({})))
    once["spec"]["containers"].append({"name": "eval", "image": "train:1", "command": ["python", "eval.py"]})
    again = admit(once, cache_spec({}))
    [train, evaluator] = again.spec["containers"]
    assert env(evaluator)["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True} in evaluator["volumeMounts"]
    assert [m["name"] for m in train["volumeMounts"]].count("cachewarm-cache") == 1
    copier = next(ct for ct in again.spec["initContainers"] if ct["name"] == "cachewarm-copy")
    assert [m["name"] for m in copier["volumeMounts"]].count("cachewarm-cache") == 1


def test_without_warmup_the_whole_prefix_is_copied() -> None:
    spec = cache_spec({})
    del spec["warmup"]
    copier = next(c for c in admit(training_pod(), spec).spec["initContainers"] if c["name"] == "cachewarm-copy")
    assert "CACHEWARM_COPY_MANIFESTS" not in env(copier)  # unset: the prefix, trusting the bucket's IAM
    assert copier["command"][4] == "python"


@pytest.mark.parametrize(("manifests", "expected"), [
    pytest.param({"cpu": m("cpu", "1"), "h100": m("h100", "2"), "a100": m("a100", "3"), "v5p": m("v5p", "4")},
                 "llama/.cachewarm/pools/team/llama/h100/llama-h100-1.json#2,"
                 "llama/.cachewarm/pools/team/llama/a100/llama-a100-1.json#3",
                 id="all-known"),
    pytest.param({"a100": m("a100", "3", job="llama-a100-77")}, "llama/.cachewarm/pools/team/llama/a100/llama-a100-77.json#3",
                 id="one-known"),
    pytest.param({"a100": "llama/.cachewarm/pools/team/llama/a100.json#3"},
                 "llama/.cachewarm/pools/team/llama/a100.json#3", id="legacy-object-per-pool"),
    pytest.param({"cpu": m("cpu", "1")}, "", id="another-pools-only"),  # set, empty: trusts nothing
    pytest.param({}, "", id="none-known"),
    pytest.param({"h100": m("h100", "2,x.json#9"), "a100": m("a100", "-3"), "v5p": m("v5p", "")}, "",
                 id="not-generations"),
    pytest.param({"h100": m("h100", "12345678901234567890"), "a100": m("a100", " 3")}, "", id="too-long-or-padded"),
    pytest.param({"h100": "2", "a100": "#3"}, "", id="no-object"),
    pytest.param({"h100": m("a100", "2"), "a100": m("a100", "3", cache="other")}, "", id="another-pools-or-caches-object"),
    pytest.param({"h100": "x/../llama/.cachewarm/pools/team/llama/h100/j.json#2",
                  "a100": "llama/.cachewarm/pools/team/llama/a100/j/k.json#3"}, "", id="not-a-warmers-name"),
])
def test_the_copier_trusts_only_the_manifests_the_operator_recorded_pinned_to_their_generation(
        manifests: dict[str, str], expected: str) -> None:
    """D3: a GPU pod (either GPU pool) gets `<object>#<generation>` for each of its pools
    whose manifest the operator recorded from its own warmers; with none, the variable
    set but empty (the copier copies nothing); anything that is not a decimal generation,
    or whose object is not a name this cache's warmers of that pool write, is left out,
    never passed on (a ',' or '#' would make another item)."""
    pod = training_pod()
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "8"
    for answer in (admit(pod, cache_spec({}), manifests=manifests),
                   admit_known(pod, cache_spec({}), manifests=manifests)):
        [holder] = [ct for ct in [*answer.spec["containers"], *answer.spec["initContainers"]]
                    if "CACHEWARM_COPY_BUCKET" in env(ct)]
        assert env(holder)["CACHEWARM_COPY_MANIFESTS"] == expected


def test_the_copier_runs_with_the_warmups_python() -> None:
    spec = cache_spec({})
    spec["warmup"]["python"] = "/opt/venv/bin/python3"
    copier = next(c for c in admit(training_pod(), spec).spec["initContainers"] if c["name"] == "cachewarm-copy")
    assert copier["command"][4] == "/opt/venv/bin/python3"


def test_an_emptydir_copy_stays_within_half_the_pods_ephemeral_storage_limits() -> None:
    """The kubelet evicts a pod whose emptyDirs and containers pass the sum of its
    containers' ephemeral-storage limits: the copy takes at most half of it."""
    pod = training_pod()
    pod["spec"]["containers"][0]["resources"]["limits"]["ephemeral-storage"] = "2Gi"
    copier = next(c for c in admit(pod, cache_spec({})).spec["initContainers"] if c["name"] == "cachewarm-copy")
    assert env(copier)["CACHEWARM_COPY_MAX_BYTES"] == str(2**30)
    # A sidecar without a limit: no pod-level limit, 90% of sizeLimit.
    pod["spec"]["containers"].append({"name": "side", "image": "side:1"})
    copier = next(c for c in admit(pod, cache_spec({})).spec["initContainers"] if c["name"] == "cachewarm-copy")
    assert env(copier)["CACHEWARM_COPY_MAX_BYTES"] == str(int(10 * 2**30 * 0.9))
    # An ephemeral claim is not the pod's ephemeral storage; a HostPath cache's copy (an
    # EmptyDir now) is.
    pod["spec"]["containers"].pop()
    for local, budget in (({"volume": "Ephemeral"}, int(10 * 2**30 * 0.9)),
                          ({"volume": "HostPath", "hostPath": "/mnt/ssd"}, 2**30)):
        copier = next(c for c in admit(pod, cache_spec(local)).spec["initContainers"] if c["name"] == "cachewarm-copy")
        assert env(copier)["CACHEWARM_COPY_MAX_BYTES"] == str(budget)


def test_the_copier_runs_the_pods_default_container_not_a_sidecar_listed_first() -> None:
    pod = training_pod()
    pod["spec"]["containers"].insert(0, {"name": "logs", "image": "fluent/fluent-bit:3",
                                         "resources": {"limits": {"memory": "64Mi"}}})
    pod["metadata"]["annotations"] = {"kubectl.kubernetes.io/default-container": "train"}
    copier = next(c for c in admit(pod, cache_spec({})).spec["initContainers"] if c["name"] == "cachewarm-copy")
    assert copier["image"] == "train:1" and copier["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}
    assert env(copier)["STORAGE_EMULATOR_HOST"] == "http://gcs:9023"


def test_envfrom_containers_read_the_bucket_from_the_configmap_which_never_names_the_local_dir() -> None:
    """The cache's ConfigMap serves envFrom containers of every pod, also of pods that got
    no copy (Windows, no warmer image): it names the bucket, never /cachewarm-cache."""
    from cachewarm.builders.injection import env_configmap  # noqa: PLC0415
    data = env_configmap(parse_spec(cache_spec({})), "llama", "team", {"name": "llama", "uid": "u"})["data"]
    assert data["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    pod = training_pod()
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "team"}}]
    [train] = admit(pod, cache_spec({})).spec["containers"]
    assert "JAX_COMPILATION_CACHE_DIR" not in env(train)
    assert train["envFrom"][0] == {"configMapRef": {"name": ENV_CM, "optional": True}}


def d7(user: int) -> dict[str, Any]:
    """The one securityContext of every init container we add (D7)."""
    return {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": user, "seccompProfile": {"type": "RuntimeDefault"},
            "readOnlyRootFilesystem": True}


@pytest.mark.parametrize(("pod_context", "container_context", "user"), [
    pytest.param({}, {"privileged": True}, 65532, id="privileged"),
    pytest.param({"runAsUser": 0}, {"capabilities": {"add": ["SYS_ADMIN"]}}, 65532, id="root-pod-sys-admin"),
    pytest.param({}, {"runAsUser": 0, "allowPrivilegeEscalation": True, "runAsNonRoot": False}, 65532, id="root"),
    pytest.param({"runAsUser": 1000, "runAsNonRoot": False}, {"privileged": True,
                 "seccompProfile": {"type": "Unconfined"}, "readOnlyRootFilesystem": False}, 1000, id="pod-user"),
    pytest.param({}, {"runAsUser": 1000, "runAsGroup": 0, "capabilities": {"add": ["SYS_RESOURCE"]},
                      "seLinuxOptions": {"type": "spc_t"}, "procMount": "Unmasked"}, 1000, id="container-user"),
])
@pytest.mark.parametrize("report", [True, False])
def test_every_init_container_we_add_has_the_fixed_restricted_context_never_the_training_containers(
        pod_context: dict[str, Any], container_context: dict[str, Any], user: int, report: bool) -> None:
    """D7: a TPU or GPU container may be privileged, root or add capabilities; the copy,
    the reporter's copy and its recorder need none of it, whatever the training container
    has: PodSecurity restricted, as its user where not root, else 65532."""
    pod = training_pod(securityContext=pod_context)
    pod["spec"]["containers"][0]["securityContext"] = container_context
    # The copier in place of the recorder; then a recorder of its own, for a second container
    # of another image (the main one's PYTHONPATH, from a reference, keeps the reporter off it).
    sidecar = {"name": "eval", "image": "eval:1", "securityContext": container_context}
    for more in ([], [sidecar]):
        pod["spec"]["containers"] += more
        if more:
            pod["spec"]["containers"][0]["env"].append(
                {"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "e", "key": "p"}}})
        init = admit(pod, cache_spec({}, report=report), reporting=report).spec["initContainers"]
        assert {ct["name"] for ct in init} >= {"cachewarm-reporter", "cachewarm-copy"}
        assert all(ct["securityContext"] == d7(user) for ct in init), [ct["securityContext"] for ct in init]
    assert "cachewarm-pythonpath" in {ct["name"] for ct in init} or not report


@pytest.mark.parametrize(("change", "folded"), [
    pytest.param(lambda ct: None, True, id="same-image-no-own-pythonpath"),
    # (A literal one of its own gets the copy in process: test_a_pod_that_sets_its_own_pythonpath_...)
    pytest.param(lambda ct: ct["env"].append({"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {
        "name": "team-env", "key": "path"}}}), False, id="own-pythonpath"),
    pytest.param(lambda ct: ct.update(envFrom=[{"configMapRef": {"name": "team-env"}}]), False, id="envFrom"),
])
def test_the_copier_records_the_images_pythonpath_in_place_of_the_recorder_only_when_it_sees_the_images(
        change: Any, folded: bool) -> None:
    """The copier's env is the main container's: where that sets PYTHONPATH (or may, through
    envFrom), the copier would record the spec's value, not the image's, so the reporter's
    recorder stays."""
    pod = training_pod()
    change(pod["spec"]["containers"][0])
    # A second container of the same image takes the reporter where the first cannot.
    pod["spec"]["containers"].append({"name": "side", "image": "train:1", "command": ["python", "side.py"]})
    spec = admit(pod, cache_spec({})).spec
    names = [ct["name"] for ct in spec["initContainers"]]
    copier = next(ct for ct in spec["initContainers"] if ct["name"] == "cachewarm-copy")
    assert ("cachewarm-pythonpath" not in names) is folded, names
    assert ("/cachewarm-reporter/image-pythonpath" in copier["command"]) is folded


def test_reinvocation_resyncs_a_folded_copiers_resources_with_the_training_container() -> None:
    """A later webhook (VPA's) lowers the training container's memory: on reinvocation the
    copier, which records for the reporter here, follows it as the recorder would."""
    pod = training_pod()
    once = patched(pod, admit(pod, cache_spec({})))
    assert [ct["name"] for ct in once["spec"]["initContainers"]] == ["cachewarm-reporter", "cachewarm-copy"]
    once["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2", "memory": "4Gi"}}
    again = admit(once, cache_spec({})).spec
    copier = next(ct for ct in again["initContainers"] if ct["name"] == "cachewarm-copy")
    assert copier["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}}


@pytest.mark.parametrize("in_process", [False, True])
def test_a_hostpath_cache_gets_each_pod_its_own_emptydir_copy_and_says_why(in_process: bool) -> None:
    """D1: no copy shared between pods. A cache stored with HostPath (the CRD refuses it in
    new or changed specs) gets an EmptyDir of its sizeLimit, mounted read-only in every
    container of the pod's own; the webhook says why. No hostPath, no subPath anywhere."""
    pod = training_pod()
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox", "command": ["true"]}]
    spec = cache_spec({"volume": "HostPath", "hostPath": "/mnt/disks/ssd0/jax", "sizeLimit": "30Gi"})
    answer = admit_known(pod, spec) if in_process else admit(pod, spec)
    assert any("HostPath local copy, which is no longer served" in w and "another pod reads" in w and "30Gi" in w
               for w in answer.warnings), answer.warnings
    assert "hostPath" not in json.dumps(answer.spec) and "subPath" not in json.dumps(answer.spec)
    assert {"name": "cachewarm-cache", "emptyDir": {"sizeLimit": "30Gi"}} in answer.spec["volumes"]
    ours = ("cachewarm-reporter", "cachewarm-copy")
    for ct in [*answer.spec["containers"], *answer.spec["initContainers"]]:
        for m in ct.get("volumeMounts") or []:
            if m["name"] == "cachewarm-cache" and ct["name"] not in ours and m["mountPath"] != "/cachewarm-copy":
                assert m["readOnly"] is True, ct["name"]
    assert not any("HostPath" in w for w in admit(pod, cache_spec({"sizeLimit": "30Gi"})).warnings)


def test_the_copier_mounts_only_the_ready_volumes_that_hold_the_cas_the_main_container_names() -> None:
    """The copier runs before the pod's own init containers and sidecars: only mounts of
    volumes the kubelet fills (by subPath too: what it names is there), holding what
    REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE or SSL_CERT_* name, or OpenSSL's default bundle."""
    pod = training_pod(volumes=[{"name": "proxy-ca", "configMap": {"name": "proxy-ca"}},
                                {"name": "more-cas", "secret": {"secretName": "more-cas"}},
                                {"name": "rendered", "emptyDir": {}},
                                {"name": "one-ca", "configMap": {"name": "one-ca"}},
                                {"name": "shared", "hostPath": {"path": "/mnt/shared"}},
                                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                                {"name": "trust", "configMap": {"name": "trust-bundle"}},
                                {"name": "rendered-bundle", "emptyDir": {}}])
    train = pod["spec"]["containers"][0]
    train["env"] += [{"name": "REQUESTS_CA_BUNDLE", "value": "/etc/proxy-ca/ca.pem"},
                     {"name": "SSL_CERT_DIR", "value": "/etc/more-cas"},
                     {"name": "CURL_CA_BUNDLE", "value": "/etc/rendered/ca.pem"},
                     {"name": "SSL_CERT_FILE", "value": "/etc/one/ca.pem"}]
    train["volumeMounts"] = [
        {"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "mountPropagation": "HostToContainer"},
        {"name": "more-cas", "mountPath": "/etc/more-cas/"},
        {"name": "rendered", "mountPath": "/etc/rendered"},  # an init container of the pod's fills it
        {"name": "one-ca", "mountPath": "/etc/one/ca.pem", "subPath": "ca.pem"},
        {"name": "shared", "mountPath": "/etc/proxy-ca-not", "mountPropagation": "Bidirectional"},
        {"name": "data", "mountPath": "/data"},
        # trust-manager's bundle over the system's, no env naming it
        {"name": "trust", "mountPath": "/etc/ssl/certs/ca-certificates.crt", "subPath": "ca-certificates.crt"},
        # the same from a volume an init container of the pod's fills: not the copier's
        {"name": "rendered-bundle", "mountPath": "/etc/pki/tls/certs/ca-bundle.crt", "subPath": "ca-bundle.crt"}]
    spec = admit(pod, cache_spec({})).spec
    copier = next(ct for ct in spec["initContainers"] if ct["name"] == "cachewarm-copy")
    theirs = [m for m in copier["volumeMounts"] if m["name"] not in ("cachewarm-cache", "cachewarm-reporter")]
    assert theirs == [
        {"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "mountPropagation": "HostToContainer", "readOnly": True},
        {"name": "more-cas", "mountPath": "/etc/more-cas/", "readOnly": True},
        {"name": "one-ca", "mountPath": "/etc/one/ca.pem", "subPath": "ca.pem", "readOnly": True},
        {"name": "trust", "mountPath": "/etc/ssl/certs/ca-certificates.crt", "subPath": "ca-certificates.crt",
         "readOnly": True}]
    assert env(copier)["REQUESTS_CA_BUNDLE"] == "/etc/proxy-ca/ca.pem"


def test_reinvocation_gives_the_copier_the_main_containers_resources_not_the_first_containers() -> None:
    """The default-container annotation names the second container; a reinvocation that
    changes nothing leaves the copier as it was, and one after a later webhook lowered the
    main container's memory gives the copier that."""
    pod = training_pod()
    pod["metadata"]["annotations"] = {"kubectl.kubernetes.io/default-container": "main"}
    pod["spec"]["containers"].insert(0, {"name": "proxy", "image": "train:1", "command": ["python", "proxy.py"],
                                         "resources": {"limits": {"cpu": "100m", "memory": "128Mi"}}})
    pod["spec"]["containers"][1]["name"] = "main"
    once = patched(pod, admit(pod, cache_spec({})))
    copier = next(ct for ct in once["spec"]["initContainers"] if ct["name"] == "cachewarm-copy")
    assert copier["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}
    again = admit(once, cache_spec({}))
    assert again.spec == {} and not again.injected  # nothing to follow: no patch
    once["spec"]["containers"][1]["resources"] = {"limits": {"cpu": "4", "memory": "6Gi"}}
    lowered = admit(once, cache_spec({})).spec
    copier = next(ct for ct in lowered["initContainers"] if ct["name"] == "cachewarm-copy")
    assert copier["resources"] == {"limits": {"cpu": "4", "memory": "6Gi"}}


def test_reinvocation_leaves_a_container_that_mounts_something_else_at_the_copys_path() -> None:
    pod = training_pod()
    once = patched(pod, admit(pod, cache_spec({})))
    once["spec"]["containers"].append({"name": "eval", "image": "train:1",
                                       "volumeMounts": [{"name": "other", "mountPath": "/cachewarm-cache/"}]})
    again = admit(once, cache_spec({})).spec
    evaluator = next(ct for ct in again["containers"] if ct["name"] == "eval")
    assert [m["name"] for m in evaluator["volumeMounts"]] == ["other"]


def test_a_pod_with_its_own_volume_named_like_ours_reads_the_bucket_and_is_told() -> None:
    pod = training_pod(volumes=[{"name": "cachewarm-cache", "emptyDir": {}}])
    answer = admit(pod, cache_spec({}))
    spec = answer.spec
    assert all(ct["name"] != "cachewarm-copy" for ct in spec.get("initContainers") or [])
    assert all(m["name"] != "cachewarm-cache" for ct in spec["containers"] for m in ct.get("volumeMounts") or [])
    assert env(spec["containers"][0])["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert any("named cachewarm-cache" in w for w in answer.warnings)


def test_reinvocation_keeps_the_copier_on_the_main_container_when_a_sidecar_is_put_first() -> None:
    """No default-container annotation: a later webhook's sidecar (another image) put
    first does not hand the copier its small resources."""
    pod = training_pod()
    once = patched(pod, admit(pod, cache_spec({})))
    once["spec"]["containers"].insert(0, {"name": "mesh-proxy", "image": "proxy:1",
                                          "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}}})
    again = admit(once, cache_spec({})).spec
    # (a patch all the same: the sidecar gets the copy's mount)
    copier = next(ct for ct in again["initContainers"] if ct["name"] == "cachewarm-copy")
    assert copier["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}


def test_without_the_reporter_reinvocation_resyncs_the_copy_container_too() -> None:
    pod = training_pod()
    once = patched(pod, admit(pod, cache_spec({}, report=False)))
    once["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "2Gi"}}
    again = admit(once, cache_spec({}, report=False)).spec
    assert {ct["name"]: ct["resources"] for ct in again["initContainers"]} == {
        "cachewarm-reporter": {"limits": {"cpu": "1", "memory": "2Gi"}},
        "cachewarm-copy": {"limits": {"cpu": "1", "memory": "2Gi"}}}


@pytest.mark.parametrize("clash", [
    pytest.param({"volumes": [{"name": "cachewarm-reporter", "emptyDir": {}}]}, id="own-volume-named-like-the-tools"),
    pytest.param({"volumes": [{"name": "scratch", "emptyDir": {}}],
                  "mounts": [{"name": "scratch", "mountPath": "/cachewarm-cache"}]}, id="own-mount-at-the-copys-path"),
])
def test_a_pod_whose_own_volumes_clash_with_ours_reads_the_bucket(clash: dict[str, Any]) -> None:
    pod = training_pod(volumes=clash["volumes"])
    if "mounts" in clash:
        pod["spec"]["containers"][0]["volumeMounts"] = clash["mounts"]
    answer = admit(pod, cache_spec({}, report=False))
    assert env(answer.spec["containers"][0])["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert all(ct["name"] != "cachewarm-copy" for ct in answer.spec.get("initContainers") or [])


# --- in process: no init container ---------------------------------------------------------

def admit_known(pod: dict[str, Any], spec: dict[str, Any], image_pythonpath: str | None = "/app", *,
                reporting: bool = True, boot: str | None = BOOT_CM,
                manifests: dict[str, str] | None = None) -> admission.Admission:
    """admit, with the warmers having reported the warmup image's PYTHONPATH."""
    entry = admission.index_entry(spec, generation=3, uid="uid-1", warmed=True, image_pythonpath=image_pythonpath,
                                  env_configmap=ENV_CM, boot_configmap=boot,
                                  manifests=MANIFESTS if manifests is None else manifests)
    return admission.admit_pod(pod, lambda ns, name: entry if (ns, name) == ("team", "llama") else None,
                             Reporting(WARMER, "https://10.96.0.100/report/v1", "PEM") if reporting else None, WARMER)


def assert_valid(spec: dict[str, Any]) -> None:
    """What the apiserver checks that a patch could break: volume names unique in the pod,
    and in each container env names and mount paths unique."""
    names = [v["name"] for v in spec["volumes"]]
    assert len(names) == len(set(names)), names
    for ct in [*spec["containers"], *(spec.get("initContainers") or [])]:
        paths = [m["mountPath"] for m in ct.get("volumeMounts") or []]
        assert len(paths) == len(set(paths)), (ct["name"], paths)
        env_names = [e["name"] for e in ct.get("env") or []]
        assert len(env_names) == len(set(env_names)), (ct["name"], env_names)
        assert all(m["name"] in names for m in ct.get("volumeMounts") or []), ct["name"]


def test_with_the_images_pythonpath_reported_the_copy_and_the_reporter_run_in_process_without_init_containers() -> None:
    pod = training_pod()
    pod["spec"]["containers"][0]["env"] += [{"name": "CACHEWARM_COPY_DEST", "value": "/mine"},
                                            {"name": "PYTHONPATH_EXTRA", "value": "x"}]
    answer = admit_known(pod, cache_spec({}))
    assert_valid(answer.spec)
    assert not answer.spec.get("initContainers"), answer.spec.get("initContainers")
    [train] = answer.spec["containers"]
    got = env(train)
    # Ours first, then the image's own, which the warmers reported: nothing to restore.
    assert got["PYTHONPATH"] == "/cachewarm-boot:/app" and "CACHEWARM_RESTORE_IMAGE_PYTHONPATH" not in got
    assert got["CACHEWARM_COPY_IN_PROCESS"] == "1" and got["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert got["CACHEWARM_COPY_DEST"] == "/cachewarm-copy" and got["CACHEWARM_COPY_BUCKET"] == "team-cache"
    assert got["CACHEWARM_COPY_MANIFESTS"].split(",")[0] == "llama/.cachewarm/pools/team/llama/cpu/llama-cpu-1.json#1700000000000001"
    assert got["CACHEWARM_COPY_SUMMARY"] == got["CACHEWARM_LOCAL_COPY_SUMMARY"] == "/cachewarm-reporter/local-copy.json"
    assert got["CACHEWARM_REPORT_URL"] == "https://10.96.0.100/report/v1"
    assert got["STORAGE_EMULATOR_HOST"] == "http://gcs:9023"  # the pod's own env, which the copy uses as it runs
    mounts = {m["mountPath"]: m for m in train["volumeMounts"]}
    assert mounts["/cachewarm-boot"] == {"name": "cachewarm-boot", "mountPath": "/cachewarm-boot", "readOnly": True}
    # It writes the copy and its summary itself, the copy where the copier writes; JAX's
    # directory, the same volume, stays read-only.
    assert mounts["/cachewarm-copy"] == {"name": "cachewarm-cache", "mountPath": "/cachewarm-copy"}
    assert mounts["/cachewarm-cache"] == {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True}
    assert mounts["/cachewarm-reporter"] == {"name": "cachewarm-reporter", "mountPath": "/cachewarm-reporter"}
    assert mounts["/var/run/secrets/cachewarm"]["readOnly"] is True
    volumes = {v["name"]: v for v in answer.spec["volumes"]}
    tag = sys.implementation.cache_tag
    assert volumes["cachewarm-boot"] == {"name": "cachewarm-boot", "configMap": {
        "name": BOOT_CM, "optional": True,
        "items": [*({"key": k, "path": k} for k in lc.BOOT_FILES),
                  *({"key": f"{k[:-3]}.{tag}.pyc", "path": f"__pycache__/{k[:-3]}.{tag}.pyc"} for k in lc.BOOT_FILES)]}}
    assert volumes["cachewarm-cache"] == {"name": "cachewarm-cache", "emptyDir": {"sizeLimit": "10Gi"}}
    assert "emptyDir" in volumes["cachewarm-reporter"] and "projected" in volumes["cachewarm-report-token"]


def test_an_image_that_sets_no_pythonpath_gets_ours_alone() -> None:
    [train] = admit_known(training_pod(), cache_spec({}), image_pythonpath="").spec["containers"]
    assert env(train)["PYTHONPATH"] == "/cachewarm-boot"


def test_a_pod_that_sets_its_own_pythonpath_copies_in_process_whatever_its_image(
) -> None:
    """Its own value replaced the image's anyway: ours goes in front of it, in place."""
    pod = training_pod()
    pod["spec"]["containers"][0]["image"] = "another:2"
    pod["spec"]["containers"][0]["env"] = [{"name": "SRC", "value": "/src"}, {"name": "PYTHONPATH", "value": "$(SRC)"},
                                           {"name": "AFTER", "value": "1"}]
    answer = admit_known(pod, cache_spec({}), image_pythonpath=None)
    assert not answer.spec.get("initContainers")
    [train] = answer.spec["containers"]
    assert [e["name"] for e in train["env"]][:3] == ["SRC", "PYTHONPATH", "AFTER"]
    assert env(train)["PYTHONPATH"] == "/cachewarm-boot:$(SRC)"


@pytest.mark.parametrize("change, image_pythonpath", [
    ({}, None),  # the warmers reported nothing (not warmed yet, or spec.warmup.env sets PYTHONPATH)
    ({"image": "another:2"}, "/app"),  # reported, but of the warmup's image, not this one
    ({"envFrom": [{"configMapRef": {"name": "settings"}}]}, "/app"),  # may set PYTHONPATH
    ({"env": [{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "s", "key": "p"}}}]}, "/app"),
])
def test_where_the_pythonpath_cannot_be_known_the_copy_is_by_init_container(
        change: dict[str, Any], image_pythonpath: str | None) -> None:
    pod = training_pod()
    pod["spec"]["containers"][0].update(change)
    answer = admit_known(pod, cache_spec({}), image_pythonpath=image_pythonpath)
    assert "cachewarm-copy" in [ct["name"] for ct in answer.spec["initContainers"]]
    assert not any(v["name"] == "cachewarm-boot" for v in answer.spec["volumes"])
    [train] = answer.spec["containers"]
    assert "CACHEWARM_COPY_IN_PROCESS" not in env(train)


def test_in_process_only_the_main_containers_image_copies_the_others_and_init_containers_read() -> None:
    """The copy runs with the main container's image, env and resources, as the copier
    init container did: not in the pod's own init container (its limits may be small), nor
    in a sidecar of another image even if it sets its own PYTHONPATH."""
    pod = training_pod(initContainers=[{"name": "prepare", "image": "train:1", "command": ["python", "prep.py"]}])
    pod["spec"]["containers"].append({"name": "proxy", "image": "envoy:1",
                                      "env": [{"name": "PYTHONPATH", "value": "/envoy"}]})
    pod["spec"]["containers"].append({"name": "eval", "image": "train:1", "command": ["python", "eval.py"]})
    answer = admit_known(pod, cache_spec({}))
    read_only = {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True}
    [prepare] = answer.spec["initContainers"]  # the pod's own, and nothing of ours
    assert "CACHEWARM_COPY_IN_PROCESS" not in env(prepare) and prepare["volumeMounts"] == [apitoken.MOUNT, read_only]
    assert_valid(answer.spec)
    train, proxy, evaluator = answer.spec["containers"]
    assert env(proxy)["PYTHONPATH"] == "/envoy" and "CACHEWARM_COPY_IN_PROCESS" not in env(proxy)
    assert proxy["volumeMounts"] == [read_only]
    for taker in (train, evaluator):
        assert env(taker)["PYTHONPATH"] == "/cachewarm-boot:/app" and env(taker)["CACHEWARM_COPY_IN_PROCESS"] == "1"


@pytest.mark.parametrize(("probe", "kind"), [
    ("startupProbe", "httpGet"), ("livenessProbe", "tcpSocket"), ("livenessProbe", "exec"), ("readinessProbe", "exec")])
def test_a_main_container_with_a_probe_that_would_count_the_copy_gets_it_by_init_container(probe: str, kind: str) -> None:
    """Liveness and startup probes would count the copy's time against the container (up
    to timeoutSeconds), and a readiness probe that starts python would wait for it: the
    copier init container's time was never counted."""
    pod = training_pod()
    pod["spec"]["containers"][0][probe] = {kind: {"command": ["python", "-c", "import health"]} if kind == "exec"
                                           else {"port": 8080}}
    answer = admit_known(pod, cache_spec({}))
    assert "cachewarm-copy" in [ct["name"] for ct in answer.spec["initContainers"]]


def test_a_readiness_probe_that_starts_no_process_keeps_the_copy_in_process() -> None:
    pod = training_pod()
    pod["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": 8080}}
    assert not admit_known(pod, cache_spec({})).spec.get("initContainers")


def test_in_process_without_the_reporter_there_is_no_report_env_nor_token() -> None:
    answer = admit_known(training_pod(), cache_spec({}, report=False))
    [train] = answer.spec["containers"]
    assert "CACHEWARM_REPORT_URL" not in env(train) and "CACHEWARM_LOCAL_COPY_SUMMARY" not in env(train)
    assert env(train)["CACHEWARM_COPY_IN_PROCESS"] == "1" and env(train)["PYTHONPATH"] == "/cachewarm-boot:/app"
    assert "cachewarm-report-token" not in {v["name"] for v in answer.spec["volumes"]}
    assert not answer.spec.get("initContainers")


def test_in_process_the_copy_is_read_only_for_jax_and_writable_only_at_the_copiers_path() -> None:
    answer = admit_known(training_pod(), cache_spec({}))
    mounts = [m for m in answer.spec["containers"][0]["volumeMounts"] if m["name"] == "cachewarm-cache"]
    assert mounts == [{"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True},
                      {"name": "cachewarm-cache", "mountPath": "/cachewarm-copy"}]


def test_in_process_a_container_a_later_webhook_added_reads_the_copy_and_no_init_container_appears() -> None:
    pod = training_pod()
    once = patched(pod, admit_known(pod, cache_spec({})))
    once["spec"]["containers"].append({"name": "eval", "image": "other:1", "command": ["python", "eval.py"]})
    again = admit_known(once, cache_spec({}))
    assert_valid({**once["spec"], **again.spec})
    [train, evaluator] = again.spec["containers"]
    assert env(evaluator)["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert {"name": "cachewarm-cache", "mountPath": "/cachewarm-cache", "readOnly": True} in evaluator["volumeMounts"]
    assert [m["mountPath"] for m in train["volumeMounts"]].count("/cachewarm-cache") == 1
    assert not again.spec.get("initContainers")


@pytest.mark.parametrize("clash", [
    {"volumes": [{"name": "cachewarm-boot", "emptyDir": {}}]},
    {"volumes": [{"name": "cachewarm-boot", "configMap": {"name": "team-boot"}}]},
    {"volumes": [{"name": "cachewarm-report-token", "emptyDir": {}}]},
    {"mount": "/cachewarm-boot"}, {"mount": "/cachewarm-copy"}, {"mount": "/cachewarm-reporter"},
    {"mount": "/var/run/secrets/cachewarm"},
])
def test_a_pods_own_volume_or_mount_where_the_in_process_copy_goes_is_never_taken_for_ours(
        clash: dict[str, Any]) -> None:
    """Else the pod would have two volumes or mounts of one name or path, which the
    apiserver refuses: the pod reads the bucket, and is told."""
    pod = training_pod(volumes=clash.get("volumes", [{"name": "mine", "emptyDir": {}}]))
    if "mount" in clash:
        pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": clash["mount"]}]
    answer = admit_known(pod, cache_spec({}))
    assert not lc.in_process(pod["spec"])
    assert any("asks for a local copy, which this pod cannot get" in w for w in answer.warnings), answer.warnings
    [train] = answer.spec["containers"]
    assert env(train)["JAX_COMPILATION_CACHE_DIR"] == "gs://team-cache/llama"
    assert "CACHEWARM_COPY_IN_PROCESS" not in env(train)
    assert_valid({**pod["spec"], **answer.spec})  # nor does the reporter add what clashes


def test_the_boot_configmap_ships_the_packages_own_modules_under_the_shipped_names() -> None:
    from pathlib import Path

    import cachewarm

    files = configmaps.boot_files()
    assert sorted(files) == sorted(lc.BOOT_FILES)
    package = Path(cachewarm.__file__).parent / "agents"
    for shipped, module in payload.MODULES.items():
        assert files[shipped] == (package / module).read_text(encoding="utf-8")
    bytecode = configmaps.boot_bytecode_files()
    body = lc.boot_configmap("llama", "team", {"name": "llama", "uid": "u1"}, files, bytecode)
    h = injection.configmap_hash(files, bytecode)
    assert body["metadata"]["name"] == f"cachewarm-llama-boot-{h}" and body["data"] == files
    assert body["immutable"] is True and body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cachewarm"
    assert body["metadata"]["annotations"]["cachewarm.dev/content-sha256"] == injection.body_sha256(body)
    assert {k: base64.b64decode(v) for k, v in body["binaryData"].items()} == bytecode
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert len(json.dumps(body).encode()) < 1024 * 1024  # a ConfigMap's limit


def test_the_boot_bytecode_is_the_same_bytes_in_every_operator_process() -> None:
    """Each replica (and each restart) compiles it: bytes that differed between processes
    would make every new leader rewrite every cache's boot ConfigMap, and the kubelet every
    pod's volume. marshal's do differ with the compiling process's reference counts (this
    one, pytest's, against a fresh one: so it compiles in a fresh interpreter). A process
    that first imports what the operator runs (kopf, the handlers) gets the same bytes."""
    code = ("import hashlib, json, kopf, kubernetes; from cachewarm.runtime import handlers; from cachewarm.reconcile import configmaps; "
            "print(json.dumps({k: hashlib.sha256(v).hexdigest() for k, v in configmaps.boot_bytecode_files().items()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    here = {k: hashlib.sha256(v).hexdigest() for k, v in configmaps.boot_bytecode_files().items()}
    assert json.loads(out.stdout) == here and len(here) == len(lc.BOOT_FILES)


def test_the_boot_bytecode_is_this_pythons_checked_hash_pyc_of_each_shipped_text() -> None:
    """Named as python's import looks for it beside the source, with PEP 552's header: this
    python's magic, flags 0b11 (hash-based, checked against the source), the hash of the
    UTF-8 text the kubelet writes; its code that of the text. None for a python that caches
    no bytecode, and then the volume maps only the sources."""
    files = {"sitecustomize.py": "x = 'é'\n", "cachewarm_copier.py": "def f():\n    return 2\n"}
    pycs = configmaps.compile_boot(files, "cpython-311")
    assert sorted(pycs) == ["cachewarm_copier.cpython-311.pyc", "sitecustomize.cpython-311.pyc"]
    assert importlib.util.cache_from_source("/b/cachewarm_copier.py").endswith(
        f"/b/__pycache__/{lc.bytecode_key('cachewarm_copier.py', sys.implementation.cache_tag)}")
    for shipped, text in files.items():
        pyc = pycs[lc.bytecode_key(shipped, "cpython-311")]
        assert pyc[:4] == importlib.util.MAGIC_NUMBER and int.from_bytes(pyc[4:8], "little") == 0b11
        assert pyc[8:16] == importlib.util.source_hash(text.encode("utf-8"))
        assert marshal.loads(pyc[16:]) == compile(text, shipped, "exec", dont_inherit=True, optimize=0)
    assert configmaps.compile_boot(files, None) == {}
    assert lc.boot_volume(BOOT_CM, None)["configMap"]["items"] == [{"key": k, "path": k} for k in lc.BOOT_FILES]


def test_a_failed_bytecode_compile_is_not_kept_but_tried_again_later_and_a_success_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A passing failure (a timeout while the operator's pod starts) must not leave this
    replica applying boot ConfigMaps without bytecode for its whole life (unlike another
    replica's: every change of leader would rewrite them); nor is it retried on every
    reconcile."""
    import types

    results = iter([{}, {}, {"sitecustomize.x.pyc": b"pyc"}])
    calls: list[int] = []

    def compile_boot(files: dict[str, str]) -> dict[str, bytes]:
        calls.append(1)
        return next(results)
    clock = [1000.0]
    monkeypatch.setattr(configmaps, "compile_boot", compile_boot)
    monkeypatch.setattr(configmaps, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(configmaps, "_bytecode", None)
    monkeypatch.setattr(configmaps, "_bytecode_failed_at", -float("inf"))
    assert configmaps.boot_bytecode_files() == {} and len(calls) == 1
    clock[0] += configmaps.BYTECODE_RETRY_SECONDS - 1
    assert configmaps.boot_bytecode_files() == {} and len(calls) == 1  # not yet
    clock[0] += 1
    assert configmaps.boot_bytecode_files() == {} and len(calls) == 2  # tried again, failed again
    clock[0] += configmaps.BYTECODE_RETRY_SECONDS
    assert configmaps.boot_bytecode_files() == {"sitecustomize.x.pyc": b"pyc"} and len(calls) == 3
    clock[0] += 10 * configmaps.BYTECODE_RETRY_SECONDS
    assert configmaps.boot_bytecode_files() == {"sitecustomize.x.pyc": b"pyc"} and len(calls) == 3  # kept


def test_without_a_verified_boot_configmap_the_copy_is_by_init_container_and_nothing_mounts_a_configmap() -> None:
    """D4: the code on a pod's PYTHONPATH comes only from a boot ConfigMap the operator
    verified; with none, the copy comes by init container (its code from the warmer image)."""
    pod = training_pod()
    answer = admit_known(pod, cache_spec({}), boot=None)
    assert [ct["name"] for ct in answer.spec["initContainers"]] == ["cachewarm-reporter", "cachewarm-copy"]
    assert not any("configMap" in v for v in answer.spec["volumes"])
    assert "/cachewarm-boot" not in json.dumps(answer.spec)
    assert "cachewarm-boot" in {v["name"] for v in admit_known(pod, cache_spec({})).spec["volumes"]}


def tokens(spec: dict[str, Any]) -> list[str]:
    """The volumes of the patched pod spec that carry a ServiceAccount token we added (not
    the apiserver's kube-api-access one the pod came with)."""
    return [v["name"] for v in spec.get("volumes") or []
            if any("serviceAccountToken" in s for s in (v.get("projected") or {}).get("sources") or [])
            and v["name"] != apitoken.VOLUME["name"]]


@pytest.mark.parametrize("path", ["reporter-only", "copy-by-init", "copy-in-process"])
def test_a_pod_that_opted_out_of_tokens_gets_none_from_us_and_no_reporter(path: str) -> None:
    """D8: automountServiceAccountToken false is its owner saying no token; we add none
    (the reporter's projected one), so no reporter either, and say why."""
    spec = cache_spec(None if path == "reporter-only" else {})
    def run(pod: dict[str, Any]) -> admission.Admission:
        return admit_known(pod, spec) if path == "copy-in-process" else admit(pod, spec)
    opted_out = run(training_pod(automountServiceAccountToken=False))
    assert tokens(opted_out.spec) == []
    assert "CACHEWARM_REPORT_URL" not in json.dumps(opted_out.spec)
    assert "cachewarm-pythonpath" not in {ct["name"] for ct in opted_out.spec.get("initContainers") or []}
    assert any("automountServiceAccountToken false" in w and "no reporter" in w for w in opted_out.warnings)
    for automount in (True, None):  # only false opts out
        pod = training_pod(**({"automountServiceAccountToken": automount} if automount is not None else {}))
        answer = run(pod)
        assert tokens(answer.spec) == ["cachewarm-report-token"] and not any("automount" in w for w in answer.warnings)
    if path != "reporter-only":  # the copy itself still comes
        assert "CACHEWARM_COPY_BUCKET" in json.dumps(opted_out.spec)


@pytest.mark.parametrize("name", ["cachewarm-cache", "cachewarm-boot", "cachewarm-reporter", "cachewarm-report-token"])
@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_users_mount_of_a_volume_named_like_ours_never_gets_that_volume_nor_the_copy(name: str, where: str) -> None:
    """A mount of a volume the pod lacks is refused by the apiserver, unless our patch adds
    one of that name: then the user's container would mount the copy writable, our code, or
    our token, where it chose. Such a pod gets no copy, and no volume of that name."""
    for run in (admit, admit_known):
        pod = training_pod()
        evil = {"name": "evil", "image": "train:1", "volumeMounts": [{"name": name, "mountPath": "/mine"}]}
        if where == "containers":
            pod["spec"]["containers"].append(evil)
        else:
            pod["spec"]["initContainers"] = [evil]
        answer = run(pod, cache_spec({}))
        volumes = {v["name"] for v in answer.spec.get("volumes") or []}
        assert name not in volumes, answer.spec  # the apiserver refuses the pod: its mount names none
        assert "cachewarm-cache" not in volumes and any("cannot get" in w for w in answer.warnings)


@pytest.mark.parametrize(("local", "pod_context", "in_process", "warned"), [
    pytest.param({"volume": "Ephemeral"}, {}, False, True, id="ephemeral-no-fsgroup"),
    pytest.param({"volume": "Ephemeral"}, {"fsGroup": 0}, False, False, id="ephemeral-fsgroup"),
    pytest.param({"volume": "Ephemeral"}, {}, True, False, id="ephemeral-in-process"),  # as the training user
    pytest.param({}, {}, False, False, id="emptydir"),  # created 0777
])
def test_an_ephemeral_copy_by_init_container_without_fsgroup_is_said_to_be_perhaps_unwritable(
        local: dict[str, Any], pod_context: dict[str, Any], in_process: bool, warned: bool) -> None:
    """D7 runs the copier as non-root: a claim's root (root's, 0755, on most provisioners) is
    writable by it only through the pod's fsGroup."""
    pod = training_pod(securityContext=pod_context)
    answer = (admit_known if in_process else admit)(pod, cache_spec(local))
    assert any("fsGroup" in w for w in answer.warnings) is warned, answer.warnings
    # Reinvocation after a later webhook (VPA's) changed the resources, which the copier
    # follows: said once, at the first admission.
    later = patched(pod, answer)
    later["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2", "memory": "4Gi"}}
    again = admit(later, cache_spec(local))
    assert again.spec.get("initContainers") or in_process  # the copier resynced (by init container)
    assert not any("fsGroup" in w for w in again.warnings)


def test_the_default_copy_is_sized_from_the_caches_listing_beyond_its_10gi() -> None:
    from cachewarm.builders.localcopy import default_copy_size
    assert default_copy_size("10Gi", 0) == "10Gi"
    assert default_copy_size("10Gi", 5 * 2**30) == "10Gi"
    assert default_copy_size("10Gi", int(8.9 * 2**30)) == "10Gi"  # under 90% of 10Gi: the copier takes it all
    assert default_copy_size("10Gi", 9 * 2**30) == "12Gi"  # 9Gi / 0.9 is just over 10Gi: 11, plus one
    # 30 GiB listed: the copier's 90% share of 35Gi holds it (30 / 0.9 = 33.4 -> 34, plus one).
    assert default_copy_size("10Gi", 30 * 2**30) == "35Gi"


def test_a_default_copy_of_a_large_cache_gets_a_volume_that_holds_it_and_a_set_one_keeps_its_size() -> None:
    from cachewarm.admission import admit
    pod = {"metadata": {"name": "t", "namespace": "ml", "labels": {"cachewarm.dev/cache": "c"}},
           "spec": {"containers": [{"name": "train", "image": "team/train:1"}]}}
    base = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}}

    def volume(spec: dict[str, Any]) -> dict[str, Any]:
        entry = admit.index_entry(spec, generation=1, uid="u", warmed=True, cache_bytes=30 * 2**30,
                                  manifests={"a": "p/.cachewarm/pools/ml/c/a/c-a-0123456789.json#5"})
        answer = admit.admit_pod(pod, lambda ns, n: entry, warmer_image="w@sha256:" + "a" * 64)
        return next(v for v in answer.spec["volumes"] if v["name"] == "cachewarm-cache")
    assert volume(base)["emptyDir"] == {"sizeLimit": "35Gi"}
    # A localCopy the user wrote is theirs: its sizeLimit is kept.
    assert volume({**base, "injection": {"localCopy": {}}})["emptyDir"] == {"sizeLimit": "10Gi"}
