"""How many pods the webhook injected per cache recently, kept in memory for status.

Counted from the labelled pods the operator watches (each carries the webhook's
annotation), not from the admissions one replica served: every replica serves the
webhook, and the leader, which writes status, sees every injected pod this way."""

from __future__ import annotations

import datetime as dt
import threading

from cachewarm.api import timefmt


class RecentInjections:
    """Injected pods per (namespace, cache) created within a sliding window, each counted
    once however often it is seen. Thread-safe: pods are recorded on the event loop,
    status is read from reconcile threads."""

    def __init__(self, window_seconds: float) -> None:
        self.window = dt.timedelta(seconds=window_seconds)
        self._pods: dict[tuple[str, str], dict[str, dt.datetime]] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, cache: str, pod_uid: str, created: dt.datetime) -> None:
        with self._lock:
            self._pods.setdefault((namespace, cache), {})[pod_uid] = created

    def summary(self, namespace: str, cache: str, now: dt.datetime) -> dict[str, object]:
        """{"recentPods": N, "windowSeconds": W, "lastInjectionTime": ...} (the last only if any)."""
        with self._lock:
            pods = self._pods.get((namespace, cache), {})
            for uid in [u for u, t in pods.items() if now - t > self.window]:
                del pods[uid]
            out: dict[str, object] = {"recentPods": len(pods), "windowSeconds": int(self.window.total_seconds())}
            if pods:
                out["lastInjectionTime"] = timefmt.rfc3339(max(pods.values()))
            return out
