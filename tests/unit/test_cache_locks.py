"""One lock per CompilationCache: reconciles of one cache (timers and change handlers run
concurrently in kopf's threads) take turns; other caches are not held up."""

from __future__ import annotations

import threading

from cachewarm.handlers import CacheLocks


def test_one_lock_per_cache_shared_by_every_thread() -> None:
    locks = CacheLocks()
    seen: list[threading.Lock] = []
    barrier = threading.Barrier(8)

    def grab() -> None:
        barrier.wait()
        seen.append(locks.of("ml", "llama"))

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(lock) for lock in seen}) == 1
    assert locks.of("ml", "other") is not seen[0]
    assert locks.of("team-b", "llama") is not seen[0]


def test_a_held_cache_lock_blocks_only_that_cache() -> None:
    locks = CacheLocks()
    with locks.of("ml", "llama"):
        assert not locks.of("ml", "llama").acquire(blocking=False)
        other = locks.of("ml", "gemma")
        assert other.acquire(blocking=False)
        other.release()
