"""cachewarm's GCS client and bucket reconcile against the emulator behind its fidelity
proxy: what GCS answers (upper-case locations, 412 on a stale metageneration, merged
labels, customTime only forward, at most 100 lifecycle rules) and what cachewarm does with it (re-read and re-merge on
412, entries stamped with a customTime)."""

from __future__ import annotations

import datetime as dt
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from google.api_core import exceptions as gexc
from google.cloud import storage

from cachewarm.builders import bucket as b
from cachewarm.builders import placement
from cachewarm.clients.gcs import GcsClient, GcsPreconditionFailed
from cachewarm.api.model import GcsStorage
from cachewarm.reconcile.bucket import delete_cache_data, reconcile_bucket
from cachewarm_testbed import lifecycle_eval as ev
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl

pytestmark = pytest.mark.integration

ENTRY = "jit_step-" + "ab" * 32 + "-cache"
THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}


def new_bucket(gcs: storage.Client, granted: bool = True, **labels: str) -> str:
    """A bucket its owner made and (`granted`) granted whole to namespace ns, for the operator
    instances these tests run (default, ops-a, ops-b); its other labels as given."""
    name = f"it-{uuid.uuid4().hex[:10]}"
    bucket = gcs.bucket(name)
    grants = dict(b.grant_label("ns", "", instance) for instance in ("default", "ops-a", "ops-b")) if granted else {}
    bucket.labels = {**grants, **labels}
    gcs.create_bucket(bucket, location="us-central1")
    return name


def spec(bucket: str, **kw: Any) -> GcsStorage:
    return GcsStorage.model_validate({"bucket": bucket, "location": "us-central1", "create": False, **kw})


def claim(gcs_spec: GcsStorage, name: str = "c", created: str = "2026-01-01T00:00:00Z") -> b.Claim:
    return b.Claim.of(gcs_spec, created=created, namespace="ns", name=name)


def test_locations_read_back_upper_case_as_gcs_reports_them(storage_only: storage.Client) -> None:
    assert storage_only.get_bucket(new_bucket(storage_only)).location == "US-CENTRAL1"


def test_stale_metageneration_is_refused_with_412(storage_only: storage.Client) -> None:
    client = GcsClient(client=storage_only, timeout=5)
    name = new_bucket(storage_only)
    seen = client.get_bucket(name)
    assert seen is not None
    other = storage_only.get_bucket(name)
    other.lifecycle_rules = [THEIRS]
    other.patch()  # someone else's edit after we read
    with pytest.raises(GcsPreconditionFailed):
        client.patch_bucket(seen, {"softDeletePolicy": {"retentionDurationSeconds": 0}})
    assert [dict(r) for r in storage_only.get_bucket(name).lifecycle_rules] == [THEIRS]


def test_labels_are_merged_and_removed_as_gcs_patch_does(storage_only: storage.Client, storage_bed: Testbed) -> None:
    name = new_bucket(storage_only, granted=False, team="a", old="x")
    # A PATCH naming one label, as other tools send it: GCS keeps the others.
    requests.patch(f"{storage_bed.storage_emulator_host}/storage/v1/b/{name}", json={"labels": {"added": "y"}},
                   timeout=10).raise_for_status()
    assert storage_only.get_bucket(name).labels == {"team": "a", "old": "x", "added": "y"}
    client = GcsClient(client=storage_only, timeout=5)
    seen = client.get_bucket(name)
    assert seen is not None
    client.patch_bucket(seen, {"labels": {"team": "a", "added": "y"}})
    assert storage_only.get_bucket(name).labels == {"team": "a", "added": "y"}


def test_custom_time_only_moves_forward(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only)
    blob = storage_only.bucket(name).blob(ENTRY)
    blob.upload_from_string(b"x")
    later = dt.datetime(2030, 1, 2, tzinfo=dt.timezone.utc)
    blob.custom_time = later
    blob.patch()
    blob.custom_time = later - dt.timedelta(days=1)
    with pytest.raises(gexc.BadRequest):
        blob.patch()
    assert storage_only.bucket(name).get_blob(ENTRY).custom_time == later


def test_more_than_100_lifecycle_rules_are_refused_as_gcs_does(storage_only: storage.Client) -> None:
    """GCS allows 100 lifecycle rules on a bucket; the emulator alone stores any number."""
    name = new_bucket(storage_only)
    rules = [{"action": {"type": "Delete"}, "condition": {"age": 30 + i, "matchesPrefix": [f"t{i}/"]}}
             for i in range(101)]
    bucket = storage_only.get_bucket(name)
    bucket.lifecycle_rules = rules
    with pytest.raises(gexc.BadRequest):
        bucket.patch()
    assert list(storage_only.get_bucket(name).lifecycle_rules) == []
    bucket = storage_only.get_bucket(name)
    bucket.lifecycle_rules = rules[:100]
    bucket.patch()
    assert len(list(storage_only.get_bucket(name).lifecycle_rules)) == 100


class EditedAfterFirstRead(GcsClient):
    """The real client; after its first read of the bucket, someone else adds a rule (a
    real write to the emulator), so cachewarm's PATCH meets a changed metageneration."""

    def __init__(self, raw: storage.Client) -> None:
        super().__init__(client=raw, timeout=5)
        self.raw = raw
        self.reads = 0

    def get_bucket(self, name: str) -> b.BucketInfo | None:
        seen = super().get_bucket(name)
        self.reads += 1
        if self.reads == 1:
            other = self.raw.get_bucket(name)
            other.lifecycle_rules = [*other.lifecycle_rules, THEIRS]
            other.patch()
        return seen


def test_concurrent_edit_is_re_read_and_merged_not_lost(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only)
    gcs_spec = spec(name, prefix="jax", lifecycle={"deleteAfterDays": 10})
    client = EditedAfterFirstRead(storage_only)
    out = reconcile_bucket(client, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=True)
    assert out.ready and client.reads == 2
    final = storage_only.get_bucket(name)
    rule = b.last_use_rule(10, ["jax/"])
    assert [dict(r) for r in final.lifecycle_rules] == [THEIRS, rule]
    assert final.labels[b.rule_label(rule)] == "default"
    # Reconciled again, nothing changes: the metageneration stays.
    again = reconcile_bucket(GcsClient(client=storage_only, timeout=5), gcs_spec, mine=claim(gcs_spec), claims=[],
                             spec_changed=False)
    assert again.events == []
    assert storage_only.get_bucket(name).metageneration == final.metageneration


def test_entries_without_custom_time_are_stamped_with_their_creation(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only)
    bucket = storage_only.bucket(name)
    for obj in (f"jax/{ENTRY}", "jax/notes-cache.txt", f"jax/sub/{ENTRY}"):
        bucket.blob(obj).upload_from_string(b"x")
    gcs_spec = spec(name, prefix="jax", lifecycle={"deleteAfterDays": 10})
    out = reconcile_bucket(GcsClient(client=storage_only, timeout=5), gcs_spec, mine=claim(gcs_spec), claims=[],
                           spec_changed=True)
    assert out.cache == {"entries": 1, "bytes": 1, "unstamped": 0}
    entry = bucket.get_blob(f"jax/{ENTRY}")
    assert entry.custom_time == entry.time_created
    assert bucket.get_blob(f"jax/sub/{ENTRY}").custom_time is None  # not this cache's entry
    rules = [dict(r) for r in storage_only.get_bucket(name).lifecycle_rules]
    obj = ev.ObjectState(entry.name, entry.time_created, entry.custom_time)
    assert not ev.deletes(rules, obj, entry.time_created + dt.timedelta(days=9))
    assert ev.deletes(rules, obj, entry.time_created + dt.timedelta(days=10))


def test_rule_limit_is_a_condition_not_a_patch_loop(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only)
    bucket = storage_only.get_bucket(name)
    theirs = [{"action": {"type": "Delete"}, "condition": {"age": 100 + i, "matchesPrefix": [f"logs{i}/"]}}
              for i in range(b.MAX_LIFECYCLE_RULES - 1)]
    bucket.lifecycle_rules = theirs
    bucket.patch()
    client = GcsClient(client=storage_only, timeout=5)
    older = spec(name, prefix="a", lifecycle={"deleteAfterDays": 10})
    newer = spec(name, prefix="b", lifecycle={"deleteAfterDays": 20})
    claims = [claim(older, "a", "2026-01-01T00:00:00Z"), claim(newer, "b", "2026-01-02T00:00:00Z")]
    first = reconcile_bucket(client, older, mine=claims[0], claims=claims, spec_changed=True)
    assert [cd.reason for cd in first.settings][0] == "Reconciled"
    full = storage_only.get_bucket(name)
    assert len(list(full.lifecycle_rules)) == b.MAX_LIFECYCLE_RULES
    second = reconcile_bucket(client, newer, mine=claims[1], claims=claims, spec_changed=True)
    lifecycle = second.settings[0]
    assert (lifecycle.status, lifecycle.reason) == (False, "RuleLimitReached")
    assert "99 lifecycle rules of others and 1 of cachewarm's" in lifecycle.message
    assert second.ready and second.events == []
    assert storage_only.get_bucket(name).metageneration == full.metageneration


def test_a_rule_the_library_cannot_read_is_never_dropped(storage_only: storage.Client, storage_bed: Testbed) -> None:
    name = new_bucket(storage_only)
    future = {"action": {"type": "SomeFutureAction"}, "condition": {"age": 1, "matchesPrefix": ["tmp/"]}}
    requests.patch(f"{storage_bed.storage_emulator_host}/storage/v1/b/{name}",
                   json={"lifecycle": {"rule": [THEIRS, future]}}, timeout=10).raise_for_status()
    gcs_spec = spec(name, prefix="jax")
    out = reconcile_bucket(GcsClient(client=storage_only, timeout=5), gcs_spec, mine=claim(gcs_spec), claims=[],
                           spec_changed=True)
    assert (out.settings[0].status, out.settings[0].reason) == (False, "LifecycleRulesUnreadable")
    raw = requests.get(f"{storage_bed.storage_emulator_host}/storage/v1/b/{name}", timeout=10).json()
    assert raw["lifecycle"]["rule"] == [THEIRS, future]


class RecordingClient(GcsClient):
    """The real client, keeping every patch it sends."""

    def __init__(self, raw: storage.Client) -> None:
        super().__init__(client=raw, timeout=5)
        self.patches: list[dict[str, Any]] = []

    def patch_bucket(self, current: b.BucketInfo, patch: dict[str, Any]) -> b.BucketInfo:
        self.patches.append(patch)
        return super().patch_bucket(current, patch)


@pytest.mark.parametrize("asked", [7, 0])
def test_an_adopted_buckets_soft_delete_is_its_owners(storage_only: storage.Client, asked: int) -> None:
    """A team's bucket keeps the 30-day recovery it chose, whatever the cache asks."""
    name = new_bucket(storage_only, team="ml")
    bucket = storage_only.get_bucket(name)
    bucket.soft_delete_policy.retention_duration_seconds = 30 * b.DAY
    bucket.patch()
    gcs_spec = spec(name, prefix="jax", softDeleteDays=asked)
    client = RecordingClient(storage_only)
    for spec_changed in (True, False):
        out = reconcile_bucket(client, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=spec_changed)
        assert out.ready
    assert client.patches and not any("softDeletePolicy" in p for p in client.patches)
    assert storage_only.get_bucket(name).soft_delete_policy.retention_duration_seconds == 30 * b.DAY
    soft = out.settings[1]
    assert (soft.type, soft.status, soft.reason) == ("SoftDeleteApplied", False, "NotManaged")
    assert "not created by cachewarm" in soft.message and "(30d)" in soft.message
    assert out.status["softDeleteDays"] == 30


def test_two_operator_instances_on_one_bucket_leave_each_others_rules_alone(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only, team="ml")
    a_spec = spec(name, prefix="a", lifecycle={"deleteAfterDays": 10})
    b_spec = spec(name, prefix="b", lifecycle={"deleteAfterDays": 20})
    client = RecordingClient(storage_only)
    for _ in range(2):  # each operator sees only its own cache
        out_a = reconcile_bucket(client, a_spec, mine=claim(a_spec, "a"), claims=[], spec_changed=False,
                                 instance="ops-a")
        out_b = reconcile_bucket(client, b_spec, mine=claim(b_spec, "b"), claims=[], spec_changed=False,
                                 instance="ops-b")
    assert len(client.patches) == 2  # one each, then a fixed point
    assert out_a.events == [] == out_b.events
    bucket = storage_only.get_bucket(name)
    assert [dict(r) for r in bucket.lifecycle_rules] == [b.last_use_rule(10, ["a/"]), b.last_use_rule(20, ["b/"])]
    lifecycle = out_a.settings[0]
    assert (lifecycle.status, lifecycle.reason) == (True, "SharedWithOtherOperator")
    assert "instance(s) ops-b (this one is ops-a)" in lifecycle.message
    # A deletion in operator a never deletes what a cache of operator b (same prefix) uses.
    storage_only.bucket(name).blob(f"b/{ENTRY}").upload_from_string(b"x")
    events = delete_cache_data(client, b_spec, namespace="ns", name="b-in-a", instance="ops-a")
    assert [e.reason for e in events] == ["DataRetained"]
    assert storage_only.bucket(name).get_blob(f"b/{ENTRY}") is not None


def test_delete_removes_this_caches_manifests_and_keeps_every_other_caches(storage_only: storage.Client) -> None:
    """deletionPolicy Delete: the cache's entries and its warmers' manifests go; the
    manifests of another cache on the same prefix, of a cache of the same name in another
    namespace or under another prefix, and anything else in the manifest folder stay. Then
    a created bucket holding only the cache's entries and manifests is deleted."""
    name = new_bucket(storage_only, **b.owner_labels("ns", "c"))
    gcs_spec = spec(name, prefix="jax")
    ours = [*(placement.manifest_object(gcs_spec, "ns", "c", pool, f"c-{pool}-1") for pool in ("cpu", "h100")),
            placement.legacy_manifest_object(gcs_spec, "ns", "c", "cpu")]
    theirs = [placement.manifest_object(gcs_spec, "ns", "c2", "cpu", "c2-cpu-1"),
              placement.manifest_object(gcs_spec, "team-b", "c", "cpu", "c-cpu-1"),
              placement.manifest_object(spec(name, prefix="other"), "ns", "c", "cpu", "c-cpu-1"),
              placement.manifest_object(spec(name), "ns", "c", "cpu", "c-cpu-1"),  # a cache of that name at the root
              "jax/.cachewarm/pools/ns/c/notes.txt", "jax/.cachewarm/pools/ns/c/sub/x/cpu.json"]
    assert ours == ["jax/.cachewarm/pools/ns/c/cpu/c-cpu-1.json", "jax/.cachewarm/pools/ns/c/h100/c-h100-1.json",
                    "jax/.cachewarm/pools/ns/c/cpu.json"]
    for obj in [f"jax/{ENTRY}", *ours, *theirs]:
        storage_only.bucket(name).blob(obj).upload_from_string(b'{"version": 1, "entries": []}')
    client = GcsClient(client=storage_only, timeout=5)
    events = delete_cache_data(client, gcs_spec, namespace="ns", name="c")
    assert sorted(o.name for o in storage_only.list_blobs(name)) == sorted(theirs)
    assert [(e.reason, e.message) for e in events] == [
        ("DataDeleted", f"Deleted 1 cache objects and 3 warmer manifests under gs://{name}/jax"),
        ("BucketKept", f"Kept bucket {name}: 6 objects that are not this cache's entries remain")]
    # A created bucket with nothing but the cache's own objects: the manifests hold nothing back.
    name = new_bucket(storage_only, **b.owner_labels("ns", "c"))
    root = spec(name)
    for obj in [ENTRY, placement.manifest_object(root, "ns", "c", "cpu", "c-cpu-1")]:
        storage_only.bucket(name).blob(obj).upload_from_string(b"x")
    events = delete_cache_data(client, root, namespace="ns", name="c")
    assert [e.reason for e in events] == ["DataDeleted", "BucketDeleted"]
    assert storage_only.lookup_bucket(name) is None


def test_the_rule_a_cache_needs_already_there_unrecorded_is_reported_not_copied(storage_only: storage.Client) -> None:
    name = new_bucket(storage_only)
    rule = b.last_use_rule(10, ["jax/"])
    bucket = storage_only.get_bucket(name)
    bucket.lifecycle_rules = [THEIRS, rule]  # e.g. ours, its label stripped by a tool
    bucket.patch()
    gcs_spec = spec(name, prefix="jax", lifecycle={"deleteAfterDays": 10})
    client = RecordingClient(storage_only)
    for _ in range(3):
        out = reconcile_bucket(client, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=False)
    assert client.patches == []
    assert [dict(r) for r in storage_only.get_bucket(name).lifecycle_rules] == [THEIRS, rule]
    lifecycle = out.settings[0]
    assert (lifecycle.status, lifecycle.reason) == (False, "IdenticalForeignRule")


def test_the_inventory_pages_like_gcs_and_lists_only_names_directly_under_the_prefix(
    storage_only: storage.Client, storage_bed: Testbed
) -> None:
    """2,500 entries and 1,200 objects in a folder under the prefix are four objects.list
    pages (GCS's at most 1000 each, cut before matchGlob filters them: the costlier reading
    of GCS's docs), read through the client's own paging, one of them with no match at all;
    the folder's objects are not in the answer (matchGlob '<prefix>*' stops at '/'), and
    each item carries only the fields asked for."""
    name = new_bucket(storage_only)
    bucket = storage_only.bucket(name)
    entries = [f"c/jit_f{i}-{i:064x}-cache" for i in range(2500)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: bucket.blob(n).upload_from_string(b"x"), entries + [
            f"c/sub/jit_g{i}-{i:064x}-cache" for i in range(1200)]))
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    client = GcsClient(client=storage_only, timeout=5)
    listed = list(client.list_objects(name, "c/", glob="c/*"))
    assert sorted(o.name for o in listed) == sorted(entries)
    assert [e["path"] for e in proxy.log()] == [f"/storage/v1/b/{name}/o"] * 4  # pages of all 3,700 names
    assert all(o.size == 1 and o.generation and o.created for o in listed)  # the fields it asked for arrived
