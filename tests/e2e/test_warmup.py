"""The heart of cachewarm, end to end: the operator's warmer Job fills the bucket, the
cache turns Warmed, and an ordinary training pod admitted through the webhook loads every
warmed program from the cache and compiles none of its own. kube-scheduler places the pods
on the testbed's simulated GKE nodes and the stand-in kubelet (cachewarm_testbed.nodeagent)
runs them; Jobs, pods and status go through the real apiserver and kube-controller-manager.
GPU and TPU pools: test_accelerator_pools.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import storage

from cachewarm.builders.job import job_name, spec_hash
from cachewarm.builders.placement import manifest_object
from cachewarm.api.model import GcsStorage, parse_spec
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, scrape
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e


def warm_cache(name: str, bucket: str, warmup: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A cache that warms on the cpu pool; its pods get the reporter (injection.report)."""
    spec = {**spec, "injection": {"report": True, **(spec.get("injection") or {})}}
    return {
        "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
        "spec": {
            "storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
            "jax": {"minCompileTimeSecs": 0},
            "warmup": {"image": "demo/train:1", "pools": [{"name": "cpu"}], **warmup},
            **spec,
        },
    }


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def wait_warmed(bed: Testbed, ns: str, name: str, status: str = "True", timeout: float = 180) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns)
        warmed = conditions(obj).get("Warmed")
        # Fully warm: not a re-warm in progress (True, Rewarming) nor a warm in progress.
        if warmed and warmed["status"] == status and warmed["reason"] not in ("Warming", "Rewarming"):
            return obj
        return None
    return eventually(check, timeout=timeout, what=f"Warmed={status} on {ns}/{name}")


def jobs(bed: Testbed, ns: str, cache: str) -> list[dict[str, Any]]:
    out = bed.kubectl_run("get", "jobs", "-n", ns, "-l", f"cachewarm.dev/warmer-for={cache}", "-o", "json")
    return list(json.loads(out.stdout)["items"])


def train_in_pod(bed: Testbed, ns: str, cache: str, name: str = "trainer",
                 env: list[dict[str, str]] | None = None, *, image: str = "demo/train:1",
                 command: list[str] | None = None, log_compiles: bool = True) -> dict[str, Any]:
    """Create an ordinary training pod through the webhook (demo/train.py for two steps
    unless `image` and `command` say otherwise; JAX_LOG_COMPILES=1 unless `log_compiles`
    is false), let the node agent run it, and return the training script's report (its
    last log line), its log and its env as stored."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "train", "image": image, "command": command or ["python", "train.py", "--steps", "2"],
               "env": [*([{"name": "JAX_LOG_COMPILES", "value": "1"}] if log_compiles else []), *(env or [])]}]}}
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(pod))
    assert created.returncode == 0, created.stderr

    def done() -> str | None:
        phase = ((bed.get_json("pod", name, ns) or {}).get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None
    phase = eventually(done, timeout=180, what=f"pod {name} finished")
    log = (bed.workdir / "pods" / ns / name / "train.log").read_text()
    assert phase == "Succeeded", log[-3000:]
    stored = bed.get_json("pod", name, ns) or {}
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0].get("env") or []}
    return {**json.loads(log.strip().splitlines()[-1]), "log": log, "env": env}


def inspect(bed: Testbed, *args: str) -> dict[str, Any]:
    """`cachewarm inspect ... -o json` as a user runs it, with the admin kubeconfig."""
    out = subprocess.run([sys.executable, "-m", "cachewarm", "inspect", *args, "-o", "json"],
                         env={**os.environ, **bed.env()}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.mark.parametrize("mode", ["targets", "command"])
def test_warmed_cache_is_hit_by_an_ordinary_training_pod(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client, mode: str,
) -> None:
    bucket = f"warm-{uuid.uuid4().hex[:8]}"
    warmup = {"targets": ["train:targets"]} if mode == "targets" else {
        "command": ["python", "train.py", "--steps", "1"]}
    # targets: the default read path (a local copy); command: gs:// directly (readFrom Bucket).
    read = {"injection": {"readFrom": "Bucket"}} if mode == "command" else {}
    controller_manager.apply(warm_cache("llama", bucket, warmup, **read), namespace)
    obj = wait_warmed(controller_manager, namespace, "llama")

    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["state"] == "Succeeded" and pool["name"] == "cpu"
    assert pool["entriesWritten"] >= 1 and pool["bytesWritten"] > 0
    # What the keys were computed with, kept through the CRD's schema (the node agent runs
    # no image, so it reports no imageID: the real node's test checks the digest).
    fingerprint = pool["fingerprint"]
    assert (fingerprint["platform"], fingerprint["devices"], fingerprint["cacheDir"]) == ("cpu", 1, f"gs://{bucket}/jax")
    assert fingerprint["versions"]["jaxlib"] and "image" not in fingerprint
    entries = [b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    assert len(entries) == pool["entriesWritten"] == obj["status"]["cache"]["entries"]
    assert any("jit_train_step" in b.name for b in entries)
    [job] = jobs(controller_manager, namespace, "llama")
    assert job["metadata"]["name"] == pool["job"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "CompilationCache"
    reasons = [e["reason"] for e in controller_manager.events_for("llama", namespace)]
    assert "WarmerCreated" in reasons and "WarmerSucceeded" in reasons
    # /metrics: the run, once, and the cache's size as its status says.
    this = {"namespace": namespace, "cache": "llama"}
    assert scrape(operator.metrics_url, "cachewarm_warmer_runs_total", **this, outcome="Succeeded") == 1
    assert scrape(operator.metrics_url, "cachewarm_warmer_runs_total", **this, outcome="Failed") == 0
    assert scrape(operator.metrics_url, "cachewarm_cache_entries", **this) == len(entries)
    assert scrape(operator.metrics_url, "cachewarm_cache_bytes", **this) == sum(b.size or 0 for b in entries)
    injected = scrape(operator.metrics_url, "cachewarm_webhook_admissions_total", outcome="injected")

    # `cachewarm inspect` lists, by program, what the warmer wrote, and says which pool
    # reported each entry and with what fingerprint; --bucket the same entries without them.
    report = inspect(controller_manager, f"{namespace}/llama")
    by_program = {p["name"]: p for p in report["programs"]}
    assert sum(p["entries"] for p in report["programs"]) == len(entries)
    assert by_program["jit_train_step"]["pools"] == ["cpu"]
    assert sorted(k["key"] for p in report["programs"] for k in p["keys"]) == \
        sorted(b.name.removesuffix("-cache").rsplit("-", 1)[1] for b in entries)
    assert report["pools"][0]["fingerprint"] == pool["fingerprint"]
    direct = inspect(controller_manager, "--bucket", f"gs://{bucket}/jax")
    assert [(p["name"], p["entries"], p["bytes"]) for p in direct["programs"]] == \
        [(p["name"], p["entries"], p["bytes"]) for p in report["programs"]] and direct["pools"] == []

    hits_before = scrape(operator.metrics_url, "cachewarm_cache_hits_total", **this)
    run = train_in_pod(controller_manager, namespace, "llama")
    assert scrape(operator.metrics_url, "cachewarm_webhook_admissions_total", outcome="injected") == injected + 1
    if mode == "command":
        assert run["cache_dir"] == f"gs://{bucket}/jax"
    else:  # the node agent mounts the pod's copy volume at run["cache_dir"]
        assert run["env"]["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache" and not run["cache_dir"].startswith("gs://")
    assert run["cache_hits"] >= 1
    assert run["compiled"] == 0, run["log"][-3000:]
    assert "Persistent compilation cache hit for 'jit_train_step'" in run["log"]
    # Nothing new was written by the training run.
    assert len([b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]) == len(entries)

    # The pod's reporter (added by the webhook, its token projected for the pod) told the
    # operator: its hits are in status.usage and /metrics, and its keys match the warmer's.
    def usage() -> dict[str, Any] | None:
        return ((controller_manager.get_json("ccache", "llama", namespace) or {}).get("status") or {}).get("usage")
    got = eventually(usage, timeout=60, what="status.usage from the training pod's report")
    assert (got["pods"], got["hits"], got["misses"]) == (1, run["cache_hits"], 0)
    assert got["compileRequests"] == run["cache_hits"] and got["hitRatio"] == 1.0
    assert scrape(operator.metrics_url, "cachewarm_cache_hits_total", **this) == hits_before + run["cache_hits"]
    # Seconds saved in steady state (every pod hits, none compiles): each program hit is
    # measured against what the cache's warmer measured compiling it (its pool's
    # compiledPrograms, the warmer's fingerprint being the pod's).
    compiled = {p["program"]: p for p in pool["compiledPrograms"]}
    assert compiled["jit_train_step"]["written"] and compiled["jit_train_step"]["key"] in pool["keys"]
    [step] = [h for h in got["hitPrograms"] if h["program"] == "jit_train_step"]
    assert step["compileSecondsFrom"] == "Warmer"
    assert step["compileSeconds"] == compiled["jit_train_step"]["compileSeconds"] > step["loadSeconds"] > 0
    assert step["secondsSaved"] > 0 and "measuredSecondsSaved" in got
    if mode == "targets":  # the local copy: loading every program costs less than compiling it
        assert got["measuredSecondsSaved"] > 0
        [start] = [p for p in got["podStarts"] if p["pod"] == "trainer"]
        assert start["coldCompileSeconds"] > start["compileSeconds"]
    assert eventually(lambda: scrape(operator.metrics_url, "cachewarm_measured_seconds_saved", **this)
                      == got["measuredSecondsSaved"], timeout=30, what="the measured seconds saved metric")
    shown = inspect(controller_manager, f"{namespace}/llama")
    assert shown["measuredSecondsSaved"] == got["measuredSecondsSaved"]
    assert any(h["program"] == "jit_train_step" and h["compileSecondsFrom"] == "Warmer" for h in shown["hitPrograms"])
    matched = eventually(lambda: conditions(controller_manager.get_json("ccache", "llama", namespace)).get(
        "KeysMatch", {}).get("status") == "True", timeout=60, what="KeysMatch True")
    assert matched
    # `cachewarm inspect` names the pod beside the entry it hit.
    hit = {k["key"]: k["hitBy"] for p in inspect(controller_manager, f"{namespace}/llama")["programs"]
           for k in p["keys"]}
    assert {key for key, pods in hit.items() if pods == ["trainer"]} == \
        {h["key"].rsplit("-", 1)[1] for h in got["recentHits"]} and got["recentHits"]

    # A pod on two devices computes other keys: it misses, and the cache says why.
    other = train_in_pod(controller_manager, namespace, "llama", name="two-devices", env=[
        {"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=2"}])
    assert other["cache_hits"] == 0 and other["compiled"] >= 1

    def differs() -> dict[str, Any] | None:
        cond = conditions(controller_manager.get_json("ccache", "llama", namespace)).get("KeysMatch") or {}
        return cond if cond.get("status") == "False" else None
    cond = eventually(differs, timeout=60, what="KeysMatch False for the two-device pod")
    assert cond["reason"] == "FingerprintsDiffer"
    assert "they run 2 devices; pool cpu was warmed with 1 devices" in cond["message"]
    warnings = [e for e in controller_manager.events_for("llama", namespace) if e["reason"] == "FingerprintsDiffer"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    # status.usage is written at the next usage flush, which may come after the reconcile
    # that set KeysMatch (it reads the reports as they arrive): wait for it, not assume it.
    last = eventually(lambda: (usage() or {}).get("pods") == 2 and usage(), timeout=30,
                      what="status.usage counting both pods")
    assert last["misses"] >= 1
    assert any(m["pod"] == "two-devices" and m["program"] == "jit_train_step" for m in last["lastMisses"])


def test_the_default_copy_takes_a_warms_small_entries_from_its_pack(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, gcs: storage.Client,
) -> None:
    """Issue 30: the warmer Job of a warm that wrote several programs (a training script run
    once: its step, its evaluation, its init's random programs) also writes the pack of their
    entries beside its manifest, which names it; a labelled pod's copy (the default read
    path) takes them from the pack in one request, checked each, downloads none on its own,
    and the pod hits every program."""
    bucket = f"pack-{uuid.uuid4().hex[:8]}"
    program = ["python", "jax_train.py", "--extra", "--steps"]
    controller_manager.apply(warm_cache("packed", bucket, {"image": "test/targets:1", "command": [*program, "1"]}),
                             namespace)
    obj = wait_warmed(controller_manager, namespace, "packed")
    [pool] = obj["status"]["warmup"]["pools"]
    manifest = json.loads(gcs.bucket(bucket).blob(pool["manifestObject"]).download_as_bytes())
    pack = gcs.bucket(bucket).get_blob(manifest["pack"]["name"])
    assert pack is not None and pack.name == pool["manifestObject"].removesuffix(".json") + ".cachewarm-pack"
    assert manifest["pack"] == {"name": pack.name, "size": pack.size, "md5": pack.md5_hash,
                                "generation": str(pack.generation)} and pack.custom_time is not None
    packed = sorted(e["name"] for e in manifest["entries"] if e.get("packed"))
    assert len(packed) == len(manifest["entries"]) >= 2, manifest
    # Not an entry to the operator: the cache counts only JAX's entries.
    assert obj["status"]["cache"]["entries"] == len(packed)

    run = train_in_pod(controller_manager, namespace, "packed", image="test/targets:1", command=[*program, "2"])
    assert run["env"]["JAX_COMPILATION_CACHE_DIR"] == "/cachewarm-cache" and not run["cache_dir"].startswith("gs://")
    assert run["compiled"] == 0 and run["hits"] == len(packed), run["log"][-3000:]
    [copy] = [json.loads(line)["cachewarm-copier"] for line in run["log"].splitlines()
              if line.startswith('{"cachewarm-copier"')]
    assert (copy["copied"], copy["fromPack"], copy["packs"], copy["packBytes"], copy["packFallback"],
            copy["failed"]) == (len(packed), len(packed), 1, pack.size, 0, 0), copy


def test_warmed_means_the_entries_the_warmer_reported_are_in_the_bucket(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, gcs: storage.Client,
) -> None:
    """Warmed is not "some entry under the prefix": an entry of another program (planted
    before the warm) is not what the warmer reports, and deleting one the warmer reported
    turns Warmed False (EntriesMissing) at the next reconcile, although entries remain."""
    bucket = f"keys-{uuid.uuid4().hex[:8]}"
    controller_manager.apply(warm_cache("keys", bucket, {"targets": ["train:targets"]}), namespace)
    eventually(lambda: controller_manager.get_json("ccache", "keys", namespace) and gcs.lookup_bucket(bucket),
               what="the cache's bucket")
    gcs.bucket(bucket).blob("jax/jit_old_program-" + "f" * 64 + "-cache").upload_from_string(b"old image's entry")
    obj = wait_warmed(controller_manager, namespace, "keys")
    [pool] = obj["status"]["warmup"]["pools"]
    written = [b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache") and "old_program" not in b.name]
    hashes = sorted(b.name.removesuffix("-cache").rsplit("-", 1)[1][:16] for b in written)
    assert pool["keys"] == hashes and "f" * 16 not in pool["keys"]
    assert f"the {len(hashes)} entries its warmers reported are in the bucket" in conditions(obj)["Warmed"]["message"]
    # The pool's manifest (for pods' local copies), written by the operator's warmer Job
    # where the local copy reads it: the same entries, with their sizes, GCS's md5 and
    # generation (D2), not the old one; and status records the generation of that manifest
    # object (D3: the one pods' copiers are given, and read it at) with the object's name:
    # the Job's own (<pool>/<job>.json), which no later warm rewrites.
    gcs_spec = GcsStorage.model_validate({"bucket": bucket, "location": "us-central1", "prefix": "jax"})
    assert pool["manifestObject"] == manifest_object(gcs_spec, namespace, "keys", "cpu", pool["job"])
    assert pool["manifestObject"] == f"jax/.cachewarm/pools/{namespace}/keys/cpu/{pool['job']}.json"
    blob = gcs.bucket(bucket).get_blob(pool["manifestObject"])
    assert blob is not None and blob.content_type == "application/json"
    assert pool["manifestGeneration"] == str(blob.generation)
    manifest = json.loads(blob.download_as_bytes())
    assert manifest["pool"] == "cpu" and manifest["fingerprint"] == pool["fingerprint"]
    # One entry: no pack (issue 30; a pack of one saves no request), as before packs.
    assert "pack" not in manifest and len(written) == 1
    assert manifest["entries"] == sorted(({"name": b.name.removeprefix("jax/"), "size": b.size, "md5": b.md5_hash,
                                           "generation": str(b.generation)} for b in written),
                                         key=lambda e: e["name"])
    assert sorted(e["name"].removesuffix("-cache").rsplit("-", 1)[1][:16] for e in manifest["entries"]) == pool["keys"]

    written[0].delete()

    def missing() -> dict[str, Any] | None:
        warmed = conditions(controller_manager.get_json("ccache", "keys", namespace)).get("Warmed") or {}
        return warmed if warmed.get("reason") == "EntriesMissing" else None
    warmed = eventually(missing, timeout=60, what="Warmed=False EntriesMissing after an entry was deleted")
    assert warmed["status"] == "False" and f"cpu: 1 of {len(hashes)}" in warmed["message"]


def test_warmers_run_as_the_writer_identity_and_training_pods_as_their_own(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """warmup.serviceAccountName: the warmer pod runs as the cache's writer identity (on
    GKE bound through Workload Identity to a Google service account that may write the
    bucket); a training pod keeps the ServiceAccount it names. Identities only: the GCS
    emulator checks no IAM, so what each may write is not shown here."""
    bed = controller_manager
    for account in ("cache-writer", "trainer"):
        assert bed.kubectl_run("create", "serviceaccount", account, "-n", namespace).returncode == 0
    bed.apply(warm_cache("ident", f"ident-{uuid.uuid4().hex[:8]}",
                         {"targets": ["train:targets"], "serviceAccountName": "cache-writer"}), namespace)
    obj = wait_warmed(bed, namespace, "ident")
    [pool] = obj["status"]["warmup"]["pools"]
    pods = json.loads(bed.kubectl_run("get", "pods", "-n", namespace, "-l", f"job-name={pool['job']}",
                                      "-o", "json").stdout)["items"]
    assert pods and {p["spec"]["serviceAccountName"] for p in pods} == {"cache-writer"}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "reader", "labels": {"cachewarm.dev/cache": "ident"}},
           "spec": {"restartPolicy": "Never", "serviceAccountName": "trainer", "containers": [{
               "name": "train", "image": "demo/train:1", "command": ["python", "train.py", "--steps", "1"]}]}}
    created = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(pod))
    assert created.returncode == 0, created.stderr
    stored = bed.get_json("pod", "reader", namespace) or {}
    assert stored["spec"]["serviceAccountName"] == "trainer"
    assert "cachewarm.dev/injected" in stored["metadata"]["annotations"]


@pytest.mark.parametrize(("target", "error"), [
    ("warm_targets:broken_targets", "TypeError"),
    ("warm_targets:no_targets", "produced nothing to compile"),
])
def test_warmer_that_compiles_nothing_or_fails_leaves_warmed_false(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, target: str, error: str,
) -> None:
    """The session's operator retries a failed warmer once (CACHEWARM_WARM_RETRIES=1, after
    1 s): the same Job runs again, then the pool stays Failed, and says so."""
    controller_manager.apply(warm_cache("bad", f"bad-{uuid.uuid4().hex[:8]}",
                                        {"targets": [target], "image": "test/targets:1"}), namespace)

    def given_up() -> dict[str, Any] | None:
        obj = controller_manager.get_json("ccache", "bad", namespace) or {}
        pools = ((obj.get("status") or {}).get("warmup") or {}).get("pools") or []
        return obj if pools and pools[0].get("state") == "Failed" and pools[0].get("attempt") == 2 else None
    obj = eventually(given_up, timeout=180, what="the failed warmer retried once, then left Failed")
    warmed = conditions(obj)["Warmed"]
    assert warmed["reason"] == "WarmupFailed" and warmed["status"] == "False"
    assert error in warmed["message"]
    [pool] = obj["status"]["warmup"]["pools"]
    assert error in pool["lastError"] and "no retry is left" in pool["message"] and "nextRetryTime" not in pool
    reasons = [e["reason"] for e in controller_manager.events_for("bad", namespace)]
    assert reasons.count("WarmerRetried") == 1 and reasons.count("WarmerCreated") == 2
    assert reasons.count("WarmerFailed") >= 1
    # Both attempts are runs that failed, each counted once.
    runs = {"namespace": namespace, "cache": "bad", "pool": "cpu"}
    assert scrape(operator.metrics_url, "cachewarm_warmer_runs_total", **runs, outcome="Failed") == 2
    assert scrape(operator.metrics_url, "cachewarm_warmer_runs_total", **runs, outcome="Succeeded") == 0


def test_a_warmer_in_an_image_without_the_gcs_libraries_fails_and_says_so(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """demo/Dockerfile's stage `plain` installs jax alone. Its warmer cannot reach a gs://
    cache (JAX would only warn and cache nothing): the warm fails, and the cache says what
    the image lacks rather than blaming the write thresholds."""
    bed = controller_manager
    bed.apply(warm_cache("plain", f"plain-{uuid.uuid4().hex[:8]}",
                         {"targets": ["train:targets"], "image": "cachewarm/demo-train-plain:0.1.0"}), namespace)

    def given_up() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", "plain", namespace) or {}
        pools = ((obj.get("status") or {}).get("warmup") or {}).get("pools") or []
        return obj if pools and pools[0].get("state") == "Failed" and pools[0].get("attempt") == 2 else None
    obj = eventually(given_up, timeout=180, what="the plain image's warmer failed, retried once, and left Failed")
    warmed = conditions(obj)["Warmed"]
    assert (warmed["status"], warmed["reason"]) == ("False", "WarmupFailed")
    lacking = "which this image cannot use: it lacks etils[epath] and gcsfs"
    assert lacking in warmed["message"]
    [pool] = obj["status"]["warmup"]["pools"]
    assert lacking in pool["lastError"] and pool.get("entriesWritten", 0) == 0


def test_image_change_rewarms_and_same_spec_does_not(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bucket = f"rw-{uuid.uuid4().hex[:8]}"
    spec = warm_cache("rw", bucket, {"targets": ["train:targets"]})
    controller_manager.apply(spec, namespace)
    first = wait_warmed(controller_manager, namespace, "rw")["status"]["warmup"]["pools"][0]["job"]

    controller_manager.apply(spec, namespace)  # the same spec again
    assert [j["metadata"]["name"] for j in jobs(controller_manager, namespace, "rw")] == [first]

    spec["spec"]["warmup"]["image"] = "demo/train:2"
    controller_manager.apply(spec, namespace)

    def rewarmed() -> str | None:
        obj = controller_manager.get_json("ccache", "rw", namespace)
        pool = ((obj or {}).get("status", {}).get("warmup") or {}).get("pools", [{}])[0]
        return pool["job"] if pool.get("job") != first and pool.get("state") == "Succeeded" else None
    second = eventually(rewarmed, timeout=180, what="a second warm for the new image")
    assert sorted(j["metadata"]["name"] for j in jobs(controller_manager, namespace, "rw")) == sorted([first, second])
    obj = wait_warmed(controller_manager, namespace, "rw")
    # The same program in a new image (demo/Dockerfile built again: a folder of its own on
    # the node agent, test_node_agent shows) is found in the cache: nothing new written.
    [pod] = json.loads(controller_manager.kubectl_run("get", "pods", "-n", namespace, "-l", f"job-name={second}",
                                                      "-o", "json").stdout)["items"]
    assert pod["spec"]["containers"][0]["image"] == "demo/train:2" and pod["status"]["phase"] == "Succeeded"
    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["entriesFound"] >= 1 and pool["entriesWritten"] == 0, pool

    annotated = controller_manager.kubectl_run("annotate", "ccache", "rw", "-n", namespace, "cachewarm.dev/rewarm=1")
    assert annotated.returncode == 0, annotated.stderr
    eventually(lambda: len(jobs(controller_manager, namespace, "rw")) == 3, timeout=60, what="manual re-warm Job")


def test_operator_killed_mid_warm_leaves_one_job_per_pool(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    controller_manager.apply(warm_cache("crash", f"crash-{uuid.uuid4().hex[:8]}", {
        "targets": ["train:targets"], "pools": [{"name": "a"}, {"name": "b"}]}), namespace)
    eventually(lambda: len(jobs(controller_manager, namespace, "crash")) == 2, timeout=60, what="two warmer Jobs")
    operator.restart()
    obj = wait_warmed(controller_manager, namespace, "crash")
    names = sorted(j["metadata"]["name"] for j in jobs(controller_manager, namespace, "crash"))
    assert len(names) == 2
    assert sorted(p["job"] for p in obj["status"]["warmup"]["pools"]) == names


# What a forged warmer summary claims: every field it could put in status, each larger
# than a real warm's (so the summaries' max() would pick it), written as a pod's
# termination message.
BIG = 10**12
FORGERY = {"processIndex": 0, "entriesFound": 0, "entriesWritten": BIG, "bytesWritten": BIG, "compileSeconds": BIG,
           "keys": ["f" * 16], "keyCount": 1, "imagePythonPath": "/forged",
           "manifestGeneration": "666", "fingerprint": {"platform": "forged"}, "errors": []}
WRITE_FORGERY = f"open('/dev/termination-log', 'w').write({json.dumps(FORGERY)!r})"


def warmer_job_name(bed: Testbed, namespace: str, body: dict[str, Any]) -> str:
    """The name the warmer Job of `body`'s first pool will have: the builders'
    deterministic one, from the spec as the apiserver defaults it (a server dry-run)."""
    dry = bed.kubectl_run("create", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
                          input=yaml.safe_dump(body))
    assert dry.returncode == 0, dry.stderr
    cache = parse_spec(json.loads(dry.stdout)["spec"])
    assert cache.warmup is not None
    return job_name(body["metadata"]["name"], cache.warmup.pools[0], spec_hash(cache, cache.warmup.pools[0], ""))


def test_a_pod_the_warmer_job_did_not_create_cannot_forge_its_results(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """Anyone who may create pods in the namespace may label one job-name=<warmer Job> and
    have it end with any termination message. Made before the cache (the Job's name is
    the builders' deterministic one, computed from the spec as the apiserver defaults it),
    so the operator lists it beside the Job's own pod when it reads the warm's results:
    none of its fields reach status (they are larger than the real warm's, so the
    summaries' max() would pick them), and one Warning names it."""
    bed = controller_manager
    body = warm_cache("forged", f"forged-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"]})
    job = warmer_job_name(bed, namespace, body)
    forger = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "forger", "labels": {"job-name": job}},
              "spec": {"restartPolicy": "Never", "containers": [{
                  "name": "warm", "image": "demo/train:1", "command": ["python", "-c", WRITE_FORGERY]}]}}
    created = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(forger))
    assert created.returncode == 0, created.stderr
    eventually(lambda: ((bed.get_json("pod", "forger", namespace) or {}).get("status") or {}).get("phase")
               == "Succeeded", timeout=120, what="the forged pod finished")
    bed.apply(body, namespace)
    obj = wait_warmed(bed, namespace, "forged")
    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["job"] == job  # the forged pod was listed with the Job's own
    assert pool["entriesWritten"] < BIG and pool["bytesWritten"] < BIG and pool["compileSeconds"] < BIG
    assert "f" * 16 not in pool["keys"] and pool["fingerprint"]["platform"] == "cpu"
    assert pool.get("imagePythonPath", {}).get("value") != "/forged" and pool.get("manifestGeneration") != "666"
    ignored = [e for e in bed.events_for("forged", namespace) if e["reason"] == "WarmerPodIgnored"]
    assert len(ignored) == 1 and ignored[0]["type"] == "Warning" and "forger" in ignored[0]["message"]


def test_a_job_the_cache_does_not_control_is_stopped_and_never_read(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, tmp_path: Path,
) -> None:
    """The warmer Job's name is deterministic, and anyone who may create Jobs in the
    namespace can make one of it before the operator does, with the warmer's labels, a
    generation annotation far ahead, and a pod (the Job's own, so the pod check passes) that
    ends with forged results. Claiming the cache as the Job's controller is refused by the
    apiserver (manifests/policy/warmer_jobs.yaml), at create and at a later patch, even to the
    testbed's admin. The ownerless Job is then made and runs to completion; once the cache
    exists, the operator does not read it: it stops it (one Warning WarmerJobNotOurs), makes
    its own Job of that name (the cache its controller), and status holds the real warm."""
    bed = controller_manager
    body = warm_cache("squat", f"squat-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"]})
    name = warmer_job_name(bed, namespace, body)
    squatter: dict[str, Any] = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": {"cachewarm.dev/warmer-for": "squat", "cachewarm.dev/pool": "cpu"},
                     "annotations": {"cachewarm.dev/generation": "999"},
                     "ownerReferences": [{"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                                          "name": "squat", "uid": str(uuid.uuid4()), "controller": True}]},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
            {"name": "warm", "image": "demo/train:1", "command": ["python", "-c", WRITE_FORGERY],
             "env": [{"name": "CACHEWARM_MANIFEST", "value": f"gs://{body['spec']['storage']['gcs']['bucket']}/x"}]}]}}}}
    claimed = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(squatter))
    assert claimed.returncode != 0 and "names a CompilationCache as its controller" in claimed.stderr, claimed.stderr
    assert bed.get_json("job", name, namespace) is None
    cache_ref = squatter["metadata"].pop("ownerReferences")
    made = bed.kubectl_run("create", "-n", namespace, "-o", "json", "-f", "-", input=yaml.safe_dump(squatter))
    assert made.returncode == 0, made.stderr
    squatter_uid = json.loads(made.stdout)["metadata"]["uid"]
    patched = bed.kubectl_run("patch", "job", name, "-n", namespace, "--type=merge",
                              "-p", json.dumps({"metadata": {"ownerReferences": cache_ref}}))
    assert patched.returncode != 0 and "names a CompilationCache as its controller" in patched.stderr, patched.stderr
    eventually(lambda: any(c.get("type") == "Complete" and c.get("status") == "True" for c in
                           ((bed.get_json("job", name, namespace) or {}).get("status") or {}).get("conditions") or []),
               timeout=120, what="the squatting Job completed with its forged results")

    bed.apply(body, namespace)
    obj = wait_warmed(bed, namespace, "squat")
    [job] = jobs(bed, namespace, "squat")
    meta = job["metadata"]
    assert meta["name"] == name and meta["uid"] != squatter_uid
    [controller] = [r for r in meta["ownerReferences"] if r.get("controller")]
    assert (controller["kind"], controller["uid"]) == ("CompilationCache", obj["metadata"]["uid"])
    [pool] = obj["status"]["warmup"]["pools"]
    assert pool["job"] == name and pool["state"] == "Succeeded" and pool["jobUid"] == meta["uid"]
    assert pool["entriesWritten"] < BIG and pool["bytesWritten"] < BIG and pool["compileSeconds"] < BIG
    assert "f" * 16 not in pool["keys"] and pool["fingerprint"]["platform"] == "cpu"
    assert pool.get("imagePythonPath", {}).get("value") != "/forged" and pool.get("manifestGeneration") != "666"
    stopped = [e for e in bed.events_for("squat", namespace) if e["reason"] == "WarmerJobNotOurs"]
    assert len(stopped) == 1 and stopped[0]["type"] == "Warning" and name in stopped[0]["message"], stopped
    assert stopped[0].get("count", 1) == 1 and stopped[0]["involvedObject"]["uid"] == obj["metadata"]["uid"]

    # The cache's own Job is changed by no one but the operator (a generation far ahead would
    # stall its warms), nor through its status subresource (which resets only the spec).
    annotated = bed.kubectl_run("annotate", "job", name, "-n", namespace, "--overwrite", "cachewarm.dev/generation=999")
    assert annotated.returncode != 0 and "only the cachewarm operator changes it" in annotated.stderr, annotated.stderr
    relabelled = bed.kubectl_run("patch", "job", name, "-n", namespace, "--subresource=status", "--type=merge",
                                 "-p", json.dumps({"metadata": {"labels": {"cachewarm.dev/pool": "other"}}}))
    assert relabelled.returncode != 0 and "only the cachewarm operator changes it" in relabelled.stderr, \
        relabelled.stderr
    assert (bed.get_json("job", name, namespace) or {})["metadata"]["annotations"]["cachewarm.dev/generation"] != "999"
    # A controller of another kind holding the cache's uid is let through, and cannot then
    # be turned into the cache by an update.
    decoy = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "decoy", "ownerReferences": [
        {"apiVersion": "decoy.example/v1", "kind": "Decoy", "name": "squat", "uid": obj["metadata"]["uid"],
         "controller": True}]}, "spec": {"suspend": True, "template": squatter["spec"]["template"]}}
    made = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(decoy))
    assert made.returncode == 0, made.stderr
    turned = bed.kubectl_run("patch", "job", "decoy", "-n", namespace, "--type=json", "-p", json.dumps([
        {"op": "replace", "path": "/metadata/ownerReferences/0/apiVersion", "value": "cachewarm.dev/v1alpha1"},
        {"op": "replace", "path": "/metadata/ownerReferences/0/kind", "value": "CompilationCache"}]))
    assert turned.returncode != 0 and "names a CompilationCache as its controller" in turned.stderr, turned.stderr

    # Where the policy is not installed (here: the operator's own identity, which it spares),
    # the cache's Job deleted and made again under its name with the cache as controller is
    # still not read: its uid is not the one status pinned. It is stopped; the warm stays.
    as_operator = bed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator", tmp_path / "operator")
    gone = bed.kubectl_run("delete", "job", name, "-n", namespace, "--wait=true")
    assert gone.returncode == 0, gone.stderr
    impostor = {**squatter, "metadata": {**squatter["metadata"], "labels": {**squatter["metadata"]["labels"],
                                                                              "app.kubernetes.io/managed-by": "cachewarm"},
                                         "ownerReferences": [{**cache_ref[0], "uid": obj["metadata"]["uid"]}]}}
    made = bed.kubectl_run("create", "-n", namespace, "-o", "json", "-f", "-", input=yaml.safe_dump(impostor),
                           kubeconfig=as_operator)
    assert made.returncode == 0, made.stderr
    impostor_uid = json.loads(made.stdout)["metadata"]["uid"]
    eventually(lambda: (bed.get_json("job", name, namespace) or {"metadata": {}})["metadata"].get("uid") != impostor_uid,
               timeout=60, what="the impostor Job stopped")
    after = bed.get_json("ccache", "squat", namespace)
    assert after is not None
    [kept] = after["status"]["warmup"]["pools"]
    assert kept["jobUid"] == meta["uid"] and kept["state"] == "Succeeded" and "f" * 16 not in kept["keys"]
    assert kept.get("manifestGeneration") != "666" and conditions(after)["Warmed"]["status"] == "True"


def test_a_job_of_the_warmers_name_without_its_label_is_named_not_deleted(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """A Job of the warmer's name made without the warmer label is not listed as the cache's:
    the operator's create finds it, and since it is not cachewarm's to delete, the pool's
    message and one Warning say so; deleted by its owner, the warmer runs."""
    bed = controller_manager
    body = warm_cache("held", f"held-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"]})
    name = warmer_job_name(bed, namespace, body)
    holder = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
              "spec": {"suspend": True, "template": {"spec": {"restartPolicy": "Never", "containers": [
                  {"name": "x", "image": "demo/train:1", "command": ["true"]}]}}}}
    made = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(holder))
    assert made.returncode == 0, made.stderr
    bed.apply(body, namespace)

    def held() -> dict[str, Any] | None:
        pools = (((bed.get_json("ccache", "held", namespace) or {}).get("status") or {}).get("warmup") or {}).get("pools")
        return pools[0] if pools and "this cache is not its controller" in pools[0].get("message", "") else None
    pool = eventually(held, timeout=60, what="the pool naming the Job that holds its name")
    assert pool["job"] == name and pool["state"] == "Pending" and f"Job {name} exists" in pool["message"]
    assert bed.get_json("job", name, namespace) is not None  # not the operator's to delete
    said = [e for e in bed.events_for("held", namespace) if e["reason"] == "WarmerJobNotOurs"]
    assert len(said) == 1 and said[0]["type"] == "Warning", said
    gone = bed.kubectl_run("delete", "job", name, "-n", namespace, "--wait=true")
    assert gone.returncode == 0, gone.stderr
    wait_warmed(bed, namespace, "held")


def test_the_apiserver_refuses_a_pod_that_claims_a_warmer_job_as_its_controller(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    """The operator's owner check (above) reads the pod's controller ownerReference; the
    Job's uid is readable by anyone who may read Jobs, so a pod creator could claim it.
    manifests/policy/warmer_pods.yaml lets only the Job controller make or change a pod
    labelled job-name whose controller is a Job. Tried as the testbed's admin (cluster-admin,
    more than any tenant): a create naming the Job as controller, a later patch adding it to
    a plain job-name pod, and the label added to a pod made with the Job as controller but
    without it, are each refused with the policy's message; the Job's own pod (the Job
    controller's, as its own ServiceAccount) still warms the cache."""
    bed = controller_manager
    bed.apply(warm_cache("claimed", f"claimed-{uuid.uuid4().hex[:8]}", {"targets": ["train:targets"]}), namespace)
    [job] = eventually(lambda: jobs(bed, namespace, "claimed"), timeout=60, what="the warmer Job")
    name = job["metadata"]["name"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"], "controller": True}
    forger: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": "claimer", "labels": {"job-name": name}, "ownerReferences": [owner]},
                              "spec": {"restartPolicy": "Never", "containers": [
                                  {"name": "warm", "image": "demo/train:1", "command": ["true"]}]}}
    created = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(forger))
    assert created.returncode != 0 and "only the Job controller" in created.stderr, created.stderr
    assert bed.get_json("pod", "claimer", namespace) is None
    del forger["metadata"]["ownerReferences"]
    plain = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(forger))
    assert plain.returncode == 0, plain.stderr  # no Job as controller: the operator's check is the layer
    patched = bed.kubectl_run("patch", "pod", "claimer", "-n", namespace, "--type=merge",
                              "-p", json.dumps({"metadata": {"ownerReferences": [owner]}}))
    assert patched.returncode != 0 and "only the Job controller" in patched.stderr, patched.stderr
    assert not ((bed.get_json("pod", "claimer", namespace) or {})["metadata"].get("ownerReferences"))
    # Without the label the policy does not look (the operator lists warmers by it): the
    # Job's uid as controller is let through, and the label then refused. The reference
    # names no Job (the operator compares uids only), so the Job controller never claims
    # nor releases the pod; the garbage collector may delete it as dangling, which the
    # finalizer holds until the test lets it go.
    unlabelled = {**forger, "metadata": {"name": "claimer-2", "finalizers": ["cachewarm.dev/test-hold"],
                                         "ownerReferences": [{**owner, "name": f"not-{name}"}]}}
    made = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(unlabelled))
    assert made.returncode == 0, made.stderr
    labelled = bed.kubectl_run("label", "pod", "claimer-2", "-n", namespace, f"job-name={name}")
    assert labelled.returncode != 0 and "only the Job controller" in labelled.stderr, labelled.stderr
    kept = (bed.get_json("pod", "claimer-2", namespace) or {})["metadata"]
    assert "job-name" not in (kept.get("labels") or {}) and kept["ownerReferences"][0]["uid"] == owner["uid"]
    # The labels a Job's selector matches: the Job controller would adopt such an orphan pod
    # and make it the Job's own.
    for label in ("batch.kubernetes.io/controller-uid", "controller-uid"):
        adoptable = {**forger, "metadata": {"name": "adoptable", "labels": {"job-name": name,
                                                                            label: job["metadata"]["uid"]}}}
        refused = bed.kubectl_run("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(adoptable))
        assert refused.returncode != 0 and "controller-uid label" in refused.stderr, (label, refused.stderr)
        added = bed.kubectl_run("label", "pod", "claimer", "-n", namespace, f"{label}={job['metadata']['uid']}")
        assert added.returncode != 0 and "controller-uid label" in added.stderr, (label, added.stderr)
    let_go = bed.kubectl_run("patch", "pod", "claimer-2", "-n", namespace, "--type=merge",
                             "-p", json.dumps({"metadata": {"finalizers": None}}))
    assert let_go.returncode == 0, let_go.stderr
    wait_warmed(bed, namespace, "claimed")


def wait_ready(bed: Testbed, ns: str, name: str) -> None:
    eventually(lambda: conditions(bed.get_json("ccache", name, ns)).get("Ready", {}).get("status") == "True",
               what=f"{ns}/{name} Ready")


def create_labelled_pod(bed: Testbed, ns: str, name: str, cache: str) -> dict[str, Any]:
    """Create a pod opted in to `cache` (an image no node has: it is only ever held or
    scheduled, never run); returns its manifest."""
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
                "spec": {"containers": [{"name": "train", "image": "python:3.11", "command": ["true"]}]}}
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(manifest))
    assert created.returncode == 0, created.stderr
    return manifest


def create_gated_setup(bed: Testbed, ns: str, cache: str, target: str, timeout: int, pod: str,
                       release: Path | None = None) -> dict[str, Any]:
    """A cache with waitForWarm and the given warmup target, Ready, and a labelled pod
    created right after; returns the pod manifest for reuse. `release`: the file that lets
    warm_targets:held_targets compile (its warmers wait while it does not exist)."""
    warmup: dict[str, Any] = {"targets": [target], "image": "test/targets:1"}
    if release is not None:
        warmup["env"] = [{"name": "WARM_RELEASE_FILE", "value": str(release)}]
    bed.apply(warm_cache(cache, f"{cache}-{uuid.uuid4().hex[:8]}", warmup,
                         injection={"waitForWarm": {"enabled": True, "timeoutSeconds": timeout}}), ns)
    wait_ready(bed, ns, cache)
    return create_labelled_pod(bed, ns, pod, cache)


def gates(bed: Testbed, ns: str, pod: str) -> list[str]:
    return [g["name"] for g in ((bed.get_json("pod", pod, ns) or {}).get("spec") or {}).get("schedulingGates", [])]


def test_wait_for_warm_holds_pods_until_the_cache_is_warm(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, tmp_path: Path,
) -> None:
    """The warm is held (its target waits for a file) until the pod has been seen held, so
    the pod is created while the cache cannot be warm, whatever the machine's speed."""
    bed = controller_manager
    release = tmp_path / "release"
    create_gated_setup(bed, namespace, "gated", "warm_targets:held_targets", 600, "waiter", release)
    assert gates(bed, namespace, "waiter") == ["cachewarm.dev/wait-for-warm"]
    assert conditions(bed.get_json("ccache", "gated", namespace))["Warmed"]["status"] == "False"
    release.touch()
    wait_warmed(bed, namespace, "gated")
    eventually(lambda: gates(bed, namespace, "waiter") == [], timeout=30, what="gate removed once Warmed")
    eventually(lambda: any(e["reason"] == "PodReleased" and "the cache is warm" in e["message"]
                           for e in bed.events_for("gated", namespace)), timeout=20, what="PodReleased event")
    # A pod created after the cache is warm is not held at all.
    create_labelled_pod(bed, namespace, "late", "gated")
    assert gates(bed, namespace, "late") == []


def test_wait_for_warm_gives_up_after_its_timeout(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    create_gated_setup(bed, namespace, "slow", "warm_targets:stuck_targets", 4, "patient")
    assert gates(bed, namespace, "patient") == ["cachewarm.dev/wait-for-warm"]
    operator.restart()  # the gate is released by whichever operator runs when the time is up
    eventually(lambda: gates(bed, namespace, "patient") == [], timeout=30, what="gate removed after the timeout")
    assert conditions(bed.get_json("ccache", "slow", namespace))["Warmed"]["status"] == "False"
    assert any(e["reason"] == "PodReleased" and "waited 4s" in e["message"] for e in bed.events_for("slow", namespace))
    bed.kubectl_run("delete", "ccache", "slow", "-n", namespace, "--wait=false")


def test_a_changed_program_stops_the_running_warmer_before_starting_the_new_one(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    spec = warm_cache("swap", f"swap-{uuid.uuid4().hex[:8]}",
                      {"targets": ["warm_targets:stuck_targets"], "image": "test/targets:1"})
    bed.apply(spec, namespace)

    def running() -> str | None:
        pools = ((bed.get_json("ccache", "swap", namespace) or {}).get("status", {}).get("warmup") or {}).get("pools")
        return pools[0]["job"] if pools and pools[0]["state"] == "Running" else None
    stuck = eventually(running, timeout=60, what="the first warmer running")
    spec["spec"]["warmup"]["targets"] = ["warm_targets:slow_targets"]
    bed.apply(spec, namespace)
    obj = wait_warmed(bed, namespace, "swap")
    names = [j["metadata"]["name"] for j in jobs(bed, namespace, "swap")]
    assert stuck not in names
    assert names == [obj["status"]["warmup"]["pools"][0]["job"]]
    assert any(e["reason"] == "WarmerStopped" and stuck in e["message"] for e in bed.events_for("swap", namespace))


def released(bed: Testbed, ns: str, cache: str, pod: str, why: str) -> None:
    eventually(lambda: gates(bed, ns, pod) == [], timeout=30, what=f"gate of {pod} removed")
    eventually(lambda: any(e["reason"] == "PodReleased" and f"Released pod {pod}: {why}" in e["message"]
                           for e in bed.events_for(cache, ns)), timeout=20, what=f"PodReleased ({why})")


def test_wait_for_warm_turned_off_releases_held_pods(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    create_gated_setup(bed, namespace, "unwait", "warm_targets:stuck_targets", 600, "held")
    assert gates(bed, namespace, "held") == ["cachewarm.dev/wait-for-warm"]
    patched = bed.kubectl_run("patch", "ccache", "unwait", "-n", namespace, "--type", "merge",
                              "-p", '{"spec": {"injection": {"waitForWarm": {"enabled": false}}}}')
    assert patched.returncode == 0, patched.stderr
    released(bed, namespace, "unwait", "held", "the cache no longer waits for warm")
    bed.kubectl_run("delete", "ccache", "unwait", "-n", namespace, "--wait=false")


def test_deleting_the_cache_releases_held_pods(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    create_gated_setup(bed, namespace, "gone", "warm_targets:stuck_targets", 600, "orphan")
    assert gates(bed, namespace, "orphan") == ["cachewarm.dev/wait-for-warm"]
    # deletionPolicy Retain: the cache has no finalizer and is gone at once.
    assert bed.kubectl_run("delete", "ccache", "gone", "-n", namespace).returncode == 0
    released(bed, namespace, "gone", "orphan", "the cache was deleted")


def test_a_cache_deleted_while_the_operator_is_down_releases_held_pods_at_its_start(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    create_gated_setup(bed, namespace, "missed", "warm_targets:stuck_targets", 600, "stranded")
    assert gates(bed, namespace, "stranded") == ["cachewarm.dev/wait-for-warm"]
    os.kill(operator.pid, signal.SIGKILL)  # no operator sees the cache's DELETED event
    assert bed.kubectl_run("delete", "ccache", "missed", "-n", namespace).returncode == 0
    assert gates(bed, namespace, "stranded") == ["cachewarm.dev/wait-for-warm"]
    operator.restart()
    eventually(lambda: gates(bed, namespace, "stranded") == [], timeout=30, what="gate removed at the operator's start")
    pod_events = json.loads(bed.kubectl_run("get", "events", "-n", namespace, "-o", "json",
                                            "--field-selector", "involvedObject.name=stranded").stdout)["items"]
    assert any(e["reason"] == "PodReleased" and "its CompilationCache missed does not exist" in e["message"]
               for e in pod_events)


def test_a_pod_created_while_a_warmed_cache_rewarms_is_not_held(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, tmp_path: Path,
) -> None:
    """The re-warm is held (its target waits for a file the test creates only afterwards),
    so the cache is Rewarming from before the pod's creation until after it: the status
    read before and after shows the same Rewarming condition and the re-warm's Job still
    running. The gate is decided at admission (schedulingGates can only be removed later)."""
    bed = controller_manager
    release = tmp_path / "release"
    release.touch()  # the first warm runs through
    create_gated_setup(bed, namespace, "again", "warm_targets:held_targets", 600, "first", release)
    first_job = wait_warmed(bed, namespace, "again", timeout=120)["status"]["warmup"]["pools"][0]["job"]
    release.unlink()  # hold the re-warm
    annotated = bed.kubectl_run("annotate", "ccache", "again", "-n", namespace, "cachewarm.dev/rewarm=1")
    assert annotated.returncode == 0, annotated.stderr

    def rewarming() -> tuple[dict[str, Any], str] | None:
        obj = bed.get_json("ccache", "again", namespace)
        warmed = conditions(obj).get("Warmed") or {}
        pool = (((obj or {}).get("status") or {}).get("warmup") or {}).get("pools", [{}])[0]
        held = pool.get("job") != first_job and pool.get("state") == "Running"
        return (warmed, pool["job"]) if warmed.get("reason") == "Rewarming" and held else None
    before, job = eventually(rewarming, timeout=60, what="Warmed True, reason Rewarming, the re-warm Job running")
    assert before["status"] == "True" and "Re-warming: cpu" in before["message"]
    create_labelled_pod(bed, namespace, "during", "again")
    assert gates(bed, namespace, "during") == []
    after = rewarming()
    assert after is not None and after == (before, job), (before, after)
    [running] = [j for j in jobs(bed, namespace, "again") if j["metadata"]["name"] == job]
    assert not (running.get("status") or {}).get("conditions"), running.get("status")  # neither Complete nor Failed
    release.touch()
    wait_warmed(bed, namespace, "again", timeout=120)


def test_a_refused_cache_holds_no_pod(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    bucket = f"taken-{uuid.uuid4().hex[:8]}"
    # Created in one second, the older claim is the one whose name sorts first.
    bed.apply(warm_cache("first", bucket, {"targets": ["warm_targets:stuck_targets"], "image": "test/targets:1"}),
              namespace)
    wait_ready(bed, namespace, "first")
    bed.apply(warm_cache("second", bucket, {"targets": ["warm_targets:stuck_targets"], "image": "test/targets:1"},
                         injection={"waitForWarm": {"enabled": True, "timeoutSeconds": 600}}), namespace)
    eventually(lambda: conditions(bed.get_json("ccache", "second", namespace)).get("BucketReady", {}).get("reason")
               == "PrefixInUse", timeout=30, what="the second cache refused")
    create_labelled_pod(bed, namespace, "reader", "second")
    assert gates(bed, namespace, "reader") == []
    for name in ("second", "first"):
        bed.kubectl_run("delete", "ccache", name, "-n", namespace, "--wait=false")
