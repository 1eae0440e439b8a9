"""The operator's Prometheus metrics: what counts as a finished warmer run (once per Job
and attempt, never again on a resync), and what /metrics exposes."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachewarm.api.metrics import Metrics, finished_runs


def status(*pools: dict[str, Any]) -> dict[str, Any]:
    return {"warmup": {"pools": list(pools)}}


RUNNING = {"name": "h100", "job": "llama-h100-1", "state": "Running", "attempt": 1}
DONE = {**RUNNING, "state": "Succeeded", "startTime": "2026-11-22T01:00:00Z", "completionTime": "2026-11-22T01:04:30Z"}


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_run_counts_once_when_it_finishes_and_not_on_later_resyncs() -> None:
    assert [(p["state"], s) for p, s in finished_runs(status(RUNNING), status(DONE))] == [("Succeeded", 270.0)]
    assert list(finished_runs(status(DONE), status(DONE))) == []  # a resync of a finished pool
    assert list(finished_runs(status(), status(RUNNING))) == []  # not finished yet


def test_a_retry_of_the_same_job_is_a_second_run() -> None:
    failed1 = {**RUNNING, "state": "Failed", "startTime": "2026-11-22T01:00:00Z", "failedTime": "2026-11-22T01:00:10Z"}
    failed2 = {**failed1, "attempt": 2}
    assert [s for _, s in finished_runs(status(failed1), status(failed2))] == [10.0]
    assert list(finished_runs(status(failed1), status(failed1))) == []


def test_a_pool_without_times_counts_without_a_duration() -> None:
    [(pool, seconds)] = finished_runs({}, status({"name": "v5p", "job": "j", "state": "Failed", "attempt": 1}))
    assert pool["name"] == "v5p" and seconds is None


def test_metrics_expose_runs_errors_admissions_and_cache_size() -> None:
    caches = [{"metadata": {"namespace": "ml", "name": "llama"},
               "status": {"cache": {"entries": 12, "bytes": 3400}}},
              {"metadata": {"namespace": "ml", "name": "new"}, "status": {}}]  # never listed: no sample
    metrics = Metrics(lambda: caches)
    metrics.record_reconcile("ml", "llama", status(RUNNING), status(DONE), None)
    metrics.record_reconcile("ml", "llama", status(DONE), status(DONE), "GCSUnavailable")
    metrics.admissions.labels("injected").inc()
    metrics.admission_seconds.labels("injected").observe(0.002)
    got = samples(metrics)
    run = frozenset({"namespace": "ml", "cache": "llama", "pool": "h100", "outcome": "Succeeded"}.items())
    assert got[("cachewarm_warmer_runs_total", run)] == 1.0
    assert got[("cachewarm_warmer_duration_seconds_sum", run)] == 270.0
    assert got[("cachewarm_reconcile_errors_total", frozenset({"reason": "GCSUnavailable"}.items()))] == 1.0
    assert got[("cachewarm_webhook_admissions_total", frozenset({"outcome": "injected"}.items()))] == 1.0
    assert got[("cachewarm_webhook_admission_duration_seconds_count",
                frozenset({"outcome": "injected"}.items()))] == 1.0
    cache = frozenset({"namespace": "ml", "cache": "llama"}.items())
    assert (got[("cachewarm_cache_entries", cache)], got[("cachewarm_cache_bytes", cache)]) == (12.0, 3400.0)
    assert ("cachewarm_cache_entries", frozenset({"namespace": "ml", "cache": "new"}.items())) not in got


def test_a_deleted_caches_series_go_and_other_caches_stay() -> None:
    metrics = Metrics()
    for name in ("llama", "gemma"):
        metrics.record_reconcile("ml", name, status(RUNNING), status(DONE), None)
        metrics.count_report("ml", name, 3, 1, 2.5)
    metrics.forget_cache("ml", "llama")
    got = samples(metrics)
    left = {dict(labels).get("cache") for (name, labels) in got if name.startswith(
        ("cachewarm_warmer_runs", "cachewarm_warmer_duration", "cachewarm_cache_hits", "cachewarm_cache_misses",
         "cachewarm_compile_seconds_saved"))}
    assert left == {"gemma"}
    assert got[("cachewarm_cache_hits_total", frozenset({"namespace": "ml", "cache": "gemma"}.items()))] == 3.0
    metrics.forget_cache("ml", "llama")  # again, or a cache never counted: nothing to remove
    metrics.forget_cache("other", "never")
