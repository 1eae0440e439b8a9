"""What the admission policies cost a CompilationCache's author: create and update latency
through the real kube-apiserver with cachewarm's ValidatingAdmissionPolicies bound (as
`kubectl apply -k manifests/` installs them) against the same policies with their bindings
removed, in one run, in interleaved rounds (with, without; then without, with; ...), so that
the machine's drift hits both sides alike and a round's ratio is a paired one.

The requests are the ones the policy `cachewarm-cache-authors` judges with both of its
authorizer checks: a user bound to the built-in `edit` role (aggregated by the real
kube-controller-manager) and to cachewarm-serviceaccount-user, in a namespace labelled
cachewarm.dev/serviceaccounts=restricted, creates caches with spec.warmup naming the
ServiceAccount `writer` (create jobs.batch and use serviceaccounts/writer are asked of the
authorizer, both allowed), then changes each one's spec.warmup.image (a merge patch: an
update the policy matches, the same two checks). One request at a time; no operator runs,
so nothing else writes to the caches. Each side's turn starts with warm-up requests that
are not counted, once a probe proved the policy is (or is no longer) enforced: an
author-only user's server-side dry run of a cache with warmers is refused with the
bindings, admitted without.

Run: .venv/bin/python bench/admission_policy.py [--requests 300] [--rounds 10] [--json out.json]
     (after `make bin`; --requests is per side and per operation; stops everything itself)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from rounds import REPO, difference, order, paired

from cachewarm_testbed.cluster import Testbed, eventually, exit_on_sigterm

NS = "bench-authors"
GROUP, VERSION, PLURAL = "cachewarm.dev", "v1alpha1", "compilationcaches"
SIDES = ("with policies", "without bindings")
BINDINGS = "app.kubernetes.io/name=cachewarm"


def cache(name: str, side: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompilationCache",
            "metadata": {"name": name, "labels": {"bench-side": side}},
            "spec": {"storage": {"gcs": {"bucket": "bench-authors", "prefix": name, "location": "us-central1",
                                         "create": False}},
                     "warmup": {"image": "demo/train:1", "targets": ["train:targets"], "pools": [{"name": "cpu"}],
                                "serviceAccountName": "writer"}}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stats(latencies: list[float]) -> dict[str, float]:
    return {"requests": len(latencies), **{f"p{int(q * 100)}_ms": round(percentile(latencies, q) * 1000, 2)
                                           for q in (0.5, 0.95, 0.99)},
            "mean_ms": round(statistics.fmean(latencies) * 1000, 2)}


def kubectl(bed: Testbed, *args: str, body: str | None = None) -> str:
    done = bed.kubectl_run(*args, input=body)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def user_api(bed: Testbed, name: str, *cluster_roles: str) -> client.CustomObjectsApi:
    """The CustomObjectsApi of ServiceAccount NS/name, bound to `cluster_roles` in NS."""
    kubectl(bed, "create", "serviceaccount", name, "-n", NS)
    for role in cluster_roles:
        kubectl(bed, "create", "rolebinding", f"{name}-{role}", f"--clusterrole={role}",
                f"--serviceaccount={NS}:{name}", "-n", NS)
    path = bed.service_account_kubeconfig(NS, name, Path(tempfile.mkdtemp()) / "kubeconfig")
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)  # type: ignore[no-untyped-call]
    return client.CustomObjectsApi(client.ApiClient(configuration))


def setup(bed: Testbed) -> tuple[client.CustomObjectsApi, client.CustomObjectsApi, str]:
    """manifests/ installed, the restricted namespace and its users; returns the editor's
    and the author-only user's API, and the bindings as they were installed (YAML)."""
    kubectl(bed, "apply", "-k", str(REPO / "manifests"))
    kubectl(bed, "wait", "--for=condition=Established", "--timeout=60s", "crd/compilationcaches.cachewarm.dev")
    kubectl(bed, "create", "namespace", NS)
    kubectl(bed, "create", "serviceaccount", "writer", "-n", NS)
    kubectl(bed, "label", "namespace", NS, "cachewarm.dev/serviceaccounts=restricted")
    editor = user_api(bed, "editor", "edit", "cachewarm-serviceaccount-user")
    author = user_api(bed, "author", "cachewarm-edit")
    listed = json.loads(kubectl(bed, "get", "validatingadmissionpolicybindings", "-l", BINDINGS, "-o", "json"))
    bindings = [{"apiVersion": b["apiVersion"], "kind": b["kind"],
                 "metadata": {"name": b["metadata"]["name"], "labels": b["metadata"].get("labels", {})},
                 "spec": b["spec"]} for b in listed["items"]]
    assert any(b["metadata"]["name"] == "cachewarm-cache-authors" for b in bindings), bindings

    def edit_aggregated() -> bool | None:  # kube-controller-manager aggregates cachewarm-edit into edit
        try:
            editor.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, cache("aggregated", "probe"),
                                                   dry_run="All")
            return True
        except client.ApiException:
            return None
    eventually(edit_aggregated, timeout=60, what="edit aggregates cachewarm-edit")
    return editor, author, yaml.safe_dump_all(bindings)


def enforced(author: client.CustomObjectsApi) -> bool:
    """Whether cachewarm-cache-authors is enforced now: the author-only user (no Jobs) is refused a cache with warmers."""
    try:
        author.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, cache("probe", "probe"), dry_run="All")
        return False
    except client.ApiException as exc:
        if exc.status == 403 and "cachewarm-cache-authors" in str(exc.body):
            return True
        raise


def switch(bed: Testbed, author: client.CustomObjectsApi, bindings: str, on: bool) -> None:
    if on:
        kubectl(bed, "apply", "-f", "-", body=bindings)
    else:
        kubectl(bed, "delete", "validatingadmissionpolicybindings", "-l", BINDINGS)
    # The apiserver picks up bindings from an informer: wait until the probe agrees.
    eventually(lambda: enforced(author) == on or None, timeout=60, what=f"policies {'on' if on else 'off'}")


def turn(api: client.CustomObjectsApi, side: str, round_index: int, count: int,
         warmup: int) -> tuple[list[float], list[float]]:
    """`warmup` uncounted creates and updates, then `count` timed creates, then an update
    of each; then this turn's caches are deleted (not timed)."""
    tag = f"{'w' if side == SIDES[0] else 'o'}{round_index}"
    creates: list[float] = []
    updates: list[float] = []
    names = [f"{tag}-x{i}" for i in range(warmup)] + [f"{tag}-{i}" for i in range(count)]
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, cache(name, tag))
        if i >= warmup:
            creates.append(time.perf_counter() - t0)
    for i, name in enumerate(names):
        patch = {"spec": {"warmup": {"image": "demo/train:2"}}}
        t0 = time.perf_counter()
        api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, patch)
        if i >= warmup:
            updates.append(time.perf_counter() - t0)
    api.delete_collection_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, label_selector=f"bench-side={tag}")
    return creates, updates


def policy_checks(bed: Testbed) -> dict[str, dict[str, float]]:
    """The apiserver's own time evaluating a policy's validations (CEL and authorizer calls,
    no network or storage): apiserver_validating_admission_policy_check_duration_seconds.
    kube-apiserver 1.36 observes it only for a validation that refused (or failed to
    evaluate), once per such validation (k8s.io/apiserver's validating/dispatcher.go): here
    the probes' refusals, whose two validations (each with its authorizer check and its
    message) refuse; the admitted requests are not in it."""
    text = kubectl(bed, "get", "--raw", "/metrics")
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith(f"apiserver_validating_admission_policy_check_duration_seconds{suffix}"):
                policy = dict(re.findall(r'(\w+)="([^"]*)"', line)).get("policy", "?")
                into[policy] = into.get(policy, 0.0) + float(line.rsplit(" ", 1)[1])
    return {policy: {"evaluations": counts[policy], "mean_ms": round(sums[policy] / counts[policy] * 1000, 3)}
            for policy in sums if counts.get(policy)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bed = Testbed().start(controller_manager=True)
    try:
        editor, author, bindings = setup(bed)
        per_round = max(1, args.requests // args.rounds)
        data: dict[str, dict[str, list[list[float]]]] = {s: {"create": [], "update": []} for s in SIDES}
        loads: list[float] = []
        for r in range(args.rounds):
            for side in order(r, SIDES):
                switch(bed, author, bindings, side == SIDES[0])
                loads.append(os.getloadavg()[0])
                creates, updates = turn(editor, side, r, per_round, args.warmup)
                data[side]["create"].append(creates)
                data[side]["update"].append(updates)
                print(f"round {r} {side}: create p50 {percentile(creates, 0.5) * 1000:.2f} ms, "
                      f"update p50 {percentile(updates, 0.5) * 1000:.2f} ms", file=sys.stderr, flush=True)
        checks = policy_checks(bed)
    finally:
        bed.stop()
    result: dict[str, Any] = {"policy_checks": checks, "rounds": args.rounds, "per_round": per_round, "loads": [round(x, 2) for x in loads],
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                         f"{platform.python_implementation()} {platform.python_version()}"}
    for op in ("create", "update"):
        result[op] = {side: stats([x for chunk in data[side][op] for x in chunk]) for side in SIDES}
        with_p50 = [percentile(c, 0.5) for c in data[SIDES[0]][op]]
        without_p50 = [percentile(c, 0.5) for c in data[SIDES[1]][op]]
        result[op]["p50 ratio with/without, per round"] = paired(with_p50, without_p50)
        result[op]["p50 difference with - without, ms, per round"] = difference(with_p50, without_p50)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| operation | side | requests | p50 ms | p95 ms | p99 ms | mean ms |", "|---|---|---:|---:|---:|---:|---:|"]
    for op in ("create", "update"):
        for side in SIDES:
            s = result[op][side]
            lines.append(f"| {op} | {side} | {s['requests']} | {s['p50_ms']} | {s['p95_ms']} | {s['p99_ms']} "
                         f"| {s['mean_ms']} |")
    lines.append("")
    lines.append("| operation | p50 ratio with/without (median, min, max over rounds) | p50 difference ms (median, min, max) |")
    lines.append("|---|---|---|")
    for op in ("create", "update"):
        ratio = result[op]["p50 ratio with/without, per round"]
        diff = result[op]["p50 difference with - without, ms, per round"]
        lines.append(f"| {op} | {ratio['median']} ({ratio['min']}, {ratio['max']}) "
                     f"| {diff['median']} ({diff['min']}, {diff['max']}) |")
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="timed creates (and as many updates) per side")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds the requests are split into")
    parser.add_argument("--warmup", type=int, default=10, help="uncounted creates and updates at each turn's start")
    parser.add_argument("--json", type=Path, help="also write the result here")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    exit_on_sigterm()
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nmachine: {result['machine']}; {args.rounds} rounds of {result['per_round']} creates and "
          f"{result['per_round']} updates per side, one at a time; 1-min load average at the turns' starts: "
          f"{result['loads']}")
    for policy, check in sorted(result["policy_checks"].items()):
        print(f"apiserver's own evaluation of {policy}, refusing validations only: {check['evaluations']:.0f}, "
              f"mean {check['mean_ms']} ms (apiserver_validating_admission_policy_check_duration_seconds)")


if __name__ == "__main__":
    main()
