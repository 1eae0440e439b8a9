"""What a cache's bucket should look like, and the smallest patch that gets it there.

Lifecycle: cachewarm's Delete rules match only names that end in `-cache` or `-atime`
(the two endings of JAX's entries), or in `.cachewarm-pack` (the packs warmers write beside
their manifests), under the prefixes of the caches on the bucket, and expire an entry or a
pack `deleteAfterDays` after its customTime (set by the warmer that last wrote or found it). Caches with the same deleteAfterDays share one rule, so many caches on one
bucket stay under GCS's rule limit.

Ownership: a rule is this operator's only when the bucket carries the label
`cachewarm-rule-<hash of the rule's canonical JSON>` with this operator's instance name as
its value, written in the same PATCH as the rule. Every other rule, even one shaped like
ours and one another cachewarm instance recorded, belongs to someone else and is kept as
GCS returned it, in its place.

Bucket-wide settings (soft delete) have one owner among the caches on a bucket: the cache
that created the bucket. On a bucket cachewarm did not create (adopted), they belong to the
bucket's owner and no cache ever writes them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.bucket import BucketInfo
from cachewarm.builders.placement import PACK_SUFFIX, is_pool_manifest, is_pool_pack, manifest_folder
from cachewarm.api.model import GcsStorage

DAY = 86_400
# JAX names entries <module>-<sha256 hex>-cache (and -atime when its LRU is on); besides
# them, only the cache's own warmers' manifests (is_own_manifest) under a prefix are ours
# to delete.
ENTRY_NAME = re.compile(r"^[^/]+-[0-9a-f]{64}-(cache|atime)$")
ENTRY_SUFFIXES = ("-cache", "-atime")
# What cachewarm's rules expire: entries, and the warmers' packs (each written with the warm's
# customTime; a pack only cachewarm's warmers name so, under `<prefix>.cachewarm/pools/`).
RULE_SUFFIXES = (*ENTRY_SUFFIXES, PACK_SUFFIX)
# A pool's name (the CRD's pattern; a DNS label), as the last part of a manifest's name.
POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# GCS limits (https://cloud.google.com/storage/docs/lifecycle, .../docs/tags-and-labels).
MAX_LIFECYCLE_RULES = 100
MAX_BUCKET_LABELS = 64
# Labels cachewarm never takes for its rule records, so the owner can always still add a
# grant or a label of their own; and the distinct rules (deleteAfterDays) one namespace's
# caches may hold on a bucket, so one tenant granted a prefix cannot take the bucket's rules
# and labels from the others (issue 29 attacker review).
OWNER_LABELS_KEPT_FREE = 8
RULES_PER_NAMESPACE = 4
_INT_CONDITIONS = ("age", "daysSinceCustomTime", "daysSinceNoncurrentTime", "numNewerVersions")


def owner_labels(namespace: str, name: str, instance: str = c.DEFAULT_INSTANCE) -> dict[str, str]:
    """Labels on a bucket cachewarm created, naming the cache (and operator) that created it."""
    return {
        c.GCS_LABEL_MANAGED_BY: c.MANAGED_BY,
        c.GCS_LABEL_NAMESPACE: namespace[:63],
        c.GCS_LABEL_CACHE: name[:63],
        c.GCS_LABEL_INSTANCE: instance,
    }


def created_by(bucket: BucketInfo, namespace: str, name: str, instance: str = c.DEFAULT_INSTANCE) -> bool:
    """True when the bucket carries the labels of this cache's creation by this operator
    (a bucket created before instances existed has no instance label: the default's)."""
    labels = {**bucket.labels}
    labels.setdefault(c.GCS_LABEL_INSTANCE, c.DEFAULT_INSTANCE)
    return all(labels.get(k) == v for k, v in owner_labels(namespace, name, instance).items())


# --- consent: whose bucket the operator may act on for a namespace ------------------------


def created_for(bucket: BucketInfo, namespace: str, instance: str = c.DEFAULT_INSTANCE) -> bool:
    """Whether this operator created the bucket for a cache of `namespace` (its creation
    labels, written in the create call itself; before instances existed: the default's)."""
    labels = {**bucket.labels}
    labels.setdefault(c.GCS_LABEL_INSTANCE, c.DEFAULT_INSTANCE)
    return (labels.get(c.GCS_LABEL_MANAGED_BY) == c.MANAGED_BY and labels.get(c.GCS_LABEL_NAMESPACE) == namespace[:63]
            and labels.get(c.GCS_LABEL_INSTANCE) == instance)


def grant_label(namespace: str, prefix: str, instance: str = c.DEFAULT_INSTANCE) -> tuple[str, str]:
    """The label (key, value) by which a bucket's owner lets this operator instance act for
    caches of `namespace` at `prefix` ("" for the whole bucket) and under it. GCS label keys
    hold only lowercase letters, digits, '-' and '_' (63 at most), so the key carries a hash
    of instance, namespace and prefix, and the value the namespace, for people to read."""
    digest = hashlib.sha256(f"{instance}/{namespace}/{prefix}".encode()).hexdigest()[:16]
    return f"{c.GCS_LABEL_GRANT_PREFIX}{digest}", namespace


def covering_prefixes(prefix: str) -> list[str]:
    """The prefix, each folder above it, and the bucket root (""): a grant at any of them
    covers a cache at `prefix`. "a/b" -> ["a/b", "a", ""]."""
    parts = prefix.split("/") if prefix else []
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def consent(bucket: BucketInfo, namespace: str, prefix: str, instance: str = c.DEFAULT_INSTANCE) -> str | None:
    """How the bucket's owner consented to this operator acting for caches of `namespace`
    at `prefix` (a phrase for messages), or None when it did not: cachewarm created the
    bucket for that namespace, or the bucket carries a grant label for the prefix or one
    above it."""
    if created_for(bucket, namespace, instance):
        return "created by cachewarm for this namespace"
    for granted in covering_prefixes(prefix):
        key, value = grant_label(namespace, granted, instance)
        if bucket.labels.get(key) == value:
            return f"granted by its label {key} (prefix {granted!r})" if granted else f"granted by its label {key} (whole bucket)"
    return None


def granted_claims(bucket: BucketInfo, claims: Iterable[Claim], instance: str = c.DEFAULT_INSTANCE) -> list[Claim]:
    """The caches the bucket's owner consented to: only they count on the bucket (their
    rules, their prefixes' precedence), so a cache without consent can neither take a
    prefix from one with it nor put a rule on the bucket."""
    return [cl for cl in claims if consent(bucket, cl.namespace, cl.prefix, instance) is not None]


@dataclass(frozen=True)
class CreationLimits:
    """What the operator's admin allows a cache to create (the operator's project pays):
    locations and storage classes (empty: any), and buckets per namespace."""

    locations: frozenset[str] = frozenset()
    storage_classes: frozenset[str] = frozenset()
    per_namespace: int = 10


def creation_refusal(gcs: GcsStorage, limits: CreationLimits, created_in_namespace: int | None) -> str | None:
    """Which of the admin's rules a new bucket would break (None: none). `created_in_namespace`:
    how many buckets this operator created for the namespace exist now (None: not counted,
    when the count cannot matter)."""
    if limits.locations and gcs.location.upper() not in {loc.upper() for loc in limits.locations}:
        return (f"location {gcs.location} is not one this cluster's admin allows for new buckets "
                f"(CACHEWARM_BUCKET_LOCATIONS: {', '.join(sorted(limits.locations))})")
    if limits.storage_classes and gcs.storage_class.upper() not in {s.upper() for s in limits.storage_classes}:
        return (f"storage class {gcs.storage_class} is not one this cluster's admin allows for new buckets "
                f"(CACHEWARM_BUCKET_STORAGE_CLASSES: {', '.join(sorted(limits.storage_classes))})")
    if limits.per_namespace == 0:
        return "this cluster's admin allows cachewarm to create no buckets (CACHEWARM_BUCKETS_PER_NAMESPACE: 0)"
    if created_in_namespace is not None and created_in_namespace >= limits.per_namespace:
        return (f"cachewarm already created {created_in_namespace} buckets for this namespace, the most this "
                f"cluster's admin allows (CACHEWARM_BUCKETS_PER_NAMESPACE: {limits.per_namespace})")
    return None


# --- caches sharing a bucket ------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Claim:
    """One cache's use of a bucket, as the operator's index sees it. Ordered by age."""

    created: str  # creationTimestamp (RFC 3339, so text order is time order)
    namespace: str
    name: str
    prefix: str = field(default="", compare=False)
    delete_after_days: int = field(default=30, compare=False)
    soft_delete_days: int = field(default=7, compare=False)
    allow_bucket_root: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, gcs: GcsStorage, *, created: str, namespace: str, name: str) -> Claim:
        return cls(created, namespace, name, gcs.prefix, gcs.lifecycle.delete_after_days,
                   gcs.soft_delete_days, gcs.lifecycle.allow_bucket_root)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def object_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def overlaps(a: str, b: str) -> bool:
    """Whether two caches' object prefixes ("" for the root, else "p/") share any name."""
    return a.startswith(b) or b.startswith(a)


def active(claims: Iterable[Claim]) -> list[Claim]:
    """Caches that manage their prefix: those that overlap no older cache that manages its
    own (a refused cache blocks nobody). Oldest first."""
    out: list[Claim] = []
    for cl in sorted({cl.key: cl for cl in claims}.values()):
        if not any(overlaps(o.object_prefix, cl.object_prefix) for o in out):
            out.append(cl)
    return out


def refused_by(claims: Iterable[Claim], mine: Claim) -> Claim | None:
    """The older managing cache whose prefix overlaps mine (then mine manages nothing)."""
    return next((o for o in active(claims) if o < mine and overlaps(o.object_prefix, mine.object_prefix)), None)


def settings_owner(claims: Iterable[Claim], bucket: BucketInfo, instance: str = c.DEFAULT_INSTANCE) -> Claim | None:
    """The cache that owns bucket-wide settings: the active one that created the bucket.
    None on an adopted bucket (its settings are its owner's, never cachewarm's) and when
    the creating cache is gone."""
    for cl in active(claims):
        if created_by(bucket, cl.namespace, cl.name, instance):
            return cl
    return None


# --- lifecycle rules ----------------------------------------------------------------------


def last_use_rule(days: int, object_prefixes: Sequence[str]) -> dict[str, Any]:
    """Delete JAX entries and warmers' packs under these prefixes `days` after their customTime.

    matchesPrefix and matchesSuffix in one rule must both hold (GCS: all conditions of a
    rule), so the rule matches `<one of the prefixes>...(-cache|-atime|.cachewarm-pack)` and nothing else.
    A rule for the bucket root has no matchesPrefix (it then matches those endings anywhere).
    """
    condition: dict[str, Any] = {"daysSinceCustomTime": days}
    prefixes = sorted(set(object_prefixes))
    if prefixes != [""]:
        if "" in prefixes:
            raise ValueError("the bucket root cannot share a rule with a prefix")
        condition["matchesPrefix"] = prefixes
    condition["matchesSuffix"] = list(RULE_SUFFIXES)
    return {"action": {"type": "Delete"}, "condition": condition}


@dataclass(frozen=True)
class LifecyclePlan:
    """cachewarm's rules for one bucket, computed the same way by every cache on it."""

    rules: list[dict[str, Any]]
    rule_of: dict[tuple[str, str], dict[str, Any]]  # cache key -> the rule covering its entries
    root_not_allowed: frozenset[tuple[str, str]] = frozenset()
    over_limit: frozenset[tuple[str, str]] = frozenset()
    # Caches left without a rule because their namespace's caches already hold
    # RULES_PER_NAMESPACE distinct deleteAfterDays on the bucket (older caches first).
    over_namespace_limit: frozenset[tuple[str, str]] = frozenset()


def plan_lifecycle(claims: Iterable[Claim], budget: int) -> LifecyclePlan:
    """One rule per distinct deleteAfterDays among the active caches, at most `budget`
    rules; the groups whose oldest cache is newest are left out first. A namespace's caches
    use at most RULES_PER_NAMESPACE distinct deleteAfterDays (its oldest caches' first);
    its other caches get none."""
    groups: dict[int, list[Claim]] = {}
    root_not_allowed: set[tuple[str, str]] = set()
    days_of: dict[str, list[int]] = {}
    over_namespace: set[tuple[str, str]] = set()
    for cl in active(claims):
        if cl.object_prefix == "" and not cl.allow_bucket_root:
            root_not_allowed.add(cl.key)
            continue
        used = days_of.setdefault(cl.namespace, [])
        if cl.delete_after_days not in used:
            if len(used) >= RULES_PER_NAMESPACE:
                over_namespace.add(cl.key)
                continue
            used.append(cl.delete_after_days)
        groups.setdefault(cl.delete_after_days, []).append(cl)
    by_age = sorted(groups, key=lambda d: min(groups[d]))
    kept = set(by_age[:max(budget, 0)])
    rules: list[dict[str, Any]] = []
    rule_of: dict[tuple[str, str], dict[str, Any]] = {}
    for days in sorted(kept):
        rule = last_use_rule(days, [cl.object_prefix for cl in groups[days]])
        rules.append(rule)
        rule_of.update({cl.key: rule for cl in groups[days]})
    over = {cl.key for d in groups if d not in kept for cl in groups[d]}
    return LifecyclePlan(rules, rule_of, frozenset(root_not_allowed), frozenset(over), frozenset(over_namespace))


def canonical(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A rule as plain JSON data with integer conditions as ints (GCS may return "10")."""
    out: dict[str, Any] = copy.deepcopy(dict(rule))
    cond = out.get("condition")
    if isinstance(cond, dict):
        for key in _INT_CONDITIONS:
            if key in cond:
                cond[key] = int(cond[key])
    return out


def rule_label(rule: Mapping[str, Any]) -> str:
    """The bucket label that records a rule as cachewarm's."""
    text = json.dumps(canonical(rule), sort_keys=True, separators=(",", ":"))
    return c.GCS_LABEL_RULE_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:16]


def recorded_by(value: str) -> str:
    """The instance that recorded a rule label with this value."""
    return c.DEFAULT_INSTANCE if value == c.LEGACY_RULE_RECORD else value


def recorded(bucket: BucketInfo, instance: str) -> set[str]:
    """The rule labels this operator instance recorded on the bucket."""
    return {k for k, v in bucket.labels.items() if k.startswith(c.GCS_LABEL_RULE_PREFIX) and recorded_by(v) == instance}


def other_instances(bucket: BucketInfo, instance: str) -> list[str]:
    """Other cachewarm operator instances that recorded rules on, or created, the bucket."""
    names = {recorded_by(v) for k, v in bucket.labels.items() if k.startswith(c.GCS_LABEL_RULE_PREFIX)}
    if bucket.labels.get(c.GCS_LABEL_MANAGED_BY) == c.MANAGED_BY:
        names.add(bucket.labels.get(c.GCS_LABEL_INSTANCE, c.DEFAULT_INSTANCE))
    return sorted(names - {instance})


def _our_indices(bucket: BucketInfo, instance: str) -> set[int]:
    """Positions of this operator's rules: a rule is ours when its label is recorded with
    our instance and it is the only copy on the bucket (of two identical copies nothing
    tells which one we wrote, so both are someone else's)."""
    recorded_here = recorded(bucket, instance)
    rules = bucket.lifecycle_rules
    copies = Counter(rule_label(r) for r in rules)
    return {i for i, r in enumerate(rules) if rule_label(r) in recorded_here and copies[rule_label(r)] == 1}


def split_rules(bucket: BucketInfo, instance: str = c.DEFAULT_INSTANCE
                ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(someone else's rules in order, this operator's rules); see _our_indices."""
    ours = _our_indices(bucket, instance)
    rules = bucket.lifecycle_rules
    return ([r for i, r in enumerate(rules) if i not in ours], [r for i, r in enumerate(rules) if i in ours])


# The end of every JAX entry name: "-<64 hex>-cache" or "-<64 hex>-atime" ("h": any hex digit).
_ENTRY_TAILS = tuple(f"-{'h' * 64}{suffix}" for suffix in ENTRY_SUFFIXES)


def _fits_tail(text: str, tail: str) -> bool:
    """Whether `text` can be the last len(text) characters of an entry name ending as `tail`."""
    if len(text) > len(tail):
        return False
    for have, want in zip(text, tail[len(tail) - len(text):]):
        if not (have == want or (want == "h" and have in "0123456789abcdef")):
            return False
    return True


def _prefix_and_suffix_fit(object_prefix: str, prefix: str, suffix: str) -> bool:
    """Whether some JAX entry directly under `object_prefix` (`<object_prefix><module>-<64
    hex>-cache|atime`, the module any non-empty text without "/") starts with `prefix` and
    ends with `suffix`."""
    if not object_prefix.startswith(prefix):
        if not prefix.startswith(object_prefix) or "/" in prefix[len(object_prefix):]:
            return False
    for tail in _ENTRY_TAILS:
        if _fits_tail(suffix, tail):
            return True  # the suffix lies in the tail; the module is free to fit the prefix
        if not _fits_tail(suffix[-len(tail):], tail):
            continue
        rest = suffix[:-len(tail)]  # the end of <object_prefix><module>
        if "/" not in rest:
            return True  # the module is <what the prefix needs><rest>
        cut = rest.rindex("/") + 1
        module = rest[cut:]
        if module and object_prefix.endswith(rest[:cut]):
            # The suffix fixes the whole name (up to the tail's hex digits, which it fixes too).
            if (object_prefix + module + suffix[-len(tail):]).startswith(prefix):
                return True
    return False


def deletes_entries_of(rule: Mapping[str, Any], object_prefix: str) -> bool:
    """Whether a Delete rule's name conditions (matchesPrefix, matchesSuffix; absent means
    every name) match some JAX entry name directly under `object_prefix` ("" for the bucket
    root). Only names are compared: its other conditions (age, customTime, storage class,
    ...) only say when, so a rule that can match such a name will delete such entries."""
    if (rule.get("action") or {}).get("type") != "Delete":
        return False
    cond = rule.get("condition") or {}
    prefixes = list(cond.get("matchesPrefix") or [""])
    suffixes = list(cond.get("matchesSuffix") or [""])
    return any(_prefix_and_suffix_fit(object_prefix, p, s) for p in prefixes for s in suffixes)


def foreign_rules_deleting_entries(bucket: BucketInfo, object_prefix: str, instance: str = c.DEFAULT_INSTANCE
                                   ) -> list[tuple[int, Mapping[str, Any]]]:
    """Rules that are not this operator's (index in the bucket's lifecycle, rule) whose
    Delete also matches JAX entries of the cache at `object_prefix`: they delete its
    entries by their own conditions, whatever cachewarm's rule says. Never changed."""
    ours = _our_indices(bucket, instance)
    return [(i, r) for i, r in enumerate(bucket.lifecycle_rules)
            if i not in ours and deletes_entries_of(r, object_prefix)]


def rule_budget(bucket: BucketInfo, instance: str = c.DEFAULT_INSTANCE) -> int:
    """How many rules this operator may own: GCS's rule limit less the rules of others, and
    its label limit less the labels of others and OWNER_LABELS_KEPT_FREE (each owned rule
    takes one label; the owner can always add a grant)."""
    foreign, _ = split_rules(bucket, instance)
    mine = recorded(bucket, instance)
    other_labels = [k for k in bucket.labels if k not in mine]
    return min(MAX_LIFECYCLE_RULES - len(foreign), MAX_BUCKET_LABELS - OWNER_LABELS_KEPT_FREE - len(other_labels))


def identical_foreign(bucket: BucketInfo, rule: Mapping[str, Any], instance: str = c.DEFAULT_INSTANCE) -> bool:
    """Whether a rule byte-identical to this one is on the bucket but not ours."""
    foreign, _ = split_rules(bucket, instance)
    return canonical(rule) in [canonical(r) for r in foreign]


def lifecycle_patch(bucket: BucketInfo, plan: LifecyclePlan, instance: str = c.DEFAULT_INSTANCE) -> dict[str, Any]:
    """Others' rules (other operator instances' included) untouched and in place, ours
    after them as the plan says, and the labels that record ours (others' labels kept).
    A planned rule identical to one of someone else's is neither added (copies would pile
    up whenever labels are stripped) nor recorded. Empty when the bucket already is so, or
    when some rule on it could not be read (writing the lifecycle back would drop it)."""
    if bucket.unreadable_rules:
        return {}
    foreign, ours = split_rules(bucket, instance)
    taken = [canonical(r) for r in foreign]
    planned = [r for r in plan.rules if canonical(r) not in taken]
    wanted = [*foreign, *planned]
    if [canonical(r) for r in ours] == [canonical(r) for r in planned]:
        # Ours are as planned wherever they stand (another operator instance appends its
        # own after them): moving them would only make the two reorder the list in turn.
        wanted = [copy.deepcopy(dict(r)) for r in bucket.lifecycle_rules]
    mine = recorded(bucket, instance)
    labels = {k: v for k, v in bucket.labels.items() if k not in mine}
    # A record written before instances existed ("1", the default's) is kept as it is.
    labels.update({rule_label(r): bucket.labels[rule_label(r)] if rule_label(r) in mine else instance
                   for r in planned})
    patch: dict[str, Any] = {}
    if [canonical(r) for r in bucket.lifecycle_rules] != [canonical(r) for r in wanted]:
        patch["lifecycle"] = {"rule": [copy.deepcopy(dict(r)) for r in wanted]}
    if dict(bucket.labels) != labels:
        patch["labels"] = labels
    return patch


def changed_outside(bucket: BucketInfo, patch: Mapping[str, Any], instance: str = c.DEFAULT_INSTANCE, *,
                    settings_owned_before: bool = True) -> bool:
    """Whether a patch undoes changes made outside cachewarm (drift), rather than only
    following the caches on the bucket: a rule cachewarm recorded is gone or edited, or a
    setting other than lifecycle rules and their labels differs. Soft delete counts only
    when this cache already owned the bucket-wide settings: a cache that has just become
    their owner (e.g. an older overlapping cache that refused it was deleted) writes its
    value for the first time, which is configuration, not a repair."""
    outside = set(patch) - {"lifecycle", "labels"}
    if not settings_owned_before:
        outside.discard("softDeletePolicy")
    if outside:
        return True
    _, ours = split_rules(bucket, instance)
    return recorded(bucket, instance) != {rule_label(r) for r in ours}


def observed_delete_after_days(bucket: BucketInfo, mine: Claim, instance: str = c.DEFAULT_INSTANCE) -> int | None:
    """deleteAfterDays of this operator's rule on the bucket that covers this cache's
    entries, or None if none does."""
    _, ours = split_rules(bucket, instance)
    for rule in ours:
        cond = rule.get("condition") or {}
        prefixes = list(cond.get("matchesPrefix") or [""])
        if mine.object_prefix in prefixes and "daysSinceCustomTime" in cond:
            return int(cond["daysSinceCustomTime"])
    return None


def covered_by_other_instance(bucket: BucketInfo, object_prefix: str, instance: str) -> str | None:
    """Another operator instance whose recorded rule names this prefix (it has a cache
    there, which this operator cannot see), or None."""
    for rule in bucket.lifecycle_rules:
        owner = recorded_by(bucket.labels.get(rule_label(rule), instance))
        prefixes = list((rule.get("condition") or {}).get("matchesPrefix") or [""])
        if owner != instance and object_prefix in prefixes:
            return owner
    return None


def location_matches(bucket: BucketInfo, gcs: GcsStorage) -> bool:
    return bucket.location.casefold() == gcs.location.casefold()


def bucket_patch(bucket: BucketInfo, gcs: GcsStorage, *, plan: LifecyclePlan, owns_settings: bool,
                 created_by_us: bool, instance: str = c.DEFAULT_INSTANCE) -> dict[str, Any]:
    """The fields to PATCH so the bucket matches the spec; empty when it already does.

    Lifecycle (cachewarm's own rules and their labels) on every bucket; soft delete,
    access settings and storage class only on buckets this cache created (an adopted
    bucket's are its owner's: its soft delete protects the owner's data too), soft delete
    only by the cache that owns bucket-wide settings.
    """
    patch = lifecycle_patch(bucket, plan, instance)
    _consent_labels_unchanged(bucket, patch.get("labels"))
    wanted_soft = gcs.soft_delete_days * DAY
    if owns_settings and created_by_us and bucket.soft_delete_seconds != wanted_soft:
        patch["softDeletePolicy"] = {"retentionDurationSeconds": wanted_soft}
    if created_by_us:
        if not bucket.uniform_access or bucket.public_access_prevention != "enforced":
            patch["iamConfiguration"] = {
                "uniformBucketLevelAccess": {"enabled": True},
                "publicAccessPrevention": "enforced",
            }
        if bucket.storage_class != gcs.storage_class:
            patch["storageClass"] = gcs.storage_class
    return patch


def _consent_labels_unchanged(bucket: BucketInfo, labels: Mapping[str, Any] | None) -> None:
    """The labels that give consent (grants, creation labels) are the owner's or the create
    call's: a patch must send them as read. Raises ValueError (a bug, never sent)."""
    if labels is None:
        return
    consent_keys = {c.GCS_LABEL_MANAGED_BY, c.GCS_LABEL_NAMESPACE, c.GCS_LABEL_CACHE, c.GCS_LABEL_INSTANCE}
    changed = sorted(k for k in {*labels, *bucket.labels}
                     if (k in consent_keys or k.startswith(c.GCS_LABEL_GRANT_PREFIX))
                     and labels.get(k) != bucket.labels.get(k))
    if changed:
        raise ValueError(f"cachewarm's patch of bucket {bucket.name} would change consent labels {changed}")


def is_cache_entry(object_name: str, gcs: GcsStorage) -> bool:
    """True for a JAX cache entry directly under this cache's prefix."""
    if not object_name.startswith(gcs.object_prefix):
        return False
    return ENTRY_NAME.match(object_name[len(gcs.object_prefix):]) is not None


def is_own_manifest(object_name: str, gcs: GcsStorage, namespace: str, name: str) -> bool:
    """True for a manifest of one of this cache's pools, or its pack: exactly a name its
    warmers write (builders/placement.manifest_object, one per Job, or the legacy one per
    pool; placement.pack_object), for pool and Job names that can be ones. Never another
    cache's (its namespace and name are in the name), nor anything else in the folder."""
    folder = manifest_folder(gcs, namespace, name)
    if not object_name.startswith(folder) or not object_name.endswith((".json", PACK_SUFFIX)):
        return False
    pool = object_name[len(folder):].removesuffix(".json").split("/", 1)[0]
    return POOL_NAME.fullmatch(pool) is not None and (is_pool_manifest(object_name, gcs, namespace, name, pool)
                                                     or is_pool_pack(object_name, gcs, namespace, name, pool))
