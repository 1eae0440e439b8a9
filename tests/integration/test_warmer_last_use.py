"""A re-warm keeps the entries it uses alive: the warmer moves the customTime of every
entry it finds or writes forward, and cachewarm's lifecycle rule counts from it. The real
warmer file, run as its Job runs it, against the GCS emulator."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from google.cloud import storage

from cachewarm.builders import bucket as b
from cachewarm.api.model import GcsStorage
from cachewarm_testbed import lifecycle_eval as ev
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.warmrun import run_warmer

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"
CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}


def test_a_re_warm_moves_custom_time_of_the_entries_it_finds_forward(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    """cachewarm's rule deletes an entry deleteAfterDays after its customTime: each warm
    that finds an entry moves it forward, so entries in use do not expire."""
    bucket = f"warm-{uuid.uuid4().hex[:10]}"
    storage_only.create_bucket(bucket, location="us-central1")
    url = f"gs://{bucket}/jax"
    env = {k: v for k, v in storage_bed.env().items() if k != "KUBECONFIG"}
    # A training pod (plain JAX, no warmer) writes the entry: it has no customTime.
    train = ("import jax, warm_targets as w; fn, args = next(w.quick_targets()); fn.lower(*args).compile()")
    subprocess.run([sys.executable, "-c", train], cwd=DATA, check=True, timeout=300, env={
        **os.environ, **env, **CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": url})
    entries = [blob for blob in storage_only.list_blobs(bucket, prefix="jax/") if blob.name.endswith("-cache")]
    assert len(entries) == 1 and entries[0].custom_time is None
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    times = []
    for _ in range(2):
        code, summary, log = run_warmer(tmp_path, ["targets", "warm_targets:quick_targets"], cwd=DATA,
                                        env={**env, **CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": url})
        assert code == 0, log
        assert (summary["entriesFound"], summary["entriesWritten"], summary["entriesRefreshed"]) == (1, 0, 1)
        assert summary["refreshFailed"] == 0 and "refreshError" not in summary
        times.append(storage_only.bucket(bucket).get_blob(entries[0].name).custom_time)
    assert entries[0].time_created <= times[0] < times[1]
    # Only the object that exists was PATCHed (no -atime: jax's LRU is off), once per warm.
    patches = [r for r in proxy.log() if r["method"] == "PATCH" and f"/b/{bucket}/o/" in r["path"]]
    assert [(r["path"].endswith("-cache"), r["status"]) for r in patches] == [(True, 200)] * 2, patches
    # As data against GCS's semantics: the entry outlives its age while warms find it.
    gcs_spec = GcsStorage.model_validate({"bucket": bucket, "location": "us-central1", "prefix": "jax",
                                          "lifecycle": {"deleteAfterDays": 10}})
    rules = b.plan_lifecycle([b.Claim.of(gcs_spec, created="t", namespace="ns", name="c")], 100).rules
    entry = ev.ObjectState(entries[0].name, entries[0].time_created - dt.timedelta(days=365), times[1])
    assert not ev.deletes(rules, entry, times[1] + dt.timedelta(days=9))
    assert ev.deletes(rules, entry, times[1] + dt.timedelta(days=10))


def _warm_once_untouched(storage_only: storage.Client, bucket: str, url: str, env: dict[str, str]) -> str:
    """A training pod (plain JAX) writes one entry; returns its name."""
    storage_only.create_bucket(bucket, location="us-central1")
    train = ("import jax, warm_targets as w; fn, args = next(w.quick_targets()); fn.lower(*args).compile()")
    subprocess.run([sys.executable, "-c", train], cwd=DATA, check=True, timeout=300, env={
        **os.environ, **env, **CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": url})
    [entry] = [blob.name for blob in storage_only.list_blobs(bucket, prefix="jax/") if blob.name.endswith("-cache")]
    return entry


def test_only_process_0_of_a_multi_host_warmer_refreshes(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    bucket = f"warm-{uuid.uuid4().hex[:10]}"
    url = f"gs://{bucket}/jax"
    env = {k: v for k, v in storage_bed.env().items() if k != "KUBECONFIG"}
    entry = _warm_once_untouched(storage_only, bucket, url, env)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    code, summary, log = run_warmer(tmp_path, ["targets", "warm_targets:quick_targets"], cwd=DATA, env={
        **env, **CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": url, "JAX_PROCESS_ID": "1"})
    assert code == 0, log
    assert (summary["processIndex"], summary["entriesRefreshed"], summary["refreshFailed"]) == (1, 0, 0)
    assert [r for r in proxy.log() if r["method"] == "PATCH" and f"/b/{bucket}/" in r["path"]] == []
    assert storage_only.bucket(bucket).get_blob(entry).custom_time is None


def test_a_warmer_that_may_not_update_objects_says_so_once_and_still_succeeds(
    tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client
) -> None:
    bucket = f"warm-{uuid.uuid4().hex[:10]}"
    url = f"gs://{bucket}/jax"
    env = {k: v for k, v in storage_bed.env().items() if k != "KUBECONFIG"}
    entry = _warm_once_untouched(storage_only, bucket, url, env)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "PATCH", "path": f"/b/{bucket}/o/", "status": 403, "times": 50}])
    try:
        code, summary, log = run_warmer(tmp_path, ["targets", "warm_targets:quick_targets"], cwd=DATA,
                                        env={**env, **CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": url})
    finally:
        proxy.clear_faults()
    assert code == 0, log  # the warm itself worked: the operator reports the refresh apart
    assert (summary["entriesFound"], summary["entriesRefreshed"], summary["refreshFailed"]) == (1, 0, 1)
    assert "storage.objects.update" in summary["refreshError"] and summary["errors"] == []
    assert storage_only.bucket(bucket).get_blob(entry).custom_time is None
