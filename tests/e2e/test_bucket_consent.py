"""Bucket consent through the operator, a real apiserver and the GCS emulator behind its
proxy (which logs every request that reaches GCS): a namespace's caches act only on buckets
cachewarm created for that namespace or that their owner granted to it by label
(docs/bucket-and-data-safety.md#bucket-consent), and new buckets only within the admin's
limits (the session operator runs with CACHEWARM_BUCKET_LOCATIONS=us-central1 and
CACHEWARM_BUCKET_STORAGE_CLASSES=STANDARD,NEARLINE, tests/conftest.py).

The emulator has no IAM: the operator's identity may do anything on it, as a project-wide
storage.admin could on GCS, which is the case consent exists for."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import storage

from cachewarm.builders import bucket as b
from cachewarm_testbed.buckets import grant
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.gcsproxy import ProxyControl
from test_operator_bucket import ENTRY, cache, condition, ours, unique_bucket, wait_condition

pytestmark = pytest.mark.e2e

THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}


@pytest.fixture
def team_a(testbed: Testbed) -> Iterator[str]:
    """The tenant who tries: a namespace of its own beside `namespace` (team-b's)."""
    name = f"a-{uuid.uuid4().hex[:10]}"
    assert testbed.kubectl_run("create", "namespace", name).returncode == 0
    yield name
    testbed.kubectl_run("delete", "namespace", name, "--wait=false")


def editor(bed: Testbed, ns: str, tmp_path: Path) -> Path:
    """A kubeconfig of a user with the built-in `edit` role in `ns` only (ServiceAccount
    ns/tenant), as a platform team gives a team its namespace (kube-controller-manager
    aggregates cachewarm-edit into `edit`)."""
    for args in (("create", "serviceaccount", "tenant", "-n", ns),
                 ("create", "rolebinding", "tenant-edit", "--clusterrole=edit", f"--serviceaccount={ns}:tenant",
                  "-n", ns)):
        done = bed.kubectl_run(*args)
        assert done.returncode == 0, done.stderr
    kubeconfig = bed.service_account_kubeconfig(ns, "tenant", tmp_path / "tenant.kubeconfig")
    eventually(lambda: bed.kubectl_run("auth", "can-i", "create", "compilationcaches.cachewarm.dev", "-n", ns,
                                       kubeconfig=kubeconfig).returncode == 0 or None,
               timeout=60, what="edit aggregates cachewarm-edit")
    return kubeconfig


def team_b_bucket(gcs: storage.Client, team_b: str) -> tuple[str, list[str]]:
    """team-b's bucket as its owner keeps it: granted to team-b at jax/, a rule of its own,
    three JAX entries under jax/ that no warmer stamped yet (no customTime) and a file."""
    name = unique_bucket("team-b")
    gcs.create_bucket(name, location="us-central1")
    grant(gcs, name, team_b, "jax")
    bucket = gcs.get_bucket(name)
    bucket.lifecycle_rules = [THEIRS]
    bucket.patch()
    entries = [f"jax/jit_step{i}-{i:064x}-cache" for i in range(3)]
    for obj in [*entries, "jax/notes.txt"]:
        gcs.bucket(name).blob(obj).upload_from_string(b"team-b's")
    return name, entries


def snapshot(gcs: storage.Client, name: str) -> dict[str, Any]:
    """What team-b would notice changed: the bucket's rules, labels, settings and every
    object with its generation, metageneration and customTime."""
    bucket = gcs.get_bucket(name)
    return {"rules": [dict(r) for r in bucket.lifecycle_rules], "labels": dict(bucket.labels),
            "metageneration": bucket.metageneration,
            "objects": sorted((o.name, o.generation, o.metageneration, o.custom_time) for o in gcs.list_blobs(name))}


def touched(proxy: ProxyControl, name: str) -> list[dict[str, Any]]:
    """Requests on the bucket beyond reading its metadata: writes, and object reads or listings."""
    return [r for r in proxy.log() if f"/b/{name}" in r["path"] and
            not (r["method"] == "GET" and r["path"].rstrip("/") == f"/storage/v1/b/{name}")]


def reads_of(proxy: ProxyControl, name: str) -> int:
    return sum(1 for r in proxy.log() if r["method"] == "GET" and r["path"].rstrip("/") == f"/storage/v1/b/{name}")


def test_a_tenant_cannot_make_the_operator_touch_another_namespaces_bucket(
    operator: OperatorHandle, installed: Testbed, namespace: str, team_a: str, gcs: storage.Client,
    proxy: ProxyControl, tmp_path: Path, controller_manager: Testbed,
) -> None:
    """A user with `edit` in team-a names team-b's bucket three ways (adopt its prefix with a 1-day rule and
    deletionPolicy Delete, its root, and create: true over it): each BucketNotGranted with the
    label team-b's owner would add, nothing of the bucket in status, and across several
    reconciles not one request beyond a read of the bucket's metadata; deleting the caches
    deletes nothing."""
    name, entries = team_b_bucket(gcs, namespace)
    before = snapshot(gcs, name)
    proxy.clear_log()
    tries = {
        "prefix": cache("prefix", name, create=False, prefix="jax", deletionPolicy="Delete",
                        lifecycle={"deleteAfterDays": 1}),
        "root": cache("root", name, create=False, deletionPolicy="Delete",
                      lifecycle={"deleteAfterDays": 1, "allowBucketRoot": True}),
        "create": cache("create", name, create=True, prefix="jax", deletionPolicy="Delete"),
    }
    tenant = editor(installed, team_a, tmp_path)
    for body in tries.values():
        made = installed.kubectl_run("create", "-n", team_a, "-f", "-", input=yaml.safe_dump(body), kubeconfig=tenant)
        assert made.returncode == 0, made.stderr
    for cache_name, body in tries.items():
        obj = wait_condition(installed, team_a, cache_name, "BucketReady", "False", "BucketNotGranted")
        message = condition(obj, "BucketReady")["message"]
        key, value = b.grant_label(team_a, body["spec"]["storage"]["gcs"].get("prefix", ""))
        assert f"--update-labels={key}={value}" in message, message
        assert "US-CENTRAL1" not in message.upper() and "status" in obj
        assert "bucket" not in obj["status"] and "cache" not in obj["status"], obj["status"]
        assert condition(obj, "Stalled")["status"] == "True" and condition(obj, "Ready")["status"] == "False"
        assert {condition(obj, t)["reason"] for t in ("LifecycleReady", "SoftDeleteApplied")} == {"BucketNotGranted"}
    # Each cache reads the bucket once per reconcile (resync 3 s): several rounds each.
    eventually(lambda: reads_of(proxy, name) >= 4 * len(tries), timeout=60, what="four reconciles of each cache")
    assert touched(proxy, name) == []
    assert snapshot(gcs, name) == before
    assert all(gcs.get_bucket(name).get_blob(e).custom_time is None for e in entries)

    proxy.clear_log()  # the test's own reads above went through the proxy too
    for cache_name in tries:
        done = installed.kubectl_run("delete", "ccache", cache_name, "-n", team_a, "--timeout=60s", kubeconfig=tenant)
        assert done.returncode == 0, done.stderr
    assert touched(proxy, name) == []
    assert snapshot(gcs, name) == before
    retained = [e for e in installed.events_for("prefix", team_a) if e["reason"] == "DataRetained"]
    assert retained and "not granted to namespace" in retained[0]["message"], retained


def test_a_cache_that_came_first_without_consent_takes_no_prefix_from_its_owner(
    operator: OperatorHandle, installed: Testbed, namespace: str, team_a: str, gcs: storage.Client,
) -> None:
    """Older caches win an overlap, but only among caches the bucket is granted to: team-a's
    cache made first on team-b's prefix blocks nothing; team-b's own cache manages it."""
    name, _ = team_b_bucket(gcs, namespace)
    installed.apply(cache("early", name, create=False, prefix="jax", lifecycle={"deleteAfterDays": 1}), team_a)
    wait_condition(installed, team_a, "early", "BucketReady", "False", "BucketNotGranted")
    installed.apply(cache("owner", name, create=False, prefix="jax", lifecycle={"deleteAfterDays": 20}), namespace)
    obj = wait_condition(installed, namespace, "owner", "Ready", "True")
    assert condition(obj, "LifecycleReady")["reason"] == "Reconciled"
    assert [dict(r) for r in gcs.get_bucket(name).lifecycle_rules] == [THEIRS, ours(20, "jax/")]


def test_a_bucket_cachewarm_made_for_one_namespace_is_not_another_namespaces(
    operator: OperatorHandle, installed: Testbed, namespace: str, team_a: str, gcs: storage.Client,
    proxy: ProxyControl,
) -> None:
    name = unique_bucket("made")
    installed.apply(cache("maker", name, create=True, prefix="b"), namespace)
    wait_condition(installed, namespace, "maker", "Ready", "True")
    labels = dict(gcs.get_bucket(name).labels)
    assert labels["cachewarm-namespace"] == namespace
    proxy.clear_log()
    installed.apply(cache("other", name, create=True, prefix="a", lifecycle={"deleteAfterDays": 1}), team_a)
    wait_condition(installed, team_a, "other", "BucketReady", "False", "BucketNotGranted")
    eventually(lambda: reads_of(proxy, name) >= 6, timeout=60, what="several reconciles")
    assert touched(proxy, name) == [], "team-a's cache went beyond reading team-b's bucket's metadata"
    assert dict(gcs.get_bucket(name).labels) == labels


def test_the_grant_the_message_names_works_and_its_removal_stops_further_writes(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl,
) -> None:
    """The owner adds exactly the label BucketNotGranted names: the cache becomes Ready (at
    its next reconcile: buckets are not watched, so within one resync), writes its rule and
    stamps its entries. The owner removes it: from the next reconcile on the operator writes
    nothing more, whatever the spec asks, and status drops what it saw of the bucket; the
    rule it wrote stays (the bucket is its owner's again; cachewarm writes nothing there)."""
    name = unique_bucket("grant")
    gcs.create_bucket(name, location="us-central1")
    entry = f"llama/{ENTRY}"
    gcs.bucket(name).blob(entry).upload_from_string(b"x")
    installed.apply(cache("llama", name, create=False, prefix="llama", lifecycle={"deleteAfterDays": 10}), namespace)
    obj = wait_condition(installed, namespace, "llama", "BucketReady", "False", "BucketNotGranted")
    found = re.search(r"--update-labels=([a-z0-9_-]+)=([a-z0-9_-]+)", condition(obj, "BucketReady")["message"])
    assert found, condition(obj, "BucketReady")["message"]
    bucket = gcs.get_bucket(name)
    bucket.labels = {**bucket.labels, found.group(1): found.group(2)}
    bucket.patch()
    obj = wait_condition(installed, namespace, "llama", "Ready", "True")
    assert f"adopted, granted by its label {found.group(1)} (prefix 'llama')" in condition(obj, "BucketReady")["message"]
    assert obj["status"]["bucket"]["location"] == "US-CENTRAL1"
    assert ours(10, "llama/") in [dict(r) for r in gcs.get_bucket(name).lifecycle_rules]
    eventually(lambda: gcs.get_bucket(name).get_blob(entry).custom_time is not None, timeout=30,
               what="the entry stamped once granted")

    bucket = gcs.get_bucket(name)
    labels = dict(bucket.labels)
    labels.pop(found.group(1))
    bucket.labels = labels
    bucket.patch()
    # Nothing else changes: the next resync (3 s here, 300 s by default) finds the grant gone.
    obj = wait_condition(installed, namespace, "llama", "BucketReady", "False", "BucketNotGranted", timeout=30)
    assert "bucket" not in obj["status"] and "cache" not in obj["status"], obj["status"]
    after = snapshot(gcs, name)
    proxy.clear_log()
    # Whatever the spec asks from now on, nothing reaches the bucket beyond a read.
    installed.apply(cache("llama", name, create=False, prefix="llama", lifecycle={"deleteAfterDays": 2}), namespace)
    eventually(lambda: reads_of(proxy, name) >= 4, timeout=60, what="reconciles after the revocation")
    assert touched(proxy, name) == [] and snapshot(gcs, name) == after
    assert ours(2, "llama/") not in after["rules"] and ours(10, "llama/") in after["rules"]


def test_new_buckets_only_where_the_admin_allows(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client,
) -> None:
    """CACHEWARM_BUCKET_LOCATIONS, _STORAGE_CLASSES and _PER_NAMESPACE (10 by default): a cache
    outside them is refused with the rule it broke and nothing is created; back within them
    (another namespace's buckets and another operator's do not count), the bucket is made."""
    far = unique_bucket("far")
    installed.apply(cache("far", far, location="europe-west4"), namespace)
    obj = wait_condition(installed, namespace, "far", "BucketReady", "False", "BucketCreationNotAllowed")
    assert "CACHEWARM_BUCKET_LOCATIONS: US-CENTRAL1" in condition(obj, "BucketReady")["message"]
    cold = unique_bucket("cold")
    installed.apply(cache("cold", cold, storageClass="ARCHIVE"), namespace)
    obj = wait_condition(installed, namespace, "cold", "BucketReady", "False", "BucketCreationNotAllowed")
    assert "CACHEWARM_BUCKET_STORAGE_CLASSES: NEARLINE, STANDARD" in condition(obj, "BucketReady")["message"]
    assert gcs.lookup_bucket(far) is None and gcs.lookup_bucket(cold) is None

    # Ten buckets cachewarm made for this namespace exist already (as their labels say),
    # beside one of another namespace and one of another operator instance.
    made = [unique_bucket("had") for _ in range(10)]
    for i, other in enumerate(made):
        bucket = gcs.bucket(other)
        bucket.labels = b.owner_labels(namespace, f"old-{i}")
        gcs.create_bucket(bucket, location="us-central1")
    for labels in (b.owner_labels("elsewhere", "x"), b.owner_labels(namespace, "x", "ops-b")):
        bucket = gcs.bucket(unique_bucket("not-counted"))
        bucket.labels = labels
        gcs.create_bucket(bucket, location="us-central1")
    eleventh = unique_bucket("eleventh")
    installed.apply(cache("eleventh", eleventh), namespace)
    obj = wait_condition(installed, namespace, "eleventh", "BucketReady", "False", "BucketCreationNotAllowed")
    assert "already created 10 buckets for this namespace" in condition(obj, "BucketReady")["message"]
    assert gcs.lookup_bucket(eleventh) is None
    gcs.get_bucket(made[0]).delete()
    # Counted again at its next reconcile (CACHEWARM_BUCKET_COUNT_SECONDS=0 here: a listing each time).
    wait_condition(installed, namespace, "eleventh", "Ready", "True")
    assert gcs.get_bucket(eleventh).labels["cachewarm-namespace"] == namespace
