"""Fixtures shared by every test layer. Process lifecycles live in cachewarm.testbed;
this file only wires them into pytest scopes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachewarm.testbed.cluster import Testbed, repo_root

REPO = repo_root()


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
    crd = REPO / "crds" / "cachewarm.dev_compilationcaches.yaml"
    applied = testbed.kubectl_run("apply", "-f", str(crd))
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
