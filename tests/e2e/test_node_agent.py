"""The stand-in kubelet is not kinder than a real one where the tests lean on it: a container
gets exactly the env its spec resolves to (plus its image's and the node's), never the test
runner's; a reference that cannot be resolved keeps the pod waiting as a kubelet does; an
image the node does not have is never run; and the termination message is what the
container wrote to /dev/termination-log."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from cachewarm_testbed.cluster import Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

SHOW_ENV = ("import json, os; print(json.dumps(dict(os.environ)));"
            "open('/dev/termination-log', 'w').write('bye from ' + os.environ['HOSTNAME'])")


def create(bed: Testbed, ns: str, obj: dict[str, Any]) -> None:
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    assert created.returncode == 0, created.stderr


def pod(name: str, container: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "probe"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", **container}]}}


def test_a_container_gets_its_spec_env_and_nothing_of_the_runner(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    create(bed, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                            "data": {"A": "from-configmap", "JAX_PLATFORMS": "cpu"}})
    create(bed, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"},
                            "stringData": {"TOKEN": "s3cret"}})
    create(bed, namespace, pod("env", {
        "image": "test/targets:1", "command": ["python", "-c", SHOW_ENV],
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CM_"}],
        "env": [{"name": "PLAIN", "value": "v"},
                {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "A"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "TOKEN"}}},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "CM_A", "value": "env-wins-over-envFrom"}]}))

    def done() -> dict[str, Any] | None:
        obj = bed.get_json("pod", "env", namespace) or {}
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    obj = eventually(done, timeout=120, what="the env pod to finish")
    assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, "env", "c")
    env = json.loads(bed.pod_log(namespace, "env", "c").strip().splitlines()[-1])
    assert (env["PLAIN"], env["A"], env["TOKEN"], env["POD"]) == ("v", "from-configmap", "s3cret", "env")
    assert env["CM_JAX_PLATFORMS"] == "cpu" and env["CM_A"] == "env-wins-over-envFrom"
    assert env["HOSTNAME"] == "env" and "STORAGE_EMULATOR_HOST" in env  # kubelet's and the node's
    # Nothing of the process running the tests (its KUBECONFIG, its own variables).
    assert "KUBECONFIG" not in env and "PYTEST_CURRENT_TEST" not in env
    assert not {k for k in env if k.startswith("CACHEWARM_")}
    [state] = obj["status"]["containerStatuses"]
    assert state["state"]["terminated"]["message"] == "bye from env"
    assert obj["spec"]["nodeName"] == "gke-cpu-0"  # the only node without a taint


@pytest.mark.parametrize(("name", "container", "reason"), [
    ("noimage", {"image": "python:3.11", "command": ["true"]}, "ErrImageNeverPull"),
    ("nokey", {"image": "test/targets:1", "command": ["true"], "env": [
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "X"}}}]},
     "CreateContainerConfigError"),
])
def test_a_pod_the_node_cannot_start_waits_with_the_kubelets_reason(
    node_agent: Proc, controller_manager: Testbed, namespace: str, name: str, container: dict[str, Any],
    reason: str,
) -> None:
    bed = controller_manager
    create(bed, namespace, pod(name, container))

    def waiting() -> dict[str, Any] | None:
        statuses = ((bed.get_json("pod", name, namespace) or {}).get("status") or {}).get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None
    state = eventually(waiting, timeout=60, what=f"{name} waiting")
    assert state["reason"] == reason
    assert (bed.get_json("pod", name, namespace) or {})["status"]["phase"] == "Pending"


def test_a_projected_token_is_one_the_apiserver_issued_for_that_pod(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """As a kubelet does: the token in a projected serviceAccountToken volume comes from the
    TokenRequest API with the volume's audience, bound to the pod, and the container finds
    it under the mount path (here through an env value naming it)."""
    bed = controller_manager
    assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", namespace).returncode == 0
    spec = pod("token", {
        "image": "test/targets:1",
        "command": ["python", "-c", "import os; print(open(os.environ['TOKEN_FILE']).read())"],
        "env": [{"name": "TOKEN_FILE", "value": "/var/run/secrets/cachewarm/token"}],
        "volumeMounts": [{"name": "cachewarm-token", "mountPath": "/var/run/secrets/cachewarm", "readOnly": True}]})
    spec["spec"]["serviceAccountName"] = "trainer"
    spec["spec"]["volumes"] = [{"name": "cachewarm-token", "projected": {"sources": [{"serviceAccountToken": {
        "audience": "cachewarm", "expirationSeconds": 600, "path": "token"}}]}}]
    create(bed, namespace, spec)

    def done() -> dict[str, Any] | None:
        obj = bed.get_json("pod", "token", namespace) or {}
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    obj = eventually(done, timeout=120, what="the token pod to finish")
    assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, "token", "c")
    token = bed.pod_log(namespace, "token", "c").strip().splitlines()[-1]
    review = bed.kubectl_run("create", "-o", "json", "-f", "-", input=json.dumps({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
        "spec": {"token": token, "audiences": ["cachewarm"]}}))
    assert review.returncode == 0, review.stderr
    status = json.loads(review.stdout)["status"]
    assert status["authenticated"] is True and status["audiences"] == ["cachewarm"]
    assert status["user"]["username"] == f"system:serviceaccount:{namespace}:trainer"
    assert status["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["token"]
    assert status["user"]["extra"]["authentication.kubernetes.io/pod-uid"] == [obj["metadata"]["uid"]]
