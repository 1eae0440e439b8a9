"""The operator says in status what a cache's spec makes of its pods: PodsReadOnly True for
the default ReadOnly, False (ReadWriteChosen, with how to switch) for ReadWrite, flipping
when the user switches; LocalCopyAsSpecified for the copy's shape."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually

pytestmark = pytest.mark.e2e


def cache(name: str, injection: dict[str, Any]) -> dict[str, Any]:
    bucket = f"mode-{uuid.uuid4().hex[:10]}"
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
                     "injection": injection}}


def condition(bed: Testbed, namespace: str, name: str, type_: str, generation: int) -> dict[str, Any] | None:
    """The condition `type_` once the operator reconciled `generation` of the cache."""
    obj = bed.get_json("ccache", name, namespace) or {}
    status = obj.get("status") or {}
    if status.get("observedGeneration") != generation:
        return None
    found: dict[str, Any] | None = next((c for c in status.get("conditions") or [] if c["type"] == type_), None)
    return found


def test_pods_read_only_follows_the_mode(operator: OperatorHandle, installed: Testbed, namespace: str) -> None:
    bed = installed
    bed.apply(cache("reader", {}), namespace)
    bed.apply(cache("writer", {"mode": "ReadWrite"}), namespace)
    reader = eventually(lambda: condition(bed, namespace, "reader", "PodsReadOnly", 1), timeout=60,
                        what="PodsReadOnly of reader")
    assert (reader["status"], reader["reason"]) == ("True", "ReadOnly")
    writer = eventually(lambda: condition(bed, namespace, "writer", "PodsReadOnly", 1), timeout=60,
                        what="PodsReadOnly of writer")
    assert (writer["status"], writer["reason"]) == ("False", "ReadWriteChosen")
    assert "cachewarm.dev/cache=writer can write entries" in writer["message"]
    assert "kubectl patch compilationcache writer --type=merge" in writer["message"]
    copy = condition(bed, namespace, "writer", "LocalCopyAsSpecified", 1)
    assert copy is not None and (copy["status"], copy["reason"]) == ("True", "NoLocalCopy")
    # A ReadWrite cache is not unready: it is a choice, said, not a fault.
    eventually(lambda: (condition(bed, namespace, "writer", "Ready", 1) or {}).get("status") == "True", timeout=60,
               what="writer Ready")

    # The switch the message names.
    switched = bed.kubectl_run("patch", "compilationcache", "writer", "-n", namespace, "--type=merge",
                               "-p", json.dumps({"spec": {"injection": {"mode": "ReadOnly", "localCopy": {}}}}))
    assert switched.returncode == 0, switched.stderr
    now = eventually(lambda: condition(bed, namespace, "writer", "PodsReadOnly", 2), timeout=60,
                     what="PodsReadOnly of writer after the switch")
    assert (now["status"], now["reason"]) == ("True", "ReadOnly")
    copy = condition(bed, namespace, "writer", "LocalCopyAsSpecified", 2)
    assert copy is not None and (copy["status"], copy["reason"]) == ("True", "PerPodCopy")
