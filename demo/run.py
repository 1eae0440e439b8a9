"""`make demo`: cachewarm's main job on a local control plane, start to finish.

1. Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the GCS
   emulator, and a real node (kubelet + containerd + kube-proxy, cachewarm_testbed.realnode;
   needs Linux and root); builds the operator, warmer and training images from our
   Dockerfiles (cached by content) into the node's containerd; installs the operator with
   `kubectl apply -k manifests/` (plus the GCS emulator's address in its env).
   With --simulated instead: no root needed; the operator runs as a local process under
   its ServiceAccount, and simulated GKE nodes (the node agent) run pods as local processes.
2. Trains once without the cache (an unlabelled pod): the cold time to the first step.
3. Applies demo/compilationcache.yaml; the operator creates the bucket and a warmer Job,
   which compiles demo/train.py's step into the bucket; the cache turns Warmed.
4. Trains again in a pod labelled cachewarm.dev/cache=llama-demo: the webhook injects
   the cache env, the reporter and (the default read path) a local copy of the cache, and
   the first step loads the compiled program from local disk instead of compiling it. The
   pod's reporter tells the operator, which sums it in status.usage. Each pod is timed from
   its create request to its first training step done: the warm one's goal is at most
   0.3x the cold one's (WARM_GOAL).
5. Trains in a second labelled pod on two (host) devices: its keys differ from the
   warmed ones, it misses, and the cache's KeysMatch condition says why.
6. Prints a report and writes it to demo-report.json.
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

from cachewarm_testbed import images, install
from cachewarm_testbed.realnode import NODE_NAME
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, exit_on_sigterm, local_images, repo_root

REPO = repo_root()
NS = "demo"
# How pods find GCS here: the emulator's address (a real cluster needs none of it).
GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
# Shorter intervals than a cluster's defaults, so the demo does not wait on them.
# The model size every pod trains, as the cache's warmer compiles it (demo/compilationcache.yaml).
MODEL_SIZE = {"name": "DEMO_LAYERS", "value": "96"}
WARM_GOAL = 0.3  # warm pod-to-first-step over cold, at most
OPERATOR_ENV = {"CACHEWARM_WARM_POLL_SECONDS": "1", "CACHEWARM_RESYNC_SECONDS": "30",
                "CACHEWARM_USAGE_FLUSH_SECONDS": "2"}


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def client_env(bed: Testbed, real: bool) -> list[dict[str, str]]:
    """The GCS emulator's address for the real node's pods (simulated nodes add it themselves)."""
    env = bed.env()
    return [{"name": k, "value": env[k]} for k in GCS_ENV] if real else []


def pod_log(bed: Testbed, name: str, real: bool) -> str:
    if not real:
        return bed.pod_log(NS, name, "train")
    out = bed.kubectl_run("logs", name, "-n", NS, "-c", "train")
    return out.stdout if out.returncode == 0 else out.stderr


def train_pod(bed: Testbed, name: str, cache: str | None, real: bool,
              env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "train", "image": images.TRAIN_IMAGE, "command": ["python", "train.py", "--steps", "3"],
            "env": [*client_env(bed, real), MODEL_SIZE, *(env or [])]}]},
    }
    if cache:
        pod["metadata"]["labels"] = {"cachewarm.dev/cache": cache}
    asked = time.time()  # the pod's clock is this machine's: the node runs here
    created = bed.kubectl_run("create", "-n", NS, "-f", "-", input=yaml.safe_dump(pod))
    if created.returncode != 0:
        raise SystemExit(f"creating pod {name} failed: {created.stderr}")
    for line in created.stderr.splitlines():
        say(f"  apiserver: {line}")
    phase = eventually(lambda: (((bed.get_json("pod", name, NS) or {}).get("status") or {}).get("phase")
                                if (((bed.get_json("pod", name, NS) or {}).get("status") or {}).get("phase")
                                    in ("Succeeded", "Failed")) else None),
                       timeout=300, what=f"pod {name} to finish")
    log = pod_log(bed, name, real)
    if phase != "Succeeded":
        raise SystemExit(f"pod {name} failed:\n{log[-3000:]}")
    stored = bed.get_json("pod", name, NS) or {}
    env = {e["name"]: e.get("value") for e in stored["spec"]["containers"][0].get("env", [])}
    out = json.loads(log.strip().splitlines()[-1])
    # What a user waits for: from the create request to the first training step done.
    out["pod_to_first_step_seconds"] = round(out["done"] - asked, 3)
    return {**out, "env": env, "node": stored["spec"].get("nodeName", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, default=REPO / "demo-report.json")
    parser.add_argument("--simulated", action="store_true",
                        help="no root: simulated nodes (the node agent) and the operator as a local process")
    args = parser.parse_args()
    real = not args.simulated
    exit_on_sigterm()
    t_start = t_cluster = time.monotonic()
    bed = Testbed()
    operator = None
    setup: dict[str, Any] = {}
    try:
        if real:
            t0 = time.monotonic()
            say("building the operator, warmer and training images from our Dockerfiles (cached by content)")
            archives = images.build_all()
            setup["imagesSeconds"] = round(time.monotonic() - t0, 1)
            t_cluster = time.monotonic()
            say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the GCS emulator "
                "and a real node (kubelet, containerd, kube-proxy)")
            bed.start(controller_manager=True, real_node=True)
            node = bed.start_real_node()
            node.import_images(archives)
            say(f"  node {NODE_NAME} Ready; images imported: {', '.join(sorted(archives))}")
            env = bed.env()
            pod = install.install_operator(bed, REPO / "manifests", {
                **{k: env[k] for k in GCS_ENV}, **OPERATOR_ENV})
            replicas = install.operator_pods(bed)
            say(f"installed with kubectl apply -k manifests/: {len(replicas)} operator Pods Running; the leader, "
                f"{pod['metadata']['name']} ({pod['spec']['containers'][0]['image']}), on {pod['spec']['nodeName']}")
            setup["images"] = sorted(archives)
            setup["operatorReplicas"] = len(replicas)
            setup["operatorPod"] = {"name": pod["metadata"]["name"], "node": pod["spec"]["nodeName"], "leader": True,
                                    "image": pod["spec"]["containers"][0]["image"],
                                    "imageID": pod["status"]["containerStatuses"][0]["imageID"]}
        else:
            say("starting etcd, kube-apiserver, kube-controller-manager and the GCS emulator")
            bed.start(controller_manager=True)
            if bed.kubectl_run("apply", "-k", str(REPO / "manifests")).returncode != 0:
                raise SystemExit("kubectl apply -k manifests/ failed")
            bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
            say("installed manifests/ (CRD, RBAC, webhook configuration); starting the operator as its ServiceAccount")
            kubeconfig = bed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator",
                                                        Path(tempfile.mkdtemp()) / "kubeconfig")
            operator = OperatorHandle(bed, kubeconfig, OPERATOR_ENV)
            bed.start_node_agent(local_images())
        setup["clusterSeconds"] = round(time.monotonic() - t_cluster, 1)  # after the images
        bed.kubectl_run("create", "namespace", NS)
        eventually(lambda: bed.get_json("serviceaccount", "default", NS), what="default ServiceAccount")

        say("training without the cache (cold)")
        cold = train_pod(bed, "train-cold", None, real)
        say(f"  pod created -> first step done {cold['pod_to_first_step_seconds']} s (the step itself "
            f"{cold['first_step_seconds']} s), programs compiled: {cold['compiled']}")

        say("applying demo/compilationcache.yaml")
        cache = yaml.safe_load((REPO / "demo" / "compilationcache.yaml").read_text())
        cache["spec"]["warmup"]["env"] = [*cache["spec"]["warmup"].get("env", []), *client_env(bed, real)]
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
        warm = train_pod(bed, "train-warm", "llama-demo", real)
        ratio = round(warm["pod_to_first_step_seconds"] / cold["pod_to_first_step_seconds"], 3)
        say(f"  on {warm['node']}: pod created -> first step done {warm['pod_to_first_step_seconds']} s (the step "
            f"itself {warm['first_step_seconds']} s), {ratio}x the cold pod's; cache hits: {warm['cache_hits']}, "
            f"programs compiled: {warm['compiled']}")

        def usage() -> dict[str, Any] | None:
            got = ((bed.get_json("ccache", "llama-demo", NS) or {}).get("status") or {}).get("usage") or {}
            return got if got.get("hits") else None
        used = eventually(usage, timeout=60, what="status.usage from the warm pod's report")
        say(f"  its reporter told the operator: status.usage hits {used['hits']}, misses {used['misses']}, "
            f"compile seconds saved {used['compileSecondsSaved']}")

        say("training in a second labelled pod on two devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
        two = train_pod(bed, "train-two-devices", "llama-demo", real, [
            {"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=2"}])
        say(f"  first step {two['first_step_seconds']} s, cache hits: {two['cache_hits']}, "
            f"programs compiled: {two['compiled']}")

        def keys_differ() -> dict[str, Any] | None:
            obj = bed.get_json("ccache", "llama-demo", NS) or {}
            cond = next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == "KeysMatch"), {})
            return cond if cond.get("status") == "False" else None
        keys = eventually(keys_differ, timeout=60, what="KeysMatch False after the two-device pod")
        say(f"  KeysMatch False ({keys['reason']}): {keys['message']}")
        used = usage() or used

        report = {
            "node": "real (kubelet + containerd)" if real else "simulated (node agent)",
            **setup,
            "bucket": status["bucket"],
            "cache": status["cache"],
            "warmup": pool,
            "nodes": {"warmer": pool.get("nodes") or [], "coldTraining": cold["node"], "warmTraining": warm["node"]},
            "injectedEnv": {k: v for k, v in warm["env"].items() if k.startswith("JAX_")},
            "cold": {"podToFirstStepSeconds": cold["pod_to_first_step_seconds"],
                     "firstStepSeconds": cold["first_step_seconds"], "compiled": cold["compiled"]},
            "warm": {"podToFirstStepSeconds": warm["pod_to_first_step_seconds"],
                     "firstStepSeconds": warm["first_step_seconds"], "cacheHits": warm["cache_hits"],
                     "compiled": warm["compiled"], "cacheDir": warm["cache_dir"]},
            "warmOverCold": ratio,
            "warmGoal": WARM_GOAL,
            "twoDevices": {"firstStepSeconds": two["first_step_seconds"], "cacheHits": two["cache_hits"],
                           "compiled": two["compiled"]},
            "usage": used,
            "keysMatch": {k: keys[k] for k in ("status", "reason", "message")},
            "demoSeconds": round(time.monotonic() - t_start, 1),
        }
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        b = status["bucket"]
        install_line = (f"operator      {setup['operatorPod']['image']} on {setup['operatorPod']['node']} "
                        f"(kubectl apply -k manifests/), images {', '.join(setup['images'])}" if real
                        else "operator      a local process under its ServiceAccount (--simulated)")
        print(f"""
cachewarm demo report
  {install_line}
  bucket        {b['url']}  location {b['location']}  class {b['storageClass']}
                entries deleted {b['deleteAfterDays']} d after a warmer last used them (customTime), soft delete {b['softDeleteDays']} d
  warmer Job    {pool['job']}: {pool['state']} on {warmer_nodes}, {pool['entriesWritten']} entries written, {pool['entriesFound']} found
  training pod  cold on {cold['node']}, warm on {warm['node']} (placed by kube-scheduler)
  wall time     {report['demoSeconds']} s, of which images {setup.get('imagesSeconds', 0)} s and cluster start {setup['clusterSeconds']} s
  cache         {status['cache']['entries']} entries, {status['cache']['bytes']} bytes
  injected env  {', '.join(f'{k}={v}' for k, v in report['injectedEnv'].items())}
  pod created   cold {cold['pod_to_first_step_seconds']} s (compiled {cold['compiled']}; the step itself {cold['first_step_seconds']} s)
   -> first     warm {warm['pod_to_first_step_seconds']} s (cache hits {warm['cache_hits']}, compiled {warm['compiled']}; the step itself {warm['first_step_seconds']} s, cache {warm['cache_dir']})
   step done    warm / cold {ratio} ({'within' if ratio <= WARM_GOAL else 'OVER'} the goal of {WARM_GOAL})
                two devices: the step itself {two['first_step_seconds']} s (cache hits {two['cache_hits']}, compiled {two['compiled']})
  usage         from the pods' reports: {used['pods']} pods, hits {used['hits']}, misses {used['misses']}, hit ratio {used['hitRatio']}, compile seconds saved {used['compileSecondsSaved']}
  KeysMatch     {keys['status']} ({keys['reason']}): {keys['message']}
  report        {args.report}
""")
        if warm["compiled"] != 0 or warm["cache_hits"] == 0:
            raise SystemExit("the warm pod compiled its own program: the cache was not hit")
        if not used["compileSecondsSaved"] > 0:
            raise SystemExit(f"status.usage.compileSecondsSaved is {used['compileSecondsSaved']}: no time saved")
        if ratio > WARM_GOAL:
            raise SystemExit(f"the warm pod took {ratio}x the cold one's time to its first step, over the goal of "
                             f"{WARM_GOAL}x (a busy machine slows the fixed costs: pod start, python, import jax)")
    finally:
        if operator is not None:
            operator.stop()
        bed.stop()


if __name__ == "__main__":
    main()
