"""Admission webhook latency and throughput, on the local control plane, with every
comparison made within one run, in interleaved rounds.

Two paths, each at several concurrency levels:
  direct     AdmissionReview POSTs straight to the operator's webhook over HTTPS (every
             answer checked to carry a patch);
  apiserver  pod creations through kube-apiserver: labelled pods (sent to the webhook;
             each stored pod checked for the injected env) against unlabelled pods (never
             sent; the baseline), so the difference is the webhook's cost.

The work is split into `--rounds` rounds. In each round, at each apiserver level, a chunk of
unlabelled and a chunk of labelled pods are created, in the order unlabelled, labelled in
even rounds and labelled, unlabelled in odd ones (A B, B A, ...), so that the machine's drift
over the run hits both alike; a round's ratio labelled/unlabelled (of its p50 and of its
mean) is a paired one, and their median, min and max over the rounds are reported.

With --baseline REV, the operator of git revision REV (its operator/ unpacked, run with
PYTHONPATH at it; this tree's manifests/ installed) is the "before" side (and with
--revision REV2, REV2's operator the "after" side instead of this tree's): each round runs
both operators in turn (A B, then B A), one at a time on the same webhook port, each only
once its webhook answers with the CA that the webhook configuration names; per round and
level, after/before ratios of the direct path's and the labelled pods' p50 are reported.

Every side's turn starts its operator afresh, also when it ended the previous round: no
side enters a turn with the apiserver's connections to its webhook still open from the
last one (the one warm-up pod per turn opens one, for each side alike).

With --no-client-ca, a third side "after, no client CA" runs the after side's code
without CACHEWARM_ADMISSION_CLIENT_CA (as on GKE, where the apiserver cannot present a
webhook client certificate: the handshake asks for none) and with
CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER=--per-peer (every caller here is 127.0.0.1; the
default 16 would refuse the direct path's connections above 16). The sides' order is
A B C, then C B A.

Run: .venv/bin/python bench/webhook.py [--requests 400] [--pods 300] [--rounds 6]
     [--baseline REV [--revision REV2]] [--no-client-ca [--per-peer 256]] [--json out.json]
(after `make bin`). Prints Markdown tables; everything runs on loopback and stops itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import shutil
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client, config
from rounds import REPO, imported_from, order, paired, unpack

from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm
from cachewarm_testbed.processes import Proc, free_port

NS = "bench"
NO_CA = "after, no client CA"
KINDS = ("unlabelled", "labelled")
PATHS = {"direct": "direct HTTPS", "unlabelled": "apiserver, unlabelled pod (baseline)",
         "labelled": "apiserver, labelled pod (webhook)"}


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


class Chunk:
    """One timed batch: its latencies, wall time and errors."""

    def __init__(self, latencies: list[float], wall: float, errors: int) -> None:
        self.latencies, self.wall, self.errors = latencies, wall, errors

    @property
    def p50(self) -> float:
        return percentile(self.latencies, 0.5)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 0.99)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.latencies)


def pooled(path: str, concurrency: int, chunks: list[Chunk]) -> dict[str, Any]:
    """The chunks of one path and level over all rounds, as one row."""
    return summarize(path, concurrency, [x for c in chunks for x in c.latencies], sum(c.wall for c in chunks),
                     sum(c.errors for c in chunks))


def against(side: dict[str, dict[int, list[Chunk]]], before: dict[str, dict[int, list[Chunk]]],
            levels: list[int], api_levels: list[int]) -> dict[str, dict[str, Any]]:
    """Per-round ratios side/before of each path's and level's p50 and p99 (a chunk's p99
    is about its slowest request: 50 or fewer in a chunk)."""
    out: dict[str, dict[str, Any]] = {}
    for stat in ("p50", "p99"):
        for path, names in (("direct", levels), ("labelled", api_levels), ("unlabelled", api_levels)):
            for level in names:
                out[f"{path} {stat}, concurrency {level}"] = paired(
                    [getattr(c, stat) for c in side[path][level]], [getattr(c, stat) for c in before[path][level]])
    return out


# As the apiserver's ServiceAccount admission leaves a pod that takes its token, before any
# webhook: the projected kube-api-access volume, mounted in each container. Without it the
# webhook (since issue 28's token opt-out) takes the pod for one that opted out of tokens
# and adds no reporter: a smaller patch than a real pod's, so not the same work.
API_TOKEN_MOUNT = {"name": "kube-api-access-7x2kq", "readOnly": True,
                   "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
API_TOKEN_VOLUME = {"name": "kube-api-access-7x2kq", "projected": {"sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}


def review(namespace: str, cache: str, i: int) -> bytes:
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"bench-{i}", "namespace": namespace, "labels": {"cachewarm.dev/cache": cache}},
        "spec": {"containers": [
            {"name": "train", "image": "trainer:1", "command": ["python", "-m", "train"],
             "env": [{"name": f"V{j}", "value": "x" * 20} for j in range(10)], "volumeMounts": [API_TOKEN_MOUNT]},
            {"name": "sidecar", "image": "logger:1", "volumeMounts": [API_TOKEN_MOUNT]},
        ], "volumes": [API_TOKEN_VOLUME]},
    }
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
        "operation": "CREATE", "userInfo": {"username": "bench"}, "object": pod}}).encode()


def as_apiserver(ca: bytes, client_cert: tuple[Path, Path]) -> ssl.SSLContext:
    """A client context that trusts the webhook's CA and presents the apiserver's webhook
    client certificate, as the apiserver does (a side that asks for none never sees it)."""
    ctx = ssl.create_default_context(cadata=ca.decode())
    ctx.load_cert_chain(*map(str, client_cert))
    return ctx


async def direct(url: str, ca: bytes, namespace: str, cache: str, concurrency: int, total: int,
                 client_cert: tuple[Path, Path]) -> Chunk:
    ctx = as_apiserver(ca, client_cert)
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
    return Chunk(latencies, wall, errors)


def through_apiserver(api: client.CoreV1Api, namespace: str, cache: str | None, concurrency: int,
                      total: int) -> Chunk:
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
    return Chunk([r[0] for r in results], wall, sum(1 for r in results if not r[1]))


def quiet(pid: int, window: float = 0.5, share: float = 0.05) -> bool:
    """Whether process `pid` and its reaped children used less than `share` of a core over
    the next `window` seconds (an operator's start-up work, e.g. compiling the pods' boot
    files in a child, is over)."""
    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    before = used()
    time.sleep(window)
    return used() - before < share * window


class Operators:
    """One operator at a time, each side's own code, always on the same webhook port (the
    webhook configuration's URL stays; its caBundle is what the running one keeps there)."""

    def __init__(self, bed: Testbed, kubeconfig: Path, sides: dict[str, str | None],
                 side_env: dict[str, dict[str, str]]) -> None:
        self.bed, self.kubeconfig, self.sides, self.side_env = bed, kubeconfig, sides, side_env
        port, reports_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{port}"
        # One report URL for both sides (a patch of the same size); a side without a
        # reports listener of its own never takes a report here anyway.
        self.env = {"CACHEWARM_LOG_LEVEL": "WARNING", "CACHEWARM_WEBHOOK_PORT": str(port),
                    "CACHEWARM_WEBHOOK_URL": self.url, "CACHEWARM_REPORTS_PORT": str(reports_port),
                    "CACHEWARM_REPORT_URL": f"https://127.0.0.1:{reports_port}/report/v1"}
        self.running: tuple[str, Proc] | None = None
        self.ca = b""
        self.patch_bytes: dict[str, int] = {}  # per side: the size of its patch (base64 JSON Patch) for review()

    def use(self, side: str) -> None:
        """Side `side`'s operator started afresh (also when it is the one running: no side
        keeps the apiserver's open connections from its last turn) and its webhook the one
        the apiserver calls."""
        self.stop()
        pythonpath = self.sides[side]
        proc = self.bed.start_operator(self.kubeconfig, {**self.env, **({"PYTHONPATH": pythonpath}
                                                                       if pythonpath else {}),
                                                         **self.side_env.get(side, {})})
        self.running = (side, proc)
        self.ca = eventually(self._answering, timeout=60, what=f"the {side} operator's webhook, by the configured CA")
        eventually(lambda: quiet(proc.pid), timeout=60, what=f"the {side} operator idle after its start")

    def _answering(self) -> bytes | None:
        """The configured CA, once the running webhook's certificate verifies with it and
        it answers a review with a patch."""
        cfg = self.bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
        bundle = (cfg or {}).get("webhooks", [{}])[0].get("clientConfig", {}).get("caBundle")
        if not bundle:
            return None
        ca = base64.b64decode(bundle)
        request = urllib.request.Request(f"{self.url}/inject-cache", data=review(NS, "c", 0), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5,  # noqa: S310 - our own loopback webhook
                                        context=as_apiserver(ca, self.bed.webhook_client_cert)) as answer:
                patch = json.loads(answer.read())["response"].get("patch")
        except (OSError, ssl.SSLError, KeyError, ValueError):
            return None
        if not patch:
            return None
        assert self.running is not None
        self.patch_bytes[self.running[0]] = len(base64.b64decode(patch))
        return ca

    def stop(self) -> None:
        if self.running is not None:
            self.running[1].stop()
            self.running = None


Chunks = dict[str, dict[str, dict[int, list[Chunk]]]]  # [side][path][level]: one Chunk per round


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="direct requests per concurrency level (all rounds)")
    parser.add_argument("--pods", type=int, default=300, help="pod creations per level and kind (all rounds)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", default="1,4,16,64", help="direct levels (apiserver uses those <= 16)")
    parser.add_argument("--baseline", help="git revision whose operator is the 'before' side (default: none)")
    parser.add_argument("--revision", help="git revision whose operator is the 'after' side (default: this tree)")
    parser.add_argument("--no-client-ca", action="store_true",
                        help=f"add the side '{NO_CA}': the after side's code, no admission client CA")
    parser.add_argument("--per-peer", type=int, default=256,
                        help=f"CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER of the side '{NO_CA}'")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def resolve_sides(args: argparse.Namespace) -> tuple[dict[str, str | None], dict[str, dict[str, str]],
                                                     dict[str, Any], list[Path]]:
    """Each side's PYTHONPATH (None: this tree's), its extra operator env, what it runs
    (commit, where cachewarm imports from), and the unpacked trees to remove after."""
    sides: dict[str, str | None] = {}
    trees: list[Path] = []
    meta: dict[str, Any] = {}
    for side, rev in (("after", args.revision), ("before", args.baseline)):
        if side == "after" and rev is None:
            sides[side] = None
            meta[side] = {"commit": "this tree", "cachewarm_from": imported_from(None)}
        elif rev is not None:
            tree, commit = unpack(rev, ("operator",))
            trees.append(tree)
            sides[side] = str(tree / "operator")
            meta[side] = {"commit": commit, "cachewarm_from": imported_from(sides[side])}
            assert meta[side]["cachewarm_from"].startswith(str(tree)), meta
    side_env: dict[str, dict[str, str]] = {}
    if args.no_client_ca:
        # After "after", before "before": the order A B C, C B A keeps the two after sides apart.
        sides = {"after": sides["after"], NO_CA: sides["after"],
                 **{k: v for k, v in sides.items() if k != "after"}}
        # Empty: the setting's default (no client CA), over the testbed's start_operator's.
        meta[NO_CA] = {**meta["after"], "env": {"CACHEWARM_ADMISSION_CLIENT_CA": "",
                                                "CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER": str(args.per_peer)}}
        side_env[NO_CA] = meta[NO_CA]["env"]
    return sides, side_env, meta, trees


def measure(args: argparse.Namespace, sides: dict[str, str | None], side_env: dict[str, dict[str, str]],
            levels: list[int], api_levels: list[int]) -> tuple[Chunks, list[dict[str, Any]], dict[str, int]]:
    """The rounds, on a testbed of their own: the chunks, the machine's load average at the
    start of each side's turn, and each side's patch size."""
    chunks: Chunks = {side: {path: {} for path in PATHS} for side in sides}
    loads: list[dict[str, Any]] = []
    bed = Testbed().start(controller_manager=True)
    operators = None
    try:
        assert bed.kubectl_run("apply", "-k", str(REPO / "manifests")).returncode == 0
        bed.kubectl_run("wait", "--for=condition=Established", "crd/compilationcaches.cachewarm.dev")
        kubeconfig = bed.service_account_kubeconfig(
            "cachewarm-system", "cachewarm-operator", Path(tempfile.mkdtemp()) / "kubeconfig")
        operators = Operators(bed, kubeconfig, sides, side_env)
        bed.kubectl_run("create", "namespace", NS)
        # The cache first: an operator counts as up once its webhook patches a pod of it.
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "c"},
                   "spec": {"storage": {"gcs": {"bucket": "bench-cache", "location": "us-central1"}}}}, NS)
        operators.use("after")
        eventually(lambda: bed.get_json("serviceaccount", "default", NS), what="default ServiceAccount")
        eventually(lambda: "True" in json.dumps((bed.get_json("ccache", "c", NS) or {}).get("status", {})),
                   what="cache Ready")
        config.load_kube_config(str(bed.kubeconfig))  # type: ignore[no-untyped-call]
        api = client.CoreV1Api()

        for i in range(args.rounds):
            for side in order(i, list(sides)):
                operators.use(side)  # afresh, for every side's every turn
                through_apiserver(api, NS, "c", 1, 5)  # warm-up: the apiserver's connection to this webhook
                loads.append({"round": i + 1, "side": side, "loadavg": os.getloadavg()})
                print(f"round {i + 1}/{args.rounds}: {side}; load average {loads[-1]['loadavg']}",
                      file=sys.stderr, flush=True)
                for level in levels:
                    chunks[side]["direct"].setdefault(level, []).append(asyncio.run(direct(
                        f"{operators.url}/inject-cache", operators.ca, NS, "c", level, args.requests // args.rounds,
                        bed.webhook_client_cert)))
                for level in api_levels:
                    for kind in order(i, KINDS):
                        chunks[side][kind].setdefault(level, []).append(through_apiserver(
                            api, NS, "c" if kind == "labelled" else None, level, args.pods // args.rounds))
    finally:
        if operators is not None:
            operators.stop()
        bed.stop()
    return chunks, loads, operators.patch_bytes if operators is not None else {}


def report_side(side: str, chunks: Chunks, levels: list[int], api_levels: list[int]) -> dict[str, Any]:
    """One side's pooled rows and its labelled/unlabelled ratios, printed and returned."""
    rows = [pooled(PATHS["direct"], level, chunks[side]["direct"][level]) for level in levels]
    for level in api_levels:
        rows += [pooled(PATHS[kind], level, chunks[side][kind][level]) for kind in KINDS]
    webhook_cost = {
        level: {"p50": paired([c.p50 for c in chunks[side]["labelled"][level]],
                              [c.p50 for c in chunks[side]["unlabelled"][level]]),
                "mean": paired([c.mean for c in chunks[side]["labelled"][level]],
                               [c.mean for c in chunks[side]["unlabelled"][level]])}
        for level in api_levels}
    print("| path | concurrency | requests | p50 ms | p99 ms | mean ms | throughput req/s | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['concurrency']} | {r['requests']} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{r['mean_ms']} | {r['throughput_rps']} | {r['errors']} |")
    print("\n| concurrency | labelled/unlabelled p50, per round | median | min | max "
          "| labelled/unlabelled mean: median | min | max |")
    print("|---|---|---|---|---|---|---|---|")
    for level, cost in webhook_cost.items():
        p50, mean = cost["p50"], cost["mean"]
        print(f"| {level} | {', '.join(str(x) for x in p50['ratios'])} | {p50['median']} | {p50['min']} | "
              f"{p50['max']} | {mean['median']} | {mean['min']} | {mean['max']} |")
    print()
    return {"rows": rows, "labelled_over_unlabelled": webhook_cost}


def main() -> None:
    args = arguments()
    levels = [int(x) for x in args.concurrency.split(",")]
    api_levels = [x for x in levels if x <= 16]
    exit_on_sigterm()
    sides, side_env, meta, trees = resolve_sides(args)
    try:
        chunks, loads, patch_bytes = measure(args, sides, side_env, levels, api_levels)
    finally:
        for tree in trees:
            shutil.rmtree(tree, ignore_errors=True)

    result: dict[str, Any] = {"rounds": args.rounds, "requests_per_round": args.requests // args.rounds,
                              "pods_per_round": args.pods // args.rounds, **meta, "sides": {}, "loads": loads}
    print(f"\nmachine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
          f"cores: {os.cpu_count()}; {args.rounds} rounds; 1-min load average at the turns' starts: "
          f"{min(x['loadavg'][0] for x in loads):.2f}-{max(x['loadavg'][0] for x in loads):.2f}\n")
    for side in sides:
        print(f"### {side} ({meta[side]['commit']}; its patch for the direct path's pod: "
              f"{patch_bytes.get(side)} bytes)\n")
        result["sides"][side] = {**report_side(side, chunks, levels, api_levels), "patch_bytes": patch_bytes.get(side)}
    for side in sides:
        if side != "before" and "before" in sides:
            versus = against(chunks[side], chunks["before"], levels, api_levels)
            result.setdefault("over_before", {})[side] = versus
            print(f"| {side} / before | per round | median | min | max |\n|---|---|---|---|---|")
            for name, ratio in versus.items():
                print(f"| {name} | {', '.join(str(x) for x in ratio['ratios'])} | {ratio['median']} | "
                      f"{ratio['min']} | {ratio['max']} |")
            print()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if any(r["errors"] for s in result["sides"].values() for r in s["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
