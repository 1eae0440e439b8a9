"""Install cachewarm on a testbed the way a user does: `kubectl apply -k` of manifests/.

The operator then runs from its image on the real node (cachewarm_testbed.realnode), in
its namespace, under its ServiceAccount and the Deployment's security context, and the
apiserver calls its webhook through the Service. The only layer on top of manifests/ is
a kustomize overlay with what any cluster without real GCS needs: the operator's env
pointing at the GCS emulator (STORAGE_EMULATOR_HOST, as google-cloud-storage reads it),
optional settings such as a shorter poll interval, and, since this testbed has no cluster
DNS, a fixed ClusterIP for the webhook Service (REPORT_IP) that training pods report to by
address: the operator's certificate names it (CACHEWARM_WEBHOOK_HOSTS) and
CACHEWARM_REPORT_URL points there. On a cluster with DNS the manifests' defaults (the
Service's name) do the same. The images keep the names the manifests
use, so nothing is rewritten there: they are already in the node's containerd (imported
from cachewarm_testbed.images), and the default pull policy finds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from cachewarm.runtime.leader import parse_identity
from cachewarm_testbed.processes import StartError

if TYPE_CHECKING:
    from cachewarm_testbed.cluster import Testbed
    from cachewarm_testbed.realnode import RealNode

NAMESPACE = "cachewarm-system"
DEPLOYMENT = "cachewarm-operator"
WEBHOOK_CONFIGURATION = "cachewarm-pod-injector"
LEASE = "cachewarm-operator"
SERVICE = "cachewarm-webhook"
# In the testbed's Service range (cluster.SERVICE_CIDR), in its low band that the apiserver
# keeps for addresses asked for by name.
REPORT_IP = "10.96.0.100"
REPORT_ENV = {
    "CACHEWARM_REPORT_URL": f"https://{REPORT_IP}:9444/report/v1",  # the Service's reports port
    "CACHEWARM_WEBHOOK_HOSTS": json.dumps([f"{SERVICE}.{NAMESPACE}.svc", f"{SERVICE}.{NAMESPACE}.svc.cluster.local",
                                           REPORT_IP]),
}


def overlay(dest: Path, manifests: Path, env: dict[str, str]) -> Path:
    """Write a kustomization in `dest` that takes `manifests` as is, adds REPORT_ENV and
    `env` to the operator container and gives the webhook Service REPORT_IP. Returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    patch = [{"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": k, "value": v}}
             for k, v in {**REPORT_ENV, **env}.items()]
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(manifests, dest)],
    }
    kustomization["patches"] = [
        {"target": {"kind": "Deployment", "name": DEPLOYMENT}, "patch": json.dumps(patch)},
        {"target": {"kind": "Service", "name": SERVICE},
         "patch": json.dumps([{"op": "add", "path": "/spec/clusterIP", "value": REPORT_IP}])},
    ]
    (dest / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return dest


def install_operator(bed: Testbed, manifests: Path, env: dict[str, str], timeout: float = 110.0) -> dict[str, Any]:
    """`kubectl apply -k` manifests/ (through `overlay`), then wait until the operator's
    Deployment is available (every replica Ready), its webhook configuration carries a CA
    bundle and one replica holds the leader Lease. Returns that replica's Pod. Raises
    StartError with the rollout's state and the pods' log tails."""
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
        hooks = config.get("webhooks") or []
        if hooks and all(w.get("clientConfig", {}).get("caBundle") for w in hooks):
            return leader_pod(bed)
        time.sleep(0.5)
    raise StartError(f"the operator never filled the caBundle of {WEBHOOK_CONFIGURATION}\n{describe_operator(bed)}")


def operator_pods(bed: Testbed) -> list[dict[str, Any]]:
    """The operator's running Pods (not being deleted), by name."""
    out = bed.kubectl_run("get", "pods", "-n", NAMESPACE, "-l",
                          "app.kubernetes.io/name=cachewarm,app.kubernetes.io/component=operator",
                          "--field-selector=status.phase=Running", "-o", "json")
    pods = json.loads(out.stdout)["items"] if out.returncode == 0 else []
    return sorted((dict(p) for p in pods if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: str(p["metadata"]["name"]))


def lease_identity(bed: Testbed) -> str | None:
    """The leader Lease's holderIdentity as written (`<pod>@<address>`), or None."""
    return ((bed.get_json("lease", LEASE, NAMESPACE) or {}).get("spec") or {}).get("holderIdentity") or None


def lease_holder(bed: Testbed) -> str | None:
    """The name of the Pod holding the leader Lease (its identity without the `@address`
    where it takes reports), or None."""
    holder = lease_identity(bed)
    return parse_identity(holder)[0] if holder else None


def leader_pod(bed: Testbed, timeout: float = 60.0) -> dict[str, Any]:
    """The running operator Pod that holds the leader Lease (waits up to `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holder = lease_holder(bed)
        for pod in operator_pods(bed):
            if pod["metadata"]["name"] == holder:
                return pod
        time.sleep(0.5)
    raise StartError(f"no running operator Pod holds Lease {NAMESPACE}/{LEASE} (holder: {lease_holder(bed)})\n"
                     f"{describe_operator(bed)}")


def describe_operator(bed: Testbed) -> str:
    """The operator pods' state and log tail, for error messages."""
    pods = bed.kubectl_run("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout
    logs = bed.kubectl_run("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator",
                           "--prefix", "--tail=30").stdout
    events = bed.kubectl_run("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp").stdout
    return f"--- pods ---\n{pods}--- events ---\n{events[-3000:]}--- operator log ---\n{logs}"


# How pods of a testbed cluster find GCS (the emulator behind the testbed's proxy).
GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@contextlib.contextmanager
def on_real_node(env: Mapping[str, str] | None = None, *, torch: bool = False
                 ) -> Iterator[tuple[Testbed, RealNode, dict[str, Any]]]:
    """(the control plane, the real node, the operator's leader Pod): a control plane with
    the controller manager and a real node holding our images (the torch demo's too, with
    `torch`), cachewarm installed by `kubectl apply -k manifests/` with the GCS emulator's
    address and `env` in the operator's env. Everything is stopped after the block."""
    from cachewarm_testbed import images  # noqa: PLC0415 - buildah only where this runs
    from cachewarm_testbed.cluster import Testbed, repo_root  # noqa: PLC0415 - cluster imports this module

    archives = images.build_all(torch=torch)
    bed = Testbed()
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        bed_env = bed.env()
        operator = install_operator(bed, repo_root() / "manifests",
                                    {**{k: bed_env[k] for k in GCS_ENV}, **(env or {})})
        yield bed, node, operator
    finally:
        bed.stop()
