"""A cron `schedule` re-warms at its slot, not at the next resync: a reconcile of a scheduled
cache asks to be reconciled again at the next slot (service.Outcome.requeue_at), and the
controller queues it then (Controller.wake_at: one wake-up per cache, the earliest; none
left for a deleted cache or by a replica that lost the lead). Each pool records the slot
its warmer is for (status.warmup.pools[].scheduledTime).

The controller runs for real (its queue, workers and reconcile_one) against an in-memory
apiserver and bucket, on a fake clock: its wake-up timers are caught where the event loop
would start them, and the test fires each when it moves the clock to the timer's time. No
test sleeps; the e2e (tests/e2e/test_cron_wakeup.py) measures the same on the real operator."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cachewarm.reconcile import cache as service
from cachewarm.runtime.controller import Controller, Key, merged
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.api.model import parse_spec
from cachewarm.runtime.settings import Settings
from cachewarm.reconcile.warmup import last_slot, next_slot, rewarm_token
from memgcs import MemoryBucket, until
from memkube import MemoryKube

UTC = dt.timezone.utc
KEY: Key = ("ml", "llama")
DAILY = "0 3 * * *"
BEFORE = dt.datetime(2026, 11, 22, 2, 59, 30, tzinfo=UTC)  # 30 s before a slot
SLOT = dt.datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
DAY = dt.timedelta(days=1)
TICK = dt.timedelta(microseconds=1)


def at(day: int, hour: int, minute: int = 0, second: float = 0) -> dt.datetime:
    return dt.datetime(2026, 11, day, hour, minute, tzinfo=UTC) + dt.timedelta(seconds=second)


@pytest.mark.parametrize(("schedule", "now", "last", "following"), [
    (DAILY, BEFORE, SLOT - DAY, SLOT),
    (DAILY, SLOT - TICK, SLOT - DAY, SLOT),  # not a moment early
    (DAILY, SLOT, SLOT, SLOT + DAY),  # a slot counts from its very instant
    (DAILY, SLOT + TICK, SLOT, SLOT + DAY),
    ("* * * * *", at(22, 12, 0, 59.5), at(22, 12, 0), at(22, 12, 1)),
    ("* * * * *", at(22, 12, 1, 0.3), at(22, 12, 1), at(22, 12, 2)),
    ("*/15 * * * *", at(22, 12, 44, 59), at(22, 12, 30), at(22, 12, 45)),
    ("@hourly", at(22, 12, 0), at(22, 12, 0), at(22, 13, 0)),
    ("0 0 1 * *", at(22, 12), dt.datetime(2026, 11, 1, tzinfo=UTC), dt.datetime(2026, 12, 1, tzinfo=UTC)),
])
def test_the_slot_a_warm_is_for_and_the_next_one(schedule: str, now: dt.datetime, last: dt.datetime,
                                                  following: dt.datetime) -> None:
    assert last_slot(schedule, now) == last
    assert next_slot(schedule, now) == following
    assert last_slot(schedule, following) == following  # the wake-up's reconcile warms for the slot


def spec(schedule: str | None = DAILY) -> dict[str, Any]:
    warmup: dict[str, Any] = {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}
    if schedule:
        warmup["schedule"] = schedule
    return {"storage": {"gcs": {"bucket": "b-1", "prefix": "p", "location": "US"}}, "warmup": warmup}


def test_the_token_changes_at_the_slot_and_names_it_by_the_minute() -> None:
    """The token is part of every scheduled warmer's Job name (spec_hash): its text is kept
    as it was, so an upgraded operator makes no new Jobs for slots already warmed."""
    cache = parse_spec(spec())
    assert rewarm_token(cache, {}, SLOT - TICK) == "|2026-11-21T03:00Z"
    assert rewarm_token(cache, {}, SLOT) == "|2026-11-22T03:00Z"


def reconcile(schedule: str | None, now: dt.datetime) -> tuple[service.Outcome, MemoryKube]:
    kube = MemoryKube()
    wiring = service.Wiring(gcs=MemoryBucket(), kube=kube, warmer_image="w",  # type: ignore[arg-type]
                            injections=RecentInjections(60), claims=lambda bucket: [])
    meta = {"generation": 1, "uid": "u-1", "creationTimestamp": "2026-11-01T00:00:00Z"}
    outcome = service.reconcile_cache(wiring, service.CacheObject("ml", "llama", spec(schedule), meta, {}), now=now)
    return outcome, kube


def test_a_scheduled_caches_reconcile_asks_for_the_next_slot_and_records_the_one_it_warmed_for() -> None:
    outcome, kube = reconcile(DAILY, BEFORE)
    assert outcome.failure is None and outcome.requeue_at == SLOT
    [pool] = outcome.status["warmup"]["pools"]
    [job] = kube.created
    assert (pool["job"], pool["scheduledTime"]) == (job["metadata"]["name"], "2026-11-21T03:00:00Z")


def test_a_cache_without_a_schedule_asks_for_no_wake_up() -> None:
    outcome, _ = reconcile(None, BEFORE)
    assert outcome.failure is None and outcome.requeue_at is None
    assert "scheduledTime" not in outcome.status["warmup"]["pools"][0]


class StatusKube(MemoryKube):
    """A MemoryKube whose status patches land on the cache, as the apiserver merges them."""

    def patch_cache_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        super().patch_cache_status(namespace, name, status)
        cache = self.caches[(namespace, name)]
        cache["status"] = merged(cache.get("status") or {}, copy.deepcopy(status))


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


class Timer:
    """A timer the controller started, due at `due` on the test's clock."""

    def __init__(self, due: dt.datetime, delay: float, fire: Callable[[], None]) -> None:
        self.due, self.delay, self.fire = due, delay, fire
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True


class Timers:
    """The controller's timers and its queue's, caught where the event loop would start
    them and fired (on the loop) when the test moves the clock to them. asyncio's own are
    left alone."""

    def __init__(self, controller: Controller, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
        self.controller, self.clock, self.caught = controller, clock, list[Timer]()
        loop = asyncio.get_running_loop()
        later = loop.call_later

        def call_later(delay: float, fn: Any, *args: Any) -> Any:
            if getattr(fn, "__self__", None) not in (controller, controller.queue):
                return later(delay, fn, *args)
            timer = Timer(clock.now + dt.timedelta(seconds=delay), delay, lambda: fn(*args))
            self.caught.append(timer)
            return timer
        monkeypatch.setattr(loop, "call_later", call_later)
        self.loop = loop

    @property
    def pending(self) -> list[Timer]:
        return [t for t in self.caught if not t.is_cancelled and t.fire is not None]

    def move_to(self, when: dt.datetime) -> int:
        """Set the clock to `when` and fire the timers due by then; how many fired."""
        self.clock.now = when
        due = sorted((t for t in self.pending if t.due <= when), key=lambda t: t.due)
        for timer in due:
            fire, timer.fire = timer.fire, None  # type: ignore[assignment]
            self.loop.call_soon(fire)
        return len(due)


def cache_body(schedule: str | None = DAILY) -> dict[str, Any]:
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
            "metadata": {"namespace": "ml", "name": "llama", "generation": 1, "uid": "u-1",
                         "resourceVersion": "1", "creationTimestamp": "2026-11-01T00:00:00Z"},
            "spec": spec(schedule), "status": {}}


def complete(job: dict[str, Any], when: dt.datetime) -> None:
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    job["status"] = {"startTime": stamp, "completionTime": stamp, "succeeded": 1,
                     "conditions": [{"type": "Complete", "status": "True"}]}


Scenario = Callable[[Controller, StatusKube, Timers], Awaitable[None]]


def drive(monkeypatch: pytest.MonkeyPatch, scenario: Scenario, schedule: str | None = DAILY) -> None:
    """The controller with only the wake-ups to queue caches (resync, poll and usage an
    hour of real time away), from BEFORE on the fake clock, once it reconciled the cache."""
    clock = Clock(BEFORE)
    kube = StatusKube()
    kube.caches[KEY] = cache_body(schedule)
    settings = Settings(workers=2, resync_seconds=3600, warm_poll_seconds=3600, usage_flush_seconds=3600)

    class Lead:
        is_leader = True

    controller = Controller(settings, MemoryBucket(), kube, RecentInjections(60), Lead(),  # type: ignore[arg-type]
                            clock=clock)

    async def run() -> None:
        timers = Timers(controller, clock, monkeypatch)
        task = asyncio.create_task(controller.run())
        try:
            # A new leader reconciles every cache it listed.
            await until(lambda: len(kube.created) == 1 and controller.running and not controller.busy,
                        "the first reconcile")
            await scenario(controller, kube, timers)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    asyncio.run(run())


def pool(kube: StatusKube) -> dict[str, Any]:
    [entry] = kube.caches[KEY]["status"]["warmup"]["pools"]
    return dict(entry)


def test_the_cache_is_reconciled_at_its_slot_and_a_warmer_made_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(controller: Controller, kube: StatusKube, timers: Timers) -> None:
        first = kube.created[0]["metadata"]["name"]
        assert pool(kube)["scheduledTime"] == "2026-11-21T03:00:00Z"
        assert controller.wakeups() == {KEY: SLOT}
        [timer] = timers.pending
        assert timer.delay == 30.0  # SLOT - BEFORE on the controller's clock
        complete(kube.jobs[0], BEFORE)
        assert timers.move_to(SLOT - dt.timedelta(seconds=1)) == 0  # nothing is due before the slot
        assert timers.move_to(SLOT) == 1
        await until(lambda: len(kube.created) == 2 and not controller.busy, "the slot's reconcile")
        second = kube.created[1]["metadata"]["name"]
        assert second != first
        assert (pool(kube)["job"], pool(kube)["scheduledTime"]) == (second, "2026-11-22T03:00:00Z")
        assert controller.wakeups() == {KEY: SLOT + DAY}  # and on to the next slot
        assert [t.delay for t in timers.pending] == [86400.0]

    drive(monkeypatch, scenario)


def test_a_wake_up_before_the_slot_by_the_clock_asks_again_for_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's timer counts on a monotonic clock, the slot on the wall clock: a timer
    that fires a little early warms nothing yet and waits out the rest."""
    async def scenario(controller: Controller, kube: StatusKube, timers: Timers) -> None:
        complete(kube.jobs[0], BEFORE)
        [timer] = timers.pending
        fire, timer.fire = timer.fire, None  # type: ignore[assignment]
        timers.clock.now = SLOT - dt.timedelta(seconds=0.25)
        fire()
        await until(lambda: len(timers.caught) == 2 and not controller.busy, "the early reconcile's wake-up")
        assert len(kube.created) == 1 and controller.wakeups() == {KEY: SLOT}
        assert timers.pending[0].delay == 0.25
        timers.move_to(SLOT)
        await until(lambda: len(kube.created) == 2 and not controller.busy, "the slot's reconcile")

    drive(monkeypatch, scenario)


def test_one_wake_up_per_cache_the_earliest(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(controller: Controller, kube: StatusKube, timers: Timers) -> None:
        [daily] = timers.pending
        controller.wake_at(KEY, SLOT + dt.timedelta(hours=1))  # later: the pending one stays
        assert controller.wakeups() == {KEY: SLOT} and timers.pending == [daily]
        controller.wake_at(KEY, SLOT - dt.timedelta(seconds=10))  # earlier: replaces it
        assert controller.wakeups() == {KEY: SLOT - dt.timedelta(seconds=10)}
        assert daily.is_cancelled and [t.delay for t in timers.pending] == [20.0]
        controller.wake_at(("ml", "unknown"), SLOT)  # no such cache: nothing to wake
        assert set(controller.wakeups()) == {KEY}

    drive(monkeypatch, scenario)


def test_a_deleted_cache_leaves_no_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(controller: Controller, kube: StatusKube, timers: Timers) -> None:
        [timer] = timers.pending
        body = kube.caches.pop(KEY)
        controller.observe("DELETED", body)
        assert timer.is_cancelled and controller.wakeups() == {}
        # A reconcile that ends after the delete asks for none either.
        controller.wake_at(KEY, SLOT)
        assert controller.wakeups() == {} and timers.pending == []

    drive(monkeypatch, scenario)


def test_a_replica_that_lost_the_lead_keeps_no_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(controller: Controller, kube: StatusKube, timers: Timers) -> None:
        [timer] = timers.pending
        controller.leader.is_leader = False  # type: ignore[misc]
        controller.leadership_changed(False)  # from the election's thread, in the operator
        await asyncio.sleep(0)  # the loop runs the callback it queued (call_soon: first in, first run)
        assert timer.is_cancelled and controller.wakeups() == {}
        controller.wake_at(KEY, SLOT)  # a follower asks for none
        assert controller.wakeups() == {} and timers.pending == []
        # Leading again: the new leader's reconcile asks for the slot again.
        controller.leader.is_leader = True  # type: ignore[misc]
        controller.leadership_changed(True)
        await until(lambda: controller.wakeups() == {KEY: SLOT} and not controller.busy, "the new leader's wake-up")

    drive(monkeypatch, scenario)
