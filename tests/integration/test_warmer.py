"""The warmer as the Job runs it: `python warm.py ...` in the image's working directory,
with the cache env, reporting a JSON summary in the termination-message file."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm.builders import bucket as b
from cachewarm.model import GcsStorage
from cachewarm_testbed import lifecycle_eval as ev
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.warmrun import run_warmer

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data"


def warm(tmp_path: Path, *args: str, cache: Path | str | None = None, min_compile: str = "0",
         extra_env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": min_compile,
           "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none", **(extra_env or {})}
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    return run_warmer(tmp_path, args, env=env, cwd=DATA)


def test_targets_are_compiled_into_the_cache_then_found(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code, first, log = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0, log
    assert first["entriesWritten"] == 1 and first["entriesFound"] == 0 and first["errors"] == []
    assert first["bytesWritten"] == sum(p.stat().st_size for p in cache.glob("*-cache"))
    assert "Compiled target=warm_targets:slow_targets" in log
    code, again, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0
    assert again["entriesWritten"] == 0 and again["entriesFound"] == 1


def test_failing_target_exits_1_with_the_error(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:broken_targets", cache=tmp_path / "c")
    assert code == 1
    assert "TypeError" in summary["errors"][0]


@pytest.mark.parametrize("target", ["warm_targets:no_targets", "warm_targets:missing", "nosuchmodule:x"])
def test_nothing_compiled_is_a_failure(tmp_path: Path, target: str) -> None:
    code, summary, _ = warm(tmp_path, "targets", target, cache=tmp_path / "c")
    assert code in (1, 2)
    assert summary["programs"] == 0 and summary["errors"]


def test_without_cache_dir_nothing_is_cached_and_it_says_so(tmp_path: Path) -> None:
    code, summary, log = warm(tmp_path, "targets", "warm_targets:slow_targets")
    assert code == 2
    assert "JAX_COMPILATION_CACHE_DIR is not set" in log
    assert summary["errors"] == ["nothing was compiled or found in the cache"]


def test_programs_below_the_write_threshold_are_a_failure_not_a_success(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=tmp_path / "c", min_compile="1e9")
    assert code == 2
    assert summary["programs"] == 1 and summary["notCached"] == 1
    assert "none was written to or found in the cache" in summary["errors"][0]


def test_command_mode_runs_a_python_entrypoint_in_process(tmp_path: Path) -> None:
    script = tmp_path / "entry.py"
    script.write_text("import sys, jax, jax.numpy as jnp\n"
                      "print(jax.jit(lambda x: x * 2)(jnp.ones(3)))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "0", cache=tmp_path / "c")
    assert code == 0 and summary["mode"] == "command"
    assert summary["programs"] >= 1 and summary["entriesWritten"] >= 1
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "3", cache=tmp_path / "c")
    assert code == 1
    assert summary["errors"] == ["entrypoint exited with status 3"]


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
        **os.environ, **env, "JAX_COMPILATION_CACHE_DIR": url, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"})
    entries = [blob for blob in storage_only.list_blobs(bucket, prefix="jax/") if blob.name.endswith("-cache")]
    assert len(entries) == 1 and entries[0].custom_time is None
    times = []
    for _ in range(2):
        code, summary, log = warm(tmp_path, "targets", "warm_targets:quick_targets", cache=url, extra_env=env)
        assert code == 0, log
        assert (summary["entriesFound"], summary["entriesWritten"], summary["entriesRefreshed"]) == (1, 0, 1)
        times.append(storage_only.bucket(bucket).get_blob(entries[0].name).custom_time)
    assert entries[0].time_created <= times[0] < times[1]
    # As data against GCS's semantics: the entry outlives its age while warms find it.
    gcs_spec = GcsStorage.model_validate({"bucket": bucket, "location": "us-central1", "prefix": "jax",
                                          "lifecycle": {"deleteAfterDays": 10}})
    rules = b.plan_lifecycle([b.Claim.of(gcs_spec, created="t", namespace="ns", name="c")], 100).rules
    entry = ev.ObjectState(entries[0].name, entries[0].time_created - dt.timedelta(days=365), times[1])
    assert not ev.deletes(rules, entry, times[1] + dt.timedelta(days=9))
    assert ev.deletes(rules, entry, times[1] + dt.timedelta(days=10))
