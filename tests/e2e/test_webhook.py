"""The pod admission webhook, through the real apiserver: labelled pods get the cache env,
everything else is left alone, user settings win, ReadOnly pods read but never write
(real JAX processes in pods the node agent runs with the env the cluster gave them), and
the webhook can neither block pods (the apiserver's own deadline and fail-open record) nor
crash."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import signal
import ssl
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import storage
from prometheus_client.parser import text_string_to_metric_families

from cachewarm.admission import certificates as certs
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

JAX_VARS = {
    "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES",
}


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
    # ReadWrite chosen (the CRD's default is ReadOnly): its threshold is the one spec.jax sets.
    make_cache(controller_manager, namespace, "llama", jax={"minCompileTimeSecs": 2.5, "minEntrySizeBytes": 100},
               injection={"mode": "ReadWrite"})
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


def test_user_env_wins_with_a_warning_and_the_pods_annotation_and_no_event(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama")
    own = [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mnt/local-cache"}]
    stored, warnings = create_pod(controller_manager, namespace, pod("mine", "llama", env=own))
    env = env_of(stored)
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/mnt/local-cache"
    assert set(env) == JAX_VARS
    assert "container 'train' keeps its own JAX_COMPILATION_CACHE_DIR" in warnings
    # Admission has no side effects (sideEffects: None): the fact is on the pod, not in an Event.
    assert stored["metadata"]["annotations"]["cachewarm.dev/injected"].endswith(
        "; kept its own train/JAX_COMPILATION_CACHE_DIR")
    assert [e for e in events(controller_manager, namespace) if e["reason"] == "UserEnvKept"] == []


def events(bed: Testbed, ns: str) -> list[dict[str, Any]]:
    result = bed.kubectl_run("get", "events", "-n", ns, "-o", "json")
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["items"])


def objects(bed: Testbed, ns: str) -> dict[str, list[str]]:
    """The names of every kind of object a webhook could write into `ns` (Events apart:
    the operator's reconciles post their own; see admission_events)."""
    kinds = "pods,configmaps,secrets,serviceaccounts,services,jobs,persistentvolumeclaims,leases"
    result = bed.kubectl_run("get", kinds, "-n", ns, "-o", "json")
    assert result.returncode == 0, result.stderr
    found: dict[str, list[str]] = {}
    for item in json.loads(result.stdout)["items"]:
        found.setdefault(item["kind"], []).append(item["metadata"]["name"])
    return {kind: sorted(names) for kind, names in found.items()}


def admission_events(bed: Testbed, ns: str) -> list[dict[str, Any]]:
    """Events an admission could have posted: cachewarm's about a pod, or a kept user env.
    (A scheduler or kubelet running in the session posts its own about pods: Scheduled.)"""
    return [e for e in events(bed, ns)
            if (e["involvedObject"].get("kind") == "Pod" and "cachewarm" in (
                e.get("reportingComponent") or "", (e.get("source") or {}).get("component") or ""))
            or e["reason"] == "UserEnvKept"]


def test_a_server_side_dry_run_of_a_labelled_pod_creates_nothing(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    make_cache(controller_manager, namespace, "llama")
    before = objects(controller_manager, namespace)
    # The user env kept: what used to post an Event from admission.
    own = [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mnt/local-cache"}]
    result = controller_manager.kubectl_run("create", "--dry-run=server", "-o", "json", "-n", namespace, "-f", "-",
                                            input=yaml.safe_dump(pod("dry", "llama", env=own)))
    assert result.returncode == 0, result.stderr
    answered = json.loads(result.stdout)
    assert "cachewarm.dev/injected" in answered["metadata"]["annotations"]  # the webhook was called
    assert "keeps its own JAX_COMPILATION_CACHE_DIR" in result.stderr
    # A real create after it: its admission is done once the pod exists, so anything the
    # dry run's admission wrote in the background would have been written by now too.
    create_pod(controller_manager, namespace, pod("after", "llama"))
    after = objects(controller_manager, namespace)
    after["Pod"].remove("after")
    if not after["Pod"]:
        del after["Pod"]
    assert after == before
    assert admission_events(controller_manager, namespace) == []


def test_a_forged_review_without_the_apiservers_client_certificate_is_refused_and_reveals_nothing(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    """The admission listener asks for the apiserver's client certificate (the testbed's
    apiserver presents it through its admission configuration): a caller without one is
    refused in the TLS handshake, learns no bucket or prefix, and writes nothing. A pod
    the apiserver admits still gets its env (the other tests here)."""
    make_cache(controller_manager, namespace, "llama")
    bucket = controller_manager.get_json("ccache", "llama", namespace)["spec"]["storage"]["gcs"]["bucket"]
    before = objects(controller_manager, namespace)
    forged = json.dumps(review({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "forged", "namespace": namespace, "labels": {"cachewarm.dev/cache": "llama"}},
        "spec": {"containers": [{"name": "c", "image": "x", "env": [
            {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/x"}]}]}}, namespace=namespace)).encode()
    outcomes = []
    for who in ("nobody", "another CA"):
        try:
            status, answer = post_webhook(controller_manager, operator, forged, as_apiserver=False,
                                          stranger=(who == "another CA"))
            patch = base64.b64decode(((answer or {}).get("response") or {}).get("patch") or "").decode()
            outcomes.append(f"{status} {json.dumps(answer)} {patch}")
        except (ssl.SSLError, ConnectionError, urllib.error.URLError) as exc:
            outcomes.append(f"refused: {exc}")
    assert all(o.startswith("refused") or o.split()[0] in ("401", "403") for o in outcomes), outcomes
    assert not any(bucket in o for o in outcomes), outcomes
    # The same review as the apiserver would send it is answered (so the refusal above
    # was the missing certificate), and it names the bucket.
    status, answer = post_webhook(controller_manager, operator, forged)
    assert status == 200 and bucket in base64.b64decode(answer["response"]["patch"]).decode()
    # Nothing written by either: no Event for the kept env, no object.
    assert objects(controller_manager, namespace) == before
    assert admission_events(controller_manager, namespace) == []


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


def finished(bed: Testbed, ns: str, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = bed.get_json("pod", name, ns) or {}
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    return eventually(done, timeout=180, what=f"pod {ns}/{name} to finish")


def test_read_only_pods_read_hits_and_never_write(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, gcs: storage.Client
) -> None:
    """On the node agent, so every env is the one the cluster gave: the operator's warmer
    Job (the env its Job builder wrote) fills the cache; a training pod created through
    the apiserver, admitted by the webhook and run with exactly the env stored for it reads
    every entry and writes none, even for a program the warmer never compiled (--extra)."""
    bed = controller_manager
    make_cache(bed, namespace, "ro", jax={"minCompileTimeSecs": 0}, injection={"mode": "ReadOnly"},
               warmup={"image": "test/targets:1", "command": ["python", "jax_train.py"], "pools": [{"name": "cpu"}]})

    def warmed() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "ro", namespace) or {}
        cond = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}.get("Warmed") or {}
        return obj if cond.get("status") == "True" and cond.get("reason") not in ("Warming", "Rewarming") else None
    obj = eventually(warmed, timeout=180, what="the cache Warmed by its warmer Job")
    gcs_spec = obj["spec"]["storage"]["gcs"]
    [pool] = obj["status"]["warmup"]["pools"]
    entries = {b.name for b in gcs.list_blobs(gcs_spec["bucket"])}
    assert pool["entriesWritten"] > 0 and entries == {b.name for b in gcs.list_blobs(gcs_spec["bucket"], prefix="jax/")}
    assert len([e for e in entries if e.endswith("-cache")]) == pool["entriesWritten"]

    reader = pod("reader", "ro")
    reader["spec"]["restartPolicy"] = "Never"
    reader["spec"]["containers"][0].update(image="test/targets:1", command=["python", "jax_train.py", "--extra"])
    stored, _ = create_pod(bed, namespace, reader)
    assert env_of(stored)["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "1e9"
    done = finished(bed, namespace, "reader")
    log = bed.pod_log(namespace, "reader", "train")
    assert done["status"]["phase"] == "Succeeded", log[-2000:]
    result = json.loads(log.strip().splitlines()[-1])
    assert result["hits"] == pool["entriesWritten"], (result, pool)
    assert result["compiled"] == 1, (result, pool)  # evaluate() was never warmed
    assert "Error" not in log and "Warning" not in log, log[-2000:]
    assert {b.name for b in gcs.list_blobs(gcs_spec["bucket"])} == entries


def apiserver_metric(bed: Testbed, metric: str, **labels: str) -> float:
    """The sum of the samples with `labels` of the apiserver's own metric family `metric`
    (the parser names a counter's samples with a _total suffix the apiserver does not write)."""
    got = bed.kubectl_run("get", "--raw", "/metrics")
    assert got.returncode == 0, got.stderr
    return sum(sample.value for family in text_string_to_metric_families(got.stdout) if family.name == metric
               for sample in family.samples if labels.items() <= sample.labels.items())


def test_pods_are_created_while_the_operator_is_stopped(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    """With the operator stopped (SIGSTOP: its port accepts the connection, nothing
    answers), the apiserver gives up on the webhook at the configuration's timeoutSeconds,
    3 s as the README says, fails open (failurePolicy Ignore) and stores the pod as it came.
    Shown by what the apiserver recorded, not by a clock of ours: its call carried its own
    deadline (`?timeout=3s`), ended on that deadline (context deadline exceeded), and its
    fail-open counter for our webhook went up by one."""
    bed = controller_manager
    make_cache(bed, namespace, "llama")
    config = bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
    assert config is not None
    [hook] = config["webhooks"]
    log = bed.workdir / "logs" / "kube-apiserver.log"
    offset = log.stat().st_size
    failed_open = apiserver_metric(bed, "apiserver_admission_webhook_fail_open_count", name=hook["name"], type="admit")
    os.kill(operator.pid, signal.SIGSTOP)
    try:
        stored, _ = create_pod(bed, namespace, pod("while-down", "llama"))
    finally:
        os.kill(operator.pid, signal.SIGCONT)
    assert "env" not in stored["spec"]["containers"][0]
    assert "cachewarm.dev/injected" not in (stored["metadata"].get("annotations") or {})
    assert apiserver_metric(bed, "apiserver_admission_webhook_fail_open_count", name=hook["name"],
                            type="admit") == failed_open + 1

    def failed_open_lines() -> list[str]:  # klog flushes its buffer every few seconds
        text = log.read_bytes()[offset:].decode(errors="replace")
        return [line for line in text.splitlines() if f"Failed calling webhook, failing open {hook['name']}" in line]
    [line] = eventually(failed_open_lines, timeout=30, what="the apiserver's fail-open log line")
    assert "/inject-cache?timeout=3s" in line and "context deadline exceeded" in line, line
    # What it went by: the installed configuration's.
    assert (hook["timeoutSeconds"], hook["failurePolicy"]) == (3, "Ignore")


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


def post_webhook(bed: Testbed, operator: OperatorHandle, body: bytes, *, as_apiserver: bool = True,
                 stranger: bool = False) -> tuple[int, Any]:
    """POST to the webhook straight, as the apiserver does (its client certificate) or,
    with as_apiserver False, as anyone else (no certificate, or with `stranger` one of
    a CA the operator does not trust). Raises ssl.SSLError / URLError when refused."""
    cfg = bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
    assert cfg is not None
    ca = base64.b64decode(cfg["webhooks"][0]["clientConfig"]["caBundle"])
    ctx = ssl.create_default_context(cadata=ca.decode())
    if as_apiserver:
        ctx.load_cert_chain(*map(str, bed.webhook_client_cert))
    elif stranger:
        now = dt.datetime.now(dt.timezone.utc)
        other = certs.make_client_cert(certs.make_ca("stranger", now=now), "kube-apiserver", now=now)
        where = Path(tempfile.mkdtemp(prefix="stranger-"))
        (where / "c.crt").write_bytes(other.cert_pem)
        (where / "c.key").write_bytes(other.key_pem)
        ctx.load_cert_chain(str(where / "c.crt"), str(where / "c.key"))
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
    # D7: one fixed restricted context, as the training container's user (never its own context).
    assert all(ct["securityContext"] == {**restricted, "privileged": False, "readOnlyRootFilesystem": True}
               for ct in spec["initContainers"]), spec["initContainers"]
    token = next(v for v in spec["volumes"] if v["name"] == "cachewarm-report-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "cachewarm"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["PYTHONPATH"]["value"] == "/cachewarm-reporter:/app/lib"
    assert env["CACHEWARM_REPORT_URL"]["value"] == operator.report_url  # the reports listener, not admission's
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


def test_a_service_accounts_opt_out_of_tokens_holds_unless_the_pod_says_otherwise(
    operator: OperatorHandle, controller_manager: Testbed, namespace: str
) -> None:
    """Issue 28 item 11, Kubernetes' rule through the running webhook (which reads it from
    the pod as the apiserver's ServiceAccount plugin left it, before any webhook): a pod that
    leaves automountServiceAccountToken unset, of a ServiceAccount that sets it false, gets
    no projected token and no reporter from us (the cache env still), says why, and is
    counted in status.reports.podsOptedOut; the same ServiceAccount with the pod's field
    true: token and reporter (the pod's choice wins), not counted."""
    bed = controller_manager
    make_cache(bed, namespace, "llama", report=True)
    bed.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "no-tokens"},
               "automountServiceAccountToken": False}, namespace)
    unset = pod("unset", "llama")
    unset["spec"]["serviceAccountName"] = "no-tokens"
    stored, warnings = create_pod(bed, namespace, unset)
    spec = stored["spec"]
    assert "automountServiceAccountToken" not in spec  # left to the ServiceAccount
    assert "cachewarm-report-token" not in {v["name"] for v in spec.get("volumes") or []}
    assert not [ct["name"] for ct in spec.get("initContainers") or [] if ct["name"].startswith("cachewarm-")]
    assert "CACHEWARM_REPORT_URL" not in env_of(stored) and env_of(stored)["JAX_COMPILATION_CACHE_DIR"]
    assert "its ServiceAccount 'no-tokens' sets automountServiceAccountToken false" in warnings
    assert stored["metadata"]["annotations"]["cachewarm.dev/injected"].endswith(
        "; no token or reporter: opted out of ServiceAccount tokens")

    chosen = pod("chosen", "llama")
    chosen["spec"].update(serviceAccountName="no-tokens", automountServiceAccountToken=True)
    stored, warnings = create_pod(bed, namespace, chosen)
    token = next(v for v in stored["spec"]["volumes"] if v["name"] == "cachewarm-report-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "cachewarm"
    assert [ct["name"] for ct in stored["spec"]["initContainers"]] == ["cachewarm-reporter", "cachewarm-pythonpath"]
    assert "no token or reporter" not in stored["metadata"]["annotations"]["cachewarm.dev/injected"]
    assert "automountServiceAccountToken" not in warnings

    def counted() -> dict[str, Any] | None:
        got = bed.get_json("ccache", "llama", namespace) or {}
        return got if (got.get("status", {}).get("reports") or {}).get("podsOptedOut") == 1 else None
    eventually(counted, timeout=30, what="status.reports.podsOptedOut == 1 (the unset pod only)")
