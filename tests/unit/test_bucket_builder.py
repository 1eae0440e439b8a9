"""The bucket builder: which lifecycle rule is ours, how it merges with others, and the
smallest patch that brings a bucket to the spec."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.builders import bucket as b
from cachewarm.model import GcsStorage

DAY = 86400


def spec(**kw: Any) -> GcsStorage:
    return GcsStorage.model_validate({"bucket": "cache", "location": "us-central1", **kw})


def info(**kw: Any) -> b.BucketInfo:
    base: dict[str, Any] = dict(name="cache", location="US-CENTRAL1", storage_class="STANDARD",
                                soft_delete_seconds=7 * DAY, uniform_access=True, public_access_prevention="enforced")
    base.update(kw)
    return b.BucketInfo(**base)


OURS_P = {"action": {"type": "Delete"}, "condition": {"age": 10, "matchesPrefix": ["llama/"]}}
THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}
CLASS_RULE = {"action": {"type": "SetStorageClass", "storageClass": "NEARLINE"}, "condition": {"age": 30}}


@pytest.mark.parametrize(("gcs", "expected"), [
    (spec(prefix="llama", lifecycle={"deleteAfterDays": 10}), OURS_P),
    (spec(lifecycle={"deleteAfterDays": 4}), {"action": {"type": "Delete"}, "condition": {"age": 4}}),
    (spec(prefix="a/b"), {"action": {"type": "Delete"}, "condition": {"age": 30, "matchesPrefix": ["a/b/"]}}),
])
def test_lifecycle_rule_is_scoped_to_prefix_with_trailing_slash(gcs: GcsStorage, expected: dict[str, Any]) -> None:
    assert b.lifecycle_rule(gcs) == expected


@pytest.mark.parametrize(("existing", "expected"), [
    ([], [OURS_P]),
    ([THEIRS], [THEIRS, OURS_P]),
    ([OURS_P | {"condition": {"age": 3, "matchesPrefix": ["llama/"]}}, THEIRS], [THEIRS, OURS_P]),
    ([CLASS_RULE, OURS_P, THEIRS], [CLASS_RULE, THEIRS, OURS_P]),
    # A Delete rule on another prefix, or with more conditions, is not ours.
    ([{"action": {"type": "Delete"}, "condition": {"age": 10, "matchesPrefix": ["llama-old/"]}}],
     [{"action": {"type": "Delete"}, "condition": {"age": 10, "matchesPrefix": ["llama-old/"]}}, OURS_P]),
    ([{"action": {"type": "Delete"}, "condition": {"age": 10, "matchesPrefix": ["llama/"], "isLive": False}}],
     [{"action": {"type": "Delete"}, "condition": {"age": 10, "matchesPrefix": ["llama/"], "isLive": False}}, OURS_P]),
])
def test_merge_keeps_rules_it_does_not_own(existing: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    gcs = spec(prefix="llama", lifecycle={"deleteAfterDays": 10})
    assert b.merged_lifecycle(existing, gcs) == expected


def test_bucket_at_spec_needs_no_patch() -> None:
    gcs = spec(prefix="llama", lifecycle={"deleteAfterDays": 10})
    assert b.bucket_patch(info(lifecycle_rules=[THEIRS, OURS_P]), gcs, created_by_us=True) == {}


def test_string_ages_from_gcs_compare_equal() -> None:
    gcs = spec(prefix="llama", lifecycle={"deleteAfterDays": 10})
    as_returned = {"action": {"type": "Delete"}, "condition": {"age": "10", "matchesPrefix": ["llama/"]}}
    assert b.bucket_patch(info(lifecycle_rules=[as_returned]), gcs, created_by_us=False) == {}


def test_patch_names_only_what_differs() -> None:
    gcs = spec(prefix="llama", lifecycle={"deleteAfterDays": 10}, softDeleteDays=0)
    patch = b.bucket_patch(info(lifecycle_rules=[OURS_P]), gcs, created_by_us=True)
    assert patch == {"softDeletePolicy": {"retentionDurationSeconds": 0}}


def test_access_and_class_are_managed_only_on_buckets_cachewarm_created() -> None:
    gcs = spec(prefix="llama", lifecycle={"deleteAfterDays": 10}, storageClass="NEARLINE")
    loose = info(lifecycle_rules=[OURS_P], uniform_access=False, public_access_prevention="inherited")
    assert b.bucket_patch(loose, gcs, created_by_us=False) == {}
    assert b.bucket_patch(loose, gcs, created_by_us=True) == {
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


@pytest.mark.parametrize(("name", "entry"), [
    ("llama/jit_step-" + "0f" * 32 + "-cache", True),
    ("llama/jit_step-" + "0f" * 32 + "-atime", True),
    ("llama/notes.txt", False),
    ("llama/sub/jit_step-" + "0f" * 32 + "-cache", False),
    ("llama-old/jit_step-" + "0f" * 32 + "-cache", False),
    ("llama/jit_step-" + "0F" * 32 + "-cache", False),
    ("llama/jit_step-" + "0f" * 31 + "-cache", False),
])
def test_only_jax_entries_under_the_prefix_count_as_cache_entries(name: str, entry: bool) -> None:
    assert b.is_cache_entry(name, spec(prefix="llama")) is entry
