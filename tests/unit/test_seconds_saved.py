"""Seconds saved in steady state (issue 30): the warmer measures what each program it
compiled took (JAX's own record of the backend compile, children included) and says so in
its summary (compiledPrograms); the pool's status keeps it, through re-warms that compile
nothing; status.usage measures pods' hits against it where no pod compiled the program in
the window (compileSecondsFrom Warmer), for pods of the pool's fingerprint only; the
metric and `cachewarm inspect` show it. Pure, apart from one real JAX compile in a
subprocess."""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cachewarm.agents import warmer
from cachewarm.api.metrics import Metrics
from cachewarm.api.model import parse_spec
from cachewarm.cli import inspection
from cachewarm.reconcile import warmplan
from cachewarm.reconcile.warmplan import parse_summary, pool_status
from cachewarm.reports.store import Store, parse

NOW = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
FP = {"jax": "0.10.2", "platform": "cpu", "devices": 1, "flagsHash": "f1", "versions": {"jaxlib": "0.10.2"}}
H = "0123456789abcdef" * 4


def record(msg: str, *args: Any) -> logging.LogRecord:
    return logging.LogRecord("jax._src.compiler", logging.DEBUG, "compiler.py", 1, msg, args, None)


MISS = "PERSISTENT COMPILATION CACHE MISS for '%s' with key %r"
TOOK = "'%s' took at least %.2f seconds to compile (%.2fs)"
UNDER = "Not writing persistent cache entry for '%s' because it took < %.2f seconds to compile (%.2fs)"


def test_the_warmer_reads_each_compiles_seconds_and_key_from_jaxs_records() -> None:
    used = warmer.UsedKeys()
    used.filter(record(MISS, "jit_step", f"jit_step-{H}"))
    used.filter(record(TOOK, "jit_step", 0.0, 2.345678))
    used.filter(record(MISS, "jit_small", f"jit_small-{'f' * 64}"))
    used.filter(record(UNDER, "jit_small", 1.0, 0.25))
    # No MISS record of its own on this thread (another program's): its key is not known.
    used.filter(record(MISS, "jit_a", f"jit_a-{'a' * 64}"))
    used.filter(record(TOOK, "jit_b", 0.0, 1.5))
    used.filter(record(TOOK, "jit_c", 0.0, "slow"))  # not a number: not counted
    used.filter(record("Not writing persistent cache entry for '%s' because it uses host callbacks", "jit_cb"))
    assert used.compiled == {
        f"jit_step-{H}": {"program": "jit_step", "key": f"jit_step-{H}", "seconds": 2.345678, "written": True},
        f"jit_small-{'f' * 64}": {"program": "jit_small", "key": f"jit_small-{'f' * 64}", "seconds": 0.25,
                                  "written": False},
        "jit_b-": {"program": "jit_b", "key": "jit_b-", "seconds": 1.5, "written": True}}
    assert f"jit_step-{H}" in used.keys
    child = {"compiled": [{"program": "jit_step", "key": f"jit_step-{H}", "seconds": 3.0, "written": True},
                          {"program": "jit_child", "key": f"jit_child-{'c' * 64}", "seconds": 0.5, "written": True}]}
    assert warmer.compiled_programs(used.compiled.values(), [child]) == [
        {"program": "jit_step", "key": H[:16], "compileSeconds": 3.0, "written": True},  # the slower of the two
        {"program": "jit_b", "compileSeconds": 1.5, "written": True},
        {"program": "jit_child", "key": "c" * 16, "compileSeconds": 0.5, "written": True},
        {"program": "jit_small", "key": "f" * 16, "compileSeconds": 0.25, "written": False}]


def test_the_summary_names_the_slowest_compiles_and_gives_them_up_before_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    many = [{"program": f"jit_p{i}", "key": f"{i:016x}", "seconds": float(i), "written": True} for i in range(40)]
    compiled = warmer.compiled_programs(many, [])
    assert len(compiled) == warmer.MAX_COMPILED == warmplan.MAX_COMPILED and compiled[0]["program"] == "jit_p39"
    out = tmp_path / "summary"
    monkeypatch.setenv(warmer.ENV_SUMMARY_FILE, str(out))
    warmer.write_summary({"errors": [], "keys": ["a" * 16] * 250, "compiledPrograms": compiled})
    written = json.loads(out.read_text())  # whole JSON
    assert len(out.read_text()) <= warmer.SUMMARY_LIMIT
    assert written["compiledPrograms"] == compiled[:warmer.COMPILED_KEPT_BEFORE_KEYS]  # the slowest stay
    assert written["keysTruncated"] and 0 < len(written["keys"]) < 250
    # Where the keys fit, the cheapest compiles go first and only as far as needed.
    warmer.write_summary({"errors": [], "keys": ["a" * 16] * 120, "compiledPrograms": compiled})
    written = json.loads(out.read_text())
    assert len(written["keys"]) == 120 and 0 < len(written["compiledPrograms"]) <= warmer.MAX_COMPILED
    assert written["compiledPrograms"] == compiled[:len(written["compiledPrograms"])]


def test_a_real_compile_is_measured_with_its_key(tmp_path: Path) -> None:
    """JAX 0.10's records as they are (the warmer's UsedKeys, one process, a local cache)."""
    code = f"""
import json, os, sys
os.environ.update(JAX_COMPILATION_CACHE_DIR={str(tmp_path)!r}, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
sys.path.insert(0, {str(Path(warmer.__file__).parent)!r})
import warmer
used = warmer.UsedKeys(); used.install()
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((32, 32))).block_until_ready()
print(json.dumps(warmer.compiled_programs(used.compiled.values(), [])))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = {one["program"]: one for one in json.loads(done.stdout.strip().splitlines()[-1])}
    entries = {tuple(p.name.removesuffix("-cache").rsplit("-", 1)) for p in tmp_path.iterdir()
               if p.name.endswith("-cache")}
    one = got["jit__lambda"]
    assert one["written"] and 0 < one["compileSeconds"] < 60
    assert ("jit__lambda", one["key"]) in {(program, digest[:16]) for program, digest in entries}


GOOD = {"processIndex": 0, "entriesWritten": 2, "errors": [], "keys": ["a" * 16], "fingerprint": FP}
COMPILED = [{"program": "jit_step", "key": "a" * 16, "compileSeconds": 4.0, "written": True}]


def pool_entry(*summaries: dict[str, Any]) -> dict[str, Any]:
    warmup = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                         "warmup": {"image": "i", "command": ["python", "t.py"], "pools": [{"name": "cpu"}]}}).warmup
    assert warmup is not None
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    return pool_status("j", warmup.pools[0], "h", job, list(summaries))


def test_the_pool_status_keeps_process_0s_compiled_programs() -> None:
    other = {**GOOD, "processIndex": 1, "compiledPrograms": [{**COMPILED[0], "compileSeconds": 9.0}]}
    assert pool_entry(other, {**GOOD, "compiledPrograms": COMPILED})["compiledPrograms"] == COMPILED
    unknown = [{"program": "jit_x", "compileSeconds": 1.0, "written": False}]  # no key: kept without one
    assert pool_entry({**GOOD, "compiledPrograms": unknown})["compiledPrograms"] == unknown
    assert "compiledPrograms" not in pool_entry(GOOD)


@pytest.mark.parametrize("value", [
    [{**COMPILED[0], "compileSeconds": -1.0}],
    [{**COMPILED[0], "compileSeconds": float("nan")}],
    [{**COMPILED[0], "compileSeconds": 1e12}],
    [{**COMPILED[0], "compileSeconds": "4"}],
    [{**COMPILED[0], "compileSeconds": True}],
    [{**COMPILED[0], "key": "A" * 16}],
    [{**COMPILED[0], "key": "a" * 17}],
    [{**COMPILED[0], "program": ""}],
    [{**COMPILED[0], "program": "p" * 201}],
    [{**COMPILED[0], "written": "yes"}],
    [{"program": "jit_step"}],
    COMPILED * (warmplan.MAX_COMPILED + 1),
    "jit_step",
])
def test_a_bad_compiled_programs_field_is_dropped_alone_and_said(value: Any) -> None:
    _, dropped = parse_summary({**GOOD, "compiledPrograms": value})
    assert dropped == ("compiledPrograms",)
    out = pool_entry({**GOOD, "compiledPrograms": value})
    assert "compiledPrograms" not in out and out["entriesWritten"] == 2
    assert out["message"] == "Ignored invalid fields of the warmer's summary: compiledPrograms"


def test_a_compiled_programs_name_is_kept_as_plain_text() -> None:
    out = pool_entry({**GOOD, "compiledPrograms": [{**COMPILED[0], "program": "jit_\x1b[2Jstep\n"}]})
    assert out["compiledPrograms"][0]["program"] == "jit_?[2Jstep?"


def test_compiled_programs_stay_through_a_rewarm_that_compiles_nothing() -> None:
    prev = {"name": "cpu", "state": "Succeeded", "keys": ["a" * 16, "b" * 16], "fingerprint": FP, "compiledPrograms": [
        *COMPILED, {"program": "jit_gone", "key": "b" * 16, "compileSeconds": 2.0, "written": True},
        {"program": "jit_nokey", "compileSeconds": 1.0, "written": True}]}
    # While the re-warm runs: all of them.
    pending = {"name": "cpu", "state": "Pending"}
    warmplan._keep_compiled(pending, prev)
    assert pending["compiledPrograms"] == prev["compiledPrograms"] and pending["compiledFingerprint"] == FP
    # It finished relying on a's entry only, and compiled one program of its own.
    done = {"name": "cpu", "state": "Succeeded", "keys": ["a" * 16, "c" * 16], "fingerprint": FP,
            "compiledPrograms": [{"program": "jit_new", "key": "c" * 16, "compileSeconds": 1.5, "written": True}]}
    warmplan._keep_compiled(done, pending)
    assert [p["program"] for p in done["compiledPrograms"]] == ["jit_step", "jit_new"]
    # A warm that could not name its entries keeps none of the earlier ones.
    blind = {"name": "cpu", "state": "Succeeded"}
    warmplan._keep_compiled(blind, prev)
    assert "compiledPrograms" not in blind
    # A warm of other versions reports its own programs: the earlier ones are not theirs.
    other = {"name": "cpu", "state": "Succeeded", "keys": ["a" * 16, "c" * 16],
             "fingerprint": {**FP, "versions": {"jaxlib": "0.9.0"}},
             "compiledPrograms": [{"program": "jit_new", "key": "c" * 16, "compileSeconds": 1.5, "written": True}]}
    warmplan._keep_compiled(other, prev)
    assert [p["program"] for p in other["compiledPrograms"]] == ["jit_new"] and "compiledFingerprint" not in other


def test_seconds_saved_stay_while_the_pool_rewarms_and_after_a_failed_rewarm() -> None:
    """The kept programs count whatever the pool's state, with the fingerprint they were
    compiled with; a failed re-warm's keys (what it got to) do not thin them out."""
    store = Store()
    store.record(parse(report("warm", [program("jit_step", hits=2, load=0.5), program("jit_eval", hits=1, load=0.1)])),
                 NOW)
    before = store.usage("ml", "llama", NOW, body(POOL))
    assert before is not None and before["measuredSecondsSaved"] == 6.4 and before["podStarts"]
    for state in ("Pending", "Running"):
        entry: dict[str, Any] = {"name": "cpu", "state": state}
        warmplan._keep_compiled(entry, POOL)
        usage = store.usage("ml", "llama", NOW, body(entry))
        assert usage is not None
        assert (usage["measuredSecondsSaved"], usage["podStarts"]) == (6.4, before["podStarts"]), state
    failed = {"name": "cpu", "state": "Failed", "keys": ["c" * 16], "fingerprint": FP}
    warmplan._keep_compiled(failed, POOL)
    usage = store.usage("ml", "llama", NOW, body(failed))
    assert usage is not None and (usage["measuredSecondsSaved"], usage["podStarts"]) == (6.4, before["podStarts"])
    # A pool that failed with no programs kept names no fingerprint to measure against.
    assert "measuredSecondsSaved" not in (store.usage("ml", "llama", NOW, body({**POOL, "state": "Failed"})) or {})


def report(pod: str, programs: list[dict[str, Any]], fingerprint: dict[str, Any] = FP,
           cache: str = "llama", hit_keys: list[dict[str, str]] | None = None) -> bytes:
    hits = sum(p["hits"] for p in programs)
    requests = sum(p["hits"] + p["misses"] for p in programs)
    counts = {"requests": requests, "hits": hits, "misses": requests - hits, "compileSecondsSaved": -0.5,
              "compileSecondsSpent": 0.0, "programs": programs, "userRequests": requests, "userHits": hits,
              "hitKeys": hit_keys or []}
    return json.dumps({"version": 1, "pod": {"namespace": "ml", "name": pod, "uid": f"uid-{pod}"}, "cache": cache,
                       "process": {"pid": 1, "started": 1}, "sequence": 1, "counts": counts,
                       "fingerprint": fingerprint}).encode()


def program(name: str, hits: int = 0, load: float = 0.0, misses: int = 0, compile_: float = 0.0) -> dict[str, Any]:
    return {"program": name, "hits": hits, "misses": misses, "compileSeconds": compile_, "loadSeconds": load,
            "keys": []}


def body(*pools: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "llama"}, "spec": {},
            "status": {"warmup": {"pools": list(pools)}}}


POOL = {"name": "cpu", "state": "Succeeded", "fingerprint": FP, "compiledPrograms": [
    {"program": "jit_step", "key": "a" * 16, "compileSeconds": 4.0, "written": True},
    {"program": "jit_step", "key": "b" * 16, "compileSeconds": 2.0, "written": True},  # a second shape: the mean
    {"program": "jit_eval", "key": "c" * 16, "compileSeconds": 1.0, "written": True}]}


def test_in_steady_state_hits_are_measured_against_the_warmers_compile() -> None:
    store = Store()
    store.record(parse(report("warm", [program("jit_step", hits=2, load=0.5), program("jit_eval", hits=1, load=0.1)])),
                 NOW)
    usage = store.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None and usage["misses"] == 0
    assert usage["hitPrograms"] == [
        {"program": "jit_step", "hits": 2, "loadSeconds": 0.25, "helper": False, "compileSeconds": 3.0,
         "secondsSaved": 5.5, "compileSecondsFrom": "Warmer"},
        {"program": "jit_eval", "hits": 1, "loadSeconds": 0.1, "helper": False, "compileSeconds": 1.0,
         "secondsSaved": 0.9, "compileSecondsFrom": "Warmer"}]
    assert usage["measuredSecondsSaved"] == 6.4
    assert usage["podStarts"] == [{"pod": "warm", "compileSeconds": 0.6, "coldCompileSeconds": 7.0}]
    # Without the warmer's measure (an older warmer, or none of this cache): not known, as before.
    bare = store.usage("ml", "llama", NOW, body({**POOL, "compiledPrograms": []}))
    assert bare is not None and "measuredSecondsSaved" not in bare and "podStarts" not in bare
    assert "compileSecondsFrom" not in bare["hitPrograms"][0]


def test_a_pod_that_names_the_key_it_hit_is_measured_against_that_keys_compile() -> None:
    """jit_step has two entries (two shapes): 4 s and 2 s to compile. A pod that says it hit
    the 2 s one saved 2 s a hit, not the mean's 3; one that names a key no warmer measured
    gets the mean."""
    store = Store()
    store.record(parse(report("small", [program("jit_step", hits=2, load=0.5)],
                              hit_keys=[{"program": "jit_step", "key": "jit_step-" + "b" * 64}])), NOW)
    usage = store.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None
    [hit] = usage["hitPrograms"]
    assert (hit["compileSeconds"], hit["secondsSaved"]) == (2.0, 3.5)
    assert usage["podStarts"] == [{"pod": "small", "compileSeconds": 0.5, "coldCompileSeconds": 4.0}]
    other = Store()
    other.record(parse(report("new", [program("jit_step", hits=2, load=0.5)],
                              hit_keys=[{"program": "jit_step", "key": "jit_step-" + "e" * 64}])), NOW)
    usage = other.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None and usage["hitPrograms"][0]["compileSeconds"] == 3.0


def test_pods_that_compiled_the_program_in_the_window_are_the_reference_first() -> None:
    store = Store()
    store.record(parse(report("cold", [program("jit_step", misses=1, compile_=5.0)])), NOW)
    store.record(parse(report("warm", [program("jit_step", hits=1, load=0.5)])), NOW)
    usage = store.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None
    [hit] = usage["hitPrograms"]
    assert (hit["compileSeconds"], hit["compileSecondsFrom"], hit["secondsSaved"]) == (5.0, "Pods", 4.5)


@pytest.mark.parametrize("pool", [
    {**POOL, "fingerprint": {**FP, "devices": 8}},  # warmed on other hardware: no reference
    {**POOL, "fingerprint": {**FP, "versions": {"jaxlib": "0.9.0"}}},
    {**POOL, "state": "Failed"},
    {**POOL, "fingerprint": {}},
    {k: v for k, v in POOL.items() if k != "fingerprint"},
    {**POOL, "compiledPrograms": [{"program": "jit_step", "compileSeconds": "4"},
                                  {"program": "jit_step", "compileSeconds": True},
                                  {"program": "jit_step", "compileSeconds": -4.0},
                                  {"program": "jit_step", "compileSeconds": 4.0, "written": False},
                                  {"program": ["jit_step"], "compileSeconds": 4.0}, "jit_step"]},
    {**POOL, "compiledPrograms": "jit_step"},
])
def test_what_is_no_reference(pool: dict[str, Any]) -> None:
    store = Store()
    store.record(parse(report("warm", [program("jit_step", hits=2, load=0.5)])), NOW)
    usage = store.usage("ml", "llama", NOW, body(pool))
    assert usage is not None and "measuredSecondsSaved" not in usage and "podStarts" not in usage
    assert "secondsSaved" not in usage["hitPrograms"][0]


def test_only_hits_of_the_warmers_fingerprint_are_measured() -> None:
    store = Store()
    store.record(parse(report("same", [program("jit_step", hits=2, load=0.5)])), NOW)
    store.record(parse(report("other", [program("jit_step", hits=3, load=0.3)], {**FP, "devices": 4})), NOW)
    usage = store.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None
    [hit] = usage["hitPrograms"]
    assert (hit["hits"], hit["hitsMeasured"], hit["secondsSaved"]) == (5, 2, 5.5)
    assert [p["pod"] for p in usage["podStarts"]] == ["same"]


def test_a_pod_of_another_cache_gets_nothing_from_this_caches_warmer() -> None:
    """Trust: the reference is the cache's own status (its own warmers'); a report counts
    for the cache its pod is labelled for, so another cache's pods cannot borrow it, and a
    pod's hits add at most what they did before times this cache's warmer's seconds."""
    store = Store()
    store.record(parse(report("warm", [program("jit_step", hits=2, load=0.5)], cache="other")), NOW)
    usage = store.usage("ml", "other", NOW, body())
    assert usage is not None and "measuredSecondsSaved" not in usage
    assert store.usage("ml", "llama", NOW, body(POOL)) is None


def test_the_metric_and_inspect_show_it() -> None:
    store = Store()
    store.record(parse(report("warm", [program("jit_step", hits=2, load=0.5)])), NOW)
    usage = store.usage("ml", "llama", NOW, body(POOL))
    assert usage is not None
    cache = {**body(POOL), "status": {**body(POOL)["status"], "usage": usage}}
    registry: CollectorRegistry = Metrics(lambda: [cache]).registry
    assert registry.get_sample_value("cachewarm_measured_seconds_saved", {"namespace": "ml", "cache": "llama"}) == 5.5
    got = json.loads(inspection.as_json("gs://b/p", [], [POOL], [], usage))
    assert got["measuredSecondsSaved"] == 5.5
    assert got["hitPrograms"] == [{"program": "jit_step", "hits": 2, "loadSeconds": 0.25, "compileSeconds": 3.0,
                                   "compileSecondsFrom": "Warmer", "secondsSaved": 5.5}]
    assert got["pools"][0]["compiledPrograms"] == POOL["compiledPrograms"]
    table = inspection.as_table("gs://b/p", [], [POOL], [], usage)
    assert "Seconds saved (measured): 5.5" in table
    lines = table.splitlines()
    at = lines.index("LOADED BY PODS (WINDOW)")
    head, row = lines[at + 1], lines[at + 2]
    assert [c.strip() for c in head.split("  ") if c.strip()] == [
        "PROGRAM", "HITS", "LOAD S/HIT", "COMPILE S (ONCE)", "FROM", "HITS MEASURED", "SAVED S (TOTAL)"]
    # Each value starts under its header (aligned columns), hits measured shown.
    cells = {name: row[head.index(name):].split("  ")[0].strip()
             for name in ("HITS", "LOAD S/HIT", "COMPILE S (ONCE)", "FROM", "HITS MEASURED", "SAVED S (TOTAL)")}
    assert cells == {"HITS": "2", "LOAD S/HIT": "0.25", "COMPILE S (ONCE)": "3.0", "FROM": "Warmer",
                     "HITS MEASURED": "2", "SAVED S (TOTAL)": "5.5"}
    some = {**usage, "hitPrograms": [{**usage["hitPrograms"][0], "hits": 5, "hitsMeasured": 2}]}
    row = inspection.as_table("gs://b/p", [], [POOL], [], some).splitlines()[at + 2]
    assert row[head.index("HITS MEASURED"):].split("  ")[0].strip() == "2"
    assert row[head.index("HITS"):].split("  ")[0].strip() == "5"


def test_a_warm_of_more_programs_than_it_names_counts_the_rest_with_a_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caching every program means dozens of jit_<primitive> helpers: past MAX_COMPILED the
    warmer says how many more it compiled and the longest of them (compiledRest), and a pod
    that hits them all still gets podStarts and measuredSecondsSaved, with those hits said
    unmeasured and bounded."""
    n = warmplan.MAX_COMPILED + 8
    many = [{"program": f"jit_p{i}", "key": f"jit_p{i}-{i + 1:016x}{0:048x}", "seconds": float(i + 1), "written": True}
            for i in range(n)]
    every = warmer.compiled_programs(many, [], limit=None)
    assert len(every) == n
    rest = warmer.compiled_rest(every[warmplan.MAX_COMPILED:])
    assert rest == {"programs": 8, "maxSeconds": 8.0}
    # Cut for size: those given up are counted in the rest.
    out = tmp_path / "summary"
    monkeypatch.setenv(warmer.ENV_SUMMARY_FILE, str(out))
    warmer.write_summary({"errors": [], "keys": ["a" * 16] * 250, "compiledPrograms": every[:warmplan.MAX_COMPILED],
                          "compiledRest": rest})
    written = json.loads(out.read_text())
    assert len(written["compiledPrograms"]) + written["compiledRest"]["programs"] == n
    assert written["compiledRest"]["maxSeconds"] == written["compiledPrograms"][-1]["compileSeconds"] - 1
    # The operator keeps it beside compiledPrograms, and through a re-warm.
    entry = pool_entry({**GOOD, "compiledPrograms": written["compiledPrograms"], "compiledRest": written["compiledRest"]})
    assert entry["compiledRest"] == written["compiledRest"]
    running = {"name": "cpu", "state": "Running"}
    warmplan._keep_compiled(running, {**entry, "state": "Succeeded", "fingerprint": FP})
    assert running["compiledRest"] == written["compiledRest"]
    # A pod that hit every program: its start is measured, the rest's hits at 0 seconds cold.
    store = Store()
    store.record(parse(report("warm", [program(f"jit_p{i}", hits=1, load=0.01) for i in range(n)])), NOW)
    usage = store.usage("ml", "llama", NOW, body(running))
    assert usage is not None
    named = len(written["compiledPrograms"])
    [start] = usage["podStarts"]
    assert start["coldCompileSeconds"] == sum(float(i + 1) for i in range(n - named, n))
    assert (start["unmeasuredHits"], start["unmeasuredAtMostSeconds"]) == (n - named, (n - named) * (n - named))
    assert usage["measuredSecondsSaved"] == round(sum(float(i + 1) - 0.01 for i in range(n - named, n)), 3)
    # Without compiledRest, the same pod's start is not known (a hit with no reference).
    bare = store.usage("ml", "llama", NOW, body({k: v for k, v in running.items() if k != "compiledRest"}))
    assert bare is not None and "podStarts" not in bare


@pytest.mark.parametrize("value", [
    {"programs": 0, "maxSeconds": 1.0}, {"programs": "3", "maxSeconds": 1.0}, {"programs": 3, "maxSeconds": -1.0},
    {"programs": 3, "maxSeconds": float("inf")}, {"programs": 3}, [3, 1.0], {"programs": True, "maxSeconds": 1.0},
])
def test_a_bad_compiled_rest_is_dropped_alone_and_said(value: Any) -> None:
    out = pool_entry({**GOOD, "compiledPrograms": COMPILED, "compiledRest": value})
    assert "compiledRest" not in out and out["compiledPrograms"] == COMPILED
    assert out["message"] == "Ignored invalid fields of the warmer's summary: compiledRest"


def test_a_usage_pass_compares_each_pool_with_each_distinct_fingerprint_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Attacker review: every (process, program hit) was compared with every pool's
    # fingerprint, twice; a namespace's pods made that seconds on the operator's loop.
    import datetime as dt
    import json as json_module

    from cachewarm.reports import store as store_module

    now = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
    fp = {"jax": "0.10.2", "platform": "cpu", "devices": 1}
    programs = [f"jit_p{i}" for i in range(20)]

    def report(pod: int, pid: int) -> bytes:
        uses = [{"program": p, "hits": 1, "misses": 0, "compileSeconds": 0.0, "loadSeconds": 0.01, "keys": []}
                for p in programs]
        counts = {"requests": len(programs), "hits": len(programs), "misses": 0, "compileSecondsSaved": 0.0,
                  "compileSecondsSpent": 0.0, "programs": uses, "userRequests": len(programs),
                  "userHits": len(programs)}
        return json_module.dumps({"version": 1, "pod": {"namespace": "ml", "name": f"p{pod}", "uid": f"u{pod}"},
                                  "cache": "llama", "process": {"pid": pid, "started": 1}, "sequence": 1,
                                  "counts": counts, "fingerprint": fp}).encode()

    store = store_module.Store()
    for i in range(60):
        store.record(store_module.parse(report(i // 6, 100 + i)), now)
    pools = [{"name": f"p{j}", "state": "Succeeded", "fingerprint": {**fp, "devices": 1 + j},
              "compiledPrograms": [{"program": p, "key": f"{k:016x}", "compileSeconds": 2.0, "written": True}
                                   for k, p in enumerate(programs[:16])]} for j in range(4)]
    body = {"metadata": {"namespace": "ml", "name": "llama"}, "spec": {}, "status": {"warmup": {"pools": pools}}}
    compared = []
    differences = store_module.differences
    monkeypatch.setattr(store_module, "differences", lambda a, b: compared.append(1) or differences(a, b))
    usage = store.usage("ml", "llama", now, body)
    assert usage is not None and usage["processes"] == 60
    # 4 pools, 1 distinct fingerprint among the 60 processes: 4 comparisons (60 x 20 x 4 x 2 before).
    assert len(compared) <= 4, len(compared)
    assert usage["hitPrograms"][0]["compileSecondsFrom"] == "Warmer"  # the pool of the pods' fingerprint (devices 1)
