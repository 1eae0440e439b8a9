"""The bucket's planners (reconcile/bucket.py: plan_create, plan_update, refused_outcome,
reconciled_outcome and the Events they lead to) as a table, without a client: a cache's
spec.storage.gcs, the bucket as read (None: absent) and the other caches on it, against the
decision (Stop, Create, Update, or refused for an overlapping prefix), the body written
(Create's settings, Update's PATCH), the Event it is announced with, and the conditions once
it is written. After every write the bucket, as GCS then holds it, is planned again and
must need no further PATCH: a repeated reconcile writes nothing.

The rule-level details (what a rule matches, ownership by label, budgets) are the builder's
and tested in test_bucket_builder.py; the reconcile's rounds against a GCS stand-in in
test_bucket_reconcile.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from cachewarm.api.bucket import BucketInfo
from cachewarm.api.model import GcsStorage, parse_spec
from cachewarm.builders import bucket as b
from cachewarm.reconcile import bucket as r

DAY = 86400
OURS = "default"  # the operator instance planning, as reconcile_bucket's default
MINE_CREATED = "2026-01-01T00:00:00Z"
OLDER = "2025-01-01T00:00:00Z"
THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}


def gcs_of(**over: Any) -> GcsStorage:
    """spec.storage.gcs of the cache ns/c, parsed as the operator parses a spec."""
    gcs = {"bucket": "bk", "location": "us-central1", "prefix": "jax", "lifecycle": {"deleteAfterDays": 10}, **over}
    return parse_spec({"storage": {"gcs": gcs}}).storage.gcs


def rule(days: int, *prefixes: str) -> dict[str, Any]:
    """cachewarm's rule as GCS should hold it (no prefixes: the bucket root)."""
    cond: dict[str, Any] = {"daysSinceCustomTime": days}
    if prefixes:
        cond["matchesPrefix"] = sorted(prefixes)
    cond["matchesSuffix"] = ["-cache", "-atime", ".cachewarm-pack"]
    return {"action": {"type": "Delete"}, "condition": cond}


R10 = rule(10, "jax/")


def record(*rules: dict[str, Any], by: str = OURS) -> dict[str, str]:
    """The labels that record rules as an operator instance's."""
    return {b.rule_label(rl): by for rl in rules}


def bucket(**kw: Any) -> BucketInfo:
    """A bucket in the spec's location, locked down, soft delete 7 days, nothing else."""
    base: dict[str, Any] = dict(name="bk", location="US-CENTRAL1", storage_class="STANDARD",
                                soft_delete_seconds=7 * DAY, uniform_access=True, public_access_prevention="enforced")
    return BucketInfo(**{**base, **kw})


CREATOR = b.owner_labels("ns", "c")  # this cache created the bucket
# This cache's rule in place and recorded, on a bucket it created: as the spec says.
AT_SPEC = bucket(labels={**CREATOR, **record(R10)}, lifecycle_rules=[THEIRS, R10])
# Another cache on the bucket, older than this one, on a prefix beside this one's.
NEIGHBOUR = b.Claim(OLDER, "ns", "n", "other", 10, 7)


@dataclass(frozen=True)
class Case:
    spec: GcsStorage
    observed: BucketInfo | None
    decision: type  # r.Stop, r.Create, r.Update, or Refused
    body: dict[str, Any] | None = None  # Create's settings or Update's PATCH; None for a Stop and a refusal
    said: tuple[str, str] | None = None  # the write's Event (type, reason); None: no write
    conditions: dict[str, tuple[bool, str]] = dataclasses.field(default_factory=dict)  # type -> (status, reason)
    others: tuple[b.Claim, ...] = ()
    settings_owned_before: bool = True
    spec_changed: bool = False
    drift: bool = False


class Refused:
    """The decision for a cache whose prefix overlaps an older cache's: manage nothing."""


READY = {"BucketReady": (True, "Reconciled"), "LifecycleReady": (True, "Reconciled")}

CASES: dict[str, Case] = {
    "absent_with_create_is_created_with_its_rule_record_and_soft_delete_in_one_call": Case(
        gcs_of(), None, r.Create,
        body={"lifecycle": {"rule": [R10]}, "labels": {**CREATOR, **record(R10)},
              "softDeletePolicy": {"retentionDurationSeconds": 7 * DAY}},
        said=("Normal", "BucketCreated"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    "absent_without_create_stops_and_creates_nothing": Case(
        gcs_of(create=False), None, r.Stop, conditions={"BucketReady": (False, "BucketNotFound")}),
    "in_another_location_is_refused_never_moved_or_patched": Case(
        gcs_of(), dataclasses.replace(AT_SPEC, location="EUROPE-WEST4", soft_delete_seconds=0), r.Stop,
        conditions={"BucketReady": (False, "LocationMismatch")}),
    "at_spec_needs_no_patch": Case(
        gcs_of(), AT_SPEC, r.Update, body={},
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    "our_rule_deleted_outside_is_restored_as_drift_and_others_rules_kept_in_place": Case(
        gcs_of(), dataclasses.replace(AT_SPEC, lifecycle_rules=[THEIRS]), r.Update,
        body={"lifecycle": {"rule": [THEIRS, R10]}}, drift=True, said=("Warning", "DriftCorrected"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    # The soft delete write would be drift (`drift`) but for the spec change: configuration.
    "a_spec_change_replaces_our_rule_and_soft_delete_as_configuration": Case(
        gcs_of(lifecycle={"deleteAfterDays": 3}, softDeleteDays=1), AT_SPEC, r.Update, spec_changed=True,
        body={"lifecycle": {"rule": [THEIRS, rule(3, "jax/")]}, "labels": {**CREATOR, **record(rule(3, "jax/"))},
              "softDeletePolicy": {"retentionDurationSeconds": 1 * DAY}},
        drift=True, said=("Normal", "BucketConfigured"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    "a_new_cache_on_the_bucket_widens_our_rule_which_is_no_drift": Case(
        gcs_of(), AT_SPEC, r.Update, others=(dataclasses.replace(NEIGHBOUR, created="2026-02-01T00:00:00Z"),),
        body={"lifecycle": {"rule": [THEIRS, rule(10, "jax/", "other/")]},
              "labels": {**CREATOR, **record(rule(10, "jax/", "other/"))}},
        said=("Normal", "BucketConfigured"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    "created_by_another_instance_is_adopted_its_rule_record_and_settings_untouched": Case(
        gcs_of(), bucket(labels={**b.owner_labels("ns", "c", "ops-b"), **record(rule(20, "b/"), by="ops-b")},
                         lifecycle_rules=[rule(20, "b/")], soft_delete_seconds=0, uniform_access=False,
                         public_access_prevention="inherited", storage_class="NEARLINE"),
        r.Update,
        body={"lifecycle": {"rule": [rule(20, "b/"), R10]},
              "labels": {**b.owner_labels("ns", "c", "ops-b"), **record(rule(20, "b/"), by="ops-b"), **record(R10)}},
        said=("Normal", "BucketConfigured"),
        conditions={"BucketReady": (True, "Reconciled"), "LifecycleReady": (True, "SharedWithOtherOperator"),
                    "SoftDeleteApplied": (False, "NotManaged")}),
    "the_settings_owner_restores_soft_delete_and_access_changed_outside_as_drift": Case(
        gcs_of(), dataclasses.replace(AT_SPEC, soft_delete_seconds=0, public_access_prevention="inherited"), r.Update,
        body={"softDeletePolicy": {"retentionDurationSeconds": 7 * DAY},
              "iamConfiguration": {"uniformBucketLevelAccess": {"enabled": True},
                                   "publicAccessPrevention": "enforced"}},
        drift=True, said=("Warning", "DriftCorrected"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    # It owned nothing before (an older overlapping cache refused it; that cache is gone): its
    # first write of soft delete is configuration (test_bucket_reconcile drives the sequence).
    "a_cache_that_just_became_the_settings_owner_writes_soft_delete_as_configuration": Case(
        gcs_of(), dataclasses.replace(AT_SPEC, soft_delete_seconds=0), r.Update, settings_owned_before=False,
        body={"softDeletePolicy": {"retentionDurationSeconds": 7 * DAY}}, said=("Normal", "BucketConfigured"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    "a_cache_that_did_not_create_the_bucket_never_writes_its_soft_delete": Case(
        gcs_of(softDeleteDays=0), bucket(labels={**b.owner_labels("ns", "n"), **record(rule(10, "jax/", "other/"))},
                                         lifecycle_rules=[rule(10, "jax/", "other/")]),
        r.Update, others=(NEIGHBOUR,), body={},
        conditions={**READY, "SoftDeleteApplied": (False, "SoftDeleteConflict")}),
    "an_adopted_buckets_soft_delete_is_its_owners_even_for_the_oldest_cache": Case(
        gcs_of(softDeleteDays=0), bucket(labels=record(R10), lifecycle_rules=[R10]), r.Update, body={},
        conditions={**READY, "SoftDeleteApplied": (False, "NotManaged")}),
    "bucket_root_without_allow_bucket_root_gets_no_rule": Case(
        gcs_of(prefix=""), bucket(labels=CREATOR), r.Update, body={},
        conditions={"BucketReady": (True, "Reconciled"), "LifecycleReady": (False, "BucketRootNotAllowed"),
                    "SoftDeleteApplied": (True, "Reconciled")}),
    "bucket_root_with_allow_bucket_root_gets_a_rule_without_a_prefix": Case(
        gcs_of(prefix="", lifecycle={"deleteAfterDays": 10, "allowBucketRoot": True}), bucket(labels=CREATOR),
        r.Update, body={"lifecycle": {"rule": [rule(10)]}, "labels": {**CREATOR, **record(rule(10))}},
        said=("Normal", "BucketConfigured"),
        conditions={**READY, "SoftDeleteApplied": (True, "Reconciled")}),
    # Refused, the cache that created the bucket no longer owns its settings either.
    "prefix_in_use_by_an_older_cache_is_refused_and_owns_nothing": Case(
        gcs_of(), AT_SPEC, Refused, others=(b.Claim(OLDER, "ns", "old", "", 10, 7, True),),
        conditions={"BucketReady": (False, "PrefixInUse"), "LifecycleReady": (False, "PrefixInUse"),
                    "SoftDeleteApplied": (True, "NotManaged")}),
    "prefix_in_use_on_an_absent_bucket_is_refused_with_no_soft_delete_verdict": Case(
        gcs_of(prefix="jax/sub"), None, Refused, others=(b.Claim(OLDER, "ns", "old", "jax", 10, 7),),
        conditions={"BucketReady": (False, "PrefixInUse"), "LifecycleReady": (False, "PrefixInUse")}),
}


def after(observed: BucketInfo, body: dict[str, Any]) -> BucketInfo:
    """The bucket as GCS holds it once `body` (a bucket_patch) is written onto it."""
    kw: dict[str, Any] = {"metageneration": observed.metageneration + 1}
    if "lifecycle" in body:
        kw["lifecycle_rules"] = body["lifecycle"]["rule"]
    if "labels" in body:
        kw["labels"] = body["labels"]
    if "softDeletePolicy" in body:
        kw["soft_delete_seconds"] = body["softDeletePolicy"]["retentionDurationSeconds"]
    if "iamConfiguration" in body:
        kw["uniform_access"] = body["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"]
        kw["public_access_prevention"] = body["iamConfiguration"]["publicAccessPrevention"]
    if "storageClass" in body:
        kw["storage_class"] = body["storageClass"]
    return dataclasses.replace(observed, **kw)


def created(gcs: GcsStorage, create: r.Create) -> BucketInfo:
    """The bucket GCS creates for a Create (clients/gcs.create_bucket: locked down, with
    the create's labels and settings)."""
    fresh = BucketInfo(name=gcs.bucket, location=gcs.location.upper(), storage_class=gcs.storage_class,
                       labels=create.labels, uniform_access=True, public_access_prevention="enforced")
    return after(fresh, {**create.settings, "labels": {**create.labels, **create.settings.get("labels", {})}})


def reasons(conds: list[Any]) -> dict[str, tuple[bool, str]]:
    return {cd.type: (cd.status, cd.reason) for cd in conds}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bucket_plan(case: Case) -> None:
    gcs = case.spec
    mine = b.Claim.of(gcs, created=MINE_CREATED, namespace="ns", name="c")
    claims = [*case.others, mine]  # reconcile_bucket plans with this cache's claim among the index's
    plan: dict[str, Any] = dict(mine=mine, claims=claims, instance=OURS)
    refused_by = b.refused_by(claims, mine)
    if refused_by is not None:
        assert case.decision is Refused
        out = r.refused_outcome(case.observed, gcs, refused_by=refused_by, **plan)
        assert reasons([out.condition, *out.settings]) == case.conditions
        assert out.events == [] and out.status == {}
        return
    observed = case.observed
    said: tuple[str, str] | None = None
    if observed is None:
        create = r.plan_create(gcs, **plan)
        assert type(create) is case.decision
        if isinstance(create, r.Stop):
            assert reasons([create.condition]) == case.conditions
            return
        assert create.labels == b.owner_labels("ns", "c")
        assert create.settings == case.body
        event = r.created_event(gcs, create.settings)
        said = (event.type, event.reason)
        observed = created(gcs, create)
    update = r.plan_update(observed, gcs, settings_owned_before=case.settings_owned_before, **plan)
    if isinstance(update, r.Stop):
        assert case.decision is r.Stop
        assert reasons([update.condition]) == case.conditions
        assert update.status["location"] == observed.location  # status still says where it is
        return
    assert type(update) is r.Update and case.decision in (r.Update, r.Create)
    if case.decision is r.Update:
        assert update.patch == case.body and update.drift is case.drift
        if update.patch:
            event = r.patched_event(gcs, update, configuration=case.spec_changed)
            said = (event.type, event.reason)
        observed = after(observed, update.patch)
    else:
        assert update.patch == {}  # the settings went in with the create: nothing left to patch
    assert said == case.said
    again = r.plan_update(observed, gcs, settings_owned_before=True, **plan)
    assert isinstance(again, r.Update) and again.patch == {}  # converged: a repeat writes nothing
    out = r.reconciled_outcome(observed, gcs, lifecycle=again.lifecycle, events=[], inventory=None, **plan)
    assert reasons([out.condition, *out.settings]) == case.conditions
