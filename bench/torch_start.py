"""A torch.compile'd program's first step: cold, warm from the bucket, and the local floor,
on the real node, in one run (issue 31).

Set-up: the control plane, the GCS emulator, the real node holding the torch demo image
(demo/torch/Dockerfile: torch 2.15.0, g++; demo/torch/train_torch.py, a gated MLP whose train
step and eval are torch.compile'd, Inductor's C++ backend on CPU), the operator installed by
`kubectl apply -k manifests/`, and one torch cache (`spec.torch: {}`) warmed through the
operator by its Job running the real entrypoint. Then each round runs three fresh pods of
the same image and command (`python train_torch.py --steps 1`), in the round's order
(bench/rounds.py `order`):

  (a) cold         an unlabelled pod, TORCHINDUCTOR_CACHE_DIR an empty emptyDir: every
                   graph compiled, every kernel built
  (b) warm         a labelled pod: what the webhook gives it (the torch env, a writable
                   local directory, the local copy, which seeds that directory from the
                   warmer's archive in the bucket before the program compiles)
  (c) local floor  an unlabelled pod whose TORCHINDUCTOR_CACHE_DIR is a hostPath holding the
                   very files of the warmer's archive (extracted on the host, afresh for the
                   pod), Inductor's precompiled header among them linked where torch looks
                   for it (the image runs as root): the directory already on local disk, no
                   copy at all

Measured per pod: the program's first step (its own monotonic clock: the compile it pays,
or the cache load) and pod creation to first step done (from just before `kubectl apply`
to the program's wall-clock stamp, the same host clock), and torch's own counters (every
(b) and (c) pod must miss no FX graph: the run stops otherwise). Reported: median
(min-max) of each, and the per-round paired ratios (b)/(a), (c)/(a) and (b)/(c).

Needs root and `make node-deps`; serialize with the real-node e2e tests:

  flock /tmp/cachewarm-e2e.lock .venv/bin/python bench/torch_start.py [--rounds 3] [--json F]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from cachewarm_testbed import images, install
from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import order, paired  # noqa: E402 - bench/rounds.py

NS = "bench"
CACHE = "mlp"
PROGRAM = ["python", "train_torch.py", "--steps", "1"]
KINDS = ("cold", "warm", "floor")
LABELS = {"cold": "(a) cold", "warm": "(b) warm from the bucket", "floor": "(c) local floor"}
TORCH_DIR = "/cachewarm-torch"


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def program_line(logs: str) -> dict[str, Any]:
    """The program's JSON line (its last): the container's log interleaves torch's warnings on
    stderr with it (a warning's source line can come last)."""
    for text in reversed(logs.strip().splitlines()):
        if text.startswith("{") and '"counters"' in text:
            line: dict[str, Any] = json.loads(text)
            return line
    raise AssertionError(f"no line of the program's in its log:\n{logs[-3000:]}")


class Bench:
    def __init__(self, bed: Testbed, gcs_env: list[dict[str, str]], disk: Path) -> None:
        self.bed, self.gcs_env, self.disk = bed, gcs_env, disk
        self.bucket = f"torch-{uuid.uuid4().hex[:10]}"
        self.count = 0

    def warm(self) -> dict[str, Any]:
        self.bed.apply({
            "apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": CACHE},
            "spec": {"storage": {"gcs": {"bucket": self.bucket, "prefix": CACHE, "location": "us-central1"}},
                     "torch": {},
                     "warmup": {"image": images.TORCH_TRAIN_IMAGE, "command": PROGRAM, "pools": [{"name": "cpu"}],
                                "env": self.gcs_env}}}, NS)

        def warmed() -> dict[str, Any] | None:
            obj = self.bed.get_json("ccache", CACHE, NS) or {}
            conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
            if conds.get("Warmed", {}).get("reason") == "WarmupFailed":
                raise SystemExit(f"warmup failed: {conds['Warmed']['message']}")
            return obj if conds.get("Warmed", {}).get("status") == "True" else None
        return eventually(warmed, timeout=600, what="the torch cache to be Warmed")

    def archive(self, client: storage.Client) -> bytes:
        [blob] = list(client.list_blobs(self.bucket, prefix=f"{CACHE}/torch-inductor-"))
        data: bytes = blob.download_as_bytes()
        return data

    def floor_dir(self, data: bytes) -> Path:
        """The warmer's files on local disk, afresh (a run writes its locks there)."""
        target = self.disk / f"floor-{self.count}"
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(target, filter="data")
        target.chmod(0o777)
        return target

    def run(self, kind: str, data: bytes) -> dict[str, Any]:
        self.count += 1
        name = f"{kind}-{self.count}"
        container: dict[str, Any] = {"name": "train", "image": images.TORCH_TRAIN_IMAGE, "command": PROGRAM,
                                     "env": list(self.gcs_env)}
        spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        meta: dict[str, Any] = {"name": name}
        if kind == "warm":
            meta["labels"] = {"cachewarm.dev/cache": CACHE}
        else:
            source = {"emptyDir": {}} if kind == "cold" else \
                {"hostPath": {"path": str(self.floor_dir(data)), "type": "Directory"}}
            spec["volumes"] = [{"name": "torch", **source}]
            container["env"].append({"name": "TORCHINDUCTOR_CACHE_DIR", "value": TORCH_DIR})
            container["volumeMounts"] = [{"name": "torch", "mountPath": TORCH_DIR}]
            if kind == "floor":  # the warmer's precompiled header too, where torch looks for it (as root)
                container["command"] = ["sh", "-c", f"mkdir -p /tmp/torchinductor_root && ln -s {TORCH_DIR}/"
                                        "precompiled_headers /tmp/torchinductor_root/ && exec " + " ".join(PROGRAM)]
        t0 = time.time()
        self.bed.apply({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}, NS)

        def finished() -> dict[str, Any] | None:
            got = self.bed.get_json("pod", name, NS) or {}
            return got if (got.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
        done = eventually(finished, timeout=600, what=f"pod {name}")
        logs = self.bed.kubectl_run("logs", name, "-n", NS, "-c", "train").stdout
        if done["status"]["phase"] != "Succeeded":
            raise SystemExit(f"pod {name} failed:\n{logs[-3000:]}")
        line = program_line(logs)
        misses = line["counters"]["inductor"].get("fxgraph_cache_miss", 0)
        if kind != "cold" and misses:
            raise SystemExit(f"pod {name} ({LABELS[kind]}) missed {misses} FX graphs: {line}")
        self.bed.kubectl_run("delete", "pod", name, "-n", NS, "--wait=true")
        return {"firstStep": line["firstStepSeconds"], "toFirstStep": round(line["firstStepDoneAt"] - t0, 3),
                "counters": line["counters"]}


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: dict[str, list[dict[str, Any]]], pairs: dict[str, dict[str, Any]]) -> str:
    lines = ["| kind | first step, s | pod creation to first step done, s |", "|---|---|---|"]
    lines += [f"| {LABELS[k]} | {stats([r['firstStep'] for r in runs[k]])} | "
              f"{stats([r['toFirstStep'] for r in runs[k]])} |" for k in KINDS]
    lines += ["", "| paired ratio, median (min-max) | first step | pod creation to first step done |", "|---|---|---|"]
    for label, got in pairs.items():
        lines.append(f"| {label} | {got['firstStep']['median']} ({got['firstStep']['min']}-{got['firstStep']['max']}) | "
                     f"{got['toFirstStep']['median']} ({got['toFirstStep']['min']}-{got['toFirstStep']['max']}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    disk = Path(tempfile.mkdtemp(prefix="cachewarm-torch-floor-"))
    try:
        with install.on_real_node({"CACHEWARM_WARM_POLL_SECONDS": "1"}, torch=True) as (bed, _, _):
            measure(bed, args.rounds, disk, args.json)
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def measure(bed: Testbed, rounds: int, disk: Path, out: Path | None) -> None:
    """The torch cache warmed through the operator, then `rounds` rounds of the three kinds."""
    env = bed.env()
    bed.kubectl_run("create", "namespace", NS)
    eventually(lambda: bed.get_json("serviceaccount", "default", NS), what="default ServiceAccount")
    bench = Bench(bed, [{"name": k, "value": env[k]} for k in install.GCS_ENV], disk)
    t = time.monotonic()
    obj = bench.warm()
    say(f"warmed through the operator in {time.monotonic() - t:.1f} s: {obj['status']['warmup']['pools']}")
    client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": env["STORAGE_EMULATOR_HOST"]})
    data = bench.archive(client)
    say(f"the warmer's archive: {len(data)} bytes")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for i in range(rounds):
        for kind in order(i, KINDS):
            got = bench.run(kind, data)
            runs[kind].append(got)
            say(f"round {i + 1} {LABELS[kind]}: first step {got['firstStep']} s, to first step "
                f"{got['toFirstStep']} s, {got['counters']}")
    pairs = {}
    for label, (a, b) in {"(b)/(a) warm / cold": ("warm", "cold"), "(c)/(a) floor / cold": ("floor", "cold"),
                          "(b)/(c) warm / floor": ("warm", "floor")}.items():
        pairs[label] = {m: paired([r[m] for r in runs[a]], [r[m] for r in runs[b]]) for m in ("firstStep", "toFirstStep")}
    if out:
        out.write_text(json.dumps({"archiveBytes": len(data), "warm": obj["status"]["warmup"]["pools"], "runs": runs,
                                   "paired": pairs}, indent=1))
    print(table(runs, pairs))


if __name__ == "__main__":
    main()
