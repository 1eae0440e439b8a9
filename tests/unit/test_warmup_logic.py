"""Pure parts of the warmup reconcile: re-warm tokens, Job state, summaries, Warmed."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from cachewarm.model import parse_spec
from cachewarm.warmups import _job_state, _warmed, pool_status, read_summaries, rewarm_token


def spec(schedule: str | None = None) -> Any:
    warmup: dict[str, Any] = {"image": "i", "targets": ["m:f"], "pools": [{"name": "p"}]}
    if schedule:
        warmup["schedule"] = schedule
    return parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "warmup": warmup})


def at(hour: int, minute: int = 0) -> dt.datetime:
    return dt.datetime(2026, 11, 22, hour, minute, tzinfo=dt.timezone.utc)


def test_cron_slot_changes_the_token_only_at_the_next_slot() -> None:
    daily = spec("0 3 * * *")
    assert rewarm_token(daily, {}, at(3, 1)) == rewarm_token(daily, {}, at(23, 59))
    assert rewarm_token(daily, {}, at(2, 59)) != rewarm_token(daily, {}, at(3, 0))


def test_manual_annotation_is_part_of_the_token() -> None:
    assert rewarm_token(spec(), {"cachewarm.dev/rewarm": "2"}, at(1)) != rewarm_token(spec(), {}, at(1))
    assert rewarm_token(spec(), {}, at(1)) == rewarm_token(spec(), {}, at(20))  # no schedule: time is irrelevant


def test_job_state_from_conditions() -> None:
    assert _job_state({"status": {}}) == "Pending"
    assert _job_state({"status": {"active": 1, "startTime": "t"}}) == "Running"
    assert _job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "Succeeded"
    assert _job_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "Failed"
    assert _job_state({"status": {"conditions": [{"type": "Failed", "status": "False"}], "active": 1}}) == "Running"


def pod(message: str, name: str = "warm") -> dict[str, Any]:
    return {"status": {"containerStatuses": [{"name": name, "state": {"terminated": {"message": message}}}]}}


def test_summaries_are_read_from_termination_messages() -> None:
    good = json.dumps({"entriesFound": 1, "entriesWritten": 2, "bytesWritten": 10, "compileSeconds": 3.5, "errors": []})
    assert read_summaries([pod(good), pod("", "other")]) == [json.loads(good)]
    assert read_summaries([pod("Traceback ... MemoryError")]) == [{"errors": ["Traceback ... MemoryError"]}]


def test_two_host_summaries_add_writes_and_take_the_slowest_compile() -> None:
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}], "startTime": "s", "completionTime": "c"}}
    summaries = [{"entriesFound": 0, "entriesWritten": 3, "bytesWritten": 30, "compileSeconds": 5},
                 {"entriesFound": 0, "entriesWritten": 0, "bytesWritten": 0, "compileSeconds": 7}]
    pool = spec().warmup.pools[0]
    assert pool_status("j", pool, "h", job, summaries) == {
        "name": "p", "job": "j", "specHash": "h", "state": "Succeeded", "startTime": "s", "completionTime": "c",
        "entriesFound": 0, "entriesWritten": 3, "bytesWritten": 30, "compileSeconds": 7.0}


def test_warmed_needs_every_pool_and_entries_on_the_bucket() -> None:
    ok = {"name": "a", "state": "Succeeded"}
    assert _warmed([ok, {"name": "b", "state": "Running"}], 5).reason == "Warming"
    assert _warmed([ok, {"name": "b", "state": "Failed", "lastError": "boom"}], 5).message == "Warmer failed on b: boom"
    assert _warmed([ok], 0).reason == "CacheEmpty"
    assert _warmed([ok], 3).status is True
