"""Prometheus metrics of the operator (prometheus_client), served on their own port.

What each replica can know is exported by that replica: admissions, and connections its
listeners refused, by the replica that served them; reports by the replica that answered
them (one a follower forwarded by the leader, and by the follower as forwarded); warmer
runs and reconcile errors by the leader (the only one reconciling); cache entries and
bytes by every replica, read from the caches' status at scrape time (every replica watches the caches). Counters restart at 0 with the process, as Prometheus
counters do; `rate()` and `increase()` handle that. The series of a cache (its warmer runs
and durations, its pods' hits, misses and seconds saved) go when the cache is deleted, so a
cluster that churns caches does not grow a replica's registry without end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cachewarm.api import timefmt

# Warmer runs last from seconds (a small program on CPU) to hours (a large model's first
# compile on a big slice).
WARMER_BUCKETS = (10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
# The apiserver gives the webhook at most 10 s (our configuration's timeoutSeconds).
ADMISSION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0)
FINISHED = ("Succeeded", "Failed")


class Metrics:
    """The operator's metrics in a registry of their own (no process or platform
    collectors mixed in from elsewhere)."""

    def __init__(self, caches: Callable[[], Iterable[Mapping[str, Any]]] = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        self.warmer_runs = Counter(
            "cachewarm_warmer_runs", "Warmer Jobs that finished, by pool and outcome (Succeeded or Failed).",
            ["namespace", "cache", "pool", "outcome"], registry=self.registry)
        self.warmer_duration = Histogram(
            "cachewarm_warmer_duration_seconds", "How long finished warmer Jobs ran (start to completion).",
            ["namespace", "cache", "pool", "outcome"], buckets=WARMER_BUCKETS, registry=self.registry)
        self.reconcile_errors = Counter(
            "cachewarm_reconcile_errors", "Reconciles that ended in an error worth a retry, by reason.",
            ["reason"], registry=self.registry)
        self.admissions = Counter(
            "cachewarm_webhook_admissions", "Labelled pods admitted by this replica's webhook, by outcome "
            "(injected, unchanged, error; a pod is admitted in every case).", ["outcome"], registry=self.registry)
        self.admission_seconds = Histogram(
            "cachewarm_webhook_admission_duration_seconds", "Time cachewarm's admission handler took, by outcome.",
            ["outcome"], buckets=ADMISSION_BUCKETS, registry=self.registry)
        self.reports = Counter(
            "cachewarm_reports", "Reports from training pods by the HTTP status answered (202 taken; 400, 401, 403, "
            "404, 413, 429 refused; 503 not the leader or the token could not be reviewed). A report a follower "
            "forwarded is counted by the leader only.", ["code"],
            registry=self.registry)
        self.reports_forwarded = Counter(
            "cachewarm_reports_forwarded", "Reports this follower forwarded to the leader, by the leader's HTTP status "
            "(relayed to the pod), or failed when the leader could not be reached.", ["code"],
            registry=self.registry)
        self.cache_hits = Counter(
            "cachewarm_cache_hits", "Persistent-cache hits training pods reported (the leader's count). Not a torch "
            "cache's: those are cachewarm_torch_fx_graph_hits, of the pods that saved time.",
            ["namespace", "cache"], registry=self.registry)
        self.cache_misses = Counter(
            "cachewarm_cache_misses", "Compile requests training pods reported that did not hit the cache.",
            ["namespace", "cache"], registry=self.registry)
        self.seconds_saved = Counter(
            "cachewarm_compile_seconds_saved", "Compile seconds JAX estimates its cache hits saved in training pods.",
            ["namespace", "cache"], registry=self.registry)
        self.listener_dropped = Counter(
            "cachewarm_listener_connections_dropped", "Connections a listener (admission, reports) refused or closed "
            "before its client did, by reason: connection_cap, peer_cap, tls_handshake (not TLS, no or an unverified "
            "client certificate), handshake_deadline, header_deadline, body_deadline, body_too_large.",
            ["listener", "reason"], registry=self.registry)
        self.client_ca_stale = Gauge(
            "cachewarm_admission_client_ca_stale", "1 while the admission client CA file cannot be read or holds no "
            "certificate: the admission listener still asks for a certificate of the CA it last loaded; else 0.",
            registry=self.registry)
        self.registry.register(_CacheCollector(caches))
        # (namespace, cache) -> the label values each per-cache metric has for it.
        self._series: dict[tuple[str, str], set[tuple[Any, tuple[str, ...]]]] = {}

    def _of_cache(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)` for a metric whose first two labels are the cache's
        namespace and name, remembered so that `forget_cache` can remove it."""
        self._series.setdefault((labels[0], labels[1]), set()).add((metric, labels))
        return metric.labels(*labels)

    def count_report(self, namespace: str, cache: str, hits: float, misses: float, saved: float) -> None:
        """What a report added beyond its process's previous one."""
        self._of_cache(self.cache_hits, namespace, cache).inc(hits)
        self._of_cache(self.cache_misses, namespace, cache).inc(misses)
        self._of_cache(self.seconds_saved, namespace, cache).inc(saved)

    def forget_cache(self, namespace: str, cache: str) -> None:
        """Remove every series of a deleted cache."""
        for metric, labels in self._series.pop((namespace, cache), set()):
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics over HTTP from a daemon thread. Raises OSError (port taken)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def record_reconcile(self, namespace: str, name: str, before: Mapping[str, Any], after: Mapping[str, Any],
                         failure_reason: str | None) -> None:
        """After a reconcile whose status was written: the warmer runs that finished in it
        (a pool whose Job is now Succeeded or Failed and was not, for that Job, in the
        status before), and the error it ended with, if any."""
        for pool, seconds in finished_runs(before, after):
            outcome = str(pool["state"])
            self._of_cache(self.warmer_runs, namespace, name, str(pool.get("name")), outcome).inc()
            if seconds is not None:
                self._of_cache(self.warmer_duration, namespace, name, str(pool.get("name")), outcome).observe(seconds)
        if failure_reason:
            self.reconcile_errors.labels(failure_reason).inc()


def finished_runs(before: Mapping[str, Any], after: Mapping[str, Any]
                  ) -> Iterator[tuple[Mapping[str, Any], float | None]]:
    """Pools of `after` whose warmer finished since `before`, with how long it ran (None
    when the Job's times are not known). A pool that was already finished for the same
    Job and attempt is not counted again, so a resync counts nothing."""
    old = {p.get("name"): p for p in (before.get("warmup") or {}).get("pools") or []}
    for pool in (after.get("warmup") or {}).get("pools") or []:
        if pool.get("state") not in FINISHED or not pool.get("job"):
            continue
        prev = old.get(pool.get("name")) or {}
        if (prev.get("state"), prev.get("job"), prev.get("attempt")) == \
                (pool.get("state"), pool.get("job"), pool.get("attempt")):
            continue
        yield pool, _seconds(pool.get("startTime"), pool.get("completionTime") or pool.get("failedTime"))


def _seconds(start: Any, end: Any) -> float | None:
    try:
        began, ended = timefmt.parse(start), timefmt.parse(end)
    except ValueError:
        return None
    return max((ended - began).total_seconds(), 0.0)


# status.usage.torch (a torch cache's pods, in the usage window), one gauge per field.
TORCH_GAUGES = {
    "pods": ("cachewarm_torch_pods", "Pods of a torch cache whose reports carried torch's counters in the usage "
             "window (status.usage.torch.pods)."),
    "fxGraphHits": ("cachewarm_torch_fx_graph_hits", "Inductor FX graph cache hits torch counted in the pods, "
                    "but for those of pods that hit and saved no time (status.usage.torch.fxGraphHits)."),
    "fxGraphHitsNotSaved": ("cachewarm_torch_fx_graph_hits_not_saved", "Inductor FX graph cache hits torch counted "
                            "in the pods whose counters hit but that saved no time (hitButNotSaved)."),
    "fxGraphMisses": ("cachewarm_torch_fx_graph_misses", "Inductor FX graph cache misses torch counted in the pods."),
    "aotAutogradHits": ("cachewarm_torch_aot_autograd_hits", "AOTAutograd cache hits torch counted in the pods, "
                        "but for those of pods that hit and saved no time."),
    "aotAutogradHitsNotSaved": ("cachewarm_torch_aot_autograd_hits_not_saved", "AOTAutograd cache hits torch "
                                "counted in the pods whose counters hit but that saved no time."),
    "aotAutogradMisses": ("cachewarm_torch_aot_autograd_misses", "AOTAutograd cache misses torch counted in the "
                          "pods."),
    "compileSeconds": ("cachewarm_torch_compile_seconds", "Seconds torch spent compiling in the pods."),
    "warmerCompileSeconds": ("cachewarm_torch_warmer_compile_seconds", "Seconds the pods that hit would have "
                             "compiled cold, as the warm of their fingerprint took."),
    "measuredCompileSeconds": ("cachewarm_torch_measured_compile_seconds", "Seconds those same pods (the ones "
                               "measured against a warm) spent compiling."),
    "secondsSaved": ("cachewarm_torch_seconds_saved", "Seconds the pods' hits saved, measured against the warm of "
                     "their fingerprint (status.usage.torch.secondsSaved)."),
    "hitButNotSaved": ("cachewarm_torch_hit_but_not_saved_pods", "Pods whose torch counters hit but whose compile "
                       "seconds were above half the warmer's: not counted as hits, nor as time saved."),
}


class _CacheCollector(Collector):
    """Entries and bytes of each cache as its status last reported them (the inventory), and
    its pods' missed programs by cause and measured seconds saved (status.usage), and a
    torch cache's counters and seconds (status.usage.torch)."""

    def __init__(self, caches: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._caches = caches

    def collect(self) -> Iterator[GaugeMetricFamily]:
        entries = GaugeMetricFamily("cachewarm_cache_entries", "JAX cache entries under the cache's prefix, "
                                    "as last listed.", labels=["namespace", "cache"])
        size = GaugeMetricFamily("cachewarm_cache_bytes", "Bytes of those entries, as last listed.",
                                 labels=["namespace", "cache"])
        missed = GaugeMetricFamily("cachewarm_missed_programs", "Programs the cache's pods compiled in the usage "
                                   "window (status.usage.missedPrograms), by cause.",
                                   labels=["namespace", "cache", "cause"])
        lost = GaugeMetricFamily("cachewarm_missed_program_seconds", "Seconds the pods spent compiling those "
                                 "programs, by cause.", labels=["namespace", "cache", "cause"])
        saved = GaugeMetricFamily("cachewarm_measured_seconds_saved", "Seconds the pods' hits saved in the usage "
                                  "window, measured (status.usage.measuredSecondsSaved): a program's compile seconds "
                                  "(as pods compiled it in the window, else as the cache's warmer did) times its hits, "
                                  "less their load seconds.", labels=["namespace", "cache"])
        torch = {name: GaugeMetricFamily(metric, help_text, labels=["namespace", "cache"])
                 for name, (metric, help_text) in TORCH_GAUGES.items()}
        for body in list(self._caches()):
            meta, status = body.get("metadata") or {}, body.get("status") or {}
            cache, usage = status.get("cache") or {}, status.get("usage") or {}
            labels = [str(meta.get("namespace") or ""), str(meta.get("name") or "")]
            if "entries" in cache:
                entries.add_metric(labels, float(cache.get("entries") or 0))
                size.add_metric(labels, float(cache.get("bytes") or 0))
            by_cause: dict[str, tuple[int, float]] = {}
            for one in usage.get("missedPrograms") or []:
                if isinstance(one, Mapping) and isinstance(one.get("cause"), str):
                    count, seconds = by_cause.get(one["cause"], (0, 0.0))
                    by_cause[one["cause"]] = (count + 1, seconds + float(one.get("compileSeconds") or 0))
            for cause, (count, seconds) in sorted(by_cause.items()):
                missed.add_metric([*labels, cause], float(count))
                lost.add_metric([*labels, cause], seconds)
            if isinstance(usage.get("measuredSecondsSaved"), (int, float)):
                saved.add_metric(labels, float(usage["measuredSecondsSaved"]))
            used = usage.get("torch")
            used = used if isinstance(used, Mapping) else {}
            for name, family in torch.items():
                value = used.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric(labels, float(value))
        yield entries
        yield size
        yield missed
        yield lost
        yield saved
        yield from torch.values()
