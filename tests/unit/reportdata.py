"""A training pod's report and the apiserver's review of its token, shared by the tests of
the reports endpoint (test_receiver, test_report_forwarding)."""

from __future__ import annotations

import json

REVIEW = {"authenticated": True, "audiences": ["cachewarm"], "user": {
    "username": "system:serviceaccount:ml:trainer",
    "extra": {"authentication.kubernetes.io/pod-name": ["trainer"], "authentication.kubernetes.io/pod-uid": ["u-1"]}}}
REPORT = {"version": 1, "pod": {"namespace": "ml", "name": "trainer", "uid": "u-1"}, "cache": "llama",
          "process": {"pid": 7, "started": 1}, "sequence": 1,
          "counts": {"requests": 2, "hits": 2, "misses": 0, "compileSecondsSaved": 3.0, "compileSecondsSpent": 0.0}}
GOOD = json.dumps(REPORT).encode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
