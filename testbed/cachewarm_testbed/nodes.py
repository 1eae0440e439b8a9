"""Test tooling: Node objects shaped like GKE's node pools, for kube-scheduler to place pods on.

Each simulated node carries the labels, taints and extended-resource capacity that GKE puts
on nodes of that machine type, so the real scheduler decides where a warmer or a training
pod may run exactly as it would on GKE (node selectors, tolerations, GPU/TPU counts). The
node agent then runs what is bound to these nodes, with JAX on the CPU standing in for the
accelerator; nothing here pretends to be a GPU or a TPU beyond the Node object.

Sources (GKE documentation, 2026):
- GPUs: https://cloud.google.com/kubernetes-engine/docs/how-to/gpus (label
  cloud.google.com/gke-accelerator, taint nvidia.com/gpu=present:NoSchedule, resource
  nvidia.com/gpu); a3-highgpu-8g is 208 vCPU, 1872 GB, 8 x H100 80GB
  (https://cloud.google.com/compute/docs/gpus#a3-series).
- TPUs: https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus and
  .../how-to/tpus (labels cloud.google.com/gke-tpu-accelerator and gke-tpu-topology, taint
  google.com/tpu=present:NoSchedule, resource google.com/tpu); ct5lp-hightpu-8t is one host
  of 8 v5e chips (224 vCPU, 400 GB, topology 2x4); ct5p-hightpu-4t is 4 v5p chips per host
  (208 vCPU, 448 GB), so a 2x2x2 v5p slice is two such hosts, each labelled with the
  slice's topology.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GKE_NODEPOOL = "cloud.google.com/gke-nodepool"
GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
GKE_TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_RESOURCE = "google.com/tpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Machine:
    """A GCE machine type as GKE exposes it on a Node."""

    type: str
    cpu: int
    memory_gi: int
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()
    extended: dict[str, int] = field(default_factory=dict)


MACHINES: dict[str, Machine] = {
    "n2-standard-8": Machine("n2-standard-8", 8, 32),
    "a3-highgpu-8g": Machine(
        "a3-highgpu-8g", 208, 1872, {GKE_ACCELERATOR: "nvidia-h100-80gb", "cloud.google.com/gke-gpu": "true"},
        (GPU_TAINT,), {GPU_RESOURCE: 8},
    ),
    "ct5lp-hightpu-8t": Machine(
        "ct5lp-hightpu-8t", 224, 400, {GKE_TPU_ACCELERATOR: "tpu-v5-lite-podslice"}, (TPU_TAINT,), {TPU_RESOURCE: 8},
    ),
    "ct5p-hightpu-4t": Machine(
        "ct5p-hightpu-4t", 208, 448, {GKE_TPU_ACCELERATOR: "tpu-v5p-slice"}, (TPU_TAINT,), {TPU_RESOURCE: 4},
    ),
}


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node: its name, GKE node pool, machine type and (TPU) slice topology."""

    name: str
    pool: str
    machine: str
    topology: str = ""
    address: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "pool": self.pool, "machine": self.machine, "topology": self.topology,
                "address": self.address}


# The default testbed cluster: a CPU pool, an H100 pool, a single-host v5e pool, a
# single-host v5p pool and two node pools of one two-host v5p slice each (so a multi-host
# Job that does not keep its pods on one slice can be split across them, as on GKE). Addresses are loopback /32s that only this
# testbed uses (the node agent serves nothing on them; they name the node in pod status).
DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("gke-cpu-0", "cpu", "n2-standard-8", address="127.0.10.1"),
    NodeSpec("gke-h100-0", "h100", "a3-highgpu-8g", address="127.0.10.2"),
    NodeSpec("gke-v5e-0", "v5e", "ct5lp-hightpu-8t", topology="2x4", address="127.0.10.3"),
    NodeSpec("gke-v5p-0", "v5p", "ct5p-hightpu-4t", topology="2x2x1", address="127.0.10.4"),
    NodeSpec("gke-v5p16-0", "v5p16", "ct5p-hightpu-4t", topology="2x2x2", address="127.0.10.5"),
    NodeSpec("gke-v5p16-1", "v5p16", "ct5p-hightpu-4t", topology="2x2x2", address="127.0.10.6"),
    NodeSpec("gke-v5p16b-0", "v5p16b", "ct5p-hightpu-4t", topology="2x2x2", address="127.0.10.7"),
    NodeSpec("gke-v5p16b-1", "v5p16b", "ct5p-hightpu-4t", topology="2x2x2", address="127.0.10.8"),
)


def node_object(spec: NodeSpec) -> dict[str, Any]:
    """The Node (metadata and spec) GKE would register for `spec`. Raises KeyError for an
    unknown machine type."""
    machine = MACHINES[spec.machine]
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        INSTANCE_TYPE: machine.type,
        GKE_NODEPOOL: spec.pool,
        **machine.labels,
    }
    if spec.topology:
        labels[GKE_TPU_TOPOLOGY] = spec.topology
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {"taints": [dict(t) for t in machine.taints]} if machine.taints else {},
    }


def node_status(spec: NodeSpec, *, now: str, kubelet_version: str) -> dict[str, Any]:
    """status of a Ready node: capacity (with GPUs/TPUs), conditions, address, node info."""
    machine = MACHINES[spec.machine]
    capacity = {"cpu": str(machine.cpu), "memory": f"{machine.memory_gi}Gi", "pods": "110",
                "ephemeral-storage": "100Gi", **{k: str(v) for k, v in machine.extended.items()}}
    conditions = [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "cachewarm testbed node agent",
         "lastHeartbeatTime": now, "lastTransitionTime": now},
        *({"type": t, "status": "False", "reason": f"KubeletHasSufficient{t[:-8] or t}", "lastHeartbeatTime": now,
           "lastTransitionTime": now} for t in ("MemoryPressure", "DiskPressure", "PIDPressure")),
    ]
    return {
        "capacity": capacity, "allocatable": dict(capacity), "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": spec.address}, {"type": "Hostname", "address": spec.name}],
        "nodeInfo": {"kubeletVersion": kubelet_version, "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "cachewarm-testbed://local-process", "kernelVersion": "",
                     "osImage": "cachewarm testbed", "machineID": "", "systemUUID": "", "bootID": "",
                     "kubeProxyVersion": ""},
    }
