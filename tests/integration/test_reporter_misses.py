"""Every compile a warm pod still pays, named with its cause, from real JAX compiles on CPU:
cachewarm's warmer compiles tests/data/miss_kinds.py's targets into a cache directory (with
warmup.minCompileTimeSecs 0.3); pods, each with its own copy of that directory as the local
copy gives them and the reporter on their PYTHONPATH, run every program of the file; the
operator's store reads their reports and names each program they compiled with its cause.

What is not real here: the copy is a shutil.copytree (the copier is tested apart), and the
pool's status is built from the warmer's summary as the operator builds it, by hand."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from test_reporter import Endpoint, serve, site

from cachewarm.reconcile import misses
from cachewarm.reports.store import Store, parse

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
WARMER = REPO / "operator" / "cachewarm" / "agents" / "warmer.py"
NOW = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
THRESHOLD = "0.3"  # the cache's warmup.minCompileTimeSecs


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CACHEWARM_", "XLA_", "PYTHONPATH"))}


def warm(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """The warmer, as its Job runs it (a lone file, targets mode), into tmp_path/cache."""
    cache, summary = tmp_path / "cache", tmp_path / "termination-log"
    lone = tmp_path / "warm.py"
    lone.write_text(WARMER.read_text())
    env = {**clean_env(), "CACHEWARM_SUMMARY_FILE": str(summary), "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": THRESHOLD, "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}
    out = subprocess.run([sys.executable, str(lone), "targets", "miss_kinds:targets"], cwd=DATA, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return cache, json.loads(summary.read_text())


def pod(tmp_path: Path, warmed: Path, endpoint: Endpoint, name: str, devices: int = 2) -> dict[str, Any]:
    """A ReadOnly pod with a local copy of the warmed directory: the reporter's last report."""
    local = tmp_path / name / "cache"
    shutil.copytree(warmed, local)
    where = site(tmp_path / name)
    env = {**clean_env(), "PYTHONPATH": str(where), "JAX_COMPILATION_CACHE_DIR": str(local),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1e9",  # what the webhook gives ReadOnly pods
           "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "CACHEWARM_REPORT_URL": endpoint.url, "CACHEWARM_CACHE": "llama", "CACHEWARM_POD_NAMESPACE": "ml",
           "CACHEWARM_POD_NAME": name, "CACHEWARM_POD_UID": f"uid-{name}"}
    before = len(endpoint.reports)
    out = subprocess.run([sys.executable, str(DATA / "miss_kinds.py")], cwd=DATA, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in warmed.iterdir())  # wrote nothing
    mine = [r for r in endpoint.reports[before:] if r["pod"]["name"] == name]
    assert mine and mine[-1]["final"], endpoint.reports[before:]
    return mine[-1]


def test_each_kind_of_missed_program_is_named_with_its_cause(tmp_path: Path) -> None:
    endpoint, server = serve()
    try:
        warmed, summary = warm(tmp_path)
        written = sorted(p.name.rsplit("-", 2)[0] for p in warmed.glob("*-cache"))
        # The warmer writes only its slow programs; the callback one JAX never writes.
        assert written == ["jit_train_step", "jit_unstable_step"], summary
        same = pod(tmp_path, warmed, endpoint, "trainer")
        other = pod(tmp_path, warmed, endpoint, "four-devices", devices=4)
    finally:
        server.shutdown()
    programs = {p["program"]: p for p in same["counts"]["programs"]}
    assert programs["jit_train_step"]["hits"] == 1 and programs["jit_train_step"]["misses"] == 0
    assert programs["jit_train_step"]["loadSeconds"] > 0
    assert programs["jit_callback_step"]["notWritten"] == "hostCallbacks"
    unstable = programs["jit_unstable_step"]
    assert unstable["misses"] == 1 and unstable["cached"] and set(unstable["cached"]).isdisjoint(unstable["keys"])
    assert programs["jit_eval_step"]["cached"] == [] and programs["jit_small_step"]["cached"] == []
    assert same["counts"]["userRequests"] == 5 and same["counts"]["userHits"] == 1, [p for p, v in sorted(programs.items()) if not v["helper"]]  # helpers left out

    store = Store()
    for one in (same, other):
        store.record(parse(json.dumps(one).encode()), NOW)
    body = {"spec": {"warmup": {"minCompileTimeSecs": float(THRESHOLD)}},
            "status": {"warmup": {"pools": [{"name": "cpu", "state": "Succeeded",
                                             "fingerprint": summary["fingerprint"]}]}}}
    usage = store.usage("ml", "llama", NOW, body)
    assert usage is not None
    causes = {m["program"]: m["cause"] for m in usage["missedPrograms"] if not m["helper"]}
    assert causes == {
        "jit_train_step": misses.FINGERPRINT_DIFFERS,  # only the four-device pod compiled it
        "jit_eval_step": misses.NOT_WARMED,
        "jit_callback_step": misses.NOT_CACHEABLE,
        # Another key with the same fingerprint after one warm: NotWarmed, its message naming
        # both causes (other code or shapes, or a per-process value: shard_map); KeyUnstable
        # once a warmer names it (tests/integration/test_warmer_children.py).
        "jit_unstable_step": misses.NOT_WARMED,
        "jit_small_step": misses.BELOW_WRITE_THRESHOLD,
    }, usage["missedPrograms"]
    by_program = {m["program"]: m for m in usage["missedPrograms"]}
    assert by_program["jit_unstable_step"]["pods"] == 2 and "shard_map" in by_program["jit_unstable_step"]["message"]
    assert "devices" in by_program["jit_train_step"]["message"]
    # Seconds saved as measured: jit_train_step's hit against its compile in the four-device pod.
    [hit] = [h for h in usage["hitPrograms"] if h["program"] == "jit_train_step"]
    assert hit["compileSeconds"] > hit["loadSeconds"] > 0 and hit["secondsSaved"] > 0
    assert misses.programs_warm(usage).status is False


def test_jaxs_helper_programs_are_its_primitives_read_from_jax_itself() -> None:
    import jax  # noqa: F401 - the registry fills as jax imports

    from cachewarm.agents import reporter

    found = reporter._primitives()
    assert {"convert_element_type", "broadcast_in_dim", "iota", "gather", "stage", "dynamic_slice"} <= found
    assert not {"train_step", "_multi_slice", "lambda"} & found
    # The fallback, for a JAX whose registry cannot be read, is a part of them.
    assert reporter.PRIMITIVES_FALLBACK - found <= {"copy_p", "scatter-add", "device_put"}
