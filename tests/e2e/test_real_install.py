"""cachewarm as a user installs it, on a real node (issue 10's proof).

The images are built from our Dockerfiles (cachewarm_testbed.images, cached by content)
and imported into the real node's containerd; `kubectl apply -k manifests/` installs the
operator, which runs from its image in cachewarm-system under its ServiceAccount and the
Deployment's security context, reaching the apiserver through the `kubernetes` Service
(kube-proxy) and the GCS emulator on the node address. Then:

- a CompilationCache's warmer Job runs the training image, with warm.py copied in by the
  warmer image's init container; it fills the emulated bucket; the operator reads the
  result from the termination message the kubelet wrote, and the cache turns Warmed;
- a labelled training pod created through the apiserver gets the cache env and the
  reporter from the in-cluster webhook (called through its Service) and its first step
  hits the cache with no compile; the training image sets `ENV PYTHONPATH=/app`, which the
  pod's PYTHONPATH (the reporter's) replaces and the reporter restores from what its
  recorder init container read in that image, so `python -m train` from `/` still finds
  the program; the reporter's report reaches the operator through the Service with the
  token the kubelet projected, and status.usage counts the pod's hits.

What differs from GKE, and why: GCS is the emulator behind our proxy, named by
STORAGE_EMULATOR_HOST (in the operator's env through a kustomize overlay, in the warmer's
through `warmup.env`, in the training pod's own spec), as any cluster without real GCS
needs; the node is a CPU node, so the warmer runs on the accelerator-less pool; there is no
cluster DNS, so the Service has a fixed ClusterIP that pods report to by address
(install.REPORT_IP, which the operator's certificate names). Needs
root and `make node-deps`; one real node per machine.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import socket
import shutil
import ssl
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachewarm.admission import certificates as certs

from cachewarm_testbed import images, install
from cachewarm_testbed.cluster import Testbed, eventually, repo_root
from cachewarm_testbed.realnode import BARE_IMAGE, NODE_NAME, HostSnapshot, RealNode

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="a real kubelet and containerd need root"),
]

REPO = repo_root()
GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@dataclass
class Installed:
    bed: Testbed
    node: RealNode
    operator: dict[str, Any]
    before: HostSnapshot

    def client_env(self) -> list[dict[str, str]]:
        """How pods of this cluster find GCS (the emulator)."""
        env = self.bed.env()
        return [{"name": k, "value": env[k]} for k in GCS_ENV]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Installed]:
    before = HostSnapshot.take()  # before the image build too: it must leave nothing behind either
    archives = images.build_all()
    bed = Testbed()
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        env = bed.env()
        operator = install.install_operator(bed, REPO / "manifests", {
            **{k: env[k] for k in GCS_ENV},
            "CACHEWARM_WARM_POLL_SECONDS": "2", "CACHEWARM_USAGE_FLUSH_SECONDS": "2",
        })
        yield Installed(bed, node, operator, before)
    finally:
        bed.stop()


@pytest.fixture
def ns(cluster: Installed) -> str:
    name = f"ri-{uuid.uuid4().hex[:8]}"
    made = cluster.bed.kubectl_run("create", "namespace", name)
    assert made.returncode == 0, made.stderr
    eventually(lambda: cluster.bed.get_json("serviceaccount", "default", name), what="default ServiceAccount")
    return name


def manifest_deployment() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "manifests" / "manager" / "deployment.yaml").read_text()))


def test_operator_runs_from_its_image_under_the_manifests_security_context(cluster: Installed) -> None:
    pod = cluster.operator
    want = manifest_deployment()["spec"]["template"]["spec"]
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["spec"]["serviceAccountName"] == want["serviceAccountName"] == "cachewarm-operator"
    assert pod["spec"]["securityContext"] == want["securityContext"]
    [container] = pod["spec"]["containers"]
    assert container["securityContext"] == want["containers"][0]["securityContext"]
    assert container["image"] == "cachewarm/operator:0.1.0"
    [status] = pod["status"]["containerStatuses"]
    assert status["ready"] and status["restartCount"] == 0, status
    # Ready by the manifests' own probe (the webhook listening), as the real kubelet ran it.
    probe = want["containers"][0]["readinessProbe"]
    assert {k: container["readinessProbe"].get(k) for k in probe} == probe  # the apiserver adds defaults
    assert status["imageID"].startswith("sha256:") or "@sha256:" in status["imageID"], status

    # Inside the real container: the manifests' user, and a root filesystem it cannot write.
    out = cluster.bed.kubectl_run("exec", "-n", install.NAMESPACE, pod["metadata"]["name"], "--",
                                  "python", "-c",
                                  "import os\ntry:\n open('/probe', 'w')\n print(os.getuid(), 'writable')\n"
                                  "except OSError as e:\n print(os.getuid(), e.strerror)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=1) == ["65532", "Read-only file system\n"], out.stdout


def test_webhook_is_reached_through_its_service_with_the_operators_certificate(cluster: Installed) -> None:
    config = cluster.bed.get_json("mutatingwebhookconfiguration", install.WEBHOOK_CONFIGURATION, "")
    assert config is not None
    [hook] = config["webhooks"]
    # Still the Service from manifests/ (no URL put in its place), now with the CA the
    # operator made; the pod test below shows the apiserver calling it.
    assert hook["clientConfig"]["service"] == {"name": "cachewarm-webhook", "namespace": install.NAMESPACE,
                                               "path": "/inject-cache", "port": 443}
    assert "url" not in hook["clientConfig"]
    assert hook["clientConfig"]["caBundle"]


# demo/train.py at 16 unrolled layers: a compile of a few seconds, so that JAX's own
# estimate of what a hit saved (whole seconds recorded at write, less the load) is positive.
MODEL_SIZE = {"name": "DEMO_LAYERS", "value": "16"}


def warm_cache(name: str, cluster: Installed) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": f"real-{uuid.uuid4().hex[:10]}", "prefix": name,
                                "location": "us-central1", "lifecycle": {"deleteAfterDays": 10}}},
            # No jax settings: the warmer writes every program it compiles by default.
            "warmup": {"image": images.TRAIN_IMAGE, "targets": ["train:targets"], "pools": [{"name": "cpu"}],
                       "env": [*cluster.client_env(), MODEL_SIZE]},
            "injection": {"mode": "ReadOnly"},
        },
    }


def wait_warmed(bed: Testbed, name: str, ns: str) -> dict[str, Any]:
    """The cache once Warmed; the test fails at once with the reason if its warmup failed."""
    def warmed() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns) or {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        if conds.get("Warmed", {}).get("reason") == "WarmupFailed":
            pytest.fail(f"warmup failed: {conds['Warmed']['message']}")
        return obj if conds.get("Warmed", {}).get("status") == "True" else None
    return eventually(warmed, timeout=300, what=f"cache {name} to be Warmed")


def finished(bed: Testbed, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    obj = bed.get_json(kind, name, ns) or {}
    return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None


def pinned_warmer(cluster: Installed) -> str:
    """The warmer image by digest, as the operator's pod ran it in its init container
    warmer-image (manifests/manager/deployment.yaml names it by tag) and the real kubelet
    reported it: what the operator references it by in everything it makes."""
    [status] = [s for s in cluster.operator["status"].get("initContainerStatuses") or [] if s["name"] == "warmer-image"]
    assert status["state"]["terminated"]["exitCode"] == 0, status
    assert re.fullmatch(r"docker\.io/cachewarm/warmer@sha256:[0-9a-f]{64}", status["imageID"]), status
    return str(status["imageID"])


def test_a_cache_warms_on_the_real_node_and_a_labelled_pod_starts_warm(cluster: Installed, ns: str) -> None:
    """The default path (issue 30): a cache that sets no read path and no write threshold.
    Its warmer writes the program; a labelled pod gets a local copy by default, hits
    every program, compiles none, and status.usage counts 0 misses and positive seconds saved."""
    bed = cluster.bed
    bed.apply(warm_cache("llama", cluster), ns)
    obj = wait_warmed(bed, "llama", ns)
    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["state"] == "Succeeded" and pool["entriesWritten"] > 0, pool

    # The warmer pod as the kubelet ran it: the real init container copied warm.py, and the
    # summary the operator put in status is the termination message the kubelet recorded.
    pods = json.loads(bed.kubectl_run("get", "pods", "-n", ns, "-l", f"job-name={pool['job']}", "-o", "json").stdout)
    [warmer] = pods["items"]
    assert warmer["spec"]["nodeName"] == NODE_NAME
    [init] = warmer["status"]["initContainerStatuses"]
    # The warmer image by the digest the operator's node resolved it to, not by its tag.
    assert warmer["spec"]["initContainers"][0]["image"] == pinned_warmer(cluster)
    assert init["state"]["terminated"]["exitCode"] == 0
    [main] = warmer["status"]["containerStatuses"]
    summary = json.loads(main["state"]["terminated"]["message"])
    assert summary["entriesWritten"] == pool["entriesWritten"]
    # The fingerprint of the keys: what the warmer's jax saw, and the image by the digest
    # the kubelet reports (not the tag).
    fingerprint = pool["fingerprint"]
    assert fingerprint["image"] == main["imageID"] and "sha256:" in fingerprint["image"]
    assert (fingerprint["platform"], fingerprint["devices"], fingerprint["processes"]) == ("cpu", 1, 1)
    assert fingerprint["jax"] == summary["fingerprint"]["jax"] and fingerprint["cacheDir"].startswith("gs://")
    assert obj["status"]["cache"]["entries"] >= pool["entriesWritten"]

    # The default read path, said in status: a local copy.
    copy_cond = next(c for c in obj["status"]["conditions"] if c["type"] == "LocalCopyAsSpecified")
    assert (copy_cond["status"], copy_cond["reason"]) == ("True", "PerPodCopy") and "(the default:" in \
        copy_cond["message"], copy_cond
    # A training pod created through the apiserver: the in-cluster webhook adds the env,
    # the reporter and the local copy. From `/`, `python -m train` finds the program only on
    # the image's own PYTHONPATH (/app), which the pod's (ours) replaced.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "train", "labels": {"cachewarm.dev/cache": "llama"}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": images.TRAIN_IMAGE, "workingDir": "/",
               "command": ["python", "-m", "train", "--steps", "2"], "env": [*cluster.client_env(), MODEL_SIZE]}]}}
    bed.apply(pod, ns)
    stored = bed.get_json("pod", "train", ns)
    assert stored is not None
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache"
    assert stored["metadata"]["annotations"]["cachewarm.dev/injected"].endswith(", local copy)")
    assert env["CACHEWARM_REPORT_URL"].startswith(f"https://{install.REPORT_IP}:9444/")  # the Service's reports port
    done = eventually(lambda: finished(bed, "pod", "train", ns), timeout=300, what="the training pod to finish")
    logs = bed.kubectl_run("logs", "train", "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", logs.stdout[-3000:] + logs.stderr[-3000:]
    report = json.loads(logs.stdout.strip().splitlines()[-1])
    assert report["cache_hits"] >= 1 and report["compiled"] == 0, report
    assert report["cache_dir"] == "/cachewarm-cache", report
    # The init containers that ran did so as the kubelet runs them (the copy may run in
    # process, with none: the warmer reported the image's PYTHONPATH).
    inits = {s["name"]: s for s in done["status"].get("initContainerStatuses") or []}
    assert all(s["state"]["terminated"]["exitCode"] == 0 for s in inits.values()), inits

    # Its reporter reached the operator (through the Service, with the token the kubelet
    # projected for this pod), and the leader counted the pod's hits.
    def usage() -> dict[str, Any] | None:
        got = ((bed.get_json("ccache", "llama", ns) or {}).get("status") or {}).get("usage") or {}
        return got if got.get("pods") else None
    got = eventually(usage, timeout=60, what="status.usage from the training pod's report")
    assert (got["pods"], got["hits"], got["misses"]) == (1, report["cache_hits"], 0), got
    assert got["compileSecondsSaved"] > 0, got
    assert (got["localCopy"]["pods"], got["localCopy"]["coldPods"]) == (1, 0), got
    keys = eventually(lambda: next((c for c in (bed.get_json("ccache", "llama", ns) or {})["status"]["conditions"]
                                    if c["type"] == "KeysMatch" and c["status"] != "Unknown"), None),
                      timeout=60, what="KeysMatch decided")
    assert keys["status"] == "True", keys


def test_the_reporters_recorder_runs_in_an_image_without_a_shell_or_a_c_library(cluster: Installed, ns: str) -> None:
    """The reporter is on by default, so its init containers run in every labelled pod: the
    recorder runs the warmer image's busybox inside the training container's image, here one
    with a single static program and nothing else (no /bin/sh, no libc, no loader). The pod
    starts and ends as it would without cachewarm. (The testbed's warmer image is built on
    Debian's busybox-static; the published one on busybox:1.37-musl, whose busybox its
    Dockerfile proves static by running it in an empty filesystem.)"""
    bed = cluster.bed
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "bare"},
               "spec": {"storage": {"gcs": {"bucket": f"bare-{uuid.uuid4().hex[:10]}", "prefix": "bare",
                                            "location": "us-central1"}}}}, ns)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare", "labels": {"cachewarm.dev/cache": "bare"}},
           "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": BARE_IMAGE,
                                                              "command": ["/sleep", "1"]}]}}
    bed.apply(pod, ns)
    stored = bed.get_json("pod", "bare", ns) or {}
    inits = {c["name"]: c for c in stored["spec"].get("initContainers") or []}
    # A cache without warmup reads the bucket by default (no manifest names what a copy
    # would take): the recorder itself runs in the bare image.
    assert inits["cachewarm-pythonpath"]["image"] == BARE_IMAGE, inits
    assert inits["cachewarm-reporter"]["image"] == pinned_warmer(cluster), inits  # by digest
    done = eventually(lambda: finished(bed, "pod", "bare", ns), timeout=120, what="the bare pod to finish")
    statuses = {s["name"]: s["state"]["terminated"] for s in done["status"].get("initContainerStatuses") or []}
    assert done["status"]["phase"] == "Succeeded", (done["status"], statuses)
    assert {n: t["exitCode"] for n, t in statuses.items()} == {"cachewarm-reporter": 0, "cachewarm-pythonpath": 0}


# The plain training image has no GCS library; this prints what the pod's local copy held
# when its program ran, and whether gcsfs could be imported, after the program's own line.
# Then whether the boot volume (in process) holds, where this python's import looks, the
# copier's bytecode that import would take: this python's magic, a checked hash, the hash
# of the source beside it (tests/integration/test_copy_in_process.py sees python take it).
AFTER_PROGRAMS = ("import importlib.util, json, os; d = os.environ['JAX_COMPILATION_CACHE_DIR']; "
                  "s = '/cachewarm-boot/cachewarm_copier.py'; c = importlib.util.cache_from_source(s); "
                  "b = os.path.exists(c) and open(c, 'rb').read(16) == importlib.util.MAGIC_NUMBER + bytes([3, 0, 0, 0]) "
                  "+ importlib.util.source_hash(open(s, 'rb').read()); "
                  "print(json.dumps({'copy': sorted(os.listdir(d)), 'gcsfs': importlib.util.find_spec('gcsfs') is not None, "
                  "'bootBytecode': b}))")


def local_pod(name: str, cache: str, env: list[dict[str, str]], user: int | None = None) -> dict[str, Any]:
    """A training pod of the plain image (no gcsfs, no etils) that runs demo/programs.py's
    ten programs, then lists its cache directory. From `/`, `python -m programs` finds the
    program only on the image's own PYTHONPATH (/app), which the reporter puts back from
    what the copier recorded in place of the reporter's recorder. The directory its
    SSL_CERT_DIR names, a volume the kubelet fills, is mounted in the copier too, read-only.
    `user`: the pod runs as that user (and group) instead of the image's root."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
            "spec": {"restartPolicy": "Never",
                     **({"securityContext": {"runAsUser": user, "runAsGroup": user}} if user is not None else {}),
                     "containers": [{
                "name": "train", "image": images.PLAIN_TRAIN_IMAGE, "workingDir": "/",
                "env": [*env, {"name": "SSL_CERT_DIR", "value": "/etc/podinfo"}],
                "volumeMounts": [{"name": "podinfo", "mountPath": "/etc/podinfo"}],
                "command": ["sh", "-c", 'python -m programs && python -c "$0"', AFTER_PROGRAMS]}],
                "volumes": [{"name": "podinfo", "downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]}}


def run_to_end(bed: Testbed, ns: str, pod: dict[str, Any], *, in_process: bool = False
               ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(the finished pod, the JSON lines of its training container, the copier's summary).
    `in_process`: the webhook must have given the pod the copy in process (no init
    container at all; the summary is in the training container's log), else by init
    container."""
    name = pod["metadata"]["name"]
    bed.apply(pod, ns)
    done = eventually(lambda: finished(bed, "pod", name, ns), timeout=300, what=f"pod {name} to finish")
    logs = bed.kubectl_run("logs", name, "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", (done["status"], logs.stdout[-3000:], logs.stderr[-3000:])
    lines = [json.loads(line) for line in logs.stdout.splitlines() if line.startswith("{")]
    train = next(ct for ct in done["spec"]["containers"] if ct["name"] == "train")
    pythonpath = next((e["value"] for e in train["env"] if e["name"] == "PYTHONPATH"), "")
    if in_process:
        assert not done["spec"].get("initContainers") and not done["status"].get("initContainerStatuses"), done["spec"]
        assert pythonpath == "/cachewarm-boot:/app", pythonpath  # ours, then the image's own
        # The copy's summary line, on the training container's stderr (kubectl logs has both).
        [summary] = [line["cachewarm-copier"] for line in lines if "cachewarm-copier" in line]
        lines = [line for line in lines if "cachewarm-copier" not in line]
        return done, lines, summary
    copier = bed.kubectl_run("logs", name, "-n", ns, "-c", "cachewarm-copy")
    assert copier.returncode == 0, copier.stderr
    [summary] = [json.loads(line)["cachewarm-copier"] for line in copier.stdout.splitlines() if "cachewarm-copier" in line]
    inits = {s["name"]: s["state"]["terminated"]["exitCode"] for s in done["status"]["initContainerStatuses"]}
    # Two init containers, not three: the copier records the image's PYTHONPATH itself.
    assert inits == {"cachewarm-reporter": 0, "cachewarm-copy": 0}, inits
    assert pythonpath == "/cachewarm-reporter", pythonpath
    copier_spec = next(ct for ct in done["spec"]["initContainers"] if ct["name"] == "cachewarm-copy")
    assert {"name": "podinfo", "mountPath": "/etc/podinfo", "readOnly": True} in copier_spec["volumeMounts"]
    return done, lines, summary


def test_a_pod_whose_image_has_no_gcs_library_hits_every_warmed_program_from_its_local_copy(
        cluster: Installed, ns: str) -> None:
    """Issue 14: a ReadOnly cache with localCopy. The warmer (the training image with
    gcsfs) warms demo/programs.py's ten programs and writes its pool's manifest; an
    entry of another program is put in the same prefix beforehand. A pod of the plain
    image (no gcsfs, no etils) gets an emptyDir and the copier init container from the
    in-cluster webhook; the copy holds exactly the manifest's entries (not the other
    program's), and the program hits all ten and compiles nothing. Its reporter reports
    the copy, and status.usage counts it. A second cache on the same prefix, HostPath, no
    warmup (so no manifest): its pods copy the whole prefix, the second one on the node
    finds every entry already there. A third, Ephemeral: the pod's own claim, bound by the
    scheduler to a local PersistentVolume on the node (no provisioner here), holds the copy,
    made in process with the reporter off. Pods that set their own PYTHONPATH, or run the
    warmup's image, copy in process; the others by init container."""
    bed = cluster.bed
    obj = warm_cache("local", cluster)
    obj["spec"]["warmup"]["targets"] = ["programs:targets"]
    obj["spec"]["injection"]["localCopy"] = {"sizeLimit": "1Gi", "workers": 4, "timeoutSeconds": 120}
    bucket = obj["spec"]["storage"]["gcs"]["bucket"]
    bed.apply(obj, ns)
    warm = wait_warmed(bed, "local", ns)
    [pool] = warm["status"]["warmup"]["pools"]
    assert pool["keyCount"] == 10, pool
    gcs = storage.Client(project="test", credentials=AnonymousCredentials(),
                         client_options={"api_endpoint": cluster.bed.env()["STORAGE_EMULATOR_HOST"]})
    stranger = f"local/jit_other-{'ab' * 32}-cache"
    gcs.bucket(bucket).blob(stranger).upload_from_string(b"another program's entry")
    manifest = json.loads(gcs.bucket(bucket).blob(pool["manifestObject"]).download_as_bytes())
    listed = sorted(e["name"] for e in manifest["entries"])
    assert len(listed) == 10

    done, lines, summary = run_to_end(bed, ns, local_pod("reader", "local", cluster.client_env()))
    run, after = lines[-2], lines[-1]
    assert (run["programs"], run["cache_hits"], run["compiled"]) == (10, 10, 0), run
    assert run["cache_dir"] == "/cachewarm-cache"
    # Only the manifest's entries; no gcsfs at all; no boot volume by init container.
    assert after == {"copy": listed, "gcsfs": False, "bootBytecode": False}, after
    assert (summary["source"], summary["copied"], summary["cold"]) == ("manifest", 10, False), summary
    volume = next(v for v in done["spec"]["volumes"] if v["name"] == "cachewarm-cache")
    assert volume == {"name": "cachewarm-cache", "emptyDir": {"sizeLimit": "1Gi"}}
    # workers, timeoutSeconds and sizeLimit (90% of it the budget) reach the copier the
    # operator's webhook added.
    copier_env = {e["name"]: e.get("value") for e in next(
        ct for ct in done["spec"]["initContainers"] if ct["name"] == "cachewarm-copy")["env"]}
    assert (copier_env["CACHEWARM_COPY_WORKERS"], copier_env["CACHEWARM_COPY_DEADLINE_SECONDS"],
            copier_env["CACHEWARM_COPY_MAX_BYTES"]) == ("4", "120", str(int(2**30 * 0.9))), copier_env

    def reported(pods: int) -> dict[str, Any] | None:
        usage = ((bed.get_json("ccache", "local", ns) or {}).get("status") or {}).get("usage") or {}
        return usage if (usage.get("localCopy") or {}).get("pods") == pods else None
    usage = eventually(lambda: reported(1), timeout=60, what="status.usage.localCopy from the pod's report")
    assert (usage["hits"], usage["misses"]) == (10, 0), usage
    assert (usage["localCopy"]["pods"], usage["localCopy"]["coldPods"], usage["localCopy"]["entriesCopied"]) == (1, 0, 10)

    # In process, no init container. A pod of the warmup's own image, which sets no
    # PYTHONPATH: the warmer reported the image's (/app), so the webhook puts ours in
    # front of it, and `python -m programs` from / finds the program there. The copy runs
    # in the pod's first python process, before its program; the second process (the
    # listing) finds it done.
    assert pool["imagePythonPath"] == {"image": images.TRAIN_IMAGE, "value": "/app"}, pool
    own = local_pod("inproc", "local", cluster.client_env())
    own["spec"]["containers"][0]["image"] = images.TRAIN_IMAGE
    _, lines, summary = run_to_end(bed, ns, own, in_process=True)
    assert (lines[-2]["cache_hits"], lines[-2]["compiled"]) == (10, 0), lines
    assert lines[-1]["copy"] == listed, lines[-1]
    assert (summary["source"], summary["copied"], summary["cold"]) == ("manifest", 10, False), summary
    # The plain image (no GCS library) in process: the pod sets its PYTHONPATH itself, so
    # the webhook knows it whatever the image.
    plain = local_pod("inproc-plain", "local", [*cluster.client_env(), {"name": "PYTHONPATH", "value": "/app"}])
    done, lines, summary = run_to_end(bed, ns, plain, in_process=True)
    assert (lines[-2]["cache_hits"], lines[-2]["compiled"]) == (10, 0)
    # The kubelet put the operator's bytecode where the pod's python (3.11, as the
    # operator's) takes it.
    assert lines[-1] == {"copy": listed, "gcsfs": False, "bootBytecode": True}, lines[-1]
    assert (summary["source"], summary["copied"]) == ("manifest", 10), summary
    train_env = {e["name"]: e.get("value") for e in done["spec"]["containers"][0]["env"]}
    assert (train_env["CACHEWARM_COPY_WORKERS"], train_env["CACHEWARM_COPY_DEADLINE_SECONDS"],
            train_env["CACHEWARM_COPY_MAX_BYTES"]) == ("4", "120", str(int(2**30 * 0.9))), train_env
    # Both reported their copy, as the copier init container's pod did.
    usage = eventually(lambda: reported(3), timeout=60, what="status.usage.localCopy from the in-process pods")
    assert (usage["localCopy"]["coldPods"], usage["localCopy"]["entriesCopied"]) == (0, 30), usage

    # HostPath (a copy shared by the cache's pods on the node) was withdrawn in issue 28: a
    # shared copy is a writable mount another pod reads. The apiserver refuses it.
    with pytest.raises(RuntimeError, match="HostPath"):
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "node"},
                   "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "local", "location": "us-central1",
                                                "create": False}},
                            "injection": {"mode": "ReadOnly",
                                          "localCopy": {"volume": "HostPath", "hostPath": "/tmp/cachewarm-shared"}}}},
                  ns)
    # No warmup, so no manifest: the whole prefix, into the pod's own EmptyDir, by a pod that
    # does not run as root.
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "node"},
               "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "local", "location": "us-central1",
                                            "create": False}},
                        "injection": {"mode": "ReadOnly", "localCopy": {}}}}, ns)
    eventually(lambda: ((bed.get_json("ccache", "node", ns) or {}).get("status") or {}).get("observedGeneration"),
               what="cache node reconciled")
    _, lines, first = run_to_end(bed, ns, local_pod("first", "node", cluster.client_env(), user=1000))
    assert (first["source"], first["copied"], first.get("present", 0)) == ("prefix", 11, 0), first
    assert lines[-1]["copy"] == sorted([*listed, stranger.rsplit("/", 1)[1]])
    assert lines[-2]["cache_hits"] == 10

    # Ephemeral: each pod's own claim, from a StorageClass; here a local PersistentVolume on
    # the node (no provisioner: the scheduler binds the claim when the pod is scheduled).
    disk = Path(f"/tmp/cachewarm-pv-{uuid.uuid4().hex[:8]}")
    disk.mkdir()
    pv = f"cachewarm-{ns}"
    try:
        bed.apply({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "cachewarm-local"},
                   "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}, ns)
        bed.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                   "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "cachewarm-local",
                            "local": {"path": str(disk)},
                            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}]}]}}}}, ns)
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "claim"},
                   "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "local", "location": "us-central1",
                                                "create": False}},
                            "injection": {"mode": "ReadOnly", "report": False, "localCopy": {
                                "volume": "Ephemeral", "storageClassName": "cachewarm-local", "sizeLimit": "1Gi"}}}}, ns)
        eventually(lambda: ((bed.get_json("ccache", "claim", ns) or {}).get("status") or {}).get("observedGeneration"),
                   what="cache claim reconciled")
        # In process (the pod sets its PYTHONPATH), with the reporter off: the claim is the
        # copy's volume all the same, and no reporter comes with the copy.
        claimed = local_pod("claimed", "claim", [*cluster.client_env(), {"name": "PYTHONPATH", "value": "/app"}])
        done, lines, summary = run_to_end(bed, ns, claimed, in_process=True)
        assert (summary["copied"], lines[-2]["cache_hits"], lines[-2]["compiled"]) == (11, 10, 0), (summary, lines)
        train_env = {e["name"] for e in done["spec"]["containers"][0]["env"]}
        assert "CACHEWARM_COPY_IN_PROCESS" in train_env and "CACHEWARM_REPORT_URL" not in train_env, train_env
        assert "cachewarm-report-token" not in {v["name"] for v in done["spec"]["volumes"]}
        claim = bed.get_json("pvc", "claimed-cachewarm-cache", ns) or {}
        assert (claim.get("spec") or {}).get("volumeName") == pv, claim
        assert sorted(p.name for p in disk.iterdir()) == lines[-1]["copy"]  # the copy is on that volume
        assert bed.kubectl_run("delete", "pod", "claimed", "-n", ns, "--wait=true", "--timeout=60s").returncode == 0
    finally:
        bed.kubectl_run("delete", "pv", pv, "--wait=false")
        bed.kubectl_run("delete", "storageclass", "cachewarm-local", "--ignore-not-found")
        shutil.rmtree(disk, ignore_errors=True)


# The first entry of the pod's copy (the writable mount of the in-process copy), replaced
# by other bytes of the same size; then, after the pod's second program, that entry's md5.
FIRST_ENTRY = ("d = '/cachewarm-copy'; p = os.path.join(d, sorted(f for f in os.listdir(d) "
               "if f.endswith('-cache'))[0]); ")
REPLACE_ENTRY = ("import hashlib, json, os; " + FIRST_ENTRY + "b = open(p, 'rb').read(); "
                 "open(p, 'wb').write(os.urandom(len(b))); n = open(p, 'rb').read(); "
                 "print(json.dumps({'replaced': os.path.basename(p), 'was': hashlib.md5(b).hexdigest(), "
                 "'now': hashlib.md5(n).hexdigest(), 'sameSize': len(n) == len(b)}))")
ENTRY_AFTER = ("import hashlib, json, os; " + FIRST_ENTRY +
               "print(json.dumps({'after': hashlib.md5(open(p, 'rb').read()).hexdigest()}))")


def test_an_entry_replaced_in_a_pods_own_copy_is_refused_or_replaced_and_counted_as_the_program_saw_it(
        cluster: Installed, ns: str) -> None:
    """Issue 28, in process on the real node: the pod's first process copies (and hits all
    ten programs); then an entry of its copy is replaced by other bytes of the same size
    (a write the training container can make: the in-process copy is its own, writable at
    /cachewarm-copy), and a second process runs the programs. The copy is per pod (an
    emptyDir, D1: no other pod reads it) and runs once per pod, so the second process finds
    the copy done and reads what is there: the entry is refused (JAX cannot read it: these
    bytes are not zlib, so it warns and compiles: a miss), or replaced with GCS's bytes (a
    hit); either way the cache's status.usage counts the hits and misses the program saw.
    (A well-formed forgery would be loaded by this pod alone: the pod's own processes can
    run code in it anyway.)"""
    bed = cluster.bed
    obj = warm_cache("own", cluster)
    obj["spec"]["warmup"]["targets"] = ["programs:targets"]
    obj["spec"]["injection"]["localCopy"] = {"sizeLimit": "1Gi"}
    bed.apply(obj, ns)
    wait_warmed(bed, "own", ns)
    pod = local_pod("replaced", "own", cluster.client_env())
    train = pod["spec"]["containers"][0]
    train["image"] = images.TRAIN_IMAGE  # the warmup's image: the copy in process
    train["command"] = ["sh", "-c", 'python -m programs && python -c "$0" && python -m programs && python -c "$1"',
                        REPLACE_ENTRY, ENTRY_AFTER]
    _, lines, summary = run_to_end(bed, ns, pod, in_process=True)
    first, replaced, second, after = lines
    assert (summary["source"], summary["copied"], first["cache_hits"], first["compiled"]) == (
        "manifest", 10, 10, 0), (summary, first)
    assert replaced["sameSize"] and replaced["now"] != replaced["was"], replaced
    assert (second["programs"], second["cache_hits"] + second["compiled"]) == (10, 10), second
    if second["compiled"]:  # refused: the one entry replaced, and it stays this pod's alone
        assert (second["cache_hits"], second["compiled"]) == (9, 1), second
    else:  # replaced with GCS's bytes
        assert after["after"] == replaced["was"], (second, after)

    def counted() -> dict[str, Any] | None:
        usage = ((bed.get_json("ccache", "own", ns) or {}).get("status") or {}).get("usage") or {}
        return usage if usage.get("processes") == 2 else None  # the two that imported jax
    usage = eventually(counted, timeout=60, what="status.usage from both of the pod's programs")
    assert (usage["hits"], usage["misses"]) == (first["cache_hits"] + second["cache_hits"], second["compiled"]), usage


def test_a_pod_whose_copy_cannot_reach_the_bucket_still_trains_cold(cluster: Installed, ns: str) -> None:
    """The bucket out of reach during the copy (the pod's GCS endpoint refuses
    connections): the copier gives up, says so, and exits 0; the pod starts with an
    empty local cache and trains, compiling every program; its report says the copy was
    cold, and the cache gets a LocalCopyCold Warning naming the pod."""
    bed = cluster.bed
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "away"},
               "spec": {"storage": {"gcs": {"bucket": f"away-{uuid.uuid4().hex[:10]}", "prefix": "away",
                                            "location": "us-central1"}},
                        "injection": {"mode": "ReadOnly", "localCopy": {"timeoutSeconds": 20}}}}, ns)
    eventually(lambda: ((bed.get_json("ccache", "away", ns) or {}).get("status") or {}).get("bucket"),
               what="cache away reconciled")
    with socket.socket() as sock:  # a port nothing listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = [{"name": "STORAGE_EMULATOR_HOST", "value": dead}]
    _, lines, summary = run_to_end(bed, ns, local_pod("cold", "away", env))
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"], summary
    run = lines[-2]
    assert (run["programs"], run["cache_hits"], run["compiled"]) == (10, 0, 10), run
    assert lines[-1]["copy"] == []
    # In process too (the pod sets its PYTHONPATH): the copier child gives up, and the
    # training process, which waited for it at `import jax`, goes on and trains.
    _, lines, summary = run_to_end(bed, ns, local_pod("cold-inproc", "away", [*env, {"name": "PYTHONPATH",
                                                                                      "value": "/app"}]),
                                   in_process=True)
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"], summary
    assert (lines[-2]["cache_hits"], lines[-2]["compiled"]) == (0, 10) and lines[-1]["copy"] == []

    def reported() -> dict[str, Any] | None:
        usage = ((bed.get_json("ccache", "away", ns) or {}).get("status") or {}).get("usage") or {}
        return usage if (usage.get("localCopy") or {}).get("pods") == 2 else None
    usage = eventually(reported, timeout=60, what="status.usage.localCopy from the cold pods' reports")
    assert usage["localCopy"]["coldPods"] == 2, usage
    def cold_events() -> list[str] | None:
        said = [e["message"] for e in bed.events_for("away", ns) if e["reason"] == "LocalCopyCold"]
        return said if len(said) == 2 else None
    said = eventually(cold_events, timeout=30, what="a LocalCopyCold Event on the cache for each pod")
    for pod in ("cold", "cold-inproc"):
        assert any(m.startswith(f"Pod {pod} started without the cache's entries") for m in said), said


# --- issue 28, D7 and D8 through the installed operator's webhook -------------------------

# D7: what every init container cachewarm adds gets, whatever the training container has.
RESTRICTED = {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"},
              "readOnlyRootFilesystem": True}


def runtime_spec(node: RealNode, container_id: str) -> dict[str, Any]:
    """The OCI runtime spec containerd handed runc for a container (`ctr containers info`)."""
    info = node.ctr("containers", "info", container_id.removeprefix("containerd://"))
    spec: dict[str, Any] = json.loads(info.stdout)["Spec"]
    return spec


def copy_cache(name: str) -> dict[str, Any]:
    """A cache with a local copy and the reporter (its default), no warmup: the copier, by
    init container, copies the (empty) prefix."""
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": f"{name}-{uuid.uuid4().hex[:10]}", "prefix": name,
                                         "location": "us-central1"}},
                     "injection": {"mode": "ReadOnly", "localCopy": {}}}}


def test_the_webhooks_init_containers_run_restricted_beside_a_privileged_root_training_container(
        cluster: Installed, ns: str) -> None:
    """D7 through the installed operator's webhook (the apiserver calls it through its
    Service) on the real kubelet + containerd + runc: the training container is privileged,
    root, with SYS_ADMIN added, and the pod names no runAsNonRoot. The pod as stored has
    our init containers (the reporter's copy, the local copy's copier) with exactly the
    restricted securityContext, never the training container's; they ran (exit 0) as runc
    was told (the runtime spec containerd kept: uid 65532, no capabilities, no new
    privileges, seccomp, read-only root; what they wrote is 65532's), and the training
    container kept its own context (root, privileged, SYS_ADMIN in its runtime spec and in
    its process), and still cannot write the copy it reads (EROFS)."""
    bed = cluster.bed
    bed.apply(copy_cache("priv"), ns)
    eventually(lambda: ((bed.get_json("ccache", "priv", ns) or {}).get("status") or {}).get("bucket"),
               what="cache priv reconciled")
    own = {"privileged": True, "runAsUser": 0, "capabilities": {"add": ["SYS_ADMIN"]}}
    script = ('echo "uid=$(id -u)"; grep CapEff /proc/self/status; '
              'for f in /cachewarm-reporter/*; do echo "owner $(stat -c %u "$f") $f"; done; '
              'out=$(touch /cachewarm-cache/planted 2>&1); echo "write-rc=$? $out"')
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "privileged", "labels": {"cachewarm.dev/cache": "priv"}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": images.PLAIN_TRAIN_IMAGE, "command": ["sh", "-c", script],
               "env": cluster.client_env(), "securityContext": own}]}}
    bed.apply(pod, ns)
    stored = bed.get_json("pod", "privileged", ns) or {}
    assert "cachewarm.dev/injected" in (stored.get("metadata") or {}).get("annotations", {}), stored.get("metadata")
    assert "runAsNonRoot" not in (stored["spec"].get("securityContext") or {}), stored["spec"].get("securityContext")
    inits = {ct["name"]: ct.get("securityContext") for ct in stored["spec"].get("initContainers") or []}
    assert inits == {"cachewarm-reporter": RESTRICTED, "cachewarm-copy": RESTRICTED}, inits
    [train] = stored["spec"]["containers"]
    assert train["securityContext"] == own, train["securityContext"]

    done = eventually(lambda: finished(bed, "pod", "privileged", ns), timeout=180, what="the privileged pod to finish")
    logs = bed.kubectl_run("logs", "privileged", "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", (done["status"], logs.stdout[-3000:], logs.stderr[-3000:])
    statuses = {s["name"]: s for s in done["status"]["initContainerStatuses"]}
    assert {n: s["state"]["terminated"]["exitCode"] for n, s in statuses.items()} == {
        "cachewarm-reporter": 0, "cachewarm-copy": 0}, statuses
    for name, status in statuses.items():
        runtime = runtime_spec(cluster.node, status["containerID"])
        process = runtime["process"]
        assert process["user"]["uid"] == 65532, (name, process["user"])
        assert all(not process["capabilities"].get(kind) for kind in
                   ("bounding", "effective", "permitted", "inheritable", "ambient")), (name, process)
        assert process.get("noNewPrivileges") is True, name
        assert runtime["root"].get("readonly") is True, name
        assert "seccomp" in runtime["linux"], name  # RuntimeDefault: a profile, not unconfined
    [main] = done["status"]["containerStatuses"]
    process = runtime_spec(cluster.node, main["containerID"])["process"]
    assert process["user"]["uid"] == 0 and "CAP_SYS_ADMIN" in process["capabilities"]["effective"], process
    lines = logs.stdout.splitlines()
    assert "uid=0" in lines, lines
    assert not any(line.endswith("0000000000000000") for line in lines if "CapEff" in line), lines
    owners = {line.split()[2]: line.split()[1] for line in lines if line.startswith("owner ")}
    # The copier's summary, and what the reporter's copy put there.
    assert "/cachewarm-reporter/local-copy.json" in owners and len(owners) > 1, lines
    assert set(owners.values()) == {"65532"}, owners  # written by our init containers, as 65532
    write = next(line for line in lines if line.startswith("write-rc="))
    assert not write.startswith("write-rc=0") and "Read-only file system" in write, write


def test_a_pod_that_opted_out_of_tokens_gets_none_from_the_webhook_and_the_cache_counts_it(
        cluster: Installed, ns: str) -> None:
    """D8 through the installed operator's webhook on the real node: a labelled pod with
    automountServiceAccountToken false, of a cache that has the reporter (its default) and
    a local copy. kubectl shows the webhook's warning; the stored pod has no projected
    token and no reporter (no code, env or volume of it), the copy still comes;
    the pod runs to the end with no token file anywhere under /var/run/secrets. The cache
    counts it in status.reports.podsOptedOut while it runs (a reconcile forced by a spec
    change, not a wait for the count), and not once it has finished."""
    bed = cluster.bed
    cache = copy_cache("optout")
    bed.apply(cache, ns)

    def reconciled(generation: int) -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "optout", ns) or {}
        status = obj.get("status") or {}
        return obj if status.get("bucket") and status.get("observedGeneration") == generation else None
    eventually(lambda: reconciled(1), what="cache optout reconciled")
    script = ('echo "files=$(find /var/run/secrets -type f 2>/dev/null | wc -l)"; '
              'echo "env-url=${CACHEWARM_REPORT_URL:-none}"; '
              'while [ ! -e /tmp/go ]; do sleep 1; done')
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "no-token", "labels": {"cachewarm.dev/cache": "optout"}},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
               "name": "train", "image": images.PLAIN_TRAIN_IMAGE, "command": ["sh", "-c", script],
               "env": cluster.client_env()}]}}
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=json.dumps(pod))
    assert created.returncode == 0, created.stderr
    assert "automountServiceAccountToken false" in created.stderr, created.stderr  # the webhook's warning
    stored = bed.get_json("pod", "no-token", ns) or {}
    assert "cachewarm.dev/injected" in (stored.get("metadata") or {}).get("annotations", {}), stored.get("metadata")
    volumes = stored["spec"].get("volumes") or []
    assert not any("projected" in v for v in volumes), volumes
    assert "cachewarm-report-token" not in {v["name"] for v in volumes}, volumes
    inits = {ct["name"]: ct for ct in stored["spec"]["initContainers"]}
    assert list(inits) == ["cachewarm-reporter", "cachewarm-copy"], inits
    # The first (named for the folder it fills) ships the copier, and none of the reporter:
    # no reporter module, no sitecustomize; the training container's PYTHONPATH is its own.
    shipped = {Path(f).name for f in inits["cachewarm-reporter"]["command"][1:-1]}
    assert "cachewarm_copier.py" in shipped and not shipped & {"cachewarm_reporter.py", "sitecustomize.py"}, shipped
    envs = {e["name"] for ct in [*stored["spec"]["initContainers"], *stored["spec"]["containers"]]
            for e in ct.get("env") or []}
    assert not {n for n in envs if n.startswith("CACHEWARM_REPORT") or n == "PYTHONPATH"}, envs

    eventually(lambda: ((bed.get_json("pod", "no-token", ns) or {}).get("status") or {}).get("phase") == "Running"
               or None, timeout=180, what="the pod running")
    cache["spec"]["storage"]["gcs"]["lifecycle"] = {"deleteAfterDays": 9}
    bed.apply(cache, ns)
    running = eventually(lambda: reconciled(2), timeout=90, what="cache optout reconciled with the pod running")
    assert running["status"]["reports"]["podsOptedOut"] == 1, running["status"].get("reports")

    go = bed.kubectl_run("exec", "-n", ns, "no-token", "-c", "train", "--", "touch", "/tmp/go")
    assert go.returncode == 0, go.stderr
    done = eventually(lambda: finished(bed, "pod", "no-token", ns), timeout=60, what="the pod to finish")
    logs = bed.kubectl_run("logs", "no-token", "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", (done["status"], logs.stdout[-3000:], logs.stderr[-3000:])
    assert logs.stdout.splitlines() == ["files=0", "env-url=none"], logs.stdout  # no token file at all
    assert {s["name"]: s["state"]["terminated"]["exitCode"] for s in done["status"]["initContainerStatuses"]} == {
        "cachewarm-reporter": 0, "cachewarm-copy": 0}, done["status"]["initContainerStatuses"]
    cache["spec"]["storage"]["gcs"]["lifecycle"] = {"deleteAfterDays": 8}
    bed.apply(cache, ns)
    after = eventually(lambda: reconciled(3), timeout=90, what="cache optout reconciled with the pod finished")
    assert after["status"]["reports"]["podsOptedOut"] == 0, after["status"].get("reports")


def test_two_replicas_on_the_real_node_one_leads_and_a_killed_leader_is_replaced(cluster: Installed, ns: str) -> None:
    """The Deployment's two replicas run; the Lease names one; a PodDisruptionBudget keeps
    one of them; when the leader's Pod is force-deleted (its process killed, as on a node
    loss) the other replica takes the Lease and reconciles, the webhook keeps injecting
    through the Service meanwhile, and the ReplicaSet brings the count back to two."""
    bed = cluster.bed
    pods = install.operator_pods(bed)
    assert len(pods) == manifest_deployment()["spec"]["replicas"] == 2
    assert all(p["status"]["containerStatuses"][0]["ready"] for p in pods)
    leader = install.leader_pod(bed)["metadata"]["name"]
    [other] = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != leader]
    pdb = eventually(lambda: ((bed.get_json("pdb", "cachewarm-operator", install.NAMESPACE) or {}).get("status") or {})
                     .get("currentHealthy") == 2 or None, timeout=60, what="the PodDisruptionBudget counting both")
    assert pdb

    cache = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "ha"},
             "spec": {"storage": {"gcs": {"bucket": f"ha-{uuid.uuid4().hex[:10]}", "prefix": "ha",
                                          "location": "us-central1"}}}}
    bed.apply(cache, ns)

    def current(generation: int | None = None) -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "ha", ns) or {}
        status = obj.get("status") or {}
        ok = any(cd["type"] == "Ready" and cd["status"] == "True" for cd in status.get("conditions") or [])
        gen = obj.get("metadata", {}).get("generation")
        return obj if ok and status.get("observedGeneration") == gen and (generation is None or gen == generation) \
            else None
    first = eventually(current, timeout=60, what="cache ha Ready under the first leader")

    killed = bed.kubectl_run("delete", "pod", leader, "-n", install.NAMESPACE, "--grace-period=0", "--force")
    assert killed.returncode == 0, killed.stderr
    survivor_ip = next(p["status"]["podIP"] for p in pods if p["metadata"]["name"] == other)

    def served_by_survivor_only() -> bool:
        out = bed.kubectl_run("get", "endpointslices", "-n", install.NAMESPACE, "-l",
                              "kubernetes.io/service-name=cachewarm-webhook", "-o", "json")
        ready = [a for sl in json.loads(out.stdout)["items"] for e in sl.get("endpoints") or []
                 if (e.get("conditions") or {}).get("ready") for a in e["addresses"]]
        return ready == [survivor_ip]
    eventually(served_by_survivor_only, timeout=30, what="the webhook Service left with the surviving replica")
    # Admitted by the replica left, before it has taken the Lease over (the dead leader's
    # lease runs 15 s): serving the webhook needs no leader.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "during", "labels": {"cachewarm.dev/cache": "ha"}},
           "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox", "command": ["true"]}]}}
    holder_when_admitted = install.lease_holder(bed)
    bed.apply(pod, ns)
    stored = bed.get_json("pod", "during", ns) or {}
    assert "cachewarm.dev/injected" in (stored.get("metadata") or {}).get("annotations", {}), stored.get("metadata")
    print(f"pod 'during' admitted while the Lease named {holder_when_admitted}")
    eventually(lambda: install.lease_holder(bed) == other or None, timeout=60,
               what=f"{other} holding the Lease after {leader} was killed")

    # The new leader reconciles: a spec change is observed.
    cache["spec"]["storage"]["gcs"]["lifecycle"] = {"deleteAfterDays": 9}  # type: ignore[index]
    bed.apply(cache, ns)
    after = eventually(lambda: current(first["metadata"]["generation"] + 1), timeout=90,
                       what="the changed cache reconciled by the new leader")
    assert after["status"]["bucket"]["deleteAfterDays"] == 9

    def two_ready() -> list[dict[str, Any]] | None:
        ready = [p for p in install.operator_pods(bed) if p["status"]["containerStatuses"][0]["ready"]]
        return ready if len(ready) == 2 else None
    replicas = eventually(two_ready, timeout=120, what="two ready replicas again")

    # A renewal of the shared certificate (same CA, as the operator renews it): both
    # replicas serve it without a restart, and the apiserver still trusts the webhook.
    secret = bed.get_json("secret", "cachewarm-webhook-tls", install.NAMESPACE)
    assert secret is not None
    ca = certs.KeyPair(base64.b64decode(secret["data"]["ca.crt"]), base64.b64decode(secret["data"]["ca.key"]))
    old = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = [*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))]
    renewed = certs.make_serving_cert(ca, hosts, now=dt.datetime.now(dt.timezone.utc))
    secret["data"].update({"tls.crt": base64.b64encode(renewed.cert_pem).decode(),
                           "tls.key": base64.b64encode(renewed.key_pem).decode()})
    bed.apply(secret, install.NAMESPACE)
    new_der = x509.load_pem_x509_certificate(renewed.cert_pem).public_bytes(Encoding.DER)
    for replica in replicas:
        ip = replica["status"]["podIP"]
        eventually(lambda: served_certificate(ip, 9443) == new_der or None, timeout=90,
                   what=f"replica {replica['metadata']['name']} serving the renewed certificate")
    restarts = {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
                for p in install.operator_pods(bed)}
    assert restarts == {p["metadata"]["name"]: 0 for p in replicas}, restarts
    bed.apply({**pod, "metadata": {"name": "after-renewal", "labels": {"cachewarm.dev/cache": "ha"}}}, ns)
    stored = bed.get_json("pod", "after-renewal", ns) or {}
    assert "cachewarm.dev/injected" in (stored.get("metadata") or {}).get("annotations", {}), stored.get("metadata")


def served_certificate(host: str, port: int) -> bytes:
    """The DER certificate a new TLS connection to host:port is given."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection((host, port), timeout=5) as sock, \
            context.wrap_socket(sock, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_stop_leaves_the_host_as_it_was(cluster: Installed) -> None:
    """Runs last: with the operator, warmers and training pods gone, stopping the testbed
    leaves no process, mount, cgroup, iptables rule (kube-proxy's included), sysctl or
    address of ours behind."""
    during = HostSnapshot.take()
    assert any("KUBE-SERVICES" in rule for rule in during.iptables["iptables-save"].get("nat", [])), \
        "kube-proxy's rules were not there to be removed"
    cluster.bed.stop()
    assert cluster.before.differences(HostSnapshot.take()) == {}
