"""Pod creation to first step done vs the cache's size, on the real node (issue 30): how
each read path's cost grows as the cache grows.

Set-up as bench/local_copy.py (the control plane, the GCS emulator, the real node, the
operator by `kubectl apply -k manifests/`), then one cache `w` warmed through the operator
with demo/train.py's step (--layers x --width, one program): its entry is the one real
entry every measured pod needs. For each size below a prefix of the bucket holds that
entry plus filler entries (random bytes, named as JAX names entries: `jit_filler_<i>-
<sha256>-cache`, each of a distinct MD5) up to the size's count and bytes, and three
kinds of pod run, each a fresh pod of the plain or gcsfs training image, the kinds of a
round back to back (bench/rounds.py `order`):

  (b) gs://       a ReadOnly cache of that prefix with `injection.readFrom: Bucket`: JAX
                  reads its one entry through gcsfs
  (c) local copy  a ReadOnly cache of that prefix with `injection.localCopy: {}` (the
                  default copy's settings; these caches have no warm-up, and a cache
                  without one now reads the bucket by default, so they ask for the copy):
                  the copier, in process as on the default path, copies the whole prefix
                  (no manifest: every entry under the prefix, checked against the
                  listing's MD5); JAX's read of the one entry
                  the pod needs waits for that entry only, which the copier fetches first
                  when asked (sitecustomize's hook on JAX's cache read), not for the whole
                  copy, which ends in the background
  (d) local disk  an unlabelled pod whose JAX_COMPILATION_CACHE_DIR is a hostPath holding
                  the same files: the floor

A warmed cache copies what its warmers' manifests name instead of the prefix: the same
downloads, plus the manifest's metadata and body (two requests), so a warmed cache of these
sizes costs what (c) does here plus those. Every measured pod must hit its program and
compile nothing, and every (c) pod must have copied every entry: the run stops otherwise
(bench/local_copy.py's checks). The copy may end after the program's first step, so a (c)
pod's program runs under a shell that, once it exits, waits for the copier to end (its
summary, which the check reads) before it prints the program's output (pod_command): the
time measured ends at the first step, before that wait. After each pod the bench waits until the pod is deleted (its
emptyDir removed), so a 2 GB copy's removal does not overlap the next pod.

The time is bench/local_copy.py's: from just before `kubectl apply` of the pod to the
program's first step done (time.time() in the pod, same host clock). Reported per size:
median (min-max) of each kind, the per-round paired ratios (c)/(d), (b)/(d) and (b)/(c),
and the copier's own seconds and MB/s (copied bytes over the copier's time, in the pod),
and how many entries the copier fetched first because the pod asked (`onDemand`).

`--with-warmed` adds, before the sizes, the warmed cache `w` itself (its real entry only):
(c) there copies from the warmer's pinned manifest, so beside e1 it shows what a copy
from the prefix costs against one from a manifest. `--only` runs some sizes only.

Needs root and `make node-deps`. Serialize with the real-node e2e tests:

  flock /tmp/cachewarm-e2e.lock .venv/bin/python bench/start_vs_size.py [--rounds 5] [--big-rounds 3]
      [--only e1 ...] [--with-warmed] [--json F]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_copy as lc  # noqa: E402 - bench/local_copy.py: the set-up, the pods, their checks
from rounds import difference, order, paired  # noqa: E402

from cachewarm_testbed import images, install  # noqa: E402
from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm  # noqa: E402

MB = 1_000_000
# (name, entries in all, bytes in all): the real entry plus entries - 1 fillers sharing the rest.
SIZES = [("e1", 1, 0), ("e10-10mb", 10, 10 * MB), ("e100-10mb", 100, 10 * MB), ("e10-200mb", 10, 200 * MB),
         ("e100-2gb", 100, 2000 * MB)]
BIG = 1000 * MB  # sizes from this many bytes run --big-rounds rounds
KINDS = ("gs", "copy", "disk")
WARMED = "w"  # the warmed cache itself (--with-warmed): its copy from the warmer's manifest


def fillers(count: int, total: int) -> Iterator[tuple[str, bytes]]:
    """`count` entries of `total` bytes together, each its own bytes (a distinct head on one
    random block), named as JAX names entries."""
    if count <= 0:
        return
    block = os.urandom(max(8, total // count))
    for i in range(count):
        data = i.to_bytes(8, "big") + block[8:]
        yield f"jit_filler_{i:03d}-{hashlib.sha256(data).hexdigest()}-cache", data


# A (c) pod's command: the program (its output kept aside), then, once it exits, a wait for
# the copier child to end (no process left whose command line names it: the pattern's [c]
# keeps grep from matching itself), then the program's output and exit status, so that its
# report is the log's last line and the copier's summary is in the log.
WAIT_FOR_COPY = ('out="$(dirname "$CACHEWARM_COPY_SUMMARY")/bench-train.out"; "$@" > "$out"; rc=$?; '
                 'while grep -qs "cachewarm_[c]opier" /proc/[0-9]*/cmdline; do sleep 0.05; done; '
                 'cat "$out"; exit $rc')


def on_demand(logs: str) -> int:
    """The copier summary's onDemand, from a (c) pod's log (0 when none was asked for)."""
    line = next((x for x in logs.splitlines() if x.startswith('{"cachewarm-copier"')), "")
    return int(json.loads(line)["cachewarm-copier"].get("onDemand", 0)) if line else 0


class Sized(lc.Bench):
    entries: dict[str, int]  # size -> the entries its prefix holds

    def cache(self, name: str, prefix: str, *, bucket: bool, report: bool, warm: dict[str, Any] | None) -> None:
        """bench/local_copy.py's caches, but a (c) cache without warm-up asks for the copy
        (`localCopy: {}`): without warm-up the default is the bucket (no manifest to copy)."""
        if bucket or warm is not None:
            super().cache(name, prefix, bucket=bucket, report=report, warm=warm)
            return
        spec: dict[str, Any] = {
            "storage": {"gcs": {"bucket": self.bucket, "prefix": prefix, "location": "us-central1"}},
            "jax": {"minCompileTimeSecs": 0},
            "injection": {"mode": "ReadOnly", "report": report, "localCopy": {}}}
        self.bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache",
                        "metadata": {"name": name}, "spec": spec}, lc.NS)

    def read_path(self, name: str, *, copy: bool) -> None:
        """As bench/local_copy.py's, but a size's (c) cache says PerPodCopy as asked for (not
        "the default")."""
        if not copy or name == f"{WARMED}-copy":
            super().read_path(name, copy=copy)
            return

        def said() -> dict[str, Any] | None:
            obj = self.bed.get_json("ccache", name, lc.NS) or {}
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            return conds.get("LocalCopyAsSpecified")
        cond = eventually(said, timeout=120, what=f"cache {name} LocalCopyAsSpecified")
        if cond.get("reason") != "PerPodCopy":
            raise SystemExit(f"cache {name}: LocalCopyAsSpecified is not PerPodCopy: {cond}")

    def pod(self, workload: str, kind: str, name: str) -> dict[str, Any]:
        obj = super().pod(workload, kind, name)
        if kind == "copy":
            [container] = obj["spec"]["containers"]
            container["command"] = ["sh", "-c", WAIT_FOR_COPY, "sh", *container["command"]]
        return obj

    def sizes(self, client: storage.Client, real: list[tuple[str, bytes]], sizes: list[tuple[str, int, int]]) -> None:
        """For each size: its prefix filled (the real entries and the fillers), its two caches,
        and the same files on the node's disk for (d)."""
        bucket = client.bucket(self.bucket)
        self.entries = {}
        real_bytes = sum(len(d) for _, d in real)
        for name, count, total in sizes:
            dest = self.disk / name
            dest.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            written = 0
            for entry, data in itertools.chain(real, fillers(count - len(real), max(0, total - real_bytes))):
                written += len(data)
                blob = bucket.blob(f"{name}/{entry}")
                blob.chunk_size = 64 * 1024 * 1024 if len(data) > 8 * 1024 * 1024 else None
                blob.upload_from_string(data, content_type="application/octet-stream")
                (dest / entry).write_bytes(data)
            dest.chmod(0o755)
            lc.say(f"{name}: {count} entries, {written / MB:.1f} MB written in "
                   f"{time.monotonic() - t0:.0f} s")
            self.entries[name] = len(real) + max(0, count - len(real))
            self.workloads[name] = dict(self.workloads["w"])
            self.cache(f"{name}-copy", name, bucket=False, report=False, warm=None)
            self.cache(f"{name}-gs", name, bucket=True, report=False, warm=None)
        for name, _, _ in sizes:
            self.read_path(f"{name}-copy", copy=True)
            self.read_path(f"{name}-gs", copy=False)
            self.programs[name] = self.programs["w"]

    def measured(self, name: str, kind: str) -> dict[str, Any]:
        got = self.run(name, kind, source="manifest" if name == WARMED else "prefix")
        entries = self.entries[name]
        self.bed.kubectl_run("wait", "--for=delete", f"pod/{got['pod']}", "-n", lc.NS, "--timeout=300s")
        if kind == "copy" and got["copied"] != entries:
            raise SystemExit(f"pod {got['pod']} copied {got['copied']} of the {entries} entries: {got}")
        if kind == "copy":
            got["onDemand"] = on_demand(self.last_logs)
        return got


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| cache | entries | MB | rounds | (b) `gs://` direct | (c) local copy (in process) | (d) local disk (floor) "
             "| (c)/(d) paired | (b)/(d) paired | (b)/(c) paired | (c) − (d), median | copier's own time, MB/s "
             "| (c) pods with the entry fetched on ask |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        def cell(kind: str) -> str:
            s = [x["seconds"] for x in r["runs"][kind]]
            return f"{statistics.median(s):.2f} s ({min(s):.2f}–{max(s):.2f})"

        def ratio(p: dict[str, Any]) -> str:
            return f"**{p['median']:.3f}×** ({p['min']:.3f}–{p['max']:.3f})"
        copies = r["runs"]["copy"]
        over = difference([x["seconds"] for x in copies], [x["seconds"] for x in r["runs"]["disk"]], scale=1, digits=3)
        secs = statistics.median(x["copySeconds"] for x in copies)
        rate = statistics.median(x["copyBytes"] / MB / x["copySeconds"] for x in copies if x["copySeconds"])
        lines.append(f"| {name} | {r['entries']} | {r['bytes'] / MB:.1f} | {r['rounds']} | {cell('gs')} | "
                     f"{cell('copy')} | {cell('disk')} | {ratio(r['paired']['(c)/(d)'])} | "
                     f"{ratio(r['paired']['(b)/(d)'])} | {ratio(r['paired']['(b)/(c)'])} | {over['median']:.2f} s | "
                     f"{secs:.3f} s, {rate:.0f} MB/s | "
                     f"{sum(1 for x in copies if x.get('onDemand'))} of {len(copies)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size under 1 GB")
    parser.add_argument("--big-rounds", type=int, default=3, help="rounds per size from 1 GB")
    parser.add_argument("--layers", default="12")
    parser.add_argument("--width", default="512")
    parser.add_argument("--only", nargs="*", help="size names to run (default: all)")
    parser.add_argument("--with-warmed", action="store_true",
                        help=f"also the warmed cache {WARMED!r} (its real entries only), copied from its manifest")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [s for s in SIZES if not args.only or s[0] in args.only]
    exit_on_sigterm()
    archives = images.build_all()
    bed = Testbed()
    bench = Sized(bed, {"DEMO_LAYERS": args.layers, "DEMO_WIDTH": args.width})
    bench.workloads = {"w": bench.workloads["large"]}
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        bench.containerd_log = node.log_dir / "containerd.log"
        env = bed.env()
        install.install_operator(bed, lc.REPO / "manifests", {**{k: env[k] for k in lc.GCS_ENV},
                                                              "CACHEWARM_WARM_POLL_SECONDS": "1"})
        bed.kubectl_run("create", "namespace", lc.NS)
        eventually(lambda: bed.get_json("serviceaccount", "default", lc.NS), what="default ServiceAccount")
        bench.gcs_env = [{"name": k, "value": env[k]} for k in lc.GCS_ENV]
        bench.warm()
        for kind in ("none", "gs", "copy", "disk"):  # unmeasured: each image's first start; (a)'s program count
            bench.run("w", kind)
        client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": f"http://127.0.0.1:{bed.state.gcs_emulator_port}"})
        real = [(b.name.rsplit("/", 1)[1], b.download_as_bytes())
                for b in client.list_blobs(bench.bucket, prefix="w/", match_glob="w/*-cache")]
        lc.say(f"the real entries: {[(n, len(d)) for n, d in real]}")
        bench.sizes(client, real, sizes)
        if args.with_warmed:  # first: the same entries as e1, from a manifest instead of the prefix
            bench.entries[WARMED] = len(real)
            sizes.insert(0, (WARMED, len(real), sum(len(d) for _, d in real)))
        results: dict[str, dict[str, Any]] = {}
        for name, count, total in sizes:
            rounds = args.big_rounds if total >= BIG else args.rounds
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
            for i in range(rounds):
                for kind in order(i, KINDS):
                    got = bench.measured(name, kind)
                    runs[kind].append(got)
                    lc.say(f"{name} round {i + 1} {kind}: {got['seconds']} s, {got['hits']} hits / "
                           f"{got['compiled']} compiled, copy {got.get('copySeconds')} s {got.get('copyBytes')} B"
                           f"{', on demand ' + str(got['onDemand']) if 'onDemand' in got else ''}")
            secs = {k: [x["seconds"] for x in v] for k, v in runs.items()}
            results[name] = {
                "entries": bench.entries[name], "bytes": runs["copy"][-1]["copyBytes"], "rounds": rounds, "runs": runs,
                "paired": {"(c)/(d)": paired(secs["copy"], secs["disk"]), "(b)/(d)": paired(secs["gs"], secs["disk"]),
                           "(b)/(c)": paired(secs["gs"], secs["copy"])}}
            lc.say(f"{name}: {json.dumps(results[name]['paired'])}")
            if args.json:  # what is done so far, should a later size not finish
                args.json.write_text(json.dumps({"layers": args.layers, "width": args.width, "results": results},
                                                indent=1))
        print(table(results))
    finally:
        bed.stop()
        shutil.rmtree(bench.disk, ignore_errors=True)


if __name__ == "__main__":
    main()
