"""Where (c), the local copy in process, spends its time against (d), local disk, inside
the pod, phase by phase, with the garbage collector's work (issue 14). bench/local_copy.py
set up as there (control plane, GCS emulator, real node, the operator installed, the small
workload warmed), then --runs rounds of one (c) and one (d) pod of demo/programs.py,
alternated, each pod's program wrapped so that it records, with time.time() on the host's
clock: python's start (the wrapper's first line, after our sitecustomize), the end of
`import jax`, and the first step done; and gc.get_stats()'s collections per generation at
each of those points, with the seconds spent in collections (gc.callbacks) before and after
the end of `import jax`. Prints medians per phase and the full collections (generation 2)
each kind had.

Session 5 found with it that the copy run in the training process (the code before commit
3652c92) left modules and objects behind that moved a full collection (~40 ms) into the
first step, which (d) did not have; the copy now runs in a child process.

Needs root and `make node-deps` (as the real-node tests).

Run: .venv/bin/python bench/local_copy_gc.py [--runs 12] [--json bench-local-copy-gc.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_copy as lc  # noqa: E402 - bench/local_copy.py, the set-up and the pods

from cachewarm_testbed import images, install  # noqa: E402
from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm  # noqa: E402

# demo/programs.py as `python -m programs` runs it, with the probes around it; the probe's
# line goes to stderr at exit ("GC-PROBE {...}").
WRAPPED = """
import gc, json, sys, time
first, at_first = time.time(), [g["collections"] for g in gc.get_stats()]
spent = []
def _count(phase, info, _at=[0.0]):
    if phase == "start":
        _at[0] = time.perf_counter()
    else:
        spent.append((info["generation"], time.perf_counter() - _at[0]))
gc.callbacks.append(_count)
import jax
imported, at_import, before = time.time(), [g["collections"] for g in gc.get_stats()], len(spent)
def _report():
    after = spent[before:]
    print("GC-PROBE " + json.dumps({
        "first": first, "imported": imported, "collections": [at_first, at_import, [g["collections"] for g in gc.get_stats()]],
        "gcSecondsImport": sum(t for _, t in spent[:before]), "gcSecondsAfter": sum(t for _, t in after),
        "fullAfter": [round(t, 4) for g, t in after if g == 2]}), file=sys.stderr, flush=True)
import atexit
atexit.register(_report)
import runpy
runpy.run_module("programs", run_name="__main__")
"""


class Probed(lc.Bench):
    def pod(self, workload: str, kind: str, name: str) -> dict[str, Any]:
        obj = super().pod(workload, kind, name)
        obj["spec"]["containers"][0]["command"] = ["python", "-c", WRAPPED]
        return obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    archives = images.build_all()
    bed = Testbed()
    bench = Probed(bed, {})
    del bench.workloads["large"]
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        env = bed.env()
        install.install_operator(bed, lc.REPO / "manifests", {**{k: env[k] for k in lc.GCS_ENV},
                                                              "CACHEWARM_WARM_POLL_SECONDS": "1"})
        bed.kubectl_run("create", "namespace", lc.NS)
        eventually(lambda: bed.get_json("serviceaccount", "default", lc.NS), what="default ServiceAccount")
        bench.gcs_env = [{"name": k, "value": env[k]} for k in lc.GCS_ENV]
        bench.warm()
        for kind in ("none", "copy", "disk"):  # unmeasured: each image's first start on the node
            bench.run("small", kind)
        rows: dict[str, list[dict[str, Any]]] = {"copy": [], "disk": []}
        for i in range(args.runs):
            for kind in ("copy", "disk") if i % 2 == 0 else ("disk", "copy"):
                got = bench.run("small", kind)
                logs = bench.last_logs.splitlines()
                probe = json.loads(next(x for x in logs if x.startswith("GC-PROBE "))[len("GC-PROBE "):])
                done = json.loads(next(x for x in reversed(logs) if x.startswith('{"started"')))["done"]
                created = done - got["seconds"]  # just before `kubectl apply`, as local_copy.py counts
                row = {**{k: got[k] for k in ("seconds", "hits", "compiled")}, **probe,
                       "startedSeconds": round(probe["first"] - created, 3),
                       "importSeconds": round(probe["imported"] - probe["first"], 3),
                       "afterSeconds": round(done - probe["imported"], 3)}
                rows[kind].append(row)
                lc.say(f"{kind}: {row}")
        for kind, label in (("copy", "(c) local copy, in process"), ("disk", "(d) local disk")):
            r = rows[kind]
            med = {k: round(statistics.median(x[k] for x in r), 3) for k in
                   ("seconds", "startedSeconds", "importSeconds", "afterSeconds", "gcSecondsImport", "gcSecondsAfter")}
            full = sorted({x["collections"][2][2] for x in r})
            print(f"{label}: pod created -> first step done {med['seconds']} s; python started {med['startedSeconds']} s; "
                  f"import jax {med['importSeconds']} s; after it {med['afterSeconds']} s; in collections: "
                  f"{med['gcSecondsImport']} s during import, {med['gcSecondsAfter']} s after; full collections "
                  f"by the first step done: {full}; after import: "
                  f"{statistics.median(len(x['fullAfter']) for x in r)} (medians of {args.runs})")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    finally:
        bed.stop()
        shutil.rmtree(bench.disk, ignore_errors=True)


if __name__ == "__main__":
    main()
