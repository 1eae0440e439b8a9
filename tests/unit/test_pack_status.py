"""The warmer's pack (issue 30) in the pool's status: packEntries and packBytes, or packError
said in the pool's message, so a pack that fails on every warm (pods back to one GET per
entry) is seen (platform review 7)."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.api.model import parse_spec
from cachewarm.reconcile import warmplan
from cachewarm.reconcile.warmplan import pool_status

MANIFEST = "p/.cachewarm/manifest-cpu-j.json"
GOOD = {"processIndex": 0, "entriesWritten": 2, "errors": [], "keys": ["a" * 16], "manifestGeneration": "17"}


def entry(*summaries: dict[str, Any], manifest: str | None = MANIFEST) -> dict[str, Any]:
    warmup = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                         "warmup": {"image": "i", "command": ["python", "t.py"], "pools": [{"name": "cpu"}]}}).warmup
    assert warmup is not None
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    return pool_status("j", warmup.pools[0], "h", job, list(summaries), manifest=manifest)


def test_the_pack_is_in_the_pools_status_with_its_manifest() -> None:
    out = entry({**GOOD, "packEntries": 40, "packBytes": 123456})
    assert (out["manifestGeneration"], out["packEntries"], out["packBytes"]) == ("17", 40, 123456)
    assert "message" not in out and "packError" not in out
    # Without a recorded manifest there is no pack to speak of.
    assert "packEntries" not in entry({**GOOD, "packEntries": 40, "packBytes": 1}, manifest=None)
    # Only process 0 writes one.
    assert "packEntries" not in entry({**GOOD, "processIndex": 1, "manifestGeneration": None, "packEntries": 4,
                                       "packBytes": 1}, {**GOOD})


def test_a_pack_that_could_not_be_written_is_said() -> None:
    why = "could not write the pack of gs://b/m: HTTPError: 403 \x1b[2J no storage.objects.update\n" + "x" * 400
    out = entry({**GOOD, "packError": why})
    assert out["state"] == "Succeeded" and "packEntries" not in out
    assert out["packError"] == why.replace("\x1b", "?").replace("\n", "?")[:300]
    assert out["message"] == f"No pack written (pods read each entry on its own): {out['packError']}"
    # Beside an ignored field, both are said.
    both = entry({**GOOD, "packError": "e", "packBytes": -1})
    assert both["message"] == ("Ignored invalid fields of the warmer's summary: packBytes; "
                               "No pack written (pods read each entry on its own): e")


@pytest.mark.parametrize("field,value", [
    ("packEntries", -1), ("packEntries", "4"), ("packEntries", True), ("packEntries", 1.5),
    ("packBytes", -1), ("packBytes", 1 << 62), ("packBytes", "9"),
    ("packError", 3), ("packError", "e" * 5000),
])
def test_a_bad_pack_field_is_dropped_alone_and_said(field: str, value: Any) -> None:
    out = entry({**GOOD, "packEntries": 4, "packBytes": 9, field: value})
    assert out["message"].startswith(f"Ignored invalid fields of the warmer's summary: {field}")
    assert field not in out and out["manifestGeneration"] == "17"


def test_the_pack_stays_with_the_manifest_it_belongs_to_through_a_rewarm() -> None:
    prev = {"name": "cpu", "state": "Succeeded", "manifestObject": MANIFEST, "manifestGeneration": "17",
            "packEntries": 40, "packBytes": 9}
    running: dict[str, Any] = {"name": "cpu", "state": "Running"}
    warmplan._keep_manifest(running, prev, "legacy")
    assert (running["manifestGeneration"], running["packEntries"], running["packBytes"]) == ("17", 40, 9)
    # A warm that wrote its own manifest without a pack does not keep the earlier pack.
    own: dict[str, Any] = {"name": "cpu", "state": "Succeeded", "manifestObject": "m2", "manifestGeneration": "20",
                           "packError": "e"}
    warmplan._keep_manifest(own, prev, "legacy")
    assert "packEntries" not in own and own["packError"] == "e"
