"""An in-memory stand-in for the one GCS bucket the unit tests' caches use (b-1), for tests
of the reconcile's decisions (the integration and e2e tests run the real emulator): a
configured bucket whose PATCHes of labels and lifecycle rules are kept, holding entries with
the given key hashes under prefix p, counting its listings. Also `until`, the event-loop wait
the controller's tests share."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cachewarm.api.bucket import BucketInfo
from cachewarm.builders.bucket import grant_label
from cachewarm.clients.gcs import ObjectInfo


class MemoryBucket:
    def __init__(self, keys: Iterable[str] = (), custom_time: dt.datetime | None = None) -> None:
        self.keys = list(keys)
        self.custom_time = custom_time
        self.listings = 0
        self.bucket = BucketInfo(name="b-1", location="US", storage_class="STANDARD",
                                 labels=dict([grant_label("ml", "")]),  # its owner granted it to namespace ml
                                 soft_delete_seconds=7 * 86400, metageneration=1)

    def get_bucket(self, name: str) -> BucketInfo:
        return self.bucket

    def patch_bucket(self, current: BucketInfo, patch: dict[str, Any]) -> BucketInfo:
        labels = {**self.bucket.labels, **{k: v for k, v in (patch.get("labels") or {}).items() if v is not None}}
        rules = patch["lifecycle"]["rule"] if "lifecycle" in patch else self.bucket.lifecycle_rules
        self.bucket = BucketInfo(name="b-1", location="US", storage_class="STANDARD", labels=labels,
                                 lifecycle_rules=rules, soft_delete_seconds=self.bucket.soft_delete_seconds,
                                 metageneration=self.bucket.metageneration + 1)
        return self.bucket

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Iterator[ObjectInfo]:
        self.listings += 1
        for key in self.keys:
            yield ObjectInfo(f"p/jit_f-{key}{'0' * 48}-cache", 10, custom_time=self.custom_time)


async def until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait for `check` to hold, looking again at each turn of the event loop. The
    deadline only guards against a hang: the test waits for the state, not the clock."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.001)
