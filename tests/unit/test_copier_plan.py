"""What the copier picks from a listing: entries only, the union of the manifests' entries
only (or every entry), the entries already in the destination kept and counted first, then
the smallest first within the byte budget; and what a manifest must look like."""

from __future__ import annotations

import json

import pytest

from cachewarm.copier import Settings, manifest_entries, plan

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
STEP, EVAL, INIT = f"jit_step-{A}-cache", f"jit_eval-{B}-cache", f"jit_init-{C}-cache"
LISTING = [
    {"name": f"jax/{STEP}", "size": "300"},             # GCS lists sizes as strings
    {"name": f"jax/{EVAL}", "size": 100},
    {"name": f"jax/{INIT}", "size": 200},
    {"name": f"jax/jit_step-{A}-atime", "size": 8},     # JAX's LRU bookkeeping
    {"name": f"jax/sub/jit_x-{A}-cache", "size": 10},   # another cache's folder
    {"name": "jax/README", "size": 10},
]


def names(objects: list) -> list[str]:
    return [str(o["name"]).removeprefix("jax/") for o in objects]


def test_only_the_union_of_the_manifests_entries_is_picked() -> None:
    union = frozenset({STEP, INIT}) | frozenset({INIT, f"jit_gone-{D}-cache"})
    picked = plan(LISTING, "jax/", union, 10**9)
    assert (names(picked.download), picked.present) == ([INIT, STEP], [])
    assert picked.left == {"notAnEntry": 3, "notInManifest": 1, "notInBucket": 1, "overBudget": 0}


def test_without_a_manifest_every_entry_smallest_first_within_the_budget() -> None:
    picked = plan(LISTING, "jax/", None, 350)
    assert [int(o["size"]) for o in picked.download] == [100, 200]
    assert picked.left == {"notAnEntry": 3, "notInManifest": 0, "notInBucket": 0, "overBudget": 1}
    assert plan(LISTING, "jax/", frozenset(), 10**9).download == []  # manifests with no entries: nothing


def test_entries_present_with_the_listed_size_are_kept_and_count_against_the_budget_first() -> None:
    # STEP is there whole; EVAL is there with another size (not ours, or cut short): copied again.
    local = {STEP: 300, EVAL: 99, "unrelated-file": 5}
    picked = plan(LISTING, "jax/", None, 500, present=local)
    assert names(picked.present) == [STEP] and picked.present_bytes == 300
    # 500 - 300 left: EVAL (100) fits, then INIT (200) does not.
    assert names(picked.download) == [EVAL]
    assert picked.left["overBudget"] == 1
    # Present entries are on disk anyway: kept even beyond the budget, and nothing more copied.
    over = plan(LISTING, "jax/", frozenset({STEP, EVAL}), 50, present=local)
    assert (names(over.present), over.download, over.left["overBudget"]) == ([STEP], [], 1)
    # Only what is wanted counts as present.
    assert plan(LISTING, "jax/", frozenset({INIT}), 10**9, present=local).present == []


@pytest.mark.parametrize("doc", [
    "not json", json.dumps([]), json.dumps({"version": 2, "entries": []}), json.dumps({"version": 1}),
    json.dumps({"version": 1, "entries": {}}), json.dumps({"version": 1, "entries": [STEP]}),
    json.dumps({"version": 1, "entries": [{"name": "../etc/passwd"}]}),
    json.dumps({"version": 1, "entries": [{"name": f"sub/{STEP}"}]}),
    json.dumps({"version": 1, "entries": [{"name": ""}]}),
])
def test_a_manifest_of_another_shape_is_refused(doc: str) -> None:
    with pytest.raises(ValueError):
        manifest_entries(doc.encode())


def test_a_manifest_lists_entry_names() -> None:
    doc = {"version": 1, "pool": "h100", "entries": [{"name": STEP, "size": 300}, {"name": INIT, "size": 200}],
           "fingerprint": {}, "writtenTime": "2026-01-01T00:00:00Z"}
    assert manifest_entries(json.dumps(doc).encode()) == {STEP, INIT}
    assert manifest_entries(b'{"version": 1, "entries": []}') == frozenset()


def test_settings_come_from_the_environment_with_bounds() -> None:
    s = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d", "CACHEWARM_COPY_PREFIX": "/x/y/",
                           "CACHEWARM_COPY_MANIFESTS": "m/a.json, m/b.json,,m/a.json",
                           "CACHEWARM_COPY_WORKERS": "500"})
    assert (s.prefix, s.manifests, s.workers, s.endpoint) == ("x/y/", ("m/a.json", "m/b.json"), 64,
                                                              "https://storage.googleapis.com")
    d = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d",
                           "CACHEWARM_COPY_MANIFESTS": " , "})
    assert (d.prefix, d.manifests, d.workers, d.max_bytes) == ("", (), 16, 8 << 30)
