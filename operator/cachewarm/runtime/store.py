"""The controller's watch store: the latest body the watch delivered of each
CompilationCache, and per bucket the caches that claim it (a reconcile plans a bucket's
lifecycle rules for all the caches on it, so it must know them all)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from cachewarm.builders.bucket import Claim

Key = tuple[str, str]  # (namespace, name)


class CacheStore:
    def __init__(self) -> None:
        self.bodies: dict[Key, dict[str, Any]] = {}  # the latest body seen per cache
        self._claims: dict[str, dict[Key, Claim]] = {}  # bucket -> the caches on it
        self._bucket_of: dict[Key, str] = {}  # cache -> its bucket in _claims

    def put(self, key: Key, body: Mapping[str, Any], claim: Claim | None) -> dict[str, Any] | None:
        """Keep a copy of `body` as the cache's latest, and `claim` as its claim on the
        bucket its spec names (None: the spec cannot be read, and claims nothing). Returns
        the body it replaced (None: the cache is new to the store)."""
        old = self.bodies.get(key)
        self._forget_claim(key)
        new = copy.deepcopy(dict(body))
        self.bodies[key] = new
        if claim is not None:
            spec = new.get("spec") or {}
            bucket = str(((spec.get("storage") or {}).get("gcs") or {}).get("bucket") or "")
            self._claims.setdefault(bucket, {})[key] = claim
            self._bucket_of[key] = bucket
        return old

    def remove(self, key: Key) -> None:
        """Forget a deleted cache and its claim."""
        self._forget_claim(key)
        self.bodies.pop(key, None)

    def claims(self, bucket: str) -> list[Claim]:
        """The claims of the caches on `bucket`."""
        return list(self._claims.get(bucket, {}).values())

    def _forget_claim(self, key: Key) -> None:
        bucket = self._bucket_of.pop(key, None)
        if bucket is not None:
            self._claims.get(bucket, {}).pop(key, None)
