"""A training pod's report and the apiserver's review of its token, shared by the tests of
the reports endpoint (test_receiver, test_report_forwarding)."""

from __future__ import annotations

import base64
import json
from typing import Any

from cachewarm.reports.store import LabelledPods

REVIEW = {"authenticated": True, "audiences": ["cachewarm"], "user": {
    "username": "system:serviceaccount:ml:trainer",
    "extra": {"authentication.kubernetes.io/pod-name": ["trainer"], "authentication.kubernetes.io/pod-uid": ["u-1"]}}}
REPORT = {"version": 1, "pod": {"namespace": "ml", "name": "trainer", "uid": "u-1"}, "cache": "llama",
          "process": {"pid": 7, "started": 1}, "sequence": 1,
          "counts": {"requests": 2, "hits": 2, "misses": 0, "compileSecondsSaved": 3.0, "compileSecondsSpent": 0.0}}
GOOD = json.dumps(REPORT).encode()


def _b64(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def token(name: str, **claims: Any) -> str:
    """A projected-token-shaped JWT named `name` (in `jti`) for REPORT's pod, audience
    cachewarm, expiring in 2100; `claims` replace payload fields. Its signature is junk:
    only the apiserver's review (MemoryKube.reviews, keyed by this string) accepts it."""
    payload = {"aud": ["cachewarm"], "exp": 4102444800, "jti": name,
               "kubernetes.io": {"namespace": "ml", "pod": {"name": "trainer", "uid": "u-1"},
                                 "serviceaccount": {"name": "trainer", "uid": "sa-1"}}, **claims}
    return f"{_b64({'alg': 'RS256', 'kid': 'k'})}.{_b64(payload)}.c2ln"


def bearer(name: str, **claims: Any) -> dict[str, str]:
    """Authorization for token(name, **claims)."""
    return {"Authorization": f"Bearer {token(name, **claims)}"}


def labelled(*pods: tuple[str, str, str, str]) -> LabelledPods:
    """The operator's view of labelled pods: (namespace, name, uid, cache) each; by
    default REPORT's pod, labelled for its cache."""
    known = LabelledPods("cachewarm.dev/cache")
    for namespace, name, uid, cache in pods or (("ml", "trainer", "u-1", "llama"),):
        known.observe("ADDED", {"metadata": {"namespace": namespace, "name": name, "uid": uid,
                                             "labels": {"cachewarm.dev/cache": cache}}})
    return known
