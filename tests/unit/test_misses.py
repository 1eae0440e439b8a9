"""Every compile a warm pod still pays, named with its cause: the reporter's per-program
tally from JAX's records, the report's programs as the operator checks them, the causes
(reconcile/misses.py), status.usage's missedPrograms and hitPrograms, the ProgramsWarm
condition and KeysMatch's agreement with it, the metric and `cachewarm inspect`."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cachewarm.agents import reporter
from cachewarm.api import constants as c
from cachewarm.api.metrics import Metrics
from cachewarm.cli import inspection
from cachewarm.reconcile import misses
from cachewarm.reports.store import MAX_BODY_BYTES, ReportError, Store, parse

NOW = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
FP = {"jax": "0.10.2", "platform": "cpu", "devices": 2, "flagsHash": "f1", "versions": {"jaxlib": "0.10.2"}}
POOL = {"name": "cpu", "state": "Succeeded", "fingerprint": FP}
H1, H2 = "1" * 16, "2" * 16


def missed(program: str = "jit_step", *, cached: frozenset[str] | None = frozenset(), keys: frozenset[str] = frozenset({H1}),
           not_written: str | None = None, seconds: float = 2.0, fps: tuple[dict[str, Any], ...] = (FP,),
           held: bool = False) -> misses.Missed:
    return misses.Missed(program, 1, seconds, frozenset({"trainer"}), keys, cached, not_written, fps, held)


WARM = misses.Warmed((("cpu", FP),), 1.0, {})


@pytest.mark.parametrize(("one", "warm", "cause", "words"), [
    (missed(not_written="hostCallbacks"), WARM, misses.NOT_CACHEABLE, "host callback"),
    # A host callback is never cacheable, whatever else differs.
    (missed(not_written="hostCallbacks", fps=({**FP, "devices": 4},)), WARM, misses.NOT_CACHEABLE, "host callback"),
    (missed(fps=({**FP, "devices": 4},)), WARM, misses.FINGERPRINT_DIFFERS, "devices"),
    # Another key with the same fingerprint: other code or shapes most often; KeyUnstable
    # only where a warmer saw the key change (its pool's unstablePrograms, below).
    (missed(cached=frozenset({H2})), WARM, misses.NOT_WARMED, "other code or shapes than the warmers compiled"),
    # gs:// pods list nothing; the pool's warmer saw the second key itself.
    (missed(cached=None), misses.Warmed((("cpu", FP),), 1.0, {}, frozenset({"jit_step"})), misses.KEY_UNSTABLE,
     "custom_partitioning"),
    (missed(seconds=0.25), WARM, misses.BELOW_WRITE_THRESHOLD, "warmup.minCompileTimeSecs of 1.0"),
    (missed(cached=None), misses.Warmed((("cpu", FP),), 0.0, {"jit_step": (frozenset(), True)}),
     misses.BELOW_WRITE_THRESHOLD, "compiled it and did not write it"),
    (missed(seconds=3.0), WARM, misses.NOT_WARMED, "add the program"),
    (missed(seconds=0.25), misses.Warmed((("cpu", FP),), 0.0, {}), misses.NOT_WARMED, "add the program"),
    (missed(cached=None), WARM, misses.UNKNOWN, "gs://"),
    (missed(held=True), WARM, misses.UNKNOWN, "very key"),
    (missed(cached=None), misses.Warmed((("cpu", FP),), 1.0, {"jit_step": (frozenset({H1}), False)}), misses.UNKNOWN,
     "very key"),
    # No pool with a fingerprint: nothing to compare with, so not FingerprintDiffers.
    (missed(fps=({**FP, "devices": 4},)), misses.Warmed((), 1.0, {}), misses.NOT_WARMED, "add the program"),
])
def test_each_missed_program_gets_the_cause_a_user_acts_on(one: misses.Missed, warm: misses.Warmed, cause: str,
                                                           words: str) -> None:
    got, message = misses.classify(one, warm)
    assert got == cause
    assert words in message and one.program in message


def test_the_warmers_side_is_read_from_spec_and_status_and_odd_shapes_are_not_known() -> None:
    status = {"warmup": {"pools": [
        {**POOL, "compiledPrograms": [{"program": "jit_a", "key": H1, "written": True},
                              {"program": "jit_b", "written": False}, "junk", {"program": 3}],
         "unstablePrograms": [{"program": "jit_c", "seen": "runs"}, 7]},
        {"name": "tpu", "state": "Running", "fingerprint": {**FP, "platform": "tpu"}},  # not succeeded: not compared
        "not a pool", {"name": "x", "compiledPrograms": "nope", "unstablePrograms": {"a": 1}}]}}
    warm = misses.warmed({"warmup": {"minCompileTimeSecs": 0.5}, "jax": {"minCompileTimeSecs": 2}}, status)
    assert warm.pools == (("cpu", FP),)
    assert warm.min_compile_time_secs == 0.5
    assert warm.programs == {"jit_a": (frozenset({H1}), False), "jit_b": (frozenset(), True)}
    assert warm.unstable == frozenset({"jit_c"})
    assert misses.warmed({}, {}).min_compile_time_secs == 0.0  # unset: warmers write every program
    assert misses.warmed({"warmup": {"minCompileTimeSecs": "1"}}, {}).min_compile_time_secs is None
    assert misses.warmed({"warmup": "x"}, {}).min_compile_time_secs == 0.0


def record(message: str, *args: Any) -> logging.LogRecord:
    return logging.LogRecord("jax._src.compiler", logging.DEBUG, __file__, 1, message, args, None)


MISS = "PERSISTENT COMPILATION CACHE MISS for '%s' with key %r"
HIT = "Persistent compilation cache hit for '%s' with key %r"
CALLBACKS = ("Not writing persistent cache entry for '%s' because it uses host callbacks (e.g. from jax.debug.print "
             "or breakpoint)")
BELOW = "Not writing persistent cache entry for '%s' because it took < %.2f seconds to compile (%.2fs)"


def test_the_tally_counts_each_program_from_jaxs_records_and_its_own_seconds(tmp_path: Path) -> None:
    for name in (f"jit_step-{'a' * 64}-cache", f"jit_step-{'b' * 64}-cache", f"jit_eval-{'c' * 64}-cache",
                 "notes.txt", "jit_x-nothex-cache", f"-{'d' * 64}-cache"):
        (tmp_path / name).write_bytes(b"")
    tally = reporter.Tally()
    tally.reading_logs = True
    tally.list_cache(str(tmp_path))
    tally.filter(record(MISS, "jit_step", f"jit_step-{'e' * 64}"))
    tally.on_duration(reporter.DURATION_COMPILE, 1.5)
    tally.filter(record(MISS, "jit_cb", f"jit_cb-{'f' * 64}"))
    tally.filter(record(CALLBACKS, "jit_cb"))
    tally.on_duration(reporter.DURATION_COMPILE, 0.25)
    tally.filter(record(HIT, "jit_eval", f"jit_eval-{'c' * 64}"))
    tally.on_duration(reporter.DURATION_COMPILE, 0.125)
    tally.filter(record(MISS, "jit_convert_element_type", f"jit_convert_element_type-{'0' * 64}"))
    tally.filter(record(BELOW, "jit_convert_element_type", 1.0, 0.01))
    tally.on_duration(reporter.DURATION_COMPILE, 0.01)
    tally.on_duration(reporter.DURATION_COMPILE, 9.0)  # no record named its program: counted in all only
    got = {p["program"]: p for p in tally.snapshot()["programs"]}
    assert got["jit_step"] == {"program": "jit_step", "hits": 0, "misses": 1, "compileSeconds": 1.5, "loadSeconds": 0.0,
                               "keys": ["e" * 16], "notWritten": None, "helper": False, "cached": ["a" * 16, "b" * 16]}
    assert got["jit_cb"]["notWritten"] == "hostCallbacks" and got["jit_cb"]["cached"] == []
    assert (got["jit_eval"]["hits"], got["jit_eval"]["loadSeconds"]) == (1, 0.125)
    assert got["jit_convert_element_type"]["helper"] and got["jit_convert_element_type"]["notWritten"] == "belowThreshold"
    snap = tally.snapshot()
    assert (snap["userRequests"], snap["userHits"]) == (3, 1)  # the helper is left out
    assert snap["compileSecondsSpent"] == pytest.approx(10.885)
    assert list(got) == ["jit_step", "jit_cb", "jit_convert_element_type", "jit_eval"]  # costliest first


def test_a_cache_dir_that_cannot_be_listed_leaves_what_it_held_unknown(tmp_path: Path) -> None:
    tally = reporter.Tally()
    tally.reading_logs = True
    tally.list_cache("gs://bucket/prefix")
    tally.list_cache(str(tmp_path / "missing"))
    tally.filter(record(MISS, "jit_step", f"jit_step-{'e' * 64}"))
    assert "cached" not in tally.snapshot()["programs"][0]


def test_programs_are_not_reported_when_the_records_are_the_processs_own() -> None:
    tally = reporter.Tally()  # reading_logs False: the user set the compiler logger's level
    assert "programs" not in tally.snapshot() and "userRequests" not in tally.snapshot()


def test_the_tally_keeps_a_bounded_number_of_programs_the_costliest() -> None:
    tally = reporter.Tally()
    tally.reading_logs = True
    for i in range(reporter.MAX_PROGRAMS_KEPT + 10):
        tally.filter(record(MISS, f"jit_p{i}", f"jit_p{i}-{i:064x}"))
        tally.on_duration(reporter.DURATION_COMPILE, float(i))
    assert len(tally.programs) == reporter.MAX_PROGRAMS_KEPT and "jit_p0" not in tally.programs
    programs = tally.snapshot()["programs"]
    assert len(programs) == reporter.MAX_PROGRAMS
    assert programs[0]["program"] == f"jit_p{reporter.MAX_PROGRAMS_KEPT + 9}"


def report(pod: str, uid: str, programs: list[dict[str, Any]], *, fingerprint: dict[str, Any] = FP,
           user: tuple[int, int] | None = (3, 1)) -> bytes:
    counts: dict[str, Any] = {"requests": 5, "hits": 2, "misses": 3, "compileSecondsSaved": -0.5,
                              "compileSecondsSpent": 3.0, "programs": programs}
    if user is not None:
        counts.update(userRequests=user[0], userHits=user[1])
    return json.dumps({"version": 1, "pod": {"namespace": "ml", "name": pod, "uid": uid}, "cache": "llama",
                       "process": {"pid": 1, "started": 1}, "sequence": 1, "counts": counts,
                       "fingerprint": fingerprint}).encode()


def program(name: str, *, hits: int = 0, misses_: int = 0, compile_: float = 0.0, load: float = 0.0,
            keys: list[str] | None = None, cached: list[str] | None = None, **more: Any) -> dict[str, Any]:
    out = {"program": name, "hits": hits, "misses": misses_, "compileSeconds": compile_, "loadSeconds": load,
           "keys": keys or [], **more}
    if cached is not None:
        out["cached"] = cached
    return out


BODY = {"spec": {"warmup": {"minCompileTimeSecs": 1.0}}, "status": {"warmup": {"pools": [POOL]}}}


def test_usage_names_each_missed_program_with_its_cause_the_costliest_first() -> None:
    store = Store()
    store.record(parse(report("cold", "u-1", [
        program("jit_train_step", misses_=1, compile_=4.0, keys=[H1], cached=[]),
        program("jit_unstable_step", misses_=1, compile_=2.0, keys=[H1], cached=[H2]),
        program("jit_present", misses_=1, compile_=0.1, keys=[H1], cached=[H1]),
        program("jit_callback_step", misses_=1, compile_=1.5, keys=[H1], cached=[], notWritten="hostCallbacks"),
        program("jit_small_step", misses_=1, compile_=0.2, keys=[H1], cached=[]),
        program("jit_eval", misses_=1, compile_=3.0, keys=[H2], cached=[]),
    ])), NOW)
    store.record(parse(report("warm", "u-2", [
        program("jit_eval", hits=2, load=0.5),
        program("jit_unstable_step", misses_=1, compile_=2.0, keys=["3" * 16], cached=[H2]),
    ], user=(4, 2))), NOW)
    usage = store.usage("ml", "llama", NOW, BODY)
    assert usage is not None
    got = [(m["program"], m["cause"], m["pods"], m["misses"], m["compileSeconds"]) for m in usage["missedPrograms"]]
    assert got == [("jit_train_step", misses.NOT_WARMED, 1, 1, 4.0),  # ties by name
                   ("jit_unstable_step", misses.NOT_WARMED, 2, 2, 4.0),  # no warmer said it is unstable
                   ("jit_eval", misses.NOT_WARMED, 1, 1, 3.0),
                   ("jit_callback_step", misses.NOT_CACHEABLE, 1, 1, 1.5),
                   ("jit_small_step", misses.BELOW_WRITE_THRESHOLD, 1, 1, 0.2),
                   ("jit_present", misses.UNKNOWN, 1, 1, 0.1)]
    assert all(m["message"] for m in usage["missedPrograms"])
    # Seconds saved as measured: jit_eval compiled in 3 s in the window, and its 2 hits loaded in 0.5 s in all.
    assert usage["hitPrograms"] == [{"program": "jit_eval", "hits": 2, "loadSeconds": 0.25, "helper": False,
                                     "compileSeconds": 3.0, "secondsSaved": 5.5, "compileSecondsFrom": "Pods"}]
    assert usage["measuredSecondsSaved"] == 5.5
    assert (usage["userCompileRequests"], usage["userHits"], usage["userHitRatio"]) == (7, 3, 0.429)
    assert usage["compileSecondsSaved"] == -1.0  # JAX's estimate, as it was


def test_a_pod_with_other_devices_misses_for_that_and_old_reporters_leave_the_new_fields_out() -> None:
    store = Store()
    store.record(parse(report("other", "u-1", [program("jit_step", misses_=1, compile_=1.0, keys=[H1], cached=[H2])],
                              fingerprint={**FP, "devices": 4})), NOW)
    usage = store.usage("ml", "llama", NOW, BODY)
    assert usage is not None and usage["missedPrograms"][0]["cause"] == misses.FINGERPRINT_DIFFERS
    assert "devices" in usage["missedPrograms"][0]["message"]
    old = Store()
    old.record(parse(report("old", "u-1", [], user=None)), NOW)
    usage = old.usage("ml", "llama", NOW, BODY)
    assert usage is not None
    assert not {"missedPrograms", "hitPrograms", "userCompileRequests", "measuredSecondsSaved"} & set(usage)


@pytest.mark.parametrize(("programs", "user", "words"), [
    ([program("jit_a", misses_=1, keys=["XYZ"])], (1, 0), "keys"),
    ([program("jit_a", misses_=1, cached=["a" * 17])], (1, 0), "cached"),
    ([program("jit_a", misses_=1, notWritten="tooBig")], (1, 0), "notWritten"),
    ([program("", misses_=1)], (1, 0), "program"),
    ([program("jit_a", misses_=-1)], (1, 0), "misses"),
    ([program("jit_a", compile_=-1.0)], (1, 0), "compileSeconds"),
    ([program("jit_a", hits=1)] * 51, (1, 0), "programs"),
    ([], (1, 2), "more user hits"),
])
def test_a_report_whose_programs_are_not_well_formed_is_refused(programs: list[dict[str, Any]],
                                                                 user: tuple[int, int], words: str) -> None:
    with pytest.raises(ReportError, match=words) as raised:
        parse(report("p", "u", programs, user=user))
    assert raised.value.status == 400


def test_a_full_report_gives_way_to_fit_the_cap_programs_last_and_still_parses() -> None:
    long = "jit_" + "x" * 190
    programs = [program(f"{long}{i:03d}"[:200], misses_=1, compile_=float(100 - i), keys=[f"{i:016x}"],
                        cached=[f"{i:016x}"] * 4) for i in range(reporter.MAX_PROGRAMS)]
    body = json.loads(report("p", "u", programs))
    body["counts"]["hitKeys"] = [{"program": long, "key": f"{long[:100]}-{i:099x}"} for i in range(reporter.MAX_HIT_KEYS)]
    body["counts"]["lastMisses"] = [{"program": long, "key": f"{long[:100]}-{i:099x}"} for i in range(reporter.MAX_MISSES)]
    assert len(json.dumps(body, separators=(",", ":"))) > MAX_BODY_BYTES
    taken = parse(reporter._fit(body, json.dumps))
    assert not taken.counts.hit_keys and len(taken.counts.last_misses) < reporter.MAX_MISSES  # those went first
    assert len(taken.counts.programs) == reporter.MAX_PROGRAMS  # every program the reporter sends fits then
    # More than that (a reporter of its own) would go too, the cheapest first.
    body = json.loads(report("p", "u", programs * 2))
    assert len(json.dumps(body, separators=(",", ":"))) > reporter.MAX_BODY_BYTES
    kept = json.loads(reporter._fit(body, json.dumps))["counts"]["programs"]
    assert 0 < len(kept) < 2 * reporter.MAX_PROGRAMS and kept[0]["compileSeconds"] == 100.0


def usage_with(*missed_: tuple[str, str]) -> dict[str, Any]:
    return {"compileRequests": 4, "misses": len(missed_),
            "missedPrograms": [{"program": p, "cause": cause, "compileSeconds": 1.0} for p, cause in missed_]}


def test_programs_warm_says_the_costliest_cause_and_names_programs_without_seconds() -> None:
    cond = misses.programs_warm(usage_with(("jit_u", misses.KEY_UNSTABLE), ("jit_c", misses.NOT_CACHEABLE)))
    assert (cond.type, cond.status, cond.reason) == (c.Condition.PROGRAMS_WARM, False, misses.KEY_UNSTABLE)
    assert "jit_u (KeyUnstable), jit_c (NotCacheable)" in cond.message and "1.0" not in cond.message
    assert misses.programs_warm({"compileRequests": 4, "misses": 0}).status is True
    assert misses.programs_warm(None).status is None
    unknown = misses.programs_warm({"compileRequests": 4, "misses": 2})
    assert (unknown.status, unknown.reason) == (None, "ProgramsNotReported")
    many = misses.programs_warm(usage_with(*[(f"jit_{i}", misses.NOT_WARMED) for i in range(8)]))
    assert "and 3 more" in many.message and "jit_5" not in many.message


def test_the_flush_asks_a_reconcile_only_while_the_condition_is_behind_the_usage() -> None:
    usage = usage_with(("jit_u", misses.KEY_UNSTABLE))
    cond = misses.programs_warm(usage)
    written = {"type": cond.type, "status": cond.status_text, "reason": cond.reason, "message": cond.message}
    assert misses.stale({"usage": usage})
    assert not misses.stale({"usage": usage, "conditions": [written]})
    usage["missedPrograms"][0]["compileSeconds"] = 7.0  # seconds alone change nothing
    assert not misses.stale({"usage": usage, "conditions": [written]})
    assert misses.stale({"usage": usage_with(("jit_u", misses.NOT_WARMED)), "conditions": [written]})
    assert misses.unstable(usage) == ["jit_u"] and misses.unstable(None) == []


def test_the_metric_counts_missed_programs_and_their_seconds_by_cause() -> None:
    caches = [{"metadata": {"namespace": "ml", "name": "llama"}, "status": {"usage": {
        "measuredSecondsSaved": 5.5, "missedPrograms": [
            {"program": "a", "cause": "KeyUnstable", "compileSeconds": 2.0},
            {"program": "b", "cause": "KeyUnstable", "compileSeconds": 1.0},
            {"program": "c", "cause": "NotCacheable", "compileSeconds": 0.5}, "junk"]}}}]
    registry: CollectorRegistry = Metrics(lambda: caches).registry
    labels = {"namespace": "ml", "cache": "llama"}
    assert registry.get_sample_value("cachewarm_missed_programs", {**labels, "cause": "KeyUnstable"}) == 2.0
    assert registry.get_sample_value("cachewarm_missed_program_seconds", {**labels, "cause": "KeyUnstable"}) == 3.0
    assert registry.get_sample_value("cachewarm_missed_programs", {**labels, "cause": "NotCacheable"}) == 1.0
    assert registry.get_sample_value("cachewarm_measured_seconds_saved", labels) == 5.5


def test_inspect_shows_the_programs_pods_compiled_with_their_causes() -> None:
    missed_ = [{"program": "jit_u", "cause": "KeyUnstable", "pods": 2, "misses": 3, "compileSeconds": 4.5,
                "message": "jit_u was warmed with another key"}]
    table = inspection.as_table("gs://b/p", [], [], missed_)
    assert "jit_u  KeyUnstable  2  3  4.5" in table and "jit_u was warmed with another key" in table
    assert json.loads(inspection.as_json("gs://b/p", [], [], missed_))["missedPrograms"] == missed_
    assert "CAUSE" not in inspection.as_table("gs://b/p", [], [])


def test_through_the_reconcile_keysmatch_and_programs_warm_agree_on_an_unstable_program() -> None:
    from cachewarm.api import conditions
    from cachewarm.reconcile import cache as service
    from cachewarm.reconcile.admitted import RecentInjections
    from memkube import MemoryKube
    from test_warmer_summary import GOOD, META, Gcs, job_pod
    from test_warmer_summary import NOW as SUMMARY_NOW

    body = {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}}
    kube = MemoryKube()

    def reconcile(status: dict[str, Any]) -> service.Outcome:
        wiring = service.Wiring(gcs=Gcs(), kube=kube, warmer_image="w", injections=RecentInjections(60),
                                claims=lambda bucket: [])
        return service.reconcile_cache(wiring, service.CacheObject("ml", "llama", body, META, status),
                                       now=SUMMARY_NOW, pod_fingerprints=[("trainer", FP)])

    first = reconcile({})
    [job] = kube.jobs
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1,
                     "startTime": "2026-11-22T06:00:00Z", "completionTime": "2026-11-22T06:30:00Z"}
    kube.pods.append(job_pod(job, json.dumps({**GOOD, "fingerprint": FP})))
    warmed = reconcile(first.status).status
    keys = conditions.get(warmed["conditions"], c.Condition.KEYS_MATCH) or {}
    assert (keys.get("status"), keys.get("reason")) == ("True", "FingerprintsMatch")
    assert (conditions.get(warmed["conditions"], c.Condition.PROGRAMS_WARM) or {}).get("reason") == "NoReports"
    # The usage flush wrote a program that got another key with the same fingerprint.
    usage = usage_with(("jit_unstable_step", misses.KEY_UNSTABLE))
    after = reconcile({**warmed, "usage": usage}).status
    keys = conditions.get(after["conditions"], c.Condition.KEYS_MATCH) or {}
    warm = conditions.get(after["conditions"], c.Condition.PROGRAMS_WARM) or {}
    assert (keys.get("status"), keys.get("reason")) == ("False", misses.KEY_UNSTABLE)
    assert "jit_unstable_step" in str(keys.get("message"))
    assert (warm.get("status"), warm.get("reason")) == ("False", misses.KEY_UNSTABLE)
    assert not misses.stale({**after, "usage": usage})  # the flush asks for no further reconcile


def test_a_pods_start_is_told_warm_against_cold_where_both_are_known() -> None:
    def counted(pod: str, requests: int, programs: list[dict[str, Any]]) -> bytes:
        body = json.loads(report(pod, f"uid-{pod}", programs))
        body["counts"].update(requests=requests, hits=sum(p["hits"] for p in programs),
                              misses=requests - sum(p["hits"] for p in programs))
        return json.dumps(body).encode()
    store = Store()
    store.record(parse(counted("cold", 2, [program("jit_a", misses_=1, compile_=3.0),
                                           program("jit_b", misses_=1, compile_=1.0)])), NOW)
    store.record(parse(counted("warm", 2, [program("jit_a", hits=1, load=0.2),
                                           program("jit_b", misses_=1, compile_=1.0)])), NOW)
    # Not known: a request not in its program list; a hit of a program no pod compiled.
    store.record(parse(counted("partial", 3, [program("jit_a", hits=1, load=0.2)])), NOW)
    store.record(parse(counted("unmeasured", 1, [program("jit_c", hits=1, load=0.1)])), NOW)
    usage = store.usage("ml", "llama", NOW, BODY)
    assert usage is not None
    assert usage["podStarts"] == [{"pod": "warm", "compileSeconds": 1.2, "coldCompileSeconds": 4.0}]


@pytest.mark.parametrize(("name", "kept"), [("\x1b]0;pwned\x07\x1b[2J", "?]0?pwned??[2J"),
                                           ("jit_a\nfake line", "jit_a?fake?line")])
def test_a_programs_name_is_kept_as_plain_text_without_control_characters(name: str, kept: str) -> None:
    from cachewarm.reports.store import ProgramUse
    rest = {"hits": 1, "misses": 0, "compileSeconds": 0, "loadSeconds": 0}
    assert ProgramUse.model_validate({"program": name, **rest}).program == kept
    for ok in ("jit_train_step", "jit__lambda", "jit_<lambda>", "pjit_f.1"):
        assert ProgramUse.model_validate({"program": ok, **rest}).program == ok
