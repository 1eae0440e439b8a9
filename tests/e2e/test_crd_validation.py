"""The real kube-apiserver enforces the CompilationCache schema from crds/: a valid object
is stored with its defaults, and each wrong one is rejected with a message saying what to
fix."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
import yaml

from cachewarm_testbed.cluster import Testbed

pytestmark = pytest.mark.e2e


def valid_cache(name: str = "llama") -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1",
        "kind": "CompilationCache",
        "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": "schema-check-cache", "prefix": "llama-8b", "location": "us-central1"}},
            "warmup": {
                "image": "us-docker.pkg.dev/team/train:2026-11-20",
                "targets": ["train.warm:targets"],
                "pools": [{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}],
            },
        },
    }


def with_change(path: str, value: Any) -> dict[str, Any]:
    """A valid cache with the dotted `path` set to `value` (a DELETE sentinel removes it)."""
    obj = valid_cache()
    *parents, last = path.split(".")
    node: Any = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return obj


DELETE = object()


def with_local_copy(local_copy: Any, mode: Any = "ReadOnly", jax: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid cache whose injection has `local_copy` (mode DELETE leaves mode unset;
    local_copy DELETE: readFrom LocalCopy instead)."""
    injection: dict[str, Any] = {"localCopy": local_copy} if local_copy is not DELETE else {"readFrom": "LocalCopy"}
    if mode is not DELETE:
        injection["mode"] = mode
    obj = with_change("spec.injection", injection)
    if jax is not None:
        obj["spec"]["jax"] = jax
    return obj


def with_torch(torch: Any = None, **spec: Any) -> dict[str, Any]:
    """A valid torch cache (spec.torch `torch`, {} when None) on a CPU pool, with `spec`'s
    keys set over the valid cache's (DELETE removes one)."""
    obj = with_change("spec.torch", {} if torch is None else torch)
    obj["spec"]["warmup"]["pools"] = [{"name": "cpu"}]
    for key, value in spec.items():
        if value is DELETE:
            del obj["spec"][key]
        else:
            obj["spec"][key] = value
    return obj


TPU_POOL = {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}}
CACHE_DIR_FORM = "torch.cacheDir must be an absolute directory below '/'"
CACHE_DIR_DOTS = "torch.cacheDir must not contain '.' or '..' path segments"
CACHE_DIR_OURS = "torch.cacheDir must not be one of cachewarm's own mount paths"
CACHE_DIR_SYSTEM = "torch.cacheDir must not be a system directory"
SIZE_FORM = "torch.maxArchiveSize must be a number of bytes or a Kubernetes quantity"
SIZE_RANGE = "torch.maxArchiveSize must be at least 1 byte and at most 64Gi"


def torch_field(case: str, field: str, value: Any, message: str) -> tuple[str, dict[str, Any], str]:
    """A WRONG case: spec.torch.`field` set to `value`, refused with `message` as the
    apiserver says it (naming the field and the value)."""
    return case, with_torch({field: value}), f"spec.torch.{field}: Invalid value: {json.dumps(value)}: {message}"

# (id, object, text the apiserver's message must contain)
WRONG: list[tuple[str, dict[str, Any], str]] = [
    ("bucket-uppercase", with_change("spec.storage.gcs.bucket", "Team-Cache"), "spec.storage.gcs.bucket"),
    ("bucket-too-short", with_change("spec.storage.gcs.bucket", "ab"), "at least 3 chars"),
    ("bucket-google", with_change("spec.storage.gcs.bucket", "my-google-cache"), 'must not start with "goog" or contain "google"'),
    ("bucket-goog-prefix", with_change("spec.storage.gcs.bucket", "goog-cache"), 'must not start with "goog"'),
    ("bucket-ip", with_change("spec.storage.gcs.bucket", "192.168.5.4"), "must not look like an IP address"),
    ("bucket-dots", with_change("spec.storage.gcs.bucket", "a..b"), 'must not contain ".."'),
    ("bucket-missing", with_change("spec.storage.gcs.bucket", DELETE), "spec.storage.gcs.bucket: Required value"),
    ("location-missing", with_change("spec.storage.gcs.location", DELETE), "spec.storage.gcs.location: Required value"),
    ("location-spaces", with_change("spec.storage.gcs.location", "us central1"), "spec.storage.gcs.location"),
    ("prefix-leading-slash", with_change("spec.storage.gcs.prefix", "/llama"), "spec.storage.gcs.prefix"),
    ("prefix-dotdot", with_change("spec.storage.gcs.prefix", "a/../b"), "must not contain '.' or '..' path segments"),
    ("soft-delete-3", with_change("spec.storage.gcs.softDeleteDays", 3), "softDeleteDays must be 0 (off) or between 7 and 90"),
    ("soft-delete-91", with_change("spec.storage.gcs.softDeleteDays", 91), "softDeleteDays must be 0 (off) or between 7 and 90"),
    ("soft-delete-string", with_change("spec.storage.gcs.softDeleteDays", "seven"), "spec.storage.gcs.softDeleteDays: Invalid value"),
    ("lifecycle-zero", with_change("spec.storage.gcs.lifecycle", {"deleteAfterDays": 0}), "should be greater than or equal to 1"),
    ("allow-bucket-root-string", with_change("spec.storage.gcs.lifecycle", {"allowBucketRoot": "yes"}),
     "spec.storage.gcs.lifecycle.allowBucketRoot: Invalid value"),
    ("storage-class", with_change("spec.storage.gcs.storageClass", "FAST"), 'supported values: "STANDARD"'),
    ("deletion-policy", with_change("spec.storage.gcs.deletionPolicy", "Purge"), 'supported values: "Retain", "Delete"'),
    ("create-string", with_change("spec.storage.gcs.create", "yes"), "spec.storage.gcs.create: Invalid value"),
    ("unknown-field", with_change("spec.storage.gcs.regoin", "us"), 'unknown field "spec.storage.gcs.regoin"'),
    ("both-modes", with_change("spec.warmup.command", ["python", "train.py"]), "set exactly one of warmup.command"),
    ("no-mode", with_change("spec.warmup.targets", DELETE), "set exactly one of warmup.command"),
    ("target-syntax", with_change("spec.warmup.targets", ["train.warm"]), "spec.warmup.targets[0]"),
    ("pool-duplicate", with_change("spec.warmup.pools", [{"name": "a"}, {"name": "a"}]), "Duplicate value"),
    ("pool-gpu-and-tpu", with_change("spec.warmup.pools.0.tpu", {"type": "tpu-v5p-slice", "topology": "2x2x1"}), "either accelerator (GPU) or tpu, not both"),
    ("tpu-topology", with_change("spec.warmup.pools.0", {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2by2"}}), "spec.warmup.pools[0].tpu.topology"),
    ("gpu-count-zero", with_change("spec.warmup.pools.0.accelerator.count", 0), "should be greater than or equal to 1"),
    ("min-compile-negative", with_change("spec.jax", {"minCompileTimeSecs": -1}), "spec.jax.minCompileTimeSecs"),
    ("xla-caches", with_change("spec.jax", {"enableXlaCaches": "autotune"}), "spec.jax.enableXlaCaches"),
    ("injection-mode", with_change("spec.injection", {"mode": "WriteOnly"}), 'supported values: "ReadWrite", "ReadOnly"'),
    ("schedule", with_change("spec.warmup.schedule", "every day"), "spec.warmup.schedule"),
    ("name-too-long", with_change("metadata.name", "x" * 53), "metadata.name"),
    ("image-empty", with_change("spec.warmup.image", ""), "spec.warmup.image"),
    ("image-spaces", with_change("spec.warmup.image", "my image"), "spec.warmup.image"),
    ("command-empty", with_change("spec.warmup", {"image": "i", "command": [], "pools": [{"name": "a"}]}),
     "spec.warmup.command"),
    ("pools-empty", with_change("spec.warmup.pools", []), "spec.warmup.pools"),
    ("pool-name", with_change("spec.warmup.pools.0.name", "H100_pool"), "spec.warmup.pools[0].name"),
    ("hosts-zero", with_change("spec.warmup.pools.0.hosts", 0), "spec.warmup.pools[0].hosts"),
    ("chips-zero", with_change("spec.warmup.pools.0.chipsPerHost", 0), "spec.warmup.pools[0].chipsPerHost"),
    ("node-selector-type", with_change("spec.warmup.pools.0.nodeSelector", {"a": 1}), "spec.warmup.pools[0].nodeSelector"),
    ("toleration-operator", with_change("spec.warmup.pools.0.tolerations", [{"key": "k", "operator": "Is"}]),
     'supported values: "Exists", "Equal"'),
    ("env-sets-cache", with_change("spec.warmup.env", [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/x"}]),
     "warmup.env must not set the cache variables"),
    ("env-name", with_change("spec.warmup.env", [{"name": "1BAD", "value": "x"}]), "spec.warmup.env[0].name"),
    ("python-empty", with_change("spec.warmup.python", ""), "spec.warmup.python"),
    ("python-shell", with_change("spec.warmup.python", "/bin/sh"), "python must be a python interpreter's name"),
    ("python-with-args", with_change("spec.warmup.python", "python -c import os"),
     "python must be a python interpreter's name"),
    ("python-relative", with_change("spec.warmup.python", "bin/python3"), "python must be a python interpreter's name"),
    ("working-dir-relative", with_change("spec.warmup.workingDir", "src"), "spec.warmup.workingDir"),
    ("parallelism-zero", with_change("spec.warmup.parallelism", 0), "spec.warmup.parallelism"),
    ("service-account-name", with_change("spec.warmup.serviceAccountName", "Cache_Writer"),
     "spec.warmup.serviceAccountName"),
    ("service-account-long", with_change("spec.warmup.serviceAccountName", "a" * 254),
     "spec.warmup.serviceAccountName"),
    ("backoff-negative", with_change("spec.warmup.backoffLimit", -1), "spec.warmup.backoffLimit"),
    ("deadline-short", with_change("spec.warmup.activeDeadlineSeconds", 5), "spec.warmup.activeDeadlineSeconds"),
    ("ttl-negative", with_change("spec.warmup.ttlSecondsAfterFinished", -5), "spec.warmup.ttlSecondsAfterFinished"),
    ("wait-timeout-zero", with_change("spec.injection", {"waitForWarm": {"enabled": True, "timeoutSeconds": 0}}),
     "spec.injection.waitForWarm.timeoutSeconds"),
    ("min-entry-negative", with_change("spec.jax", {"minEntrySizeBytes": -1}), "spec.jax.minEntrySizeBytes"),
    ("spec-missing", with_change("spec", DELETE), "spec: Required value"),
    ("gpu-type", with_change("spec.warmup.pools.0.accelerator.type", "NVIDIA H100"), "spec.warmup.pools[0].accelerator.type"),
    ("tpu-type-missing", with_change("spec.warmup.pools.0", {"name": "v5p", "tpu": {"topology": "2x2x1"}}),
     "spec.warmup.pools[0].tpu.type: Required value"),
    ("resources-type", with_change("spec.warmup.pools.0.resources", {"limits": {"memory": [1]}}),
     "spec.warmup.pools[0].resources.limits.memory"),
    ("toleration-effect", with_change("spec.warmup.pools.0.tolerations", [{"key": "k", "effect": "Never"}]),
     'supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"'),
    ("wait-enabled-type", with_change("spec.injection", {"waitForWarm": {"enabled": "yes"}}),
     "spec.injection.waitForWarm.enabled: Invalid value"),
    ("report-type", with_change("spec.injection", {"report": "yes"}),
     "spec.injection.report: Invalid value"),
    ("hosts-too-many", with_change("spec.warmup.pools.0.hosts", 257), "spec.warmup.pools[0].hosts"),
    ("hosts-string", with_change("spec.warmup.pools.0.hosts", "two"), "spec.warmup.pools[0].hosts"),
    ("chips-too-many", with_change("spec.warmup.pools.0.chipsPerHost", 17), "spec.warmup.pools[0].chipsPerHost"),
    # spec.injection.localCopy
    ("local-copy-volume", with_local_copy({"volume": "Tmpfs"}),
     'spec.injection.localCopy.volume: Unsupported value: "Tmpfs": supported values: "EmptyDir", "HostPath", "Ephemeral"'),
    ("local-copy-size-not-quantity", with_local_copy({"sizeLimit": "ten gigs"}),
     "localCopy.sizeLimit must be a Kubernetes quantity"),
    ("local-copy-size-zero", with_local_copy({"sizeLimit": "0Gi"}), "localCopy.sizeLimit must be greater than 0"),
    ("local-copy-size-negative", with_local_copy({"sizeLimit": "-1Gi"}), "localCopy.sizeLimit must be greater than 0"),
    ("local-copy-size-integer", with_local_copy({"sizeLimit": 10}), "spec.injection.localCopy.sizeLimit: Invalid value"),
    # HostPath is withdrawn (refused below); its hostPath rules stay for the objects stored
    # with it, whose hostPath an update may still change (ratcheting spares the volume only).
    ("local-copy-host-path-relative", with_local_copy({"volume": "HostPath", "hostPath": "mnt/ssd/jax"}),
     "localCopy.hostPath must be an absolute path"),
    ("local-copy-host-path-dotdot", with_local_copy({"volume": "HostPath", "hostPath": "/mnt/ssd/../../etc"}),
     "localCopy.hostPath must not contain '..' path segments"),
    ("local-copy-host-path-root", with_local_copy({"volume": "HostPath", "hostPath": "/"}),
     "localCopy.hostPath must name a directory below '/'"),
    ("local-copy-host-path-root-dot", with_local_copy({"volume": "HostPath", "hostPath": "//./"}),
     "localCopy.hostPath must name a directory below '/'"),
    ("local-copy-host-path-missing", with_local_copy({"volume": "HostPath"}),
     "localCopy.hostPath is required with volume HostPath"),
    ("local-copy-host-path-with-emptydir", with_local_copy({"volume": "EmptyDir", "hostPath": "/mnt/ssd/jax"}),
     "localCopy.hostPath is only allowed with volume HostPath"),
    ("local-copy-host-path-default-volume", with_local_copy({"hostPath": "/mnt/ssd/jax"}),
     "localCopy.hostPath is only allowed with volume HostPath"),
    ("local-copy-storage-class-with-emptydir", with_local_copy({"storageClassName": "premium-rwo"}),
     "localCopy.storageClassName is only allowed with volume Ephemeral"),
    ("local-copy-storage-class-with-hostpath",
     with_local_copy({"volume": "HostPath", "hostPath": "/mnt/ssd/jax", "storageClassName": "premium-rwo"}),
     "localCopy.storageClassName is only allowed with volume Ephemeral"),
    ("local-copy-storage-class-name", with_local_copy({"volume": "Ephemeral", "storageClassName": "Premium_RWO"}),
     "spec.injection.localCopy.storageClassName in body should match"),
    ("local-copy-workers-zero", with_local_copy({"workers": 0}),
     "spec.injection.localCopy.workers in body should be greater than or equal to 1"),
    ("local-copy-workers-65", with_local_copy({"workers": 65}),
     "spec.injection.localCopy.workers in body should be less than or equal to 64"),
    ("local-copy-timeout-zero", with_local_copy({"timeoutSeconds": 0}),
     "spec.injection.localCopy.timeoutSeconds in body should be greater than or equal to 1"),
    ("local-copy-timeout-3601", with_local_copy({"timeoutSeconds": 3601}),
     "spec.injection.localCopy.timeoutSeconds in body should be less than or equal to 3600"),
    ("local-copy-read-write", with_local_copy({}, mode="ReadWrite"), "injection.localCopy needs injection.mode ReadOnly"),
    ("local-copy-host-path-withdrawn", with_local_copy({"volume": "HostPath", "hostPath": "/mnt/disks/ssd0/jax-cache"}),
     "localCopy.volume HostPath is withdrawn: a copy shared between pods is a writable mount another pod reads"),
    ("local-copy-xla-caches", with_local_copy({}, jax={"enableXlaCaches": "all"}),
     'injection.localCopy needs jax.enableXlaCaches "none"'),
    ("local-copy-xla-cache-list", with_local_copy({}, jax={"enableXlaCaches": "xla_gpu_kernel_cache_file"}),
     'injection.localCopy needs jax.enableXlaCaches "none"'),
    # spec.injection.readFrom (issue 30)
    ("read-from-unknown", with_change("spec.injection", {"readFrom": "Disk"}),
     'spec.injection.readFrom: Unsupported value: "Disk": supported values: "LocalCopy", "Bucket"'),
    ("read-from-bucket-with-local-copy", with_change("spec.injection", {"readFrom": "Bucket", "localCopy": {}}),
     "injection.readFrom Bucket turns the local copy off, and injection.localCopy configures one"),
    ("read-from-local-copy-read-write", with_change("spec.injection", {"readFrom": "LocalCopy", "mode": "ReadWrite"}),
     "injection.readFrom LocalCopy needs injection.mode ReadOnly"),
    ("read-from-local-copy-xla-caches",
     with_local_copy(DELETE, mode=DELETE, jax={"enableXlaCaches": "all"}),
     'injection.readFrom LocalCopy needs jax.enableXlaCaches "none"'),
    # spec.warmup.minCompileTimeSecs (issue 30)
    ("warmup-min-compile-negative", with_change("spec.warmup.minCompileTimeSecs", -1),
     "spec.warmup.minCompileTimeSecs in body should be greater than or equal to 0"),
    ("warmup-min-compile-string", with_change("spec.warmup.minCompileTimeSecs", "1s"),
     "spec.warmup.minCompileTimeSecs: Invalid value"),
    # spec.torch (issue 31): each message as users see it, naming the field.
    ("torch-not-object", with_change("spec.torch", True), "spec.torch: Invalid value"),
    ("torch-unknown-field", with_torch({"cachedir": "/torch"}), 'unknown field "spec.torch.cachedir"'),
    torch_field("torch-cache-dir-relative", "cacheDir", "torch-cache", CACHE_DIR_FORM),
    torch_field("torch-cache-dir-root", "cacheDir", "/", CACHE_DIR_FORM),
    ("torch-cache-dir-empty", with_torch({"cacheDir": ""}), "spec.torch.cacheDir: Invalid value"),
    torch_field("torch-cache-dir-trailing-slash", "cacheDir", "/tmp/torch/", CACHE_DIR_FORM),
    torch_field("torch-cache-dir-double-slash", "cacheDir", "/tmp//torch", CACHE_DIR_FORM),
    torch_field("torch-cache-dir-space", "cacheDir", "/tmp/my torch", CACHE_DIR_FORM),
    torch_field("torch-cache-dir-dotdot", "cacheDir", "/tmp/../etc", CACHE_DIR_DOTS),
    torch_field("torch-cache-dir-dot", "cacheDir", "/tmp/./torch", CACHE_DIR_DOTS),
    torch_field("torch-cache-dir-cachewarm", "cacheDir", "/cachewarm", CACHE_DIR_OURS),
    torch_field("torch-cache-dir-cachewarm-cache", "cacheDir", "/cachewarm-cache/torch", CACHE_DIR_OURS),
    torch_field("torch-cache-dir-cachewarm-prefix", "cacheDir", "/cachewarm-torchx", CACHE_DIR_OURS),
    torch_field("torch-cache-dir-opt-cachewarm", "cacheDir", "/opt/cachewarm/torch", CACHE_DIR_OURS),
    torch_field("torch-cache-dir-token", "cacheDir", "/var/run/secrets/cachewarm", CACHE_DIR_OURS),
    ("torch-cache-dir-too-long", with_torch({"cacheDir": "/" + "a" * 200}), "spec.torch.cacheDir: Too long"),
    *[torch_field(f"torch-cache-dir-system{path.replace('/', '-')}", "cacheDir", path, CACHE_DIR_SYSTEM)
      for path in ("/usr", "/usr/lib/torch", "/etc", "/lib64", "/bin", "/sbin/x", "/proc", "/sys", "/dev/shm",
                   "/run", "/var/run/secrets/kubernetes.io", "/boot", "/root", "/home", "/opt", "/var",
                   "/var/lib", "/srv", "/mnt")],
    ("torch-cache-dir-number", with_torch({"cacheDir": 5}), "spec.torch.cacheDir: Invalid value"),
    torch_field("torch-size-not-quantity", "maxArchiveSize", "four gigs", SIZE_FORM),
    torch_field("torch-size-lowercase-unit", "maxArchiveSize", "4gi", SIZE_FORM),
    torch_field("torch-size-too-big", "maxArchiveSize", "65Gi", SIZE_RANGE),
    torch_field("torch-size-exa", "maxArchiveSize", "1E", SIZE_RANGE),
    torch_field("torch-size-too-big-bytes", "maxArchiveSize", 64 * 2**30 + 1, SIZE_RANGE),
    torch_field("torch-size-zero", "maxArchiveSize", "0", SIZE_RANGE),
    torch_field("torch-size-zero-bytes", "maxArchiveSize", 0, SIZE_RANGE),
    torch_field("torch-size-negative", "maxArchiveSize", "-1Gi", SIZE_RANGE),
    torch_field("torch-size-negative-bytes", "maxArchiveSize", -1, SIZE_RANGE),
    torch_field("torch-size-half-byte", "maxArchiveSize", "500m", SIZE_RANGE),
    ("torch-size-too-long", with_torch({"maxArchiveSize": "1" * 65}), "spec.torch.maxArchiveSize: Too long"),
    ("torch-size-float", with_torch({"maxArchiveSize": 1.5}), "spec.torch.maxArchiveSize: Invalid value"),
    ("torch-size-bool", with_torch({"maxArchiveSize": True}), "spec.torch.maxArchiveSize: Invalid value"),
    ("torch-without-warmup", with_torch(warmup=DELETE),
     "spec.torch: Required value: spec.torch needs spec.warmup: only warmers fill a torch cache"),
    ("torch-read-write", with_torch(injection={"mode": "ReadWrite"}),
     "spec.injection.mode: Forbidden: spec.torch refuses injection.mode ReadWrite: a torch cache is code"),
    ("torch-read-from-bucket", with_torch(injection={"readFrom": "Bucket"}),
     "spec.injection.readFrom: Forbidden: spec.torch refuses injection.readFrom Bucket: torch reads a local "
     "directory only"),
    ("torch-tpu-pool", with_torch(warmup={**valid_cache()["spec"]["warmup"], "pools": [{"name": "cpu"}, TPU_POOL]}),
     "spec.warmup.pools: Forbidden: spec.torch refuses pools with tpu: torch on TPU is torch_xla"),
    ("torch-env-inductor-dir", with_torch(warmup={**valid_cache()["spec"]["warmup"], "pools": [{"name": "cpu"}],
                                                  "env": [{"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/x"}]}),
     "spec.warmup.env: Forbidden: warmup.env of a torch cache must not set TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR"),
    ("torch-env-triton-dir", with_torch(warmup={**valid_cache()["spec"]["warmup"], "pools": [{"name": "cpu"}],
                                                "env": [{"name": "TRITON_CACHE_DIR", "value": "/x"}]}),
     "spec.warmup.env: Forbidden: warmup.env of a torch cache must not set TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR"),
]


def create(testbed: Testbed, namespace: str, obj: dict[str, Any]) -> tuple[int, str]:
    result = testbed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))
    return result.returncode, result.stdout + result.stderr


def test_valid_cache_is_stored_with_defaults(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, valid_cache())
    assert code == 0, out
    got = crd_installed.kubectl_run("get", "ccache", "llama", "-n", namespace, "-o", "json")
    gcs = json.loads(got.stdout)["spec"]["storage"]["gcs"]
    assert gcs["softDeleteDays"] == 7
    assert gcs["storageClass"] == "STANDARD"
    assert gcs["deletionPolicy"] == "Retain"
    assert gcs["lifecycle"] == {"deleteAfterDays": 30, "allowBucketRoot": False}


@pytest.mark.parametrize(("obj", "message"), [pytest.param(o, m, id=i) for i, o, m in WRONG])
def test_wrong_cache_is_rejected_with_message(
    crd_installed: Testbed, namespace: str, obj: dict[str, Any], message: str
) -> None:
    code, out = create(crd_installed, namespace, copy.deepcopy(obj))
    assert code != 0, f"apiserver accepted an invalid CompilationCache:\n{out}"
    assert message in out


def test_torch_cache_is_stored_with_its_defaults(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, with_torch())
    assert code == 0, out
    spec = stored_spec(crd_installed, namespace, "llama")
    assert spec["torch"] == {"cacheDir": "/cachewarm-torch", "maxArchiveSize": "4Gi"}
    # Like a JAX cache's: no read path written in (the operator gives it the local copy).
    assert spec["injection"] == {"mode": "ReadOnly", "report": True}


@pytest.mark.parametrize("torch", [
    pytest.param({"cacheDir": "/cachewarm-torch/inductor", "maxArchiveSize": 1}, id="min-bytes"),
    pytest.param({"cacheDir": "/root/.cache/torch", "maxArchiveSize": "64Gi"}, id="max-quantity"),
    pytest.param({"cacheDir": "/" + "a" * 199, "maxArchiveSize": 64 * 2**30}, id="longest-dir-max-bytes"),
    pytest.param({"cacheDir": "/workspace/inductor_cache-2.15", "maxArchiveSize": "1.5Gi"}, id="fraction"),
    # Below the system directories users keep caches in, and /tmp itself: accepted.
    *[pytest.param({"cacheDir": path, "maxArchiveSize": "4Gi"}, id=f"dir{path.replace('/', '-')}")
      for path in ("/tmp", "/home/me/.cache/torch", "/opt/app/cache", "/var/lib/torch", "/usrx", "/runs")],
])
def test_torch_variants_are_accepted(crd_installed: Testbed, namespace: str, torch: dict[str, Any]) -> None:
    code, out = create(crd_installed, namespace, with_torch(torch))
    assert code == 0, out
    assert stored_spec(crd_installed, namespace, "llama")["torch"] == torch


def test_torch_cache_on_gpu_with_a_copy_and_jax_settings_is_accepted(crd_installed: Testbed, namespace: str) -> None:
    # spec.jax does not apply to a torch cache: XLA's caches do not refuse its local copy.
    obj = with_torch(injection={"readFrom": "LocalCopy", "localCopy": {"sizeLimit": "20Gi"}},
                     jax={"enableXlaCaches": "all"})
    obj["spec"]["warmup"]["pools"] = valid_cache()["spec"]["warmup"]["pools"]
    obj["spec"]["warmup"]["env"] = [{"name": "TORCHINDUCTOR_MAX_AUTOTUNE", "value": "1"}]
    code, out = create(crd_installed, namespace, obj)
    assert code == 0, out


def test_local_copy_is_stored_with_its_defaults(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, with_local_copy({}))
    assert code == 0, out
    stored = json.loads(crd_installed.kubectl_run("get", "ccache", "llama", "-n", namespace, "-o", "json").stdout)
    injection = stored["spec"]["injection"]
    assert injection["mode"] == "ReadOnly"
    assert injection["localCopy"] == {"volume": "EmptyDir", "sizeLimit": "10Gi", "workers": 16, "timeoutSeconds": 300}
    assert stored["spec"]["jax"]["enableXlaCaches"] == "none"


def test_local_copy_and_read_from_are_not_written_into_stored_caches(crd_installed: Testbed, namespace: str) -> None:
    # The local copy is the default read path (issue 30), decided by the operator at each
    # read (api/model.CacheSpec), not by a CRD default that would be written into objects.
    code, out = create(crd_installed, namespace, valid_cache())
    assert code == 0, out
    stored = json.loads(crd_installed.kubectl_run("get", "ccache", "llama", "-n", namespace, "-o", "json").stdout)
    assert "localCopy" not in stored["spec"]["injection"] and "readFrom" not in stored["spec"]["injection"]
    assert "minCompileTimeSecs" not in stored["spec"]["warmup"]


@pytest.mark.parametrize("injection", [{"readFrom": "Bucket"}, {"readFrom": "LocalCopy"},
                                       {"readFrom": "LocalCopy", "localCopy": {"sizeLimit": "1Gi"}}])
def test_read_from_values_are_accepted(crd_installed: Testbed, namespace: str, injection: dict[str, Any]) -> None:
    code, out = create(crd_installed, namespace, with_change("spec.injection", injection))
    assert code == 0, out


@pytest.mark.parametrize(("local_copy", "jax"), [
    pytest.param({"volume": "Ephemeral", "workers": 64, "timeoutSeconds": 3600}, None, id="ephemeral-max-bounds"),
    pytest.param({"volume": "Ephemeral", "storageClassName": "premium-rwo", "sizeLimit": "50Gi"}, None,
                 id="ephemeral"),
    pytest.param({"volume": "Ephemeral", "sizeLimit": "1.5Ti"}, None, id="ephemeral-default-class"),
    pytest.param({"volume": "EmptyDir", "sizeLimit": "500M", "workers": 1, "timeoutSeconds": 1},
                 {"enableXlaCaches": "none"}, id="empty-dir-min-bounds"),
])
def test_local_copy_variants_are_accepted(
    crd_installed: Testbed, namespace: str, local_copy: dict[str, Any], jax: dict[str, Any] | None
) -> None:
    code, out = create(crd_installed, namespace, with_local_copy(local_copy, jax=jax))
    assert code == 0, out
    stored = json.loads(crd_installed.kubectl_run("get", "ccache", "llama", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["injection"]["localCopy"].items() >= local_copy.items()


def test_hosts_is_not_defaulted(crd_installed: Testbed, namespace: str) -> None:
    # Unset hosts means "derive from the TPU shape"; a default would make it an override.
    obj = valid_cache("shape")
    obj["spec"]["warmup"]["pools"] = [{"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}]
    code, out = create(crd_installed, namespace, obj)
    assert code == 0, out
    stored = json.loads(crd_installed.kubectl_run("get", "ccache", "shape", "-n", namespace, "-o", "json").stdout)
    [pool] = stored["spec"]["warmup"]["pools"]
    assert "hosts" not in pool and "chipsPerHost" not in pool


# Status is written by the operator; the schema still types what it declares.
WRONG_POOL_STATUS: list[tuple[str, dict[str, Any], str]] = [
    ("nodes-string", {"name": "a", "nodes": "node-1"}, "status.warmup.pools[0].nodes"),
    ("nodes-ints", {"name": "a", "nodes": [1]}, "status.warmup.pools[0].nodes[0]"),
    ("message-object", {"name": "a", "message": {"text": "x"}}, "status.warmup.pools[0].message"),
    ("reason-list", {"name": "a", "reason": ["Unschedulable"]}, "status.warmup.pools[0].reason"),
    ("state-unknown", {"name": "a", "state": "Scheduling"}, 'supported values: "Pending", "Running"'),
    ("job-uid-long", {"name": "a", "jobUid": "u" * 65}, "status.warmup.pools[0].jobUid"),
]


def test_pool_status_fields_are_typed(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, valid_cache("st"))
    assert code == 0, out
    good = {"name": "a", "state": "Pending", "reason": "Unschedulable", "nodes": ["node-1"],
            "message": "Unschedulable: 0/5 nodes are available: 5 Insufficient google.com/tpu."}
    ok = crd_installed.kubectl_run("patch", "ccache", "st", "-n", namespace, "--subresource=status", "--type=merge",
                                   "-p", json.dumps({"status": {"warmup": {"pools": [good]}}}), "-o", "json")
    assert ok.returncode == 0, ok.stderr
    # The patch's answer is the object as stored (an operator running in the same session
    # may rewrite the status right after, so it is not read again).
    stored = json.loads(ok.stdout)
    assert stored["status"]["warmup"]["pools"] == [good]  # declared, so not pruned
    for case, pool, message in WRONG_POOL_STATUS:
        bad = crd_installed.kubectl_run("patch", "ccache", "st", "-n", namespace, "--subresource=status",
                                        "--type=merge", "-p", json.dumps({"status": {"warmup": {"pools": [pool]}}}))
        assert bad.returncode != 0, case
        assert message in bad.stderr, (case, bad.stderr)


TORCH_FINGERPRINT = {
    "framework": "torch", "versions": {"torch": "2.15.0", "triton": "3.9.0"}, "platform": "cpu", "deviceKind": "cpu",
    "devices": 1, "inductorConfigHash": "0123456789ab", "inductorEnv": {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
    "inductorChanged": {"max_autotune": "True"}, "torchKey": "0123456789abcdef", "cacheDir": "/cachewarm-torch"}
TORCH_USAGE = {"pods": 2, "fxGraphHits": 6, "fxGraphMisses": 0, "aotAutogradHits": 4, "aotAutogradMisses": 0,
               "compileSeconds": 3.5, "warmerCompileSeconds": 42.25, "secondsSaved": 38.75, "hitButNotSaved": 1}
WRONG_TORCH_STATUS: list[tuple[str, dict[str, Any], str]] = [
    ("framework-unknown", {"warmup": {"pools": [{"name": "a", "fingerprint": {"framework": "tensorflow"}}]}},
     'supported values: "jax", "torch"'),
    ("inductor-env-int", {"warmup": {"pools": [{"name": "a", "fingerprint": {"inductorEnv": {"A": 1}}}]}},
     "status.warmup.pools[0].fingerprint.inductorEnv.A"),
    ("inductor-env-long", {"warmup": {"pools": [{"name": "a", "fingerprint": {"inductorEnv": {"A": "x" * 101}}}]}},
     "status.warmup.pools[0].fingerprint.inductorEnv.A"),
    ("inductor-changed-list", {"warmup": {"pools": [{"name": "a", "fingerprint": {"inductorChanged": ["a"]}}]}},
     "status.warmup.pools[0].fingerprint.inductorChanged"),
    ("torch-key-int", {"warmup": {"pools": [{"name": "a", "fingerprint": {"torchKey": 5}}]}},
     "status.warmup.pools[0].fingerprint.torchKey"),
    ("usage-hits-string", {"usage": {"torch": {"fxGraphHits": "six"}}}, "status.usage.torch.fxGraphHits"),
    ("usage-saved-string", {"usage": {"torch": {"secondsSaved": "lots"}}}, "status.usage.torch.secondsSaved"),
]


def test_torch_status_fields_are_typed(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, with_torch() | {"metadata": {"name": "ts"}})
    assert code == 0, out
    good = {"warmup": {"pools": [{"name": "cpu", "fingerprint": TORCH_FINGERPRINT}]}, "usage": {"torch": TORCH_USAGE}}
    ok = crd_installed.kubectl_run("patch", "ccache", "ts", "-n", namespace, "--subresource=status", "--type=merge",
                                   "-p", json.dumps({"status": good}), "-o", "json")
    assert ok.returncode == 0, ok.stderr
    stored = json.loads(ok.stdout)["status"]  # the patch's answer, as in test_pool_status_fields_are_typed
    assert stored["warmup"]["pools"][0]["fingerprint"] == TORCH_FINGERPRINT  # declared, so not pruned
    assert stored["usage"]["torch"] == TORCH_USAGE
    for case, status, message in WRONG_TORCH_STATUS:
        bad = crd_installed.kubectl_run("patch", "ccache", "ts", "-n", namespace, "--subresource=status",
                                        "--type=merge", "-p", json.dumps({"status": status}))
        assert bad.returncode != 0, case
        assert message in bad.stderr, (case, bad.stderr)


def test_dotted_name_is_refused_and_dashed_name_accepted(crd_installed: Testbed, namespace: str) -> None:
    # Dots are valid in Kubernetes names but not in the warmer Service name, the pods'
    # subdomain or GCS label values built from it.
    code, out = create(crd_installed, namespace, valid_cache("llama.v2"))
    assert code != 0, f"apiserver accepted a dotted name:\n{out}"
    assert "metadata.name must be a DNS-1035 label" in out
    code, out = create(crd_installed, namespace, valid_cache("llama-v2"))
    assert code == 0, out


@pytest.mark.parametrize("name", ["2llama", "llama-", "-llama"])
def test_name_not_starting_with_a_letter_or_ending_with_dash_is_refused(
    crd_installed: Testbed, namespace: str, name: str
) -> None:
    code, out = create(crd_installed, namespace, valid_cache(name))
    assert code != 0, f"apiserver accepted {name!r}:\n{out}"
    assert "metadata.name" in out


def test_bucket_cannot_change_after_creation(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, valid_cache("moving"))
    assert code == 0, out
    patched = crd_installed.kubectl_run(
        "patch", "ccache", "moving", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"storage": {"gcs": {"bucket": "other-bucket"}}}}),
    )
    assert patched.returncode != 0
    assert "bucket is immutable" in patched.stderr


def stored_spec(testbed: Testbed, namespace: str, name: str) -> dict[str, Any]:
    got = testbed.kubectl_run("get", "ccache", name, "-n", namespace, "-o", "json")
    assert got.returncode == 0, got.stderr
    spec: dict[str, Any] = json.loads(got.stdout)["spec"]
    return spec


def test_mode_defaults_to_read_only_and_an_explicit_read_write_stays(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, valid_cache("reader"))
    assert code == 0, out
    assert stored_spec(crd_installed, namespace, "reader")["injection"]["mode"] == "ReadOnly"
    code, out = create(crd_installed, namespace, with_change("spec.injection", {"mode": "ReadWrite"}) | {
        "metadata": {"name": "writer"}})
    assert code == 0, out
    assert stored_spec(crd_installed, namespace, "writer")["injection"]["mode"] == "ReadWrite"


def test_local_copy_without_mode_is_read_only(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, with_local_copy({}, mode=DELETE))
    assert code == 0, out
    assert stored_spec(crd_installed, namespace, "llama")["injection"]["mode"] == "ReadOnly"


def test_changing_a_copy_to_host_path_is_refused(crd_installed: Testbed, namespace: str) -> None:
    code, out = create(crd_installed, namespace, with_local_copy({}))
    assert code == 0, out
    patched = crd_installed.kubectl_run(
        "patch", "ccache", "llama", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"injection": {"localCopy": {"volume": "HostPath", "hostPath": "/mnt/ssd"}}}}))
    assert patched.returncode != 0
    assert "localCopy.volume HostPath is withdrawn" in patched.stderr


def previous_crd(current: dict[str, Any]) -> dict[str, Any]:
    """The CRD as it was before HostPath was withdrawn and ReadOnly became the default: the
    volume's rule removed, mode defaulting to ReadWrite."""
    old = copy.deepcopy(current)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        old["metadata"].pop(key, None)
    old.pop("status", None)
    spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    injection = spec["properties"]["injection"]["properties"]
    injection["mode"]["default"] = "ReadWrite"
    withdrawn = without_rules(old, "HostPath is withdrawn")
    assert withdrawn, "no rule withdraws HostPath"
    return old


def without_rules(node: Any, said: str) -> int:
    """Remove, anywhere under `node`, the CEL rules whose message contains `said`; how many."""
    removed = 0
    if isinstance(node, dict):
        rules = node.get("x-kubernetes-validations")
        if isinstance(rules, list):
            kept = [r for r in rules if said not in str(r.get("message", ""))]
            removed += len(rules) - len(kept)
            node["x-kubernetes-validations"] = kept
            if not kept:
                del node["x-kubernetes-validations"]
        removed += sum(without_rules(v, said) for k, v in node.items() if k != "x-kubernetes-validations")
    elif isinstance(node, list):
        removed += sum(without_rules(v, said) for v in node)
    return removed


def host_path_probe(testbed: Testbed, namespace: str) -> bool:
    """Whether the apiserver now accepts a new HostPath cache (a server-side dry run: nothing stored)."""
    probe = with_local_copy({"volume": "HostPath", "hostPath": "/mnt/ssd/probe"}) | {"metadata": {"name": "probe"}}
    result = testbed.kubectl_run("create", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(probe))
    return result.returncode == 0


def until_probe(testbed: Testbed, namespace: str, accepted: bool) -> None:
    """Wait until the apiserver serves the CRD just written (its handler is swapped
    asynchronously after the CRD update)."""
    deadline = time.monotonic() + 60
    while host_path_probe(testbed, namespace) != accepted:
        assert time.monotonic() < deadline, f"the apiserver did not serve the CRD (HostPath accepted: {not accepted})"
        time.sleep(0.5)


def test_caches_stored_before_keep_their_mode_and_host_path(crd_installed: Testbed, namespace: str) -> None:
    # Existing objects cannot be made with the current CRD, so the test serves the previous
    # one for a moment (the real upgrade path: objects stored under it, then the new CRD
    # applied), stores two caches the way they were made then, and restores the current CRD.
    got = crd_installed.kubectl_run("get", "crd", "compilationcaches.cachewarm.dev", "-o", "json")
    assert got.returncode == 0, got.stderr
    current = json.loads(got.stdout)
    restored = copy.deepcopy(current)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        restored["metadata"].pop(key, None)
    restored.pop("status", None)
    try:
        replaced = crd_installed.kubectl_run("replace", "-f", "-", input=json.dumps(previous_crd(current)))
        assert replaced.returncode == 0, replaced.stderr
        until_probe(crd_installed, namespace, accepted=True)
        code, out = create(crd_installed, namespace, valid_cache("legacy-writer"))  # no mode: ReadWrite then
        assert code == 0, out
        host_path = {"volume": "HostPath", "hostPath": "/mnt/disks/ssd0/jax-cache", "sizeLimit": "375Gi"}
        code, out = create(crd_installed, namespace, with_local_copy(host_path) | {"metadata": {"name": "legacy-copy"}})
        assert code == 0, out
    finally:
        back = crd_installed.kubectl_run("replace", "-f", "-", input=json.dumps(restored))
        assert back.returncode == 0, back.stderr
        until_probe(crd_installed, namespace, accepted=False)
    # Defaulting fills absent fields only: the stored ReadWrite stays.
    assert stored_spec(crd_installed, namespace, "legacy-writer")["injection"]["mode"] == "ReadWrite"
    # Ratcheting: an update that leaves the volume as it is stays allowed ...
    patched = crd_installed.kubectl_run(
        "patch", "ccache", "legacy-copy", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"warmup": {"image": "us-docker.pkg.dev/team/train:2026-11-27"}}}))
    assert patched.returncode == 0, patched.stderr
    assert stored_spec(crd_installed, namespace, "legacy-copy")["injection"]["localCopy"]["volume"] == "HostPath"
    # ... and so does moving it to a per-pod copy; moving back is refused.
    moved = crd_installed.kubectl_run(
        "patch", "ccache", "legacy-copy", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"injection": {"localCopy": {"volume": "EmptyDir", "hostPath": None}}}}))
    assert moved.returncode == 0, moved.stderr
    back_to_host = crd_installed.kubectl_run(
        "patch", "ccache", "legacy-copy", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"injection": {"localCopy": {"volume": "HostPath", "hostPath": "/mnt/ssd"}}}}))
    assert back_to_host.returncode != 0
    assert "localCopy.volume HostPath is withdrawn" in back_to_host.stderr
