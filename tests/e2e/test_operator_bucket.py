"""The operator, as its own process with the manifests' RBAC, reconciles buckets on the
GCS emulator: create, adopt, region check, drift, deletion policies and GCS faults."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import storage

from cachewarm.builders import bucket as b
from cachewarm.clients.gcs import GcsClient
from cachewarm.api.model import GcsStorage
from cachewarm.reconcile.bucket import reconcile_bucket
from cachewarm_testbed import lifecycle_eval as ev
from cachewarm_testbed.buckets import grant
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.gcsproxy import ProxyControl

pytestmark = pytest.mark.e2e

DAY = 86400
ENTRY = "jit_train_step-" + "ab" * 32 + "-cache"


def ours(days: int, *prefixes: str) -> dict[str, Any]:
    """A rule cachewarm writes: JAX entries under the prefixes, by days since customTime."""
    return b.last_use_rule(days, list(prefixes) or [""])


def unique_bucket(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def cache(name: str, bucket: str, **gcs: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cachewarm.dev/v1alpha1",
        "kind": "CompilationCache",
        "metadata": {"name": name},
        "spec": {"storage": {"gcs": {"bucket": bucket, "location": "us-central1", **gcs}}},
    }


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return None


def wait_condition(bed: Testbed, ns: str, name: str, type_: str, status: str, reason: str | None = None,
                   timeout: float = 60) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns)
        cond = condition(obj, type_)
        if cond and cond["status"] == status and (reason is None or cond["reason"] == reason):
            return obj
        return None
    return eventually(check, timeout=timeout, what=f"{type_}={status} ({reason}) on {ns}/{name}")


def event_reasons(bed: Testbed, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in bed.events_for(name, ns)]


def bucket_writes(proxy: ProxyControl, bucket: str) -> list[dict[str, Any]]:
    return [w for w in proxy.writes() if bucket in w["path"] or w["path"].rstrip("/") == "/storage/v1/b"]


def bucket_reads(proxy: ProxyControl, bucket: str) -> int:
    """Reads of the bucket's metadata that reached GCS since the proxy's log was cleared."""
    return sum(1 for r in proxy.log() if r["method"] == "GET" and r["path"].rstrip("/") == f"/storage/v1/b/{bucket}")


def wait_reconciles(proxy: ProxyControl, bucket: str, reads: int, timeout: float = 60) -> None:
    """Until the operator read the bucket `reads` times since proxy.clear_log(): the
    operator's own record that it reconciled. Every reconcile of a cache on the bucket
    starts with one read of it (one more only when a write of its races someone else's),
    and reconciles of one cache never overlap (the controller's queue), so with one cache on
    the bucket, read n+1 means n reconciles ended: their status written, their Events
    posted. The test itself must not read the bucket meanwhile."""
    eventually(lambda: bucket_reads(proxy, bucket) >= reads, timeout=timeout,
               what=f"{reads} reads of bucket {bucket} by the operator's reconciles")


def wait_listed_twice(bed: Testbed, ns: str, names: list[str], since: dt.datetime, timeout: float = 90) -> None:
    """Until each cache recorded two listings (status.cache.listedTime, the time its
    reconcile began, whole seconds) both later than `since`: the cache's own record that
    one of its reconciles began after `since` (so read the bucket after it) and ended (its
    status written, its Events posted) before the next one began. Per cache, where the
    proxy's log tells the caches on one bucket apart by nothing. A listing comes at the
    inventory cadence (10 s in the suite): about twice that."""
    floor = since.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # > floor: after since
    first: dict[str, str] = {}

    def check() -> bool:
        for name in names:
            listed = str((((bed.get_json("ccache", name, ns) or {}).get("status") or {}).get("cache") or {})
                         .get("listedTime") or "")
            if listed > floor and name not in first:
                first[name] = listed
        return len(first) == len(names) and all(
            str((((bed.get_json("ccache", n, ns) or {}).get("status") or {}).get("cache") or {})
                .get("listedTime") or "") > first[n] for n in names)
    eventually(check, timeout=timeout, what=f"two listings of each of {names} after {floor}")


def test_sample_creates_configured_bucket_and_reaches_ready(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, repo: Path,
    proxy: ProxyControl,
) -> None:
    sample = yaml.safe_load((repo / "manifests" / "samples" / "compilationcache.yaml").read_text())
    proxy.clear_log()
    installed.apply(sample, namespace)
    obj = wait_condition(installed, namespace, "llama-8b", "Ready", "True")

    bucket = gcs.get_bucket("team-jax-cache")
    assert bucket.location == "US-CENTRAL1"  # as GCS reports it
    assert bucket.storage_class == "STANDARD"
    assert bucket.iam_configuration.uniform_bucket_level_access_enabled
    assert bucket.iam_configuration.public_access_prevention == "enforced"
    assert bucket.soft_delete_policy.retention_duration_seconds == 7 * DAY
    assert [dict(r) for r in bucket.lifecycle_rules] == [ours(10, "llama-8b/")]
    # The rule GCS holds expires the entries and the warmers' packs under the prefix (issue 30), nothing else.
    [rule] = [dict(r) for r in bucket.lifecycle_rules]
    pack = f"llama-8b/.cachewarm/pools/{namespace}/llama-8b/cpu/llama-8b-cpu-1.cachewarm-pack"
    assert ev.name_conditions_met(rule, pack) and ev.name_conditions_met(rule, f"llama-8b/{ENTRY}")
    assert not ev.name_conditions_met(rule, pack.removesuffix(".cachewarm-pack") + ".json")
    assert not ev.name_conditions_met(rule, f"other/{ENTRY}")
    assert bucket.labels["managed-by"] == "cachewarm"
    assert bucket.labels[b.rule_label(ours(10, "llama-8b/"))] == "default"

    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["bucket"] == {
        "url": "gs://team-jax-cache/llama-8b", "location": "US-CENTRAL1", "storageClass": "STANDARD",
        "createdByCachewarm": True, "deleteAfterDays": 10, "softDeleteDays": 7,
    }
    assert condition(obj, "BucketReady")["reason"] == "Reconciled"
    assert condition(obj, "LifecycleReady")["reason"] == "Reconciled"
    assert condition(obj, "SoftDeleteApplied")["reason"] == "Reconciled"
    # No kopf state anywhere on the user's object (the controller is ours); Retain needs no finalizer.
    assert not any(k.startswith("kopf.zalando.org") for k in obj["metadata"].get("annotations", {}))
    assert "kopf" not in status
    assert not obj["metadata"].get("finalizers")
    # Created with its lifecycle and soft delete in the one insert: nothing left to patch.
    assert "BucketConfigured" not in event_reasons(installed, namespace, "llama-8b")
    [created] = [e for e in installed.events_for("llama-8b", namespace) if e["reason"] == "BucketCreated"]
    assert created["message"].endswith("with labels, lifecycle, softDeletePolicy"), created["message"]
    assert [w["method"] for w in bucket_writes(proxy, "team-jax-cache")] == ["POST"], proxy.writes()

    # Applying the same file again changes nothing on the object, even across resyncs: two
    # resyncs are seen to end (three reads of the bucket) before the object is compared.
    before = installed.get_json("ccache", "llama-8b", namespace)
    out = installed.apply(sample, namespace)
    assert "unchanged" in out
    proxy.clear_log()
    wait_reconciles(proxy, "team-jax-cache", 3)
    after = installed.get_json("ccache", "llama-8b", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert bucket_writes(proxy, "team-jax-cache") == []


def test_spec_change_is_applied_and_generation_observed(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("spec-change")
    installed.apply(cache("c", name, prefix="c", lifecycle={"deleteAfterDays": 5}), namespace)
    wait_condition(installed, namespace, "c", "Ready", "True")
    installed.apply(cache("c", name, prefix="c", lifecycle={"deleteAfterDays": 20}, softDeleteDays=0), namespace)

    def updated() -> dict[str, Any] | None:
        obj = installed.get_json("ccache", "c", namespace)
        assert obj is not None
        ok = obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2
        return obj if ok and obj["status"]["bucket"]["deleteAfterDays"] == 20 else None
    obj = eventually(updated, what="generation 2 reconciled")
    assert obj["status"]["bucket"]["softDeleteDays"] == 0
    assert gcs.get_bucket(name).soft_delete_policy.retention_duration_seconds == 0
    assert [dict(r) for r in gcs.get_bucket(name).lifecycle_rules] == [ours(20, "c/")]


def test_hand_made_drift_is_undone_with_event(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("drift")
    installed.apply(cache("drifty", name, prefix="p", lifecycle={"deleteAfterDays": 3}), namespace)
    wait_condition(installed, namespace, "drifty", "Ready", "True")

    bucket = gcs.get_bucket(name)
    foreign = {"action": {"type": "SetStorageClass", "storageClass": "NEARLINE"}, "condition": {"age": 100}}
    bucket.lifecycle_rules = [foreign]  # someone replaced our rule with theirs
    bucket.soft_delete_policy.retention_duration_seconds = 30 * DAY
    bucket.patch()

    def restored() -> bool:
        got = gcs.get_bucket(name)
        rules = [dict(r) for r in got.lifecycle_rules]
        return rules == [foreign, ours(3, "p/")] and got.soft_delete_policy.retention_duration_seconds == 7 * DAY
    eventually(restored, timeout=30, what="lifecycle and soft delete restored, foreign rule kept")
    eventually(lambda: "DriftCorrected" in event_reasons(installed, namespace, "drifty"),
               timeout=15, what="DriftCorrected event")

    # Only cachewarm's rule removed (its label left behind): drift as well, not a new cache.
    def drift_events() -> int:
        return sum(e["count"] if e.get("count") else 1 for e in installed.events_for("drifty", namespace)
                   if e["reason"] == "DriftCorrected")
    before = drift_events()
    bucket = gcs.get_bucket(name)
    bucket.lifecycle_rules = [foreign]
    bucket.patch()
    eventually(restored, timeout=30, what="our rule restored again")
    eventually(lambda: drift_events() > before, timeout=15, what="a second DriftCorrected event")


def test_adopt_missing_bucket_reports_and_writes_nothing(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    name = unique_bucket("absent")
    proxy.clear_log()
    installed.apply(cache("adopt", name, create=False), namespace)
    obj = wait_condition(installed, namespace, "adopt", "BucketReady", "False", "BucketNotFound")
    assert "create: true" in condition(obj, "BucketReady")["message"]
    assert condition(obj, "Ready")["status"] == "False"
    assert gcs.lookup_bucket(name) is None
    assert bucket_writes(proxy, name) == []


def test_adopt_bucket_in_other_region_reports_and_writes_nothing(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    name = unique_bucket("eu")
    gcs.create_bucket(name, location="europe-west4")
    grant(gcs, name, namespace)  # granted: the region is then checked (without a grant, nothing is said of it)
    blob = gcs.bucket(name).blob("theirs/data.bin")
    blob.upload_from_string(b"keep me")
    proxy.clear_log()
    installed.apply(cache("far", name, create=False), namespace)
    obj = wait_condition(installed, namespace, "far", "BucketReady", "False", "LocationMismatch")
    message = condition(obj, "BucketReady")["message"]
    assert "EUROPE-WEST4" in message and "us-central1" in message
    assert bucket_writes(proxy, name) == []
    assert list(gcs.get_bucket(name).lifecycle_rules) == []
    assert gcs.bucket(name).blob("theirs/data.bin").download_as_bytes() == b"keep me"


def test_adopted_bucket_is_configured_but_its_own_rules_and_access_kept(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("adopted")
    gcs.create_bucket(name, location="US-CENTRAL1")
    grant(gcs, name, namespace, "jax")
    bucket = gcs.get_bucket(name)
    theirs = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}
    bucket.lifecycle_rules = [theirs]
    bucket.patch()
    installed.apply(cache("adopted", name, create=False, prefix="jax"), namespace)
    obj = wait_condition(installed, namespace, "adopted", "Ready", "True")
    assert obj["status"]["bucket"]["createdByCachewarm"] is False
    rules = [dict(r) for r in gcs.get_bucket(name).lifecycle_rules]
    assert rules == [theirs, ours(30, "jax/")]
    assert not gcs.get_bucket(name).iam_configuration.uniform_bucket_level_access_enabled


def _put(gcs: storage.Client, bucket: str, names: list[str]) -> None:
    for obj in names:
        gcs.bucket(bucket).blob(obj).upload_from_string(b"x")


def _names(gcs: storage.Client, bucket: str) -> set[str]:
    return {b.name for b in gcs.list_blobs(bucket)}


def test_retain_keeps_bucket_and_entries(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("retain")
    installed.apply(cache("keep", name, prefix="c"), namespace)
    wait_condition(installed, namespace, "keep", "Ready", "True")
    _put(gcs, name, [f"c/{ENTRY}"])
    assert installed.kubectl_run("delete", "ccache", "keep", "-n", namespace, "--timeout=30s").returncode == 0
    assert installed.get_json("ccache", "keep", namespace) is None
    assert _names(gcs, name) == {f"c/{ENTRY}"}


def test_delete_removes_entries_and_created_bucket(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("delete")
    installed.apply(cache("gone", name, prefix="c", deletionPolicy="Delete"), namespace)
    obj = wait_condition(installed, namespace, "gone", "Ready", "True")
    assert obj["metadata"]["finalizers"] == ["cachewarm.dev/data-cleanup"]
    _put(gcs, name, [f"c/{ENTRY}", f"c/{ENTRY.replace('-cache', '-atime')}"])
    assert installed.kubectl_run("delete", "ccache", "gone", "-n", namespace, "--timeout=60s").returncode == 0
    assert gcs.lookup_bucket(name) is None


def test_delete_never_touches_what_cachewarm_did_not_create(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    # A created bucket that also holds someone else's objects: entries go, the rest stays.
    # Of the warmers' manifests, only the deleted cache's own go (another cache's stay).
    made = unique_bucket("shared")
    installed.apply(cache("shared", made, prefix="c", deletionPolicy="Delete"), namespace)
    wait_condition(installed, namespace, "shared", "Ready", "True")
    manifests = f"c/.cachewarm/pools/{namespace}"
    # This cache's manifests: one per warmer Job, and the pool's from before per-Job ones.
    _put(gcs, made, [f"c/{ENTRY}", "c/notes.txt", "other/data.bin", f"{manifests}/shared/cpu.json",
                     f"{manifests}/shared/cpu/shared-cpu-0123456789.json", f"{manifests}/other/cpu.json",
                     f"{manifests}/other/cpu/other-cpu-0123456789.json",
                     # Packs beside the manifests (issue 30): this cache's goes, another's stays.
                     f"{manifests}/shared/cpu/shared-cpu-0123456789.cachewarm-pack",
                     f"{manifests}/other/cpu/other-cpu-0123456789.cachewarm-pack"])
    # An adopted bucket: entries under the prefix go, the bucket and other data stay.
    adopted = unique_bucket("adopt-del")
    gcs.create_bucket(adopted, location="us-central1")
    grant(gcs, adopted, namespace, "c")
    _put(gcs, adopted, [f"c/{ENTRY}", f"elsewhere/{ENTRY}", "c/sub/" + ENTRY,
                        f"{manifests}/adopted/cpu.json", f"{manifests}/shared/cpu.json"])
    installed.apply(cache("adopted", adopted, prefix="c", create=False, deletionPolicy="Delete"), namespace)
    wait_condition(installed, namespace, "adopted", "Ready", "True")

    for n in ("shared", "adopted"):
        assert installed.kubectl_run("delete", "ccache", n, "-n", namespace, "--timeout=60s").returncode == 0
    assert _names(gcs, made) == {"c/notes.txt", "other/data.bin", f"{manifests}/other/cpu.json",
                                 f"{manifests}/other/cpu/other-cpu-0123456789.json",
                                 f"{manifests}/other/cpu/other-cpu-0123456789.cachewarm-pack"}
    assert _names(gcs, adopted) == {f"elsewhere/{ENTRY}", "c/sub/" + ENTRY, f"{manifests}/shared/cpu.json"}
    reasons = event_reasons(installed, namespace, "adopted")
    assert "BucketKept" in reasons
    said = f"Deleted 1 cache objects and 2 warmer manifests and 1 warmer packs under gs://{made}/c"
    assert any(e["reason"] == "DataDeleted" and e["message"] == said for e in installed.events_for("shared", namespace))


def test_gcs_faults_end_in_ready_without_duplicate_writes(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    name = unique_bucket("faulty")
    proxy.clear_log()
    proxy.faults([
        {"method": "GET", "path": f"/b/{name}$", "hang": 4, "status": 504, "times": 1},  # client timeout (2 s)
        {"method": "POST", "path": r"^/storage/v1/b/?$", "status": 429, "times": 2},
        {"method": "PATCH", "path": f"/b/{name}$", "status": 503, "times": 2},
    ])
    try:
        installed.apply(cache("faulty", name, prefix="f"), namespace)
        obj = wait_condition(installed, namespace, "faulty", "Ready", "True", timeout=90)
        assert obj["status"]["bucket"]["deleteAfterDays"] == 30
        # One insert carrying the settings (plus the proxy's own completion PATCH, not logged).
        assert [(w["method"]) for w in bucket_writes(proxy, name)] == ["POST"], bucket_writes(proxy, name)
        # A new spec is a PATCH, which fails twice first.
        installed.apply(cache("faulty", name, prefix="f", lifecycle={"deleteAfterDays": 12}), namespace)
        eventually(lambda: ((installed.get_json("ccache", "faulty", namespace) or {}).get("status") or {})
                   .get("bucket", {}).get("deleteAfterDays") == 12, timeout=90, what="the new rule")
    finally:
        proxy.clear_faults()
    writes = bucket_writes(proxy, name)
    assert [(w["method"]) for w in writes] == ["POST", "PATCH"], writes
    reasons = event_reasons(installed, namespace, "faulty")
    assert "GCSUnavailable" in reasons
    assert gcs.get_bucket(name).soft_delete_policy.retention_duration_seconds == 7 * DAY


def test_permission_denied_is_a_condition_then_recovers(
    operator: OperatorHandle, installed: Testbed, namespace: str, proxy: ProxyControl
) -> None:
    name = unique_bucket("denied")
    proxy.faults([{"method": "GET", "path": f"/b/{name}$", "status": 403, "times": 3}])
    try:
        installed.apply(cache("denied", name), namespace)
        obj = wait_condition(installed, namespace, "denied", "BucketReady", "False", "AccessDenied", timeout=30)
        assert "permission denied" in condition(obj, "BucketReady")["message"]
    finally:
        proxy.clear_faults()
    wait_condition(installed, namespace, "denied", "Ready", "True", timeout=60)
    assert "AccessDenied" in event_reasons(installed, namespace, "denied")


def test_second_cache_on_the_same_prefix_is_refused_and_never_deletes_the_first(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client
) -> None:
    name = unique_bucket("shared-prefix")
    installed.apply(cache("first", name, prefix="p", deletionPolicy="Delete"), namespace)
    wait_condition(installed, namespace, "first", "Ready", "True")
    _put(gcs, name, [f"p/{ENTRY}"])
    installed.apply(cache("second", name, prefix="p", deletionPolicy="Delete",
                          lifecycle={"deleteAfterDays": 1}), namespace)
    obj = wait_condition(installed, namespace, "second", "BucketReady", "False", "PrefixInUse")
    assert f"already the cache of {namespace}/first" in condition(obj, "BucketReady")["message"]
    rules = [dict(r) for r in gcs.get_bucket(name).lifecycle_rules]
    assert rules == [ours(30, "p/")]
    assert installed.kubectl_run("delete", "ccache", "second", "-n", namespace, "--timeout=60s").returncode == 0
    assert _names(gcs, name) == {f"p/{ENTRY}"}


# --- data safety: what cachewarm's rules can match, on adopted buckets and shared ones -----

JAX_SHAPED_ELSEWHERE = "other-team/jit_x-" + "cd" * 32 + "-cache"
FOREIGN_OBJECTS = ["datasets/train.parquet", "checkpoints/step-100/model.safetensors",
                   "checkpoints/step-100/meta.json", "README.md"]
CLASS_RULE = {"action": {"type": "SetStorageClass", "storageClass": "NEARLINE"},
              "condition": {"age": 30, "matchesPrefix": ["checkpoints/"]}}
LOGS_RULE = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}


def _adopted_bucket_with_foreign_data(gcs: storage.Client, stem: str, lookalike: dict[str, Any],
                                      objects: list[str]) -> tuple[str, list[dict[str, Any]]]:
    name = unique_bucket(stem)
    gcs.create_bucket(name, location="us-central1")
    _put(gcs, name, objects)
    bucket = gcs.get_bucket(name)
    # The team's rules, one shaped exactly like cachewarm's (but never recorded as ours).
    bucket.lifecycle_rules = [LOGS_RULE, CLASS_RULE, lookalike]
    bucket.patch()
    return name, [dict(r) for r in gcs.get_bucket(name).lifecycle_rules]


def _put_entries(gcs: storage.Client, bucket: str, object_prefix: str) -> list[str]:
    """Entries as JAX writes them under the cache's prefix (a -cache and its -atime), each
    stamped with a customTime as a warmer stamps what it finds or writes: what the rules
    below are checked against. Uploaded by the test at the prefix it names: the env the
    operator gives a warmer (where its entries go) is test_warmup's to check, through the
    operator's own warmer Job on the node agent, not this test's."""
    stamped = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    names = [f"{object_prefix}{ENTRY}", f"{object_prefix}{ENTRY.replace('-cache', '-atime')}"]
    for obj in names:
        blob = gcs.bucket(bucket).blob(obj)
        blob.custom_time = stamped
        blob.upload_from_string(b"x")
    return names


@pytest.mark.parametrize("prefix", ["", "jax"])
def test_adopted_bucket_rules_match_only_jax_entries_and_foreign_rules_stay(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, prefix: str,
) -> None:
    object_prefix = f"{prefix}/" if prefix else ""
    objects = FOREIGN_OBJECTS + ([JAX_SHAPED_ELSEWHERE, "datasets/features-cache"] if prefix else [])
    name, foreign_rules = _adopted_bucket_with_foreign_data(
        # Shaped like the rule the cache will want, one day apart (an identical one is the
        # team's rule for the job: cachewarm then adds no copy, see the integration tests).
        gcs, "adopt-root" if not prefix else "adopt-prefix", ours(6, object_prefix) if prefix else ours(6), objects)
    grant(gcs, name, namespace, prefix)
    spec = cache("team", name, create=False, prefix=prefix, lifecycle={"deleteAfterDays": 5})
    installed.apply(spec, namespace)
    if not prefix:
        # At the root, GCS cannot tell JAX's entries from the team's: no rule without a yes.
        obj = wait_condition(installed, namespace, "team", "LifecycleReady", "False", "BucketRootNotAllowed")
        assert condition(obj, "Ready")["status"] == "True"
        assert [dict(r) for r in gcs.get_bucket(name).lifecycle_rules] == foreign_rules
        spec["spec"]["storage"]["gcs"]["lifecycle"]["allowBucketRoot"] = True
        installed.apply(spec, namespace)
    wait_condition(installed, namespace, "team", "LifecycleReady", "True", "Reconciled")
    written = _put_entries(gcs, name, object_prefix)

    seen = GcsClient(client=gcs, timeout=10).get_bucket(name)
    assert seen is not None
    theirs, mine = b.split_rules(seen)
    assert [dict(r) for r in theirs] == foreign_rules  # byte for byte, in order, the lookalike too
    assert [dict(r) for r in seen.lifecycle_rules][:len(foreign_rules)] == foreign_rules
    assert mine == [ours(5, object_prefix) if prefix else ours(5)]
    for foreign in objects:
        assert ev.rules_matching_name(mine, foreign) == [], foreign
    entries = [blob for blob in gcs.list_blobs(name, prefix=object_prefix or None)
               if b.ENTRY_NAME.match(blob.name[len(object_prefix):])]
    assert sorted(blob.name for blob in entries) == sorted(written)
    for blob in entries:
        assert len(ev.rules_matching_name(mine, blob.name)) == 1
        state = ev.ObjectState(blob.name, blob.time_created, blob.custom_time)
        assert blob.custom_time is not None
        assert not ev.deletes(mine, state, blob.custom_time + dt.timedelta(days=4))
        assert ev.deletes(mine, state, blob.custom_time + dt.timedelta(days=5))
    assert _names(gcs, name) >= set(objects)


def test_caches_sharing_a_bucket_report_conflicts_and_leave_it_alone(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    name = unique_bucket("shared-bucket")
    installed.apply(cache("first", name, prefix="team", softDeleteDays=7), namespace)
    wait_condition(installed, namespace, "first", "Ready", "True")
    installed.apply(cache("nested", name, prefix="team/llama", softDeleteDays=30), namespace)
    installed.apply(cache("root", name, softDeleteDays=7), namespace)
    installed.apply(cache("sibling", name, prefix="other", softDeleteDays=14), namespace)

    nested = wait_condition(installed, namespace, "nested", "BucketReady", "False", "PrefixInUse")
    assert f"overlaps gs://{name}/team, already the cache of {namespace}/first" in \
        condition(nested, "BucketReady")["message"]
    nested = wait_condition(installed, namespace, "nested", "SoftDeleteApplied", "False", "SoftDeleteConflict")
    assert f"keeps 7d as CompilationCache {namespace}/first asks (it created the bucket)" in \
        condition(nested, "SoftDeleteApplied")["message"]
    wait_condition(installed, namespace, "root", "BucketReady", "False", "PrefixInUse")
    root = wait_condition(installed, namespace, "root", "SoftDeleteApplied", "True", "SetByOwner")
    assert f"gs://{name} overlaps gs://{name}/team" in condition(root, "BucketReady")["message"]
    sibling = wait_condition(installed, namespace, "sibling", "Ready", "True")
    sibling = wait_condition(installed, namespace, "sibling", "SoftDeleteApplied", "False", "SoftDeleteConflict")
    assert "this cache asks for 14d and does not change it" in condition(sibling, "SoftDeleteApplied")["message"]
    assert condition(sibling, "LifecycleReady")["status"] == "True"

    def settled() -> storage.Bucket | None:
        got = gcs.get_bucket(name)
        return got if [dict(r) for r in got.lifecycle_rules] == [ours(30, "other/", "team/")] else None
    bucket = eventually(settled, what="one shared rule for team/ and other/")
    assert bucket.soft_delete_policy.retention_duration_seconds == 7 * DAY
    metageneration = bucket.metageneration

    # Every cache resyncs (each reads the bucket) a few times: nothing is written again.
    proxy.clear_log()
    wait_reconciles(proxy, name, 12)  # three resyncs of each of the four caches
    assert bucket_writes(proxy, name) == []
    assert gcs.get_bucket(name).metageneration == metageneration
    for cache_name in ("first", "nested", "root", "sibling"):
        reasons = event_reasons(installed, namespace, cache_name)
        assert "DriftCorrected" not in reasons, (cache_name, reasons)
        assert all(reasons.count(r) <= 1 for r in ("PrefixInUse", "SoftDeleteConflict")), (cache_name, reasons)
    assert event_reasons(installed, namespace, "nested").count("SoftDeleteConflict") == 1


def test_resyncs_of_an_unchanged_cache_list_no_objects_until_the_inventory_is_due(
    operator: OperatorHandle, installed: Testbed, namespace: str, proxy: ProxyControl
) -> None:
    """A resync (3 s in the suite) reads the bucket for drift but lists no entries: the
    inventory is taken at a new spec, after a warm, and at its own cadence
    (CACHEWARM_INVENTORY_SECONDS, 10 s in the suite, 1 h by default). Waited for by what the
    operator did (its requests, in order, and the listedTime it records), not by the clock."""
    name = unique_bucket("quiet")
    installed.apply(cache("quiet", name, prefix="q"), namespace)
    obj = wait_condition(installed, namespace, "quiet", "Ready", "True")
    listed_at = obj["status"]["cache"]["listedTime"]
    proxy.clear_log()
    bucket, listing = ("GET", f"/storage/v1/b/{name}"), ("GET", f"/storage/v1/b/{name}/o")

    def until_listed() -> tuple[list[tuple[str, str]]] | None:
        seen = [(e["method"], e["path"].rstrip("/")) for e in proxy.log() if f"/b/{name}" in e["path"]]
        return (seen[:seen.index(listing)],) if listing in seen else None
    [before] = eventually(until_listed, timeout=60, what="the inventory at its cadence")
    # Before it, reconciles only read the bucket (the one that lists read it first).
    assert before and set(before) == {bucket}, before

    def quiet_resync() -> bool:
        """Two reads of the bucket with no listing between: a reconcile that read it and
        ended listing nothing (reconciles of one cache never overlap, so the second read is
        the next one's). Waited for wherever it falls, before or after a listing: not on
        how many resync ticks fit in one inventory period."""
        seen = [(e["method"], e["path"].rstrip("/")) for e in proxy.log() if f"/b/{name}" in e["path"]]
        return any(one == two == bucket for one, two in zip(seen, seen[1:]))
    eventually(quiet_resync, timeout=60, what="a resync that read the bucket and listed nothing")
    relisted = eventually(lambda: (lambda o: o if o["status"]["cache"]["listedTime"] > listed_at else None)(
        installed.get_json("ccache", "quiet", namespace) or {}), timeout=15, what="a new listedTime")
    assert relisted["status"]["cache"]["entries"] == 0
    assert relisted["status"]["observedGeneration"] == relisted["metadata"]["generation"] == 1  # no new spec
    # The operator's own record: the new listing came at the cadence, not sooner.
    first, second = (dt.datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ")
                     for t in (listed_at, relisted["status"]["cache"]["listedTime"]))
    assert second - first >= dt.timedelta(seconds=10), (listed_at, relisted["status"]["cache"]["listedTime"])


# --- what cachewarm leaves alone, driven through the operator: the rule limit, a copy of its
# rule it did not record, another operator instance on the bucket ---------------------------

def warning_events(bed: Testbed, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in bed.events_for(name, ns) if e["reason"] == reason and e["type"] == "Warning"]


def test_a_rule_that_no_longer_fits_under_gcs_limit_is_a_condition_and_nothing_is_written(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    """GCS allows 100 lifecycle rules per bucket. A team's bucket holds 99: the first cache
    takes the last place, the next one (another deleteAfterDays: its own rule) reports
    RuleLimitReached, once, and the operator writes nothing for it, resync after resync.
    (Caches are ordered by creationTimestamp, whole seconds, then by name: "first" is the
    older even when both were created in the same second.)"""
    name = unique_bucket("full")
    gcs.create_bucket(name, location="us-central1")
    grant(gcs, name, namespace)
    theirs = [{"action": {"type": "Delete"}, "condition": {"age": 100 + i, "matchesPrefix": [f"logs{i}/"]}}
              for i in range(b.MAX_LIFECYCLE_RULES - 1)]
    bucket = gcs.get_bucket(name)
    bucket.lifecycle_rules = theirs
    bucket.patch()
    installed.apply(cache("first", name, create=False, prefix="a", lifecycle={"deleteAfterDays": 10}), namespace)
    wait_condition(installed, namespace, "first", "LifecycleReady", "True", "Reconciled")
    full = gcs.get_bucket(name)
    assert [dict(r) for r in full.lifecycle_rules] == [*theirs, ours(10, "a/")]

    since = dt.datetime.now(dt.timezone.utc)
    proxy.clear_log()
    installed.apply(cache("second", name, create=False, prefix="b", lifecycle={"deleteAfterDays": 20}), namespace)
    obj = wait_condition(installed, namespace, "second", "LifecycleReady", "False", "RuleLimitReached")
    lifecycle = condition(obj, "LifecycleReady")
    assert "holds 99 lifecycle rules of others and 1 of cachewarm's" in lifecycle["message"]
    assert "no rule for 20 days fits" in lifecycle["message"]
    assert condition(obj, "BucketReady")["status"] == "True"  # the bucket itself is fine
    assert obj["status"]["bucket"].get("deleteAfterDays") is None  # no rule of cachewarm's covers b/
    # Several resyncs of both caches later (each reads the bucket once): nothing was written,
    # the first cache keeps its place, the second was announced once. The proxy's log cannot
    # tell the two caches' reads apart (7 reads could all be one cache's), so each cache's
    # own record says it reconciled, whole, within the log's window.
    wait_listed_twice(installed, namespace, ["first", "second"], since)
    wait_reconciles(proxy, name, 7)
    assert bucket_writes(proxy, name) == []
    after = gcs.get_bucket(name)
    assert after.metageneration == full.metageneration
    rules = [dict(r) for r in after.lifecycle_rules]
    assert rules == [*theirs, ours(10, "a/")]
    [said] = warning_events(installed, namespace, "second", "RuleLimitReached")
    assert said["message"] == lifecycle["message"]
    assert condition(installed.get_json("ccache", "first", namespace), "LifecycleReady")["reason"] == "Reconciled"
    # As the rules say: nothing ever deletes the second cache's entries, the first's expire.
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=365)
    now = dt.datetime.now(dt.timezone.utc)
    assert ev.rules_matching_name(rules, f"b/{ENTRY}") == []
    assert not ev.deletes(rules, ev.ObjectState(f"b/{ENTRY}", long_ago, long_ago), now)
    assert ev.deletes(rules, ev.ObjectState(f"a/{ENTRY}", long_ago, long_ago), now)


def test_the_rule_a_cache_needs_already_there_unrecorded_is_reported_and_never_copied(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    """The bucket already holds, byte for byte, the rule the cache needs, but not recorded
    as this operator's (a team's copy, or ours with its label stripped by a tool): the cache
    reports IdenticalForeignRule, once, the operator adds no second copy and records none,
    and entries expire as that rule says. Removing the copy lets cachewarm manage it again."""
    name = unique_bucket("identical")
    gcs.create_bucket(name, location="us-central1")
    grant(gcs, name, namespace, "jax")
    needed = ours(10, "jax/")
    bucket = gcs.get_bucket(name)
    bucket.lifecycle_rules = [LOGS_RULE, needed]
    bucket.patch()
    bucket = gcs.get_bucket(name)
    proxy.clear_log()
    installed.apply(cache("copy", name, create=False, prefix="jax", lifecycle={"deleteAfterDays": 10}), namespace)
    obj = wait_condition(installed, namespace, "copy", "LifecycleReady", "False", "IdenticalForeignRule")
    lifecycle = condition(obj, "LifecycleReady")
    assert "neither adds a second copy nor takes one over" in lifecycle["message"]
    assert condition(obj, "BucketReady")["status"] == "True"
    wait_reconciles(proxy, name, 4)  # the first reconcile and two resyncs ended
    assert bucket_writes(proxy, name) == []
    after = gcs.get_bucket(name)
    assert after.metageneration == bucket.metageneration
    assert [dict(r) for r in after.lifecycle_rules] == [LOGS_RULE, needed]
    assert after.labels == bucket.labels and b.rule_label(needed) not in after.labels
    [said] = warning_events(installed, namespace, "copy", "IdenticalForeignRule")
    assert said["message"] == lifecycle["message"]
    # Entries expire as that rule says: deleteAfterDays after their customTime.
    stamped = dt.datetime.now(dt.timezone.utc)
    entry = ev.ObjectState(f"jax/{ENTRY}", stamped, stamped)
    rules = [dict(r) for r in after.lifecycle_rules]
    assert not ev.deletes(rules, entry, stamped + dt.timedelta(days=10) - dt.timedelta(seconds=1))
    assert ev.deletes(rules, entry, stamped + dt.timedelta(days=10))

    # The unrecorded copy removed: the operator writes the rule as its own (recorded).
    bucket = gcs.get_bucket(name)
    bucket.lifecycle_rules = [LOGS_RULE]
    bucket.patch()
    wait_condition(installed, namespace, "copy", "LifecycleReady", "True", "Reconciled", timeout=30)
    managed = gcs.get_bucket(name)
    assert [dict(r) for r in managed.lifecycle_rules] == [LOGS_RULE, needed]
    assert managed.labels[b.rule_label(needed)] == "default"


def test_a_bucket_another_operator_instance_uses_is_reported_and_its_rules_are_left_alone(
    operator: OperatorHandle, installed: Testbed, namespace: str, gcs: storage.Client, proxy: ProxyControl
) -> None:
    """Another cachewarm operator (instance ops-b, another cluster) keeps a cache on the same
    bucket. It is played by the product's own reconcile_bucket with instance ops-b, as that
    operator would run it; the operator under test (instance default) reports
    SharedWithOtherOperator, once, adds its own rule after the other's and never changes the
    other's rule or label, and the two reach a fixed point (neither writes again)."""
    name = unique_bucket("two-ops")
    gcs.create_bucket(name, location="us-central1")
    grant(gcs, name, "team-b", "b", instance="ops-b")  # one grant per cluster (instance)
    grant(gcs, name, namespace, "a")
    other_spec = GcsStorage.model_validate({"bucket": name, "location": "us-central1", "create": False,
                                            "prefix": "b", "lifecycle": {"deleteAfterDays": 20}})
    other_claim = b.Claim.of(other_spec, created="2026-01-01T00:00:00Z", namespace="team-b", name="b")
    other = GcsClient(client=gcs, timeout=10)
    reconcile_bucket(other, other_spec, mine=other_claim, claims=[], spec_changed=True, instance="ops-b")
    theirs = b.last_use_rule(20, ["b/"])
    assert [dict(r) for r in gcs.get_bucket(name).lifecycle_rules] == [theirs]

    installed.apply(cache("mine", name, create=False, prefix="a", lifecycle={"deleteAfterDays": 10}), namespace)
    obj = wait_condition(installed, namespace, "mine", "LifecycleReady", "True", "SharedWithOtherOperator")
    lifecycle = condition(obj, "LifecycleReady")
    assert "instance(s) ops-b (this one is default)" in lifecycle["message"]
    assert obj["status"]["bucket"]["deleteAfterDays"] == 10
    shared = gcs.get_bucket(name)
    assert [dict(r) for r in shared.lifecycle_rules] == [theirs, ours(10, "a/")]
    assert shared.labels[b.rule_label(theirs)] == "ops-b" and shared.labels[b.rule_label(ours(10, "a/"))] == "default"

    # The other operator's next reconcile finds its rule as it left it and writes nothing;
    # it sees the operator under test as the other instance.
    again = reconcile_bucket(other, other_spec, mine=other_claim, claims=[], spec_changed=False, instance="ops-b")
    assert again.events == [] and again.settings[0].reason == "SharedWithOtherOperator"
    assert "instance(s) default (this one is ops-b)" in again.settings[0].message
    # ...and neither does the operator under test, resync after resync.
    proxy.clear_log()
    wait_reconciles(proxy, name, 3)
    assert bucket_writes(proxy, name) == []
    assert gcs.get_bucket(name).metageneration == shared.metageneration
    [said] = warning_events(installed, namespace, "mine", "SharedWithOtherOperator")
    assert said["message"] == lifecycle["message"]
