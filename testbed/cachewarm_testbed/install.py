"""Install cachewarm on a testbed the way a user does: `kubectl apply -k` of manifests/.

The operator then runs from its image on the real node (cachewarm_testbed.realnode), in
its namespace, under its ServiceAccount and the Deployment's security context, and the
apiserver calls its webhook through the Service. The only layer on top of manifests/ is
a kustomize overlay with what any cluster without real GCS needs: the operator's env
pointing at the GCS emulator (STORAGE_EMULATOR_HOST, as google-cloud-storage reads it) and
optional settings such as a shorter poll interval. The images keep the names the manifests
use, so nothing is rewritten there: they are already in the node's containerd (imported
from cachewarm_testbed.images), and the default pull policy finds them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from cachewarm_testbed.processes import StartError

if TYPE_CHECKING:
    from cachewarm_testbed.cluster import Testbed

NAMESPACE = "cachewarm-system"
DEPLOYMENT = "cachewarm-operator"
WEBHOOK_CONFIGURATION = "cachewarm-pod-injector"


def overlay(dest: Path, manifests: Path, env: dict[str, str]) -> Path:
    """Write a kustomization in `dest` that takes `manifests` as is and adds `env` to the
    operator container. Returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    patch = [{"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": k, "value": v}}
             for k, v in env.items()]
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(manifests, dest)],
    }
    if patch:
        kustomization["patches"] = [{"target": {"kind": "Deployment", "name": DEPLOYMENT},
                                     "patch": json.dumps(patch)}]
    (dest / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return dest


def install_operator(bed: Testbed, manifests: Path, env: dict[str, str], timeout: float = 110.0) -> dict[str, Any]:
    """`kubectl apply -k` manifests/ (through `overlay`), then wait until the operator's
    Deployment is available and its webhook configuration carries a CA bundle. Returns the
    operator's Pod. Raises StartError with the rollout's state and the pod's log tail."""
    kustomization = overlay(bed.workdir / "install", manifests, env)
    applied = bed.kubectl_run("apply", "-k", str(kustomization))
    if applied.returncode != 0:
        raise StartError(f"kubectl apply -k {kustomization} failed: {applied.stderr.strip()}")
    rollout = bed.kubectl_run("rollout", "status", f"deployment/{DEPLOYMENT}", "-n", NAMESPACE,
                              f"--timeout={int(timeout)}s")
    if rollout.returncode != 0:
        raise StartError(f"the operator's Deployment did not become available: {rollout.stderr.strip()}\n"
                         f"{describe_operator(bed)}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        config = bed.get_json("mutatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "") or {}
        if all(w.get("clientConfig", {}).get("caBundle") for w in config.get("webhooks", [])):
            return operator_pod(bed)
        time.sleep(0.5)
    raise StartError(f"the operator never filled the caBundle of {WEBHOOK_CONFIGURATION}\n{describe_operator(bed)}")


def operator_pod(bed: Testbed) -> dict[str, Any]:
    """The operator's one running Pod."""
    out = bed.kubectl_run("get", "pods", "-n", NAMESPACE, "-l",
                          "app.kubernetes.io/name=cachewarm,app.kubernetes.io/component=operator",
                          "--field-selector=status.phase=Running", "-o", "json")
    pods = json.loads(out.stdout)["items"] if out.returncode == 0 else []
    if len(pods) != 1:
        raise StartError(f"expected one running operator Pod, found {len(pods)}\n{describe_operator(bed)}")
    return dict(pods[0])


def describe_operator(bed: Testbed) -> str:
    """The operator pods' state and log tail, for error messages."""
    pods = bed.kubectl_run("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout
    logs = bed.kubectl_run("logs", "-n", NAMESPACE, f"deployment/{DEPLOYMENT}", "--tail=30").stdout
    events = bed.kubectl_run("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp").stdout
    return f"--- pods ---\n{pods}--- events ---\n{events[-3000:]}--- operator log ---\n{logs}"
