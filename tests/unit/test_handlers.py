"""The reconcile handler reads the whole object from one version of it, although kopf's
body moves to newer versions while a sync handler runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest

from cachewarm import handlers, service
from cachewarm.handlers import CacheLocks


def test_one_reconcile_reads_spec_meta_and_status_of_one_version(monkeypatch: pytest.MonkeyPatch) -> None:
    raw: dict[str, Any] = {"metadata": {"name": "llama", "namespace": "ml", "generation": 1},
                           "spec": {"version": 1}, "status": {"observedGeneration": 0}}
    body = kopf.Body(cast(kopf.RawBody, raw))
    seen: list[tuple[Any, ...]] = []

    def reconcile_cache(*, spec: Any, meta: Any, status: Any, **_: Any) -> service.Outcome:
        generation = meta.get("generation")
        # The event loop takes in version 2 while the reconcile runs.
        raw.update({"metadata": {"name": "llama", "namespace": "ml", "generation": 2}, "spec": {"version": 2},
                    "status": {"observedGeneration": 1}})
        seen.append((generation, spec.get("version"), status.get("observedGeneration"), meta.get("generation")))
        return service.Outcome(status={})

    monkeypatch.setattr(service, "reconcile_cache", reconcile_cache)
    memo = SimpleNamespace(locks=CacheLocks(), gcs=None, injections=None)
    patch = kopf.Patch()
    handlers.reconcile(body, patch, namespace="ml", name="llama", memo=memo, claims=None, warmer_image="w")
    assert seen == [(1, 1, 0, 1)]
