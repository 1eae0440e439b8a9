"""Cold compile against warm load against the load floor, for the demo's training step.

Each run is a fresh python process (JAX keeps in-memory caches), timed from inside:
  cold        first training step with an empty persistent cache: trace + lower + compile + run
  warm        first training step with the cache filled by a previous process
  load floor  JAX's own measure of reading and deserializing the entry
              (/jax/compilation_cache/cache_retrieval_time_sec) in the warm run
  compile     XLA's backend compile time in the cold run (/jax/core/compile/backend_compile_duration)
The median of --runs runs is reported for each model size. The cache is a local
directory by default; --gcs puts it on the GCS emulator (through the testbed), as pods use it.

Run: .venv/bin/python bench/warm_start.py [--runs 5] [--sizes 4x256,8x512] [--gcs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, sys, time
from collections import defaultdict
import jax
durations = defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **_: durations.__setitem__(e, durations[e] + d))
sys.path.insert(0, sys.argv[1])
import train
params = train.init_params(); inputs, labels = train.batch()
t0 = time.perf_counter()
params, loss = train.train_step(params, inputs, labels); loss.block_until_ready()
first = time.perf_counter() - t0
t0 = time.perf_counter()
params, loss = train.train_step(params, inputs, labels); loss.block_until_ready()
print(json.dumps({"first_step": first, "next_step": time.perf_counter() - t0,
  "retrieval": durations["/jax/compilation_cache/cache_retrieval_time_sec"],
  "backend_compile": durations["/jax/core/compile/backend_compile_duration"],
  "trace": durations["/jax/core/compile/jaxpr_trace_duration"],
  "lower": durations["/jax/core/compile/jaxpr_to_mlir_module_duration"]}))
"""


def run_once(env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", WORKER, str(REPO / "demo")], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(layers: int, width: int, runs: int, cache_url: str, reset: Any, base_env: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **base_env, "DEMO_LAYERS": str(layers), "DEMO_WIDTH": str(width),
           "JAX_COMPILATION_CACHE_DIR": cache_url, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}
    cold, warm = [], []
    for _ in range(runs):
        reset()
        cold.append(run_once(env))
        warm.append(run_once(env))
    med = lambda rows, key: round(statistics.median(r[key] for r in rows), 3)  # noqa: E731
    return {
        "model": f"{layers} layers x {width}", "runs": runs,
        "cold_first_step_s": med(cold, "first_step"), "cold_backend_compile_s": med(cold, "backend_compile"),
        "warm_first_step_s": med(warm, "first_step"), "load_floor_s": med(warm, "retrieval"),
        "trace_lower_s": round(med(warm, "trace") + med(warm, "lower"), 3),
        "steady_step_s": med(warm, "next_step"),
        "warm_over_cold": round(med(warm, "first_step") / med(cold, "first_step"), 2),
        "warm_backend_compile_s": med(warm, "backend_compile"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="4x256,8x512", help="LAYERSxWIDTH, comma-separated")
    parser.add_argument("--gcs", action="store_true", help="cache on the GCS emulator instead of a local dir")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    bed = None
    base_env: dict[str, str] = {}
    try:
        if args.gcs:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            from cachewarm_testbed.cluster import Testbed, exit_on_sigterm

            exit_on_sigterm()

            bed = Testbed().start()
            base_env = bed.env()
            client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                    client_options={"api_endpoint": bed.storage_emulator_host})
            client.create_bucket("bench-cache")
        for size in args.sizes.split(","):
            layers, width = (int(x) for x in size.split("x"))
            if args.gcs:
                # A fresh, empty prefix for each cold/warm pair.
                rows = [measure(layers, width, 1, f"gs://bench-cache/run-{uuid.uuid4().hex[:8]}", lambda: None,
                                base_env) for _ in range(args.runs)]
                results.append(_merge(rows, args.runs))
            else:
                tmp = Path(tempfile.mkdtemp(prefix="cachewarm-bench-"))
                results.append(measure(layers, width, args.runs, str(tmp),
                                       lambda tmp=tmp: (shutil.rmtree(tmp), tmp.mkdir()), base_env))
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if bed is not None:
            bed.stop()
    where = "GCS emulator (loopback HTTP)" if args.gcs else "local directory"
    print(f"\ncache: {where}; machine: {platform.machine()}, {os.cpu_count()} cores; "
          f"jax {__import__('jax').__version__}; median of {args.runs} fresh processes each\n")
    print("| model | cold first step s | XLA compile s | warm first step s | load floor s | trace+lower s | "
          "warm/cold | steady step s | startup cold/warm s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        # Startup: the first step minus one steady step, i.e. what the cache can save.
        startup = (f"{r['cold_first_step_s'] - r['steady_step_s']:.2f} / "
                   f"{r['warm_first_step_s'] - r['steady_step_s']:.2f}")
        print(f"| {r['model']} | {r['cold_first_step_s']} | {r['cold_backend_compile_s']} | {r['warm_first_step_s']} | "
              f"{r['load_floor_s']} | {r['trace_lower_s']} | {r['warm_over_cold']} | {r['steady_step_s']} | {startup} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _merge(rows: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    keys = [k for k in rows[0] if k not in ("model", "runs")]
    merged: dict[str, Any] = {"model": rows[0]["model"], "runs": runs}
    for key in keys:
        merged[key] = round(statistics.median(r[key] for r in rows), 3)
    return merged


if __name__ == "__main__":
    main()
