"""How many pods the webhook injected per cache recently, and how many of its live pods
it gave no token because they opted out, kept in memory for status.

Counted from the labelled pods the operator watches (each carries the webhook's
annotation), not from the admissions one replica served: every replica serves the
webhook, and the leader, which writes status, sees every injected pod this way."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Mapping
from typing import Any, Final

from cachewarm.api import constants as c
from cachewarm.api import timefmt

# Said in a pod's injected annotation (after "; ") when the webhook gave it no projected
# token and no reporter because it opted out of ServiceAccount tokens (its own
# automountServiceAccountToken false, or unset and its ServiceAccount's false): what
# status.reports.podsOptedOut counts, so that it counts what the webhook decided.
OPTED_OUT_NOTE: Final = "no token or reporter: opted out of ServiceAccount tokens"


def opted_out(pod: Mapping[str, Any]) -> bool:
    """Whether the webhook noted `pod` as opted out of tokens (its annotation) and the pod
    is live: neither finished nor being deleted."""
    meta = pod.get("metadata") or {}
    noted = f"; {OPTED_OUT_NOTE}" in str((meta.get("annotations") or {}).get(c.INJECTED_ANNOTATION) or "")
    return noted and not meta.get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


class RecentInjections:
    """Injected pods per (namespace, cache) created within a sliding window, each counted
    once however often it is seen. Thread-safe: pods are recorded on the event loop,
    status is read from reconcile threads."""

    def __init__(self, window_seconds: float) -> None:
        self.window = dt.timedelta(seconds=window_seconds)
        self._pods: dict[tuple[str, str], dict[str, dt.datetime]] = {}
        self._opted_out: dict[str, tuple[str, str]] = {}  # pod uid -> (namespace, cache)
        self._lock = threading.Lock()

    def observe_pod(self, event_type: str | None, pod: Mapping[str, Any]) -> None:
        """A watch event of a labelled pod: kept while it is live and the webhook noted it
        as opted out of tokens (`opted_out`), under the cache it is labelled for now."""
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
        cache = (meta.get("labels") or {}).get(c.CACHE_LABEL)
        with self._lock:
            if event_type == "DELETED" or not cache or not opted_out(pod):
                self._opted_out.pop(uid, None)
            else:
                self._opted_out[uid] = (str(meta.get("namespace") or ""), str(cache))

    def opted_out(self, namespace: str, cache: str) -> int:
        """The live pods of this cache the webhook gave no token because they opted out."""
        with self._lock:
            return sum(1 for key in self._opted_out.values() if key == (namespace, cache))

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
