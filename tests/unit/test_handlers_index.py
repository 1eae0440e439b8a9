"""What runtime/handlers.py hands the webhook and the controller from the watches: the
index entry carries only what status says the operator verified (each pool's manifest
generation, the ConfigMaps it checked), and a change of one of our ConfigMaps queues its
cache for a reconcile. The e2e tests (test_configmap_trust.py, test_warmup.py) drive both
through a real apiserver and kopf."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cachewarm.runtime import handlers

SPEC = {"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
        "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}}


def entry(status: dict[str, Any]) -> dict[str, Any]:
    index = handlers.index_caches("ml", "llama", SPEC, {"generation": 2}, status, "u-1")  # type: ignore[arg-type]
    found: dict[str, Any] = index[("ml", "llama")]
    return found


def test_the_index_entry_takes_manifest_generations_and_verified_configmaps_from_status() -> None:
    status = {"warmup": {"pools": [{"name": "a", "manifestGeneration": "17"}, {"name": "b"},
                                   {"name": "c", "manifestGeneration": "17; rm -rf"}]},
              "injection": {"configMaps": {"env": "cachewarm-llama-env-0123456789",
                                           "boot": "cachewarm-llama-boot-9876543210"}}}
    got = entry(status)
    assert got["manifests"] == {"a": "17"}  # b: none reported; c: not a generation
    assert (got["env_configmap"], got["boot_configmap"]) == ("cachewarm-llama-env-0123456789",
                                                             "cachewarm-llama-boot-9876543210")


@pytest.mark.parametrize("status", [{}, {"injection": {"configMaps": {"env": "", "boot": None}}},
                                    {"injection": {"configMaps": {"env": 7}}}])
def test_no_verified_configmap_is_none_in_the_index(status: dict[str, Any]) -> None:
    got = entry(status)
    assert (got["env_configmap"], got["boot_configmap"], got["manifests"]) == (None, None, {})


class Controller:
    def __init__(self, caches: set[tuple[str, str]]) -> None:
        self.caches = caches
        self.queued: list[tuple[str, str]] = []

    def has_cache(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self.caches

    def enqueue(self, key: tuple[str, str]) -> None:
        self.queued.append(key)


def configmap(owner: str | None, label: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "cachewarm-llama-boot-0123456789", "namespace": "ml",
                            "labels": {"app.kubernetes.io/managed-by": "cachewarm"}}
    if owner is not None:
        meta["ownerReferences"] = [{"kind": "CompilationCache", "name": owner, "uid": "u", "controller": True}]
    if label is not None:
        meta["labels"]["cachewarm.dev/env-for"] = label
    return {"metadata": meta}


@pytest.mark.parametrize(("body", "queued"), [
    (configmap("llama"), [("ml", "llama")]),
    (configmap(None, label="llama"), [("ml", "llama")]),  # its owner reference removed: the label names it
    (configmap("gone"), []),  # no such cache: nothing to reconcile
    (configmap(None), []),
])
def test_a_change_of_our_configmap_queues_its_cache(body: dict[str, Any], queued: list[tuple[str, str]]) -> None:
    controller = Controller({("ml", "llama")})
    for event in ("ADDED", "MODIFIED", "DELETED"):
        asyncio.run(handlers.on_configmap_event(body, SimpleNamespace(controller=controller),  # type: ignore[arg-type]
                                                type=event))
    assert controller.queued == queued * 3
