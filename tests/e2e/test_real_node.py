"""A real node in the testbed: kubelet v1.36.3 + containerd + runc + CNI bridge + kube-proxy
run real busybox pods (init container into an emptyDir, termination message, a Job of 3
completions, `kubectl logs`), pods reach the apiserver through the `kubernetes` Service and
the GCS proxy on the node address, the host reaches a pod through its Service's ClusterIP
(as the apiserver reaches the webhook), and stopping the testbed leaves the host as it was.

Needs root on Linux and `make node-deps` (skipped, with the reason, without root). It has
its own testbed: the kubelet uses fixed host paths, so only one real node runs per machine
(a lock file guards it), and the session's simulated-node fixtures never see this node.
The last test stops the testbed itself and compares the host with the snapshot taken
before start, so the tests here run in file order.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachewarm_testbed import realnode
from cachewarm_testbed.cluster import Testbed, eventually
from cachewarm_testbed.processes import StartError
from cachewarm_testbed.realnode import BUSYBOX_IMAGE, NODE_IP, NODE_NAME, POD_CIDR, HostSnapshot, RealNode

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="a real kubelet and containerd need root"),
]


@dataclass
class RealBed:
    bed: Testbed
    node: RealNode
    before: HostSnapshot


@pytest.fixture(scope="module")
def real() -> Iterator[RealBed]:
    before = HostSnapshot.take()
    bed = Testbed()
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        yield RealBed(bed, node, before)
    finally:
        bed.stop()


@pytest.fixture
def ns(real: RealBed) -> str:
    name = f"rn-{uuid.uuid4().hex[:8]}"
    made = real.bed.kubectl_run("create", "namespace", name)
    assert made.returncode == 0, made.stderr
    return name


def busybox(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", script], **extra}


def wait(bed: Testbed, *args: str) -> None:
    out = bed.kubectl_run("wait", "--timeout=120s", *args)
    assert out.returncode == 0, out.stderr + out.stdout


def test_node_registered_with_its_own_address(real: RealBed) -> None:
    node = real.bed.get_json("node", NODE_NAME, "default")
    assert node is not None
    assert {"type": "InternalIP", "address": NODE_IP} in node["status"]["addresses"]
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")


def test_init_container_emptydir_termination_message_and_logs(real: RealBed, ns: str) -> None:
    bed = real.bed
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "work", "emptyDir": {}}],
            "initContainers": [busybox("writer", "echo hello-from-init > /work/msg",
                                       volumeMounts=[{"name": "work", "mountPath": "/work"}])],
            "containers": [busybox("main", "cat /work/msg; echo \"read $(cat /work/msg)\" > /dev/termination-log",
                                   volumeMounts=[{"name": "work", "mountPath": "/work"}])],
        },
    }
    bed.apply(pod, ns)
    wait(bed, "--for=jsonpath={.status.phase}=Succeeded", "pod/reader", "-n", ns)

    got = bed.get_json("pod", "reader", ns)
    assert got is not None
    assert got["spec"]["nodeName"] == NODE_NAME
    assert got["status"]["hostIP"] == NODE_IP
    assert ipaddress.ip_address(got["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)
    init = got["status"]["initContainerStatuses"][0]["state"]["terminated"]
    assert init["exitCode"] == 0
    main = got["status"]["containerStatuses"][0]["state"]["terminated"]
    assert main["exitCode"] == 0
    # Written by the container into /dev/termination-log, read back by the kubelet.
    assert main["message"] == "read hello-from-init\n"

    logs = bed.kubectl_run("logs", "reader", "-c", "main", "-n", ns)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == "hello-from-init\n"


def test_job_of_three_completions(real: RealBed, ns: str) -> None:
    bed = real.bed
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "three"},
        "spec": {"completions": 3, "parallelism": 3, "backoffLimit": 0,
                 "template": {"spec": {"restartPolicy": "Never",
                                       "containers": [busybox("c", "echo done-$HOSTNAME")]}}},
    }
    bed.apply(job, ns)
    wait(bed, "--for=condition=Complete", "job/three", "-n", ns)
    got = bed.get_json("job", "three", ns)
    assert got is not None and got["status"]["succeeded"] == 3

    pods = bed.kubectl_run("get", "pods", "-n", ns, "-l", "job-name=three", "-o", "json")
    assert pods.returncode == 0, pods.stderr
    names = [p["metadata"]["name"] for p in json.loads(pods.stdout)["items"]]
    assert len(names) == 3
    for name in names:
        logs = bed.kubectl_run("logs", name, "-n", ns)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout == f"done-{name}\n"


def guard_dropped() -> int:
    out = subprocess.run(["iptables", "-w", "-L", realnode.GUARD_CHAIN, "-v", "-x", "-n"],
                         capture_output=True, text=True, check=True, timeout=30)
    return sum(int(line.split()[0]) for line in out.stdout.splitlines()[2:] if line.split())


def run_pod(bed: Testbed, ns: str, name: str, script: str) -> str:
    """Run `script` in a busybox pod to completion; return its log."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never", "containers": [busybox("c", script)]}}
    bed.apply(pod, ns)
    wait(bed, "--for=jsonpath={.status.phase}=Succeeded", f"pod/{name}", "-n", ns)
    logs = bed.kubectl_run("logs", name, "-n", ns)
    assert logs.returncode == 0, logs.stderr
    return logs.stdout


def test_pods_reach_the_apiserver_through_the_kubernetes_service(real: RealBed, ns: str) -> None:
    """What an in-cluster client does: KUBERNETES_SERVICE_HOST is the ClusterIP, which
    kube-proxy sends to the apiserver on the node address."""
    out = run_pod(real.bed, ns, "incluster",
                  'echo "host=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"; '
                  'nc -w 5 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT </dev/null; echo rc=$?')
    assert "host=10.96.0.1:443" in out.split(), out
    assert "rc=0" in out.split(), out  # the TCP connection through the ClusterIP was accepted


def test_pods_reach_the_gcs_proxy_on_the_node_address(real: RealBed, ns: str) -> None:
    bed = real.bed
    assert bed.storage_emulator_host.startswith(f"http://{NODE_IP}:")
    out = run_pod(bed, ns, "gcs", f"wget -q -O - '{bed.storage_emulator_host}/storage/v1/b?project=testbed'; "
                                  "echo \" rc=$?\"")
    assert "rc=0" in out.split(), out
    assert "storage#buckets" in out, out


def test_the_host_reaches_a_pod_through_its_service_clusterip(real: RealBed, ns: str) -> None:
    """The apiserver calls an admission webhook through its Service's ClusterIP from the
    host: the same path, with busybox httpd behind a selector Service."""
    bed = real.bed
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": {"app": "web"}},
           "spec": {"containers": [busybox("c", "mkdir -p /www && echo served-by-$HOSTNAME > /www/index.html "
                                                "&& exec httpd -f -p 8080 -h /www",
                                           ports=[{"containerPort": 8080, "name": "http"}])]}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    bed.apply(pod, ns)
    bed.apply(service, ns)
    wait(bed, "--for=condition=Ready", "pod/web", "-n", ns)
    svc = bed.get_json("service", "web", ns)
    assert svc is not None
    cluster_ip = svc["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network("10.96.0.0/16")

    def answered() -> str | None:
        try:
            with urllib.request.urlopen(f"http://{cluster_ip}/index.html", timeout=3) as resp:
                return str(resp.read().decode())
        except OSError:
            return None
    assert eventually(answered, timeout=60, what=f"{cluster_ip}:80 answering") == "served-by-web\n"


def test_pod_traffic_to_an_unserved_clusterip_is_dropped_on_the_host(real: RealBed, ns: str) -> None:
    """kube-proxy has no rule for a ClusterIP no Service holds, so the packet would be
    routed out of the host's interface: the FORWARD guard must drop it (its counter grows,
    the connection fails)."""
    bed = real.bed
    dropped = guard_dropped()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "leak"},
           "spec": {"restartPolicy": "Never",
                    "containers": [busybox("c", "nc -w 3 10.96.255.254 443 </dev/null; echo rc=$?")]}}
    bed.apply(pod, ns)
    wait(bed, "--for=jsonpath={.status.phase}=Succeeded", "pod/leak", "-n", ns)
    logs = bed.kubectl_run("logs", "leak", "-n", ns)
    assert logs.returncode == 0, logs.stderr
    assert "rc=1" in logs.stdout.split(), logs.stdout  # nc gave up: nothing answered
    assert guard_dropped() > dropped


def test_second_real_node_is_refused_clearly(real: RealBed, tmp_path: Any) -> None:
    other = RealNode(tmp_path, real.bed.kubeconfig, real.node.kubelet_bin.parent, "10.96.0.0/16")
    with pytest.raises(StartError, match="another real node runs on this machine"):
        other.start(lock_timeout=0)


def test_stop_leaves_the_host_as_it_was(real: RealBed) -> None:
    """Runs last: stops the testbed and compares the host with the snapshot before start
    (mounts, iptables chains and rules, sysctls, lo addresses, links, kubepods cgroups,
    fixed paths, processes of ours)."""
    during = HostSnapshot.take()
    assert real.before.differences(during), "the running node changed nothing the snapshot sees"
    assert f"{NODE_IP}/32" in during.lo_addresses
    assert any(realnode.GUARD_CHAIN in rule for rule in during.iptables["iptables-save"]["filter"])
    assert any(c.endswith("/kubepods") for c in during.cgroups)
    assert during.processes and during.mounts

    real.bed.stop()
    after = HostSnapshot.take()
    changed = {k: v for k, v in real.before.differences(during).items() if k not in ("cgroups", "mounts")}
    print("changed while running (besides cgroups and mounts):", json.dumps(changed, indent=1))
    print("timings:", real.node.timings)
    assert real.before.differences(after) == {}, real.before.differences(after)


def test_failed_start_names_the_process_and_restores_the_host(real: RealBed, tmp_path: Path) -> None:
    """After the node above is gone: a kubelet that dies at once gives a StartError with
    its name and log tail, and the half-started node (containerd, guard, address) is undone."""
    real.bed.stop()  # only one real node per machine
    before = HostSnapshot.take()
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "kubelet").write_text("#!/bin/sh\necho 'kubelet: simulated failure' >&2\nexit 3\n")
    (bins / "kubelet").chmod(0o755)
    (bins / "kube-proxy").symlink_to(real.node.kube_proxy_bin)
    node = RealNode(tmp_path / "node", tmp_path / "kubeconfig", bins, "10.96.0.0/16")
    with pytest.raises(StartError, match=r"kubelet exited \(code 3\)[\s\S]*simulated failure"):
        node.start()
    assert before.differences(HostSnapshot.take()) == {}


KILLED_RUN = """
import sys, time
from pathlib import Path
from cachewarm_testbed.cluster import Testbed
bed = Testbed(Path(sys.argv[1])).start(controller_manager=True, real_node=True)
bed.start_real_node()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_run_is_undone_by_the_next_start(real: RealBed, tmp_path: Path) -> None:
    """A test run killed with SIGKILL never reaches stop(): its kubelet, containerd, cgroups,
    address and rules stay. The next real node's start undoes them from the snapshot the
    killed one recorded (here that start then fails on purpose, at its kubelet)."""
    real.bed.stop()  # only one real node per machine
    before = HostSnapshot.take()
    workdir = tmp_path / "killed"
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(workdir)], stdout=subprocess.PIPE, text=True)
    try:
        try:
            assert run.stdout is not None and run.stdout.readline().strip() == "ready"
        finally:
            run.kill()
            run.wait()
        left = HostSnapshot.take()
        assert any(c.endswith("/kubepods") for c in left.cgroups) and f"{NODE_IP}/32" in left.lo_addresses
        assert any("kubelet" in cmd for _, cmd in left.processes)

        bins = tmp_path / "bin"
        bins.mkdir()
        (bins / "kubelet").write_text("#!/bin/sh\nexit 3\n")
        (bins / "kubelet").chmod(0o755)
        (bins / "kube-proxy").symlink_to(real.node.kube_proxy_bin)
        with pytest.raises(StartError, match=r"kubelet exited \(code 3\)"):
            RealNode(tmp_path / "node", tmp_path / "kubeconfig", bins, "10.96.0.0/16").start()
    finally:
        killed_bed = Testbed.load(workdir)
        if killed_bed is not None:
            killed_bed.stop()  # the killed run's control plane
    assert before.differences(HostSnapshot.take()) == {}


# --- issue 28: what cachewarm injects runs with least privilege (builders' part) ----------

@pytest.fixture
def with_warmer() -> Iterator[tuple[Testbed, RealNode]]:
    """A real node of its own (the tests above stopped theirs: one per machine) holding the
    warmer image, which cachewarm's init containers copy their tools from. Only that image
    is built (cached by content). Per test, so that the node is gone before a later
    fixture of this file starts its own."""
    from cachewarm_testbed import images  # noqa: PLC0415 - buildah only where this runs
    yield from node_holding(images.WARMER_IMAGE)


def node_holding(ref: str) -> Iterator[tuple[Testbed, RealNode]]:
    """A control plane (with the controller manager) and a real node holding the image
    `ref` (only that one built, cached by content); both stopped after the yield."""
    from cachewarm_testbed import images  # noqa: PLC0415 - buildah only where this runs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(images, "BUILDS", tuple(b for b in images.BUILDS if b.ref == ref))
        archives = images.build_all()
    bed = Testbed()
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        yield bed, node
    finally:
        bed.stop()


def runtime_spec(node: RealNode, container_id: str) -> dict[str, Any]:
    """The OCI runtime spec containerd handed runc for a container (`ctr containers info`)."""
    info = node.ctr("containers", "info", container_id.removeprefix("containerd://"))
    spec: dict[str, Any] = json.loads(info.stdout)["Spec"]
    return spec


def test_our_init_containers_run_unprivileged_beside_a_privileged_root_container_that_cannot_write_the_copy(
        with_warmer: tuple[Testbed, RealNode]) -> None:
    """D7 and D1 on a real kubelet + containerd + runc. The pod patch is the webhook's
    (admit_pod, the same function the webhook runs; this bed has no operator, so the pod
    is created with the patch applied, as the apiserver would store it after the webhook).
    tests/e2e/test_real_install.py shows D7 (and D8) through the installed operator's
    webhook; this one stays for what that one's pod does not get there: three init
    containers (the recorder, cachewarm-pythonpath, beside the copier), the shape of a pod
    that sets its PYTHONPATH when the cache has no boot ConfigMap the operator verified
    (D4), which a healthy install copies in process instead.
    The training container is privileged, root, with SYS_ADMIN added: each init container
    we add still runs as 65532 with no capabilities, no new privileges, RuntimeDefault
    seccomp and a read-only root, as runc was told (the runtime spec containerd kept) and
    as the files they wrote show (their owner); the training container reads the copy
    read-only (EROFS on a write). The copier finds no python in busybox and says so (the
    pod starts cold): its privileges are what this test is about, not the copy."""
    from cachewarm.admission import admit  # noqa: PLC0415
    from cachewarm.builders.reporting import Reporting  # noqa: PLC0415
    from cachewarm_testbed.images import WARMER_IMAGE  # noqa: PLC0415
    bed, node = with_warmer
    ns = f"rn-{uuid.uuid4().hex[:8]}"
    assert bed.kubectl_run("create", "namespace", ns).returncode == 0
    eventually(lambda: bed.get_json("serviceaccount", "default", ns), what="default ServiceAccount")  # the token's
    spec = {"storage": {"gcs": {"bucket": "b-1", "location": "US", "prefix": "p"}},
            "injection": {"mode": "ReadOnly", "report": True, "localCopy": {"sizeLimit": "64Mi"}},
            "warmup": {"image": BUSYBOX_IMAGE, "targets": ["m:f"], "pools": [{"name": "cpu"}]}}
    entry = admit.index_entry(spec, generation=1, uid="u-1", warmed=True)
    script = ('echo "uid=$(id -u)"; grep CapEff /proc/self/status; '
              'for f in /cachewarm-reporter/*; do echo "owner $(stat -c %u "$f") $f"; done; '
              'out=$(touch /cachewarm-cache/planted 2>&1); echo "write-rc=$? $out"; '
              'cat /cachewarm-reporter/local-copy.json')
    train = busybox("train", script, env=[{"name": "PYTHONPATH", "value": "/app"}],
                    securityContext={"privileged": True, "runAsUser": 0, "capabilities": {"add": ["SYS_ADMIN"]}})
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "privileged", "namespace": ns, "labels": {"cachewarm.dev/cache": "llama"}},
           # Its token explicit: admit_pod runs here before the apiserver's ServiceAccount
           # plugin would have given it one (a pod without either opted out of tokens).
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": True, "containers": [train]}}
    answer = admit.admit_pod(pod, lambda n, name: entry if (n, name) == (ns, "llama") else None,
                             Reporting(WARMER_IMAGE, "https://10.96.0.100/report/v1", "PEM"), WARMER_IMAGE)
    pod["spec"].update(answer.spec)
    pod["metadata"]["annotations"] = answer.annotations
    assert [ct["name"] for ct in pod["spec"]["initContainers"]] == [
        "cachewarm-reporter", "cachewarm-pythonpath", "cachewarm-copy"]
    # As JSON: YAML would hand kubectl the ReadOnly threshold 1e9 as a number, not a string.
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=json.dumps(pod))
    assert created.returncode == 0, created.stderr
    wait(bed, "--for=jsonpath={.status.phase}=Succeeded", "pod/privileged", "-n", ns)
    got = bed.get_json("pod", "privileged", ns)
    assert got is not None
    for status in got["status"]["initContainerStatuses"]:
        assert status["state"]["terminated"]["exitCode"] == 0, status
        runtime = runtime_spec(node, status["containerID"])
        process = runtime["process"]
        assert process["user"]["uid"] == 65532, (status["name"], process["user"])
        assert all(not process["capabilities"].get(kind) for kind in
                   ("bounding", "effective", "permitted", "inheritable", "ambient")), (status["name"], process)
        assert process.get("noNewPrivileges") is True, status["name"]
        assert runtime["root"].get("readonly") is True, status["name"]
        assert "seccomp" in runtime["linux"], status["name"]  # RuntimeDefault: a profile, not unconfined
    logs = bed.kubectl_run("logs", "privileged", "-c", "train", "-n", ns)
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert "uid=0" in lines and not any(line.endswith("0000000000000000") for line in lines if "CapEff" in line)
    owners = {line.split()[2]: line.split()[1] for line in lines if line.startswith("owner ")}
    assert {"/cachewarm-reporter/busybox", "/cachewarm-reporter/image-pythonpath",
            "/cachewarm-reporter/local-copy.json"} <= set(owners), lines
    assert set(owners.values()) == {"65532"}, owners  # written by our init containers, as 65532
    write = next(line for line in lines if line.startswith("write-rc="))
    assert not write.startswith("write-rc=0") and "Read-only file system" in write, write
    assert "could not run python" in lines[-1], lines[-1]


# --- issue 28: the copier keeps only what it checked (agents' part) --------------------------

@pytest.fixture(scope="module")
def with_train() -> Iterator[tuple[Testbed, RealNode]]:
    """A real node of its own holding the plain training image (python and jax, no GCS
    library), in which the copier runs as a pod's python runs it. Only that image is built
    (cached by content)."""
    from cachewarm_testbed import images  # noqa: PLC0415 - buildah only where this runs
    yield from node_holding(f"docker.io/{images.PLAIN_TRAIN_IMAGE}")


def test_a_tampered_entry_and_a_symlink_planted_in_the_copy_are_replaced_by_the_next_copy_after_a_restart(
        with_train: tuple[Testbed, RealNode]) -> None:
    """In a real pod (kubelet, containerd, runc; the copy an emptyDir, which outlives a
    container restart): the training container copies (the copier as a pod's python runs
    it, pinned manifest from the GCS emulator over the node address), then plants what a
    process with the copy mounted writable could: an entry's name holding other bytes of
    the same size and the same CRC32C, and a symlink under another entry's name; it exits 1
    and the kubelet restarts it (OnFailure). The next copy keeps only the entry it verified
    (present 1: the hit that is real), replaces the other two with GCS's bytes (replaced
    2), and the files are GCS's. The copy by init container is read-only to the training
    container (the test above); this is the in-process copy's case, the pod's own volume."""
    import base64  # noqa: PLC0415
    import hashlib  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415

    from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
    from google.cloud import storage  # noqa: PLC0415

    from cachewarm.agents import copier  # noqa: PLC0415
    from cachewarm_testbed.images import PLAIN_TRAIN_IMAGE  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location(
        "test_copier", Path(__file__).resolve().parents[1] / "integration" / "test_copier.py")
    assert spec is not None and spec.loader is not None
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)  # the integration tests' forgery and manifest helpers
    bed, _ = with_train
    gcs = storage.Client(project="testbed", credentials=AnonymousCredentials(),
                         client_options={"api_endpoint": bed.storage_emulator_host})
    bucket = f"rn-copy-{uuid.uuid4().hex[:8]}"
    gcs.create_bucket(bucket, location="us-central1")
    names = [f"jax/{helpers.entry(f'jit_p{i}', str(i))}" for i in range(3)]
    data = {n: os.urandom(1000 + i) for i, n in enumerate(names)}
    for name in names:
        gcs.bucket(bucket).blob(name).upload_from_string(data[name])
    pool = helpers.manifest(gcs, bucket, "cpu", names)
    forged = helpers.crc32c_forgery(data[names[0]], b"#!evil" + data[names[0]][6:])
    ns = f"rn-{uuid.uuid4().hex[:8]}"
    assert bed.kubectl_run("create", "namespace", ns).returncode == 0
    tools = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tools"},
             "data": {"copier.py": Path(copier.__file__).read_text()},
             "binaryData": {"forged": base64.b64encode(forged).decode()}}
    assert bed.kubectl_run("create", "-n", ns, "-f", "-", input=json.dumps(tools)).returncode == 0
    e0, e1 = (helpers.base(n) for n in names[:2])
    # The first run's summary is kept in another emptyDir: the testbed's containerd does not
    # keep an exited container's log once the kubelet has restarted it (`logs --previous`).
    script = ("if [ ! -e /out/planted ]; then python -I -S /tools/copier.py > /out/first && "
              f"cp /tools/forged /copy/{e0} && rm /copy/{e1} && ln -s /tools/forged /copy/{e1} && "
              "touch /out/planted; exit 1; fi; "
              "sed 's/^/first /' /out/first; python -I -S /tools/copier.py; "
              "md5sum /copy/*-cache | sed 's/^/md5 /'")
    env = {"STORAGE_EMULATOR_HOST": bed.storage_emulator_host, "CACHEWARM_COPY_BUCKET": bucket,
           "CACHEWARM_COPY_PREFIX": "jax", "CACHEWARM_COPY_DEST": "/copy", "CACHEWARM_COPY_MANIFESTS": pool}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "planted", "namespace": ns},
           "spec": {"restartPolicy": "OnFailure",
                    "containers": [{"name": "train", "image": f"docker.io/{PLAIN_TRAIN_IMAGE}",
                                    "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", script],
                                    "env": [{"name": k, "value": v} for k, v in env.items()],
                                    "volumeMounts": [{"name": "copy", "mountPath": "/copy"},
                                                     {"name": "out", "mountPath": "/out"},
                                                     {"name": "tools", "mountPath": "/tools"}]}],
                    "volumes": [{"name": "copy", "emptyDir": {}}, {"name": "out", "emptyDir": {}},
                                {"name": "tools", "configMap": {"name": "tools"}}]}}
    assert bed.kubectl_run("create", "-n", ns, "-f", "-", input=json.dumps(pod)).returncode == 0
    wait(bed, "--for=jsonpath={.status.phase}=Succeeded", "pod/planted", "-n", ns)
    got = bed.get_json("pod", "planted", ns)
    assert got is not None and got["status"]["containerStatuses"][0]["restartCount"] == 1, got["status"]
    logs = bed.kubectl_run("logs", "planted", "-n", ns)
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    before = [json.loads(x.removeprefix("first "))["cachewarm-copier"] for x in lines if x.startswith("first {")]
    after = [json.loads(x)["cachewarm-copier"] for x in lines if x.startswith('{"cachewarm-copier"')]
    assert len(before) == len(after) == 1, logs.stdout
    before, after = before[0], after[0]
    assert (before["copied"], before["present"], before["trusted"]) == (3, 0, 1), before
    assert (after["present"], after["copied"], after["replaced"], after["failed"], after["cold"]) == (
        1, 2, 2, 0, False), after
    sums = {line.split()[2].rsplit("/", 1)[1]: line.split()[1] for line in logs.stdout.splitlines()
            if line.startswith("md5 ")}
    assert sums == {helpers.base(n): hashlib.md5(data[n]).hexdigest() for n in names}, logs.stdout  # noqa: S324
