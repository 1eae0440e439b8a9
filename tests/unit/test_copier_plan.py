"""What the copier picks from a listing: entries only, the manifest's keys only, the
smallest first within the byte budget."""

from __future__ import annotations

from cachewarm.copier import Settings, plan

A, B, C = "a" * 64, "b" * 64, "c" * 64
LISTING = [
    {"name": f"jax/jit_step-{A}-cache", "size": 300},
    {"name": f"jax/jit_eval-{B}-cache", "size": 100},
    {"name": f"jax/jit_init-{C}-cache", "size": 200},
    {"name": f"jax/jit_step-{A}-atime", "size": 8},     # JAX's LRU bookkeeping
    {"name": f"jax/sub/jit_x-{A}-cache", "size": 10},   # another cache's folder
    {"name": "jax/README", "size": 10},
]


def test_only_entries_of_the_manifest_are_picked() -> None:
    picked, left = plan(LISTING, "jax/", (A[:16], C[:16]), 10**9)
    assert [o["name"] for o in picked] == [f"jax/jit_init-{C}-cache", f"jax/jit_step-{A}-cache"]
    assert left == {"notAnEntry": 3, "notInManifest": 1, "overBudget": 0}


def test_without_a_manifest_every_entry_smallest_first_within_the_budget() -> None:
    picked, left = plan(LISTING, "jax/", None, 350)
    assert [o["size"] for o in picked] == [100, 200]
    assert left["overBudget"] == 1
    assert plan(LISTING, "jax/", (), 10**9)[0] == []  # a manifest with no keys: nothing


def test_settings_come_from_the_environment_with_bounds() -> None:
    s = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d", "CACHEWARM_COPY_PREFIX": "/x/y/",
                           "CACHEWARM_COPY_KEYS": "aa, bb,", "CACHEWARM_COPY_WORKERS": "500"})
    assert (s.prefix, s.keys, s.workers, s.endpoint) == ("x/y/", ("aa", "bb"), 64, "https://storage.googleapis.com")
