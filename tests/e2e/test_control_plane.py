"""The local control plane is a real Kubernetes API: CRDs become Established, RBAC denies
what was not granted, and `make dev-up`'s CLI starts and stops it idempotently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e


def test_apiserver_reports_pinned_version(testbed: Testbed, repo: Path) -> None:
    pinned = (repo / "hack" / "versions.env").read_text()
    out = testbed.kubectl_run("version", "-o", "json")
    assert out.returncode == 0, out.stderr
    server = json.loads(out.stdout)["serverVersion"]["gitVersion"]
    assert f"K8S_VERSION={server.removeprefix('v')}" in pinned


def test_crd_is_established(crd_installed: Testbed) -> None:
    out = crd_installed.kubectl_run("api-resources", "--api-group=cachewarm.dev", "-o", "name")
    assert out.stdout.split() == ["compilationcaches.cachewarm.dev"]


def test_rbac_denies_service_account_without_grant(testbed: Testbed, namespace: str, tmp_path: Path) -> None:
    assert testbed.kubectl_run("create", "serviceaccount", "nobody", "-n", namespace).returncode == 0
    kubeconfig = testbed.service_account_kubeconfig(namespace, "nobody", tmp_path / "kubeconfig")

    denied = testbed.kubectl_run("get", "configmaps", "-n", namespace, kubeconfig=kubeconfig)
    assert denied.returncode != 0
    assert f"system:serviceaccount:{namespace}:nobody" in denied.stderr
    assert "forbidden" in denied.stderr

    role = testbed.kubectl_run(
        "create", "role", "cm-reader", "--verb=get,list", "--resource=configmaps", "-n", namespace
    )
    assert role.returncode == 0, role.stderr
    granted = testbed.kubectl_run(
        "create", "rolebinding", "nobody-reads", "--role=cm-reader",
        f"--serviceaccount={namespace}:nobody", "-n", namespace,
    )
    assert granted.returncode == 0, granted.stderr
    allowed = testbed.kubectl_run("get", "configmaps", "-n", namespace, kubeconfig=kubeconfig)
    assert allowed.returncode == 0, allowed.stderr


def test_controller_manager_runs_jobs_into_pods(controller_manager: Testbed, namespace: str) -> None:
    made = controller_manager.kubectl_run(
        "create", "job", "hello", "--image=busybox", "-n", namespace, "--", "true"
    )
    assert made.returncode == 0, made.stderr
    waited = controller_manager.kubectl_run(
        "wait", "--for=create", "pod", "-l", "job-name=hello", "-n", namespace, "--timeout=60s"
    )
    assert waited.returncode == 0, waited.stderr


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachewarm_testbed", *args],
        cwd=cwd, capture_output=True, text=True, timeout=180, env=os.environ.copy(),
    )


def test_dev_up_is_idempotent_and_dev_down_leaves_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "dev"
    first = run_cli("up", str(workdir), "--no-controller-manager", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    try:
        bed = Testbed.load(workdir)
        assert bed is not None and bed.healthy()
        pids = dict(bed.state.pids)
        assert set(pids) == {"etcd", "kube-apiserver", "gcs-emulator", "gcs-proxy"}

        env = dict(os.environ)
        for line in (workdir / "env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip("'")
        listed = subprocess.run(["kubectl", "api-resources", "-o", "name"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "namespaces" in listed.stdout.split()

        second = run_cli("up", str(workdir), "--no-controller-manager", cwd=tmp_path)
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stdout
        again = Testbed.load(workdir)
        assert again is not None and again.state.pids == pids
    finally:
        down = run_cli("down", str(workdir), cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not workdir.exists()
    for name, pid in pids.items():
        assert not Proc(name=name, pid=pid, log=Path("/dev/null")).alive(), f"{name} outlived dev-down"


def test_cert_manager_overlay_renders_with_ca_injection_and_cert_dir(testbed: Testbed, repo: Path) -> None:
    out = testbed.kubectl_run("kustomize", str(repo / "manifests" / "cert-manager"))
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout)}
    hook = docs[("MutatingWebhookConfiguration", "cachewarm-pod-injector")]
    assert hook["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "cachewarm-system/cachewarm-webhook"}
    operator = docs[("Deployment", "cachewarm-operator")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in operator["containers"][0]["env"]}  # valueFrom ones: None
    assert env["CACHEWARM_WEBHOOK_CERT_DIR"] == "/etc/cachewarm/tls"
    assert env["CACHEWARM_WEBHOOK_CONFIGURATION"] == ""
    assert {"name": "tls", "secret": {"secretName": "cachewarm-webhook-tls"}} in operator["volumes"]
    serving = docs[("Certificate", "cachewarm-webhook")]["spec"]
    assert serving["secretName"] == "cachewarm-webhook-tls"
    # Issued by a CA of its own, not self-signed: its renewals keep ca.crt, which pods'
    # reporters were given at admission.
    issuer = docs[("Issuer", serving["issuerRef"]["name"])]["spec"]
    ca = docs[("Certificate", "cachewarm-webhook-ca")]["spec"]
    assert issuer == {"ca": {"secretName": ca["secretName"]}} and ca["isCA"] is True
    assert docs[("Issuer", ca["issuerRef"]["name"])]["spec"] == {"selfSigned": {}}


def test_default_install_is_accepted_by_the_apiserver(installed: Testbed, repo: Path) -> None:
    """Every object of `kubectl apply -k manifests/` passes the apiserver's validation (a
    server-side dry-run create under another name, since the real ones exist already and the
    operator has re-pointed the webhook configuration at itself). A schema check of what
    `kubectl apply -k` sends, nothing the operator creates: the install itself runs for real
    in test_real_install.py."""
    rendered = installed.kubectl_run("kustomize", str(repo / "manifests"))
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d["kind"] != "CustomResourceDefinition"]
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                         "RoleBinding", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
                                         "Service", "MutatingWebhookConfiguration",
                                         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for doc in docs:
        doc["metadata"]["name"] += "-dryrun"
        out = installed.kubectl_run("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc))
        assert out.returncode == 0, (doc["kind"], out.stderr)
