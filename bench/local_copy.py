"""Pod creation to first step done, on the real node, by where the cache is (issue 14).

Starts the control plane, the GCS emulator and a real node (kubelet + containerd), imports
the images built from our Dockerfiles, installs the operator with `kubectl apply -k
manifests/`, and warms two caches through it (one per workload):

  small  demo/programs.py: ten small programs (an MLP classifier: init with static sizes,
         a donating train step, bf16, evaluation, a static top-k), `programs:targets`
  large  demo/train.py's training step (a residual LM, its layers an unrolled scan), one
         program, made bigger (--large-layers x --large-width), `train:targets`

Then, for each workload, pods of each kind run in turn (--runs rounds, default 10; the
kinds of a round back to back, in bench/rounds.py's order: as listed in even rounds,
reversed in odd ones), each a fresh pod on the node:

  (a) none        an unlabelled pod: no persistent cache, every program compiled
  (b) gs://       labelled for a ReadOnly cache with `injection.readFrom: Bucket` (since
                  issue 30 the explicit choice): JAX reads the bucket through gcsfs (the
                  training image with gcsfs)
  (c) local copy  labelled for a ReadOnly cache that sets neither injection.localCopy nor
                  readFrom: the default read path (issue 30), a per-pod emptyDir copy of
                  LocalCopy's defaults; in process: the
                  pod sets its PYTHONPATH (/app, the image's own), so the webhook knows it
                  and adds no init container; the pod's python starts a child that copies
                  the pool's manifest entries (our sitecustomize) and waits for it when
                  its `import jax` returns, then JAX reads local disk (the plain image, no
                  GCS library). A pod of the warmup's image that sets no
                  PYTHONPATH gets the same spec (the warmers report the image's).
  (c-init)        `--with-init`: the same by init container (the pod sets no PYTHONPATH and
                  runs another image than the warmup's, so the webhook cannot know it)
  (d) local disk  an unlabelled pod whose JAX_COMPILATION_CACHE_DIR is a hostPath that
                  already holds the entries (copied there beforehand): the floor

(b), (c) and (d) have the reporter off (injection.report false), so they differ only in
where the cache is; `--with-reporter` adds (c) with the reporter on (the CRD's default).

The time is from just before the pod is created (`kubectl apply`, run here) to the
moment the program finished its first step (time.time() in the pod; the same host
clock), so it counts scheduling, every init container (the copy included), container
start, python and jax start-up (in process, whatever of the copy has not overlapped them
by the end of `import jax`), and each program compiled or loaded. The median of the
runs is reported, with the range, and for (c) the copier's own seconds; and per round the
paired ratios of each kind to (d) of the same round ((c)/(d), (b)/(d), (a)/(d), ...), their
median and min-max. Each cache's LocalCopyAsSpecified condition is checked to say the read
path meant ((b): NoLocalCopy, readFrom Bucket; (c): PerPodCopy, the default), and each pod's
admitted spec to read where its kind says. Every measured pod of (b), (c) and (d) must
have hit every program its workload asks for (cache_hits == programs, compiled == 0, in
every round), and every (a) pod compiled them all: the run stops otherwise.

Needs root and `make node-deps` (as the real-node tests).

Run: .venv/bin/python bench/local_copy.py [--runs 10] [--with-reporter] [--with-init] [--json bench-local-copy.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachewarm.api import constants
from cachewarm_testbed import images, install
from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm, repo_root

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import order, paired  # noqa: E402 - bench/rounds.py

REPO = repo_root()
NS = "bench"
GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
KINDS = ("none", "gs", "copy", "disk")
LABELS = {"none": "(a) no cache", "gs": "(b) gs:// direct", "copy": "(c) local copy, in process",
          "disk": "(d) local disk", "copy+reporter": "(c') local copy in process, reporter on",
          "copy-init": "(c-init) local copy by init container"}
RATIOS = {"copy": "(c)", "copy+reporter": "(c')", "copy-init": "(c-init)"}
SHORT = {"none": "(a)", "gs": "(b)", **RATIOS}  # the kinds paired with (d), round by round
# (not "1e9": kubectl reads that YAML scalar as a number)
READER = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1000000000", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
          "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}


def containerd_timeline(log: Path, pod: str, t0: float) -> list[dict[str, Any]]:
    """The pod's containers as containerd's log saw them, in seconds from t0 (when the pod
    was created): [{name, created, started, exited}], in the order they were created. Where
    the seconds between pod creation and the program's start go: an init container's
    `exited` to the next container's `created` is the kubelet noticing the exit (its
    relist, once a second with the generic PLEG). `exited` is when containerd's shim for
    the container went away (a few ms after the process ended)."""
    def when(line: str) -> float | None:
        m = re.match(r'time="(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z"', line)
        if m is None:
            return None
        whole = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()
        return whole + float(f"0.{m.group(2) or 0}") - t0
    lines = log.read_text(errors="replace").splitlines()
    sandbox = next((m.group(1) for line in lines if f"PodSandboxMetadata{{Name:{pod}," in line
                    for m in [re.search(r'returns sandbox id \\"([0-9a-f]+)', line)] if m), None)
    if sandbox is None:
        return []
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        t = when(line)
        m = re.search(r'ContainerMetadata\{Name:([^,]+),.*returns container id \\"([0-9a-f]+)', line)
        if m and sandbox in line and t is not None:
            out[m.group(2)] = {"name": m.group(1), "created": round(t, 3)}
            continue
        for cid, c in out.items():
            if cid in line and t is not None:
                if "StartContainer" in line and "returns successfully" in line:
                    c["started"] = round(t, 3)
                elif "shim disconnected" in line:
                    c["exited"] = round(t, 3)
    return list(out.values())


def kubelet_wait(timeline: list[dict[str, Any]]) -> float:
    """Seconds between each container's exit and the next one's creation, summed: the
    pod's start spent waiting for the kubelet to notice that an init container ended."""
    return round(sum(max(0.0, b["created"] - a["exited"]) for a, b in zip(timeline, timeline[1:]) if "exited" in a), 3)


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, bed: Testbed, large: dict[str, str]) -> None:
        self.bed = bed
        self.containerd_log: Path | None = None  # once the node runs: per-container timelines
        self.gcs_env: list[dict[str, str]] = []  # once the testbed runs (start)
        self.bucket = f"bench-{uuid.uuid4().hex[:10]}"
        self.workloads: dict[str, dict[str, Any]] = {
            "small": {"command": ["python", "-m", "programs"], "target": "programs:targets", "env": {}},
            "large": {"command": ["python", "-m", "train", "--steps", "1"], "target": "train:targets", "env": large},
        }
        self.disk = Path(f"/var/tmp/cachewarm-bench-{uuid.uuid4().hex[:8]}")
        self.last_logs = ""  # the training container's log of the last pod run
        # Programs each workload's process asks for (compile requests), from its first (a) pod:
        # every later pod must ask for as many, and (b), (c), (d) hit them all.
        self.programs: dict[str, int] = {}

    def cache(self, name: str, prefix: str, *, bucket: bool, report: bool, warm: dict[str, Any] | None) -> None:
        """A ReadOnly cache: pods read gs:// (`bucket`: readFrom Bucket, the explicit choice)
        or, setting neither localCopy nor readFrom, get the default read path (the copy)."""
        spec: dict[str, Any] = {
            "storage": {"gcs": {"bucket": self.bucket, "prefix": prefix, "location": "us-central1"}},
            "jax": {"minCompileTimeSecs": 0},
            "injection": {"mode": "ReadOnly", "report": report, **({"readFrom": "Bucket"} if bucket else {})},
        }
        if warm is not None:
            spec["warmup"] = {"image": images.TRAIN_IMAGE, "targets": [warm["target"]], "pools": [{"name": "cpu"}],
                              "env": [*self.gcs_env, *({"name": k, "value": v} for k, v in warm["env"].items())]}
        self.bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                        "metadata": {"name": name}, "spec": spec}, NS)

    def warm(self) -> None:
        for workload, w in self.workloads.items():
            self.cache(f"{workload}-copy", workload, bucket=False, report=False, warm=w)
            self.cache(f"{workload}-gs", workload, bucket=True, report=False, warm=None)
            self.cache(f"{workload}-copy-reported", workload, bucket=False, report=True, warm=None)
        for workload in self.workloads:
            def warmed(name: str = f"{workload}-copy") -> dict[str, Any] | None:
                obj = self.bed.get_json("ccache", name, NS) or {}
                conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
                if conds.get("Warmed", {}).get("reason") == "WarmupFailed":
                    raise SystemExit(f"warmup of {name} failed: {conds['Warmed']['message']}")
                return obj if conds.get("Warmed", {}).get("status") == "True" else None
            t0 = time.monotonic()
            obj = eventually(warmed, timeout=900, what=f"cache {workload}-copy Warmed")
            [pool] = obj["status"]["warmup"]["pools"]
            say(f"{workload}: warmed {pool['keyCount']} programs in {time.monotonic() - t0:.0f} s")
            self.read_path(f"{workload}-copy", copy=True)
            self.read_path(f"{workload}-gs", copy=False)
        # (d)'s floor: the same entries on the node's disk beforehand.
        client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.bed.env()["STORAGE_EMULATOR_HOST"]})
        for workload in self.workloads:
            dest = self.disk / workload
            dest.mkdir(parents=True, exist_ok=True)
            for blob in client.list_blobs(self.bucket, prefix=f"{workload}/", match_glob=f"{workload}/*-cache"):
                blob.download_to_filename(str(dest / blob.name.rsplit("/", 1)[1]))
            dest.chmod(0o755)

    def read_path(self, name: str, *, copy: bool) -> None:
        """Stop unless the cache's LocalCopyAsSpecified says its pods read where the bench
        means them to: the default copy (PerPodCopy, "the default"), or gs:// by readFrom
        Bucket (NoLocalCopy)."""
        def said() -> dict[str, Any] | None:
            obj = self.bed.get_json("ccache", name, NS) or {}
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            return conds.get("LocalCopyAsSpecified")
        cond = eventually(said, timeout=120, what=f"cache {name} LocalCopyAsSpecified")
        want = ("PerPodCopy", "the default") if copy else ("NoLocalCopy", "readFrom is Bucket")
        if cond.get("reason") != want[0] or want[1] not in cond.get("message", ""):
            raise SystemExit(f"cache {name}: LocalCopyAsSpecified is not {want}: {cond}")

    def pod(self, workload: str, kind: str, name: str) -> dict[str, Any]:
        w = self.workloads[workload]
        env = [{"name": k, "value": v} for k, v in w["env"].items()]
        container: dict[str, Any] = {"name": "train", "image": images.PLAIN_TRAIN_IMAGE, "command": w["command"],
                                     "env": env}
        spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        labels = {}
        if kind == "gs":
            container["image"] = images.TRAIN_IMAGE  # JAX reads gs:// through gcsfs
            container["env"] = [*env, *self.gcs_env]
            labels = {"cachewarm.dev/cache": f"{workload}-gs"}
        elif kind.startswith("copy"):
            container["env"] = [*env, *self.gcs_env]  # the copier reaches GCS as the pod would
            if kind != "copy-init":  # the image's own PYTHONPATH, which the webhook then knows
                container["env"].append({"name": "PYTHONPATH", "value": "/app"})
            labels = {"cachewarm.dev/cache": f"{workload}-copy" + ("-reported" if kind.endswith("reporter") else "")}
        elif kind == "disk":
            container["env"] = [*env, {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/cache"},
                                *({"name": k, "value": v} for k, v in READER.items())]
            container["volumeMounts"] = [{"name": "cache", "mountPath": "/cache", "readOnly": True}]
            spec["volumes"] = [{"name": "cache", "hostPath": {"path": str(self.disk / workload), "type": "Directory"}}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **({"labels": labels} if labels else {})},
                "spec": spec}

    def run(self, workload: str, kind: str, source: str = "manifest") -> dict[str, Any]:
        """One fresh pod of `kind` for `workload`, timed; stops the bench unless it read where
        its kind says and (b), (c), (d) hit every program, (a) compiled every one. `source`:
        what a copy must have copied from (the warmers' manifests, or a warmless cache's prefix)."""
        if kind == "copy+reporter":  # its cache (-copy-reported) has no warm-up: it copies the prefix
            source = "prefix"
        name = f"{workload}-{kind.replace('+', '-')}-{uuid.uuid4().hex[:6]}"
        obj = self.pod(workload, kind, name)
        t0 = time.time()
        self.bed.apply(obj, NS)

        def done() -> dict[str, Any] | None:
            got = self.bed.get_json("pod", name, NS) or {}
            return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
        finished = eventually(done, timeout=900, what=f"pod {name}")
        logs = self.bed.kubectl_run("logs", name, "-n", NS, "-c", "train").stdout
        self.last_logs = logs  # for bench/local_copy_gc.py
        if finished["status"]["phase"] != "Succeeded":
            raise SystemExit(f"pod {name} failed: {logs[-2000:]}")
        line = json.loads(next(x for x in reversed(logs.splitlines()) if x.startswith("{")))
        self.check(workload, kind, name, line, finished)
        out = {"seconds": round(line["done"] - t0, 3), "hits": line["cache_hits"], "compiled": line["compiled"],
               # pod created -> the program's python started: scheduling, init containers,
               # container start (what the pod's start costs before any of its own work)
               "started": round(line["started"] - t0, 3) if "started" in line else None, "pod": name}
        if kind.startswith("copy"):
            inits = [ct["name"] for ct in finished["spec"].get("initContainers") or []]
            if (kind == "copy-init") != ("cachewarm-copy" in inits):
                raise SystemExit(f"pod {name} ({kind}) got the copy {'by init container' if inits else 'in process'}")
            # The in-process copy's summary is on the training container's stderr.
            copier = self.bed.kubectl_run("logs", name, "-n", NS, "-c", "cachewarm-copy" if inits else "train").stdout
            summary = json.loads(next(x for x in copier.splitlines() if "cachewarm-copier" in x))["cachewarm-copier"]
            out.update(copySeconds=summary.get("seconds"), copied=summary.get("copied"), copyBytes=summary.get("bytes"),
                       cold=summary.get("cold"), trusted=summary.get("trusted"), present=summary.get("present"))
            # With the checks on (issue 28: pinned manifests, MD5 of every entry), a copy that
            # trusted nothing would time a cold start, not the copy: refuse to report it.
            if summary.get("cold") or not summary.get("copied") or summary.get("source") != source \
                    or (source == "manifest" and not summary.get("trusted")):
                raise SystemExit(f"pod {name} ({kind}): the copy trusted or copied nothing: {summary}")
        if self.containerd_log is not None:
            timeline = containerd_timeline(self.containerd_log, name, t0)
            out.update(containers=timeline, kubeletWait=kubelet_wait(timeline))
        self.bed.kubectl_run("delete", "pod", name, "-n", NS, "--wait=false")
        return out


    def check(self, workload: str, kind: str, name: str, line: dict[str, Any], pod: dict[str, Any]) -> None:
        """Stop the bench (loudly) unless the pod read its cache where `kind` says (its main
        container's JAX_COMPILATION_CACHE_DIR as admitted: gs:// for (b), the copy's for (c),
        none for (a)) and hit every program it asked for ((a): compiled every one)."""
        [main] = [ct for ct in pod["spec"]["containers"] if ct["name"] == "train"]
        where = next((e.get("value", "") for e in main.get("env") or [] if e["name"] == constants.ENV_CACHE_DIR), None)
        want = {"none": None, "gs": "gs://", "disk": "/cache"}.get(kind, constants.LOCAL_COPY_DIR)
        if (where is None) != (want is None) or (want is not None and not str(where).startswith(want)):
            raise SystemExit(f"pod {name} ({kind}) reads its cache at {where!r}, not {want!r}")
        programs = line.get("programs", line["cache_hits"] + line["compiled"])
        expected = self.programs.setdefault(workload, programs) if kind == "none" else self.programs.get(workload)
        hits_all = line["compiled"] == 0 and line["cache_hits"] == programs
        if not programs or programs != expected or (hits_all if kind == "none" else not hits_all) \
                or (kind == "none" and line["cache_hits"]):
            raise SystemExit(f"pod {name} ({kind}): {line['cache_hits']} hits, {line['compiled']} compiled of "
                             f"{programs} programs (the workload asks for {expected}); "
                             f"{'(a) must compile every one' if kind == 'none' else 'every program must hit'}")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    out: dict[str, Any] = {"median": round(statistics.median(seconds), 3), "min": min(seconds), "max": max(seconds),
                           "hits": runs[-1]["hits"], "compiled": runs[-1]["compiled"], "runs": runs}
    started = [r["started"] for r in runs if r.get("started") is not None]
    if started:
        out["startedMedian"] = round(statistics.median(started), 3)
    waits = [r["kubeletWait"] for r in runs if "kubeletWait" in r]
    if waits:
        out["kubeletWaitMedian"] = round(statistics.median(waits), 3)
    if "copySeconds" in runs[-1]:
        out["copySecondsMedian"] = round(statistics.median(r["copySeconds"] for r in runs), 3)
        out["copied"], out["copyBytes"] = runs[-1]["copied"], runs[-1]["copyBytes"]
    return out


def paired_to_floor(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each kind's seconds over (d)'s of the same round, per round, with median and min-max:
    {"(c)/(d)": paired(...), ...} (rounds.paired)."""
    if "disk" not in runs:
        return {}
    floor = [r["seconds"] for r in runs["disk"]]
    return {f"{SHORT[k]}/(d)": paired([r["seconds"] for r in v], floor) for k, v in runs.items() if k in SHORT}


def paired_table(pairs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Per workload and ratio: the median of the per-round ratios, min-max, and each round's."""
    lines = ["| workload | per-round ratio | median | min–max | rounds |", "|---|---|---|---|---|"]
    for workload, ratios in pairs.items():
        for name, p in ratios.items():
            lines.append(f"| {workload} | {name} | **{p['median']:.3f}×** | {p['min']:.3f}–{p['max']:.3f} | "
                         f"{', '.join(f'{r:.3f}' for r in p['ratios'])} |")
    return "\n".join(lines)


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| workload | cache | pod created → first step done, median (range) | pod created → python started "
             "| of which the kubelet noticing init containers' exits | hits / compiled | copier |",
             "|---|---|---|---|---|---|---|"]
    for workload, kinds in results.items():
        for kind, r in kinds.items():
            copier = (f"{r['copied']} entries, {r['copyBytes'] / 1e6:.1f} MB in {r['copySecondsMedian']} s"
                      if "copySecondsMedian" in r else "")
            started = f"{r['startedMedian']:.2f} s" if "startedMedian" in r else ""
            wait = f"{r['kubeletWaitMedian']:.2f} s" if "kubeletWaitMedian" in r else ""
            lines.append(f"| {workload} | {LABELS[kind]} | {r['median']:.2f} s ({r['min']:.2f}–{r['max']:.2f}) | "
                         f"{started} | {wait} | {r['hits']} / {r['compiled']} | {copier} |")
        for kind, short in RATIOS.items():
            if kind in kinds and "disk" in kinds:
                lines.append(f"| {workload} | {short} / (d) | "
                             f"**{kinds[kind]['median'] / kinds['disk']['median']:.3f}×** | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="rounds (each kind once per round)")
    parser.add_argument("--large-layers", default="12")
    parser.add_argument("--large-width", default="512")
    parser.add_argument("--with-reporter", action="store_true", help="also (c) with the reporter on")
    parser.add_argument("--with-init", action="store_true", help="also (c) by init container")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    archives = images.build_all()
    bed = Testbed()
    bench = Bench(bed, {"DEMO_LAYERS": args.large_layers, "DEMO_WIDTH": args.large_width})
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        bench.containerd_log = node.log_dir / "containerd.log"
        env = bed.env()
        install.install_operator(bed, REPO / "manifests", {**{k: env[k] for k in GCS_ENV},
                                                           "CACHEWARM_WARM_POLL_SECONDS": "1"})
        bed.kubectl_run("create", "namespace", NS)
        eventually(lambda: bed.get_json("serviceaccount", "default", NS), what="default ServiceAccount")
        bench.gcs_env = [{"name": k, "value": env[k]} for k in GCS_ENV]
        bench.warm()
        kinds = [*KINDS, *(["copy+reporter"] if args.with_reporter else []), *(["copy-init"] if args.with_init else [])]
        for workload in bench.workloads:  # unmeasured: each image's first container start on the node
            for kind in ("none", "gs"):
                bench.run(workload, kind)
        results: dict[str, dict[str, Any]] = {}
        pairs: dict[str, dict[str, dict[str, Any]]] = {}
        for workload in bench.workloads:
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for i in range(args.runs):
                for kind in order(i, kinds):  # a round's kinds back to back, reversed every other round
                    got = bench.run(workload, kind)
                    runs[kind].append(got)
                    say(f"{workload} round {i + 1} {kind}: {got}")
            results[workload] = {k: summarize(v) for k, v in runs.items()}
            pairs[workload] = paired_to_floor(runs)
            say(f"{workload} paired: {json.dumps(pairs[workload])}")
        print(table(results))
        print()
        print(paired_table(pairs))
        if args.json:
            args.json.write_text(json.dumps({"runs": args.runs, "large": bench.workloads["large"]["env"],
                                             "programs": bench.programs, "paired": pairs, "results": results},
                                            indent=1))
    finally:
        bed.stop()
        shutil.rmtree(bench.disk, ignore_errors=True)


if __name__ == "__main__":
    main()
