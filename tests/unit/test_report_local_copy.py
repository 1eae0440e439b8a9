"""A pod's local copy in its reports: what the reporter reads of the copy's summary file
(and what it makes of a missing or odd one), what the operator takes (`localCopy`, checked
strictly), how status.usage.localCopy counts each pod once, and the LocalCopyCold Event
the leader posts once per pod whose copy failed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from memkube import MemoryKube
from reportdata import REPORT

from cachewarm.agents import reporter
from cachewarm.runtime.controller import Controller
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.reports.store import MAX_BODY_BYTES, ReportError, Store, cold_message, parse
from cachewarm.runtime.settings import Settings

NOW = dt.datetime(2026, 11, 23, 12, tzinfo=dt.timezone.utc)
COPY = {"copied": 12, "present": 3, "bytes": 4_096_000, "failed": 0, "cold": False, "seconds": 2.5,
        "source": "manifest"}
COLD = {"copied": 0, "present": 0, "bytes": 0, "failed": 4, "cold": True, "seconds": 30.0, "source": "prefix",
        "error": "URLError: <urlopen error [Errno 111] Connection refused>"}


def report(**changes: Any) -> dict[str, Any]:
    """reportdata's report with changes: `localCopy=...`, `pod__name=...` (a nested field)."""
    body: dict[str, Any] = json.loads(json.dumps(REPORT))
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = body
        for part in parents:
            node = node[part]
        node[leaf] = value
    return body


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def summary_file(tmp_path: Path, content: Any) -> str:
    path = tmp_path / "local-copy.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


# --- the reporter: the summary file as a report carries it ---

def test_the_reporter_carries_the_summary_clipped_and_the_first_error_only_when_cold(tmp_path: Path) -> None:
    summary = {"copied": 12, "present": 3, "bytes": 4_096_000, "failed": 1, "wanted": 16, "cold": False,
               "source": "manifest", "seconds": 2.34567, "errors": ["HTTPError 503"], "leftOut": {"budget": 2},
               "manifestsMissing": ["v5p"]}
    assert reporter.local_copy(summary_file(tmp_path, summary)) == {
        "copied": 12, "present": 3, "failed": 1, "bytes": 4_096_000, "cold": False, "seconds": 2.346,
        "source": "manifest"}
    cold = {**summary, "copied": 0, "cold": True, "errors": ["x" * 300, "second"]}
    assert reporter.local_copy(summary_file(tmp_path, cold))["error"] == "x" * 200  # type: ignore[index]
    # As the copier prints it, wrapped; numbers out of range, of the wrong type, missing.
    odd = {"cachewarm-copier": {"copied": 10**12, "present": -4, "bytes": True, "failed": "2", "cold": "yes",
                                "seconds": float("nan"), "source": "elsewhere", "errors": "not a list"}}
    assert reporter.local_copy(summary_file(tmp_path, odd)) == {
        "copied": reporter.MAX_COUNT, "present": 0, "failed": 0, "bytes": 0, "cold": False, "seconds": 0.0}
    assert reporter.local_copy(summary_file(tmp_path, {"cold": True})) == {
        "copied": 0, "present": 0, "failed": 0, "bytes": 0, "cold": True, "seconds": 0.0}


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "null", '"cold"', " " * (reporter.MAX_SUMMARY_BYTES + 1)])
def test_a_summary_that_is_no_json_object_means_no_local_copy(tmp_path: Path, content: str) -> None:
    assert reporter.local_copy(summary_file(tmp_path, content)) is None


def test_no_path_no_file_or_a_directory_means_no_local_copy(tmp_path: Path) -> None:
    assert reporter.local_copy("") is None
    assert reporter.local_copy(str(tmp_path / "missing.json")) is None
    assert reporter.local_copy(str(tmp_path)) is None


def test_every_report_carries_the_local_copy_read_once_and_it_parses(tmp_path: Path) -> None:
    path = summary_file(tmp_path, {**COPY, "errors": []})
    env = {reporter.ENV_LOCAL_COPY: path, reporter.ENV_CACHE: "llama", "CACHEWARM_POD_NAMESPACE": "ml",
           "CACHEWARM_POD_NAME": "t", "CACHEWARM_POD_UID": "u"}
    sender = reporter.Reporter(reporter.Tally(), env, tmp_path)
    first = sender.report()
    Path(path).unlink()  # the init container wrote it before the process started; read once
    second = sender.report()
    assert first["localCopy"] == second["localCopy"] == {k: v for k, v in COPY.items()}
    taken = parse(reporter._fit(second, json.dumps))
    assert taken.local_copy is not None and (taken.local_copy.copied, taken.local_copy.bytes_copied) == (12, 4_096_000)
    without = reporter.Reporter(reporter.Tally(), {k: v for k, v in env.items() if k != reporter.ENV_LOCAL_COPY},
                                tmp_path)
    assert "localCopy" not in without.report()


def test_a_report_with_a_cold_copy_and_long_names_still_fits_the_operators_cap(tmp_path: Path) -> None:
    env = {reporter.ENV_LOCAL_COPY: summary_file(tmp_path, {**COLD, "errors": ["e" * 5000] * 5}),
           reporter.ENV_CACHE: "llama", "CACHEWARM_POD_NAMESPACE": "ml", "CACHEWARM_POD_NAME": "t",
           "CACHEWARM_POD_UID": "u"}
    tally = reporter.Tally()
    long = "jit_" + "x" * 190
    for i in range(reporter.MAX_MISSES):
        tally.misses.append({"program": long, "key": f"{long[:100]}-{i:099x}"})
    for i in range(reporter.MAX_HIT_KEYS):
        tally.hit_keys[f"{long[:100]}-{i:099x}"] = long
    tally.requests = tally.hits = 40
    built = reporter.Reporter(tally, env, tmp_path).report()
    assert len(json.dumps(built, separators=(",", ":"))) > MAX_BODY_BYTES
    body = reporter._fit(built, json.dumps)
    assert len(body) <= reporter.MAX_BODY_BYTES
    taken = parse(body)
    assert taken.local_copy is not None and taken.local_copy.cold and taken.local_copy.error == "e" * 200


# --- the operator: what it takes ---

def test_a_report_with_a_local_copy_parses_and_unknown_fields_are_ignored() -> None:
    taken = parse(raw(report(localCopy={**COLD, "wanted": 9, "leftOut": {"budget": 1}})))
    assert taken.local_copy is not None
    assert (taken.local_copy.copied, taken.local_copy.present, taken.local_copy.bytes_copied, taken.local_copy.failed,
            taken.local_copy.cold, taken.local_copy.seconds, taken.local_copy.source) == (0, 0, 0, 4, True, 30.0, "prefix")
    assert taken.local_copy.error == COLD["error"]
    assert parse(raw(report())).local_copy is None
    minimal = {k: v for k, v in COPY.items() if k != "source"}
    assert parse(raw(report(localCopy={**minimal, "seconds": 3}))).local_copy is not None  # an int is a number


@pytest.mark.parametrize(("field", "value"), [
    ("copied", "12"), ("copied", 1.5), ("copied", True), ("copied", -1), ("copied", None),
    ("present", "3"), ("present", -1), ("present", False),
    ("bytes", "4096"), ("bytes", 10**16), ("bytes", 2.5),
    ("failed", "0"), ("failed", -2), ("failed", [1]),
    ("cold", "false"), ("cold", 0), ("cold", None),
    ("seconds", "2.5"), ("seconds", -0.1), ("seconds", True),
    ("source", "somewhere"), ("source", 1),
    ("error", 42), ("error", "e" * 201),
])
def test_a_local_copy_field_of_the_wrong_type_or_range_is_refused(field: str, value: Any) -> None:
    local = {**COPY, field: value}
    if value is None:
        local.pop(field)  # a required field missing
    with pytest.raises(ReportError, match=f"localCopy.*{field}") as refused:
        parse(raw(report(localCopy=local)))
    assert refused.value.status == 400


@pytest.mark.parametrize("local", ["copied", 12, [COPY], True])
def test_a_local_copy_that_is_no_object_is_refused(local: Any) -> None:
    with pytest.raises(ReportError, match="localCopy") as refused:
        parse(raw(report(localCopy=local)))
    assert refused.value.status == 400


# --- usage: each pod once ---

def test_usage_counts_each_pods_local_copy_once_and_its_cold_pods() -> None:
    store = Store(dt.timedelta(hours=1))
    # Pod 1: two processes report the same copy; the later report of one of them too.
    store.record(parse(raw(report(localCopy=COPY))), NOW)
    store.record(parse(raw(report(process__pid=8, localCopy=COPY))), NOW)
    store.record(parse(raw(report(sequence=2, localCopy=COPY))), NOW + dt.timedelta(seconds=60))
    # Pod 2: a cold copy. Pod 3: no local copy at all.
    store.record(parse(raw(report(pod__name="t-2", pod__uid="u-2", localCopy=COLD))), NOW)
    store.record(parse(raw(report(pod__name="t-3", pod__uid="u-3"))), NOW)
    usage = store.usage("ml", "llama", NOW + dt.timedelta(seconds=60))
    assert usage is not None and (usage["pods"], usage["processes"]) == (3, 4)
    assert usage["localCopy"] == {"pods": 2, "coldPods": 1, "entriesCopied": 12, "entriesPresent": 3,
                                  "bytesCopied": 4_096_000, "maxSeconds": 30.0}


def test_usage_has_no_local_copy_while_no_pod_reported_one_in_the_window() -> None:
    store = Store(dt.timedelta(minutes=10))
    store.record(parse(raw(report())), NOW)
    usage = store.usage("ml", "llama", NOW)
    assert usage is not None and "localCopy" not in usage
    store.record(parse(raw(report(pod__name="t-2", pod__uid="u-2", localCopy=COPY))), NOW - dt.timedelta(minutes=20))
    usage = store.usage("ml", "llama", NOW)  # that pod's report is older than the window
    assert usage is not None and "localCopy" not in usage


def test_a_cold_copy_is_said_once_per_pod_and_the_message_names_the_pods() -> None:
    store = Store(dt.timedelta(hours=1))
    store.record(parse(raw(report(localCopy=COLD))), NOW)
    store.record(parse(raw(report(process__pid=8, localCopy=COLD))), NOW)  # the same pod's other process
    store.record(parse(raw(report(pod__name="t-2", pod__uid="u-2", localCopy=COPY))), NOW)  # warm
    assert store.newly_cold("ml", "llama", NOW) == [("trainer", COLD["error"])]
    assert store.newly_cold("ml", "llama", NOW) == []
    store.record(parse(raw(report(sequence=2, localCopy=COLD))), NOW + dt.timedelta(seconds=60))
    store.record(parse(raw(report(pod__name="t-4", pod__uid="u-4", localCopy={**COLD, "error": None}))), NOW)
    assert store.newly_cold("ml", "llama", NOW + dt.timedelta(seconds=60)) == [("t-4", "")]
    store.prune(NOW + dt.timedelta(seconds=60), caches=set())  # the cache was deleted
    assert store.newly_cold("ml", "llama", NOW) == []
    assert cold_message([("trainer", "Boom")]) == (
        "Pod trainer started without the cache's entries: the local copy failed (Boom); its processes compile "
        "what they would have read from it")
    many = cold_message([(f"t-{i}", "") for i in range(7)])
    assert many.startswith("7 pods (t-0, t-1, t-2, t-3, t-4 and 2 more) started without the cache's entries: the "
                           "local copy failed; their")


class Lead:
    is_leader = True


def test_the_leader_posts_local_copy_cold_once_and_removes_a_local_copy_no_pod_reports_any_more() -> None:
    kube = MemoryKube()
    settings = Settings(workers=1, resync_seconds=3600, warm_poll_seconds=3600)
    controller = Controller(settings, None, kube, RecentInjections(60), Lead())  # type: ignore[arg-type]
    now = dt.datetime.now(dt.timezone.utc)
    written = {"pods": 1, "localCopy": {"pods": 1}, "lastReportTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    controller.store[("ml", "llama")] = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                         "metadata": {"namespace": "ml", "name": "llama", "uid": "c-1"},
                                         "status": {"usage": written}}
    controller.reports.record(parse(raw(report(pod__name="t-2", pod__uid="u-2"))), now)

    async def flush() -> None:
        """One round of the leader's usage flush, waited for until every write it sent
        (status patches, Events) has been made: a fresh executor per round, shut down with
        wait=True, so what the assertions see is all the round did, however slow the
        machine (no window to outlast)."""
        controller._loop = asyncio.get_running_loop()
        controller._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flush")
        controller._flush_usage()
        await asyncio.to_thread(controller._executor.shutdown, wait=True)
    asyncio.run(flush())
    [(_, _, status)] = kube.status_patches
    assert status["usage"]["localCopy"] is None and status["usage"]["pods"] == 1  # named, so the merge removes it
    assert kube.events == []

    controller.reports.record(parse(raw(report(localCopy=COLD))), now)
    asyncio.run(flush())
    asyncio.run(flush())
    assert kube.events == [("Warning", "LocalCopyCold", cold_message([("trainer", str(COLD["error"]))]))]
    assert kube.status_patches[-1][2]["usage"]["localCopy"]["coldPods"] == 1


def test_a_copy_error_with_control_characters_reaches_status_and_events_as_one_plain_line() -> None:
    # Attacker review: the pod writes this text; a terminal escape or a newline in it would
    # reach the LocalCopyCold Event and `kubectl describe` as such.
    parsed = parse(raw(report(localCopy={**COLD, "error": "HTTP 403\x1b[2J\nforged line\x07"})))
    assert parsed.local_copy is not None and parsed.local_copy.error == "HTTP 403?[2J?forged line?"
    assert "\n" not in cold_message([("trainer", parsed.local_copy.error)])
