"""What the in-process local copy adds to a python process's start, outside a pod: the
same process (`import jax`, then list the cache directory) started fresh each run, (c)
with the boot directory first on PYTHONPATH as the kubelet lays out the operator's boot
ConfigMap (sources and bytecode), copying 10 entries of 14 KB from the GCS emulator
(behind its fidelity proxy) into a new directory, against (d) a directory that already
holds them, alternated. Reports medians of the time from the spawn to the program's first
line and to the end of `import jax`.

Run: .venv/bin/python bench/local_copy_start.py [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "integration"), str(REPO / "tests")]

from conftest import storage_client  # noqa: E402 - the tests' own helpers
from test_copier import env_for, process_env  # noqa: E402
from test_copy_in_process import boot_dir  # noqa: E402

from cachewarm_testbed.cluster import Testbed  # noqa: E402

PROGRAM = ("import time; first = time.time(); import jax; imported = time.time(); "
           "import os, sys; print(first, imported, len(os.listdir(sys.argv[1])))")
ENTRIES = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    bed = Testbed().start_gcs()
    try:
        gcs = storage_client(bed.storage_emulator_host)
        bucket = f"start-{uuid.uuid4().hex[:8]}"
        gcs.create_bucket(bucket, location="us-central1")
        work = Path(tempfile.mkdtemp(prefix="local-copy-start-"))
        floor = work / "floor"
        floor.mkdir()
        for i in range(ENTRIES):
            data = os.urandom(14000)
            gcs.bucket(bucket).blob(f"jax/jit_p{i}-{i:064x}-cache").upload_from_string(data)
            (floor / f"jit_p{i}-{i:064x}-cache").write_bytes(data)
        boot = boot_dir(work / "boot")
        times: dict[str, list[tuple[float, float]]] = {"c": [], "d": []}
        for run in range(args.runs):
            for kind in ("c", "d") if run % 2 else ("d", "c"):
                if kind == "c":
                    dest = work / f"copy{run}"
                    env = process_env({**env_for(bed, bucket, dest, summary=str(work / f"pod{run}" / "s.json")),
                                       "CACHEWARM_COPY_IN_PROCESS": "1", "PYTHONPATH": str(boot),
                                       "PYTHONDONTWRITEBYTECODE": "1"})
                else:
                    dest, env = floor, process_env({"PYTHONDONTWRITEBYTECODE": "1"})
                spawned = time.time()
                out = subprocess.run([sys.executable, "-c", PROGRAM, str(dest)], env=env, capture_output=True,
                                     text=True, check=True)
                first, imported, count = out.stdout.split()
                assert int(count) == ENTRIES, out.stderr
                times[kind].append((float(first) - spawned, float(imported) - spawned))
        for kind, label in (("c", "(c) copy in process"), ("d", "(d) local directory")):
            print(f"{label}: first line {statistics.median(t[0] for t in times[kind]):.3f} s, "
                  f"end of import jax {statistics.median(t[1] for t in times[kind]):.3f} s "
                  f"(medians of {args.runs})")
    finally:
        bed.stop()


if __name__ == "__main__":
    main()
