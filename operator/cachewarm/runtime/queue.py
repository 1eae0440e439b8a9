"""A generic work queue of keys, drained by a few asyncio workers (client-go's workqueue, as
cert-manager's controllers share one); what is worth enqueueing is the caller's business.

Its rules, which keep processing safe whatever the keys stand for:

- a key is in the queue at most once, and never processed by two workers at once: a key
  added while it is being processed is processed again right after it ("dirty");
- a processing that asks for a retry is added again after a backoff that doubles per key
  (`backoff`); one that succeeds resets the key's backoff;
- a delayed add (`add_at`) keeps one wake-up per key, the earliest asked for, until it fires
  or is cancelled;
- while `active()` is false, adds are dropped and keys taken from the queue are dropped
  unprocessed (the controller's gate: a replica that does not lead processes nothing);
- at shutdown, `drain` waits for the keys being processed to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)
MAX_BACKOFF = 600.0
log = logging.getLogger("cachewarm.queue")


def backoff(retry_delay_seconds: float, retry: int) -> float:
    """Delay before retry number `retry`: doubles from retry_delay_seconds up to 10 minutes."""
    return float(min(retry_delay_seconds * (2 ** min(retry, 16)), MAX_BACKOFF))


class Outcome(Protocol):
    """How processing a key ended: `retry` asks for another go after the key's backoff,
    `again` for one at once (what it acted on changed under it)."""

    @property
    def retry(self) -> bool: ...

    @property
    def again(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class _Raised:
    """What a processing that raised counts as: a retry."""

    retry: bool = True
    again: bool = False


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class WorkQueue(Generic[K]):
    def __init__(self, process: Callable[[K], Awaitable[Outcome]], *, workers: int, retry_delay_seconds: float,
                 active: Callable[[], bool] = lambda: True, clock: Callable[[], dt.datetime] = _utcnow,
                 name: str = "queue") -> None:
        """`process`: what a worker does with a key (an exception counts as a retry).
        `clock`: the time `add_at` counts its delays from (tests drive it). `name`: of the
        worker tasks."""
        self._process = process
        self._workers = workers
        self._retry_delay_seconds = retry_delay_seconds
        self._active = active
        self._clock = clock
        self._name = name
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._retries: dict[K, int] = {}
        # The earliest delayed add asked for, per key: (when, its loop timer).
        self._delayed: dict[K, tuple[dt.datetime, asyncio.TimerHandle]] = {}
        self._queue: asyncio.Queue[K] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> list[asyncio.Task[None]]:
        """Take keys from now on (on the running loop) and start the workers; their tasks,
        which run until `stop`."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._worker(), name=f"{self._name}-worker-{i}")
                       for i in range(self._workers)]
        return list(self._tasks)

    def stop(self) -> None:
        """Cancel the workers and the delayed adds."""
        for task in self._tasks:
            task.cancel()
        for key in list(self._delayed):
            self.cancel_delayed(key)

    def add(self, key: K) -> None:
        if self._queue is None or not self._active():
            return  # not started yet, or gated: the caller adds its keys again when it may
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    @property
    def running(self) -> bool:
        """Whether the queue takes keys (`start` was called)."""
        return self._queue is not None

    @property
    def queued(self) -> frozenset[K]:
        """The keys waiting in the queue for a worker."""
        return frozenset(self._queued)

    @property
    def busy(self) -> bool:
        """Whether a key is queued, being processed or due again right after (retries and
        delayed adds are not counted: they add it later)."""
        return bool(self._queued or self._processing or self._dirty)

    def forget(self, key: K) -> None:
        """Drop the key's backoff (what it stood for is gone)."""
        self._retries.pop(key, None)

    async def drain(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) for the keys being processed to end. Returns
        whether they all ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._processing and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._processing

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if not self._active():
                continue
            self._processing.add(key)
            try:
                outcome = await self._process(key)
            except Exception:  # noqa: BLE001 - a bug in one key's processing must not stop the worker
                log.exception("Processing of %s failed", key)
                outcome = _Raised()
            finally:
                self._processing.discard(key)
            self._after(key, outcome)

    def _after(self, key: K, outcome: Outcome) -> None:
        assert self._loop is not None
        if key in self._dirty or outcome.again:
            self._dirty.discard(key)
            self.add(key)
        elif outcome.retry:
            retry = self._retries.get(key, 0)
            self._retries[key] = retry + 1
            self._loop.call_later(backoff(self._retry_delay_seconds, retry), self.add, key)
        else:
            self._retries.pop(key, None)

    # --- delayed adds ---

    def add_at(self, key: K, when: dt.datetime) -> None:
        """Add the key at `when` (by the queue's clock). One delayed add per key, the
        earliest asked for: a later one is dropped. None while the queue is not started or
        is gated."""
        if self._loop is None or not self._active():
            return
        pending = self._delayed.get(key)
        if pending is not None:
            if pending[0] <= when:
                return
            pending[1].cancel()
        delay = max(0.0, (when - self._clock()).total_seconds())
        self._delayed[key] = (when, self._loop.call_later(delay, self._fire, key))

    def _fire(self, key: K) -> None:
        self._delayed.pop(key, None)
        self.add(key)

    def cancel_delayed(self, key: K) -> None:
        pending = self._delayed.pop(key, None)
        if pending is not None:
            pending[1].cancel()

    def delayed(self) -> dict[K, dt.datetime]:
        """The pending delayed adds: when each key is added."""
        return {key: when for key, (when, _) in self._delayed.items()}
