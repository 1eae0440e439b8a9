"""The stand-in kubelet is not kinder than a real one where the tests lean on it: a container
gets exactly the env its spec resolves to (plus its image's and the node's), never the test
runner's; a reference that cannot be resolved keeps the pod waiting as a kubelet does; an
image the node does not have is never run; each image is a folder of its own holding only
what its Dockerfile installs, and python is not found in an image without it; volume mounts
honour subPath and readOnly; and the termination message is what the container wrote to
/dev/termination-log."""

from __future__ import annotations

import json
from pathlib import Path
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


def run_to_end(bed: Testbed, ns: str, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = bed.get_json("pod", name, ns) or {}
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    return eventually(done, timeout=120, what=f"pod {name} to finish")


# What a container of an image finds: its marker, its working directory's files, its ENV,
# and which modules its python can import.
LOOK_AROUND = """
import importlib.util, json, os, sys
found = {m: importlib.util.find_spec(m) is not None
         for m in ("jax", "gcsfs", "etils", "kubernetes", "cachewarm", "cachewarm_testbed", "pytest", "yaml")}
print(json.dumps({"marker": open(sys.argv[1]).read().strip(), "cwd": os.getcwd(), "files": sorted(os.listdir()),
                  "pythonpath": os.path.realpath(os.environ.get("PYTHONPATH") or "."),
                  "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
                  "prefix": sys.prefix, "found": found}))
"""


def test_each_image_is_its_own_folder_with_only_what_its_dockerfile_installs(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """demo/train:1 and :2 are two builds of demo/Dockerfile: two folders, each with its
    marker, the Dockerfile's files in its WORKDIR and its ENV (PYTHONPATH=/app standing for
    that folder). Its stage `plain` installs jax alone: gcsfs and etils are not importable
    there. None of the test runner's own packages is importable in any image."""
    bed = controller_manager
    images = {"one": "demo/train:1", "two": "demo/train:2", "plain": "cachewarm/demo-train-plain:0.1.0"}
    for name, image in images.items():
        create(bed, namespace, pod(name, {"image": image, "command": [
            "python", "-c", LOOK_AROUND, "/etc/cachewarm-testbed-image"]}))
    seen: dict[str, dict[str, Any]] = {}
    for name in images:
        obj = run_to_end(bed, namespace, name)
        assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, name, "c")
        seen[name] = json.loads(bed.pod_log(namespace, name, "c").strip().splitlines()[-1])
    assert {name: s["marker"] for name, s in seen.items()} == images
    assert seen["one"]["cwd"] != seen["two"]["cwd"]
    for name in images:
        assert set(seen[name]["files"]) - {"__pycache__"} == {"programs.py", "train.py"}
        assert seen[name]["pythonpath"] == seen[name]["cwd"] and seen[name]["unbuffered"] == "1"
        assert not any(seen[name]["found"][m] for m in ("kubernetes", "cachewarm", "cachewarm_testbed", "pytest",
                                                       "yaml")), seen[name]["found"]
    assert seen["one"]["found"]["jax"] and seen["one"]["found"]["gcsfs"] and seen["one"]["found"]["etils"]
    assert seen["plain"]["found"]["jax"] and not seen["plain"]["found"]["gcsfs"]
    assert not seen["plain"]["found"]["etils"]
    assert seen["plain"]["prefix"] != seen["one"]["prefix"]


def test_python_in_an_image_without_it_fails_to_start(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """The warmer image (busybox) has no python: a container asking for it never runs, as
    runc's exec fails (StartError, exit code 128), instead of finding the host's."""
    bed = controller_manager
    create(bed, namespace, pod("nopython", {"image": "cachewarm/warmer:0.1.0", "command": ["python", "-c", "pass"]}))
    obj = run_to_end(bed, namespace, "nopython")
    assert obj["status"]["phase"] == "Failed"
    [state] = obj["status"]["containerStatuses"]
    term = state["state"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("StartError", 128)
    assert 'exec: "python": executable file not found' in term["message"]


# Reads and writes through each mount, reporting what worked: errno 30 is EROFS.
USE_MOUNTS = """
import errno, json, os
def write(path):
    try:
        with open(path, "w") as out:
            out.write("written")
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
print(json.dumps({
    "whole": sorted(os.listdir(os.environ["WHOLE"])),
    "whole_write": write(os.environ["WHOLE"] + "/new.txt"),
    "sub": sorted(os.listdir(os.environ["SUB"])),
    "sub_write": write(os.environ["SUB"] + "/from-main.txt"),
    "file": open(os.environ["FILE"]).read(),
    "file_write": write(os.environ["FILE"]),
    "made": os.path.isdir(os.environ["MADE"]),
}))
"""


def test_volume_mounts_honour_subpath_and_read_only(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """As a kubelet mounts them: a subPath mounts only that directory or file of the volume
    (one that does not exist is made a directory), and a readOnly mount cannot be written
    through (EROFS), while the init container that filled the volume could write it and a
    writable subPath mount of the same volume still can."""
    bed = controller_manager
    fill = ("import os; d = os.environ['DATA']; os.makedirs(d + '/sub'); open(d + '/sub/inner.txt', 'w').write('inner'); "
            "open(d + '/top.txt', 'w').write('top')")
    spec = pod("mounts", {
        "image": "test/targets:1", "command": ["python", "-c", USE_MOUNTS],
        "env": [{"name": "WHOLE", "value": "/whole"}, {"name": "SUB", "value": "/sub"},
                {"name": "FILE", "value": "/config/top.txt"}, {"name": "MADE", "value": "/made"}],
        "volumeMounts": [{"name": "data", "mountPath": "/whole", "readOnly": True},
                         {"name": "data", "mountPath": "/sub", "subPath": "sub"},
                         {"name": "data", "mountPath": "/config/top.txt", "subPath": "top.txt", "readOnly": True},
                         {"name": "data", "mountPath": "/made", "subPath": "not/there/yet"}]})
    spec["spec"]["initContainers"] = [{"name": "fill", "image": "test/targets:1", "command": ["python", "-c", fill],
                                       "env": [{"name": "DATA", "value": "/data"}],
                                       "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
    spec["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    create(bed, namespace, spec)
    obj = run_to_end(bed, namespace, "mounts")
    assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, "mounts", "c")
    seen = json.loads(bed.pod_log(namespace, "mounts", "c").strip().splitlines()[-1])
    assert seen["whole"] == ["not", "sub", "top.txt"] and seen["whole_write"] == "EROFS"
    assert seen["sub"] == ["inner.txt"] and seen["sub_write"] == "ok"
    assert seen["file"] == "top" and seen["file_write"] == "EROFS"
    assert seen["made"] is True


def test_what_a_container_writes_into_its_images_files_no_later_container_sees(
    node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """Each container writes into a layer of its own over the image's files (as containerd's
    snapshots do): a file a first pod leaves in its working directory (/app) is not there for
    a second pod of the same image, nor in the image's folder every container reads."""
    bed = controller_manager
    write = "import os; open('left-by-first', 'w').write('x'); print(os.getcwd())"
    look = "import json, os; print(json.dumps(sorted(os.listdir())))"
    create(bed, namespace, pod("first", {"image": "demo/train:1", "command": ["python", "-c", write]}))
    obj = run_to_end(bed, namespace, "first")
    assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, "first", "c")
    image_folder = bed.pod_log(namespace, "first", "c").strip().splitlines()[-1]
    create(bed, namespace, pod("second", {"image": "demo/train:1", "command": ["python", "-c", look]}))
    obj = run_to_end(bed, namespace, "second")
    assert obj["status"]["phase"] == "Succeeded", bed.pod_log(namespace, "second", "c")
    files = json.loads(bed.pod_log(namespace, "second", "c").strip().splitlines()[-1])
    assert "train.py" in files and "left-by-first" not in files, files
    assert not (Path(image_folder) / "left-by-first").exists()
