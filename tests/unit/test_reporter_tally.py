"""The reporter's bookkeeping in a training process: the entries it hit, from JAX's own
log records, bounded; and a report that always fits under the operator's size cap."""

from __future__ import annotations

import json
import logging

from cachewarm.agents import reporter
from cachewarm.reports.store import MAX_BODY_BYTES, parse


def hit_record(program: str, key: str) -> logging.LogRecord:
    return logging.LogRecord("jax._src.compiler", logging.DEBUG, __file__, 1,
                             "Persistent compilation cache hit for '%s' with key %r", (program, key), None)


def test_hits_are_kept_by_key_the_latest_last_and_at_most_max_hit_keys() -> None:
    tally = reporter.Tally()
    for i in range(reporter.MAX_HIT_KEYS + 5):
        tally.filter(hit_record(f"jit_p{i}", f"jit_p{i}-{i:064x}"))
    tally.filter(hit_record("jit_p6", f"jit_p6-{6:064x}"))  # hit again: now the latest
    keys = tally.snapshot()["hitKeys"]
    assert len(keys) == reporter.MAX_HIT_KEYS
    assert keys[-1] == {"program": "jit_p6", "key": f"jit_p6-{6:064x}"}
    assert {"program": "jit_p0", "key": f"jit_p0-{0:064x}"} not in keys  # the oldest went


def test_a_report_with_long_names_is_cut_to_fit_the_operators_cap_and_still_parses() -> None:
    long = "jit_" + "x" * 190
    counts = {"requests": 40, "hits": 20, "misses": 20, "compileSecondsSaved": 1.0, "compileSecondsSpent": 2.0,
              "compiles": 20,
              "lastMisses": [{"program": long, "key": f"{long[:100]}-{i:099x}"} for i in range(reporter.MAX_MISSES)],
              "hitKeys": [{"program": long, "key": f"{long[:100]}-{i:099x}"} for i in range(reporter.MAX_HIT_KEYS)]}
    report = {"version": 1, "pod": {"namespace": "ml", "name": "t", "uid": "u"}, "cache": "llama",
              "process": {"pid": 1, "started": 1, "index": 0}, "sequence": 1, "final": False, "counts": counts,
              "fingerprint": {"jax": "0.10.2"}}
    assert len(json.dumps(report, separators=(",", ":"))) > MAX_BODY_BYTES  # as built, it would be refused
    body = reporter._fit(report, json.dumps)
    assert len(body) <= reporter.MAX_BODY_BYTES < MAX_BODY_BYTES
    taken = parse(body)
    assert taken.counts.hits == 20 and len(taken.counts.last_misses) == reporter.MAX_MISSES
    assert 0 < len(taken.counts.hit_keys) < reporter.MAX_HIT_KEYS
    assert taken.counts.hit_keys[-1].key.endswith(f"{reporter.MAX_HIT_KEYS - 1:099x}")  # the newest are kept


def test_a_long_program_name_gives_way_in_a_key_but_its_hash_stays() -> None:
    tally = reporter.Tally()
    key = "jit_" + "y" * 300 + "-" + "d" * 64
    tally.filter(hit_record("jit_" + "y" * 300, key))
    [hit] = tally.snapshot()["hitKeys"]
    assert len(hit["key"]) == 200 and hit["key"].endswith("-" + "d" * 64)
