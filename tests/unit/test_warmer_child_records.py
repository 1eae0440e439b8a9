"""The warmer's decisions about child processes and unstable keys (issue 30), pure: which
entrypoints run in process, how children's records and fingerprints merge, which programs
are unstable and which older entries go, and how a pool's status keeps what the warmer
said (reconcile/warmplan.py reads it strictly)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cachewarm.agents import warmer
from cachewarm.api.model import parse_spec
from cachewarm.reconcile.warmplan import parse_summary, pool_status

H = "0123456789abcdef" * 4  # a key's hash: 64 hex digits


def key(program: str, n: int) -> str:
    return f"{program}-{n:x}{H[1:]}"


@pytest.mark.parametrize(("argv", "inside"), [
    (["python", "train.py", "--steps", "1"], True),
    (["python3.11", "-m", "pkg.train"], True),
    (["/usr/bin/python", "train.py"], True),
    (["python", "-c", "import train"], False),
    (["python", "-u", "train.py"], False),  # was run_path("-u") before issue 30
    (["python", "-m"], False),
    (["sh", "-c", "python train.py"], False),
    (["torchrun", "--nproc-per-node=2", "train.py"], False),
    (["python"], False),
])
def test_which_entrypoints_run_in_process(argv: list[str], inside: bool) -> None:
    assert warmer.in_process(argv) is inside


FP = {"jax": "0.10.2", "platform": "cpu", "devices": 2}


def test_the_warms_fingerprint_is_its_own_else_the_busiest_childs_and_others_are_counted() -> None:
    records = [{"requests": 1, "fingerprint": {**FP, "devices": 4}}, {"requests": 5, "fingerprint": FP},
               {"requests": 0, "fingerprint": {}}]
    assert warmer.merge_fingerprints({}, records) == {**FP, "otherFingerprints": 1}
    assert warmer.merge_fingerprints({**FP, "devices": 4}, records) == {**FP, "devices": 4, "otherFingerprints": 1}
    assert warmer.merge_fingerprints({}, [{"requests": 0, "fingerprint": {}}]) == {}


def test_child_records_are_read_and_bad_ones_skipped(tmp_path: Path) -> None:
    suffix = warmer.CHILD_RECORD_SUFFIX
    compiled = [{"program": "a", "key": "a-1", "seconds": 2.5, "written": True},
                {"program": "b", "key": "b-2", "seconds": "slow", "written": True}]  # not a number: left out
    (tmp_path / f"1-1{suffix}").write_text(json.dumps({"pid": 1, "requests": 3, "hits": 1, "keys": ["a-1"],
                                                       "fingerprint": FP, "compiled": compiled}))
    (tmp_path / f"2-2{suffix}").write_text("{not json")
    (tmp_path / f"3-3{suffix}").write_text(json.dumps({"pid": 3, "requests": "many", "hits": 0, "keys": []}))
    (tmp_path / f"4-4{suffix}.tmp").write_text("{}")  # not renamed yet: not a record
    assert warmer.read_child_records(str(tmp_path)) == [
        {"pid": 1, "requests": 3, "hits": 1, "keys": ["a-1"], "fingerprint": FP, "compiled": compiled[:1]}]
    assert warmer.read_child_records(str(tmp_path / "gone")) == []


def manifest(*keys: str, fp: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"version": 2, "entries": [{"name": f"{k}-cache"} for k in keys], "fingerprint": FP if fp is None else fp}


def test_a_program_whose_older_key_went_unused_and_got_a_new_one_is_unstable_across_runs() -> None:
    old, new = key("jit_step", 1), key("jit_step", 2)
    helper = key("jit_convert_element_type", 3)
    unstable, stale = warmer.unstable_programs(manifest(old, helper), FP, {new, helper}, {new}, [])
    assert unstable == [{"program": "jit_step", "seen": "runs",
                         "keys": [warmer.key_hash(old), warmer.key_hash(new)]}]
    assert stale == {old}


@pytest.mark.parametrize("case", ["other fingerprint", "old key used", "nothing new written", "no manifest",
                                  "another program", "not a key"])
def test_what_is_not_an_unstable_program(case: str) -> None:
    old, new = key("jit_step", 1), key("jit_step", 2)
    previous: dict[str, Any] | None = manifest(old)
    used, written = {new}, {new}
    if case == "other fingerprint":
        previous = manifest(old, fp={**FP, "devices": 4})
    elif case == "old key used":
        used = {old, new}  # a second shape of the program, the first one hit
    elif case == "nothing new written":
        used, written = {old}, set()
    elif case == "no manifest":
        previous = None
    elif case == "another program":
        written = used = {key("jit_other", 2)}
    else:
        previous = {**manifest(), "entries": [{"name": "../jit_step-" + H + "-cache"}, {"name": 5}, "x"]}
    assert warmer.unstable_programs(previous, FP, used, written, []) == ([], set())


def test_two_processes_that_ran_the_same_programs_with_two_keys_for_one_are_unstable_in_a_run() -> None:
    a = {key("jit_step", 1), key("jit_helper", 5)}
    b = {key("jit_step", 2), key("jit_helper", 5)}
    unstable, stale = warmer.unstable_programs(None, FP, a | b, a | b, [(FP, a), (FP, b)])
    assert unstable == [{"program": "jit_step", "seen": "processes",
                         "keys": sorted(warmer.key_hash(k) for k in (key("jit_step", 1), key("jit_step", 2)))}]
    assert stale == set()  # both were written by this warm
    # Different programs (a preparation step and the training), or fingerprints: not compared.
    prep = {key("jit_step", 3)}
    assert warmer.unstable_programs(None, FP, a | prep, a | prep, [(FP, a), (FP, prep)]) == ([], set())
    assert warmer.unstable_programs(None, FP, a | b, a | b, [(FP, a), ({**FP, "devices": 4}, b)]) == ([], set())


def test_a_summary_names_at_most_five_programs_and_four_keys_each() -> None:
    olds = [key(f"jit_p{i}", j) for i in range(8) for j in range(1, 7)]
    news = {key(f"jit_p{i}", 9) for i in range(8)}
    unstable, stale = warmer.unstable_programs(manifest(*olds), FP, news, news, [])
    assert len(unstable) == warmer.MAX_UNSTABLE == 5 and stale == set(olds)
    assert all(len(u["keys"]) == 4 and u["keys"][-1] == warmer.key_hash(key(u["program"], 9)) for u in unstable)


def test_the_summary_gives_up_unstable_programs_before_it_cuts_json(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "summary"
    monkeypatch.setenv(warmer.ENV_SUMMARY_FILE, str(out))
    programs = [{"program": "p" * 100, "seen": "runs", "keys": ["f" * 16] * 4}] * 5
    warmer.write_summary({"errors": [], "keys": ["a" * 16] * 150, "unstablePrograms": programs,
                          "imagePythonPath": "/x" * 400})
    written = json.loads(out.read_text())  # whole JSON
    assert len(out.read_text()) <= warmer.SUMMARY_LIMIT and written["imagePythonPath"] == "/x" * 400
    assert 0 < len(written["keys"]) < 150 and "unstablePrograms" in written


def test_unstable_programs_give_way_before_the_summary_is_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "summary"
    monkeypatch.setenv(warmer.ENV_SUMMARY_FILE, str(out))
    programs = [{"program": f"{i}" + "p" * 999, "seen": "runs", "keys": []} for i in range(5)]
    warmer.write_summary({"errors": [], "unstablePrograms": programs, "imagePythonPath": "/x"})
    written = json.loads(out.read_text())  # whole JSON
    assert 0 < len(written["unstablePrograms"]) < 5 and written["imagePythonPath"] == "/x"
    assert written["unstablePrograms"] == programs[:len(written["unstablePrograms"])]


GOOD = {"processIndex": 0, "entriesWritten": 2, "errors": []}
UNSTABLE = [{"program": "jit_step", "keys": ["aa", "bb"], "seen": "runs"}]


def pool_entry(summary: dict[str, Any]) -> dict[str, Any]:
    warmup = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                         "warmup": {"image": "i", "command": ["sh", "-c", "python t.py"], "pools": [{"name": "a"}]}}
                        ).warmup
    assert warmup is not None
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    return pool_status("j", warmup.pools[0], "h", job, [summary])


def test_the_pool_status_names_unstable_programs() -> None:
    out = pool_entry({**GOOD, "unstablePrograms": UNSTABLE})
    assert out["unstablePrograms"] == UNSTABLE
    assert "unstablePrograms" not in pool_entry(GOOD)


@pytest.mark.parametrize(("field", "value"), [
    ("unstablePrograms", [{**UNSTABLE[0], "seen": "sometimes"}]),
    ("unstablePrograms", [{**UNSTABLE[0], "program": ""}]),
    ("unstablePrograms", [{**UNSTABLE[0], "program": "p" * 101}]),
    ("unstablePrograms", [{**UNSTABLE[0], "keys": ["k"] * 5}]),
    ("unstablePrograms", [{**UNSTABLE[0], "keys": ["k" * 65]}]),
    ("unstablePrograms", UNSTABLE * 6),
    ("unstablePrograms", "jit_step"),
])
def test_a_bad_unstable_field_is_dropped_alone_and_said(field: str, value: Any) -> None:
    _, dropped = parse_summary({**GOOD, field: value})
    assert dropped == (field,)
    out = pool_entry({**GOOD, field: value})
    assert field not in out and out["entriesWritten"] == 2
    assert out["message"] == f"Ignored invalid fields of the warmer's summary: {field}"
