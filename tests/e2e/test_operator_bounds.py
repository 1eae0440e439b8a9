"""The apiserver bounds the operator's own ServiceAccount (manifests/policy/operator_bounds.yaml)
and what injection may leave in labelled pods (manifests/policy/operator_injected_pods.yaml),
on the real kube-apiserver with `kubectl apply -k manifests/`.

Every write is made as the operator's ServiceAccount with a token the TokenRequest API
minted for it (its user name and groups exactly as the operator's pod has them; an admin's
`--as` would carry no ServiceAccount groups). The normal writes go through the operator's
own KubeClient methods with objects the package's builders make; each forbidden write is
refused with the policy's message, and what RBAC refuses before any policy sees it is said
as such. test_bounds_hold_where_rbac_is_widened gives the ServiceAccount more RBAC than
manifests/ does (a mistake, or a compromised cluster role) and shows the policies still
refuse what RBAC no longer does."""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from cachewarm.admission import admit as admission
from cachewarm.api.model import parse_spec
from cachewarm.builders import injection
from cachewarm.builders import job as jb
from cachewarm.builders.reporting import Reporting
from cachewarm.clients.kube import KubeClient
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, repo_root

pytestmark = pytest.mark.e2e

OPERATOR = ("cachewarm-system", "cachewarm-operator")
WEBHOOK = "cachewarm-pod-injector"
OWNER = {"name": "llama", "uid": "6f1c7a2e-0000-4000-8000-0000000000b0"}
WARMER = "cachewarm/warmer:0.1.0"
SPEC = {"storage": {"gcs": {"bucket": "bounds-check", "prefix": "llama", "location": "us-central1"}},
        "injection": {"mode": "ReadOnly", "report": True, "localCopy": {}},
        "warmup": {"image": "us-docker.pkg.dev/team/train:1", "targets": ["train.warm:targets"],
                   "pools": [{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                             {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}]}}


@pytest.fixture(scope="module")
def operator_kubeconfig(installed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed.service_account_kubeconfig(*OPERATOR, tmp_path_factory.mktemp("bounds") / "kubeconfig")


@pytest.fixture(scope="module")
def kube(operator_kubeconfig: Path) -> Iterator[KubeClient]:
    """The operator's own client, as the operator's ServiceAccount."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(operator_kubeconfig),  # type: ignore[no-untyped-call]
                            client_configuration=configuration)
    api = client.ApiClient(configuration)
    yield KubeClient(api)
    api.close()


@pytest.fixture
def ns(installed: Testbed, namespace: str, enforced: None) -> str:
    """A tenant namespace with the default ServiceAccount pods need (made here where no
    kube-controller-manager runs; one that made it first is fine)."""
    installed.kubectl_run("create", "serviceaccount", "default", "-n", namespace)
    return namespace


@pytest.fixture(scope="module")
def enforced(installed: Testbed, operator_kubeconfig: Path, kube: KubeClient) -> Iterator[None]:
    """Wait until the apiserver enforces each policy: it loads policies and bindings from
    its own watch, a moment after `kubectl apply` returns. Each is probed with a server-side
    dry run that only it refuses."""
    probe = f"bounds-{uuid.uuid4().hex[:8]}"
    assert as_admin(installed, "create", "namespace", probe)[0] == 0
    as_admin(installed, "create", "serviceaccount", "default", "-n", probe)  # or kube-controller-manager's
    assert as_admin(installed, "create", "-f", "-", body=pod("probe", probe))[0] == 0
    op = lambda *a, body=None: as_operator(installed, operator_kubeconfig, *a, "--dry-run=server", body=body)  # noqa: E731
    bad_pod = pod("probe-bad", probe, labels={"cachewarm.dev/cache": "x"},
                  volumes=[{"name": "cachewarm-reporter", "hostPath": {"path": "/"}}])
    probes = {
        "cachewarm-operator-pods": lambda: patch_pod(kube, probe, "probe", {"metadata": {"labels": {"x": "y"}}},
                                                     dry_run=True),
        "cachewarm-operator-configmaps": lambda: op("create", "configmap", "probe", "-n", probe),
        "cachewarm-operator-jobs": lambda: op("create", "job", "probe", "--image=busybox", "-n", probe),
        "cachewarm-operator-services": lambda: op("create", "service", "clusterip", "probe", "--tcp=80:80",
                                                  "-n", probe),
        "cachewarm-operator-webhook": lambda: op("patch", "mutatingwebhookconfiguration", WEBHOOK, "--type=json", "-p",
                                                 json.dumps([{"op": "replace", "path": "/webhooks/0/failurePolicy",
                                                              "value": "Fail"}])),
        "cachewarm-injected-pods": lambda: as_admin(installed, "create", "--dry-run=server", "-f", "-", body=bad_pod),
        "cachewarm-operator-own-objects": lambda: op("create", "secret", "generic", "probe", "-n", "cachewarm-system"),
    }
    for policy, attempt in probes.items():
        eventually(lambda: f"'{policy}'" in attempt()[1] or None, timeout=30, what=f"{policy} enforced")
    yield
    installed.kubectl_run("delete", "namespace", probe, "--wait=false")


def as_operator(bed: Testbed, kubeconfig: Path, *args: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    done = bed.kubectl_run(*args, input=json.dumps(body) if body is not None else None, kubeconfig=kubeconfig)
    return done.returncode, done.stdout + done.stderr


def as_admin(bed: Testbed, *args: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    done = bed.kubectl_run(*args, input=json.dumps(body) if body is not None else None)
    return done.returncode, done.stdout + done.stderr


def refused_by(policy: str, answer: tuple[int, str], *words: str) -> None:
    rc, out = answer
    assert rc != 0, out
    assert f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request" in out, out
    for word in words:
        assert word in out, (word, out)


def spec() -> Any:
    return parse_spec(SPEC)


def warmer_objects(namespace: str) -> list[dict[str, Any]]:
    """What the operator creates for SPEC: a GPU pool's Job; a TPU multi-host pool's
    headless Service and Indexed Job."""
    cache = spec()
    out: list[dict[str, Any]] = []
    for pool in cache.warmup.pools:
        job = jb.warmer_job(cache, cache_name="llama", namespace=namespace, pool=pool,
                            digest=jb.spec_hash(cache, pool), owner=OWNER, warmer_image=WARMER, generation=1)
        if job["spec"]["completions"] > 1:
            out.append(jb.headless_service("llama", namespace, pool, OWNER))
        out.append(job)
    return out


def pod(name: str, namespace: str, *, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    container = {"name": "train", "image": "us-docker.pkg.dev/team/train:1", "command": ["python", "train.py"],
                 "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": {"containers": [container], **spec}}


# --- 1. pods: only removing cachewarm's scheduling gate ------------------------------------

def patch_pod(kube: KubeClient, namespace: str, name: str, body: Any, *, dry_run: bool = False) -> tuple[int, str]:
    """A patch of a pod as the operator (kubectl patch reads the pod first, which the
    operator may not: RBAC gives it list, watch and patch)."""
    try:
        client.CoreV1Api(kube.api_client).patch_namespaced_pod(name, namespace, body,
                                                               **({"dry_run": "All"} if dry_run else {}))
    except ApiException as exc:
        return exc.status or 1, str(exc.body)
    return 0, ""


def test_pods_only_lose_cachewarms_gate(installed: Testbed, kube: KubeClient, ns: str) -> None:
    gates = [{"name": "example.com/quota"}, {"name": "cachewarm.dev/wait-for-warm"}]
    rc, out = as_admin(installed, "create", "-f", "-", body=pod("held", ns, schedulingGates=gates))
    assert rc == 0, out
    op = lambda body: patch_pod(kube, ns, "held", body)  # noqa: E731
    refused_by("cachewarm-operator-pods", op({"metadata": {"labels": {"team": "b"}}}), "labels")
    refused_by("cachewarm-operator-pods", op([{"op": "replace", "path": "/spec/containers/0/image",
                                               "value": "evil:1"}]), "anything else of the spec")
    # While gated, the apiserver lets a pod's node selector grow: steering it to a node.
    refused_by("cachewarm-operator-pods", op({"spec": {"nodeSelector": {"kubernetes.io/hostname": "theirs"}}}),
               "anything else of the spec")
    # Another's gate: refused by the policy; adding one: the apiserver's own validation refuses
    # it before any admission policy (gates can only be removed after creation).
    refused_by("cachewarm-operator-pods", op([{"op": "remove", "path": "/spec/schedulingGates/0"}]),
               "example.com/quota")
    rc, out = op([{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": "example.com/hold"}}])
    assert rc == 422 and "only deletion is allowed" in out, out
    # Removing our gate and something else at once.
    refused_by("cachewarm-operator-pods", op([{"op": "remove", "path": "/spec/schedulingGates/1"},
                                              {"op": "add", "path": "/metadata/annotations", "value": {"x": "y"}}]),
               "annotations")
    # What the operator does: its own client's JSON patch.
    kube.remove_scheduling_gate(ns, "held", 1, "cachewarm.dev/wait-for-warm")
    stored = installed.get_json("pod", "held", ns)
    assert stored is not None
    assert stored["spec"]["schedulingGates"] == [{"name": "example.com/quota"}]
    assert stored["spec"]["containers"][0]["image"] == "us-docker.pkg.dev/team/train:1"
    assert "team" not in (stored["metadata"].get("labels") or {})


# --- 2. ConfigMaps: only the caches' own ---------------------------------------------------

def test_configmaps_only_the_caches_own(installed: Testbed, operator_kubeconfig: Path, kube: KubeClient,
                                        ns: str) -> None:
    # A real owner: where kube-controller-manager runs, its garbage collector deletes a
    # ConfigMap whose owner does not exist.
    cache = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
             "spec": {"storage": {"gcs": {"bucket": "bounds-check", "prefix": "llama", "location": "us-central1",
                                          "create": False}}}}
    rc, out = as_admin(installed, "create", "-n", ns, "-o", "json", "-f", "-", body=cache)
    assert rc == 0, out
    ours = injection.env_configmap(spec(), "llama", ns, {"name": "llama", "uid": json.loads(out)["metadata"]["uid"]})
    assert ours["metadata"]["name"].startswith("cachewarm-llama-env-")
    assert kube.create_configmap(ours) is not None
    message = "only writes its caches' own ConfigMaps"
    coredns = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "coredns", "namespace": "kube-system"},
               "data": {"Corefile": ".:53 { forward . 6.6.6.6 }"}}
    for body in (coredns,
                 # a tenant's own name, even with our labels and owner
                 {**copy.deepcopy(ours), "metadata": {**copy.deepcopy(ours["metadata"]), "name": "team-settings"}},
                 # our name without our owner
                 {**copy.deepcopy(ours), "metadata": {k: v for k, v in ours["metadata"].items()
                                                      if k != "ownerReferences"} | {"name": "cachewarm-llama-x"}},
                 # our name, label and owner kind, but another cache's ownership than the label says
                 {**copy.deepcopy(ours), "metadata": {**copy.deepcopy(ours["metadata"]), "name": "cachewarm-other-y",
                                                      "labels": {"app.kubernetes.io/managed-by": "cachewarm",
                                                                 "cachewarm.dev/env-for": "other"}}}):
        refused_by("cachewarm-operator-configmaps",
                   as_operator(installed, operator_kubeconfig, "create", "-f", "-", body=body), message)
    # A change of an existing one: RBAC (get, create) refuses it before any policy.
    rc, out = as_operator(installed, operator_kubeconfig, "patch", "configmap", ours["metadata"]["name"], "-n", ns,
                          "--type=merge", "-p", '{"metadata":{"labels":{"x":"y"}}}')
    assert rc != 0 and "cannot patch resource" in out, out


def test_own_secret_and_lease_only(installed: Testbed, operator: OperatorHandle, operator_kubeconfig: Path,
                                   enforced: None) -> None:
    """RBAC lets the operator create Secrets and Leases in cachewarm-system (it cannot name
    what is created); the policy lets it create only its TLS Secret and its Lease, which the
    session's operator made as it started (the suite's every reconcile needs its lead)."""
    assert installed.get_json("lease", "cachewarm-operator", "cachewarm-system") is not None
    made = installed.get_json("secret", "cachewarm-webhook-tls", "cachewarm-system")
    assert made is not None and made["type"] == "kubernetes.io/tls"
    token = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
             "metadata": {"name": "kept-token", "namespace": "cachewarm-system",
                          "annotations": {"kubernetes.io/service-account.name": "cachewarm-operator"}}}
    refused_by("cachewarm-operator-own-objects",
               as_operator(installed, operator_kubeconfig, "create", "-f", "-", body=token), "only its webhook's TLS")
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "another", "namespace": "cachewarm-system"}, "spec": {}}
    refused_by("cachewarm-operator-own-objects",
               as_operator(installed, operator_kubeconfig, "create", "-f", "-", body=lease), "Lease cachewarm-operator")


# --- 3. Jobs and Services: warmers only, without host access or privilege -------------------

def test_warmer_jobs_and_services_only(installed: Testbed, operator_kubeconfig: Path, kube: KubeClient,
                                       ns: str) -> None:
    built = warmer_objects(ns)
    assert [o["kind"] for o in built] == ["Job", "Service", "Job"]
    for obj in built:
        assert kube.create(obj) is not None, obj["metadata"]["name"]
    job = built[0]
    refuse = lambda why, body: refused_by(  # noqa: E731
        "cachewarm-operator-jobs", as_operator(installed, operator_kubeconfig, "create", "-f", "-", body=body), why)
    bare = copy.deepcopy(job)
    bare["metadata"]["name"] = "no-owner"
    del bare["metadata"]["ownerReferences"]
    refuse("only writes warmer Jobs", bare)
    for name, change, why in [
        ("privileged", lambda p: p["containers"][0].update(securityContext={"privileged": True}), "privileged"),
        ("escalation", lambda p: p["initContainers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
         "privileged"),
        ("caps", lambda p: p["containers"][0].update(securityContext={"capabilities": {"add": ["NET_ADMIN"]}}),
         "capabilities"),
        ("hostpath", lambda p: p["volumes"].append({"name": "root", "hostPath": {"path": "/"}}), "hostPath"),
        ("hostnet", lambda p: p.update(hostNetwork=True), "host network"),
        ("hostpid", lambda p: p.update(hostPID=True), "host network, PID"),
        ("hostport", lambda p: p["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]), "host port"),
        ("secret", lambda p: p["volumes"].append({"name": "s", "secret": {"secretName": "any"}}),
         "only emptyDir volumes"),
        ("projected", lambda p: p["volumes"].append(
            {"name": "t", "projected": {"sources": [{"secret": {"name": "any"}}]}}), "only emptyDir volumes"),
        ("envfrom", lambda p: p["containers"][0].update(envFrom=[{"secretRef": {"name": "any"}}]), "no envFrom"),
        ("secretkey", lambda p: p["containers"][0].setdefault("env", []).append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "any", "key": "k"}}}), "no envFrom"),
        ("root", lambda p: p["containers"][0].update(securityContext={"runAsUser": 0}), "no pod security context"),
        ("podroot", lambda p: p.update(securityContext={"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}}),
         "no pod security context"),
        ("node", lambda p: p.update(nodeName="control-plane"), "no pod security context, node"),
        ("priority", lambda p: p.update(priorityClassName="system-node-critical"), "priority"),
    ]:
        body = copy.deepcopy(job)
        body["metadata"]["name"] = f"bad-{name}"
        change(body["spec"]["template"]["spec"])
        refuse(why, body)
    # Never in the cluster's own namespaces, whatever it carries.
    system = copy.deepcopy(job)
    system["metadata"].update(name="in-kube-system", namespace="kube-system")
    refuse("no warmer Job in kube-*", system)
    service = built[1]
    svc = lambda name, f: refused_by(  # noqa: E731
        "cachewarm-operator-services",
        as_operator(installed, operator_kubeconfig, "create", "-f", "-", body=f(copy.deepcopy(service), name)),
        "only writes the headless Services" if name == "no-labels" else "only makes headless Services")
    svc("no-labels", lambda s, n: {**s, "metadata": {"name": n, "namespace": ns,
                                                     "ownerReferences": s["metadata"]["ownerReferences"]}})
    svc("external", lambda s, n: {**s, "metadata": {**s["metadata"], "name": n},
                                  "spec": {**s["spec"], "externalIPs": ["8.8.8.8"]}})
    svc("nodeport", lambda s, n: {**s, "metadata": {**s["metadata"], "name": n},
                                  "spec": {**{k: v for k, v in s["spec"].items() if k != "clusterIP"},
                                           "type": "NodePort"}})
    # Deleting someone else's: refused; its own: allowed (its client's calls).
    for kind, name in (("job", "theirs"), ("service", "theirs")):
        args = (["create", "job", name, "--image=busybox", "-n", ns] if kind == "job"
                else ["create", "service", "clusterip", name, "--tcp=80:80", "-n", ns])
        assert as_admin(installed, *args)[0] == 0
        refused_by(f"cachewarm-operator-{kind}s",
                   as_operator(installed, operator_kubeconfig, "delete", kind, name, "-n", ns, "--wait=false"),
                   "DELETE")
    # A stray under a cache's warmer label, which the operator stops (reconcile/warmplan.py).
    stray = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "stray", "namespace": ns,
             "labels": {"cachewarm.dev/warmer-for": "llama", "cachewarm.dev/pool": "h100"}},
             "spec": {"template": {"spec": {"restartPolicy": "Never",
                                            "containers": [{"name": "c", "image": "busybox"}]}}}}
    assert as_admin(installed, "create", "-f", "-", body=stray)[0] == 0
    kube.delete_job(ns, "stray")
    kube.delete_service(ns, service["metadata"]["name"])
    kube.delete_job(ns, job["metadata"]["name"])
    gone = installed.get_json("job", "stray", ns)  # foreground: no controller-manager here to finish it
    assert gone is None or gone["metadata"].get("deletionTimestamp"), gone
    assert installed.get_json("service", service["metadata"]["name"], ns) is None


# --- 4. its MutatingWebhookConfiguration: only the client configuration --------------------

@pytest.fixture
def webhook_restored(installed: Testbed) -> Iterator[dict[str, Any]]:
    """The webhook configuration as installed, put back afterwards."""
    original = installed.get_json("mutatingwebhookconfiguration", WEBHOOK, "")
    assert original is not None
    yield original

    def put_back() -> bool | None:
        # The session's operator, when it runs, rewrites its CA bundle and URL on its own
        # (its certificate check, every second here): a replace between our read and write
        # is a conflict, and the next attempt reads again.
        current = installed.get_json("mutatingwebhookconfiguration", WEBHOOK, "")
        assert current is not None
        back = copy.deepcopy(original)
        back["metadata"] = {"name": WEBHOOK, "labels": original["metadata"].get("labels", {}),
                            "resourceVersion": current["metadata"]["resourceVersion"]}
        rc, out = as_admin(installed, "replace", "-f", "-", body=back)
        assert rc == 0 or "the object has been modified" in out, out
        return rc == 0 or None
    eventually(put_back, timeout=30, what="the webhook configuration put back")


def test_webhook_configuration_only_its_client_config(installed: Testbed, operator_kubeconfig: Path, kube: KubeClient,
                                                     enforced: None, webhook_restored: dict[str, Any]) -> None:
    # What the operator does: its CA bundle, and off-cluster a URL in place of the Service.
    assert kube.set_webhook_client_config(WEBHOOK, b"-----BEGIN CERTIFICATE-----\nbounds\n", None) == 1
    assert kube.set_webhook_client_config(WEBHOOK, b"-----BEGIN CERTIFICATE-----\nbounds\n",
                                          "https://127.0.0.1:9443/inject-cache") == 1
    changed = installed.get_json("mutatingwebhookconfiguration", WEBHOOK, "")
    assert changed is not None and changed["webhooks"][0]["clientConfig"]["url"].startswith("https://127.0.0.1")

    # With the operator's own verb, patch (its RBAC has no update), of the whole object as
    # read and changed (kubectl would also rewrite its last-applied annotation, which the
    # policy refuses on its own).
    hooks = DynamicClient(kube.api_client).resources.get(api_version="admissionregistration.k8s.io/v1",
                                                         kind="MutatingWebhookConfiguration")

    def attempt(change: Any) -> tuple[int, str]:
        body = hooks.get(name=WEBHOOK).to_dict()
        change(body)
        try:
            hooks.patch(name=WEBHOOK, body=body, content_type="application/merge-patch+json")
        except ApiException as exc:
            return exc.status or 1, str(exc.body)
        return 0, ""

    assert attempt(lambda b: None) == (0, "")  # the same object again: nothing changed, allowed
    message = "may change only webhooks[].clientConfig"
    hook = lambda f: lambda b: f(b["webhooks"][0])  # noqa: E731
    for change in (
        hook(lambda w: w["namespaceSelector"]["matchExpressions"][0].update(values=["cachewarm-system"])),
        hook(lambda w: w.update(namespaceSelector={})),
        hook(lambda w: w.update(failurePolicy="Fail")),
        hook(lambda w: w.update(objectSelector={})),
        hook(lambda w: w["rules"][0].update(operations=["CREATE", "UPDATE"])),
        hook(lambda w: w.update(timeoutSeconds=30)),
        lambda b: b["webhooks"].append({**copy.deepcopy(b["webhooks"][0]), "name": "more.cachewarm.dev"}),
        lambda b: b["metadata"].setdefault("labels", {}).update(extra="x"),
        # a Service in place of the URL: another endpoint than the one it had
        hook(lambda w: w.update(clientConfig={"service": {"name": "evil", "namespace": "default", "port": 443},
                                              "caBundle": w["clientConfig"]["caBundle"]})),
    ):
        refused_by("cachewarm-operator-webhook", attempt(change), message)
    rc, out = as_operator(installed, operator_kubeconfig, "delete", "mutatingwebhookconfiguration", WEBHOOK)
    assert rc != 0 and "cannot delete resource" in out, out  # RBAC, before any policy


# --- 5. labelled pods: what carries cachewarm's names has cachewarm's shape ----------------

def injected(namespace: str, image_pythonpath: str | None) -> dict[str, Any]:
    """A labelled pod as the webhook leaves it (admit_pod, the webhook's own function): by
    init containers (no image PYTHONPATH known) or in process."""
    entry = admission.index_entry(SPEC, generation=1, uid=OWNER["uid"], warmed=True,
                                  env_configmap="cachewarm-llama-env-0123456789",
                                  boot_configmap="cachewarm-llama-boot-abcdef0123",
                                  image_pythonpath=image_pythonpath,
                                  manifests={"h100": "llama/.cachewarm/pools/x/llama/h100/j.json#1"})
    base = pod(f"p-{uuid.uuid4().hex[:6]}", namespace, labels={"cachewarm.dev/cache": "llama"},
               automountServiceAccountToken=True)
    answer = admission.admit_pod(base, lambda ns, name: entry, Reporting(WARMER, "https://10.96.0.1/report/v1", "PEM"),
                                 WARMER)
    assert answer.injected
    out = copy.deepcopy(base)
    out["spec"].update(answer.spec)
    out["metadata"]["annotations"] = answer.annotations
    return out


def test_injected_pods_keep_cachewarms_shape(installed: Testbed, ns: str) -> None:
    policy = "cachewarm-injected-pods"
    by_init, in_process = injected(ns, None), injected(ns, "/app")
    assert "cachewarm-copy" in [c["name"] for c in by_init["spec"]["initContainers"]]
    assert "cachewarm-boot" in [v["name"] for v in in_process["spec"]["volumes"]]
    for body in (by_init, in_process):
        rc, out = as_admin(installed, "create", "-f", "-", body=body)
        assert rc == 0, out

    def bad(name: str, change: Any, *words: str, labelled: bool = True) -> None:
        body = copy.deepcopy(by_init if name != "boot-secret" else in_process)
        body["metadata"]["name"] = f"bad-{name}"
        if not labelled:
            body["metadata"]["labels"] = {}
        change(body["spec"])
        answer = as_admin(installed, "create", "-f", "-", body=body)
        if labelled:
            refused_by(policy, answer, *words)
        else:
            assert answer[0] == 0, answer[1]

    copier = lambda s: next(c for c in s["initContainers"] if c["name"] == "cachewarm-copy")  # noqa: E731
    volume = lambda s, n: next(v for v in s["volumes"] if v["name"] == n)  # noqa: E731
    bad("privileged", lambda s: [copier(s)["securityContext"].update(privileged=True),
                                copier(s)["securityContext"].pop("allowPrivilegeEscalation")], "cachewarm-copy")
    bad("escalation", lambda s: copier(s)["securityContext"].pop("allowPrivilegeEscalation"), "escalation")
    bad("caps", lambda s: copier(s)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "capabilities")
    bad("root", lambda s: copier(s)["securityContext"].update(runAsNonRoot=False), "runAsNonRoot")
    bad("rw-root", lambda s: copier(s)["securityContext"].pop("readOnlyRootFilesystem"), "readOnlyRootFilesystem")
    bad("hostpath", lambda s: volume(s, "cachewarm-cache").update(emptyDir=None, hostPath={"path": "/var/lib"}),
        "hostPath")
    # A torch cache's writable Inductor directory (issue 31): an emptyDir, never a host directory.
    bad("torch-hostpath", lambda s: s["volumes"].append({"name": "cachewarm-torch", "hostPath": {"path": "/var/lib"}}),
        "cachewarm-torch are emptyDirs")
    bad("token-secret", lambda s: volume(s, "cachewarm-report-token")["projected"]["sources"].append(
        {"secret": {"name": "db-password"}}), "projected ServiceAccount token")
    bad("boot-secret", lambda s: volume(s, "cachewarm-boot").update(configMap=None, secret={"secretName": "x"}),
        "cachewarm-boot")
    # Unlabelled pods are not this policy's: the same privileged init container is admitted.
    bad("unlabelled", lambda s: [copier(s)["securityContext"].update(privileged=True),
                                 copier(s)["securityContext"].pop("allowPrivilegeEscalation")], labelled=False)


# --- RBAC widened by mistake: the policies still hold --------------------------------------

WIDER = "cachewarm-bounds-test-wider"


@pytest.fixture
def wider_rbac(installed: Testbed) -> Iterator[None]:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": WIDER},
            "rules": [{"apiGroups": [""], "resources": ["configmaps", "pods", "pods/status"],
                       "verbs": ["get", "create", "update", "patch", "delete"]},
                      {"apiGroups": ["admissionregistration.k8s.io"],
                       "resources": ["mutatingwebhookconfigurations"], "verbs": ["create", "patch", "delete"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": WIDER},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": WIDER},
               "subjects": [{"kind": "ServiceAccount", "name": OPERATOR[1], "namespace": OPERATOR[0]}]}
    for obj in (role, binding):
        installed.apply(obj, "default")
    yield
    installed.kubectl_run("delete", "clusterrolebinding,clusterrole", WIDER)


def test_bounds_hold_where_rbac_is_widened(installed: Testbed, operator_kubeconfig: Path, ns: str,
                                           wider_rbac: None, webhook_restored: dict[str, Any]) -> None:
    op = lambda *a, body=None: as_operator(installed, operator_kubeconfig, *a, body=body)  # noqa: E731
    assert as_admin(installed, "create", "configmap", "coredns-like", "-n", ns, "--from-literal=k=v")[0] == 0
    refused_by("cachewarm-operator-configmaps", op("patch", "configmap", "coredns-like", "-n", ns, "--type=merge",
                                                   "-p", '{"data":{"k":"evil"}}'), "UPDATE")
    refused_by("cachewarm-operator-configmaps", op("delete", "configmap", "coredns-like", "-n", ns), "DELETE")
    refused_by("cachewarm-operator-pods", op("create", "-f", "-", body=pod("made", ns)), "CREATE of pods")
    assert as_admin(installed, "create", "-f", "-", body=pod("running", ns))[0] == 0
    refused_by("cachewarm-operator-pods", op("delete", "pod", "running", "-n", ns, "--wait=false"), "DELETE of pods")
    refused_by("cachewarm-operator-pods", op("patch", "pod", "running", "-n", ns, "--subresource=status",
                                             "--type=merge", "-p", '{"status":{"phase":"Failed"}}'), "pods/status")
    refused_by("cachewarm-operator-webhook", op("patch", "mutatingwebhookconfiguration", WEBHOOK, "--type=json",
                                                "-p", json.dumps([{"op": "replace", "path": "/webhooks/0/failurePolicy",
                                                                   "value": "Fail"}])), "failurePolicy")
    refused_by("cachewarm-operator-webhook", op("delete", "mutatingwebhookconfiguration", WEBHOOK), "DELETE")
    other = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
             "metadata": {"name": "cachewarm-bounds-other"}, "webhooks": []}
    refused_by("cachewarm-operator-webhook", op("create", "-f", "-", body=other), "CREATE")
    assert installed.get_json("configmap", "coredns-like", ns)["data"] == {"k": "v"}  # type: ignore[index]


def test_policies_are_installed_with_fail_and_deny(installed: Testbed, repo: Path) -> None:
    """Every policy here fails closed and denies (a binding in Warn or Audit would only log)."""
    docs = [d for f in ("operator_bounds.yaml", "operator_injected_pods.yaml")
            for d in yaml.safe_load_all((repo / "manifests" / "policy" / f).read_text())]
    policies = {d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert len(policies) == 7
    for name in policies:
        stored = installed.get_json("validatingadmissionpolicy", name, "")
        assert stored is not None and stored["spec"]["failurePolicy"] == "Fail", name
        binding = installed.get_json("validatingadmissionpolicybinding", name, "")
        assert binding is not None and binding["spec"]["validationActions"] == ["Deny"], name


# --- the namespaced install (manifests/namespaced) -------------------------------------------

NAMESPACED = "manifests/namespaced"
NAMESPACED_RESOURCES = {"pods", "jobs", "services", "configmaps", "events", "compilationcaches"}


def built(bed: Testbed, repo: Path, path: str) -> list[dict[str, Any]]:
    done = bed.kubectl_run("kustomize", str(repo / path))
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_namespaced_overlay_binds_namespaced_rights_per_namespace(installed: Testbed, repo: Path) -> None:
    """`kubectl kustomize manifests/namespaced` builds; no ClusterRoleBinding gives the
    operator a namespaced resource; its three namespace lists agree; it installs what
    manifests/ does (its resources list is manifests/kustomization.yaml's, which kustomize
    cannot include as `..`)."""
    docs = built(installed, repo, NAMESPACED)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    operator = {"kind": "ServiceAccount", "name": OPERATOR[1], "namespace": OPERATOR[0]}
    cluster_wide = [d for d in docs if d["kind"] == "ClusterRoleBinding" and operator in d.get("subjects", [])]
    assert [d["metadata"]["name"] for d in cluster_wide] == ["cachewarm-operator-cluster"]
    for binding in cluster_wide:
        granted = {r for rule in roles[binding["roleRef"]["name"]]["rules"] for r in rule["resources"]}
        assert not granted & NAMESPACED_RESOURCES, granted
    watched = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"
                     and d["roleRef"]["name"] == "cachewarm-operator" and d["metadata"]["namespace"] != OPERATOR[0])
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    [hook] = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    [selector] = hook["webhooks"][0]["namespaceSelector"]["matchExpressions"]
    assert watched and sorted(env["CACHEWARM_NAMESPACES"].split(",")) == watched
    assert selector["operator"] == "In" and sorted(selector["values"]) == watched
    base = yaml.safe_load((repo / "manifests" / "kustomization.yaml").read_text())["resources"]
    overlay = yaml.safe_load((repo / NAMESPACED / "kustomization.yaml").read_text())["resources"]
    assert ["../" + r for r in base] == overlay[:len(base)]


@pytest.fixture(scope="module")
def namespaced_install() -> Iterator[Testbed]:
    """A control plane of its own with manifests/namespaced applied (its example namespaces
    team-a and team-b, and team-c, which it does not watch)."""
    repo = repo_root()
    bed = Testbed().start()
    try:
        for args in (("apply", "-f", str(repo / "crds")),
                     *(("create", "namespace", n) for n in ("team-a", "team-b", "team-c")),
                     ("apply", "-k", str(repo / NAMESPACED)),
                     ("wait", "--for=condition=Established", "--timeout=60s", "crd/compilationcaches.cachewarm.dev")):
            done = bed.kubectl_run(*args)
            assert done.returncode == 0, (args, done.stderr)
        yield bed
    finally:
        bed.stop()


def test_namespaced_install_runs_the_operator_in_its_namespaces_only(namespaced_install: Testbed,
                                                                     tmp_path: Path) -> None:
    bed = namespaced_install
    who = f"--as=system:serviceaccount:{OPERATOR[0]}:{OPERATOR[1]}"
    can = lambda *a: bed.kubectl_run("auth", "can-i", *a, who).stdout.strip() == "yes"  # noqa: E731
    assert can("patch", "pods", "-n", "team-a") and can("create", "jobs.batch", "-n", "team-b")
    for ns in ("team-c", "kube-system", "default"):
        assert not can("patch", "pods", "-n", ns) and not can("create", "configmaps", "-n", ns), ns
        assert not can("create", "jobs.batch", "-n", ns) and not can("list", "compilationcaches.cachewarm.dev", "-n", ns)
    assert can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert can("patch", "mutatingwebhookconfigurations/cachewarm-pod-injector")
    assert not can("update", "mutatingwebhookconfigurations/cachewarm-pod-injector")
    assert can("create", "tokenreviews.authentication.k8s.io")
    kubeconfig = bed.service_account_kubeconfig(*OPERATOR, tmp_path / "kubeconfig")
    handle = OperatorHandle(bed, kubeconfig, {
        "CACHEWARM_NAMESPACES": "team-a,team-b", "CACHEWARM_RESYNC_SECONDS": "3", "CACHEWARM_GCP_PROJECT": "testbed",
        "CACHEWARM_RETRY_DELAY_SECONDS": "0.5", "CACHEWARM_GCS_TIMEOUT_SECONDS": "2",
        "CACHEWARM_POD_NAMESPACE": OPERATOR[0]})
    try:
        for ns in ("team-a", "team-c"):
            bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "c"},
                       "spec": {"storage": {"gcs": {"bucket": f"ns-{uuid.uuid4().hex[:8]}",
                                                    "location": "us-central1"}}}}, ns)
        eventually(lambda: ((bed.get_json("ccache", "c", "team-a") or {}).get("status") or {}).get(
            "observedGeneration") == 1 or None, timeout=60, what="the cache in team-a reconciled")
        eventually(lambda: all(h["clientConfig"].get("caBundle") for h in
                               (bed.get_json("mutatingwebhookconfiguration", WEBHOOK, "") or {})["webhooks"]) or None,
                   timeout=30, what="the webhook pointed at the operator")
        # team-c is not watched: its cache has no status of the operator's (read once
        # team-a's was reconciled; the operator never reads team-c, where RBAC would refuse
        # it: no 403 in its log below).
        unwatched = (bed.get_json("ccache", "c", "team-c") or {}).get("status") or {}
        assert unwatched.get("observedGeneration", 0) == 0 and not unwatched.get("conditions"), unwatched
    finally:
        handle.stop()
    # A right the namespaced install lacks shows up as a 403 in the operator's log.
    log = handle.log.read_text(errors="replace")
    assert not re.findall(r"User \"system:serviceaccount:cachewarm-system:[a-z-]+\" cannot [^\n]{0,200}", log)
