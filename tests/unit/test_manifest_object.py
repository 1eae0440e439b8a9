"""status.warmup.pools[].manifestObject: what the CRD accepts and what the operator reads
back from status (reconcile/warmplan.MANIFEST_OBJECT) agree, and every name a warmer Job
writes its manifest at is one."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from cachewarm.api.model import GcsStorage
from cachewarm.builders import placement
from cachewarm.reconcile.warmplan import MANIFEST_OBJECT
from cachewarm.reconcile.warmup import recorded_manifests

CRD = Path(__file__).resolve().parents[2] / "crds" / "cachewarm.dev_compilationcaches.yaml"


@functools.cache
def schema() -> dict[str, object]:
    crd = yaml.safe_load(CRD.read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    field: dict[str, object] = status["properties"]["warmup"]["properties"]["pools"]["items"]["properties"][
        "manifestObject"]
    return field


def crd_accepts(value: str) -> bool:
    field = schema()
    # The pattern is RE2, where `$` is the end of the text; in Python's re that is `\Z`
    # (`$` also matches before a final newline).
    pattern = str(field["pattern"]).removesuffix("$") + r"\Z"
    return len(value) <= int(str(field["maxLength"])) and re.search(pattern, value) is not None


@pytest.mark.parametrize(("value", "ok"), [
    ("jax/.cachewarm/pools/ml/llama/cpu/llama-cpu-0123456789.json", True),
    (".cachewarm/pools/ml/llama/cpu.json", True),
    ("a.json#17", False),  # would make another generation in CACHEWARM_COPY_MANIFESTS
    ("a.json,b.json", False),  # would make another item
    ("x.json#9/a.json", False),
    ("x.json,y/a.json", False),
    ("a\n.json", False),
    ("a.json\n", False),
    ("a.jsonx", False),
    (".json", False),
    ("", False),
    ("a" * 1019 + ".json", True),
    ("a" * 1020 + ".json", False),  # over 1024: not a GCS object name
])
def test_the_crd_and_the_operator_take_the_same_manifest_objects(value: str, ok: bool) -> None:
    assert crd_accepts(value) is ok
    assert (MANIFEST_OBJECT.fullmatch(value) is not None) is ok
    got = recorded_manifests([{"name": "cpu", "manifestObject": value, "manifestGeneration": "7"}])
    assert got == ({"cpu": f"{value}#7"} if ok else {})


@settings(max_examples=200, deadline=None)
@given(prefix=st.sampled_from(["", "jax", "a/b"]), pool=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?", fullmatch=True),
       job=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True))
def test_every_manifest_a_warmer_job_writes_can_be_recorded(prefix: str, pool: str, job: str) -> None:
    gcs = GcsStorage.model_validate({"bucket": "b-1", "location": "US", "prefix": prefix})
    obj = placement.manifest_object(gcs, "ml", "llama", pool, job)
    assert crd_accepts(obj) and MANIFEST_OBJECT.fullmatch(obj) is not None
    assert placement.is_pool_manifest(obj, gcs, "ml", "llama", pool)
