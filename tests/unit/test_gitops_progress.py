"""Reconciling and Stalled (the kstatus conditions) from the other conditions: what needs
a person is Stalled, what the operator is still working on is Reconciling, never both.
tests/e2e/test_gitops_health.py evaluates the result with kstatus itself."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.api.conditions import Cond
from cachewarm.reconcile.status import STALLED_BUCKET, STALLED_WARM, progress

BUCKET_OK = Cond("BucketReady", True, "Reconciled", "ok")
ENV_OK = Cond("InjectionReady", True, "Reconciled", "ok")


def run(bucket: Cond = BUCKET_OK, warm: Cond | None = None, pools: list[dict[str, Any]] | None = None,
        injection: Cond | None = ENV_OK, failing: bool = False) -> tuple[str, str, str]:
    reconciling, stalled = progress(bucket, injection, warm, pools or [], failing)
    assert not (reconciling.status and stalled.status)
    state = "stalled" if stalled.status else "reconciling" if reconciling.status else "done"
    reason = stalled.reason if stalled.status else reconciling.reason
    return state, reason, (stalled if stalled.status else reconciling).message


def test_a_cache_with_nothing_left_to_do_is_neither():
    assert run()[0] == "done"
    assert run(warm=Cond("Warmed", True, "Warmed", "every pool is warm"))[0] == "done"


@pytest.mark.parametrize("reason", STALLED_BUCKET)
def test_bucket_problems_only_a_person_fixes_stall_with_the_bucket_message(reason: str):
    bucket = Cond("BucketReady", False, reason, f"bucket says {reason}")
    assert run(bucket, failing=reason == "AccessDenied") == ("stalled", reason, f"bucket says {reason}")


@pytest.mark.parametrize("reason", ["GCSUnavailable", "BucketChangedConcurrently", "ReconcileError"])
def test_transient_bucket_errors_are_reconciling(reason: str):
    assert run(Cond("BucketReady", False, reason, "retrying"), failing=True) == ("reconciling", reason, "retrying")


@pytest.mark.parametrize("reason", STALLED_WARM)
def test_warms_that_cannot_progress_stall(reason: str):
    assert run(warm=Cond("Warmed", False, reason, "why"))[:2] == ("stalled", reason)


@pytest.mark.parametrize("reason", ["Warming", "Unschedulable", "KubernetesError"])
def test_a_warm_under_way_is_reconciling(reason: str):
    pools = [{"name": "cpu", "state": "Running"}]
    assert run(warm=Cond("Warmed", False, reason, "Warming: cpu Running"), pools=pools)[:2] == ("reconciling", reason)


def test_a_rewarm_is_reconciling_although_warmed_stays_true():
    assert run(warm=Cond("Warmed", True, "Rewarming", "Re-warming"))[:2] == ("reconciling", "Rewarming")


def test_a_failed_warm_stalls_only_once_no_retry_is_left_and_no_pool_still_runs():
    failed = Cond("Warmed", False, "WarmupFailed", "Warmer failed on cpu")
    retry_due = [{"name": "cpu", "state": "Failed", "nextRetryTime": "2026-11-22T10:00:00Z"}]
    other_running = [{"name": "cpu", "state": "Failed"}, {"name": "gpu", "state": "Running"}]
    given_up = [{"name": "cpu", "state": "Failed", "attempt": 4}]
    assert run(warm=failed, pools=retry_due)[0] == "reconciling"
    assert run(warm=failed, pools=other_running)[0] == "reconciling"
    assert run(warm=failed, pools=given_up) == ("stalled", "WarmupFailed", "Warmer failed on cpu")


def test_a_bucket_stall_wins_over_a_warm_in_progress():
    bucket = Cond("BucketReady", False, "BucketNotFound", "missing")
    warm = Cond("Warmed", False, "BucketNotReady", "Warmers wait for the bucket to be ready")
    assert run(bucket, warm=warm)[:2] == ("stalled", "BucketNotFound")


def test_a_failing_step_with_every_condition_true_is_still_reconciling():
    assert run(failing=True)[:2] == ("reconciling", "ReconcileError")
    assert run(injection=Cond("InjectionReady", False, "KubernetesError", "no"))[:2] == ("reconciling",
                                                                                         "KubernetesError")


def test_a_configmap_of_ours_held_by_someone_else_stalls_with_its_message():
    # Issue 28 (D4): only a person can remove a ConfigMap squatting our name; the operator
    # never deletes it. Stalled, not Reconciling forever, even while the reconcile retries.
    squatted = Cond("InjectionReady", False, "ConfigMapNotOurs", "ConfigMap cachewarm-c-boot-0123456789 is not ours")
    assert run(injection=squatted, failing=True) == ("stalled", "ConfigMapNotOurs",
                                                     "ConfigMap cachewarm-c-boot-0123456789 is not ours")
    reconciling, _ = progress(BUCKET_OK, squatted, None, [], True)
    assert "a person removes that ConfigMap" in reconciling.message
