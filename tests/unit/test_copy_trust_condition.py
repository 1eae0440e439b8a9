"""LocalCopyAsSpecified through the reconcile (issue 28): a local-copy cache whose warmers
have recorded no manifest generation says its pods' copies are empty (NoTrustedManifest),
and says the copy is served once its warmer's own pod reports one."""

from __future__ import annotations

import json
from typing import Any

from cachewarm.api import conditions
from cachewarm.reconcile import cache as service
from cachewarm.reconcile.admitted import RecentInjections
from memkube import MemoryKube
from test_warmer_summary import GOOD, META, NOW, Gcs, job_pod

BODY = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
        "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]},
        "injection": {"mode": "ReadOnly", "localCopy": {}}}


def reconcile(kube: MemoryKube, status: dict[str, Any]) -> service.Outcome:
    wiring = service.Wiring(gcs=Gcs(), kube=kube, warmer_image="w", injections=RecentInjections(60),
                            claims=lambda bucket: [])
    return service.reconcile_cache(wiring, service.CacheObject("ml", "llama", BODY, META, status), now=NOW)


def copy_condition(status: dict[str, Any]) -> tuple[bool, str, str]:
    cond = conditions.get(status.get("conditions"), "LocalCopyAsSpecified") or {}
    return cond.get("status") == "True", str(cond.get("reason")), str(cond.get("message"))


def test_the_copy_is_said_empty_until_the_warmers_own_pod_records_a_manifest() -> None:
    kube = MemoryKube()
    first = reconcile(kube, {})
    ok, reason, message = copy_condition(first.status)
    assert (ok, reason) == (False, "NoTrustedManifest")
    assert "(a)" in message and "start cold" in message
    # The Job succeeds; its own pod's summary names the manifest generation it wrote.
    [job] = kube.jobs
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1,
                     "startTime": "2026-11-22T06:00:00Z", "completionTime": "2026-11-22T06:30:00Z"}
    kube.pods.append(job_pod(job, json.dumps(GOOD)))
    second = reconcile(kube, first.status)
    assert second.failure is None, second.failure
    assert second.status["warmup"]["pools"][0].get("manifestGeneration") == "17"
    assert copy_condition(second.status)[:2] == (True, "PerPodCopy")
