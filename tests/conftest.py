"""Fixtures shared by every test layer. Process lifecycles live in cachewarm_testbed;
this file only wires them into pytest scopes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachewarm_testbed.cluster import OperatorHandle, Testbed, exit_on_sigterm, local_images, repo_root
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.processes import Proc

REPO = repo_root()


def pytest_configure(config: pytest.Config) -> None:
    # A CI timeout sends SIGTERM: run the fixtures' teardown so no testbed process is left.
    exit_on_sigterm()


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    """etcd + kube-apiserver (RBAC on) + GCS emulator, for the whole session."""
    bed = Testbed().start()
    try:
        yield bed
    finally:
        bed.stop()


@pytest.fixture(scope="session")
def controller_manager(testbed: Testbed) -> Testbed:
    """The testbed with kube-controller-manager running too (Jobs, GC, namespaces)."""
    testbed.start_controller_manager()
    return testbed


@pytest.fixture(scope="session")
def crd_installed(testbed: Testbed) -> Testbed:
    """The CompilationCache CRD from crds/, applied and Established."""
    # `kubectl apply -f crds/` as the README says (crds/Kustomization has no .yaml suffix,
    # so kubectl skips it while kustomize still finds it for manifests/).
    applied = testbed.kubectl_run("apply", "-f", str(REPO / "crds"))
    assert applied.returncode == 0, applied.stderr
    waited = testbed.kubectl_run(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/compilationcaches.cachewarm.dev",
    )
    assert waited.returncode == 0, waited.stderr
    return testbed


@pytest.fixture
def namespace(testbed: Testbed) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    created = testbed.kubectl_run("create", "namespace", name)
    assert created.returncode == 0, created.stderr
    yield name
    testbed.kubectl_run("delete", "namespace", name, "--wait=false")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def installed(crd_installed: Testbed) -> Testbed:
    """`kubectl apply -k manifests/`: namespace, ServiceAccount, least-privilege RBAC."""
    applied = crd_installed.kubectl_run("apply", "-k", str(REPO / "manifests"))
    assert applied.returncode == 0, applied.stderr
    return crd_installed


OPERATOR_ENV = {
    "CACHEWARM_RESYNC_SECONDS": "3",
    "CACHEWARM_WARM_POLL_SECONDS": "1",
    "CACHEWARM_RETRY_DELAY_SECONDS": "0.5",
    "CACHEWARM_GCS_TIMEOUT_SECONDS": "2",
    "CACHEWARM_GCP_PROJECT": "testbed",
    # As in a Pod (downward API): leader election and the shared certificate Secret in the
    # operator's namespace, with the manifests' Role.
    "CACHEWARM_POD_NAMESPACE": "cachewarm-system",
    "CACHEWARM_CERT_CHECK_SECONDS": "1",
    # A failed warmer runs once more, a second later (test_warmup shows the retry).
    "CACHEWARM_WARM_RETRIES": "1",
    "CACHEWARM_WARM_RETRY_SECONDS": "1",
    # The entries are listed when something changed, else at this cadence (1 h in a cluster):
    # short enough for test_warmup's deleted entry, long enough for test_operator_bucket to
    # show resyncs that list nothing.
    "CACHEWARM_INVENTORY_SECONDS": "10",
    # An admin's limits on the buckets caches may create (tests/e2e/test_bucket_consent.py).
    "CACHEWARM_BUCKET_LOCATIONS": "us-central1",
    "CACHEWARM_BUCKET_STORAGE_CLASSES": "STANDARD,NEARLINE",
    # The project's buckets listed at every creation: test_bucket_consent makes buckets with
    # creation labels by hand, which a listing kept for a minute (the default) would count
    # only from its next listing (that reuse is a unit test's, test_consent_decisions).
    "CACHEWARM_BUCKET_COUNT_SECONDS": "0",
    # status.usage is written every 30 s in a cluster; test_reports reads it sooner.
    "CACHEWARM_USAGE_FLUSH_SECONDS": "1",
}


@pytest.fixture(scope="session")
def operator(installed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorHandle]:
    """`cachewarm run` as its own process, authenticated as the manifests' ServiceAccount
    (so it has exactly the RBAC manifests/ grants), with short timers for the tests."""
    kubeconfig = installed.service_account_kubeconfig(
        "cachewarm-system", "cachewarm-operator", tmp_path_factory.mktemp("operator") / "kubeconfig"
    )
    handle = OperatorHandle(installed, kubeconfig, OPERATOR_ENV)
    try:
        yield handle
    finally:
        handle.stop()
    log = "".join(p.read_text(errors="replace") for p in handle.logs if p.exists())
    # A permission the operator lacks shows up as a 403 in its log: manifests/ must grant it.
    denied = re.findall(r"User \"system:serviceaccount:cachewarm-system:[a-z-]+\" cannot [^\n]{0,200}", log)
    assert not denied, denied


@pytest.fixture(scope="session")
def node_agent(controller_manager: Testbed) -> Proc:
    """kube-scheduler and the stand-in kubelet for simulated GKE nodes (a CPU node, an
    a3-highgpu-8g H100 node, a v5e 2x4 host, a v5p 2x2x1 host and two node pools of a
    two-host v5p 2x2x2 slice each): the scheduler places pods, the agent runs what is bound to its nodes."""
    return controller_manager.start_node_agent(local_images())


@pytest.fixture(scope="session")
def proxy(testbed: Testbed) -> ProxyControl:
    return ProxyControl(testbed.storage_emulator_host)


def storage_client(endpoint: str) -> storage.Client:
    """A google-cloud-storage client on the emulator (through the proxy), for test setup."""
    return storage.Client(project="testbed", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint})


@pytest.fixture(scope="session")
def gcs(testbed: Testbed) -> storage.Client:
    return storage_client(testbed.storage_emulator_host)


@pytest.fixture(scope="session")
def storage_bed() -> Iterator[Testbed]:
    """The GCS emulator behind its fidelity proxy, alone (no control plane)."""
    bed = Testbed().start_gcs()
    try:
        yield bed
    finally:
        bed.stop()


@pytest.fixture(scope="session")
def storage_only(storage_bed: Testbed) -> storage.Client:
    return storage_client(storage_bed.storage_emulator_host)


@pytest.fixture(scope="session")
def kstatus() -> Callable[[dict], dict]:
    """Evaluate an object as Flux, kpt and every kstatus-based check do: hack/kstatus, a
    small Go program around sigs.k8s.io/cli-utils' status.Compute, built once from the Go
    module proxy. Returns {"status": Current|InProgress|Failed|Terminating, "message": ...}."""
    built = subprocess.run([str(REPO / "hack" / "build-kstatus.sh")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    binary = built.stdout.strip().splitlines()[-1]

    def evaluate(obj: dict) -> dict:
        out = subprocess.run([binary], input=json.dumps(obj), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))
    return evaluate


@pytest.fixture(scope="module")
def own_install() -> Iterator[Testbed]:
    """A control plane of the module's own with the CRD and manifests/ applied, for tests
    that run several operators against one Lease (which the session's operator holds in
    the shared one)."""
    bed = Testbed().start()
    try:
        for args in (("apply", "-f", str(REPO / "crds")), ("apply", "-k", str(REPO / "manifests")),
                     ("wait", "--for=condition=Established", "--timeout=60s", "crd/compilationcaches.cachewarm.dev")):
            done = bed.kubectl_run(*args)
            assert done.returncode == 0, (args, done.stderr)
        yield bed
    finally:
        bed.stop()
