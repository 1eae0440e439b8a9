"""`cachewarm inspect`'s pure part: entries grouped by program and matched to the pools
that reported them, the URL it takes, and what it prints; the CLI's refusals."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from click.testing import CliRunner

from cachewarm.cli.main import cli
from cachewarm.clients.gcs import ObjectInfo
from cachewarm.cli.inspection import InspectError, as_json, as_table, parse_url, programs

T1 = dt.datetime(2026, 11, 22, 1, tzinfo=dt.timezone.utc)
T2 = dt.datetime(2026, 11, 22, 2, tzinfo=dt.timezone.utc)
A, B, C = "a" * 64, "b" * 64, "c" * 64
OBJECTS = [
    ObjectInfo(f"jax/jit_train_step-{A}-cache", 1000, created=T1, custom_time=T2),
    ObjectInfo(f"jax/jit_train_step-{B}-cache", 3000, created=T2, custom_time=T2),
    ObjectInfo(f"jax/jit_eval-{C}-cache", 500, created=T1),
    ObjectInfo(f"jax/jit_eval-{C}-atime", 8, created=T1),   # JAX's LRU bookkeeping, not an entry
    ObjectInfo("jax/README", 10, created=T1),                # someone else's object
    ObjectInfo(f"jax/sub/jit_x-{A}-cache", 10, created=T1),  # another cache's folder
]
POOLS = [{"name": "h100", "state": "Succeeded", "keys": [A[:16]],
          "fingerprint": {"jax": "0.10.2", "platform": "gpu", "deviceKind": "NVIDIA H100 80GB HBM3", "devices": 8,
                          "processes": 1, "flagsHash": "0123456789ab", "image": "train@sha256:" + "d" * 64}},
         {"name": "v5p", "state": "Succeeded", "keys": [A[:16], B[:16]], "fingerprint": {}}]


def test_entries_are_grouped_by_program_and_named_by_the_pools_that_reported_them() -> None:
    progs = programs(OBJECTS, "jax/", POOLS)
    assert [(p.name, len(p.entries), p.size, p.written, p.last_used, p.pools) for p in progs] == [
        ("jit_eval", 1, 500, T1, None, []),
        ("jit_train_step", 2, 4000, T2, T2, ["h100", "v5p"]),
    ]
    newest, older = progs[1].entries
    assert (newest.key, newest.pools) == (B, ["v5p"]) and (older.key, older.pools) == (A, ["h100", "v5p"])
    assert programs(OBJECTS, "other/") == []


@pytest.mark.parametrize(("url", "parsed"), [
    ("gs://team-cache", ("team-cache", "")),
    ("gs://team-cache/", ("team-cache", "")),
    ("gs://team-cache/llama/8b/", ("team-cache", "llama/8b/")),
])
def test_a_bucket_url_is_a_bucket_and_an_object_prefix(url: str, parsed: tuple[str, str]) -> None:
    assert parse_url(url) == parsed


@pytest.mark.parametrize("url", ["team-cache", "s3://team-cache", "gs://", "gs://UPPER", "gs://a"])
def test_a_wrong_url_says_what_it_expected(url: str) -> None:
    with pytest.raises(InspectError, match="not a gs://BUCKET"):
        parse_url(url)


def test_json_and_table_say_the_same_things() -> None:
    progs = programs(OBJECTS, "jax/", POOLS)
    report = json.loads(as_json("gs://b/jax", progs, POOLS))
    assert [(p["name"], p["entries"], p["bytes"], p["lastUsed"]) for p in report["programs"]] == [
        ("jit_eval", 1, 500, None), ("jit_train_step", 2, 4000, "2026-11-22T02:00:00Z")]
    assert report["programs"][1]["keys"][0] == {"key": B, "bytes": 3000, "written": "2026-11-22T02:00:00Z",
                                                "lastUsed": "2026-11-22T02:00:00Z", "pools": ["v5p"], "hitBy": [],
                                                "hitPods": 0}
    assert report["pools"][0]["fingerprint"]["deviceKind"] == "NVIDIA H100 80GB HBM3"
    table = as_table("gs://b/jax", progs, POOLS)
    assert "jit_train_step  2        3.9 KiB  2026-11-22T02:00:00Z  2026-11-22T02:00:00Z  h100,v5p" in table
    assert ("h100  Succeeded  jax 0.10.2, gpu NVIDIA H100 80GB HBM3 x8, flags 0123456789ab, image train@sha256:"
            in table)
    assert "v5p  Succeeded  -" in table
    assert "(no JAX cache entries)" in as_table("gs://b/jax", [])


@pytest.mark.parametrize(("args", "message"), [
    ([], "give either NAMESPACE/NAME or --bucket"),
    (["ml/llama", "--bucket", "gs://b"], "give either NAMESPACE/NAME or --bucket"),
    (["llama"], "expected NAMESPACE/NAME, got 'llama'"),
    (["ml/llama/x"], "expected NAMESPACE/NAME"),
    (["--bucket", "gs://b", "-o", "yaml"], "'yaml' is not one of 'table', 'json'"),
])
def test_wrong_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["inspect", *args])
    assert result.exit_code == 2 and message in result.output


def test_a_wrong_bucket_url_is_an_error_not_a_traceback() -> None:
    result = CliRunner().invoke(cli, ["inspect", "--bucket", "team-cache"])
    assert result.exit_code == 1 and "error: not a gs://BUCKET[/PREFIX] URL: 'team-cache'" in result.output


def test_entries_name_the_pods_that_reported_hitting_them() -> None:
    hits = [{"program": "jit_train_step", "key": f"jit_train_step-{B}", "pods": ["t-1", "t-2"], "podCount": 7},
            {"program": "jit_gone", "key": f"jit_gone-{'f' * 64}", "pods": ["t-9"], "podCount": 1}]  # entry deleted
    progs = programs(OBJECTS, "jax/", POOLS, hits)
    newest, older = progs[1].entries
    assert (newest.hit_by, newest.hit_pods, older.hit_by, older.hit_pods) == (["t-1", "t-2"], 7, [], 0)
    assert progs[0].hit_by == [] and progs[1].hit_by == ["t-1", "t-2"]
    data = json.loads(as_json("gs://b/jax", progs, POOLS))
    assert data["programs"][1]["hitBy"] == ["t-1", "t-2"]
    assert (data["programs"][1]["keys"][0]["hitBy"], data["programs"][1]["keys"][0]["hitPods"]) == (["t-1", "t-2"], 7)
    row = next(line for line in as_table("gs://b/jax", progs, POOLS).splitlines() if line.startswith("jit_train_step"))
    assert row.endswith("t-1,t-2 +5")
