"""The cluster's users and CompilationCaches (manifests/rbac/user_roles.yaml), against a
real apiserver and kube-controller-manager's ClusterRole aggregation: a user with the
built-in `edit` role in one namespace can create, change and delete CompilationCaches
there, and can never write their status (which names the ConfigMaps, manifest generations
and PYTHONPATH the webhook gives pods: docs/security.md); `view` reads them."""

from __future__ import annotations

import json
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually

pytestmark = pytest.mark.e2e


@pytest.fixture
def tenant_ns(installed: Testbed, controller_manager: Testbed) -> Iterator[str]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    created = installed.kubectl_run("create", "namespace", ns)
    assert created.returncode == 0, created.stderr
    yield ns
    installed.kubectl_run("delete", "namespace", ns, "--wait=false")


def _user(bed: Testbed, ns: str, role: str, tmp_path: Path, name: str | None = None) -> Path:
    """A kubeconfig of ServiceAccount ns/<name> (default <role>-user) bound to the ClusterRole `role` in ns only."""
    name = name or f"{role}-user"
    for args in (("create", "serviceaccount", name, "-n", ns),
                 ("create", "rolebinding", name, f"--clusterrole={role}", f"--serviceaccount={ns}:{name}", "-n", ns)):
        done = bed.kubectl_run(*args)
        assert done.returncode == 0, done.stderr
    return bed.service_account_kubeconfig(ns, name, tmp_path / f"{name}.kubeconfig")


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


RESTRICTED = "cachewarm.dev/serviceaccounts"
WARMUP = {"image": "demo/train:1", "targets": ["train:targets"], "pools": [{"name": "cpu"}]}


def _cache(name: str, bucket: str, service_account: str | None = None, create: bool = False) -> dict[str, Any]:
    warmup = {**WARMUP, **({"serviceAccountName": service_account} if service_account else {})}
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": bucket, "location": "us-central1", "create": create}},
                     "warmup": warmup}}


def _restrict(bed: Testbed, ns: str, *service_accounts: str) -> None:
    """What a cluster admin does: the namespace labelled, and the warmers' ServiceAccounts made."""
    for sa in service_accounts:
        done = bed.kubectl_run("create", "serviceaccount", sa, "-n", ns)
        assert done.returncode == 0, done.stderr
    done = bed.kubectl_run("label", "namespace", ns, f"{RESTRICTED}=restricted")
    assert done.returncode == 0, done.stderr


def _may_not_use(ns: str, user: str, sa: str) -> str:
    return (f"{user} may not use serviceaccounts/{sa} in namespace {ns} "
            f"(verb use, resource serviceaccounts, name {sa})")


def _aggregated(bed: Testbed, kubeconfig: Path, *can_i: str) -> None:
    """kube-controller-manager aggregates the manifests' ClusterRoles into edit/admin soon after install."""
    eventually(lambda: _as(bed, kubeconfig, "auth", "can-i", *can_i)[0] == 0 or None, timeout=60,
               what=f"aggregated: {can_i}")


def test_restricted_namespace_needs_use_of_the_warmer_serviceaccount(
    installed: Testbed, tenant_ns: str, tmp_path: Path,
) -> None:
    """manifests/policy/cache_authors.yaml, second check: in a namespace a cluster admin
    labelled cachewarm.dev/serviceaccounts=restricted, a cache with warmers needs its author
    to be allowed `use` on the ServiceAccount they run as (spec.warmup.serviceAccountName,
    else `default`), though the author may create Jobs (`edit`). The refusal names the verb,
    resource, name and namespace and the commands that grant it; the namespace admin (who
    holds `use` through cachewarm-serviceaccount-user, aggregated to `admin`) runs exactly
    those, and then the author may name that ServiceAccount and no other."""
    ns = tenant_ns
    edit = _user(installed, ns, "edit", tmp_path)
    admin = _user(installed, ns, "admin", tmp_path)
    editor = f"system:serviceaccount:{ns}:edit-user"
    for sa in ("writer", "other"):
        done = installed.kubectl_run("create", "serviceaccount", sa, "-n", ns)
        assert done.returncode == 0, done.stderr
    _aggregated(installed, edit, "create", "compilationcaches.cachewarm.dev", "-n", ns)
    _aggregated(installed, admin, "use", "serviceaccounts/writer", "-n", ns)
    rc, out = _as(installed, edit, "auth", "can-i", "use", "serviceaccounts/writer", "-n", ns)
    assert rc != 0 and out.strip().startswith("no"), out  # the premise: `edit` has no `use`
    # Unlabelled: Kubernetes' own rule, whoever may create Jobs names any ServiceAccount.
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache("before", "b-sa", "writer"))
    assert rc == 0, out

    # The label takes one value, refused otherwise (a typo must not look like a restriction).
    done = installed.kubectl_run("label", "namespace", ns, f"{RESTRICTED}=Restricted")
    assert done.returncode != 0 and f"label {RESTRICTED} on namespace {ns} is Restricted: its only value is " \
        "restricted" in done.stderr, done.stderr
    wrong = {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": f"{ns}-x", "labels": {RESTRICTED: "true"}}}
    done = installed.kubectl_run("create", "-f", "-", input=yaml.safe_dump(wrong))
    assert done.returncode != 0 and "its only value is restricted" in done.stderr, done.stderr
    _restrict(installed, ns)

    # Made, or changed, with a ServiceAccount the author may not use: refused, naming it.
    for name, sa in (("named", "writer"), ("unnamed", None)):
        rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache(name, "b-sa", sa))
        assert rc != 0 and _may_not_use(ns, editor, sa or "default") in out, out
        assert installed.get_json("compilationcache", name, ns) is None
    rc, out = _as(installed, edit, "patch", "-n", ns, "compilationcache/before", "--type=merge",
                  "-p", json.dumps({"spec": {"jax": {"minCompileTimeSecs": 5}}}))
    assert rc != 0 and _may_not_use(ns, editor, "writer") in out, out
    # Labels are not looked at, nor caches without warmers.
    rc, out = _as(installed, edit, "label", "-n", ns, "compilationcache/before", "team=ml")
    assert rc == 0, out
    plain = _cache("plain", "b-sa")
    del plain["spec"]["warmup"]
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=plain)
    assert rc == 0, out

    # The refusal says how to grant it, for this ServiceAccount (a Role: kubectl create role
    # refuses the verb `use` on serviceaccounts, so written out) or all (a command): the
    # namespace admin does each, as the message says.
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache("named", "b-sa", "writer"))
    assert rc != 0 and '{apiGroups: [""], resources: [serviceaccounts], resourceNames: [writer], verbs: [use]}' \
        in out, out
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "use-writer"},
            "rules": [{"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["writer"],
                       "verbs": ["use"]}]}
    rc, done = _as(installed, admin, "create", "-n", ns, "-f", "-", body=role)
    assert rc == 0, done
    rc, done = _as(installed, admin, "create", "rolebinding", "use-writer", "--role=use-writer", f"--user={editor}",
                   "-n", ns)
    assert rc == 0, done
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache("named", "b-sa", "writer"))
    assert rc == 0, out
    # The Role names one ServiceAccount: another stays refused, until the command the
    # message gives binds cachewarm-serviceaccount-user (all of the namespace's).
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache("another", "b-sa", "other"))
    assert rc != 0 and _may_not_use(ns, editor, "other") in out, out
    command = re.search(r"(kubectl create rolebinding \S+ --clusterrole=\S+ --user=\S+ -n \S+)", out)
    assert command, out
    rc, done = _as(installed, admin, *shlex.split(command.group(1))[1:])
    assert rc == 0, (command.group(1), done)
    rc, out = _as(installed, edit, "create", "-n", ns, "-f", "-", body=_cache("another", "b-sa", "other"))
    assert rc == 0, out


def test_a_weaker_users_change_to_a_stronger_users_cache_is_judged_as_the_weaker_user(
    installed: Testbed, tenant_ns: str, tmp_path: Path,
) -> None:
    """The policy's authorizer runs as whoever sends the update, never as the cache's
    author: in a restricted namespace, a user with Jobs and `use` makes a cache whose
    warmers run as `writer`; a user with the author role alone (no Jobs), and an editor
    without `use`, are each refused changing its spec, its serviceAccountName or its re-warm
    annotation, and may label it."""
    ns = tenant_ns
    strong = _user(installed, ns, "edit", tmp_path, name="strong")
    grant = installed.kubectl_run("create", "rolebinding", "strong-uses", "--clusterrole=cachewarm-serviceaccount-user",
                                  f"--serviceaccount={ns}:strong", "-n", ns)
    assert grant.returncode == 0, grant.stderr
    editor = _user(installed, ns, "edit", tmp_path)
    author = _user(installed, ns, "cachewarm-edit", tmp_path)
    _restrict(installed, ns, "writer", "other")
    _aggregated(installed, strong, "create", "compilationcaches.cachewarm.dev", "-n", ns)
    _aggregated(installed, author, "create", "compilationcaches.cachewarm.dev", "-n", ns)
    rc, out = _as(installed, strong, "create", "-n", ns, "-f", "-", body=_cache("warms", "b-weak", "writer"))
    assert rc == 0, out

    changes = ({"spec": {"warmup": {"image": "attacker/image:1"}}},
               {"spec": {"warmup": {"serviceAccountName": "other"}}},
               {"metadata": {"annotations": {"cachewarm.dev/rewarm": "again"}}})
    for change in changes:
        rc, out = _as(installed, author, "patch", "-n", ns, "compilationcache/warms", "--type=merge",
                      "-p", json.dumps(change))
        assert rc != 0 and "needs the right to create jobs.batch" in out, (change, out)
        rc, out = _as(installed, editor, "patch", "-n", ns, "compilationcache/warms", "--type=merge",
                      "-p", json.dumps(change))
        # The editor is judged on the ServiceAccount the cache would run as after its change.
        sa = change["spec"]["warmup"].get("serviceAccountName", "writer") if "spec" in change else "writer"
        assert rc != 0 and _may_not_use(ns, f"system:serviceaccount:{ns}:edit-user", sa) in out, (change, out)
    for who in (author, editor):
        rc, out = _as(installed, who, "label", "-n", ns, "compilationcache/warms", "--overwrite", "team=ml")
        assert rc == 0, out
    stored = installed.get_json("compilationcache", "warms", ns)
    assert stored is not None and stored["spec"]["warmup"]["image"] == "demo/train:1"
    assert stored["spec"]["warmup"]["serviceAccountName"] == "writer"
    assert "cachewarm.dev/rewarm" not in (stored["metadata"].get("annotations") or {})
    # The stronger user's own change passes (the same policy, its own rights).
    rc, out = _as(installed, strong, "patch", "-n", ns, "compilationcache/warms", "--type=merge",
                  "-p", json.dumps(changes[1]))
    assert rc == 0, out


def test_two_tenants_of_a_restricted_namespace_through_the_operator(
    operator: OperatorHandle, controller_manager: Testbed, tmp_path: Path,
) -> None:
    """The issue's two tenants of team-a: one with the built-in `edit`, one with the
    CompilationCache author role alone. In a restricted namespace neither makes a cache
    whose warmers run as `writer` (the author lacks Jobs, the editor `use`); once a
    RoleBinding of cachewarm-serviceaccount-user gives the editor `use`, its cache is made
    and the operator creates its warmer Job under `writer`. No Job of a refused cache: a
    refused cache is never stored, so the operator cannot see it; the Jobs are listed after
    the operator created the granted cache's (it reconciled this namespace after the
    refusals), and each is that cache's."""
    bed = controller_manager
    ns = f"team-a-{uuid.uuid4().hex[:8]}"
    done = bed.kubectl_run("create", "namespace", ns)
    assert done.returncode == 0, done.stderr
    try:
        edit = _user(bed, ns, "edit", tmp_path)
        author = _user(bed, ns, "cachewarm-edit", tmp_path)
        _restrict(bed, ns, "writer")
        _aggregated(bed, edit, "create", "compilationcaches.cachewarm.dev", "-n", ns)
        _aggregated(bed, author, "create", "compilationcaches.cachewarm.dev", "-n", ns)
        # Each cache its own bucket, which the operator would create for it (were one
        # admitted, it would be warmed like the granted one).
        bucket = f"team-a-{uuid.uuid4().hex[:8]}"
        rc, out = _as(bed, author, "create", "-n", ns, "-f", "-", body=_cache("by-author", f"{bucket}-1", "writer", True))
        assert rc != 0 and "needs the right to create jobs.batch" in out, out
        rc, out = _as(bed, edit, "create", "-n", ns, "-f", "-", body=_cache("by-editor", f"{bucket}-2", "writer", True))
        assert rc != 0 and _may_not_use(ns, f"system:serviceaccount:{ns}:edit-user", "writer") in out, out
        grant = bed.kubectl_run("create", "rolebinding", "edit-uses", "--clusterrole=cachewarm-serviceaccount-user",
                                f"--serviceaccount={ns}:edit-user", "-n", ns)
        assert grant.returncode == 0, grant.stderr
        rc, out = _as(bed, edit, "create", "-n", ns, "-f", "-", body=_cache("granted", f"{bucket}-3", "writer", True))
        assert rc == 0, out

        def granted_job() -> dict[str, Any] | None:
            listed = bed.kubectl_run("get", "jobs", "-n", ns, "-l", "cachewarm.dev/warmer-for=granted", "-o", "json")
            items = json.loads(listed.stdout)["items"] if listed.returncode == 0 else []
            return items[0] if items else None
        job = eventually(granted_job, timeout=120, what="the granted cache's warmer Job")
        assert job["spec"]["template"]["spec"]["serviceAccountName"] == "writer"
        listed = bed.kubectl_run("get", "jobs", "-n", ns, "-o", "json")
        assert listed.returncode == 0, listed.stderr
        owners = {j["metadata"]["name"]: j["metadata"]["labels"].get("cachewarm.dev/warmer-for")
                  for j in json.loads(listed.stdout)["items"]}
        assert set(owners.values()) == {"granted"}, owners
        for refused in ("by-author", "by-editor"):
            assert bed.get_json("compilationcache", refused, ns) is None
    finally:
        bed.kubectl_run("delete", "namespace", ns, "--wait=false")
