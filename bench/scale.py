"""Scale and cost: N CompilationCaches (each its own bucket) created at once, on the local
control plane and the GCS emulator, for this tree's operator ("after") and, in the same run,
the operator of a baseline git revision ("before"), in interleaved rounds: A B, B A, A B,
... each side on a fresh testbed (etcd, kube-apiserver, emulator and proxy started anew),
with its own revision's manifests/ installed. A before/after ratio is then paired within a
round and the machine's drift over the run hits both sides alike.

Measures, per side and round
  - time from the first create until every cache is Ready with observedGeneration current
    (a watch, so nothing polls the apiserver), and how long the creates themselves took;
  - the operator's memory: peak RSS (VmHWM) and RSS at the end;
  - GCS calls (counted by the testbed's GCS proxy) and Kubernetes API calls (the
    apiserver's apiserver_request_total; only the operator talks to it then) during the
    creation, then per cache per resync over `--resyncs` resync periods of steady state;
  - with --entries K: one more cache holding K entries, and its own GCS calls per resync
    (how the inventory's cost grows with a cache's size).
Then, for the headline figures, the per-round ratio after/before and the ratios' median,
min and max.

Run: .venv/bin/python bench/scale.py [--caches 1000] [--resync 20] [--resyncs 3]
     [--entries 10000] [--baseline 57684f0] [--rounds 2] [--json out.json]
     (after `make bin`; stops everything itself; --baseline none measures this tree only)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from kubernetes import client, config, watch

from rounds import REPO, imported_from, order, paired, unpack

from cachewarm_testbed.buckets import grant
from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm
from cachewarm_testbed.gcsproxy import ProxyControl

NS = "scale"
GROUP, VERSION, PLURAL = "cachewarm.dev", "v1alpha1", "compilationcaches"


def cache(name: str, bucket: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}}}}


def settled(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return ready and status.get("observedGeneration") == obj["metadata"].get("generation")


class ReadyWatch:
    """Counts caches that are Ready with observedGeneration current, from one watch."""

    def __init__(self, api: client.CustomObjectsApi) -> None:
        self.api = api
        self.done: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            stream = watch.Watch().stream(self.api.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
                                          timeout_seconds=30)
            try:
                for event in stream:
                    obj = event["object"]
                    if settled(obj):
                        self.done.setdefault(obj["metadata"]["name"], time.monotonic())
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - the apiserver going away at the end; else watch again
                if self.stop.is_set():
                    return


class Memory:
    """Samples the operator's RSS; VmHWM is the kernel's own peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[int] = []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def field(self, name: str) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(rf"^{name}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append(self.field("VmRSS"))


def cpu_seconds(bed: Testbed) -> dict[str, float]:
    """CPU time (user + system) each testbed process has used so far."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name, proc in bed.procs.items():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def gcs_calls(log: list[dict[str, Any]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for entry in log:
        path, method = entry["path"], entry["method"]
        if re.fullmatch(r"/storage/v1/b/[^/]+/o", path):
            kind = "objects.list"
        elif re.fullmatch(r"/storage/v1/b/[^/]+/o/.+", path):
            kind = f"objects.{ {'GET': 'get', 'PATCH': 'patch', 'DELETE': 'delete'}.get(method, method)}"
        elif re.fullmatch(r"/storage/v1/b/?", path):
            kind = "buckets.insert" if method == "POST" else "buckets.list"
        elif re.fullmatch(r"/storage/v1/b/[^/]+", path):
            kind = {"GET": "buckets.get", "PATCH": "buckets.patch", "DELETE": "buckets.delete"}.get(method, method)
        elif path.startswith("/upload/"):
            kind = "objects.insert"
        else:
            kind = f"{method} {path}"
        out[kind] += 1
    return out


def api_calls(bed: Testbed) -> Counter[str]:
    """apiserver_request_total by verb and resource (cumulative)."""
    text = bed.kubectl_run("get", "--raw", "/metrics").stdout
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if labels.get("resource") in ("leases",) and labels.get("group") == "coordination.k8s.io" \
                and labels.get("namespace") == "kube-system":
            continue  # the apiserver's own identity leases
        out[f"{labels.get('verb')} {labels.get('resource')}{'/' + labels['subresource'] if labels.get('subresource') else ''}"] \
            += int(float(line.rsplit(" ", 1)[1]))
    return out


def fill(gcs: storage.Client, bucket: str, entries: int) -> None:
    """A bucket holding `entries` JAX cache entries (tiny) under jax/, for a cache to adopt,
    each with a customTime as a warmer leaves it (so none is left to stamp)."""
    blobs = gcs.create_bucket(bucket, location="us-central1")
    now = dt.datetime.now(dt.timezone.utc)

    def put(i: int) -> None:
        blob = blobs.blob(f"jax/jit_f{i}-{i:064x}-cache")
        blob.custom_time = now
        blob.upload_from_string(b"x")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, range(entries)))
    grant(gcs, bucket, NS)  # as its owner would, for the namespace's caches (ignored by revisions before consent)


def report(result: dict[str, Any]) -> None:
    """What is measured so far, on stderr (a later failure keeps it)."""
    print(json.dumps(result), file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, tree: Path, pythonpath: str | None) -> dict[str, Any]:
    """One side of a round: a fresh testbed, `tree`'s manifests, the operator importing
    cachewarm from `pythonpath` (None: this tree's, from the venv)."""
    bed = Testbed().start()
    operator = None
    result: dict[str, Any] = {}
    try:
        applied = bed.kubectl_run("apply", "-k", str(tree / "manifests"))
        assert applied.returncode == 0, applied.stderr
        bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
        assert bed.kubectl_run("create", "namespace", NS).returncode == 0
        kubeconfig = bed.service_account_kubeconfig(
            "cachewarm-system", "cachewarm-operator", Path(tempfile.mkdtemp()) / "kubeconfig")
        operator = bed.start_operator(kubeconfig, {
            "CACHEWARM_LOG_LEVEL": "WARNING", "CACHEWARM_POD_NAMESPACE": "cachewarm-system",
            "CACHEWARM_POD_NAME": "cachewarm-bench", "CACHEWARM_GCP_PROJECT": "testbed",
            "CACHEWARM_RESYNC_SECONDS": str(args.resync),
            # Every cache makes its own bucket in one namespace (an older revision ignores this).
            "CACHEWARM_BUCKETS_PER_NAMESPACE": "10000", **({"PYTHONPATH": pythonpath} if pythonpath else {})})
        proxy = ProxyControl(bed.storage_emulator_host)
        if args.entries:
            fill_started = time.monotonic()
            fill(storage.Client(project="testbed", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": bed.storage_emulator_host}), "scale-big",
                 args.entries)
            result["fill_seconds"] = round(time.monotonic() - fill_started, 1)
        config.load_kube_config(str(bed.kubeconfig))
        ready = ReadyWatch(client.CustomObjectsApi())
        # The operator's start is not measured: one cache of its own first, Ready before the
        # clock starts (right after the CRD is installed, the apiserver may still answer its
        # first list with 429 "storage is (re)initializing", which it retries 15 s later).
        probe_started = time.monotonic()
        bed.apply(cache("probe", "scale-probe"), NS)
        eventually(lambda: "probe" in ready.done or None, timeout=120, what="the probe cache Ready")
        result["probe_ready_seconds"] = round(ready.done["probe"] - probe_started, 1)
        memory = Memory(operator.pid)
        baseline_rss = memory.field("VmRSS")
        proxy.clear_log()
        api_before = api_calls(bed)
        listing = {"apiVersion": "v1", "kind": "List",
                   "items": [cache(f"c{i:04d}", f"scale-{i:04d}") for i in range(args.caches)]}
        cpu_before = cpu_seconds(bed)
        t0 = time.monotonic()
        created = bed.kubectl_run("create", "-n", NS, "-f", "-", input=yaml.safe_dump(listing))
        assert created.returncode == 0, created.stderr[-2000:]
        t_created = time.monotonic() - t0
        eventually(lambda: len(ready.done) >= args.caches + 1 or None, timeout=args.timeout,
                   what=f"{args.caches} caches Ready")
        t_ready = max(ready.done.values()) - t0
        timed = {name: t for name, t in ready.done.items() if name != "probe"}
        cpu_after = cpu_seconds(bed)
        result["rss_peak_mb_at_all_ready"] = round(memory.field("VmHWM") / 2**20, 1)
        result["cpu_seconds_creation"] = {k: round(v - cpu_before.get(k, 0), 1) for k, v in cpu_after.items()}
        result.update({
            "create_seconds": round(t_created, 1), "all_ready_seconds": round(t_ready, 1),
            "ready_by_second": {str(s): sum(1 for t in timed.values() if t - t0 <= s)
                                for s in (10, 20, 30, 45, 60, 90, 120) if s < t_ready + 10},
            "gcs_calls_creation": dict(gcs_calls(proxy.log())),
            "api_calls_creation": dict(api_calls(bed) - api_before),
        })

        report(result)
        if args.entries:
            proxy.clear_log()
            bed.apply(cache("big", "scale-big"), NS)
            eventually(lambda: "big" in ready.done or None, timeout=300, what="the big cache Ready")
            result["big_cache_adopted_gcs_calls"] = dict(gcs_calls([e for e in proxy.log()
                                                                    if "/b/scale-big" in e["path"]]))

        # Steady state: let one resync pass settle, then count over whole resync periods.
        time.sleep(args.resync)
        proxy.clear_log()
        api_before = api_calls(bed)
        time.sleep(args.resync * args.resyncs)
        log = proxy.log()
        big = [e for e in log if "/b/scale-big" in e["path"]]
        small = [e for e in log if "/b/scale-big" not in e["path"]]
        # The probe cache is one of the small ones; Kubernetes calls are not told apart by
        # cache, so they are divided among all caches, the big one too.
        per = (args.caches + 1) * args.resyncs
        per_api = (args.caches + 1 + (1 if args.entries else 0)) * args.resyncs
        result.update({
            "gcs_calls_steady": dict(gcs_calls(small)),
            "gcs_calls_per_cache_per_resync": {k: round(v / per, 2) for k, v in gcs_calls(small).items()},
            "api_calls_per_cache_per_resync": {k: round(v / per_api, 2) for k, v in
                                               (api_calls(bed) - api_before).items()},
        })
        if args.entries:
            result["big_cache"] = {"entries": args.entries,
                                   "gcs_calls_per_resync": {k: round(v / args.resyncs, 2)
                                                            for k, v in gcs_calls(big).items()}}
        report(result)
        memory.stop.set()
        result.update({"rss_baseline_mb": round(baseline_rss / 2**20, 1),
                       "rss_peak_mb": round(memory.field("VmHWM") / 2**20, 1),
                       "rss_end_mb": round(memory.field("VmRSS") / 2**20, 1)})
        ready.stop.set()
    finally:
        if operator is not None:
            operator.stop()
        bed.stop()
    return result


# The figures compared round by round (after / before): a path into one side's result.
HEADLINE: dict[str, Callable[[dict[str, Any]], float]] = {
    "all_ready_seconds": lambda r: float(r["all_ready_seconds"]),
    "create_seconds": lambda r: float(r["create_seconds"]),
    "operator_cpu_seconds_creation": lambda r: float(r["cpu_seconds_creation"].get("operator-0", 0)),
    "cpu_seconds_creation_all": lambda r: float(sum(r["cpu_seconds_creation"].values())),
    "gcs_calls_creation": lambda r: float(sum(r["gcs_calls_creation"].values())),
    "api_calls_creation": lambda r: float(sum(r["api_calls_creation"].values())),
    "rss_peak_mb_at_all_ready": lambda r: float(r["rss_peak_mb_at_all_ready"]),
    "rss_peak_mb": lambda r: float(r["rss_peak_mb"]),
    "gcs_calls_per_cache_per_resync": lambda r: float(sum(r["gcs_calls_per_cache_per_resync"].values())),
    "api_calls_per_cache_per_resync": lambda r: float(sum(r["api_calls_per_cache_per_resync"].values())),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", type=int, default=1000)
    parser.add_argument("--resync", type=float, default=20.0, help="CACHEWARM_RESYNC_SECONDS for the steady phase")
    parser.add_argument("--resyncs", type=int, default=3, help="resync periods of steady state to count calls over")
    parser.add_argument("--entries", type=int, default=0, help="entries of one extra cache (0: none)")
    parser.add_argument("--baseline", default="57684f0",
                        help="git revision whose operator is the 'before' side ('none': this tree only)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running both sides (A B, then B A)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()

    sides: dict[str, tuple[Path, str | None]] = {"after": (REPO, None)}
    result: dict[str, Any] = {"caches": args.caches, "resync_seconds": args.resync, "resyncs": args.resyncs,
                              "entries": args.entries, "rounds": args.rounds,
                              "after": {"tree": REPO.name, "cachewarm_from": imported_from(None)}}
    tree = None
    if args.baseline != "none":
        tree, commit = unpack(args.baseline)
        sides["before"] = (tree, str(tree / "operator"))
        result["before"] = {"commit": commit, "cachewarm_from": imported_from(str(tree / "operator"))}
        assert result["before"]["cachewarm_from"].startswith(str(tree)), result["before"]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    try:
        for i in range(args.rounds):
            for side in order(i, list(sides)):
                print(f"round {i + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                runs[side].append({"round": i + 1, **measure(args, *sides[side])})
                report({side: runs[side][-1]})
    finally:
        if tree is not None:
            shutil.rmtree(tree, ignore_errors=True)
    for side, measured in runs.items():
        result[side] = {**result[side], "runs": measured,
                        "median": {name: statistics.median(get(r) for r in measured) for name, get in HEADLINE.items()}}
    if "before" in runs:
        result["paired_after_over_before"] = {
            name: paired([get(r) for r in runs["after"]], [get(r) for r in runs["before"]])
            for name, get in HEADLINE.items()}
    result["machine"] = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}, " \
                        f"{os.cpu_count()} cores"
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
