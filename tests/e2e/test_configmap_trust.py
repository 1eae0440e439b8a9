"""Code shipped only from what the operator owns (issue 28 item 2, D4), against a real
apiserver and the operator as the e2e session runs it (its manifests' RBAC): a namespace
user with ConfigMap and pod rights (a ServiceAccount with a Role, nothing more) tries to
get their own content into the cache's env and boot ConfigMaps, whose names anyone can
compute. (a) Made before the cache, theirs is never used, changed nor deleted, and the
cache says so; (c) ours, once made and checked, cannot be edited (immutable); (b) deleted
and made again with other content, it is dropped from status and from what the webhook
puts into later pods.

What the webhook put into a pod is read from the pod as the apiserver admitted it (no node
runs it: the boot ConfigMap's code would run in its python, which the unit and real-node
tests of the local copy show). After status changes, the webhook's index follows the
cache's watch event: server-side dry runs are polled until it has, then a real pod is
created.

Two layers: manifests/policy/reserved_configmaps.yaml (installed with manifests/) has the
apiserver refuse anyone but the operator a ConfigMap of those names (first test); the
operator's own check of each one's content is the second, for a cluster without the policy
(second test, with the policy's binding taken away for its duration). The operator watches
no ConfigMap: a deleted or replaced one is found at its next reconcile (the e2e resync is
3 s, 300 s by default)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from cachewarm.api.model import parse_spec
from cachewarm.builders.injection import CONTENT_SHA256_ANNOTATION, env_configmap
from cachewarm.builders.localcopy import boot_configmap
from cachewarm.reconcile.configmaps import boot_bytecode_files, boot_files
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually

pytestmark = pytest.mark.e2e

CACHE = "trust"
REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "manifests" / "policy" / "reserved_configmaps.yaml"
REFUSED = "is reserved for cachewarm's verified code"


def cache_body(bucket: str) -> dict[str, Any]:
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": CACHE},
            "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
                     "injection": {"mode": "ReadOnly", "localCopy": {"sizeLimit": "1Gi"}}}}


def our_names(bed: Testbed, ns: str, body: dict[str, Any]) -> tuple[str, str]:
    """The env and boot ConfigMaps' names the operator will use: the builders' (their
    content's hash), for the spec as the apiserver defaults it. Anyone can compute them."""
    dry = bed.kubectl_run("create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=yaml.safe_dump(body))
    assert dry.returncode == 0, dry.stderr
    cache = parse_spec(json.loads(dry.stdout)["spec"])
    owner = {"name": CACHE, "uid": "any"}
    return (env_configmap(cache, CACHE, ns, owner)["metadata"]["name"],
            boot_configmap(CACHE, ns, owner, boot_files(), boot_bytecode_files())["metadata"]["name"])


def tenant(bed: Testbed, ns: str, tmp_path: Path) -> Path:
    """A kubeconfig of a namespace user: ConfigMaps and pods in `ns`, nothing else."""
    for args in (("create", "serviceaccount", "tenant", "-n", ns),
                 ("create", "role", "tenant", "--verb=get,create,update,patch,delete", "--resource=configmaps,pods",
                  "-n", ns),
                 ("create", "rolebinding", "tenant", "--role=tenant", f"--serviceaccount={ns}:tenant", "-n", ns)):
        done = bed.kubectl_run(*args)
        assert done.returncode == 0, done.stderr
    return bed.service_account_kubeconfig(ns, "tenant", tmp_path / "tenant")


def forged(name: str, ns: str, role: str, owner_uid: str = "") -> dict[str, Any]:
    """The tenant's ConfigMap of our name: our label, our content-hash claim, their
    content; with `owner_uid` (the cache's, which anyone who may read the cache knows) as
    like ours as it can be: controlled by the cache, and immutable."""
    data = {"JAX_COMPILATION_CACHE_DIR": "gs://attacker/jax"} if role == "env" else {
        "sitecustomize.py": "print('the tenant runs code in every training pod')"}
    claim = name.rsplit("-", 1)[1]
    out: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap", "data": data,
        "metadata": {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/managed-by": "cachewarm"},
                     "annotations": {CONTENT_SHA256_ANNOTATION: claim}}}
    if owner_uid:
        out["immutable"] = True
        out["metadata"]["ownerReferences"] = [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                               "name": CACHE, "uid": owner_uid, "controller": True}]
    return out


def plant(bed: Testbed, ns: str, kubeconfig: Path, name: str, role: str, owner_uid: str = "") -> str:
    """The tenant makes its ConfigMap of `name`, deleting ours first and creating theirs
    right after through one client (kubectl's process start is slower than the operator's
    resync, which makes ours again in between), again until theirs lands, as an attacker
    would. Returns its uid."""
    api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))

    def attempt() -> str | None:
        try:
            api.delete_namespaced_config_map(name, ns)
        except ApiException as exc:
            if exc.status != 404:
                raise
        try:
            made = api.create_namespaced_config_map(ns, client.V1ConfigMap.model_validate(forged(name, ns, role, owner_uid)))
        except ApiException as exc:
            if exc.status == 409:  # the operator's landed first
                return None
            raise
        return str(made.metadata.uid)
    return eventually(attempt, timeout=60, what=f"the tenant's ConfigMap {name}")


def pod(name: str) -> dict[str, Any]:
    """A training pod of the cache: one container whose PYTHONPATH the webhook knows (an
    in-process copy, from the boot ConfigMap, where one is verified), one with an envFrom
    source (the cache env through the env ConfigMap, where one is verified)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": CACHE}},
            # The tenant's own ServiceAccount (no controller-manager here makes "default").
            "spec": {"restartPolicy": "Never", "serviceAccountName": "tenant", "containers": [
                {"name": "train", "image": "demo/train:1", "command": ["python", "train.py"],
                 "env": [{"name": "PYTHONPATH", "value": "/app"}]},
                {"name": "side", "image": "demo/train:1", "command": ["python", "-c", "pass"],
                 "envFrom": [{"configMapRef": {"name": "team-env", "optional": True}}]}]}}


def admitted(bed: Testbed, ns: str, kubeconfig: Path, name: str, *, dry_run: bool) -> dict[str, Any]:
    args = ["create", "-n", ns, "-o", "json", "-f", "-", *(["--dry-run=server"] if dry_run else [])]
    made = bed.kubectl_run(*args, input=yaml.safe_dump(pod(name)), kubeconfig=kubeconfig)
    assert made.returncode == 0, made.stderr
    return dict(json.loads(made.stdout))


def references(obj: dict[str, Any], *names: str) -> set[str]:
    text = json.dumps(obj["spec"])
    return {n for n in names if f'"{n}"' in text}


def status(bed: Testbed, ns: str) -> dict[str, Any]:
    return dict((bed.get_json("ccache", CACHE, ns) or {}).get("status") or {})


def injection_ready(bed: Testbed, ns: str) -> dict[str, Any]:
    return next((c for c in status(bed, ns).get("conditions") or [] if c["type"] == "InjectionReady"), {})


def policy_refuses(bed: Testbed, ns: str) -> bool:
    """Whether the apiserver now refuses a ConfigMap of a reserved name (a server-side dry
    run as the testbed's admin, which the policy refuses too). A binding's change reaches
    the apiserver's admission a moment after it is stored."""
    made = bed.kubectl_run("create", "configmap", "cachewarm-probe-boot-0123456789", "-n", ns, "--dry-run=server")
    return made.returncode != 0 and REFUSED in made.stderr


@pytest.fixture
def without_configmap_policy(installed: Testbed, namespace: str) -> Iterator[None]:
    """The reserved-names policy's binding taken away, as on a cluster where the policy was
    not installed; put back (and seen in force) afterwards for the tests that follow."""
    bed = installed
    eventually(lambda: policy_refuses(bed, namespace), timeout=30, what="the policy in force before")
    gone = bed.kubectl_run("delete", "validatingadmissionpolicybinding", "cachewarm-reserved-configmaps")
    assert gone.returncode == 0, gone.stderr
    try:
        eventually(lambda: not policy_refuses(bed, namespace), timeout=30, what="the policy no longer in force")
        yield
    finally:
        back = bed.kubectl_run("apply", "-f", str(POLICY))
        assert back.returncode == 0, back.stderr
        eventually(lambda: policy_refuses(bed, namespace), timeout=30, what="the policy in force again")


def refused(call: Any) -> str:
    """The apiserver's message for `call`, which must be refused as Forbidden (403)."""
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value
    return str(caught.value.body)


def test_the_apiserver_refuses_a_tenants_configmap_of_our_names(
    operator: OperatorHandle, installed: Testbed, namespace: str, tmp_path: Path,
) -> None:
    """The first layer: with manifests/ installed, the tenant can neither make a ConfigMap of
    our names before the cache nor after deleting ours (as like ours as it can be), nor
    change ours; it may delete ours, which the operator makes again at its next reconcile,
    so pods start cold for a while, never with the tenant's code."""
    bed, ns = installed, namespace
    body = cache_body(f"trust-{namespace}")
    env_name, boot_name = our_names(bed, ns, body)
    api = client.CoreV1Api(config.new_client_from_config(str(tenant(bed, ns, tmp_path))))
    eventually(lambda: policy_refuses(bed, ns), timeout=30, what="the policy in force")
    for name, role in ((env_name, "env"), (boot_name, "boot")):
        said = refused(lambda: api.create_namespaced_config_map(ns, client.V1ConfigMap.model_validate(
            forged(name, ns, role))))
        assert REFUSED in said and name in said, said
    assert bed.get_json("configmap", env_name, ns) is None and bed.get_json("configmap", boot_name, ns) is None
    bed.apply(body, ns)
    eventually(lambda: (status(bed, ns).get("injection") or {}).get("configMaps") == {"env": env_name, "boot": boot_name},
               timeout=60, what="both ConfigMaps made and verified")
    ours = (bed.get_json("configmap", boot_name, ns) or {})["metadata"]["uid"]
    said = refused(lambda: api.patch_namespaced_config_map(boot_name, ns, {"metadata": {"labels": {"x": "y"}}}))
    assert REFUSED in said, said
    api.delete_namespaced_config_map(boot_name, ns)
    cache_uid = str((bed.get_json("ccache", CACHE, ns) or {})["metadata"]["uid"])
    said = refused(lambda: api.create_namespaced_config_map(ns, client.V1ConfigMap.model_validate(
        forged(boot_name, ns, "boot", cache_uid))))
    assert REFUSED in said, said
    again = eventually(lambda: bed.get_json("configmap", boot_name, ns), timeout=60, what="ours made again")
    assert again["metadata"]["uid"] != ours and again["data"] != forged(boot_name, ns, "boot")["data"]
    eventually(lambda: (status(bed, ns).get("injection") or {}).get("configMaps") == {"env": env_name, "boot": boot_name},
               timeout=60, what="both verified again")


@pytest.mark.usefixtures("without_configmap_policy")
def test_only_configmaps_the_operator_wrote_and_checked_reach_pods(
    operator: OperatorHandle, installed: Testbed, namespace: str, tmp_path: Path,
) -> None:
    """The second layer, on a cluster without the policy."""
    bed, ns = installed, namespace
    body = cache_body(f"trust-{namespace}")
    env_name, boot_name = our_names(bed, ns, body)
    user = tenant(bed, ns, tmp_path)

    # (a) Theirs first: never used, never changed nor deleted, and the cache says why.
    roles = {env_name: "env", boot_name: "boot"}
    theirs = {name: plant(bed, ns, user, name, role) for name, role in roles.items()}
    bed.apply(body, ns)
    refused = eventually(lambda: injection_ready(bed, ns).get("reason") == "ConfigMapNotOurs"
                         and injection_ready(bed, ns), timeout=60, what="InjectionReady ConfigMapNotOurs")
    assert refused["status"] == "False" and env_name in refused["message"] and boot_name in refused["message"]
    assert not (status(bed, ns).get("injection") or {}).get("configMaps")
    warnings = [e for e in bed.events_for(CACHE, ns) if e["reason"] == "ConfigMapNotOurs"]
    assert warnings and {e["type"] for e in warnings} == {"Warning"}
    first = admitted(bed, ns, user, "while-theirs", dry_run=False)
    assert references(first, env_name, boot_name) == set()
    for name, uid in theirs.items():  # the tenant's, as they made them
        kept = bed.get_json("configmap", name, ns) or {}
        assert kept["metadata"]["uid"] == uid and kept["data"] == forged(name, ns, roles[name])["data"]

    # Deleted by the tenant: the operator makes its own, checks it, and pods get it.
    for name in (env_name, boot_name):
        assert bed.kubectl_run("delete", "configmap", name, "-n", ns, kubeconfig=user).returncode == 0
    eventually(lambda: (status(bed, ns).get("injection") or {}).get("configMaps") == {"env": env_name, "boot": boot_name},
               timeout=60, what="both ConfigMaps verified in status")
    assert injection_ready(bed, ns)["status"] == "True"
    eventually(lambda: references(admitted(bed, ns, user, "probe", dry_run=True), env_name, boot_name)
               == {env_name, boot_name}, timeout=30, what="the webhook using the verified ConfigMaps")
    assert references(admitted(bed, ns, user, "with-ours", dry_run=False), env_name, boot_name) == {env_name, boot_name}

    # (c) Ours cannot be edited: the apiserver refuses any change of an immutable one.
    edit = bed.kubectl_run("patch", "configmap", boot_name, "-n", ns, "--type=merge",
                           "-p", json.dumps({"data": {"sitecustomize.py": "print('edited')"}}), kubeconfig=user)
    assert edit.returncode != 0 and "immutable" in edit.stderr, edit.stderr
    unmark = bed.kubectl_run("patch", "configmap", boot_name, "-n", ns, "--type=merge",
                             "-p", json.dumps({"immutable": False}), kubeconfig=user)
    assert unmark.returncode != 0 and "immutable" in unmark.stderr, unmark.stderr

    # (b) Deleted and made again with other content (as like ours as the tenant can: our
    # label, controller and immutability): dropped from status, and later pods do not get
    # it; theirs stays.
    cache_uid = str((bed.get_json("ccache", CACHE, ns) or {})["metadata"]["uid"])
    uid = plant(bed, ns, user, boot_name, "boot", cache_uid)
    eventually(lambda: (status(bed, ns).get("injection") or {}).get("configMaps") == {"env": env_name},
               timeout=60, what="the replaced boot ConfigMap dropped from status")
    assert injection_ready(bed, ns)["reason"] == "ConfigMapNotOurs"
    eventually(lambda: references(admitted(bed, ns, user, "probe", dry_run=True), env_name, boot_name) == {env_name},
               timeout=30, what="the webhook no longer using the replaced ConfigMap")
    assert references(admitted(bed, ns, user, "after-replaced", dry_run=False), env_name, boot_name) == {env_name}
    assert (bed.get_json("configmap", boot_name, ns) or {})["metadata"]["uid"] == uid
