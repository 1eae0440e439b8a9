"""A cron `schedule` re-warms at its slot, through the real operator: the reconcile of a
scheduled cache asks to be reconciled again at the next slot, and the warmer Job for that
slot is created within seconds of it. The operator's own record of the slot a pool's warmer
is for (status.warmup.pools[].scheduledTime) is compared with the apiserver's record of
when the operator created that Job (its creationTimestamp): recorded times, not a clock
read by the test.

The operator here resyncs and polls once an hour (CACHEWARM_RESYNC_SECONDS and
CACHEWARM_WARM_POLL_SECONDS 3600), so no timer of the old code can act at a slot during the
test; the cache gets no watch event after it is created. Before the requeue, the slot's
warmer waited for the resync (300 s by default). The control plane is the module's own
(own_install, with kube-controller-manager and the node agent to run the warmers): the
session's operator resyncs every 3 s and would act on the cache itself."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, local_images

pytestmark = pytest.mark.e2e

NS = "cachewarm-system"
# As the session's operator (tests/conftest.py), but no resync, poll or usage flush within
# the test: only a wake-up a reconcile asked for reconciles the cache at a slot.
ENV = {
    "CACHEWARM_RESYNC_SECONDS": "3600",
    "CACHEWARM_WARM_POLL_SECONDS": "3600",
    "CACHEWARM_USAGE_FLUSH_SECONDS": "3600",
    "CACHEWARM_RETRY_DELAY_SECONDS": "0.5",
    "CACHEWARM_GCS_TIMEOUT_SECONDS": "2",
    "CACHEWARM_GCP_PROJECT": "testbed",
    "CACHEWARM_POD_NAMESPACE": NS,
    "CACHEWARM_CERT_CHECK_SECONDS": "1",
}
# How late after its slot the slot's warmer Job may be created: one reconcile's work (read
# the cache, check the bucket, apply the env ConfigMap, list and create Jobs), with room for
# a loaded 2-core machine. This bound is a guard, not the proof: with `* * * * *` a Job made
# by any reconcile within the minute is under 60 s late by construction. The proof is that
# a later slot's Job exists at all: the resync and poll the old code waited for are an hour
# away here (300 s by default).
BOUND = dt.timedelta(seconds=30)


@pytest.fixture(scope="module")
def bed(own_install: Testbed) -> Testbed:
    own_install.start_controller_manager()
    own_install.start_node_agent(local_images())
    return own_install


def when(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def scheduled_cache(name: str, bucket: str) -> dict[str, Any]:
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
                     "jax": {"minCompileTimeSecs": 0},
                     "warmup": {"image": "demo/train:1", "pools": [{"name": "cpu"}],
                                "command": ["python", "train.py", "--steps", "1"],
                                "schedule": "* * * * *"}}}


def test_a_scheduled_warmer_is_created_at_its_slot_not_at_the_next_resync(bed: Testbed, tmp_path: Path) -> None:
    kubeconfig = bed.service_account_kubeconfig(NS, "cachewarm-operator", tmp_path / "kubeconfig")
    handle = OperatorHandle(bed, kubeconfig, ENV)
    try:
        namespace = f"t-{uuid.uuid4().hex[:10]}"
        assert bed.kubectl_run("create", "namespace", namespace).returncode == 0
        bed.apply(scheduled_cache("nightly", f"sched-{uuid.uuid4().hex[:8]}"), namespace)

        def warmer(after: dt.datetime | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
            """The pool and its Job, once the Job exists for a slot later than `after`."""
            pools = (((bed.get_json("ccache", "nightly", namespace) or {}).get("status") or {}).get("warmup")
                     or {}).get("pools") or []
            for pool in pools:
                if pool.get("scheduledTime") and (after is None or when(pool["scheduledTime"]) > after):
                    job = bed.get_json("job", str(pool["job"]), namespace)
                    if job is not None:
                        return pool, job
            return None

        first, _ = eventually(lambda: warmer(None), timeout=60, what="the first warmer Job")
        # The next slot's warmer: nothing reconciles the cache then but the wake-up its last
        # reconcile asked for (a warmer still running at the slot is stopped first, and the
        # following slot's is made instead: the check holds for whichever slot it is).
        pool, job = eventually(lambda: warmer(when(first["scheduledTime"])), timeout=150,
                               what="a warmer Job for a later slot")
        slot = when(pool["scheduledTime"])
        created = when(job["metadata"]["creationTimestamp"])  # whole seconds, as the apiserver keeps it
        late = created - slot
        print(f"slot {pool['scheduledTime']}: Job {job['metadata']['name']} created "
              f"{job['metadata']['creationTimestamp']} ({late.total_seconds():.0f} s after the slot)")
        assert dt.timedelta(0) <= late <= BOUND, (pool, job["metadata"])
        # A new warmer for this slot: its name carries the slot's hash, not the first's.
        assert job["metadata"]["name"] != first["job"]
    finally:
        handle.stop()
