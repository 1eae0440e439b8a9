"""reconcile.py against a GCS stand-in that keeps what is written into it: how long the
reconcile may spend stamping entries, what status says about rules that are not there,
and how the deletion path reports a bucket it could not delete."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterator
from typing import Any


from cachewarm.reconcile import bucket as r
from cachewarm.reconcile import cache as service
from cachewarm.builders import bucket as b
from cachewarm.clients.gcs import ObjectInfo
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.api.model import GcsStorage
from memkube import MemoryKube

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def entry(i: int, prefix: str = "jax/") -> str:
    return f"{prefix}jit_step-{i:064x}-cache"


class FakeGcs:
    """One bucket and its objects; patches and customTime stamps are applied to them."""

    def __init__(self, bucket: b.BucketInfo, objects: list[ObjectInfo] | None = None,
                 granted_to: str | None = "ns") -> None:
        # As its owner left it: granted (a whole-bucket grant label) to namespace `granted_to`.
        grant = dict([b.grant_label(granted_to, "")]) if granted_to else {}
        self.bucket = dataclasses.replace(bucket, labels={**bucket.labels, **grant})
        self.objects = {o.name: o for o in objects or []}
        self.stamps: list[str] = []
        self.patches: list[dict[str, Any]] = []
        self.delete_bucket_conflict = False

    def get_bucket(self, name: str) -> b.BucketInfo | None:
        return self.bucket

    def patch_bucket(self, current: b.BucketInfo, patch: dict[str, Any]) -> b.BucketInfo:
        self.patches.append(patch)
        changes: dict[str, Any] = {"metageneration": self.bucket.metageneration + 1}
        if "labels" in patch:
            changes["labels"] = dict(patch["labels"])
        if "lifecycle" in patch:
            changes["lifecycle_rules"] = patch["lifecycle"]["rule"]
        if "softDeletePolicy" in patch:
            changes["soft_delete_seconds"] = patch["softDeletePolicy"]["retentionDurationSeconds"]
        self.bucket = dataclasses.replace(self.bucket, **changes)
        return self.bucket

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Iterator[ObjectInfo]:
        # GCS matchGlob as cachewarm uses it: '*' matches anything but '/'.
        pattern = re.compile(re.escape(glob).replace(r"\*", "[^/]*")) if glob is not None else None
        yield from [o for o in self.objects.values()
                    if o.name.startswith(prefix) and (pattern is None or pattern.fullmatch(o.name))]

    def set_custom_time(self, bucket: str, obj: ObjectInfo, when: dt.datetime) -> bool:
        self.stamps.append(obj.name)
        self.objects[obj.name] = dataclasses.replace(obj, custom_time=when)
        return True

    def delete_object(self, bucket: str, obj: ObjectInfo) -> None:
        self.objects.pop(obj.name, None)

    def delete_bucket(self, name: str) -> bool:
        if self.delete_bucket_conflict:
            return False
        return True


class Clock:
    """A clock that moves only when the fake GCS stamps an entry (one second each)."""

    def __init__(self, gcs: FakeGcs) -> None:
        self.gcs = gcs

    def __call__(self) -> float:
        return float(len(self.gcs.stamps))


def spec(**kw: Any) -> GcsStorage:
    return GcsStorage.model_validate({"bucket": "bk", "location": "US", "create": False, "prefix": "jax", **kw})


def unstamped_bucket(n: int) -> FakeGcs:
    return FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"),
                   [ObjectInfo(entry(i), 1, created=T0, generation=1, metageneration=1) for i in range(n)])


def test_stamping_is_bounded_in_time_and_the_rest_is_counted_and_done_later() -> None:
    gcs = unstamped_bucket(12)
    clock = Clock(gcs)
    first, _ = r.cache_inventory(gcs, spec(), clock=clock)  # type: ignore[arg-type]
    assert first == {"entries": 12, "bytes": 12, "unstamped": 12 - len(gcs.stamps)}
    assert 0 < len(gcs.stamps) <= r.STAMP_SECONDS + 1 < 12
    seen: list[int] = [first["unstamped"]]
    while seen[-1]:
        gcs.stamps.clear()
        seen.append(r.cache_inventory(gcs, spec(), clock=clock)[0]["unstamped"])  # type: ignore[arg-type]
        assert seen[-1] < seen[-2]  # every reconcile makes progress
    assert all(o.custom_time == T0 for o in gcs.objects.values())


def test_stamping_is_bounded_in_count_too(monkeypatch: Any) -> None:
    monkeypatch.setattr(r, "STAMP_LIMIT", 3)
    gcs = unstamped_bucket(5)
    out, _ = r.cache_inventory(gcs, spec(), clock=lambda: 0.0)  # type: ignore[arg-type]
    assert len(gcs.stamps) == 3 and out["unstamped"] == 2


TEAM_RULE = {"action": {"type": "Delete"}, "condition": {"age": 30}}


def claim(gcs_spec: GcsStorage, name: str = "c", created: str = "2026-01-01T00:00:00Z") -> b.Claim:
    return b.Claim.of(gcs_spec, created=created, namespace="ns", name=name)


def reconcile_cache(gcs: FakeGcs, status: dict[str, Any], others: list[b.Claim] | None = None) -> service.Outcome:
    body = {"storage": {"gcs": {"bucket": "bk", "location": "US", "create": False, "prefix": "jax",
                                "lifecycle": {"deleteAfterDays": 10}}}}
    meta = {"generation": 1, "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"}
    wiring = service.Wiring(gcs=gcs, kube=MemoryKube(), warmer_image="w",  # type: ignore[arg-type]
                            injections=RecentInjections(60), claims=lambda bucket: others or [])
    return service.reconcile_cache(wiring, service.CacheObject("ns", "c", body, meta, status), now=T0)


def lifecycle_of(status: dict[str, Any]) -> dict[str, Any]:
    return next(cd for cd in status["conditions"] if cd["type"] == "LifecycleReady")


def test_a_foreign_rule_deleting_the_caches_entries_is_named_in_lifecycle_ready_and_announced_once() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD",
                               lifecycle_rules=[{"action": {"type": "Delete"}, "condition": {"age": 9,
                                                 "matchesPrefix": ["logs/"]}}, TEAM_RULE]))
    first = reconcile_cache(gcs, {})
    lifecycle = lifecycle_of(first.status)
    assert (lifecycle["status"], lifecycle["reason"]) == ("True", "Reconciled")
    assert '#1 {"age":30}' in lifecycle["message"] and "logs/" not in lifecycle["message"]
    warned = [e for e in first.events if e.reason == "ForeignRuleDeletesEntries"]
    assert len(warned) == 1 and warned[0].type == "Warning" and '#1 {"age":30}' in warned[0].message
    assert gcs.bucket.lifecycle_rules[:2] == [gcs.bucket.lifecycle_rules[0], TEAM_RULE]  # never changed
    again = reconcile_cache(gcs, first.status)
    assert lifecycle_of(again.status)["message"] == lifecycle["message"]
    assert not [e for e in again.events if e.reason == "ForeignRuleDeletesEntries"]


def test_an_edited_copy_of_our_rule_is_named_too() -> None:
    gcs_spec = spec(lifecycle={"deleteAfterDays": 10})
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"))
    r.reconcile_bucket(gcs, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=True)  # type: ignore[arg-type]
    edited = b.canonical(gcs.bucket.lifecycle_rules[0])
    edited["condition"]["daysSinceCustomTime"] = 2  # someone edits ours: now it is theirs
    gcs.bucket = dataclasses.replace(gcs.bucket, lifecycle_rules=[edited])
    out = r.reconcile_bucket(gcs, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=False)  # type: ignore[arg-type]
    assert gcs.bucket.lifecycle_rules[0] == edited
    lifecycle = out.settings[0]
    assert lifecycle.status is True and lifecycle.reason == "Reconciled"
    assert out.foreign_deleting == [r.describe_rule(0, edited)]
    assert '"daysSinceCustomTime":2' in lifecycle.message


def test_a_bucket_with_only_unrelated_foreign_rules_reports_none() -> None:
    gcs_spec = spec(lifecycle={"deleteAfterDays": 10})
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD", lifecycle_rules=[
        {"action": {"type": "Delete"}, "condition": {"age": 9, "matchesPrefix": ["logs/"]}},
        {"action": {"type": "SetStorageClass", "storageClass": "NEARLINE"}, "condition": {"age": 30}}]))
    out = r.reconcile_bucket(gcs, gcs_spec, mine=claim(gcs_spec), claims=[], spec_changed=True)  # type: ignore[arg-type]
    assert out.foreign_deleting == [] and "not cachewarm's" not in out.settings[0].message


def test_a_cache_that_becomes_owner_of_the_bucket_settings_configures_them_it_does_not_correct_drift() -> None:
    """The bucket's creator was refused by an older cache on an overlapping prefix (which
    then owned nothing either); that cache is deleted, so the creator now owns soft delete
    and writes it for the first time: configuration, not a change made outside cachewarm."""
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD", labels=b.owner_labels("ns", "c"),
                               soft_delete_seconds=0, uniform_access=True, public_access_prevention="enforced"))
    older = b.Claim("2025-01-01T00:00:00Z", "ns", "older", "")
    first = reconcile_cache(gcs, {}, [older])
    assert gcs.patches == []
    second = reconcile_cache(gcs, first.status)  # the older cache is gone
    assert gcs.bucket.soft_delete_seconds == 7 * b.DAY
    configured = [(e.type, e.reason) for e in second.events if e.reason in ("BucketConfigured", "DriftCorrected")]
    assert configured == [("Normal", "BucketConfigured")]
    soft = next(cd for cd in second.status["conditions"] if cd["type"] == "SoftDeleteApplied")
    assert (soft["status"], soft["reason"]) == ("True", "Reconciled")
    # From now on the value is this cache's: a change made outside cachewarm is drift.
    gcs.bucket = dataclasses.replace(gcs.bucket, soft_delete_seconds=0)
    third = reconcile_cache(gcs, second.status)
    assert [(e.type, e.reason) for e in third.events] == [("Warning", "DriftCorrected")]


def test_a_refused_cache_no_longer_claims_a_lifecycle_rule() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"))
    first = reconcile_cache(gcs, {})
    assert lifecycle_of(first.status)["status"] == "True" and "deleted 10 days" in lifecycle_of(first.status)["message"]
    older = b.Claim("2025-01-01T00:00:00Z", "ns", "older", "")  # at the root: overlaps jax/
    refused = reconcile_cache(gcs, first.status, [older])
    bucket_ready = next(cd for cd in refused.status["conditions"] if cd["type"] == "BucketReady")
    assert bucket_ready["reason"] == "PrefixInUse"
    lifecycle = lifecycle_of(refused.status)
    assert (lifecycle["status"], lifecycle["reason"]) == ("False", "PrefixInUse")
    assert "deleted" not in lifecycle["message"] and "ns/older" in lifecycle["message"]


def deletable() -> FakeGcs:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD", labels=b.owner_labels("ns", "c")),
                  [ObjectInfo(entry(1), 1, generation=1)])
    return gcs


def test_a_bucket_gcs_refuses_to_delete_as_not_empty_is_kept_and_said_so() -> None:
    gcs = deletable()
    gcs.delete_bucket_conflict = True
    events = r.delete_cache_data(gcs, spec(), namespace="ns", name="c")  # type: ignore[arg-type]
    assert [e.reason for e in events] == ["DataDeleted", "BucketKept"]
    assert "not empty" in events[-1].message and "BucketNameTaken" not in {e.reason for e in events}
    gone = r.delete_cache_data(deletable(), spec(), namespace="ns", name="c")  # type: ignore[arg-type]
    assert [e.reason for e in gone] == ["DataDeleted", "BucketDeleted"]


def test_a_deletion_removes_this_caches_manifests_counts_them_apart_and_keeps_other_caches() -> None:
    ours = ["jax/.cachewarm/pools/ns/c/cpu.json", "jax/.cachewarm/pools/ns/c/h100.json"]
    others = ["jax/.cachewarm/pools/ns/c2/cpu.json", "jax/.cachewarm/pools/other/c/cpu.json",
              "jax/.cachewarm/pools/ns/c/notes.txt", "jax/notes.json"]
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"),
                  [ObjectInfo(n, 1, generation=1) for n in [entry(1), *ours, *others]])
    events = r.delete_cache_data(gcs, spec(), namespace="ns", name="c")  # type: ignore[arg-type]
    assert sorted(gcs.objects) == sorted(others)
    assert events[0].reason == "DataDeleted"
    assert events[0].message == "Deleted 1 cache objects and 2 warmer manifests under gs://bk/jax"
    # A warmer Job's pack beside its manifest (issue 30) goes with it, counted apart; another cache's stays.
    packs = ["jax/.cachewarm/pools/ns/c/cpu/c-cpu-1.json", "jax/.cachewarm/pools/ns/c/cpu/c-cpu-1.cachewarm-pack"]
    theirs = "jax/.cachewarm/pools/ns/c2/cpu/c2-cpu-1.cachewarm-pack"
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"),
                  [ObjectInfo(n, 1, generation=1) for n in [entry(1), *packs, theirs]])
    events = r.delete_cache_data(gcs, spec(), namespace="ns", name="c")  # type: ignore[arg-type]
    assert sorted(gcs.objects) == [theirs]
    assert events[0].message == "Deleted 1 cache objects and 1 warmer manifests and 1 warmer packs under gs://bk/jax"
    # Nothing to say about manifests where there were none.
    again = r.delete_cache_data(deletable(), spec(), namespace="ns", name="c")  # type: ignore[arg-type]
    assert again[0].message == "Deleted 1 cache objects under gs://bk/jax"
