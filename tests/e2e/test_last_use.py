"""A warmer whose identity may not set customTime, end to end: the operator's warmer Job
runs on the testbed's node (the stand-in kubelet), GCS refuses its customTime PATCHes (403,
through the fidelity proxy), and the operator reports that in the pool's status and one
LastUseNotRefreshed Warning, while the warm itself stays a success. The entries keep the
customTime their last refresh gave them, so cachewarm's rule deletes them deleteAfterDays
after that, as the Warning says (README, "Permissions")."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from google.cloud import storage

from cachewarm_testbed import lifecycle_eval as ev
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def warmed_by(bed: Testbed, ns: str, name: str, not_job: str | None = None, timeout: float = 240) -> dict[str, Any]:
    """The cache once fully warm (Warmed True, not warming) by a Job other than `not_job`."""
    def check() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns)
        warmed = conditions(obj).get("Warmed") or {}
        pools = (((obj or {}).get("status") or {}).get("warmup") or {}).get("pools") or [{}]
        if warmed.get("status") == "True" and warmed.get("reason") not in ("Warming", "Rewarming") \
                and pools[0].get("state") == "Succeeded" and pools[0].get("job") != not_job:
            return obj
        return None
    return eventually(check, timeout=timeout, what=f"{ns}/{name} warmed" + (f" by a Job other than {not_job}"
                                                                              if not_job else ""))


def entries(gcs: storage.Client, bucket: str) -> dict[str, dt.datetime | None]:
    return {blob.name: blob.custom_time for blob in gcs.list_blobs(bucket, prefix="jax/")
            if blob.name.endswith("-cache")}


def test_a_warmer_that_may_not_set_custom_time_is_said_in_status_and_an_event_and_entries_keep_their_last_refresh(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client, proxy: ProxyControl,
) -> None:
    bed = controller_manager
    bucket = f"last-use-{uuid.uuid4().hex[:8]}"
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1",
                                            "lifecycle": {"deleteAfterDays": 10}}},
                        "jax": {"minCompileTimeSecs": 0},
                        "warmup": {"image": "demo/train:1", "targets": ["train:targets"], "pools": [{"name": "cpu"}]}}},
              namespace)
    # A first warm writes the entries and refreshes their customTime, as it should.
    first = warmed_by(bed, namespace, "llama")
    [pool] = first["status"]["warmup"]["pools"]
    assert pool["entriesWritten"] >= 1
    assert "refreshFailed" not in pool and "refreshError" not in pool
    refreshed = entries(gcs, bucket)
    assert len(refreshed) == pool["entriesWritten"] and all(refreshed.values()), refreshed

    # From now on GCS refuses every metadata PATCH of the bucket's objects (the identity
    # lacks storage.objects.update); a re-warm finds the same entries and cannot refresh them.
    proxy.clear_log()
    proxy.faults([{"method": "PATCH", "path": f"^/storage/v1/b/{bucket}/o/", "status": 403, "times": 10_000}])
    try:
        annotated = bed.kubectl_run("annotate", "ccache", "llama", "-n", namespace, "cachewarm.dev/rewarm=1")
        assert annotated.returncode == 0, annotated.stderr
        second = warmed_by(bed, namespace, "llama", not_job=pool["job"])
    finally:
        proxy.clear_faults()

    [again] = second["status"]["warmup"]["pools"]
    assert again["state"] == "Succeeded"  # the warm itself worked
    assert (again["entriesFound"], again["entriesWritten"]) == (len(refreshed), 0)
    assert again["refreshFailed"] >= 1  # status keeps no count of the refreshed ones
    assert "permission denied setting customTime" in again["refreshError"]
    assert "storage.objects.update" in again["refreshError"]
    warmed = conditions(second)["Warmed"]
    assert (warmed["status"], warmed["reason"]) == ("True", "Warmed")  # not failed by it
    events = [e for e in bed.events_for("llama", namespace) if e["reason"] == "LastUseNotRefreshed"]
    assert [(e["type"], e["message"]) for e in events] == [
        ("Warning", f"Warmer Job {again['job']} could not refresh entries' customTime: {again['refreshError']}")]

    # Context, not a claim about the operator: the fault rule refuses every object PATCH, so
    # no PATCH reaches GCS and no customTime can move, whatever the operator or warmer does.
    # These two lines describe the fault (and that the proxy applied it); the claims are the
    # status and the Event above. What follows is what that means for the entries: each is
    # deleted deleteAfterDays after the refresh of the first warm, not of this one.
    assert [r for r in proxy.writes() if r["method"] == "PATCH" and f"/b/{bucket}/o/" in r["path"]] == []
    assert entries(gcs, bucket) == refreshed
    rules = [dict(r) for r in gcs.get_bucket(bucket).lifecycle_rules]
    for name, stamped in refreshed.items():
        assert stamped is not None
        entry = ev.ObjectState(name, stamped, stamped)
        assert not ev.deletes(rules, entry, stamped + dt.timedelta(days=10) - dt.timedelta(seconds=1)), name
        assert ev.deletes(rules, entry, stamped + dt.timedelta(days=10)), name

    # Said once: later reconciles of the cache (each reads the bucket once; the fast poll and
    # resyncs) post no second Warning.
    proxy.clear_log()
    eventually(lambda: sum(1 for r in proxy.log() if r["method"] == "GET"
                           and r["path"].rstrip("/") == f"/storage/v1/b/{bucket}") >= 3,
               timeout=60, what="two more reconciles of the cache")
    assert len([e for e in bed.events_for("llama", namespace) if e["reason"] == "LastUseNotRefreshed"]) == 1
