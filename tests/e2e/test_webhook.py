"""The pod admission webhook, through the real apiserver: labelled pods get the cache env,
everything else is left alone, user settings win, ReadOnly pods read but never write
(real JAX processes), and the webhook can neither block pods nor crash."""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import storage

from cachewarm.builders.injection import cache_env
from cachewarm.model import parse_spec
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.podrun import run_container

pytestmark = pytest.mark.e2e

JAX_VARS = {
    "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES",
}
TRAIN = Path(__file__).parent.parent / "data" / "jax_train.py"


def make_cache(bed: Testbed, ns: str, name: str, report: bool | None = False, **spec: Any) -> dict[str, Any]:
    """A Ready cache. Its pods get the cache env only (injection.report false) unless the
    test asks for the reporter (True) or leaves the field to the CRD's default (None):
    test_reporter_is_added_to_every_container_that_can_take_it shows that part of the patch."""
    if report is not None:
        spec = {**spec, "injection": {"report": report, **(spec.get("injection") or {})}}
    bucket = f"wh-{uuid.uuid4().hex[:10]}"
    obj = {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}}, **spec},
    }
    bed.apply(obj, ns)
    def ready() -> dict[str, Any] | None:
        got = bed.get_json("ccache", name, ns)
        conds = {c["type"]: c["status"] for c in (got or {}).get("status", {}).get("conditions", [])}
        return got if conds.get("Ready") == "True" else None
    return eventually(ready, what=f"cache {ns}/{name} Ready")


def pod(name: str, cache: str | None, env: list[dict[str, str]] | None = None, init: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "train", "image": "python:3.11", "command": ["python", "train.py"],
        # Passes PodSecurity "restricted", which cachewarm-system enforces.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if env:
        container["env"] = env
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                           "spec": {"containers": [container]}}
    if cache is not None:
        obj["metadata"]["labels"] = {"cachewarm.dev/cache": cache}
    if init:
        obj["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox", "command": ["true"]}]
    return obj


def create_pod(bed: Testbed, ns: str, obj: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Create through the apiserver; return the stored pod and kubectl's stderr (warnings)."""
    result = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    assert result.returncode == 0, result.stderr
    stored = bed.get_json("pod", obj["metadata"]["name"], ns)
    assert stored is not None
    return stored, result.stderr


def env_of(stored: dict[str, Any], which: str = "containers") -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in stored["spec"][which][0].get("env", [])}


def webhook_calls(operator: OperatorHandle, ns: str, name: str) -> int:
    return operator.log.read_text(errors="replace").count(f"object=Pod/{ns}/{name}")


def test_labelled_pod_is_stored_with_cache_env_and_annotation(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama", jax={"minCompileTimeSecs": 2.5, "minEntrySizeBytes": 100})
    bucket = controller_manager.get_json("ccache", "llama", namespace)["spec"]["storage"]["gcs"]["bucket"]
    stored, _ = create_pod(controller_manager, namespace, pod("trainer", "llama", init=True))
    expected = {
        "JAX_COMPILATION_CACHE_DIR": f"gs://{bucket}/jax",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2.5",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "100",
        "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
    }
    assert env_of(stored) == expected
    assert env_of(stored, "initContainers") == expected
    assert stored["metadata"]["annotations"]["cachewarm.dev/injected"] == (
        f"llama (generation 1, ReadWrite, gs://{bucket}/jax)"
    )
    described = controller_manager.kubectl_run("describe", "pod", "trainer", "-n", namespace).stdout
    assert "cachewarm.dev/injected: llama (generation 1" in described

    def counted() -> bool:
        got = controller_manager.get_json("ccache", "llama", namespace)
        return bool(got and got["status"].get("injection", {}).get("recentPods") == 1)
    eventually(counted, timeout=30, what="status.injection.recentPods == 1")


def test_unlabelled_pod_is_untouched_and_never_sent(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama")
    stored, warnings = create_pod(controller_manager, namespace, pod("plain", None))
    assert "env" not in stored["spec"]["containers"][0]
    assert "annotations" not in stored["metadata"]
    assert warnings == ""
    # Control: a labelled pod does show up in the webhook's log, so absence means something.
    create_pod(controller_manager, namespace, pod("labelled", "llama"))
    eventually(lambda: webhook_calls(operator, namespace, "labelled") > 0, timeout=10, what="webhook log line")
    assert webhook_calls(operator, namespace, "plain") == 0


def test_user_env_wins_with_warning_and_event(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama")
    own = [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mnt/local-cache"}]
    stored, warnings = create_pod(controller_manager, namespace, pod("mine", "llama", env=own))
    env = env_of(stored)
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/mnt/local-cache"
    assert set(env) == JAX_VARS
    assert "container 'train' keeps its own JAX_COMPILATION_CACHE_DIR" in warnings
    eventually(
        lambda: any(e["reason"] == "UserEnvKept" and "Pod mine" in e["message"]
                    for e in controller_manager.events_for("llama", namespace)),
        timeout=20, what="UserEnvKept event on the cache",
    )


def test_missing_or_foreign_cache_admits_pod_unchanged_with_warning(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    stored, warnings = create_pod(controller_manager, namespace, pod("lost", "no-such-cache"))
    assert "env" not in stored["spec"]["containers"][0]
    assert f"no CompilationCache 'no-such-cache' in namespace '{namespace}'" in warnings

    other = f"{namespace}-other"
    assert controller_manager.kubectl_run("create", "namespace", other).returncode == 0
    try:
        make_cache(controller_manager, other, "theirs")
        stored, warnings = create_pod(controller_manager, namespace, pod("borrow", "theirs"))
        assert "env" not in stored["spec"]["containers"][0]
        assert f"no CompilationCache 'theirs' in namespace '{namespace}'" in warnings
    finally:
        controller_manager.kubectl_run("delete", "namespace", other, "--wait=false")


def test_read_only_pods_read_hits_and_never_write(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str, gcs: storage.Client
) -> None:
    obj = make_cache(controller_manager, namespace, "ro", jax={"minCompileTimeSecs": 0},
                     injection={"mode": "ReadOnly"})
    gcs_spec = obj["spec"]["storage"]["gcs"]
    base_env = controller_manager.env()

    # A warmer (the same env builder, role "warmer") writes the entries.
    warmer_env = {e["name"]: e["value"] for e in cache_env(parse_spec(obj["spec"]), "warmer")}
    warm = run_container({"spec": {"containers": [{"name": "w", "env": [
        {"name": k, "value": v} for k, v in warmer_env.items()]}]}},
        [sys.executable, str(TRAIN)], base_env=base_env)
    assert warm.returncode == 0, warm.stderr[-2000:]
    warmed = json.loads(warm.stdout.splitlines()[-1])
    assert warmed["compiled"] > 0 and warmed["hits"] == 0
    entries = {b.name for b in gcs.list_blobs(gcs_spec["bucket"])}
    assert len(entries) == warmed["compiled"]

    # A training pod admitted through the webhook reads them and writes nothing, even for
    # a program the warmer never compiled (--extra).
    stored, _ = create_pod(controller_manager, namespace, pod("reader", "ro"))
    assert env_of(stored)["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "1e9"
    read = run_container(stored, [sys.executable, str(TRAIN), "--extra"], base_env=base_env)
    assert read.returncode == 0, read.stderr[-2000:]
    result = json.loads(read.stdout.splitlines()[-1])
    assert result["hits"] == warmed["compiled"]
    assert result["compiled"] == 1, (result, warmed)  # evaluate() was never warmed
    assert "Error" not in read.stderr and "Warning" not in read.stderr, read.stderr[-2000:]
    assert {b.name for b in gcs.list_blobs(gcs_spec["bucket"])} == entries


def test_pods_are_created_while_the_operator_is_stopped(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama")
    os.kill(operator.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        stored, _ = create_pod(controller_manager, namespace, pod("while-down", "llama"))
        waited = time.monotonic() - t0
    finally:
        os.kill(operator.pid, signal.SIGCONT)
    assert "env" not in stored["spec"]["containers"][0]
    assert waited < 30  # bounded by the webhook timeout, not by the operator coming back


def test_pods_in_operator_and_system_namespaces_are_never_sent(
    operator: OperatorHandle, controller_manager: Testbed
) -> None:
    for ns in ("cachewarm-system", "kube-system"):
        name = f"sys-{uuid.uuid4().hex[:6]}"
        make_cache(controller_manager, ns, name)
        try:
            eventually(lambda: controller_manager.get_json("serviceaccount", "default", ns), what="default SA")
            stored, warnings = create_pod(controller_manager, ns, pod(name, name))
            assert "env" not in stored["spec"]["containers"][0]
            assert warnings == ""
            assert webhook_calls(operator, ns, name) == 0
        finally:
            controller_manager.kubectl_run("delete", "pod", name, "-n", ns, "--wait=false")
            controller_manager.kubectl_run("delete", "ccache", name, "-n", ns, "--wait=false")


# -- straight to the webhook over HTTPS -------------------------------------------------


def post_webhook(bed: Testbed, operator: OperatorHandle, body: bytes) -> tuple[int, Any]:
    cfg = bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
    assert cfg is not None
    ca = base64.b64decode(cfg["webhooks"][0]["clientConfig"]["caBundle"])
    ctx = ssl.create_default_context(cadata=ca.decode())
    req = urllib.request.Request(f"{operator.webhook_url}/inject-cache", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def review(obj: Any, *, resource: str = "pods", uid: str = "u-1", namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": resource}, "namespace": namespace,
        "operation": "CREATE", "userInfo": {"username": "test"}, "object": obj}}


def test_reinvocation_of_an_injected_pod_changes_nothing(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama", report=None)  # the CRD's default: the reporter on
    stored, _ = create_pod(controller_manager, namespace, pod("again", "llama"))
    assert [c["name"] for c in stored["spec"]["initContainers"]] == ["cachewarm-reporter", "cachewarm-pythonpath"]
    status, answer = post_webhook(controller_manager, operator,
                                  json.dumps(review(stored, namespace=namespace)).encode())
    assert status == 200
    assert answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]


@pytest.mark.parametrize(("body", "status"), [
    pytest.param(b"\xff\xfe\x00garbage", 400, id="not-utf8"),
    pytest.param(b"{not json", 400, id="not-json"),
    pytest.param(b"[1, 2, 3]", 400, id="json-list"),
    pytest.param(json.dumps({"kind": "Pod"}).encode(), 400, id="wrong-kind"),
    pytest.param(json.dumps({"kind": "AdmissionReview"}).encode(), 400, id="no-request"),
    pytest.param(json.dumps({"kind": "AdmissionReview", "request": {"object": {}}}).encode(), 400, id="no-uid"),
    pytest.param(json.dumps(review({"metadata": {"name": "x"}}, resource="services")).encode(), 200, id="other-resource"),
    pytest.param(json.dumps(review({"metadata": {"labels": {"cachewarm.dev/cache": "x"}}, "spec": "nonsense"})).encode(),
                 200, id="broken-pod"),
    pytest.param(json.dumps(review({"metadata": {"name": "p", "labels": {"cachewarm.dev/cache": "x"}}})).encode(),
                 200, id="pod-without-spec"),
    pytest.param(json.dumps(review({"metadata": {"name": "big"}, "spec": {"containers": [
        {"name": "c", "command": ["x" * (3 * 1024 * 1024)]}]}})).encode(), 413, id="huge"),
])
def test_malformed_reviews_get_well_formed_answers(
    operator: OperatorHandle, installed: Testbed, body: bytes, status: int
) -> None:
    got_status, answer = post_webhook(installed, operator, body)
    assert got_status == status
    if status == 200:
        assert answer["response"] == {"uid": "u-1", "allowed": True, **(
            {"warnings": answer["response"]["warnings"]} if "warnings" in answer["response"] else {})}
    else:
        assert answer["kind"] == "Status" and answer["message"]
    # The server is still there and still answers a good request.
    ok_status, ok = post_webhook(installed, operator, json.dumps(review(
        {"metadata": {"name": "ok", "namespace": "default"}, "spec": {"containers": [{"name": "c"}]}})).encode())
    assert ok_status == 200 and ok["response"]["allowed"] is True


def test_reporter_is_added_to_every_container_that_can_take_it(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    """With injection.report, the pod gets the reporter: its init containers,
    the emptyDir and a projected token for audience cachewarm, and PYTHONPATH (ours first,
    then the container's own), where to report and the CA the operator serves. A container
    with envFrom sources is left without it. In a namespace that enforces PodSecurity
    'restricted', the patched pod is still admitted."""
    bed = controller_manager
    assert bed.kubectl_run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
                           ).returncode == 0
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": f"wh-{uuid.uuid4().hex[:10]}", "location": "us-central1"}},
                        "injection": {"report": True}}}, namespace)
    eventually(lambda: (bed.get_json("ccache", "llama", namespace) or {}).get("status", {}).get("bucket"),
               what="the cache reconciled")
    restricted = {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                  "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "labels": {"cachewarm.dev/cache": "llama"}},
           "spec": {"restartPolicy": "Never", "nodeSelector": {"cachewarm.test/nowhere": "true"}, "containers": [
               {"name": "train", "image": "demo/train:1", "command": ["python", "train.py"],
                "env": [{"name": "PYTHONPATH", "value": "/app/lib"}], "securityContext": restricted},
               {"name": "sidecar", "image": "demo/train:1", "command": ["python", "-c", "pass"],
                "envFrom": [{"configMapRef": {"name": "team", "optional": True}}], "securityContext": restricted}]}}
    stored, _ = create_pod(bed, namespace, obj)
    spec = stored["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["cachewarm-reporter", "cachewarm-pythonpath"]
    assert spec["initContainers"][0]["image"] == "cachewarm/warmer:0.1.0"
    assert spec["initContainers"][1]["image"] == "demo/train:1"  # the training image's own python
    assert spec["initContainers"][1]["securityContext"] == restricted  # exactly the training container's
    token = next(v for v in spec["volumes"] if v["name"] == "cachewarm-report-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "cachewarm"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["PYTHONPATH"]["value"] == "/cachewarm-reporter:/app/lib"
    assert env["CACHEWARM_REPORT_URL"]["value"] == f"{operator.webhook_url}/report/v1"
    assert env["CACHEWARM_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    config = json.loads(bed.kubectl_run("get", "mutatingwebhookconfiguration", "cachewarm-pod-injector", "-o",
                                        "json").stdout)
    assert env["CACHEWARM_REPORT_CA"]["value"].encode() == base64.b64decode(
        config["webhooks"][0]["clientConfig"]["caBundle"])
    assert {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]} >= {
        "/cachewarm-reporter", "/var/run/secrets/cachewarm"}
    sidecar = spec["containers"][1]
    assert "PYTHONPATH" not in {e["name"] for e in sidecar.get("env") or []}
    assert "/cachewarm-reporter" not in {m["mountPath"] for m in sidecar.get("volumeMounts") or []}

    # injection.report false: the cache env only.
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "quiet"},
               "spec": {"storage": {"gcs": {"bucket": f"wh-{uuid.uuid4().hex[:10]}", "location": "us-central1"}},
                        "injection": {"report": False}}}, namespace)
    eventually(lambda: (bed.get_json("ccache", "quiet", namespace) or {}).get("status", {}).get("bucket"),
               what="the quiet cache reconciled")
    quiet = {**obj, "metadata": {"name": "quiet", "labels": {"cachewarm.dev/cache": "quiet"}}}
    stored, _ = create_pod(bed, namespace, quiet)
    assert "initContainers" not in stored["spec"] and env_of(stored)["PYTHONPATH"] == "/app/lib"
    assert "cachewarm-reporter" not in {v["name"] for v in stored["spec"].get("volumes") or []}
