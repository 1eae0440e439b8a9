"""What the operator reads and reports for a torch cache (issue 31): a torch warmer's
summary in pool status, torch fingerprints compared and named by KeysMatch, pods' torch
counters and seconds saved in status.usage.torch, their metrics and `cachewarm inspect`."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cachewarm.api.metrics import Metrics
from cachewarm.api.model import parse_spec
from cachewarm.cli import inspection
from cachewarm.clients.gcs import ObjectInfo
from cachewarm.reconcile.keysmatch import differences, keys_match
from cachewarm.reconcile.warmplan import pool_status
from cachewarm.reports.store import ReportError, Store, parse

NOW = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
ARCHIVE = "e" * 64
KEY = ARCHIVE[:16]  # key_hash("torch-inductor-<sha>")
# agents/warmer.torch_fingerprint of the warmer, as the design spells it
WARMED: dict[str, Any] = {
    "framework": "torch", "versions": {"torch": "2.15.0", "triton": "3.9.0"}, "platform": "cpu",
    "deviceKind": "cpu", "devices": 1, "inductorConfigHash": "0a1b2c3d4e5f", "inductorEnv": {},
    "inductorChanged": {}, "torchKey": "0123456789abcdef", "cacheDir": "/cachewarm-torch"}
AUTOTUNE = "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE"


def pools(fp: dict[str, Any] | None = None, seconds: float = 21.0, **more: Any) -> list[dict[str, Any]]:
    return [{"name": "cpu", "state": "Succeeded", "fingerprint": fp or WARMED, **more,
             "compiledPrograms": [{"program": "torch.compile", "key": KEY, "compileSeconds": seconds}]}]


# --- KeysMatch -------------------------------------------------------------------------------

def test_the_same_torch_fingerprint_matches_and_the_message_says_no_xla_flags() -> None:
    pod = {k: v for k, v in WARMED.items()}
    matched, reason, message = keys_match(pools(), [("trainer", pod)])
    assert (matched, reason) == (True, "FingerprintsMatch")
    assert "XLA" not in message and "Inductor config" in message
    # Not in Inductor's keys: how many devices; a device kind the pod did not read (it had
    # not initialized CUDA itself); a cache dir one side did not say.
    quiet = {**{k: v for k, v in pod.items() if k not in ("deviceKind", "cacheDir")}, "devices": 8}
    assert keys_match(pools(), [("trainer", quiet)])[:2] == (True, "FingerprintsMatch")


def test_a_pod_that_keeps_its_own_torch_cache_dir_reads_nothing_seeded_and_is_named() -> None:
    # torch reads only its TORCHINDUCTOR_CACHE_DIR: a pod's own value wins, and the seeded
    # directory is never read (every graph misses), though the keys are the same.
    pod = {**WARMED, "cacheDir": "/x"}
    assert differences(WARMED, pod) == ["cacheDir"]
    matched, reason, message = keys_match(pools(), [("trainer", pod)])
    assert (matched, reason) == (False, "FingerprintsDiffer")
    assert message.startswith("Training pods do not read the seeded directory and miss: they use "
                              "TORCHINDUCTOR_CACHE_DIR /x; pool cpu's warm was seeded at /cachewarm-torch")
    # With another difference too, both are named.
    both = {**pod, "torchKey": "f" * 16}
    assert "TORCHINDUCTOR_CACHE_DIR /x" in keys_match(pools(), [("trainer", both)])[2]


def test_an_env_setting_that_enters_the_key_is_named_in_words() -> None:
    # The env changes the config's defaults, so the hash differs too: the setting is named, not the hash.
    pod = {**WARMED, "inductorConfigHash": "ffffffffffff", "inductorEnv": {AUTOTUNE: "1"}}
    assert differences(pools()[0]["fingerprint"], pod) == [f"inductorEnv.{AUTOTUNE}"]
    matched, reason, message = keys_match(pools(), [("trainer", pod)])
    assert (matched, reason) == (False, "FingerprintsDiffer")
    assert message == ("Training pods compute other keys than the warmers and miss: they run "
                       f"{AUTOTUNE}=1; pool cpu was warmed with {AUTOTUNE} unset")
    # The other way round, and a value set in both but not the same.
    warmed_with = {**WARMED, "inductorEnv": {AUTOTUNE: "1"}}
    assert f"they run {AUTOTUNE} unset; pool cpu was warmed with {AUTOTUNE}=1" in keys_match(
        pools(warmed_with), [("trainer", {**WARMED, "inductorConfigHash": "ffffffffffff"})])[2]
    assert f"they run {AUTOTUNE}=0; pool cpu was warmed with {AUTOTUNE}=1" in keys_match(
        pools(warmed_with), [("t", {**WARMED, "inductorConfigHash": "f" * 12, "inductorEnv": {AUTOTUNE: "0"}})])[2]


def test_an_env_difference_that_leaves_the_config_hash_alone_is_not_a_key_difference() -> None:
    pod = {**WARMED, "inductorEnv": {"TORCH_COMPILE_DEBUG": "1"}}
    assert differences(WARMED, pod) == []
    assert keys_match(pools(), [("trainer", pod)])[0] is True


def test_a_config_value_set_in_code_is_named_and_a_bare_hash_difference_says_set_in_the_program() -> None:
    pod = {**WARMED, "inductorConfigHash": "ffffffffffff", "inductorChanged": {"max_autotune": "True"}}
    message = keys_match(pools(), [("trainer", pod)])[2]
    assert message.endswith("they run torch._inductor.config.max_autotune = True (set in the program); pool cpu "
                            "was warmed with torch._inductor.config.max_autotune at its default")
    bare = {**WARMED, "inductorConfigHash": "ffffffffffff"}
    message = keys_match(pools(), [("trainer", bare)])[2]
    assert message == ("Training pods compute other keys than the warmers and miss: they run the Inductor config "
                       "(set in the program) ffffffffffff; pool cpu was warmed with the Inductor config (set in the "
                       "program) 0a1b2c3d4e5f")


def test_versions_torch_sources_and_the_device_are_named() -> None:
    pod = {**WARMED, "versions": {"torch": "2.14.1", "triton": "3.9.0"}}
    assert keys_match(pools(), [("t", pod)])[2].endswith("they run torch 2.14.1; pool cpu was warmed with torch 2.15.0")
    pod = {**WARMED, "torchKey": "fedcba9876543210", "platform": "cuda", "deviceKind": "NVIDIA H100 80GB HBM3"}
    assert differences(WARMED, pod) == ["platform", "torchKey", "deviceKind"]
    assert "torch sources fedcba9876543210 (torchKey)" in keys_match(pools(), [("t", pod)])[2]


def test_a_jax_pod_against_a_torch_warm_is_named_by_its_framework_alone() -> None:
    jax_pod = {"jax": "0.10.2", "versions": {"jaxlib": "0.10.2"}, "platform": "cpu", "devices": 1}
    assert differences(WARMED, jax_pod) == ["framework"]
    matched, reason, message = keys_match(pools(), [("trainer", jax_pod)])
    assert (matched, reason) == (False, "FingerprintsDiffer")
    assert message.endswith("they run JAX; pool cpu was warmed with torch")
    # and the other way round: a torch pod of a JAX cache
    jax_pools = [{"name": "cpu", "state": "Succeeded", "fingerprint": jax_pod}]
    assert keys_match(jax_pools, [("trainer", WARMED)])[2].endswith("they run torch; pool cpu was warmed with JAX")


def test_a_difference_is_said_as_one_line_of_plain_text_whatever_the_fingerprints_hold() -> None:
    pod = parse(raw(torch_report(fingerprint={**WARMED, "platform": "cpu\n\x1b[2J"}))).fingerprint.as_status()
    message = keys_match(pools({**WARMED, "platformVersion": "12.9\r"}), [("trainer", pod)])[2]
    assert message.isprintable() and "they run platform cpu??[2J" in message


# --- a torch warmer's summary in pool status ---------------------------------------------------

SUMMARY: dict[str, Any] = {
    "mode": "command", "processIndex": 0, "cacheDir": "gs://b/torch", "programs": 3, "entriesFound": 0,
    "entriesWritten": 1, "bytesWritten": 3_200_000, "compileSeconds": 25.93, "errors": [], "keys": [KEY],
    "keyCount": 1, "fingerprint": {**WARMED, "inductorEnv": {AUTOTUNE: "1"}},
    "compiledPrograms": [{"program": "torch.compile", "seconds": 25.93, "key": KEY}],
    "manifestGeneration": "1700000000000001",
    "torch": {"fxGraphHits": 0, "fxGraphMisses": 3, "fxGraphBypasses": 0, "aotAutogradHits": 0,
              "aotAutogradMisses": 2, "aotAutogradBypasses": 0, "compileSeconds": 25.93, "files": 101,
              "archiveBytes": 3_300_000, "counted": True}}


def pool_entry(*summaries: dict[str, Any]) -> dict[str, Any]:
    warmup = parse_spec({"storage": {"gcs": {"bucket": "b", "location": "US"}},
                         "warmup": {"image": "i", "command": ["python", "t.py"], "pools": [{"name": "cpu"}]}}).warmup
    assert warmup is not None
    job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    return pool_status("j", warmup.pools[0], "h", job, list(summaries), manifest="torch/.cachewarm/pools/cpu.json")


def test_a_torch_warmers_summary_fills_pool_status_as_a_jax_ones_does() -> None:
    entry = pool_entry(SUMMARY)
    assert "message" not in entry  # nothing of it dropped as invalid
    assert (entry["entriesWritten"], entry["bytesWritten"], entry["keys"], entry["keyCount"]) == (1, 3_200_000,
                                                                                                  [KEY], 1)
    assert entry["manifestGeneration"] == "1700000000000001"
    # The warm's seconds, named `seconds` by the design's warmer, as compileSeconds.
    assert entry["compiledPrograms"] == [{"program": "torch.compile", "key": KEY, "compileSeconds": 25.93,
                                          "written": True}]
    assert entry["torch"] == SUMMARY["torch"]
    fp = entry["fingerprint"]
    assert (fp["framework"], fp["inductorConfigHash"], fp["torchKey"], fp["inductorEnv"], fp["inductorChanged"]) == (
        "torch", "0a1b2c3d4e5f", "0123456789abcdef", {AUTOTUNE: "1"}, {})
    assert fp["versions"] == {"torch": "2.15.0", "triton": "3.9.0"}
    # Process 1 uploads nothing: its counters are not the pool's.
    other = {**SUMMARY, "processIndex": 1, "torch": {**SUMMARY["torch"], "fxGraphMisses": 9}}
    assert pool_entry(other, SUMMARY)["torch"]["fxGraphMisses"] == 3


@pytest.mark.parametrize("torch", [{"fxGraphHits": "3"}, {"fxGraphHits": -1}, {"compileSeconds": float("nan")},
                                   {"counted": 1}, {"archiveBytes": 2**60}, "x"])
def test_a_bad_torch_section_of_a_summary_is_dropped_alone_and_said(torch: Any) -> None:
    value = {**SUMMARY["torch"], **torch} if isinstance(torch, dict) else torch
    entry = pool_entry({**SUMMARY, "torch": value})
    assert "torch" not in entry and "torch" in entry["message"]
    assert entry["compiledPrograms"][0]["compileSeconds"] == 25.93  # the rest is kept


def test_a_warmers_env_names_are_kept_plain_bounded_and_comparable_with_a_pods() -> None:
    many = {f"TORCHINDUCTOR_X{i:02d}": "1" for i in range(25)}
    fp = pool_entry({**SUMMARY, "fingerprint": {**WARMED, "inductorEnv": {**many, "TORCHINDUCTOR_Y": "a\x1b[2Jb"}}}
                    )["fingerprint"]
    assert len(fp["inductorEnv"]) == 20 and fp["inductorEnv"]["TORCHINDUCTOR_X00"] == "1"
    odd = pool_entry({**SUMMARY, "fingerprint": {**WARMED, "inductorEnv": {"TORCHINDUCTOR_Y": "a\x1b[2Jb"}}}
                     )["fingerprint"]
    assert odd["inductorEnv"] == {"TORCHINDUCTOR_Y": "a?[2Jb"}
    # A pod's report of that same value is kept the same way, so the two compare equal.
    sent = parse(raw(torch_report(fingerprint={**WARMED, "inductorEnv": {"TORCHINDUCTOR_Y": "a\x1b[2Jb"}})))
    assert differences(odd, sent.fingerprint.as_status()) == []
    # A repr with quotes and spaces is kept as it is, on both sides.
    changed = {"mode": "'max-autotune no-cudagraphs'"}
    kept = pool_entry({**SUMMARY, "fingerprint": {**WARMED, "inductorChanged": changed}})["fingerprint"]
    assert kept["inductorChanged"] == changed
    sent = parse(raw(torch_report(fingerprint={**WARMED, "inductorChanged": changed})))
    assert differences(kept, sent.fingerprint.as_status()) == []


# --- pods' reports: the torch section ---------------------------------------------------------

COUNTERS = {"fxGraphHits": 3, "fxGraphMisses": 0, "fxGraphBypasses": 0, "aotAutogradHits": 2,
            "aotAutogradMisses": 0, "aotAutogradBypasses": 0, "compileSeconds": 1.5}


def torch_report(pod: str = "trainer", torch: dict[str, Any] | None = None, fingerprint: dict[str, Any] | None = None,
                 pid: int = 7) -> dict[str, Any]:
    counters = {**COUNTERS, **(torch or {})}
    requests, hits = counters["fxGraphHits"] + counters["fxGraphMisses"], counters["fxGraphHits"]
    return {"version": 1, "pod": {"namespace": "ml", "name": pod, "uid": f"u-{pod}"}, "cache": "llama",
            "process": {"pid": pid, "started": 1_700_000_000}, "sequence": 1,
            "counts": {"requests": requests, "hits": hits, "misses": requests - hits, "compileSecondsSaved": 0.0,
                       "compileSecondsSpent": counters["compileSeconds"], "compiles": counters["fxGraphMisses"]},
            "torch": counters, "fingerprint": fingerprint or WARMED}


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_a_torch_report_is_taken_with_its_counters_and_fingerprint() -> None:
    report = parse(raw(torch_report()))
    assert report.torch is not None and (report.torch.fx_graph_hits, report.torch.compile_seconds) == (3, 1.5)
    assert report.fingerprint.as_status() == WARMED
    assert parse(raw({k: v for k, v in torch_report().items() if k != "torch"})).torch is None  # a JAX report


@pytest.mark.parametrize(("torch", "where"), [
    ({"fxGraphHits": "3"}, "fxGraphHits"),          # a count as text
    ({"fxGraphHits": True}, "fxGraphHits"),         # a bool is no count
    ({"aotAutogradMisses": -1}, "aotAutogradMisses"),
    ({"compileSeconds": 1e10}, "compileSeconds"),
    ({"fxGraphBypasses": None}, "fxGraphBypasses"),  # missing
])
def test_a_malformed_torch_section_is_refused_with_what_is_wrong(torch: dict[str, Any], where: str) -> None:
    body = torch_report()
    body["torch"] = {k: v for k, v in {**COUNTERS, **torch}.items() if v is not None}
    with pytest.raises(ReportError) as refused:
        parse(raw(body))
    assert refused.value.status == 400 and where in str(refused.value)


@pytest.mark.parametrize(("fingerprint", "where"), [
    ({"inductorEnv": {f"TORCHINDUCTOR_X{i}": "1" for i in range(21)}}, "inductorEnv"),  # over 20 names
    ({"inductorEnv": {AUTOTUNE: "x" * 101}}, "inductorEnv"),
    ({"inductorEnv": {AUTOTUNE: 1}}, "inductorEnv"),                                     # not text
    ({"inductorChanged": ["max_autotune"]}, "inductorChanged"),
    ({"inductorConfigHash": "a" * 65}, "inductorConfigHash"),
    ({"torchKey": 12}, "torchKey"),
    ({"framework": "t" * 21}, "framework"),
])
def test_a_malformed_torch_fingerprint_is_refused(fingerprint: dict[str, Any], where: str) -> None:
    with pytest.raises(ReportError) as refused:
        parse(raw(torch_report(fingerprint={**WARMED, **fingerprint})))
    assert refused.value.status == 400 and where in str(refused.value)


# --- status.usage.torch -----------------------------------------------------------------------

def body(pool_list: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "llama"}, "spec": {},
            "status": {"warmup": {"pools": pool_list}}}


def usage_of(*reports: dict[str, Any], pool_list: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    store = Store()
    for one in reports:
        store.record(parse(raw(one)), NOW)
    usage = store.usage("ml", "llama", NOW, body(pools() if pool_list is None else pool_list))
    assert usage is not None
    return usage


def test_usage_sums_torch_counters_and_measures_each_pod_against_the_warm_of_its_fingerprint() -> None:
    usage = usage_of(
        torch_report("warm"),                                                       # 1.5 s against 21 s: saved 19.5
        torch_report("slow", torch={"compileSeconds": 22.0}),                       # hit, not faster: not saved
        torch_report("cold", torch={"fxGraphHits": 0, "aotAutogradHits": 0, "fxGraphMisses": 3,
                                    "aotAutogradMisses": 2, "compileSeconds": 20.0}),  # no hit: neither
        torch_report("other", fingerprint={**WARMED, "torchKey": "f" * 16}),        # no warm of its fingerprint
    )
    # The slow pod's hits are not hits: they are said apart; the unmeasured pod's stay.
    assert usage["torch"] == {"pods": 4, "fxGraphHits": 6, "fxGraphHitsNotSaved": 3, "fxGraphMisses": 3,
                              "aotAutogradHits": 4, "aotAutogradHitsNotSaved": 2, "aotAutogradMisses": 2,
                              "compileSeconds": 45.0, "warmerCompileSeconds": 42.0, "measuredCompileSeconds": 23.5,
                              "secondsSaved": 19.5, "hitButNotSaved": 1}
    # The generic counts come from the same counters (the reporter maps them), less the slow pod's hits;
    # the generic seconds saved is torch's.
    assert (usage["pods"], usage["hits"], usage["misses"], usage["hitRatio"]) == (4, 6, 3, 0.5)
    assert usage["compileSecondsSaved"] == 19.5


@pytest.mark.parametrize(("seconds", "saved"), [
    (14.7, False),  # 0.7x the warm's 21 s: what torch's Mega-Cache artifact alone gives on CPU, every counter a hit
    (10.6, False),  # just above half
    (10.5, True),   # half: the most that counts as saved
    (1.5, True),    # a warm directory (0.07x)
])
def test_a_pod_saved_time_only_at_most_half_the_warms_seconds(seconds: float, saved: bool) -> None:
    usage = usage_of(torch_report("p", torch={"compileSeconds": seconds}))
    torch = usage["torch"]
    assert (torch["hitButNotSaved"], torch["fxGraphHits"], torch["fxGraphHitsNotSaved"]) == (
        (0, 3, 0) if saved else (1, 0, 3))
    assert (torch["warmerCompileSeconds"], torch["measuredCompileSeconds"]) == (21.0, seconds)
    assert torch["secondsSaved"] == usage["compileSecondsSaved"] == (round(21.0 - seconds, 3) if saved else 0.0)
    assert usage["hits"] == (3 if saved else 0) and usage["hitRatio"] == (1.0 if saved else 0.0)


def test_a_torch_reports_hits_are_not_added_to_the_hits_counter_at_intake() -> None:
    # Whether they saved time is known only against the warm, over the window (status and the torch gauges).
    store = Store()
    assert store.record(parse(raw(torch_report())), NOW)["hits"] == 0.0
    assert store.record(parse(raw({k: v for k, v in torch_report("jax").items() if k != "torch"})), NOW)["hits"] == 3.0


def test_a_pod_that_compiled_exactly_as_long_as_the_warmer_saved_nothing() -> None:
    torch = usage_of(torch_report("even", torch={"compileSeconds": 21.0}))["torch"]
    assert (torch["secondsSaved"], torch["hitButNotSaved"], torch["warmerCompileSeconds"]) == (0.0, 1, 21.0)


def test_a_pods_processes_each_count_against_the_warm_and_the_pod_once() -> None:
    torch = usage_of(torch_report("two", pid=1), torch_report("two", pid=2, torch={"compileSeconds": 2.5}))["torch"]
    assert (torch["pods"], torch["warmerCompileSeconds"], torch["secondsSaved"], torch["hitButNotSaved"]) == (
        1, 42.0, 38.0, 0)
    # One process as slow as the warm and one fast: the pod, in all, compiled 23.5 s of 42: above half, not saved.
    torch = usage_of(torch_report("two", pid=1), torch_report("two", pid=2, torch={"compileSeconds": 22.0}))["torch"]
    assert (torch["secondsSaved"], torch["hitButNotSaved"], torch["measuredCompileSeconds"]) == (0.0, 1, 23.5)


def test_several_pools_of_the_pods_fingerprint_are_one_mean_and_a_failed_warm_still_counts() -> None:
    both = [*pools(seconds=20.0), {**pools(seconds=30.0)[0], "name": "cpu-2", "state": "Failed",
                                    "compiledFingerprint": WARMED}]
    assert usage_of(torch_report(), pool_list=both)["torch"]["warmerCompileSeconds"] == 25.0


def test_without_a_warm_or_a_torch_report_nothing_is_claimed() -> None:
    torch = usage_of(torch_report(), pool_list=[])["torch"]
    assert (torch["warmerCompileSeconds"], torch["secondsSaved"], torch["hitButNotSaved"]) == (0.0, 0.0, 0)
    jax = {k: v for k, v in torch_report().items() if k != "torch"}
    assert "torch" not in usage_of({**jax, "fingerprint": {"jax": "0.10.2"}})


# --- metrics and inspect ----------------------------------------------------------------------

def test_metrics_and_inspect_show_usage_torch_and_the_archive() -> None:
    usage = usage_of(torch_report("warm"), torch_report("slow", torch={"compileSeconds": 22.0}))
    pool = {**pool_entry(SUMMARY), "name": "cpu"}
    cache = {**body([pool]), "status": {"warmup": {"pools": [pool]}, "usage": usage}}
    registry: CollectorRegistry = Metrics(lambda: [cache]).registry
    labels = {"namespace": "ml", "cache": "llama"}
    assert registry.get_sample_value("cachewarm_torch_seconds_saved", labels) == 19.5
    assert registry.get_sample_value("cachewarm_torch_hit_but_not_saved_pods", labels) == 1.0
    assert registry.get_sample_value("cachewarm_torch_fx_graph_hits", labels) == 3.0
    assert registry.get_sample_value("cachewarm_torch_fx_graph_hits_not_saved", labels) == 3.0
    assert registry.get_sample_value("cachewarm_torch_measured_compile_seconds", labels) == 23.5
    assert registry.get_sample_value("cachewarm_torch_aot_autograd_misses", labels) == 0.0
    assert registry.get_sample_value("cachewarm_torch_warmer_compile_seconds", labels) == 42.0
    objects = [ObjectInfo(f"torch/torch-inductor-{ARCHIVE}-cache", 3_300_000, created=NOW, custom_time=NOW)]
    progs = inspection.programs(objects, "torch/", [pool])
    got = json.loads(inspection.as_json("gs://b/torch", progs, [pool], [], usage))
    assert got["torch"] == usage["torch"]
    assert got["programs"][0]["name"] == "torch-inductor" and got["programs"][0]["keys"][0]["pools"] == ["cpu"]
    assert got["pools"][0]["torch"]["files"] == 101
    table = inspection.as_table("gs://b/torch", progs, [pool], [], usage)
    assert "torch-inductor  1        3.1 MiB" in table
    assert (f"cpu  Succeeded  torch 2.15.0, triton 3.9.0, cpu cpu, Inductor config 0a1b2c3d4e5f, torch key "
            f"0123456789abcdef, env {AUTOTUNE}=1") in table
    assert "cpu  0/3  0/2  25.93  101 files, 3.1 MiB" in table
    assert ("Compile seconds: 23.5 in all the pods; the pods measured against their warm: 23.5, where the warmer "
            "compiled 42.0; saved 19.5" in table)
    assert ("Pods that hit but saved no time (above half the warmer's seconds): 1 (their FX graph hits 3, "
            "AOTAutograd hits 2, not counted as hits)" in table)
    assert "FX graph hits 3, misses 0; AOTAutograd hits 2, misses 0" in table
    assert "(no torch Inductor archives)" in inspection.as_table("gs://b/torch", [], [pool], [], usage)


@pytest.mark.parametrize("framework", ["pytorch", "Torch", "jax\n", "x" * 30])
def test_a_warmers_framework_outside_the_crds_enum_is_left_out(framework: str) -> None:
    # status.warmup.pools[].fingerprint.framework is enum [jax, torch]: another value would have
    # the apiserver refuse the whole status patch, on every reconcile.
    fp = pool_entry({**SUMMARY, "fingerprint": {**WARMED, "framework": framework}})["fingerprint"]
    assert "framework" not in fp and fp["torchKey"] == WARMED["torchKey"]
    assert pool_entry(SUMMARY)["fingerprint"]["framework"] == "torch"


def test_inspect_says_an_uncounted_warm_was_not_counted_not_zero_seconds() -> None:
    uncounted = {**SUMMARY["torch"], "counted": False, "fxGraphMisses": 0, "aotAutogradMisses": 0,
                 "compileSeconds": 0.0}
    pool = {**pool_entry({**SUMMARY, "torch": uncounted}), "name": "cpu"}
    table = inspection.as_table("gs://b/torch", [], [pool], [], None)
    line = next(one for one in table.splitlines() if one.startswith("cpu  -"))
    assert line.startswith("cpu  -  -  -  101 files, 3.1 MiB") and "not counted" in line
    assert "0.0" not in line
