"""How many pods the webhook injected per cache recently, kept in memory for status."""

from __future__ import annotations

import datetime as dt
import threading
from collections import deque


class RecentInjections:
    """Injection times per (namespace, cache) within a sliding window. Thread-safe: the
    webhook records on the event loop, status is read from handler threads."""

    def __init__(self, window_seconds: float) -> None:
        self.window = dt.timedelta(seconds=window_seconds)
        self._times: dict[tuple[str, str], deque[dt.datetime]] = {}
        self._lock = threading.Lock()

    def record(self, namespace: str, cache: str, now: dt.datetime) -> None:
        with self._lock:
            self._times.setdefault((namespace, cache), deque()).append(now)

    def summary(self, namespace: str, cache: str, now: dt.datetime) -> dict[str, object]:
        """{"recentPods": N, "windowSeconds": W, "lastInjectionTime": ...} (the last only if any)."""
        with self._lock:
            times = self._times.get((namespace, cache), deque())
            while times and now - times[0] > self.window:
                times.popleft()
            out: dict[str, object] = {"recentPods": len(times), "windowSeconds": int(self.window.total_seconds())}
            if times:
                out["lastInjectionTime"] = times[-1].strftime("%Y-%m-%dT%H:%M:%SZ")
            return out
