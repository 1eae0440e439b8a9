"""The bucket builder: cachewarm's lifecycle rules (what they can match, how caches share
them, which rules are ours), bucket-wide settings ownership, and the smallest patch."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachewarm.api import constants as c
from cachewarm.builders import bucket as b
from cachewarm.builders import placement
from cachewarm.api.model import GcsStorage
from cachewarm_testbed import lifecycle_eval as ev

DAY = 86400
HASH = "0f" * 32
NOW = dt.datetime(2026, 11, 22, tzinfo=dt.timezone.utc)


def spec(**kw: Any) -> GcsStorage:
    return GcsStorage.model_validate({"bucket": "cache", "location": "us-central1", **kw})


def info(**kw: Any) -> b.BucketInfo:
    base: dict[str, Any] = dict(name="cache", location="US-CENTRAL1", storage_class="STANDARD",
                                soft_delete_seconds=7 * DAY, uniform_access=True, public_access_prevention="enforced")
    base.update(kw)
    return b.BucketInfo(**base)


def claim(name: str, prefix: str = "", days: int = 30, created: str | None = None, soft: int = 7,
          root: bool = False) -> b.Claim:
    return b.Claim(created or f"2026-01-01T00:00:{name[-1] if name[-1].isdigit() else '0'}0Z", "ns", name,
                   prefix, days, soft, root)


def plan(*claims: b.Claim, budget: int = 100) -> b.LifecyclePlan:
    return b.plan_lifecycle(claims, budget)


def ours(days: int, *prefixes: str) -> dict[str, Any]:
    cond: dict[str, Any] = {"daysSinceCustomTime": days}
    if prefixes:
        cond["matchesPrefix"] = sorted(prefixes)
    cond["matchesSuffix"] = ["-cache", "-atime", ".cachewarm-pack"]
    return {"action": {"type": "Delete"}, "condition": cond}


THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}
CLASS_RULE = {"action": {"type": "SetStorageClass", "storageClass": "NEARLINE"}, "condition": {"age": 30}}
# A team's own rule shaped exactly like cachewarm's, never recorded in the labels.
LOOKALIKE = ours(11, "llama/")


def labelled(*rules: dict[str, Any]) -> dict[str, str]:
    return {b.rule_label(r): "default" for r in rules}


# --- rules match only JAX entries -------------------------------------------------------

def test_rule_scopes_by_prefix_and_jax_suffixes_and_counts_from_custom_time() -> None:
    assert plan(claim("a1", "llama", 10)).rules == [ours(10, "llama/")]
    assert plan(claim("a1", "a/b")).rules == [ours(30, "a/b/")]
    assert plan(claim("a1", "", 4, root=True)).rules == [ours(4)]


def test_bucket_root_needs_explicit_permission() -> None:
    refused = plan(claim("a1", ""))
    assert refused.rules == [] and refused.root_not_allowed == {("ns", "a1")}


PREFIXES = st.lists(st.text(alphabet="abc-._", min_size=1, max_size=4), min_size=0, max_size=3).map("/".join)
NAMES = st.text(alphabet=string.ascii_lowercase[:4] + string.digits[:3] + "-/._" + "cahtime", max_size=40)


def jax_entry(prefix: str, module: str, suffix: str) -> str:
    return f"{prefix}/{module}-{HASH}{suffix}" if prefix else f"{module}-{HASH}{suffix}"


def names_near(*prefixes: str) -> st.SearchStrategy[str]:
    """Object names, many of them built to sit at the edge of the rules: under one of the
    prefixes or not, ending in -cache/-atime or almost."""
    heads = st.sampled_from([*prefixes, "", "/", "x/"])
    tails = st.sampled_from(["", "-cache", "-atime", "cache", "-cache/", "-cache.tmp", "-ATIME", f"-{HASH}-cache"])
    return st.one_of(NAMES, st.tuples(heads, NAMES, tails).map("".join))


@settings(max_examples=500, deadline=None)
@given(prefix=PREFIXES, data=st.data(), module=st.text(alphabet="abc_", min_size=1, max_size=8),
       suffix=st.sampled_from(["-cache", "-atime"]))
def test_property_rules_match_only_entry_shaped_names_under_a_cache_prefix(prefix: str, data: st.DataObject,
                                                                            module: str, suffix: str) -> None:
    """For any prefix (the root included) and any object name: a rule cachewarm wrote can
    act on the name only if the name lies under the prefix of a cache on the bucket and
    ends in -cache or -atime; every JAX entry of the cache matches exactly one rule.

    What GCS cannot express (its name conditions are plain prefix/suffix tests) and this
    test therefore does not claim: that such a name is a JAX entry (no '/' after the
    prefix, 64 hex digits). That is why a rule at the bucket root needs allowBucketRoot
    (README, "Bucket")."""
    caches = [claim("a1", prefix, 5, root=True), claim("z9", "zz-other", 5), claim("y8", "yy-other", 9)]
    p = plan(*caches)
    under = [cl.object_prefix for cl in b.active(caches)]
    name = data.draw(names_near(*under, f"{prefix}x"))
    for rule in ev.rules_matching_name(p.rules, name):
        assert name.endswith(("-cache", "-atime")) and name.startswith(tuple(under)), (rule, name)
    matched = ev.rules_matching_name(p.rules, jax_entry(prefix, module, suffix))
    assert matched == [p.rule_of[("ns", "a1")]]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_names_outside_every_prefix_never_match(data: st.DataObject) -> None:
    rules = plan(claim("a1", "jax", 5), claim("b2", "team/cache", 5), claim("c3", "x", 7)).rules
    name = data.draw(names_near("jax/", "team/cache/", "x/", "jax", "team/", "jaxx/"))
    inside = name.startswith(("jax/", "team/cache/", "x/")) and name.endswith(("-cache", "-atime"))
    assert bool(ev.rules_matching_name(rules, name)) is inside


def test_entries_expire_by_last_use_not_by_creation() -> None:
    rules = plan(claim("a1", "p", 10)).rules
    created = NOW - dt.timedelta(days=400)
    hot = ev.ObjectState(jax_entry("p", "jit_step", "-cache"), created, custom_time=NOW - dt.timedelta(days=2))
    cold = ev.ObjectState(jax_entry("p", "jit_old", "-cache"), created, custom_time=NOW - dt.timedelta(days=11))
    unstamped = ev.ObjectState(jax_entry("p", "jit_new", "-cache"), created)
    assert not ev.deletes(rules, hot, NOW)
    assert ev.deletes(rules, cold, NOW)
    assert not ev.deletes(rules, unstamped, NOW)  # until the operator stamps it (reconcile)
    assert not ev.deletes(rules, ev.ObjectState("p/notes.txt", created), NOW)


# --- caches sharing a bucket ----------------------------------------------------------------

@pytest.mark.parametrize(("a", "b_", "overlap"), [
    ("", "x/", True), ("a/", "a/b/", True), ("a/", "a/", True), ("a/", "ab/", False), ("a/b/", "a/c/", False),
])
def test_overlap_is_by_object_prefix(a: str, b_: str, overlap: bool) -> None:
    assert b.overlaps(a, b_) is overlap and b.overlaps(b_, a) is overlap


def test_newer_overlapping_caches_are_inactive_and_share_nothing() -> None:
    old, nested, sibling = claim("a1", "team"), claim("b2", "team/x"), claim("c3", "teamx")
    assert b.active([nested, sibling, old]) == [old, sibling]
    assert plan(old, nested, sibling).rules == [ours(30, "team/", "teamx/")]
    assert b.refused_by([old, nested, sibling], nested) == old
    assert b.refused_by([old, nested, sibling], sibling) is None


def test_a_refused_cache_blocks_nobody() -> None:
    first, root, later = claim("a1", "team"), claim("b2", ""), claim("c3", "other")
    assert b.active([first, root, later]) == [first, later]
    assert b.refused_by([first, root, later], root) == first
    assert b.refused_by([first, root, later], later) is None


def test_caches_with_the_same_age_share_one_rule() -> None:
    p = plan(claim("a1", "a", 10), claim("b2", "b", 10), claim("c3", "c", 3))
    assert p.rules == [ours(3, "c/"), ours(10, "a/", "b/")]
    assert p.rule_of[("ns", "b2")] == ours(10, "a/", "b/")


def test_rule_limit_leaves_out_the_newest_groups() -> None:
    p = plan(claim("a1", "a", 1), claim("b2", "b", 2), claim("c3", "c", 3), claim("d4", "d", 1), budget=2)
    assert p.rules == [ours(1, "a/", "d/"), ours(2, "b/")]
    assert p.over_limit == {("ns", "c3")}


def test_one_namespace_holds_at_most_four_distinct_rules_on_a_bucket() -> None:
    mine = [b.Claim(f"2026-01-0{i}T00:00:00Z", "team-a", f"a{i}", f"a{i}", delete_after_days=i) for i in range(1, 7)]
    theirs = b.Claim("2026-02-01T00:00:00Z", "team-b", "b", "b", delete_after_days=30)
    again = b.Claim("2026-03-01T00:00:00Z", "team-a", "again", "again", delete_after_days=2)  # shares a rule
    p = b.plan_lifecycle([*mine, theirs, again], budget=50)
    assert p.over_namespace_limit == {("team-a", "a5"), ("team-a", "a6")}
    assert set(p.rule_of) == {("team-a", f"a{i}") for i in range(1, 5)} | {("team-b", "b"), ("team-a", "again")}
    assert len(p.rules) == 5


def test_budget_counts_foreign_rules_and_labels() -> None:
    bucket = info(lifecycle_rules=[THEIRS] * 3, labels={"team": "x", **labelled(ours(5, "p/"))})
    # GCS's 64 labels, less the others' one and the 8 always left to the owner (for a grant).
    assert b.rule_budget(bucket) == min(100 - 3, 64 - 8 - 1)
    many = info(labels={f"l{i}": "v" for i in range(52)})
    assert b.rule_budget(many) == 4
    assert b.rule_budget(info(labels={f"l{i}": "v" for i in range(56)})) == 0


def test_settings_owner_is_the_creator_and_nobody_on_an_adopted_bucket() -> None:
    old, new = claim("a1", "a"), claim("b2", "b")
    assert b.settings_owner([old, new], info(labels=b.owner_labels("ns", "b2"))) == new
    # Adopted: the oldest cache is no owner of the team's soft delete.
    assert b.settings_owner([old, new], info()) is None
    assert b.settings_owner([old], info(labels=b.owner_labels("ns", "gone"))) is None


# --- ownership: recorded, never guessed ------------------------------------------------------

def test_lookalike_rule_is_kept_and_ours_is_added_and_recorded() -> None:
    p = plan(claim("a1", "llama", 10))
    bucket = info(lifecycle_rules=[LOOKALIKE, THEIRS])
    patch = b.lifecycle_patch(bucket, p)
    assert patch["lifecycle"]["rule"] == [LOOKALIKE, THEIRS, ours(10, "llama/")]
    assert patch["labels"] == labelled(ours(10, "llama/"))
    after = info(lifecycle_rules=patch["lifecycle"]["rule"], labels=patch["labels"])
    assert b.lifecycle_patch(after, p) == {}
    assert b.split_rules(after) == ([LOOKALIKE, THEIRS], [ours(10, "llama/")])


def test_our_recorded_rules_are_replaced_in_place_of_the_block_and_others_keep_their_order() -> None:
    old = ours(3, "llama/")
    bucket = info(lifecycle_rules=[CLASS_RULE, old, THEIRS], labels={"team": "x", **labelled(old)})
    patch = b.lifecycle_patch(bucket, plan(claim("a1", "llama", 10)))
    assert patch["lifecycle"]["rule"] == [CLASS_RULE, THEIRS, ours(10, "llama/")]
    assert patch["labels"] == {"team": "x", **labelled(ours(10, "llama/"))}


def test_foreign_rules_are_kept_as_gcs_returned_them() -> None:
    odd = {"action": {"type": "Delete"}, "condition": {"age": "10", "matchesPrefix": ["llama/"], "isLive": False}}
    patch = b.lifecycle_patch(info(lifecycle_rules=[odd]), plan(claim("a1", "llama", 10)))
    assert patch["lifecycle"]["rule"][0] == odd


def test_string_ages_from_gcs_compare_equal() -> None:
    as_returned = {"action": {"type": "Delete"}, "condition": {
        "daysSinceCustomTime": "10", "matchesPrefix": ["llama/"], "matchesSuffix": ["-cache", "-atime", ".cachewarm-pack"]}}
    bucket = info(lifecycle_rules=[as_returned], labels=labelled(ours(10, "llama/")))
    assert b.lifecycle_patch(bucket, plan(claim("a1", "llama", 10))) == {}
    assert b.observed_delete_after_days(bucket, claim("a1", "llama", 10)) == 10


def test_an_edited_rule_of_ours_is_no_longer_ours() -> None:
    edited = ours(99, "llama/")  # someone changed our 10 to 99; its label no longer fits
    bucket = info(lifecycle_rules=[edited], labels=labelled(ours(10, "llama/")))
    assert b.split_rules(bucket) == ([edited], [])
    assert b.observed_delete_after_days(bucket, claim("a1", "llama")) is None


def test_a_bucket_with_rules_the_library_cannot_read_is_never_rewritten() -> None:
    bucket = info(lifecycle_rules=[THEIRS], unreadable_rules=1)
    assert b.lifecycle_patch(bucket, plan(claim("a1", "llama", 10))) == {}


def test_drift_is_a_change_to_what_cachewarm_recorded_not_a_new_cache_on_the_bucket() -> None:
    mine = ours(10, "a/")
    at_rest = info(lifecycle_rules=[THEIRS, mine], labels=labelled(mine))
    new_cache = plan(claim("a1", "a", 10), claim("b2", "b", 10))
    assert not b.changed_outside(at_rest, b.lifecycle_patch(at_rest, new_cache))
    removed = info(lifecycle_rules=[THEIRS], labels=labelled(mine))  # someone deleted our rule
    assert b.changed_outside(removed, b.lifecycle_patch(removed, plan(claim("a1", "a", 10))))
    assert b.changed_outside(at_rest, {"softDeletePolicy": {"retentionDurationSeconds": 0}})


def test_no_cache_left_removes_our_rules_and_labels_only() -> None:
    mine = ours(10, "llama/")
    bucket = info(lifecycle_rules=[THEIRS, mine], labels={"team": "x", **labelled(mine)})
    assert b.lifecycle_patch(bucket, plan()) == {"lifecycle": {"rule": [THEIRS]}, "labels": {"team": "x"}}


# --- the whole patch ---------------------------------------------------------------------------

def test_bucket_at_spec_needs_no_patch() -> None:
    rule = ours(10, "llama/")
    bucket = info(lifecycle_rules=[THEIRS, rule], labels=labelled(rule))
    assert b.bucket_patch(bucket, spec(prefix="llama"), plan=plan(claim("a1", "llama", 10)),
                          owns_settings=True, created_by_us=True) == {}


def test_only_the_settings_owner_writes_soft_delete() -> None:
    rule = ours(10, "llama/")
    bucket = info(lifecycle_rules=[rule], labels=labelled(rule))
    gcs = spec(prefix="llama", softDeleteDays=0)
    p = plan(claim("a1", "llama", 10))
    assert b.bucket_patch(bucket, gcs, plan=p, owns_settings=True, created_by_us=True) == {
        "softDeletePolicy": {"retentionDurationSeconds": 0}}
    assert b.bucket_patch(bucket, gcs, plan=p, owns_settings=False, created_by_us=True) == {}
    # An adopted bucket's soft delete is never written, whoever claims it.
    assert b.bucket_patch(bucket, gcs, plan=p, owns_settings=True, created_by_us=False) == {}


def test_access_and_class_are_managed_only_on_buckets_cachewarm_created() -> None:
    gcs = spec(prefix="llama", storageClass="NEARLINE")
    loose = info(uniform_access=False, public_access_prevention="inherited")
    kw: dict[str, Any] = dict(plan=plan(), owns_settings=False)
    assert b.bucket_patch(loose, gcs, created_by_us=False, **kw) == {}
    assert b.bucket_patch(loose, gcs, created_by_us=True, **kw) == {
        "iamConfiguration": {"uniformBucketLevelAccess": {"enabled": True}, "publicAccessPrevention": "enforced"},
        "storageClass": "NEARLINE",
    }


def test_location_compares_case_insensitively() -> None:
    assert b.location_matches(info(location="US-CENTRAL1"), spec(location="us-central1"))
    assert not b.location_matches(info(location="EUROPE-WEST4"), spec(location="us-central1"))


def test_created_by_needs_every_owner_label() -> None:
    labels = b.owner_labels("team-a", "llama")
    assert b.created_by(info(labels=labels), "team-a", "llama")
    assert not b.created_by(info(labels=labels), "team-b", "llama")
    assert not b.created_by(info(labels={"managed-by": "cachewarm"}), "team-a", "llama")


def test_rule_labels_are_valid_gcs_label_keys() -> None:
    label = b.rule_label(ours(10, "a/"))
    assert label.startswith(c.GCS_LABEL_RULE_PREFIX) and len(label) <= 63
    assert set(label) <= set(string.ascii_lowercase + string.digits + "-_")


@pytest.mark.parametrize(("name", "entry"), [
    ("llama/jit_step-" + HASH + "-cache", True),
    ("llama/jit_step-" + HASH + "-atime", True),
    ("llama/notes.txt", False),
    ("llama/sub/jit_step-" + HASH + "-cache", False),
    ("llama-old/jit_step-" + HASH + "-cache", False),
    ("llama/jit_step-" + "0F" * 32 + "-cache", False),
    ("llama/jit_step-" + "0f" * 31 + "-cache", False),
])
def test_only_jax_entries_under_the_prefix_count_as_cache_entries(name: str, entry: bool) -> None:
    assert b.is_cache_entry(name, spec(prefix="llama")) is entry


# --- what a deletion (deletionPolicy Delete) may remove: entries and the cache's manifests ----

def deletes(object_name: str, gcs: GcsStorage, namespace: str, name: str) -> bool:
    """What reconcile.delete_cache_data removes under the prefix it lists."""
    return b.is_cache_entry(object_name, gcs) or b.is_own_manifest(object_name, gcs, namespace, name)


def manifest_folder(prefix: str, namespace: str, name: str) -> str:
    """The folder of a cache's manifests, as written down for users (not computed by the
    code under test)."""
    return f"{prefix}/.cachewarm/pools/{namespace}/{name}/" if prefix else f".cachewarm/pools/{namespace}/{name}/"


POOL_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")


@pytest.mark.parametrize(("object_name", "deleted"), [
    ("llama/.cachewarm/pools/ns/c/h100.json", True),
    ("llama/.cachewarm/pools/ns/c/v5p-16.json", True),
    ("llama/.cachewarm/pools/ns/other/h100.json", False),  # another cache, same prefix
    ("llama/.cachewarm/pools/team-b/c/h100.json", False),  # same name, another namespace
    ("other/.cachewarm/pools/ns/c/h100.json", False),  # another prefix
    (".cachewarm/pools/ns/c/h100.json", False),  # a cache of the same name at the bucket root
    ("llama/x/.cachewarm/pools/ns/c/h100.json", False),
    ("llama/.cachewarm/pools/ns/c/h100/c-h100-0123abcd.json", True),  # one per warmer Job
    ("llama/.cachewarm/pools/ns/c/sub/h100.json", True),  # pool "sub", Job "h100"
    ("llama/.cachewarm/pools/ns/c/sub/x/h100.json", False),
    ("llama/.cachewarm/pools/ns/other/h100/c-h100-1.json", False),  # another cache's Job
    ("llama/.cachewarm/pools/ns/c/h100/C-h100.json", False),
    ("llama/.cachewarm/pools/ns/c/h100/-j.json", False),
    ("llama/.cachewarm/pools/ns/c/h100/.json", False),
    ("llama/.cachewarm/pools/ns/c/h100/" + "j" * 64 + ".json", False),
    ("llama/.cachewarm/pools/ns/c/H100/j.json", False),
    ("llama/.cachewarm/pools/ns/c/h100/j.json.tmp", False),
    ("llama/.cachewarm/pools/ns/c/h100.json.tmp", False),
    ("llama/.cachewarm/pools/ns/c/h100.JSON", False),
    ("llama/.cachewarm/pools/ns/c/H100.json", False),
    ("llama/.cachewarm/pools/ns/c/-h100.json", False),
    ("llama/.cachewarm/pools/ns/c/.json", False),
    ("llama/.cachewarm/pools/ns/c/notes.txt", False),
    ("llama/.cachewarm/pools/ns/c/jit_step-" + HASH + "-cache", False),
    ("llama/.cachewarm/pools/ns/c.json", False),
    ("llama/.cachewarm/pools/ns/c", False),
    ("llama/h100.json", False),
    # The pack a warmer Job writes beside its manifest (issue 30): its own, not another's.
    ("llama/.cachewarm/pools/ns/c/h100/c-h100-1.cachewarm-pack", True),
    ("llama/.cachewarm/pools/ns/other/h100/c-h100-1.cachewarm-pack", False),
    ("llama/.cachewarm/pools/ns/c/h100.cachewarm-pack", False),  # no legacy pack per pool
    ("llama/.cachewarm/pools/ns/c/h100/C-1.cachewarm-pack", False),
    ("llama/.cachewarm/pools/ns/c/h100/.cachewarm-pack", False),
    ("llama/.cachewarm/pools/ns/c/h100/j.cachewarm-pack.tmp", False),
    ("llama/.cachewarm/pools/ns/c/h100/x/j.cachewarm-pack", False),
    ("llama/j.cachewarm-pack", False),
])
def test_a_deletion_removes_this_caches_manifests_and_no_other_object(object_name: str, deleted: bool) -> None:
    assert b.is_own_manifest(object_name, spec(prefix="llama"), "ns", "c") is deleted
    assert deletes(object_name, spec(prefix="llama"), "ns", "c") is deleted


# Small alphabets, so that hypothesis often draws two caches that differ in one part only,
# and prefixes that themselves look like manifest folders.
CACHE_PREFIXES = st.one_of(PREFIXES, st.sampled_from(["", "llama", ".cachewarm", ".cachewarm/pools", "a/.cachewarm",
                                                      ".cachewarm/pools/ns/c", "llama/.cachewarm/pools/ns"]))
NAMESPACES = st.text(alphabet="nsc-", min_size=1, max_size=3)
CACHE_NAMES = st.text(alphabet="nsc-.1", min_size=1, max_size=4)
CACHES = st.tuples(CACHE_PREFIXES, NAMESPACES, CACHE_NAMES)
POOLS = st.one_of(st.text(alphabet="ab1-", min_size=1, max_size=5),
                  st.sampled_from(["", "A", "a.b", "a/b", "a.json", "..", "a" * 63, "a" * 64]))


@settings(max_examples=1000, deadline=None)
@given(mine=CACHES, other=CACHES, pool=POOLS, job=POOLS)
def test_property_a_deletion_never_matches_another_caches_manifest(
    mine: tuple[str, str, str], other: tuple[str, str, str], pool: str, job: str
) -> None:
    """Every cache's manifests sit at <prefix>/.cachewarm/pools/<namespace>/<cache>/<pool>/<job>.json:
    a deletion matches one only when it is this cache's (same prefix, namespace and name)
    and its pool and Job parts can name a pool and a Job, whatever the prefixes (one under
    the other, or shaped like a manifest folder themselves)."""
    prefix, namespace, name = mine
    theirs = placement.manifest_object(spec(prefix=other[0]), other[1], other[2], pool, job)
    assert theirs == manifest_folder(*other) + f"{pool}/{job}.json"  # the documented layout
    pack = placement.pack_object(spec(prefix=other[0]), other[1], other[2], pool, job)
    assert pack == manifest_folder(*other) + f"{pool}/{job}.cachewarm-pack"
    own = other == mine and all(POOL_LABEL.fullmatch(n) is not None and len(n) <= 63 for n in (pool, job))
    for one in (theirs, pack):
        assert b.is_own_manifest(one, spec(prefix=prefix), namespace, name) is own
        assert deletes(one, spec(prefix=prefix), namespace, name) is own


MANIFEST_TAILS = st.sampled_from(["", ".json", "cpu.json", "a-1.json", "cpu", "cpu.json.tmp", "cpu/x.json", "Cpu.json", "cpu/j-1.json", "cpu/x/j.json", "cpu/J.json", "cpu/.json",
                                  "-cpu.json", "cpu-.json", "c.p.json", "cpu.json/", f"jit_x-{HASH}-cache",
                                  f"jit_x-{HASH}-atime", f"sub/jit_x-{HASH}-cache", "x", "cpu/j-1.cachewarm-pack",
                                  "cpu.cachewarm-pack", "cpu/J.cachewarm-pack", "cpu/x/j.cachewarm-pack",
                                  ".cachewarm-pack", "cpu/.cachewarm-pack"])


@settings(max_examples=1000, deadline=None)
@given(mine=CACHES, other=CACHES, data=st.data())
def test_property_a_deletion_matches_only_entries_and_this_caches_manifests(
    mine: tuple[str, str, str], other: tuple[str, str, str], data: st.DataObject
) -> None:
    """For any object name (many drawn at the edge: in this cache's manifest folder or
    another's, under the prefix or beside it): a deletion removes it only when it is a JAX
    entry directly under the prefix, or exactly <folder>/<pool>/<job>.json (or the legacy
    <folder>/<pool>.json) of this cache for pool and Job names that can be ones."""
    prefix, namespace, name = mine
    gcs = spec(prefix=prefix)
    heads = st.sampled_from([manifest_folder(*mine), manifest_folder(*other), gcs.object_prefix,
                             manifest_folder(*mine)[:-1], f"{gcs.object_prefix}.cachewarm/pools/", ""])
    tails = st.one_of(MANIFEST_TAILS, st.tuples(st.sampled_from(["a", "x/", "/"]), MANIFEST_TAILS).map("".join), NAMES)
    entries = st.sampled_from(["-cache", "-atime"]).map(lambda end: jax_entry(prefix, "jit_x", end))
    object_name = data.draw(st.one_of(st.tuples(heads, tails).map("".join), NAMES, entries))
    if not deletes(object_name, gcs, namespace, name):
        return
    folder = manifest_folder(*mine)
    tail = object_name[len(folder):] if object_name.startswith(folder) else None
    parts = tail.removesuffix(".json").split("/") if tail is not None and tail.endswith(".json") else []
    manifest = 1 <= len(parts) <= 2 and all(POOL_LABEL.fullmatch(n) is not None and len(n) <= 63 for n in parts)
    packed = tail.removesuffix(".cachewarm-pack").split("/") if tail is not None and tail.endswith(".cachewarm-pack") \
        else []  # a pack: exactly <folder>/<pool>/<job>.cachewarm-pack
    manifest = manifest or (len(packed) == 2 and all(POOL_LABEL.fullmatch(n) is not None and len(n) <= 63
                                                     for n in packed))
    entry = object_name.startswith(gcs.object_prefix) and "/" not in object_name[len(gcs.object_prefix):] and \
        object_name.endswith(("-cache", "-atime")) and re.search(r"-[0-9a-f]{64}-(cache|atime)$", object_name)
    assert manifest or entry, object_name
    assert b.is_own_manifest(object_name, gcs, namespace, name) is manifest


@settings(max_examples=300, deadline=None)
@given(cache=CACHES, pool=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?", fullmatch=True),
       job=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True))
def test_property_every_manifest_a_warmer_writes_is_removed_with_its_cache(cache: tuple[str, str, str],
                                                                           pool: str, job: str) -> None:
    """Any pool name the CRD allows (a DNS label of at most 20 characters), any Job name,
    and the pool's legacy manifest (one per pool, before per-Job manifests)."""
    prefix, namespace, name = cache
    gcs = spec(prefix=prefix)
    assert deletes(placement.manifest_object(gcs, namespace, name, pool, job), gcs, namespace, name)
    assert deletes(placement.legacy_manifest_object(gcs, namespace, name, pool), gcs, namespace, name)
    assert deletes(placement.pack_object(gcs, namespace, name, pool, job), gcs, namespace, name)


# --- two operator instances on one bucket ----------------------------------------------------

def apply(bucket: b.BucketInfo, patch: dict[str, Any]) -> b.BucketInfo:
    """The bucket after a patch, as GCS would hold it."""
    kw: dict[str, Any] = {}
    if "lifecycle" in patch:
        kw["lifecycle_rules"] = patch["lifecycle"]["rule"]
    if "labels" in patch:
        kw["labels"] = patch["labels"]
    return dataclasses.replace(bucket, **kw)


def test_two_instances_keep_each_others_rules_and_reach_a_fixed_point() -> None:
    """Each operator sees only its own cluster's caches: neither takes the other's rule for
    its own, rewrites it, or drops its record."""
    a_plan = plan(claim("a1", "team-a", 10))
    b_plan = plan(claim("b1", "team-b", 20))
    bucket = info(labels={"team": "ml"})
    for _ in range(3):
        for instance, p in (("ops-a", a_plan), ("ops-b", b_plan)):
            bucket = apply(bucket, b.lifecycle_patch(bucket, p, instance))
    assert [dict(r) for r in bucket.lifecycle_rules] == [ours(10, "team-a/"), ours(20, "team-b/")]
    assert bucket.labels == {"team": "ml", b.rule_label(ours(10, "team-a/")): "ops-a",
                             b.rule_label(ours(20, "team-b/")): "ops-b"}
    assert b.lifecycle_patch(bucket, a_plan, "ops-a") == {} == b.lifecycle_patch(bucket, b_plan, "ops-b")
    assert b.split_rules(bucket, "ops-a") == ([ours(20, "team-b/")], [ours(10, "team-a/")])
    assert not b.changed_outside(bucket, {"labels": {}}, "ops-a")
    assert b.observed_delete_after_days(bucket, claim("a1", "team-a"), "ops-a") == 10
    assert b.observed_delete_after_days(bucket, claim("a1", "team-b"), "ops-a") is None
    assert b.other_instances(bucket, "ops-a") == ["ops-b"]
    assert b.other_instances(bucket, "ops-b") == ["ops-a"]
    # One operator's caches all gone: it removes its own rule and record only.
    emptied = apply(bucket, b.lifecycle_patch(bucket, plan(), "ops-a"))
    assert [dict(r) for r in emptied.lifecycle_rules] == [ours(20, "team-b/")]
    assert emptied.labels == {"team": "ml", b.rule_label(ours(20, "team-b/")): "ops-b"}


def test_another_instances_records_do_not_count_against_its_budget_as_ours() -> None:
    theirs = ours(20, "team-b/")
    bucket = info(lifecycle_rules=[theirs], labels={b.rule_label(theirs): "ops-b"})
    assert b.rule_budget(bucket, "ops-a") == min(100 - 1, 64 - 8 - 1)
    assert b.rule_budget(bucket, "ops-b") == min(100, 64 - 8)


def test_records_written_before_instances_are_the_default_instances() -> None:
    rule = ours(10, "llama/")
    bucket = info(lifecycle_rules=[rule], labels={b.rule_label(rule): "1"})
    assert b.split_rules(bucket) == ([], [rule])
    assert b.split_rules(bucket, "ops-a") == ([rule], [])
    assert b.other_instances(bucket, "ops-a") == ["default"]
    old = info(labels={k: v for k, v in b.owner_labels("ns", "c").items() if k != c.GCS_LABEL_INSTANCE})
    assert b.created_by(old, "ns", "c")
    assert not b.created_by(old, "ns", "c", "ops-a")


def test_a_bucket_another_instance_created_is_not_ours() -> None:
    bucket = info(labels=b.owner_labels("ns", "c", "ops-b"))
    assert b.created_by(bucket, "ns", "c", "ops-b")
    assert not b.created_by(bucket, "ns", "c", "ops-a")
    assert b.settings_owner([claim("c")], bucket, "ops-a") is None
    assert b.other_instances(bucket, "ops-a") == ["ops-b"]


def test_data_under_another_instances_prefix_is_theirs_too() -> None:
    theirs = ours(20, "shared/", "x/")
    bucket = info(lifecycle_rules=[theirs, THEIRS], labels={b.rule_label(theirs): "ops-b"})
    assert b.covered_by_other_instance(bucket, "shared/", "ops-a") == "ops-b"
    assert b.covered_by_other_instance(bucket, "shared/", "ops-b") is None
    assert b.covered_by_other_instance(bucket, "logs/", "ops-a") is None  # an unrecorded rule says nothing


def test_instance_labels_are_valid_gcs_labels() -> None:
    for key, value in b.owner_labels("ns", "c", "eu-west_2").items():
        assert key[0] in string.ascii_lowercase and len(key) <= 63 and len(value) <= 63
        assert set(key + value) <= set(string.ascii_lowercase + string.digits + "-_")


# --- identical rules: never a second copy, never one of two claimed ---------------------------

def test_a_rule_identical_to_an_unrecorded_one_is_not_added() -> None:
    rule = ours(10, "llama/")
    p = plan(claim("a1", "llama", 10))
    bucket = info(lifecycle_rules=[THEIRS, rule])  # the team's, byte for byte what we want
    assert b.identical_foreign(bucket, rule)
    assert b.lifecycle_patch(bucket, p) == {}
    # Our record stripped by someone: no second copy either, and our label is not rewritten.
    stripped = info(lifecycle_rules=[rule], labels={"team": "x"})
    assert b.lifecycle_patch(stripped, p) == {}
    # Another instance's rule that happens to be what this one wants: theirs, left alone.
    other = info(lifecycle_rules=[rule], labels={b.rule_label(rule): "ops-b"})
    assert b.lifecycle_patch(other, p, "ops-a") == {}


def test_of_two_identical_copies_neither_is_claimed_and_no_third_is_added() -> None:
    rule = ours(10, "llama/")
    bucket = info(lifecycle_rules=[rule, THEIRS, rule], labels=labelled(rule))
    assert b.split_rules(bucket) == ([rule, THEIRS, rule], [])
    patch = b.lifecycle_patch(bucket, plan(claim("a1", "llama", 10)))
    assert patch == {"labels": {}}  # our record dropped (it names no rule we can tell), no rule written
    assert b.observed_delete_after_days(bucket, claim("a1", "llama")) is None


# --- rules of others that delete this cache's entries --------------------------------------


def delete_rule(**cond: Any) -> dict[str, Any]:
    return {"action": {"type": "Delete"}, "condition": {"age": 30, **cond}}


@pytest.mark.parametrize("rule, object_prefix, deletes", [
    (delete_rule(), "jax/", True),  # no name conditions: every object
    (delete_rule(), "", True),
    (delete_rule(matchesPrefix=["logs/"]), "jax/", False),
    (delete_rule(matchesPrefix=["ja"]), "jax/", True),
    (delete_rule(matchesPrefix=["jax/jit_"]), "jax/", True),
    (delete_rule(matchesPrefix=["jax/sub/"]), "jax/", False),  # entries lie directly under the prefix
    (delete_rule(matchesSuffix=[".parquet"]), "jax/", False),
    (delete_rule(matchesSuffix=["-cache"]), "jax/", True),
    (delete_rule(matchesSuffix=["e"]), "jax/", True),
    (delete_rule(matchesSuffix=["-CACHE"]), "jax/", False),
    (delete_rule(matchesSuffix=[f"step-{HASH}-cache"]), "jax/", True),
    (delete_rule(matchesSuffix=[f"jax/jit_step-{HASH}-atime"]), "jax/", True),
    (delete_rule(matchesSuffix=[f"jax/jit_step-{HASH}-atime"]), "other/", False),
    (delete_rule(matchesSuffix=[f"/-{HASH}-cache"]), "jax/", False),  # the module cannot be empty
    (delete_rule(matchesSuffix=[f"-{'x' * 64}-cache"]), "jax/", False),  # not hex
    (delete_rule(matchesPrefix=["jax/a"], matchesSuffix=[f"jax/b-{HASH}-cache"]), "jax/", False),
    (delete_rule(matchesPrefix=["jax/b"], matchesSuffix=[f"jax/b-{HASH}-cache"]), "jax/", True),
    (delete_rule(matchesPrefix=["logs/", "jax/"], matchesSuffix=[".txt", "-atime"]), "jax/", True),
    (ours(10, "jax/"), "jax/", True),  # an edited copy of ours, no longer recorded
    (ours(10, "jaxx/"), "jax/", False),
    (CLASS_RULE, "jax/", False),  # only Delete deletes
])
def test_which_rules_delete_entries_of_a_cache(rule: dict[str, Any], object_prefix: str, deletes: bool) -> None:
    assert b.deletes_entries_of(rule, object_prefix) is deletes


ENTRY_PREFIXES = st.sampled_from(["", "jax/", "a/b/", "j-/", "x"])


@settings(max_examples=500, deadline=None)
@given(object_prefix=ENTRY_PREFIXES, module=st.text(alphabet="ab-_1f", min_size=1, max_size=6),
       digest=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
       ending=st.sampled_from(["-cache", "-atime"]), data=st.data())
def test_property_a_rule_whose_names_match_an_entry_is_found(object_prefix: str, module: str, digest: str,
                                                             ending: str, data: st.DataObject) -> None:
    """Any Delete rule whose prefix and suffix conditions an actual entry name meets (per
    the evaluator of GCS's semantics) is reported."""
    name = f"{object_prefix}{module}-{digest}{ending}"
    cond: dict[str, Any] = {"age": 1}
    if data.draw(st.booleans()):
        cond["matchesPrefix"] = ["nope/", name[:data.draw(st.integers(0, len(name)))]]
    if data.draw(st.booleans()):
        cond["matchesSuffix"] = [name[data.draw(st.integers(0, len(name))):], ".nope"]
    rule = {"action": {"type": "Delete"}, "condition": cond}
    assert ev.name_conditions_met(rule, name)
    assert b.deletes_entries_of(rule, object_prefix)


@settings(max_examples=500, deadline=None)
@given(object_prefix=ENTRY_PREFIXES, module=st.text(alphabet="ab-_1f/", min_size=1, max_size=6),
       digest=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
       prefix=st.text(alphabet="ajx/b-_1f", max_size=6), suffix=st.text(alphabet="abcef-/1", max_size=8))
def test_property_a_rule_found_to_match_nothing_matches_no_entry(object_prefix: str, module: str, digest: str,
                                                                 prefix: str, suffix: str) -> None:
    rule = delete_rule(matchesPrefix=[prefix], matchesSuffix=[suffix])
    if b.deletes_entries_of(rule, object_prefix):
        return
    for ending in ("-cache", "-atime"):
        name = f"{object_prefix}{module}-{digest}{ending}"
        if "/" not in module:
            assert not ev.name_conditions_met(rule, name), name


def test_foreign_rules_deleting_entries_are_named_by_index_and_ours_are_not() -> None:
    team = delete_rule()
    edited = ours(11, "jax/")
    mine = ours(10, "jax/")
    bucket = info(lifecycle_rules=[THEIRS, team, CLASS_RULE, edited, mine], labels=labelled(mine))
    assert b.foreign_rules_deleting_entries(bucket, "jax/") == [(1, team), (3, edited)]
    assert b.foreign_rules_deleting_entries(bucket, "logs/") == [(0, THEIRS), (1, team)]
