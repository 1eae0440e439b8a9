"""What the reporter costs a training process: the same training script, each run a fresh
python process with a warm local cache, with the reporter on (the shipped files first on
PYTHONPATH, reporting to a local HTTP endpoint at exit) and off, interleaved so load on
the machine hits both alike. Reports the median wall time of each and their ratio.

Run: .venv/bin/python bench/reporter.py [--runs 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "data" / "jax_train.py"


def endpoint() -> tuple[str, list[int]]:
    received: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            received.append(len(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(202)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/report/v1", received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cachewarm-bench-reporter-"))
    site = work / "site"
    site.mkdir()
    shutil.copy(REPO / "operator" / "cachewarm" / "reporter.py", site / "cachewarm_reporter.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "sitecustomize.py", site / "sitecustomize.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "warmer.py", site / "warm.py")
    url, received = endpoint()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CACHEWARM_", "PYTHONPATH"))}
    base.update({"JAX_COMPILATION_CACHE_DIR": str(work / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"})
    modes = {"off": dict(base),
             "on": {**base, "PYTHONPATH": str(site), "CACHEWARM_REPORT_URL": url, "CACHEWARM_CACHE": "bench",
                    "CACHEWARM_POD_NAMESPACE": "bench", "CACHEWARM_POD_NAME": "bench", "CACHEWARM_POD_UID": "u"}}

    def run(env: dict[str, str]) -> float:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, str(TRAIN), "--steps", str(args.steps), "--extra"], env=env,
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
        return time.monotonic() - t0

    run(modes["off"])  # fills the cache: every measured run is warm
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.runs):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            times[mode].append(run(modes[mode]))
    med = {mode: statistics.median(values) for mode, values in times.items()}
    result = {
        "runs": args.runs, "steps": args.steps, "python": platform.python_version(), "cpus": os.cpu_count(),
        "median_seconds": {m: round(v, 3) for m, v in med.items()},
        "min_max_seconds": {m: [round(min(v), 3), round(max(v), 3)] for m, v in times.items()},
        "ratio_on_off": round(med["on"] / med["off"], 3),
        "reports_received": len(received), "report_bytes_median": statistics.median(received) if received else 0,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
