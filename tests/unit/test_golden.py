"""Golden snapshots of what the operator sends, compared byte for byte: for the sample
caches and a spread of specs (every pool kind, storage mode and injection option), the
warmer Jobs and Services, the ConfigMaps, the bucket PATCH bodies, each pool's spec_hash
and the pod patches the webhook answers. Taken before the layout move of issue 27 and kept:
a change that alters one must be deliberate (regenerate with CACHEWARM_GOLDEN_UPDATE=1 and
say why in CHANGELOG.md; a spec_hash change re-warms every cache in a cluster).

The payload files shipped into pods (boot ConfigMap's sitecustomize, copier, reporter) are
recorded by name, size and sha256, not inline, so that tests/golden/payload.json is the one
file a change to an agent's source updates."""

from __future__ import annotations

import dataclasses
import base64
import datetime as dt
import hashlib
import json
import os
import pathlib
from typing import Any

import pytest

from apitoken import given_api_token
import yaml

from cachewarm.reconcile import cache as service
from cachewarm.admission import admit
from cachewarm.reconcile import configmaps
from cachewarm.builders import placement
from cachewarm.builders.bucket import grant_label
from cachewarm.builders.reporting import Reporting
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.api.model import parse_spec
from memgcs import MemoryBucket
from memkube import MemoryKube

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("CACHEWARM_GOLDEN_UPDATE") == "1"
NOW = dt.datetime(2026, 11, 22, 7, 0, tzinfo=dt.timezone.utc)
WARMER_IMAGE = "registry.example/cachewarm/warmer@sha256:" + "e" * 64
REPORTING = Reporting(image=WARMER_IMAGE, url="https://10.96.0.100:9443/report/v1", ca_pem="-----BEGIN CERTIFICATE-----\nX\n")
NS = "team-a"


def _yaml(path: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / path).read_text())
    return doc


def _gcs(prefix: str = "p", **over: Any) -> dict[str, Any]:
    return {"gcs": {"bucket": "b-1", "prefix": prefix, "location": "US", **over}}


GPU_POOL = {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8},
            "nodeSelector": {"team": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "resources": {"limits": {"memory": "64Gi"}}}
A100_POOL = {"name": "a100", "accelerator": {"type": "nvidia-tesla-a100", "count": 1}}
V5E_POOL = {"name": "v5e", "tpu": {"type": "tpu-v5-lite-podslice", "topology": "2x4"}}
V5P_POOL = {"name": "v5p16", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}
CPU_POOL = {"name": "cpu"}

SPECS: dict[str, dict[str, Any]] = {
    "sample-llama-8b": _yaml("manifests/samples/compilationcache.yaml")["spec"],
    "demo-llama-demo": _yaml("demo/compilationcache.yaml")["spec"],
    "gpu-pools-every-warmup-option": {
        "storage": _gcs(storageClass="NEARLINE", softDeleteDays=0, deletionPolicy="Delete",
                        lifecycle={"deleteAfterDays": 3}),
        "jax": {"minCompileTimeSecs": 0.5, "minEntrySizeBytes": 1024, "enableXlaCaches": "all"},
        "warmup": {"image": "registry.example/train:7", "command": ["python", "-m", "train", "--warm"],
                   "env": [{"name": "MODEL", "value": "llama"}], "python": "python3", "workingDir": "/app",
                   "parallelism": 2, "backoffLimit": 3, "activeDeadlineSeconds": 600,
                   "ttlSecondsAfterFinished": 60, "schedule": "0 3 * * *", "serviceAccountName": "warmers",
                   "pools": [GPU_POOL, A100_POOL]},
        "injection": {"mode": "ReadWrite", "report": False},
    },
    "tpu-pools-targets": {
        "storage": _gcs(create=False),
        "warmup": {"image": "registry.example/train:7", "targets": ["train:targets", "train:more"],
                   "pools": [V5E_POOL, V5P_POOL, {**CPU_POOL, "hosts": 2}]},
        "injection": {"mode": "ReadOnly", "waitForWarm": {"enabled": True, "timeoutSeconds": 600}},
    },
    "local-copy-emptydir": {
        "storage": _gcs(),
        "warmup": {"image": "registry.example/train:7", "targets": ["train:targets"], "pools": [CPU_POOL]},
        "injection": {"mode": "ReadOnly", "localCopy": {"volume": "EmptyDir", "sizeLimit": "2Gi", "workers": 4,
                                                        "timeoutSeconds": 120}},
    },
    "local-copy-hostpath": {
        "storage": _gcs(),
        "injection": {"mode": "ReadOnly", "report": False,
                      "localCopy": {"volume": "HostPath", "hostPath": "/var/cache/cachewarm/p"}},
    },
    "local-copy-ephemeral": {
        "storage": _gcs(),
        "injection": {"mode": "ReadOnly", "localCopy": {"volume": "Ephemeral", "storageClassName": "premium-rwo",
                                                        "sizeLimit": "20Gi"}},
    },
    "bucket-root": {
        "storage": {"gcs": {"bucket": "b-1", "location": "US", "lifecycle": {"allowBucketRoot": True}}},
    },
    # A torch cache (issue 31): the torch env and directory in the Jobs and pods, the default copy.
    "torch-cpu-gpu-pools": {
        "storage": _gcs(),
        "torch": {"cacheDir": "/data/inductor", "maxArchiveSize": "1Gi"},
        "warmup": {"image": "registry.example/train-torch:7", "command": ["python", "train_torch.py", "--steps", "1"],
                   "pools": [CPU_POOL, A100_POOL]},
    },
}

PODS: dict[str, dict[str, Any]] = {
    "plain": {"containers": [{"name": "train", "image": "registry.example/train:7"}]},
    "own-env-and-pythonpath": {"containers": [
        {"name": "train", "image": "registry.example/train:7",
         "env": [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mine"}, {"name": "PYTHONPATH", "value": "/app"}]},
        {"name": "side", "image": "busybox"}],
        "initContainers": [{"name": "setup", "image": "busybox"}]},
}


def _write_or_compare(name: str, data: Any) -> None:
    text = json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with CACHEWARM_GOLDEN_UPDATE=1 once, deliberately"
    assert text == path.read_text(), f"{path.name} changed: if deliberate, regenerate it and say why in CHANGELOG.md"


def _digest(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else value
    return f"<{len(raw)} bytes sha256:{hashlib.sha256(raw).hexdigest()[:16]}>"


def _payload_digests() -> dict[str, str]:
    """Digest -> which shipped file (or its bytecode) it is, from what payload.json pins."""
    files = {_digest(v): f"<payload.json boot_files {k}>" for k, v in configmaps.boot_files().items()}
    code = {_digest(v): f"<payload.json bytecode {k}>" for k, v in configmaps.boot_bytecode_files().items()}
    return {**files, **code}


def _configmap(cm: dict[str, Any]) -> dict[str, Any]:
    """A boot ConfigMap's shipped files and bytecode by the payload.json entry their bytes
    equal (so a change to an agent's text updates payload.json alone, while a key holding
    another file's text, or bytes that are no shipped file's, still changes this snapshot);
    other data inline."""
    known = _payload_digests()
    out = json.loads(json.dumps(cm))
    for key in ("data", "binaryData"):
        for name, value in (out.get(key) or {}).items():
            if name.endswith((".py", ".pyc")) or key == "binaryData":
                digest = _digest(base64.b64decode(value) if key == "binaryData" else value)
                out[key][name] = known.get(digest, f"<not a shipped file: {digest}>")
    return out


class Recording(MemoryBucket):
    def __init__(self) -> None:
        super().__init__(["a" * 16])
        # Its owner granted it to the golden caches' namespace (MemoryBucket's is another).
        self.bucket = dataclasses.replace(self.bucket, labels=dict([grant_label(NS, "")]))
        self.patches: list[dict[str, Any]] = []

    def patch_bucket(self, current: Any, patch: dict[str, Any]) -> Any:
        self.patches.append(json.loads(json.dumps(patch)))
        return super().patch_bucket(current, patch)


def _operator_output(spec: dict[str, Any]) -> dict[str, Any]:
    kube, gcs = MemoryKube(), Recording()
    meta = {"generation": 2, "uid": "u-1", "creationTimestamp": "2026-11-22T00:00:00Z", "annotations": {}}
    status: dict[str, Any] = {}
    for _ in range(2):  # the second pass: what an idempotent resync sends
        wiring = service.Wiring(gcs=gcs, kube=kube, warmer_image=WARMER_IMAGE,  # type: ignore[arg-type]
                                injections=RecentInjections(600), claims=lambda bucket: [])
        out = service.reconcile_cache(wiring, service.CacheObject(NS, "c-1", spec, meta, status), now=NOW)
        assert out.failure is None, out.failure
        status = out.status
    pools = (status.get("warmup") or {}).get("pools") or []
    return {
        "status": status,
        "created": kube.created,
        "configmaps": [_configmap(cm) for _, cm in sorted(kube.configmaps.items())],
        "bucketPatches": gcs.patches,
        "specHashes": {p.get("name"): p.get("specHash") for p in pools},
        "jobNames": {p.get("name"): p.get("job") for p in pools},
    }


@pytest.mark.parametrize("name", sorted(SPECS))
def test_operator_output_matches_the_golden_snapshot(name: str) -> None:
    out = _operator_output(SPECS[name])
    del out["status"]  # (pinned by the tests of status, not here)
    _write_or_compare(f"operator-{name}", out)


def _admission(spec: dict[str, Any], pod_spec: dict[str, Any], status: dict[str, Any], *, warmed: bool,
               pythonpath: str | None) -> dict[str, Any]:
    # The ConfigMaps the operator verified (status.injection.configMaps, as its reconcile
    # wrote them); a warmed cache's pools have the manifest (its warmer Job's object and the
    # generation) their warmers reported.
    configmaps = (status.get("injection") or {}).get("configMaps") or {}
    pools = [p["name"] for p in (spec.get("warmup") or {}).get("pools") or []]
    gcs = parse_spec(spec).storage.gcs
    manifests = {p: f"{placement.manifest_object(gcs, NS, 'c-1', p, f'c-1-{p}-0123456789')}#{1700000000000000 + i}"
                 for i, p in enumerate(pools)}
    entry = admit.index_entry(spec, generation=2, uid="u-1", warmed=warmed, image_pythonpath=pythonpath,
                              manifests=manifests if warmed else {},
                              env_configmap=configmaps.get("env"), boot_configmap=configmaps.get("boot"))
    # As the webhook gets it: the apiserver's ServiceAccount admission gave it its token.
    pod = {"metadata": {"namespace": NS, "generateName": "train-", "labels": {"cachewarm.dev/cache": "c-1"}},
           "spec": given_api_token(json.loads(json.dumps(pod_spec)))}
    got = admit.admit_pod(pod, lambda ns, name: entry if (ns, name) == (NS, "c-1") else None, REPORTING, WARMER_IMAGE)
    return {"spec": got.spec, "annotations": got.annotations, "warnings": got.warnings, "injected": got.injected}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pod_patches_match_the_golden_snapshot(name: str) -> None:
    spec = SPECS[name]
    parse_spec(spec)
    status = _operator_output(spec)["status"]
    out = {f"{pod}/warmed={warmed}/pythonpath={pp}": _admission(spec, PODS[pod], status, warmed=warmed, pythonpath=pp)
           for pod in sorted(PODS) for warmed in (False, True) for pp in (None, "/app:/usr/lib/python3/dist-packages")}
    _write_or_compare(f"admission-{name}", out)


def test_shipped_payload_matches_the_golden_snapshot() -> None:
    """The files the operator ships into pods (boot ConfigMap and its bytecode), by digest."""
    _write_or_compare("payload", {"boot_files": {k: _digest(v) for k, v in sorted(configmaps.boot_files().items())},
                                  "bytecode": {k: _digest(v) for k, v in sorted(configmaps.boot_bytecode_files().items())}})
