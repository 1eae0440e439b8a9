"""The work queue on its own (runtime/queue.py), with string keys and a process function of
the test's: a key queued once however often it is added, never processed twice at once, a
key added while processed processed again after, backoff that doubles and resets, one
delayed add per key (the earliest), gated adds, drain.

Nothing here is timed: a process blocks on an event the test sets, the test waits for the
state it means (memgcs.until, whose deadline only guards against a hang), and the queue's
timers are caught where the event loop would start them and fired by the test."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cachewarm.runtime.queue import WorkQueue
from memgcs import until

T0 = dt.datetime(2026, 11, 22, 3, 0, tzinfo=dt.timezone.utc)


@dataclasses.dataclass
class Done:
    retry: bool = False
    again: bool = False


class Worker:
    """The queue's process function: records each key, counts how many of a key run at
    once, blocks while `gate` is shut, and ends with the next of `outcomes` (Done() once
    they run out)."""

    def __init__(self, outcomes: list[Done | Exception] | None = None, shut: bool = False) -> None:
        self.calls: list[str] = []
        self.running: dict[str, int] = {}
        self.overlap: list[str] = []
        self.outcomes = list(outcomes or [])
        self.gate = asyncio.Event()
        if not shut:
            self.gate.set()

    async def __call__(self, key: str) -> Done:
        self.calls.append(key)
        self.running[key] = self.running.get(key, 0) + 1
        if self.running[key] > 1:
            self.overlap.append(key)
        try:
            await self.gate.wait()
        finally:
            self.running[key] -= 1
        outcome = self.outcomes.pop(0) if self.outcomes else Done()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class Timer:
    def __init__(self, delay: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.delay, self.fn, self.args = delay, fn, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """The queue's call_later timers, caught (asyncio's own are left alone); `fire` runs
    one as the loop would."""

    def __init__(self, queue: WorkQueue[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.caught: list[Timer] = []
        later = asyncio.get_running_loop().call_later

        def call_later(delay: float, fn: Any, *args: Any) -> Any:
            if getattr(fn, "__self__", None) is not queue:
                return later(delay, fn, *args)
            timer = Timer(delay, fn, args)
            self.caught.append(timer)
            return timer
        monkeypatch.setattr(asyncio.get_running_loop(), "call_later", call_later)

    @property
    def pending(self) -> list[Timer]:
        return [t for t in self.caught if not t.cancelled]

    def fire(self, timer: Timer) -> None:
        assert not timer.cancelled
        self.caught.remove(timer)
        timer.fn(*timer.args)


def run(worker: Worker, steps: Callable[[WorkQueue[str], Timers], Awaitable[None]],
        monkeypatch: pytest.MonkeyPatch, *, workers: int = 2, active: Callable[[], bool] = lambda: True) -> None:
    """Start a queue of `workers` over `worker`, run `steps` on it, stop it."""
    async def main() -> None:
        queue = WorkQueue(worker, workers=workers, retry_delay_seconds=1.0, active=active, clock=lambda: T0)
        timers = Timers(queue, monkeypatch)
        tasks = queue.start()
        try:
            await steps(queue, timers)
        finally:
            worker.gate.set()
            queue.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())


def test_a_key_added_while_it_waits_in_the_queue_is_queued_and_processed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(shut=True)

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("x")  # the only worker takes it and blocks
        await until(lambda: worker.calls == ["x"], "x being processed")
        for _ in range(3):
            queue.add("a")
        assert queue.queued == frozenset({"a"})
        worker.gate.set()
        await until(lambda: not queue.busy, "the queue idle")

    run(worker, steps, monkeypatch, workers=1)
    assert worker.calls == ["x", "a"]


def test_a_key_added_while_processed_waits_for_it_and_is_processed_once_more_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(shut=True)

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("a")
        await until(lambda: worker.calls == ["a"], "a being processed")
        for _ in range(3):
            queue.add("a")
        # Not in the queue, where the idle second worker would take it at once.
        assert queue.queued == frozenset() and queue.busy
        worker.gate.set()
        await until(lambda: not queue.busy, "the queue idle")

    run(worker, steps, monkeypatch, workers=2)
    assert worker.calls == ["a", "a"] and worker.overlap == []


def test_again_processes_the_key_once_more_at_once_without_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker([Done(again=True)])

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("a")
        await until(lambda: len(worker.calls) == 2 and not queue.busy, "a processed twice")
        assert timers.caught == []

    run(worker, steps, monkeypatch)
    assert worker.calls == ["a", "a"]


def test_a_retry_waits_a_backoff_that_doubles_per_key_and_a_success_resets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker([Done(retry=True), RuntimeError("a bug counts as a retry"), Done(), Done(retry=True)])

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("a")
        delays = []
        for calls in (1, 2):
            await until(lambda: len(timers.pending) == 1 and not queue.busy, "a retry asked for")
            [timer] = timers.pending
            delays.append(timer.delay)
            assert worker.calls == ["a"] * calls  # nothing before the timer fires
            timers.fire(timer)
        await until(lambda: len(worker.calls) == 3 and not queue.busy, "the success")
        assert delays == [1.0, 2.0] and timers.pending == []
        queue.add("a")  # fails again: back to the first delay
        await until(lambda: len(timers.pending) == 1 and not queue.busy, "the retry after the success")
        assert timers.pending[0].delay == 1.0

    run(worker, steps, monkeypatch)


def test_forget_resets_a_keys_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker([Done(retry=True), Done(retry=True)])

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("a")
        await until(lambda: len(timers.pending) == 1 and not queue.busy, "the first retry asked for")
        timers.caught.clear()  # its timer dropped: the test adds the key itself
        queue.forget("a")
        queue.add("a")
        await until(lambda: len(timers.pending) == 1 and not queue.busy, "the second retry asked for")
        assert timers.pending[0].delay == 1.0

    run(worker, steps, monkeypatch)


def test_a_delayed_add_keeps_the_earliest_asked_for_until_it_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker()
    minute = dt.timedelta(minutes=1)

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add_at("a", T0 + minute)
        [first] = timers.pending
        assert first.delay == 60.0 and queue.delayed() == {"a": T0 + minute}
        queue.add_at("a", T0 + 2 * minute)  # later: the pending one stays
        assert timers.pending == [first] and queue.delayed() == {"a": T0 + minute}
        queue.add_at("a", T0 + minute / 2)  # earlier: replaces it
        assert first.cancelled and queue.delayed() == {"a": T0 + minute / 2}
        [second] = timers.pending
        assert second.delay == 30.0
        queue.add_at("b", T0 - minute)  # already due: at once
        assert timers.pending[-1].delay == 0.0
        assert worker.calls == []
        timers.fire(second)
        assert queue.delayed() == {"b": T0 - minute}
        await until(lambda: worker.calls == ["a"] and not queue.busy, "a processed at its time")

    run(worker, steps, monkeypatch)


def test_a_cancelled_delayed_add_adds_nothing_and_stop_cancels_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker()

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add_at("a", T0 + dt.timedelta(minutes=1))
        queue.add_at("b", T0 + dt.timedelta(minutes=1))
        [a, b] = timers.pending
        queue.cancel_delayed("a")
        assert a.cancelled and queue.delayed() == {"b": T0 + dt.timedelta(minutes=1)}
        queue.add_at("a", T0 + dt.timedelta(hours=1))  # a new one may be asked for after
        assert queue.delayed()["a"] == T0 + dt.timedelta(hours=1)
        queue.stop()
        assert queue.delayed() == {} and timers.pending == [] and b.cancelled

    run(worker, steps, monkeypatch)
    assert worker.calls == []


def test_while_inactive_adds_are_dropped_and_queued_keys_not_processed(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(shut=True)
    active = [True]

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("x")  # the only worker takes it and blocks
        await until(lambda: worker.calls == ["x"], "x being processed")
        queue.add("a")  # queued while active
        active[0] = False
        queue.add("b")
        queue.add_at("c", T0)
        assert queue.queued == frozenset({"a"}) and queue.delayed() == {} and timers.caught == []
        worker.gate.set()
        await until(lambda: not queue.busy, "the queue idle")

    run(worker, steps, monkeypatch, workers=1, active=lambda: active[0])
    assert worker.calls == ["x"]


def test_drain_waits_for_the_keys_being_processed(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(shut=True)

    async def steps(queue: WorkQueue[str], timers: Timers) -> None:
        queue.add("a")
        await until(lambda: worker.calls == ["a"], "a being processed")
        assert await queue.drain(0) is False  # no time left: still processing
        drain = asyncio.create_task(queue.drain(30))
        await asyncio.sleep(0)  # drain's first look: a is still being processed
        assert not drain.done()
        worker.gate.set()
        assert await drain is True
        assert worker.running == {"a": 0} and not queue.busy

    run(worker, steps, monkeypatch)


def test_nothing_is_taken_before_start() -> None:
    worker = Worker()
    queue = WorkQueue(worker, workers=1, retry_delay_seconds=1.0)
    queue.add("a")
    queue.add_at("a", T0)
    assert not queue.running and not queue.busy and queue.delayed() == {}
