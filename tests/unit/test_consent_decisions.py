"""Bucket consent (builders/bucket.py consent, reconcile/bucket.py not_granted): the operator
acts on a bucket for a namespace only when cachewarm created it for that namespace or its owner
put a grant label for the namespace, the operator instance and the prefix (or one above it) on
it. Pure decisions and the reconcile against an in-memory bucket; the same through the operator,
a real apiserver and the GCS emulator is tests/e2e/test_bucket_consent.py."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from cachewarm.api import constants as c
from cachewarm.api.bucket import BucketInfo
from cachewarm.api.model import GcsStorage
from cachewarm.builders import bucket as b
from cachewarm.clients.gcs import ObjectInfo
from cachewarm.reconcile import bucket as r
from cachewarm.reconcile.status import STALLED_BUCKET
from test_bucket_reconcile import T0, FakeGcs, entry


def bucket(**labels: str) -> BucketInfo:
    return BucketInfo(name="bk", location="US-CENTRAL1", storage_class="STANDARD", labels=labels)


def test_the_grant_label_is_a_valid_gcs_label_naming_instance_namespace_and_prefix() -> None:
    key, value = b.grant_label("team-a", "llama/8b", "prod")
    digest = hashlib.sha256(b"prod/team-a/llama/8b").hexdigest()[:16]
    assert (key, value) == (f"cachewarm-grant-{digest}", "team-a")
    assert len(key) <= 63 and key == key.lower()
    # Each of the three changes the key: a grant names one cluster, one namespace, one prefix.
    assert len({b.grant_label("team-a", "llama/8b", "prod")[0], b.grant_label("team-b", "llama/8b", "prod")[0],
                b.grant_label("team-a", "llama", "prod")[0], b.grant_label("team-a", "llama/8b", "dev")[0]}) == 4


def test_covering_prefixes_run_from_the_prefix_to_the_root() -> None:
    assert b.covering_prefixes("a/b/c") == ["a/b/c", "a/b", "a", ""]
    assert b.covering_prefixes("") == [""]


@pytest.mark.parametrize(("labels", "namespace", "prefix", "granted"), [
    # A grant at the prefix, above it, or for the whole bucket covers it.
    ({"at": "jax/llama"}, "team-a", "jax/llama", True),
    ({"at": "jax"}, "team-a", "jax/llama", True),
    ({"at": ""}, "team-a", "jax/llama", True),
    # Below it, beside it, or a prefix that only starts with the same letters: not.
    ({"at": "jax/llama/8b"}, "team-a", "jax/llama", False),
    ({"at": "jax/gemma"}, "team-a", "jax/llama", False),
    ({"at": "ja"}, "team-a", "jax/llama", False),
    # Another namespace's grant, or one whose value someone changed, grants nothing.
    ({"at": "jax", "for": "team-b"}, "team-a", "jax/llama", False),
    ({"at": "jax", "value": "team-b"}, "team-a", "jax/llama", False),
    # Another operator instance's (another cluster's) grant: not this one's.
    ({"at": "jax", "instance": "other"}, "team-a", "jax/llama", False),
    ({}, "team-a", "jax/llama", False),
])
def test_consent_by_grant_label(labels: dict[str, str], namespace: str, prefix: str, granted: bool) -> None:
    key, value = b.grant_label(labels.get("for", namespace), labels["at"], labels.get("instance", "default")) \
        if "at" in labels else ("unrelated", "x")
    seen = b.consent(bucket(**{key: labels.get("value", value)}), namespace, prefix)
    assert (seen is not None) is granted, seen


def test_a_bucket_cachewarm_created_is_its_namespaces_whole_and_no_one_elses() -> None:
    made = bucket(**b.owner_labels("team-b", "cache-1", "default"))
    assert b.consent(made, "team-b", "anything/at/all") is not None
    assert b.consent(made, "team-a", "anything/at/all") is None
    # Made by another operator instance (cluster) for a namespace of the same name: not ours.
    assert b.consent(bucket(**b.owner_labels("team-b", "cache-1", "other")), "team-b", "x") is None
    # Made before instances existed (no instance label): the default instance's.
    legacy = {k: v for k, v in b.owner_labels("team-b", "c", "default").items() if k != c.GCS_LABEL_INSTANCE}
    assert b.consent(bucket(**legacy), "team-b", "x") is not None


def test_only_granted_caches_count_on_the_bucket() -> None:
    mine = b.Claim("2026-02-01T00:00:00Z", "team-b", "llama", "jax")
    squatter = b.Claim("2026-01-01T00:00:00Z", "team-a", "early", "jax")  # older, same prefix, not granted
    granted = bucket(**dict([b.grant_label("team-b", "jax")]))
    assert b.granted_claims(granted, [mine, squatter]) == [mine]
    # So the older squatter refuses no one, and puts no rule on the bucket.
    assert b.refused_by(b.granted_claims(granted, [mine, squatter]), mine) is None
    plan = b.plan_lifecycle(b.granted_claims(granted, [mine, squatter]), 10)
    assert set(plan.rule_of) == {mine.key}


def spec(**kw: Any) -> GcsStorage:
    return GcsStorage.model_validate({"bucket": "bk", "location": "US", "create": False, "prefix": "jax", **kw})


def test_without_consent_nothing_is_written_stamped_listed_or_reported() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD", soft_delete_seconds=0),
                  [ObjectInfo(entry(1), 5, created=T0, generation=1, metageneration=1)], granted_to="team-b")
    listed: list[str] = []
    gcs.list_objects = lambda *a, **k: listed.append("listed") or iter(())  # type: ignore[method-assign]
    mine = b.Claim("2026-01-01T00:00:00Z", "team-a", "thief", "jax")
    out = r.reconcile_bucket(gcs, spec(), mine=mine, claims=[], spec_changed=True,  # type: ignore[arg-type]
                             instance="default", take_inventory=True)
    assert (out.condition.status, out.condition.reason) == (False, c.Reason.BUCKET_NOT_GRANTED)
    key, value = b.grant_label("team-a", "jax")
    assert f"{key}={value}" in out.condition.message and "gcloud storage buckets update gs://bk" in out.condition.message
    assert "US" not in out.condition.message  # not the bucket's location
    assert gcs.patches == [] and gcs.stamps == [] and listed == []
    assert out.status == {} and out.cache is None and out.entry_keys is None and out.withheld
    assert {s.reason for s in out.settings} == {c.Reason.BUCKET_NOT_GRANTED}
    assert c.Reason.BUCKET_NOT_GRANTED in STALLED_BUCKET


def test_a_grant_makes_the_same_reconcile_manage_the_prefix_and_its_removal_stops_it() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"), granted_to=None)
    mine = b.Claim.of(spec(), created="2026-01-01T00:00:00Z", namespace="team-a", name="c")
    key, value = b.grant_label("team-a", "jax")
    gcs.bucket = dataclasses.replace(gcs.bucket, labels={key: value})
    out = r.reconcile_bucket(gcs, spec(), mine=mine, claims=[], spec_changed=True)  # type: ignore[arg-type]
    assert out.ready and len(gcs.patches) == 1 and "lifecycle" in gcs.patches[0]
    # The owner removes the label: the next reconcile writes nothing more (not even to take
    # cachewarm's rule off: that is the owner's bucket now, see docs).
    gcs.bucket = dataclasses.replace(gcs.bucket, labels={k: v for k, v in gcs.bucket.labels.items() if k != key})
    again = r.reconcile_bucket(gcs, spec(lifecycle={"deleteAfterDays": 3}), mine=mine, claims=[],  # type: ignore[arg-type]
                               spec_changed=True)
    assert again.condition.reason == c.Reason.BUCKET_NOT_GRANTED and len(gcs.patches) == 1


def test_deletion_deletes_nothing_in_a_bucket_not_granted() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"),
                  [ObjectInfo(entry(1), 5, created=T0, generation=1, metageneration=1)], granted_to="team-b")
    events = r.delete_cache_data(gcs, spec(deletionPolicy="Delete"), namespace="team-a",  # type: ignore[arg-type]
                                 name="thief")
    assert [e.reason for e in events] == [c.Reason.DATA_RETAINED] and entry(1) in gcs.objects


def test_a_cache_not_granted_keeps_no_one_elses_data_from_deletion() -> None:
    gcs = FakeGcs(b.BucketInfo(name="bk", location="US", storage_class="STANDARD"),
                  [ObjectInfo(entry(1), 5, created=T0, generation=1, metageneration=1)], granted_to="team-b")
    squatter = b.Claim("2026-01-01T00:00:00Z", "team-a", "same", "jax")
    events = r.delete_cache_data(gcs, spec(deletionPolicy="Delete"), namespace="team-b",  # type: ignore[arg-type]
                                 name="owner", sharers=[squatter])
    assert c.Reason.DATA_DELETED in [e.reason for e in events] and entry(1) not in gcs.objects


LIMITS = b.CreationLimits(frozenset({"US-CENTRAL1"}), frozenset({"STANDARD"}), 2)


@pytest.mark.parametrize(("fields", "count", "names"), [
    ({"location": "europe-west4"}, 0, "CACHEWARM_BUCKET_LOCATIONS: US-CENTRAL1"),
    ({"storageClass": "ARCHIVE"}, 0, "CACHEWARM_BUCKET_STORAGE_CLASSES: STANDARD"),
    ({}, 2, "CACHEWARM_BUCKETS_PER_NAMESPACE: 2"),
])
def test_creation_outside_the_admins_limits_is_refused_with_the_rule(fields: dict[str, str], count: int,
                                                                     names: str) -> None:
    wanted = spec(**{"create": True, "location": "us-central1", **fields})
    mine = b.Claim.of(wanted, created="2026-01-01T00:00:00Z", namespace="team-a", name="c")
    out = r.plan_create(wanted, mine=mine, claims=[mine], instance="default", limits=LIMITS,
                        created_in_namespace=count)
    assert isinstance(out, r.Stop) and out.condition.reason == c.Reason.CREATION_NOT_ALLOWED, out
    assert names in out.condition.message


def test_creation_within_the_limits_is_planned() -> None:
    wanted = spec(create=True, location="us-central1")  # any case: GCS reports locations upper-case
    mine = b.Claim.of(wanted, created="2026-01-01T00:00:00Z", namespace="team-a", name="c")
    assert isinstance(r.plan_create(wanted, mine=mine, claims=[mine], instance="default", limits=LIMITS,
                                    created_in_namespace=1), r.Create)
    assert b.creation_refusal(wanted, b.CreationLimits(per_namespace=0), None) is not None


class Listing:
    listings = 0

    def list_bucket_labels(self) -> Any:
        self.listings += 1
        yield "a", b.owner_labels("team-a", "c1", "default")
        yield "b", b.owner_labels("team-a", "c2", "other")  # another cluster's
        yield "c", b.owner_labels("team-b", "c3", "default")
        yield "d", {**dict([b.grant_label("team-a", "")])}  # granted, not created
        yield "e", b.owner_labels("team-a", "c4", "default")
        legacy = {k: v for k, v in b.owner_labels("team-a", "c5").items() if k != c.GCS_LABEL_INSTANCE}
        yield "f", legacy  # created before instances existed: the default instance's


def test_the_count_is_of_this_namespaces_buckets_made_by_this_operator_listed_once_a_while() -> None:
    now = [0.0]
    gcs = Listing()
    counts = r.CreatedCounts(ttl=60, clock=lambda: now[0])
    assert counts.count(gcs, "team-a", "default") == 3  # type: ignore[arg-type]
    assert counts.count(gcs, "team-a", "other") == 1  # type: ignore[arg-type]
    assert counts.count(gcs, "team-b", "default") == 1 and gcs.listings == 1  # type: ignore[arg-type]
    counts.created("team-a", "default")  # made by this process since the listing
    assert counts.count(gcs, "team-a", "default") == 4 and gcs.listings == 1  # type: ignore[arg-type]
    now[0] = 61.0  # listed again: the bucket made above is not in this fake's listing
    assert counts.count(gcs, "team-a", "default") == 3 and gcs.listings == 2  # type: ignore[arg-type]


def test_the_cli_prints_the_label_the_operator_asks_for() -> None:
    from click.testing import CliRunner

    from cachewarm.cli.main import cli

    done = CliRunner().invoke(cli, ["grant", "gs://bkt/jax/", "-n", "team-a"])
    assert done.exit_code == 0, done.output
    refused = r.not_granted(bucket(), spec(bucket="bkt"), mine=b.Claim("t", "team-a", "c", "jax"), instance="default")
    assert refused is not None
    label, command = done.output.splitlines()
    assert f"--update-labels={label}" in refused.condition.message
    assert command == f"gcloud storage buckets update gs://bkt --update-labels={label}"
    assert f"`{command}`" in refused.condition.message


@pytest.mark.parametrize(("args", "says"), [
    (["grant", "gs://bk/jax", "-n", "Team_A"], "not a namespace name"),
    (["grant", "gs://bk/jax", "-n", "team-a", "--instance", "Prod"], "not an operator instance name"),
    (["grant", "s3://bk/jax", "-n", "team-a"], "not a gs://BUCKET[/PREFIX] URL"),
    (["grant", "gs://bk/jax"], "Missing option '-n' / '--namespace'"),
])
def test_the_cli_refuses_a_wrong_grant_with_what_is_wrong(args: list[str], says: str) -> None:
    from click.testing import CliRunner

    from cachewarm.cli.main import cli

    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 2 and says in done.output, done.output


def test_a_new_bucket_is_made_with_no_rule_of_another_namespaces_cache() -> None:
    wanted = spec(create=True, prefix="b")
    mine = b.Claim.of(wanted, created="2026-02-01T00:00:00Z", namespace="team-b", name="c")
    squatter = b.Claim("2026-01-01T00:00:00Z", "team-a", "early", "", delete_after_days=1, allow_bucket_root=True)
    made = r.plan_create(wanted, mine=mine, claims=[squatter, mine], instance="default")
    assert isinstance(made, r.Create)
    assert made.settings["lifecycle"]["rule"] == [b.last_use_rule(30, ["b/"])]


def test_a_created_buckets_storage_class_is_changed_only_to_one_the_admin_allows() -> None:
    made = dataclasses.replace(bucket(**b.owner_labels("team-a", "c")), storage_class="STANDARD")
    mine = b.Claim("2026-01-01T00:00:00Z", "team-a", "c", "jax")
    out = r.plan_update(made, spec(storageClass="ARCHIVE", location="us-central1"), mine=mine, claims=[mine],
                        instance="default", settings_owned_before=True, limits=LIMITS)
    assert isinstance(out, r.Stop) and out.condition.reason == c.Reason.CREATION_NOT_ALLOWED
    assert "CACHEWARM_BUCKET_STORAGE_CLASSES: STANDARD" in out.condition.message
    fine = r.plan_update(made, spec(storageClass="ARCHIVE", location="us-central1"), mine=mine, claims=[mine],
                         instance="default", settings_owned_before=True)  # no limits: as asked
    assert isinstance(fine, r.Update) and fine.patch["storageClass"] == "ARCHIVE"


def test_a_patch_never_changes_the_labels_that_give_consent() -> None:
    key, value = b.grant_label("team-a", "jax")
    granted = bucket(**{key: value})
    mine = b.Claim("2026-01-01T00:00:00Z", "team-a", "c", "jax")
    plan = b.plan_lifecycle([mine], 10)
    patch = b.bucket_patch(granted, spec(), plan=plan, owns_settings=False, created_by_us=False)
    assert patch["labels"][key] == value  # sent back as read
    with pytest.raises(ValueError, match="consent labels"):
        b._consent_labels_unchanged(granted, {**patch["labels"], key: "team-b"})
    with pytest.raises(ValueError, match="consent labels"):
        b._consent_labels_unchanged(granted, {k: v for k, v in patch["labels"].items() if k != key})


def test_the_refusal_of_a_bucket_cachewarm_made_sends_the_user_to_the_projects_admin() -> None:
    made = bucket(**b.owner_labels("team-b", "c"))
    out = r.not_granted(made, spec(), mine=b.Claim("t", "team-a", "c", "jax"), instance="default")
    assert out is not None and "An admin of the operator's GCP project" in out.condition.message
