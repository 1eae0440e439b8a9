"""Reports from training pods: what a report must look like, whose token may send it, how
the latest report of each process makes the cache's usage, and KeysMatch in words."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reportdata import REVIEW

from cachewarm.reconcile.keysmatch import keys_match
from cachewarm.reports import store as store_module
from cachewarm.reports.store import (MAX_BODY_BYTES, MAX_PROCESSES_PER_POD, POD_REPORT_BURST, ReportError, Store,
                                     check_identity, parse)

NOW = dt.datetime(2026, 11, 23, 12, tzinfo=dt.timezone.utc)


def report(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "version": 1, "pod": {"namespace": "ml", "name": "trainer", "uid": "u-1"}, "cache": "llama",
        "process": {"pid": 7, "started": 1_700_000_000, "index": 0}, "sequence": 1,
        "counts": {"requests": 4, "hits": 3, "misses": 1, "compileSecondsSaved": 12.5, "compileSecondsSpent": 2.0,
                   "compiles": 1, "lastMisses": [{"program": "jit_eval", "key": "jit_eval-" + "a" * 64}]},
        "fingerprint": {"jax": "0.10.2", "devices": 8}}
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = body
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(leaf)
        else:
            node[leaf] = value
    return body


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()




@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "not a cachewarm report"),
    (raw(report(version=2)), 400, "version"),
    (raw(report(pod__uid=None)), 400, "uid"),
    (raw(report(counts__hits=-1)), 400, "hits"),
    (raw(report(counts__hits=9)), 400, "more hits than compile requests"),
    (raw(report(cache="")), 400, "cache"),
    (raw(report(counts__lastMisses=[{"program": "p", "key": "k"}] * 51)), 400, "lastMisses"),
    (b" " * (MAX_BODY_BYTES + 1), 413, "larger than"),
    # A fingerprint that is not one never reaches a reconcile (it used to raise in KeysMatch).
    (raw(report(fingerprint={"versions": "xx"})), 400, "versions"),
    (raw(report(fingerprint__devices="8")), 400, "devices"),
    (raw(report(fingerprint__devices=True)), 400, "devices"),
    (raw(report(fingerprint={"versions": {"jaxlib": 10}})), 400, "versions"),
    (raw(report(fingerprint={"versions": {f"p{i}": "1" for i in range(17)}})), 400, "versions"),
    (raw(report(fingerprint="jax")), 400, "fingerprint"),
])
def test_a_malformed_or_oversized_report_is_refused_with_what_is_wrong(body: bytes, status: int, message: str) -> None:
    with pytest.raises(ReportError, match=message) as refused:
        parse(body)
    assert refused.value.status == status


@pytest.mark.parametrize(("reviewed", "body", "message"), [
    ({**REVIEW, "user": {"username": "system:serviceaccount:ml:trainer", "extra": {}}}, report(),
     "not bound to a pod"),
    ({**REVIEW, "user": {"username": "alice", "extra": REVIEW["user"]["extra"]}}, report(), "not bound to a pod"),
    (REVIEW, report(pod__name="someone-else"), "belongs to pod ml/trainer"),
    (REVIEW, report(pod__uid="u-2"), "belongs to pod ml/trainer"),
    (REVIEW, report(pod__namespace="other"), "belongs to pod ml/trainer"),
    (REVIEW, report(cache="other/llama"), "own namespace"),
])
def test_only_the_pod_the_token_is_bound_to_reports_and_only_for_its_namespace(
        reviewed: dict[str, Any], body: dict[str, Any], message: str) -> None:
    with pytest.raises(ReportError, match=message) as refused:
        check_identity(parse(raw(body)), reviewed)
    assert refused.value.status == 403


def test_the_latest_report_of_each_process_makes_the_usage_and_counts_once() -> None:
    store = Store(dt.timedelta(hours=1))
    assert store.record(parse(raw(report())), NOW) == {"hits": 3.0, "misses": 1.0, "saved": 12.5}
    later = report(sequence=2, counts__requests=10, counts__hits=8, counts__misses=2, counts__compileSecondsSaved=40.0)
    assert store.record(parse(raw(later)), NOW + dt.timedelta(seconds=60)) == {"hits": 5.0, "misses": 1.0,
                                                                                 "saved": 27.5}
    # A repeated or late report changes nothing.
    assert store.record(parse(raw(report())), NOW + dt.timedelta(seconds=120)) == {"hits": 0.0, "misses": 0.0,
                                                                                     "saved": 0.0}
    other = report(pod__name="trainer-2", pod__uid="u-2", counts__requests=2, counts__hits=0, counts__misses=2,
                   counts__compileSecondsSaved=0.0)
    store.record(parse(raw(other)), NOW + dt.timedelta(seconds=130))
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=130))
    assert usage is not None
    assert (usage["pods"], usage["processes"], usage["compileRequests"], usage["hits"], usage["misses"]) == \
        (2, 2, 12, 8, 4)
    assert usage["hitRatio"] == 0.667 and usage["compileSecondsSaved"] == 40.0
    assert usage["lastMisses"][0]["pod"] == "trainer-2"
    assert store.usage("ml", "llama", NOW + dt.timedelta(hours=2)) is None  # the window passed
    assert store.usage("ml", "other", NOW) is None


def test_a_pod_reporting_too_often_is_told_to_wait() -> None:
    store = Store()
    store.record(parse(raw(report())), NOW)
    with pytest.raises(ReportError, match="at most one report every 5s") as refused:
        store.record(parse(raw(report(sequence=2))), NOW + dt.timedelta(seconds=1))
    assert refused.value.status == 429


WARMED = {"jax": "0.10.2", "versions": {"jaxlib": "0.10.2"}, "platform": "tpu", "deviceKind": "TPU v5p",
          "devices": 8, "processes": 2, "topology": "2x2x2", "flagsHash": "abc", "cacheDir": "gs://b/p",
          "image": "train@sha256:" + "a" * 64}


def test_keys_match_says_in_words_what_differs() -> None:
    pools = [{"name": "v5p", "state": "Succeeded", "fingerprint": WARMED}]
    same = {k: v for k, v in WARMED.items() if k != "image"}  # a pod does not report its image
    assert keys_match(pools, [("trainer", same)])[0] is True
    # Not in JAX's keys: jax's own version, the process count, the cache dir.
    assert keys_match(pools, [("trainer", {**same, "jax": "0.10.3", "processes": 1, "cacheDir": "/x"})])[0] is True
    other = {**same, "versions": {"jaxlib": "0.10.1"}, "devices": 4, "topology": "2x2x1"}
    matched, reason, message = keys_match(pools, [("trainer", same), ("trainer-2", other)])
    assert (matched, reason) == (False, "FingerprintsDiffer")
    assert message == ("Training pods compute other keys than the warmers and miss: they run 4 devices, topology "
                       "2x2x1, jaxlib 0.10.1; pool v5p was warmed with 8 devices, topology 2x2x2, jaxlib 0.10.2")
    # The same difference from another pod reads the same (one Event, not one per pod).
    assert keys_match(pools, [("trainer-3", other), ("trainer", same)])[2] == message
    assert keys_match(pools, [])[:2] == (None, "NoReports")
    assert keys_match([{"name": "v5p", "state": "Succeeded"}], [("trainer", same)])[:2] == (None, "NotWarmed")
    failed = [{"name": "v5p", "state": "Failed", "fingerprint": WARMED}]
    assert keys_match(failed, [("trainer", same)])[:2] == (None, "NotWarmed")  # a failed warm warmed nothing


def test_a_process_first_seen_after_a_leader_change_sets_a_baseline_and_is_not_counted_again() -> None:
    store = Store()
    assert store.record(parse(raw(report(sequence=7))), NOW) == {"hits": 0.0, "misses": 0.0, "saved": 0.0}
    later = report(sequence=8, counts__requests=6, counts__hits=5, counts__compileSecondsSaved=20.0)
    assert store.record(parse(raw(later)), NOW + dt.timedelta(seconds=60)) == {"hits": 2.0, "misses": 0.0,
                                                                                 "saved": 7.5}


def test_processes_of_one_pod_report_apart_and_a_final_report_is_always_taken() -> None:
    store = Store()
    store.record(parse(raw(report())), NOW)
    store.record(parse(raw(report(process__pid=8))), NOW)  # another process of the same pod
    final = report(sequence=2, final=True, counts__requests=5, counts__hits=4)
    assert store.record(parse(raw(final)), NOW + dt.timedelta(seconds=1))["hits"] == 1.0
    with pytest.raises(ReportError) as again:
        store.record(parse(raw(report(sequence=3, final=True))), NOW + dt.timedelta(seconds=2))
    assert again.value.status == 429


def test_usage_without_compile_requests_has_no_hit_ratio_and_old_processes_are_forgotten() -> None:
    store = Store(dt.timedelta(minutes=10))
    store.record(parse(raw(report(counts__requests=0, counts__hits=0, counts__misses=0))), NOW)
    usage = store.usage("ml", "llama", NOW)
    assert usage is not None and "hitRatio" not in usage
    store.prune(NOW + dt.timedelta(minutes=11))
    assert store.caches() == []
    store.record(parse(raw(report(pod__uid="u-9"))), NOW)
    store.prune(NOW, caches=set())  # the cache was deleted
    assert store.caches() == []


def test_usage_names_the_entries_pods_hit_newest_first_with_their_pods() -> None:
    store = Store(dt.timedelta(hours=1))
    step, evaluate = "jit_step-" + "b" * 64, "jit_eval-" + "c" * 64
    store.record(parse(raw(report(counts__hitKeys=[{"program": "jit_step", "key": step}]))), NOW)
    store.record(parse(raw(report(pod__name="t-2", pod__uid="u-2", counts__hitKeys=[
        {"program": "jit_step", "key": step}, {"program": "jit_eval", "key": evaluate}]))),
        NOW + dt.timedelta(seconds=30))
    # Newest first: jit_eval was last hit 30 s after jit_step's first pod, and as late as its second.
    store.record(parse(raw(report(sequence=2, counts__hitKeys=[{"program": "jit_step", "key": step}]))),
                 NOW + dt.timedelta(seconds=40))
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=40))
    assert usage is not None
    assert usage["recentHits"] == [
        {"program": "jit_step", "key": step, "pods": ["t-2", "trainer"], "podCount": 2},
        {"program": "jit_eval", "key": evaluate, "pods": ["t-2"], "podCount": 1},
    ]
    with pytest.raises(ReportError):  # at most 50 keys in a report
        parse(raw(report(counts__hitKeys=[{"program": "p", "key": f"p-{i}"} for i in range(51)])))


def test_usage_keeps_at_most_50_entries_hit_and_5_pod_names_each_as_the_crd_allows() -> None:
    store = Store(dt.timedelta(hours=1))
    keys = [{"program": "p", "key": f"p-{i:064x}"} for i in range(50)]
    for n in range(7):
        store.record(parse(raw(report(pod__name=f"t-{n}", pod__uid=f"u-{n}", counts__hitKeys=keys if n == 0 else
                                      [*keys[:1], {"program": "q", "key": f"q-{n:064x}"}]))),
                     NOW + dt.timedelta(seconds=n))
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=10))
    assert usage is not None and len(usage["recentHits"]) == 50
    shared = next(h for h in usage["recentHits"] if h["key"] == keys[0]["key"])
    assert len(shared["pods"]) == 5 and shared["podCount"] == 7


def test_a_fingerprint_keeps_what_keys_match_compares_and_drops_fields_it_does_not_know() -> None:
    sent = {"jax": "0.10.2", "versions": {"jaxlib": "0.10.2"}, "flagsHash": "abc", "flagCount": 3, "cacheDir": "/c",
            "platform": "cpu", "platformVersion": "x", "deviceKind": "cpu", "devices": 8, "processes": 1,
            "topology": "2x4", "error": "e"}
    store = Store()
    store.record(parse(raw(report(fingerprint={**sent, "fromANewerReporter": [1, 2]}))), NOW)
    assert store.fingerprints("ml", "llama", NOW) == [("trainer", sent)]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=12)
_fingerprint_keys = st.sampled_from(["jax", "versions", "flagsHash", "flagCount", "cacheDir", "platform",
                                     "platformVersion", "deviceKind", "devices", "processes", "topology", "error",
                                     "framework", "inductorConfigHash", "torchKey", "inductorEnv", "inductorChanged"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_fingerprint_keys, _json, max_size=6) | _json)
@example({"platform": "cpu\n\x1b[2J", "inductorEnv": {"TORCHINDUCTOR_X": "\r"}, "framework": "torch"})
def test_any_fingerprint_is_refused_with_a_400_or_compared_without_raising(fingerprint: Any) -> None:
    """Whatever a pod puts in its fingerprint: parse answers a ReportError (a 4xx) or a
    report whose fingerprint KeysMatch compares with a warmed pool's without raising, so a
    report can never fail the cache's reconcile."""
    try:
        parsed = parse(raw(report(fingerprint=fingerprint if fingerprint is not None else {})))
    except ReportError as refused:
        assert 400 <= refused.status < 500
        return
    store = Store()
    store.record(parsed, NOW)
    warmed = [{"name": "cpu", "state": "Succeeded",
               "fingerprint": {"jax": "0.10.2", "versions": {"jaxlib": "0.10.2"}, "devices": 8}},
              {"name": "torch", "state": "Succeeded",  # a torch warm's (issue 31)
               "fingerprint": {"framework": "torch", "versions": {"torch": "2.15.0"}, "inductorConfigHash": "a" * 12,
                               "inductorEnv": {"TORCHINDUCTOR_X": "1"}, "inductorChanged": {"k": "True"}}}]
    for pools in (warmed[:1], warmed[1:], warmed):
        matched, reason, message = keys_match(pools, store.fingerprints("ml", "llama", NOW))
        assert matched in (True, False, None) and reason and message
        assert message.isprintable()  # a pod's text reaches a condition and an Event as one line


def _many(store: Store, pod: str, processes: range, at: dt.datetime, **changes: Any) -> list[int]:
    """Reports of processes (pids) `processes` of pod `pod` (uid u-<pod>) at `at`: each one's
    answer, 202 taken or the ReportError's status."""
    codes = []
    for pid in processes:
        try:
            store.record(parse(raw(report(pod__name=pod, pod__uid=f"u-{pod}", process__pid=pid, **changes))), at)
            codes.append(202)
        except ReportError as refused:
            codes.append(refused.status)
    return codes


def test_a_pod_keeps_at_most_64_processes_and_a_new_one_past_them_is_429() -> None:
    """The processes a pod says it has are its to choose (pid, started): the limit is on
    the pod (uid). Its reports come a minute apart here, so only the process cap refuses."""
    store = Store(dt.timedelta(hours=1))
    for minute in range(MAX_PROCESSES_PER_POD):
        assert _many(store, "p", range(minute, minute + 1), NOW + dt.timedelta(minutes=minute)) == [202]
    later = NOW + dt.timedelta(minutes=MAX_PROCESSES_PER_POD)
    assert _many(store, "p", range(1000, 1001), later) == [429]
    assert _many(store, "p", range(0, 1), later, sequence=2) == [202]  # one it has still reports
    assert _many(store, "q", range(1000, 1001), later) == [202]  # another pod is not held
    # Once its old processes' reports are out of the window, new ones are taken again.
    store.prune(NOW + dt.timedelta(minutes=MAX_PROCESSES_PER_POD + 59, seconds=30))
    assert _many(store, "p", range(1000, 1001), NOW + dt.timedelta(minutes=MAX_PROCESSES_PER_POD + 60)) == [202]


def test_a_pods_reports_at_once_are_bounded_whatever_processes_it_names() -> None:
    store = Store()
    assert _many(store, "p", range(POD_REPORT_BURST), NOW) == [202] * POD_REPORT_BURST
    # Six seconds later its processes may each report again (5 s apart), the pod 6.4 more.
    assert _many(store, "p", range(8), NOW + dt.timedelta(seconds=6), sequence=2) == [202] * 6 + [429] * 2
    assert _many(store, "q", range(1), NOW + dt.timedelta(seconds=6)) == [202]  # another pod's own allowance


def test_one_pod_naming_2000_processes_in_a_second_neither_evicts_another_nor_inflates_the_counts() -> None:
    """The reviewer's attack: 2000 "processes" of one pod in a second, each with a billion
    hits, against one report of a victim pod."""
    store = Store(dt.timedelta(hours=1))
    store.record(parse(raw(report(pod__name="victim", pod__uid="u-victim"))), NOW)
    big = {"counts__requests": 10**9, "counts__hits": 10**9}
    codes = _many(store, "attacker", range(2000), NOW + dt.timedelta(seconds=1), **big)
    assert codes.count(202) == MAX_PROCESSES_PER_POD and set(codes) == {202, 429}
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=1))
    assert usage is not None
    assert usage["hits"] == 3 + MAX_PROCESSES_PER_POD * 10**9  # at most what 64 processes of one pod report
    assert (usage["pods"], usage["processes"]) == (2, 1 + MAX_PROCESSES_PER_POD)
    assert "victim" in {pod for pod, _ in store.fingerprints("ml", "llama", NOW + dt.timedelta(seconds=1))}


def test_when_a_cache_is_full_the_process_forgotten_is_of_the_pod_that_keeps_the_most(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "MAX_PROCESSES_PER_CACHE", 4)
    store = Store(dt.timedelta(hours=1))
    store.record(parse(raw(report(pod__name="victim", pod__uid="u-victim"))), NOW)  # the oldest of all
    for second in range(1, 11):
        assert _many(store, "attacker", range(second, second + 1), NOW + dt.timedelta(seconds=second)) == [202]
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=10))
    assert usage is not None and (usage["processes"], usage["pods"]) == (4, 2)
    assert "victim" in {pod for pod, _ in store.fingerprints("ml", "llama", NOW + dt.timedelta(seconds=10))}


def test_counts_that_go_down_and_up_again_add_nothing_twice() -> None:
    store = Store()
    added = []
    for n, hits in enumerate((10**9 - 5, 0, 10**9 - 5, 10**9), start=1):
        changed = report(sequence=n, counts__requests=10**9, counts__hits=hits, counts__compileSecondsSaved=0.0)
        added.append(store.record(parse(raw(changed)), NOW + dt.timedelta(minutes=n))["hits"])
    assert added == [10**9 - 5, 0, 0, 5]


def test_a_process_final_report_is_taken_once_past_the_pods_allowance() -> None:
    store = Store()
    assert _many(store, "p", range(POD_REPORT_BURST), NOW) == [202] * POD_REPORT_BURST
    at = NOW + dt.timedelta(seconds=1)
    assert _many(store, "p", range(1), at, sequence=2) == [429]  # the allowance is spent
    assert _many(store, "p", range(1), at, sequence=2, final=True) == [202]  # its exit report, once
    assert _many(store, "p", range(1), at, sequence=3, final=True) == [429]
