"""Admission webhook latency and throughput, on the local control plane.

Two paths, each at several concurrency levels, a fixed number of requests per level:
  direct     AdmissionReview POSTs straight to the operator's webhook over HTTPS;
  apiserver  pod creations through kube-apiserver: labelled pods (sent to the webhook)
             against unlabelled pods (never sent), so the difference is the webhook's cost.

Run: .venv/bin/python bench/webhook.py [--requests 400] [--pods 150] [--json out.json]
(after `make bin`). Prints a Markdown table; everything runs on loopback and stops itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import platform
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client, config

from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm, repo_root


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(path: str, concurrency: int, latencies: list[float], wall: float, errors: int) -> dict[str, Any]:
    return {
        "path": path, "concurrency": concurrency, "requests": len(latencies), "errors": errors,
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2),
        "throughput_rps": round(len(latencies) / wall, 1),
    }


def review(namespace: str, cache: str, i: int) -> bytes:
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"bench-{i}", "namespace": namespace, "labels": {"cachewarm.dev/cache": cache}},
        "spec": {"containers": [
            {"name": "train", "image": "trainer:1", "command": ["python", "-m", "train"],
             "env": [{"name": f"V{j}", "value": "x" * 20} for j in range(10)]},
            {"name": "sidecar", "image": "logger:1"},
        ]},
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
        "operation": "CREATE", "userInfo": {"username": "bench"}, "object": pod}}).encode()


async def direct(url: str, ca: bytes, namespace: str, cache: str, concurrency: int, total: int) -> dict[str, Any]:
    ctx = ssl.create_default_context(cadata=ca.decode())
    latencies: list[float] = []
    errors = 0
    bodies = [review(namespace, cache, i) for i in range(total)]
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                body = queue.get_nowait()
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    payload = await resp.json()
                latencies.append(time.perf_counter() - t0)
                if resp.status != 200 or "patch" not in payload["response"]:
                    errors += 1
        # Warm the connection pool and the handler once before timing.
        async with session.post(url, data=bodies[0], headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize("direct HTTPS", concurrency, latencies, wall, errors)


def through_apiserver(api: client.CoreV1Api, namespace: str, cache: str | None, concurrency: int,
                      total: int) -> dict[str, Any]:
    label = {"cachewarm.dev/cache": cache} if cache else {}
    run = uuid.uuid4().hex[:6]

    def create(i: int) -> tuple[float, bool]:
        body = client.V1Pod(
            metadata=client.V1ObjectMeta(name=f"p-{run}-{i}", labels=label),
            spec=client.V1PodSpec(containers=[client.V1Container(name="train", image="trainer:1")]),
        )
        t0 = time.perf_counter()
        created = api.create_namespaced_pod(namespace, body)
        elapsed = time.perf_counter() - t0
        injected = any(e.name == "JAX_COMPILATION_CACHE_DIR" for e in created.spec.containers[0].env or [])
        return elapsed, injected == bool(cache)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(create, range(total)))
    wall = time.perf_counter() - t0
    path = "apiserver, labelled pod (webhook)" if cache else "apiserver, unlabelled pod (baseline)"
    return summarize(path, concurrency, [r[0] for r in results], wall, sum(1 for r in results if not r[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="direct requests per concurrency level")
    parser.add_argument("--pods", type=int, default=150, help="pod creations per level and kind")
    parser.add_argument("--concurrency", default="1,4,16,64", help="direct levels (apiserver uses those <= 16)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    exit_on_sigterm()

    bed = Testbed().start(controller_manager=True)
    operator = None
    try:
        assert bed.kubectl_run("apply", "-k", str(repo_root() / "manifests")).returncode == 0
        bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
        kubeconfig = bed.service_account_kubeconfig(
            "cachewarm-system", "cachewarm-operator", Path(tempfile.mkdtemp()) / "kubeconfig")
        operator = bed.start_operator(kubeconfig, {"CACHEWARM_LOG_LEVEL": "WARNING"})
        ns = "bench"
        bed.kubectl_run("create", "namespace", ns)
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "c"},
                   "spec": {"storage": {"gcs": {"bucket": "bench-cache", "location": "us-central1"}}}}, ns)
        eventually(lambda: bed.get_json("serviceaccount", "default", ns), what="default ServiceAccount")
        eventually(lambda: "True" in json.dumps((bed.get_json("ccache", "c", ns) or {}).get("status", {})),
                   what="cache Ready")
        cfg = bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
        assert cfg is not None
        ca = base64.b64decode(cfg["webhooks"][0]["clientConfig"]["caBundle"])

        results = []
        for level in levels:
            results.append(asyncio.run(direct(f"{operator.webhook_url}/inject-cache", ca, ns, "c", level,
                                              args.requests)))
        config.load_kube_config(str(bed.kubeconfig))
        api = client.CoreV1Api()
        through_apiserver(api, ns, "c", 1, 5)  # warm-up
        for level in [x for x in levels if x <= 16]:
            results.append(through_apiserver(api, ns, None, level, args.pods))
            results.append(through_apiserver(api, ns, "c", level, args.pods))
    finally:
        if operator is not None:
            operator.stop()
        bed.stop()

    print(f"\nmachine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
          f"cores: {__import__('os').cpu_count()}\n")
    print("| path | concurrency | requests | p50 ms | p99 ms | mean ms | throughput req/s | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['concurrency']} | {r['requests']} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{r['mean_ms']} | {r['throughput_rps']} | {r['errors']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if any(r["errors"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
