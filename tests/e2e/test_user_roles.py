"""The cluster's users and CompilationCaches (manifests/rbac/user_roles.yaml), against a
real apiserver and kube-controller-manager's ClusterRole aggregation: a user with the
built-in `edit` role in one namespace can create, change and delete CompilationCaches
there, and can never write their status (which names the ConfigMaps, manifest generations
and PYTHONPATH the webhook gives pods: docs/security.md); `view` reads them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachewarm_testbed.cluster import Testbed, eventually

pytestmark = pytest.mark.e2e


@pytest.fixture
def tenant_ns(installed: Testbed, controller_manager: Testbed) -> Iterator[str]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    created = installed.kubectl_run("create", "namespace", ns)
    assert created.returncode == 0, created.stderr
    yield ns
    installed.kubectl_run("delete", "namespace", ns, "--wait=false")


def _user(bed: Testbed, ns: str, role: str, tmp_path: Path) -> Path:
    """A kubeconfig of ServiceAccount ns/<role>-user bound to the built-in ClusterRole `role` in ns only."""
    for args in (("create", "serviceaccount", f"{role}-user", "-n", ns),
                 ("create", "rolebinding", f"{role}-user", f"--clusterrole={role}",
                  f"--serviceaccount={ns}:{role}-user", "-n", ns)):
        done = bed.kubectl_run(*args)
        assert done.returncode == 0, done.stderr
    return bed.service_account_kubeconfig(ns, f"{role}-user", tmp_path / f"{role}.kubeconfig")


def _as(bed: Testbed, kubeconfig: Path, *args: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    done = bed.kubectl_run(*args, input=yaml.safe_dump(body) if body else None, kubeconfig=kubeconfig)
    return done.returncode, (done.stdout + done.stderr)


def test_edit_writes_caches_and_never_their_status(installed: Testbed, tenant_ns: str, tmp_path: Path) -> None:
    ns = tenant_ns
    edit = _user(installed, ns, "edit", tmp_path)
    view = _user(installed, ns, "view", tmp_path)
    cache = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "mine"},
             "spec": {"storage": {"gcs": {"bucket": "b-roles", "location": "us-central1", "create": False}}}}
    # The aggregation controller adds cachewarm-edit's rules to `edit` soon after install.
    eventually(lambda: _as(installed, edit, "auth", "can-i", "create", "compilationcaches.cachewarm.dev",
                           "-n", ns)[0] == 0 or None, timeout=60, what="edit aggregates cachewarm-edit")
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=cache)
    assert rc == 0, out
    rc, out = _as(installed, edit, "annotate", "-n", ns, "compilationcache/mine", "team=ml")
    assert rc == 0, out
    # Status: refused for edit, whatever the verb.
    patch = json.dumps({"status": {"injection": {"configMaps": {"boot": "cachewarm-mine-boot-0123456789"}}}})
    rc, out = _as(installed, edit, "patch", "-n", ns, "compilationcache/mine", "--subresource=status",
                  "--type=merge", "-p", patch)
    assert rc != 0 and "forbidden" in out.lower(), out
    for verb in ("update", "patch"):
        rc, out = _as(installed, edit, "auth", "can-i", verb, "compilationcaches.cachewarm.dev", "--subresource=status",
                      "-n", ns)
        assert rc != 0 and out.strip().startswith("no"), (verb, out)
    # Nor in another namespace.
    rc, out = _as(installed, edit, "auth", "can-i", "create", "compilationcaches.cachewarm.dev", "-n", "default")
    assert rc != 0, out
    # view reads caches and their status, writes nothing.
    eventually(lambda: _as(installed, view, "get", "-n", ns, "compilationcache/mine")[0] == 0 or None, timeout=60,
               what="view aggregates cachewarm-view")
    rc, out = _as(installed, view, "delete", "-n", ns, "compilationcache/mine")
    assert rc != 0 and "forbidden" in out.lower(), out
    rc, out = _as(installed, edit, "delete", "-n", ns, "compilationcache/mine", "--wait=false")
    assert rc == 0, out


def test_warmup_needs_its_author_to_be_allowed_jobs(installed: Testbed, tenant_ns: str, tmp_path: Path) -> None:
    """manifests/policy/cache_authors.yaml: a CompilationCache's spec.warmup makes the
    operator create Jobs, so the apiserver lets a user set or change it only where that user
    may create Jobs. Two users of one namespace: `edit` (may create Jobs) and one bound to
    cachewarm-edit alone (CompilationCaches, no Jobs). The author-only user makes a cache
    without warmup, and is refused one with it (the message names the missing right); the
    editor's cache with warmup takes the author-only user's labels and annotations, not a
    change of its spec or its re-warm annotation (each may start its warmers anew)."""
    ns = tenant_ns
    edit = _user(installed, ns, "edit", tmp_path)
    author = _user(installed, ns, "cachewarm-edit", tmp_path)
    storage = {"gcs": {"bucket": "b-authors", "location": "us-central1", "create": False}}
    warmup = {"image": "demo/train:1", "targets": ["train:targets"], "pools": [{"name": "cpu"}]}

    def cache(name: str, **spec: Any) -> dict[str, Any]:
        return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
                "spec": {"storage": storage, **spec}}

    rc, out = _as(installed, author, "auth", "can-i", "create", "jobs.batch", "-n", ns)
    assert rc != 0 and out.strip().startswith("no"), out  # the premise: no Jobs for the author
    rc, out = _as(installed, author, "create", "-n", ns, "-f", "-", body=cache("plain"))
    assert rc == 0, out
    rc, out = _as(installed, author, "create", "-n", ns, "-f", "-", body=cache("warms", warmup=warmup))
    assert rc != 0 and "needs the right to create jobs.batch" in out and f"{ns}:cachewarm-edit-user" in out, out
    assert installed.get_json("compilationcache", "warms", ns) is None
    # Adding warmup to the author's own cache is the same change.
    rc, out = _as(installed, author, "patch", "-n", ns, "compilationcache/plain", "--type=merge",
                  "-p", json.dumps({"spec": {"warmup": warmup}}))
    assert rc != 0 and "needs the right to create jobs.batch" in out, out
    # The editor may.
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=cache("warms", warmup=warmup))
    assert rc == 0, out
    # The author-only user on the editor's cache: judged as itself, for what it changes.
    rc, out = _as(installed, author, "label", "-n", ns, "compilationcache/warms", "team=ml")
    assert rc == 0, out
    rc, out = _as(installed, author, "annotate", "-n", ns, "compilationcache/warms", "team/owner=ml")
    assert rc == 0, out
    # Any change of its spec may start its warmers anew (here: the JAX settings they
    # compile with), as may its re-warm annotation: refused like a change of spec.warmup.
    for change in ({"spec": {"warmup": {"image": "attacker/image:1"}}}, {"spec": {"jax": {"minCompileTimeSecs": 5}}},
                   {"metadata": {"annotations": {"cachewarm.dev/rewarm": "again"}}}):
        rc, out = _as(installed, author, "patch", "-n", ns, "compilationcache/warms", "--type=merge",
                      "-p", json.dumps(change))
        assert rc != 0 and "needs the right to create jobs.batch" in out, (change, out)
    stored = installed.get_json("compilationcache", "warms", ns)
    assert stored is not None and stored["spec"]["warmup"]["image"] == "demo/train:1"
    rc, out = _as(installed, author, "patch", "-n", ns, "compilationcache/warms", "--type=json",
                  "-p", json.dumps([{"op": "remove", "path": "/spec/warmup"}]))
    assert rc == 0, out  # removing warmup makes the operator create nothing: not looked at
