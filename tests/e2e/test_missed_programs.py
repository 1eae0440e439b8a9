"""Every compile a warm pod still pays, named with its cause, through the operator: a cache
warmed by its warmer Job (targets: tests/data/miss_kinds.py's, warmup.minCompileTimeSecs
0.3) in the suite's training image (test/targets:1), and labelled pods of that image that
run a program of each miss kind, with the default injection (a per-pod local copy) and the
reporter. status.usage.missedPrograms, the ProgramsWarm condition, the metric and
`cachewarm inspect` name each program with its cause."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from test_warmup import conditions, inspect, train_in_pod, wait_warmed, warm_cache

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, scrape
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

TWO_DEVICES = {"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=2"}
KINDS = {"jit_eval_step": "NotWarmed", "jit_callback_step": "NotCacheable", "jit_unstable_step": "NotWarmed",
         "jit_small_step": "BelowWriteThreshold", "jit_train_step": "FingerprintDiffers"}


def run_pod(bed: Testbed, ns: str, cache: str, name: str, env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A labelled pod of the suite's training image running every program of miss_kinds.py
    (test_warmup.train_in_pod): its last log line (JAX's cache counters) and its log."""
    return train_in_pod(bed, ns, cache, name, env, image="test/targets:1", command=["python", "miss_kinds.py"],
                        log_compiles=False)


def test_each_program_a_warm_pod_compiles_is_named_with_its_cause(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client,
) -> None:
    bed, bucket = controller_manager, f"miss-{uuid.uuid4().hex[:8]}"
    # Two host devices, set in the env as a user would (the warmer imports jax before it loads
    # the target module, and custom_partitioning's key is stable on one device).
    bed.apply(warm_cache("kinds", bucket, {"image": "test/targets:1", "targets": ["miss_kinds:targets"],
                                            "minCompileTimeSecs": 0.3, "env": [TWO_DEVICES]}), namespace)
    warmed = wait_warmed(bed, namespace, "kinds")
    written = sorted(b.name.rsplit("/", 1)[-1].rsplit("-", 2)[0] for b in gcs.list_blobs(bucket, prefix="jax/")
                     if b.name.endswith("-cache"))
    logs = [line for p in (bed.workdir / "pods" / namespace).glob("*/*.log") for line in p.read_text().splitlines()
            if "Compiled" in line or "Finished" in line or "rror" in line or "nstable" in line]
    # What the warmer's threshold and JAX let it write.
    assert written == ["jit_train_step", "jit_unstable_step"], (warmed["status"]["warmup"], logs)

    same = run_pod(bed, namespace, "kinds", "trainer", env=[TWO_DEVICES])
    copied = sorted(p.name for p in Path(same["cache_dir"]).glob("*-cache"))
    assert same["devices"] == 2 and same["hits"] >= 1, (same["cache_dir"], copied)
    other = run_pod(bed, namespace, "kinds", "four-devices",
                    env=[{"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=4"}])
    assert other["devices"] == 4

    def named() -> dict[str, Any] | None:
        usage = (((bed.get_json("ccache", "kinds", namespace) or {}).get("status") or {}).get("usage") or {})
        causes = {m["program"]: m.get("cause") for m in usage.get("missedPrograms") or []}
        return usage if usage.get("pods") == 2 and all(p in causes for p in KINDS) else None
    usage = eventually(named, timeout=90, what="status.usage naming each missed program")
    by_program = {m["program"]: m for m in usage["missedPrograms"]}
    assert {p: by_program[p]["cause"] for p in KINDS} == KINDS, usage["missedPrograms"]
    assert by_program["jit_unstable_step"]["pods"] == 2 and by_program["jit_eval_step"]["pods"] == 2
    assert "shard_map" in by_program["jit_unstable_step"]["message"]
    assert "host callback" in by_program["jit_callback_step"]["message"]
    # The user's hit ratio leaves JAX's helper programs out; the hit's seconds saved are measured.
    assert usage["userCompileRequests"] == 10 and usage["userHits"] == 1
    [hit] = [h for h in usage["hitPrograms"] if h["program"] == "jit_train_step"]
    assert hit["compileSeconds"] > hit["loadSeconds"] > 0 and usage["measuredSecondsSaved"] > 0
    [start] = [p for p in usage.get("podStarts") or [] if p["pod"] == "trainer"]
    assert start["coldCompileSeconds"] > start["compileSeconds"] > 0  # its hit saved a compile

    # The condition says the costliest cause; KeysMatch says the four-device pod differs.
    def warm_condition() -> dict[str, Any] | None:
        cond = conditions(bed.get_json("ccache", "kinds", namespace)).get("ProgramsWarm") or {}
        # It names the costliest programs (at most 5: misses.PROGRAMS_NAMED), the first of them first.
        costliest = usage["missedPrograms"][0]["program"]
        return cond if cond.get("status") == "False" and costliest in cond.get("message", "") else None
    cond = eventually(warm_condition, timeout=90, what="ProgramsWarm False naming the costliest program")
    assert cond["reason"] == usage["missedPrograms"][0]["cause"]
    keys = conditions(bed.get_json("ccache", "kinds", namespace)).get("KeysMatch") or {}
    assert (keys.get("status"), keys.get("reason")) == ("False", "FingerprintsDiffer")

    this = {"namespace": namespace, "cache": "kinds"}
    for cause in set(KINDS.values()):
        assert scrape(operator.metrics_url, "cachewarm_missed_programs", **this, cause=cause) >= 1, cause

    report = inspect(bed, f"{namespace}/kinds")
    assert {m["program"]: m["cause"] for m in report["missedPrograms"] if m["program"] in KINDS} == KINDS
