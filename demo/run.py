"""`make demo`: cachewarm's main job on a local control plane, start to finish.

1. Starts etcd, kube-apiserver, kube-controller-manager and the GCS emulator on loopback,
   installs manifests/, runs the operator as its ServiceAccount, and starts kube-scheduler
   with the node agent (simulated GKE nodes whose stand-in kubelet runs pods as local
   processes).
2. Trains once without the cache (an unlabelled pod): the cold time to the first step.
3. Applies demo/compilationcache.yaml; the operator creates the bucket and a warmer Job,
   which compiles demo/train.py's step into the bucket; the cache turns Warmed.
4. Trains again in a pod labelled cachewarm.dev/cache=llama-demo: the webhook injects
   the cache env and the first step loads the compiled program instead of compiling it.
5. Prints a report and writes it to demo-report.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, exit_on_sigterm, local_images, repo_root

REPO = repo_root()
NS = "demo"
IMAGES = local_images()


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def train_pod(bed: Testbed, name: str, cache: str | None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "train", "image": "demo/train:1", "command": ["python", "train.py", "--steps", "3"]}]},
    }
    if cache:
        pod["metadata"]["labels"] = {"cachewarm.dev/cache": cache}
    created = bed.kubectl_run("create", "-n", NS, "-f", "-", input=yaml.safe_dump(pod))
    if created.returncode != 0:
        raise SystemExit(f"creating pod {name} failed: {created.stderr}")
    for line in created.stderr.splitlines():
        say(f"  apiserver: {line}")
    phase = eventually(lambda: (((bed.get_json("pod", name, NS) or {}).get("status") or {}).get("phase")
                                if (((bed.get_json("pod", name, NS) or {}).get("status") or {}).get("phase")
                                    in ("Succeeded", "Failed")) else None),
                       timeout=300, what=f"pod {name} to finish")
    log = bed.pod_log(NS, name, "train")
    if phase != "Succeeded":
        raise SystemExit(f"pod {name} failed:\n{log[-3000:]}")
    stored = bed.get_json("pod", name, NS) or {}
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0].get("env", [])}
    return {**json.loads(log.strip().splitlines()[-1]), "env": env, "node": stored["spec"].get("nodeName", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, default=REPO / "demo-report.json")
    args = parser.parse_args()
    exit_on_sigterm()
    t_start = time.monotonic()
    bed = Testbed()
    operator = None
    try:
        say("starting etcd, kube-apiserver, kube-controller-manager and the GCS emulator")
        bed.start(controller_manager=True)
        if bed.kubectl_run("apply", "-k", str(REPO / "manifests")).returncode != 0:
            raise SystemExit("kubectl apply -k manifests/ failed")
        bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
        say("installed manifests/ (CRD, RBAC, webhook configuration); starting the operator as its ServiceAccount")
        kubeconfig = bed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator",
                                                    Path(tempfile.mkdtemp()) / "kubeconfig")
        operator = OperatorHandle(bed, kubeconfig, {"CACHEWARM_WARM_POLL_SECONDS": "1",
                                                    "CACHEWARM_RESYNC_SECONDS": "30"})
        bed.start_node_agent(IMAGES)
        bed.kubectl_run("create", "namespace", NS)
        eventually(lambda: bed.get_json("serviceaccount", "default", NS), what="default ServiceAccount")

        say("training without the cache (cold)")
        cold = train_pod(bed, "train-cold", None)
        say(f"  first step {cold['first_step_seconds']} s, programs compiled: {cold['compiled']}")

        say("applying demo/compilationcache.yaml")
        cache = yaml.safe_load((REPO / "demo" / "compilationcache.yaml").read_text())
        bed.apply(cache, NS)

        def warmed() -> dict[str, Any] | None:
            obj = bed.get_json("ccache", "llama-demo", NS) or {}
            conds = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
            w = conds.get("Warmed", {})
            if w.get("reason") == "WarmupFailed":
                raise SystemExit(f"warmup failed: {w.get('message')}")
            return obj if w.get("status") == "True" else None
        obj = eventually(warmed, timeout=300, what="the cache to be Warmed")
        status = obj["status"]
        [pool] = status["warmup"]["pools"]
        warmer_nodes = ", ".join(pool.get("nodes") or []) or "?"
        say(f"  Warmed: Job {pool['job']} on {warmer_nodes} wrote {pool['entriesWritten']} entries "
            f"({pool['bytesWritten']} bytes) in {pool['compileSeconds']} s")

        say("training in a pod labelled cachewarm.dev/cache=llama-demo (warm)")
        warm = train_pod(bed, "train-warm", "llama-demo")
        say(f"  on {warm['node']}: first step {warm['first_step_seconds']} s, cache hits: {warm['cache_hits']}, "
            f"programs compiled: {warm['compiled']}")

        report = {
            "bucket": status["bucket"],
            "cache": status["cache"],
            "warmup": pool,
            "nodes": {"warmer": pool.get("nodes") or [], "coldTraining": cold["node"], "warmTraining": warm["node"]},
            "injectedEnv": {k: v for k, v in warm["env"].items() if k.startswith("JAX_")},
            "cold": {"firstStepSeconds": cold["first_step_seconds"], "compiled": cold["compiled"]},
            "warm": {"firstStepSeconds": warm["first_step_seconds"], "cacheHits": warm["cache_hits"],
                     "compiled": warm["compiled"]},
            "demoSeconds": round(time.monotonic() - t_start, 1),
        }
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        b = status["bucket"]
        print(f"""
cachewarm demo report
  bucket        {b['url']}  location {b['location']}  class {b['storageClass']}
                entries deleted {b['deleteAfterDays']} d after a warmer last used them (customTime), soft delete {b['softDeleteDays']} d
  warmer Job    {pool['job']}: {pool['state']} on {warmer_nodes}, {pool['entriesWritten']} entries written, {pool['entriesFound']} found
  training pod  cold on {cold['node']}, warm on {warm['node']} (placed by kube-scheduler)
  cache         {status['cache']['entries']} entries, {status['cache']['bytes']} bytes
  injected env  {', '.join(f'{k}={v}' for k, v in report['injectedEnv'].items())}
  first step    cold {cold['first_step_seconds']} s (compiled {cold['compiled']})
                warm {warm['first_step_seconds']} s (cache hits {warm['cache_hits']}, compiled {warm['compiled']})
  (CPU: loading a cached executable is itself slow on XLA:CPU; the big gains are on GPU/TPU)
  report        {args.report}
""")
        if warm["compiled"] != 0 or warm["cache_hits"] == 0:
            raise SystemExit("the warm pod compiled its own program: the cache was not hit")
    finally:
        if operator is not None:
            operator.stop()
        bed.stop()


if __name__ == "__main__":
    main()
