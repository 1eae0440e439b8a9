"""What runtime/handlers.py hands the webhook and the controller from the watches: the
index entry carries only what status says the operator verified (each pool's manifest
generation, the ConfigMaps it checked). ConfigMaps are not watched (a flood of labelled ones
would be listed at start): the operator checks its own at every reconcile. The e2e tests
(test_configmap_trust.py, test_warmup.py) drive this through a real apiserver and kopf."""

from __future__ import annotations

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
    obj = "llama/.cachewarm/pools/ml/llama/a/llama-a-1.json"
    status = {"warmup": {"pools": [{"name": "a", "manifestGeneration": "17", "manifestObject": obj}, {"name": "b"},
                                   {"name": "c", "manifestGeneration": "17; rm -rf", "manifestObject": obj},
                                   {"name": "d", "manifestGeneration": "17"},  # no object: not trusted
                                   {"name": "e", "manifestGeneration": "17", "manifestObject": "x.json#1,y.json"}]},
              "injection": {"configMaps": {"env": "cachewarm-llama-env-0123456789",
                                           "boot": "cachewarm-llama-boot-9876543210"}}}
    got = entry(status)
    assert got["manifests"] == {"a": f"{obj}#17"}  # b: none reported; c: not a generation; e: separators
    assert (got["env_configmap"], got["boot_configmap"]) == ("cachewarm-llama-env-0123456789",
                                                             "cachewarm-llama-boot-9876543210")


@pytest.mark.parametrize("status", [{}, {"injection": {"configMaps": {"env": "", "boot": None}}},
                                    {"injection": {"configMaps": {"env": 7}}}])
def test_no_verified_configmap_is_none_in_the_index(status: dict[str, Any]) -> None:
    got = entry(status)
    assert (got["env_configmap"], got["boot_configmap"], got["manifests"]) == (None, None, {})

