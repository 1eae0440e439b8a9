"""The inventory (a listing of the cache's entries on the bucket, billed per page) follows
change, not time: a resync of a cache nothing happened to lists nothing and keeps the last
verdict; a new spec, a warm that finished since, entries left unstamped or the slow cadence
(CACHEWARM_INVENTORY_SECONDS) list once. GCS is a stand-in counting its listings; the
warmers' outcome is given (the e2e tests run real ones)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from cachewarm.reconcile import cache as service
from cachewarm.reconcile import status as cache_status
from cachewarm.reconcile import warmup as warmups
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.reconcile.warmup import WarmupOutcome
from memgcs import MemoryBucket
from memkube import MemoryKube

NOW = dt.datetime(2026, 11, 22, 7, 0, tzinfo=dt.timezone.utc)
HOUR = dt.timedelta(hours=1)
META = {"generation": 3, "uid": "u-1", "creationTimestamp": "2026-11-22T00:00:00Z"}
SPEC = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
        "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}}


def iso(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def finished_warm(monkeypatch: pytest.MonkeyPatch, pools: list[dict[str, Any]]) -> None:
    """The warmers' reconcile finds these pools (its Warmed verdict from the keys it is given)."""
    def reconcile_warmup(kube: Any, cache: Any, *, cache_entries: int, warmed_before: bool,
                         entry_keys: frozenset[str] | None, **_: Any) -> WarmupOutcome:
        return WarmupOutcome(warmups.warmed_condition(pools, cache_entries, warmed_before, entry_keys),
                             [dict(p) for p in pools])
    monkeypatch.setattr(service, "reconcile_warmup", reconcile_warmup)


def reconcile(gcs: MemoryBucket, status: dict[str, Any], now: dt.datetime = NOW) -> service.Outcome:
    wiring = service.Wiring(gcs=gcs, kube=MemoryKube(), warmer_image="w", injections=RecentInjections(60),  # type: ignore[arg-type]
                            claims=lambda bucket: [], inventory_every=HOUR)
    return service.reconcile_cache(wiring, service.CacheObject("ml", "llama", SPEC, META, status), now=now)


def warmed(outcome: service.Outcome) -> dict[str, Any]:
    return next(c for c in outcome.status["conditions"] if c["type"] == "Warmed")


POOL = {"name": "a", "job": "llama-a-1", "state": "Succeeded", "completionTime": "2026-11-22T06:00:00Z",
        "keys": ["1111111111111111", "2222222222222222"]}
KEYS = ["1111111111111111", "2222222222222222"]


def settled(gcs: MemoryBucket, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The status a first reconcile (which lists) leaves, merged as the apiserver would."""
    finished_warm(monkeypatch, [POOL])
    first = reconcile(gcs, {})
    assert gcs.listings == 1 and warmed(first)["reason"] == "Warmed"
    return first.status


@pytest.mark.parametrize(("cache", "generation", "now", "due"), [
    (None, 3, NOW, True),                                                     # never listed
    ({"entries": 5, "listedTime": iso(NOW)}, 2, NOW, True),                   # a new spec
    ({"entries": 5, "listedTime": iso(NOW), "unstamped": 7}, 3, NOW, True),   # stamping left for later
    ({"entries": 5, "listedTime": iso(NOW)}, 3, NOW + HOUR - dt.timedelta(seconds=1), False),
    ({"entries": 5, "listedTime": iso(NOW)}, 3, NOW + HOUR, True),            # the slow cadence
    ({"entries": 5, "listedTime": "yesterday"}, 3, NOW, True),                # unreadable: list
])
def test_when_the_inventory_is_due(cache: dict[str, Any] | None, generation: int, now: dt.datetime,
                                   due: bool) -> None:
    status = {"observedGeneration": 3, **({"cache": cache} if cache else {})}
    assert cache_status.inventory_due(status, generation, now, HOUR) is due


def test_a_resync_of_an_unchanged_warm_cache_lists_nothing_and_keeps_its_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    again = reconcile(gcs, status, NOW + dt.timedelta(minutes=5))
    assert gcs.listings == 1
    assert warmed(again) == warmed(reconcile(gcs, status, NOW + dt.timedelta(minutes=10)))
    assert warmed(again)["reason"] == "Warmed" and again.status["cache"] == status["cache"]


def test_a_warm_that_finished_since_the_last_listing_is_checked_against_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    rewarmed = {**POOL, "job": "llama-a-2", "completionTime": "2026-11-22T07:03:00Z",
                "keys": ["1111111111111111", "3333333333333333"]}
    finished_warm(monkeypatch, [rewarmed])
    outcome = reconcile(gcs, status, NOW + dt.timedelta(minutes=5))
    assert gcs.listings == 2
    assert warmed(outcome)["reason"] == "EntriesMissing" and "a: 1 of 2" in warmed(outcome)["message"]
    assert outcome.status["cache"]["listedTime"] == iso(NOW + dt.timedelta(minutes=5))
    # ...and that verdict, too, stands on the next resync without a listing.
    merged = {**status, **outcome.status}
    assert warmed(reconcile(gcs, merged, NOW + dt.timedelta(minutes=10)))["reason"] == "EntriesMissing"
    assert gcs.listings == 2


def test_a_warm_that_finishes_after_a_due_listing_is_checked_against_a_listing_taken_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listing due anyway (here: a new spec) runs before the Jobs are read; a warmer that
    writes its last entry and finishes in between must not be judged by that listing."""
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    rewarmed = {**POOL, "job": "llama-a-2", "completionTime": "2026-11-22T07:03:00Z",
                "keys": ["1111111111111111", "3333333333333333"]}

    def finishes_now(kube: Any, cache: Any, *, cache_entries: int, warmed_before: bool,
                     entry_keys: frozenset[str] | None, **_: Any) -> WarmupOutcome:
        gcs.keys = [*KEYS, "3333333333333333"]  # its last entry landed after the listing
        return WarmupOutcome(warmups.warmed_condition([rewarmed], cache_entries, warmed_before, entry_keys),
                             [dict(rewarmed)])
    monkeypatch.setattr(service, "reconcile_warmup", finishes_now)
    outcome = reconcile(gcs, {**status, "observedGeneration": 2}, NOW + dt.timedelta(minutes=5))
    assert gcs.listings == 2  # the one due is taken after the Jobs were read: once, and late enough
    assert warmed(outcome)["reason"] == "Warmed" and outcome.status["cache"]["entries"] == 3


def test_an_entry_deleted_behind_the_operators_back_is_seen_at_the_slow_cadence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The price of listing by change: a deletion nothing announces waits for the cadence."""
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    gcs.keys = KEYS[:1]
    assert warmed(reconcile(gcs, status, NOW + HOUR - dt.timedelta(seconds=1)))["reason"] == "Warmed"
    assert warmed(reconcile(gcs, status, NOW + HOUR))["reason"] == "EntriesMissing"
    assert gcs.listings == 2


def test_a_warm_in_progress_is_polled_without_listings(monkeypatch: pytest.MonkeyPatch) -> None:
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    finished_warm(monkeypatch, [{**POOL, "job": "llama-a-2", "state": "Running", "completionTime": None}])
    for minute in range(1, 6):
        outcome = reconcile(gcs, status, NOW + dt.timedelta(minutes=minute))
        assert warmed(outcome)["reason"] == "Rewarming"
    assert gcs.listings == 1


def test_the_warmed_verdict_is_not_reused_for_a_condition_that_does_not_come_from_a_listing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gcs = MemoryBucket(KEYS, custom_time=NOW)
    status = settled(gcs, monkeypatch)
    status["conditions"] = [c if c["type"] != "Warmed" else {**c, "reason": "Warming", "status": "False"}
                            for c in status["conditions"]]
    assert warmed(reconcile(gcs, status, NOW + dt.timedelta(minutes=5)))["reason"] == "Warmed"
    assert gcs.listings == 2
