"""The ConfigMaps a cache's pods read (reconcile/configmaps.py, D4): created when missing,
checked on every reconcile, used (status.injection.configMaps) only while what the API
holds is what the operator wrote; a ConfigMap of our name that is not ours is never
updated nor deleted, and InjectionReady says so once. Kubernetes is the in-memory
KubeClient (tests/unit/memkube.py); the e2e test (tests/e2e/test_configmap_trust.py) runs
the same against a real apiserver, which also refuses edits of an immutable one."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from cachewarm.api.model import parse_spec
from cachewarm.builders.injection import env_configmap
from cachewarm.builders.localcopy import boot_configmap
from cachewarm.clients.kube import KubeError
from cachewarm.reconcile.configmaps import (boot_bytecode_files, boot_files, ensure_configmap, not_ours,
                                            publish_configmaps)
from memkube import MemoryKube

NS, NAME, UID = "ml", "llama", "u-1"
OWNER = {"name": NAME, "uid": UID}
# Pods read the bucket: no boot ConfigMap (the local copy is the default, so say so).
CACHE = parse_spec({"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
                    "injection": {"readFrom": "Bucket"}})
LOCAL = parse_spec({"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
                    "injection": {"mode": "ReadOnly", "localCopy": {"sizeLimit": "1Gi"}}})
NOW = dt.datetime(2026, 11, 22, 7, 0, tzinfo=dt.timezone.utc)


def env() -> dict[str, Any]:
    return env_configmap(CACHE, NAME, NS, OWNER)


def boot() -> dict[str, Any]:
    return boot_configmap(NAME, NS, OWNER, boot_files(), boot_bytecode_files())


def publish(kube: MemoryKube, cache: Any = CACHE, status: dict[str, Any] | None = None
            ) -> tuple[Any, dict[str, str | None], list[Any]]:
    events: list[Any] = []
    cond, names = publish_configmaps(kube, cache, status or {}, events, namespace=NS, name=NAME, uid=UID)
    return cond, names, events


def as_status(cond: Any) -> dict[str, Any]:
    return {"conditions": [{"type": cond.type, "status": "True" if cond.status else "False", "reason": cond.reason,
                            "message": cond.message}]}


def test_a_missing_configmap_is_created_immutable_and_recorded() -> None:
    kube = MemoryKube()
    cond, names, events = publish(kube, LOCAL)
    env_body, boot_body = env_configmap(LOCAL, NAME, NS, OWNER), boot()
    assert names == {"env": env_body["metadata"]["name"], "boot": boot_body["metadata"]["name"]}
    assert kube.configmaps == {(NS, env_body["metadata"]["name"]): env_body,
                               (NS, boot_body["metadata"]["name"]): boot_body}
    assert all(cm["immutable"] is True for cm in kube.configmaps.values())
    assert (cond.status, cond.reason) == (True, "Reconciled") and events == []
    # Again: read and checked, nothing written.
    kube.calls.clear()
    assert publish(kube, LOCAL)[1] == names
    assert kube.calls == ["read_configmap", "read_configmap"]


def test_without_a_local_copy_the_boot_configmap_is_none() -> None:
    cond, names, _ = publish(MemoryKube())
    assert names == {"env": env()["metadata"]["name"], "boot": None} and cond.status


def tampered(body: dict[str, Any], how: str) -> dict[str, Any]:
    """`body` (what the operator would create) as someone else made it first."""
    out = copy.deepcopy(body)
    if how == "content":  # the annotation still claims the operator's hash
        out["data"]["JAX_COMPILATION_CACHE_DIR"] = "gs://attacker/p"
    elif how == "binary":
        out["binaryData"] = {**out.get("binaryData", {}), "x.pyc": "bm90IHRoZSBvcGVyYXRvcidz"}
    elif how == "not-base64":
        out["binaryData"] = {"x.pyc": "***"}
    elif how == "mutable":
        out.pop("immutable")
    elif how == "unlabelled":
        out["metadata"]["labels"] = {}
    elif how == "other-owner":
        out["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    elif how == "no-owner":
        out["metadata"].pop("ownerReferences")
    return out


WHY = {"content": "its content is not what the operator wrote", "binary": "its content is not what the operator wrote",
       "not-base64": "its content is not what the operator wrote", "mutable": "it is not immutable",
       "unlabelled": "it lacks the label app.kubernetes.io/managed-by=cachewarm",
       "other-owner": "its controller is not this cache", "no-owner": "its controller is not this cache"}


@pytest.mark.parametrize("how", sorted(WHY))
def test_a_configmap_of_our_name_that_is_not_ours_is_not_used_nor_changed(how: str) -> None:
    kube = MemoryKube()
    key = (NS, env()["metadata"]["name"])
    kube.configmaps[key] = tampered(env(), how)
    before = copy.deepcopy(kube.configmaps)
    cond, names, events = publish(kube)
    assert names == {"env": None, "boot": None}
    assert (cond.status, cond.reason) == (False, "ConfigMapNotOurs")
    assert f"ConfigMap {key[1]} (the cache env, for containers with envFrom sources) exists, but {WHY[how]}" \
        in cond.message and "never deletes it" in cond.message
    assert [(e.type, e.reason, e.message) for e in events] == [("Warning", "ConfigMapNotOurs", cond.message)]
    assert kube.configmaps == before and "create_configmap" not in kube.calls  # neither replaced nor deleted
    # Said once: the next reconcile with that condition in status posts no Event again.
    assert publish(kube, status=as_status(cond))[2] == []


def test_a_tampered_boot_configmap_leaves_the_env_one_in_use() -> None:
    kube = MemoryKube()
    kube.configmaps[(NS, boot()["metadata"]["name"])] = tampered(boot(), "binary")
    cond, names, _ = publish(kube, LOCAL)
    assert names == {"env": env_configmap(LOCAL, NAME, NS, OWNER)["metadata"]["name"], "boot": None}
    assert cond.reason == "ConfigMapNotOurs" and "the code of the local copy pods make in process" in cond.message


def test_a_verified_one_deleted_and_recreated_with_other_content_is_dropped() -> None:
    kube = MemoryKube()
    name = publish(kube)[1]["env"]
    assert name is not None
    kube.configmaps[(NS, name)] = tampered(kube.configmaps[(NS, name)], "content")
    assert publish(kube)[1] == {"env": None, "boot": None}


def test_one_created_by_someone_between_our_read_and_our_create_is_checked_too() -> None:
    class Racing(MemoryKube):
        def create_configmap(self, body: dict[str, Any]) -> dict[str, Any] | None:
            self.configmaps[(NS, body["metadata"]["name"])] = tampered(body, "content")  # theirs landed first
            return super().create_configmap(body)

    kube = Racing()
    assert ensure_configmap(kube, env(), UID) == "its content is not what the operator wrote"


def test_a_read_that_fails_keeps_the_last_check_and_is_retried() -> None:
    kube = MemoryKube()
    kube.fail["read_configmap"] = KubeError("reading ConfigMap: 503 Service Unavailable", 503)
    cond, names, events = publish(kube)
    assert names == {"boot": None}  # env left out: status keeps what the last check recorded
    assert (cond.status, cond.reason) == (False, "KubernetesError") and "503" in cond.message
    assert [e.reason for e in events] == ["KubernetesError"]


def test_what_the_apiserver_stores_is_ours() -> None:
    """The API's answer carries more than we sent (uid, resourceVersion, managedFields):
    none of it counts, only content, immutability, label and controller."""
    stored = copy.deepcopy(env())
    stored["metadata"].update({"uid": "x", "resourceVersion": "7", "creationTimestamp": "2026-11-22T07:00:00Z",
                               "managedFields": [{"manager": "cachewarm"}]})
    stored["metadata"]["labels"]["extra"] = "added by a policy"
    assert not_ours(stored, env(), UID) == ""
