"""What the reporter costs a training process, on the path a pod's report takes.

The same training script, each run a fresh python process with a warm local cache, in four
modes, interleaved round by round (the order of the modes reversed every other round) so
that load on the machine hits all alike:

  off       no reporter;
  local     the reporter on, its report at exit to a plain-HTTP endpoint in this process
            that answers 202 at once (what this benchmark measured before: no TLS, no review);
  operator  the reporter on as the webhook set it up: the URL, CA and cache from the env the
            operator's webhook injected into a real labelled pod (created through the
            apiserver), the pod's identity from that pod, and a token the apiserver issued
            for it (TokenRequest, audience cachewarm, bound to the Pod: what the kubelet
            mounts as the projected token). The report goes over TLS to the operator's
            /report/v1, which has the apiserver review the token (TokenReview) before it
            answers. A new pod for every run, so every exit report waits for its review, as
            the first report of a pod does;
  reviewed  the same, but every run in one pod whose token the operator has reviewed already
            (it keeps an accepted token for 5 minutes): as a pod's exit report after its
            first report, 5 s after the first compile, paid for the review.

The operator is `cachewarm run` on the local control plane (etcd, kube-apiserver, the GCS
emulator), as its own ServiceAccount with the manifests' RBAC, leader election on. Every
report is checked: after each run the operator's `cachewarm_reports_total` must have grown
by one 202 (operator, reviewed) or not at all (off, local), and nothing else (no 4xx/5xx);
the local endpoint must have received one report per local run. A run whose report was not
taken fails the benchmark.

Reports per mode the median, min and max wall time, and per round the paired ratio of each
reporting mode to `off` in the same round, with the ratios' median, min and max.

Run: .venv/bin/python bench/reporter.py [--runs 20] [--json out.json]   (after `make bin`)
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
import uuid
from pathlib import Path
from typing import Any

from rounds import difference, order, paired

from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm, repo_root, scrape

REPO = repo_root()
TRAIN = REPO / "tests" / "data" / "jax_train.py"
NS = "bench"
CACHE = "bench"
MODES = ("off", "local", "operator", "reviewed")
# The env the webhook gives a container for the reporter (builders/reporter.report_env).
REPORT_ENV = ("CACHEWARM_REPORT_URL", "CACHEWARM_REPORT_TOKEN_FILE", "CACHEWARM_REPORT_CA", "CACHEWARM_CACHE",
              "CACHEWARM_RESTORE_IMAGE_PYTHONPATH", "CACHEWARM_POD_NAMESPACE", "CACHEWARM_POD_NAME",
              "CACHEWARM_POD_UID")
FIELDS = {"metadata.namespace": "namespace", "metadata.name": "name", "metadata.uid": "uid"}
CODES = ("202", "400", "401", "403", "404", "413", "429", "503")


def local_endpoint() -> tuple[str, list[int]]:
    """A plain-HTTP endpoint that takes any POST at once (202); the sizes it received."""
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


def training_pod(name: str) -> dict[str, Any]:
    """A labelled training pod (the webhook adds the reporter); it stays Pending (no node
    matches it): only its identity and the env it was given matter here."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"cachewarm.dev/cache": CACHE}},
            "spec": {"serviceAccountName": "trainer", "nodeSelector": {"cachewarm.bench/nowhere": "true"},
                     "containers": [{"name": "train", "image": "trainer:1", "command": ["python", "train.py"]}]}}


class Pods:
    """Labelled pods created through the apiserver, and the reporter's env the webhook put in
    each, with a pod-bound token for audience cachewarm written where the env points."""

    def __init__(self, bed: Testbed, work: Path) -> None:
        self.bed, self.work = bed, work

    def make(self, name: str) -> dict[str, str]:
        self.bed.apply(training_pod(name), NS)
        pod = self.bed.get_json("pod", name, NS)
        assert pod is not None
        [train] = [c for c in pod["spec"]["containers"] if c["name"] == "train"]
        env: dict[str, str] = {}
        for entry in train.get("env") or []:
            if entry["name"] not in REPORT_ENV:
                continue
            if "value" in entry:
                env[entry["name"]] = entry["value"]
            else:  # the downward API, as the kubelet resolves it
                env[entry["name"]] = pod["metadata"][FIELDS[entry["valueFrom"]["fieldRef"]["fieldPath"]]]
        missing = [n for n in ("CACHEWARM_REPORT_URL", "CACHEWARM_REPORT_CA", "CACHEWARM_REPORT_TOKEN_FILE",
                               "CACHEWARM_POD_UID") if n not in env]
        assert not missing, f"the webhook did not give pod {name} the reporter's env {missing}"
        made = self.bed.kubectl_run("create", "token", "trainer", "-n", NS, "--audience=cachewarm",
                                    "--duration=1h", "--bound-object-kind=Pod", f"--bound-object-name={name}",
                                    f"--bound-object-uid={pod['metadata']['uid']}")
        assert made.returncode == 0, made.stderr
        token = self.work / "tokens" / name
        token.parent.mkdir(exist_ok=True)
        token.write_text(made.stdout.strip())
        env["CACHEWARM_REPORT_TOKEN_FILE"] = str(token)  # in the pod: the projected volume's file
        return env


def reports(metrics_url: str) -> dict[str, int]:
    return {code: int(scrape(metrics_url, "cachewarm_reports_total", code=code)) for code in CODES}


def token_reviews(bed: Testbed) -> int:
    """TokenReviews the apiserver has answered (apiserver_request_total; only the operator
    makes them here)."""
    text = bed.kubectl_run("get", "--raw", "/metrics").stdout
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("apiserver_request_total{") and 'resource="tokenreviews"' in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="rounds: each runs every mode once")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    exit_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="cachewarm-bench-reporter-"))
    site = work / "site"  # the files the webhook's volume holds (ConfigMap or init container)
    site.mkdir()
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "reporter.py", site / "cachewarm_reporter.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "sitecustomize.py", site / "sitecustomize.py")
    shutil.copy(REPO / "operator" / "cachewarm" / "agents" / "warmer.py", site / "warm.py")
    (site / "image-pythonpath").write_text("")  # what the recorder writes for an image without PYTHONPATH
    local_url, received = local_endpoint()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CACHEWARM_", "PYTHONPATH"))}
    base.update({"JAX_COMPILATION_CACHE_DIR": str(work / "cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"})

    def run(env: dict[str, str], warm: bool = True) -> tuple[float, float, str]:
        """One run: its wall time, its exit tail (from the script's last line, its JSON
        summary, to the process's end: interpreter shutdown, where the report at exit is
        sent) and its stderr. Checks every compile was a cache hit."""
        with tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, str(TRAIN), "--steps", str(args.steps), "--extra"],
                                    env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=err,
                                    text=True)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            t_line = time.monotonic()
            proc.stdout.read()
            code = proc.wait(timeout=300)
            t_end = time.monotonic()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        if code != 0:
            raise SystemExit(stderr[-2000:])
        summary = json.loads(line)
        assert not warm or (summary["hits"] > 0 and summary["compiled"] == 0), summary
        return t_end - t0, t_end - t_line, stderr

    bed = Testbed().start()
    operator = None
    result: dict[str, Any] = {"runs": args.runs, "steps": args.steps}
    try:
        assert bed.kubectl_run("apply", "-k", str(REPO / "manifests")).returncode == 0
        bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
        assert bed.kubectl_run("create", "namespace", NS).returncode == 0
        assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", NS).returncode == 0
        kubeconfig = bed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator", work / "kubeconfig")
        operator = bed.start_operator(kubeconfig, {
            "CACHEWARM_LOG_LEVEL": "WARNING", "CACHEWARM_GCP_PROJECT": "testbed",
            # As in a pod (downward API): leader election and the shared certificate Secret.
            "CACHEWARM_POD_NAMESPACE": "cachewarm-system", "CACHEWARM_POD_NAME": "cachewarm-bench"})
        metrics_url = operator.metrics_url
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": CACHE},
                   "spec": {"storage": {"gcs": {"bucket": "bench-reporter", "location": "us-central1"}}}}, NS)
        eventually(lambda: (bed.get_json("ccache", CACHE, NS) or {}).get("status", {}).get("bucket"),
                   what="the cache reconciled")
        # The webhook must be answering with the reporter before the pods are made.
        eventually(lambda: (bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "") or {})
                   .get("webhooks", [{}])[0].get("clientConfig", {}).get("caBundle"), what="the webhook's CA")
        pods = Pods(bed, work)
        # The webhook adds the reporter once it answers with its CA: until then (failurePolicy
        # Ignore) a pod goes without, and make() says so.
        eventually(lambda: pods.make(f"probe-{uuid.uuid4().hex[:6]}"), timeout=60, what="a pod with the reporter")
        fresh = [pods.make(f"train-{i}") for i in range(args.runs + 1)]  # one per operator run, + warm-up
        reviewed_env = pods.make("train-reviewed")
        envs = {"off": dict(base), "operator": {}, "reviewed": {**base, "PYTHONPATH": str(site), **reviewed_env}}
        envs["local"] = {**envs["reviewed"], "CACHEWARM_REPORT_URL": local_url}
        result["report_url"] = fresh[0]["CACHEWARM_REPORT_URL"]

        expected = {m: 1 if m in ("operator", "reviewed") else 0 for m in MODES}
        counted = reports(metrics_url)
        taken = {m: 0 for m in MODES}
        reviews = {m: 0 for m in MODES}

        def measured(mode: str) -> tuple[float, float]:
            """One run in `mode`; checks its report was taken (or none was sent)."""
            nonlocal counted
            env = {**base, "PYTHONPATH": str(site), **fresh.pop()} if mode == "operator" else envs[mode]
            locals_before = len(received)
            reviews_before = token_reviews(bed)
            elapsed, tail, stderr = run(env)
            assert "could not send a report" not in stderr, f"{mode}: {stderr[-1000:]}"
            want = {code: counted[code] + (expected[mode] if code == "202" else 0) for code in CODES}

            def as_wanted() -> dict[str, int] | None:
                got = reports(metrics_url)
                return got if got == want else None
            # A report is counted before it is answered: this waits only for a run whose
            # exit wait gave up (and then fails, as it must).
            counted = eventually(as_wanted, timeout=10, what=f"the operator's reports after a {mode} run: {want}")
            assert len(received) == locals_before + (mode == "local"), f"{mode}: the local endpoint's count"
            taken[mode] += expected[mode]
            reviews[mode] += token_reviews(bed) - reviews_before
            return elapsed, tail

        run(envs["off"], warm=False)  # fills the cache: every measured run is warm
        for mode in MODES:  # warm-up of each path, not counted; reviews train-reviewed's token
            measured(mode)
        reviews.update({m: 0 for m in MODES})  # counted over the measured runs only
        times: dict[str, list[float]] = {m: [] for m in MODES}
        tails: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.runs):
            for mode in order(i, MODES):
                elapsed, tail = measured(mode)
                times[mode].append(elapsed)
                tails[mode].append(tail)
        final = reports(metrics_url)
        med = {m: statistics.median(v) for m, v in times.items()}
        result.update({
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "median_seconds": {m: round(v, 3) for m, v in med.items()},
            "min_max_seconds": {m: [round(min(v), 3), round(max(v), 3)] for m, v in times.items()},
            "paired_ratio_to_off": {m: paired(times[m], times["off"]) for m in MODES if m != "off"},
            "ratio_of_medians_to_off": {m: round(med[m] / med["off"], 3) for m in MODES if m != "off"},
            # From the script's last line to the process's end, where the exit report goes.
            "exit_tail_ms_median": {m: round(statistics.median(v) * 1000, 1) for m, v in tails.items()},
            "exit_tail_ms_min_max": {m: [round(min(v) * 1000, 1), round(max(v) * 1000, 1)] for m, v in tails.items()},
            "exit_tail_paired_difference_to_off_ms": {
                m: difference(tails[m], tails["off"]) for m in MODES if m != "off"},
            # What TLS and the operator add to a report over the plain endpoint; what the review adds.
            "exit_tail_paired_difference_ms": {
                f"{a} - {b}": difference(tails[a], tails[b])
                for a, b in (("operator", "local"), ("reviewed", "local"), ("operator", "reviewed"))},
            # Warm-ups included: one operator and one reviewed run each.
            "reports_sent_to_operator": taken["operator"] + taken["reviewed"],
            "reports_received": final["202"],
            "reports_refused": {c: n for c, n in final.items() if c != "202" and n},
            "local_reports_received": len(received),
            # The apiserver's own count, per mode over the measured runs: one per operator run
            # (a new pod's token), none for reviewed runs while the operator keeps the review.
            "token_reviews": reviews,
            "report_bytes_median": statistics.median(received) if received else 0,
        })
        assert result["reports_received"] == result["reports_sent_to_operator"] == 2 * (args.runs + 1)
        assert not result["reports_refused"]
        assert reviews["operator"] == args.runs and reviews["off"] == reviews["local"] == 0, reviews
        usage = eventually(lambda: ((bed.get_json("ccache", CACHE, NS) or {}).get("status") or {}).get("usage"),
                           timeout=30, what="status.usage")
        result["status_usage_pods"] = usage.get("pods")
    finally:
        if operator is not None:
            operator.stop()
        bed.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
