"""The controller's rules: which watch events ask for a reconcile, which finalizers a cache
should carry, and the work queue as the controller drives it (one reconcile of a cache at a
time, a change during a reconcile reconciled right after, nothing reconciled by a replica
that does not lead). The queue on its own: test_queue.py.

Nothing here is timed: a test waits for the state it means (a reconcile started, the queue
idle, a timer asked for), with a deadline only as a guard against a hang. Reconciles that
must overlap something block on a gate the test opens."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cachewarm.api import constants as c
from cachewarm.runtime.controller import Controller, Key, Result, merged, wanted_finalizers, worth_reconciling
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.runtime.settings import Settings
from memgcs import until
from memkube import MemoryKube


def body(generation: int = 1, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "llama", "generation": generation, **meta},
            "spec": {}, "status": {"observedGeneration": generation}}


@pytest.mark.parametrize(("old", "new", "worth"), [
    (None, body(), True),  # first sight
    (body(1), body(2), True),  # spec changed
    (body(annotations={"a": "1"}), body(annotations={"a": "2"}), True),  # cachewarm.dev/rewarm
    (body(), body(finalizers=["x"]), True),
    (body(), body(deletionTimestamp="2026-11-22T00:00:00Z"), True),
    (body(), {**body(), "status": {"observedGeneration": 1, "conditions": []}}, False),  # our own status write
    (body(resourceVersion="1"), body(resourceVersion="2"), False),
])
def test_which_watch_events_ask_for_a_reconcile(old: Any, new: Any, worth: bool) -> None:
    assert worth_reconciling(old, new) is worth


DELETE = {"storage": {"gcs": {"deletionPolicy": "Delete"}}}
RETAIN = {"storage": {"gcs": {"deletionPolicy": "Retain"}}}


@pytest.mark.parametrize(("meta", "spec", "wanted"), [
    ({}, DELETE, [c.FINALIZER]),
    ({"finalizers": ["theirs"]}, DELETE, ["theirs", c.FINALIZER]),  # others' kept, ours added last
    ({"finalizers": [c.FINALIZER]}, DELETE, None),
    ({}, RETAIN, None),
    ({}, {}, None),  # Retain is the default: never a finalizer
    ({"finalizers": ["theirs", c.FINALIZER]}, RETAIN, ["theirs"]),  # policy changed to Retain
    # Being deleted: the finalizer goes only after the data (controller._finalize), never here.
    ({"finalizers": [c.FINALIZER], "deletionTimestamp": "t"}, RETAIN, None),
    ({"deletionTimestamp": "t"}, DELETE, None),
])
def test_finalizer_only_while_deletion_policy_is_delete(meta: Any, spec: Any, wanted: Any) -> None:
    assert wanted_finalizers(meta, spec) == wanted


class Lead:
    def __init__(self, leading: bool = True) -> None:
        self.is_leader = leading


def _controller(monkeypatch: pytest.MonkeyPatch, reconcile: Any, leading: bool = True) -> Controller:
    # Resync, poll and usage timers an hour away: only what a test does queues a cache.
    settings = Settings(workers=4, resync_seconds=3600, warm_poll_seconds=3600, usage_flush_seconds=3600,
                        retry_delay_seconds=0.05)
    controller = Controller(settings, None, MemoryKube(), RecentInjections(60), Lead(leading))  # type: ignore[arg-type]
    monkeypatch.setattr(controller, "reconcile_one", reconcile)
    monkeypatch.setattr(controller, "release_orphans", lambda: None)
    return controller


async def _drive(controller: Controller, steps: Callable[[], Awaitable[None]]) -> None:
    """Run the controller (its workers and timers) while `steps` runs."""
    task = asyncio.create_task(controller.run())
    try:
        await until(lambda: controller.running, "the controller listed the caches and started its workers")
        await steps()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_one_reconcile_of_a_cache_at_a_time_and_a_change_meanwhile_is_reconciled_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    running: dict[Key, int] = {}
    overlap: list[Key] = []
    calls: list[Key] = []
    guard = threading.Lock()
    gate = threading.Event()  # every reconcile waits here until the test opens it

    def reconcile(key: Key) -> Result:
        with guard:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlap.append(key)
            calls.append(key)
        gate.wait(10)
        with guard:
            running[key] -= 1
        return Result()

    controller = _controller(monkeypatch, reconcile)

    async def steps() -> None:
        controller.enqueue(("ml", "a"))
        controller.enqueue(("ml", "b"))
        await until(lambda: sorted(calls) == [("ml", "a"), ("ml", "b")], "both caches being reconciled")
        for _ in range(5):  # five changes of "a" while it is reconciled: one more reconcile
            controller.enqueue(("ml", "a"))
        # Not in the queue, where one of the two idle workers would take it at once: due
        # again once the reconcile in flight ends.
        assert controller.queued == frozenset()
        gate.set()
        await until(lambda: not controller.busy, "nothing queued or being reconciled")

    try:
        asyncio.run(_drive(controller, steps))
    finally:
        gate.set()
    assert overlap == []
    assert calls.count(("ml", "a")) == 2 and calls.count(("ml", "b")) == 1


def test_a_replica_that_does_not_lead_reconciles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Key] = []
    controller = _controller(monkeypatch, lambda key: calls.append(key) or Result(), leading=False)
    lead: Lead = controller.leader  # type: ignore[assignment]

    async def steps() -> None:
        controller.observe(None, body())
        controller.enqueue(("ml", "llama"))
        await until(lambda: not controller.busy, "the queue drained")
        assert calls == [] and ("ml", "llama") in controller.store
        # The same replica, once it leads, reconciles the cache it kept in its store.
        lead.is_leader = True
        controller.leadership_changed(True)
        await until(lambda: calls == [("ml", "llama")] and not controller.busy, "the new leader's reconcile")

    asyncio.run(_drive(controller, steps))


def test_a_failed_reconcile_is_retried_with_backoff_and_a_success_resets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = [Result(retry=True), Result(retry=True), Result(), Result(retry=True), Result()]
    calls: list[Key] = []
    delays: list[float] = []  # the backoff each retry was queued after
    pending: list[int] = [0]  # retry timers not fired yet

    def reconcile(key: Key) -> Result:
        calls.append(key)
        return outcomes[len(calls) - 1]

    controller = _controller(monkeypatch, reconcile)

    async def steps() -> None:
        loop = asyncio.get_running_loop()
        later = loop.call_later

        def call_later(delay: float, fn: Any, *args: Any) -> asyncio.TimerHandle:
            if fn != controller.queue.add:
                return later(delay, fn, *args)  # asyncio's own sleeps
            delays.append(delay)  # recorded, and queued at once: the wait is not what is tested
            pending[0] += 1

            def fire() -> None:
                pending[0] -= 1
                fn(*args)
            return later(0, fire)

        monkeypatch.setattr(loop, "call_later", call_later)
        quiet = lambda: not controller.busy and pending[0] == 0  # noqa: E731
        controller.enqueue(("ml", "llama"))
        await until(lambda: len(calls) == 3 and quiet(), "two failures, a success, and nothing more queued")
        # Backoff doubles from retry_delay_seconds: 0.05 s, then 0.1 s.
        assert delays == [0.05, 0.1]
        controller.enqueue(("ml", "llama"))
        await until(lambda: len(calls) == 5 and quiet(), "a failure after the success, retried once")
        assert delays == [0.05, 0.1, 0.05]  # the success reset the backoff

    asyncio.run(_drive(controller, steps))
    assert len(calls) == 5


def test_status_writes_do_not_requeue_but_a_new_generation_does(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Key] = []
    controller = _controller(monkeypatch, lambda key: calls.append(key) or Result())

    async def steps() -> None:
        controller.observe(None, body(1))
        await until(lambda: len(calls) == 1 and not controller.busy, "the new cache reconciled")
        controller.observe("MODIFIED", {**body(1), "status": {"conditions": [{"type": "Ready"}]}})
        assert not controller.busy  # nothing queued: only observe queues, and it did not
        controller.observe("MODIFIED", body(2))
        await until(lambda: len(calls) == 2 and not controller.busy, "the new generation reconciled")

    asyncio.run(_drive(controller, steps))
    assert calls == [("ml", "llama"), ("ml", "llama")]


def test_shutdown_waits_for_the_reconciles_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    started, gate, finished = threading.Event(), threading.Event(), threading.Event()

    def reconcile(key: Key) -> Result:
        started.set()
        gate.wait(10)
        finished.set()
        return Result()

    controller = _controller(monkeypatch, reconcile)

    async def steps() -> None:
        controller.enqueue(("ml", "llama"))
        await until(started.is_set, "the reconcile started")
        drain = asyncio.create_task(controller.drain(30))
        await asyncio.sleep(0)  # drain's first look: the reconcile is still in flight
        assert not drain.done()
        gate.set()
        assert await drain  # returned True: every reconcile ended
        assert finished.is_set() and not controller.busy

    try:
        asyncio.run(_drive(controller, steps))
    finally:
        gate.set()


def test_a_cache_moved_to_another_bucket_leaves_the_old_buckets_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    controller = _controller(monkeypatch, lambda key: Result())

    def on(bucket: str) -> dict[str, Any]:
        return {**body(), "spec": {"storage": {"gcs": {"bucket": bucket, "location": "US"}}}}

    controller.observe(None, on("a"))
    assert [cl.key for cl in controller.claims("a")] == [("ml", "llama")]
    controller.observe("MODIFIED", on("b"))
    assert controller.claims("a") == [] and [cl.key for cl in controller.claims("b")] == [("ml", "llama")]
    controller.observe("DELETED", on("b"))
    assert controller.claims("b") == []


@pytest.mark.parametrize(("target", "patch", "result"), [
    ({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None, "e": 4}}, {"a": 1, "b": {"d": 3, "e": 4}}),
    ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),
    ({"a": 1}, {"b": None}, {"a": 1}),
    ({"a": {"b": 1}}, {"a": 5}, {"a": 5}),
    ({}, {"a": {"b": None}}, {"a": {}}),
])
def test_a_status_patch_is_skipped_only_when_merging_it_changes_nothing(
    target: dict[str, Any], patch: dict[str, Any], result: dict[str, Any],
) -> None:
    """controller.merged is RFC 7386's merge: the reconcile writes status only when it
    differs from what the apiserver holds."""
    assert merged(target, patch) == result
    assert (merged(target, patch) != target) is (result != target)


def test_a_reconcile_whose_status_would_not_change_writes_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """reconcile_one compares the merged patch with the stored status: the same status is
    no PATCH (and posts nothing), a changed one is one PATCH of the patch itself."""
    from cachewarm.reconcile.cache import Outcome
    from cachewarm.runtime import controller as controller_module

    kube = MemoryKube()
    stored = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True"}], "cache": {"entries": 2}}
    kube.caches[("ml", "llama")] = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                    "metadata": {"namespace": "ml", "name": "llama", "generation": 1, "uid": "u"},
                                    "spec": {}, "status": stored}
    patch: dict[str, Any] = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True"}]}
    monkeypatch.setattr(controller_module, "reconcile_cache", lambda *_, **__: Outcome(dict(patch), []))
    settings = Settings(workers=1, resync_seconds=3600, warm_poll_seconds=3600)
    controller = Controller(settings, None, kube, RecentInjections(60), Lead())  # type: ignore[arg-type]
    assert controller.reconcile_one(("ml", "llama")) == Result()
    assert kube.status_patches == [] and kube.events == []
    patch["cache"] = {"entries": 3}
    controller.reconcile_one(("ml", "llama"))
    assert kube.status_patches == [("ml", "llama", patch)]


def test_usage_goes_when_its_window_emptied_and_stays_while_a_new_leader_has_not_heard_yet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    from reportdata import GOOD

    from cachewarm.reports.store import parse

    controller = _controller(monkeypatch, lambda key: Result())
    now = dt.datetime.now(dt.timezone.utc)
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    old_usage = {"pods": 1, "hits": 2, "lastReportTime": stamp(now - dt.timedelta(hours=2))}
    recent_usage = {"pods": 3, "hits": 9, "lastReportTime": stamp(now - dt.timedelta(minutes=5))}
    for name, usage in (("stale", old_usage), ("recent", recent_usage), ("llama", None)):
        controller.store[("ml", name)] = {"metadata": {"namespace": "ml", "name": name},
                                          "status": {"usage": usage} if usage else {}}
    controller.reports.record(parse(GOOD), now)  # a pod of ml/llama reported to this leader

    async def flush() -> None:
        controller._loop = asyncio.get_running_loop()
        controller._flush_usage()
        # The writes _flush_usage handed to the reconcile threads, all done.
        await asyncio.to_thread(controller._executor.shutdown, True)
    asyncio.run(flush())
    kube: MemoryKube = controller.kube  # type: ignore[assignment]
    written = {name: status["usage"] for _, name, status in kube.status_patches}
    assert written.keys() == {"stale", "llama"}  # "recent": its pods have 55 minutes left to report again
    assert written["stale"] is None
    assert written["llama"]["hits"] == 2


def test_the_timers_usage_flush_computes_usage_off_the_loop_and_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Attacker review: a usage pass over many processes took seconds on the loop that also
    # serves admission and reports; the timer's flush computes it in a reconcile thread.
    import datetime as dt
    import threading

    from reportdata import GOOD

    from cachewarm.reports.store import parse

    controller = _controller(monkeypatch, lambda key: Result())
    now = dt.datetime.now(dt.timezone.utc)
    controller.store[("ml", "llama")] = {"metadata": {"namespace": "ml", "name": "llama"}, "status": {}}
    controller.reports.record(parse(GOOD), now)
    computed_in: list[threading.Thread] = []
    usage = controller.reports.usage

    def recording(*args: Any, **kwargs: Any) -> Any:
        computed_in.append(threading.current_thread())
        return usage(*args, **kwargs)

    monkeypatch.setattr(controller.reports, "usage", recording)

    async def flush() -> threading.Thread:
        controller._loop = asyncio.get_running_loop()
        await controller._flush_usage_computed_aside()
        await asyncio.to_thread(controller._executor.shutdown, True)
        return threading.current_thread()
    loop_thread = asyncio.run(flush())
    assert computed_in and all(t is not loop_thread for t in computed_in), computed_in
    kube: MemoryKube = controller.kube  # type: ignore[assignment]
    [(_, name, status)] = kube.status_patches
    assert name == "llama" and status["usage"]["hits"] == 2
