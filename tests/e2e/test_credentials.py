"""Credentials as in production, on the real node (issue 30): every GCS request of
cachewarm's pods carries a token from a metadata server, as on GKE with Workload Identity.

The testbed's metadata-server stand-in (cachewarm_testbed.metadata) runs on the node
address, where pods reach the GCS proxy too; pods find it by GCE_METADATA_HOST (and
GCE_METADATA_IP, where google-auth pings), set in the warmer's `warmup.env` and in the
training pods' spec, as STORAGE_EMULATOR_HOST is. The proxy checks the token of every
request on the cache's bucket (its auth mode) and answers 401 to a missing or dead one.
Through the operator installed from manifests/ (its own GCS client, google-cloud-storage,
sends no token to an emulator, so its requests are let through by their User-Agent: the one
place this is kinder than GCS, said in gcsproxy):

- the warmer (the training image's gcsfs, through google-auth's compute-engine
  credentials) writes the cache with tokens that live 2 s;
- a labelled pod that reads `gs://` directly (injection.readFrom Bucket; gcsfs under JAX)
  hits every program with such tokens;
- a labelled pod of an image without any GCS library gets the copier from the webhook; its
  tokens live 2 s but state an hour (revoked, or the clocks disagree), and the downloads
  are answered slowly, so the copy outlasts each token: the proxy answers 401 to the dead
  one, the copier fetches a new one and the copy completes; the program compiles nothing.

A copier that keeps its first token fails once it expires:
tests/integration/test_copier_credentials.py (it takes the copier's refresh away, which
only its own classes can do). What this cannot show: GKE's metadata server itself (its
Workload Identity exchange, the tokens it caches and hands out with what is left of their
lifetime, its refusals of a new pod's first requests) and GCS's IAM; here any token the
stand-in issued is good for any object of the bucket.

Needs root and `make node-deps`; one real node per machine.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from cachewarm_testbed import images, install
from cachewarm_testbed.cluster import Testbed, eventually, repo_root
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.metadata import MetadataControl, Server, serve
from cachewarm_testbed.realnode import NODE_IP, HostSnapshot, RealNode

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="a real kubelet and containerd need root"),
]

REPO = repo_root()
GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
OPERATOR_CLIENT = ["gcloud-python/"]  # google-cloud-storage's User-Agent: the operator's client


@dataclass
class Credentialed:
    bed: Testbed
    node: RealNode
    metadata: MetadataControl
    proxy: ProxyControl
    before: HostSnapshot

    def client_env(self) -> list[dict[str, str]]:
        """How this cluster's pods find GCS (the emulator) and their token (the stand-in)."""
        env = self.bed.env()
        return [*({"name": k, "value": env[k]} for k in GCS_ENV),
                {"name": "GCE_METADATA_HOST", "value": self.metadata.host},
                {"name": "GCE_METADATA_IP", "value": self.metadata.host}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Credentialed]:
    before = HostSnapshot.take()
    archives = images.build_all()
    bed = Testbed()
    stand_in: Server | None = None
    try:
        bed.start(controller_manager=True, real_node=True)
        node = bed.start_real_node()
        node.import_images(archives)
        env = bed.env()
        install.install_operator(bed, REPO / "manifests", {
            **{k: env[k] for k in GCS_ENV},
            "CACHEWARM_WARM_POLL_SECONDS": "2", "CACHEWARM_USAGE_FLUSH_SECONDS": "2",
        })
        # On the node address, where pods reach the GCS proxy; in this process, stopped below.
        stand_in = serve(NODE_IP, 0, lifetime=2)
        yield Credentialed(bed, node, MetadataControl(f"http://{NODE_IP}:{stand_in.server_address[1]}"),
                           ProxyControl(bed.storage_emulator_host), before)
    finally:
        if stand_in is not None:
            stand_in.shutdown()
            stand_in.server_close()
        bed.stop()


def finished(bed: Testbed, name: str, ns: str) -> dict[str, Any] | None:
    obj = bed.get_json("pod", name, ns) or {}
    return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None


def wait_warmed(bed: Testbed, name: str, ns: str) -> dict[str, Any]:
    def warmed() -> dict[str, Any] | None:
        obj = bed.get_json("ccache", name, ns) or {}
        conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
        if conds.get("Warmed", {}).get("reason") == "WarmupFailed":
            pytest.fail(f"warmup failed: {conds['Warmed']['message']}")
        return obj if conds.get("Warmed", {}).get("status") == "True" else None
    return eventually(warmed, timeout=300, what=f"cache {name} to be Warmed")


def programs_pod(name: str, cache: str, image: str, env: list[dict[str, str]]) -> dict[str, Any]:
    """demo/programs.py's ten programs in a pod labelled for `cache`; from /app, where the
    program is whatever the pod's PYTHONPATH."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": cache}},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "train", "image": image, "workingDir": "/app", "env": env,
                "command": ["python", "-m", "programs"]}]}}


def run_to_end(bed: Testbed, ns: str, pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the finished pod, its program's JSON line)."""
    name = pod["metadata"]["name"]
    bed.apply(pod, ns)
    done = eventually(lambda: finished(bed, name, ns), timeout=300, what=f"pod {name} to finish")
    logs = bed.kubectl_run("logs", name, "-n", ns, "-c", "train")
    assert done["status"]["phase"] == "Succeeded", (done["status"], logs.stdout[-3000:], logs.stderr[-3000:])
    [run] = [json.loads(line) for line in logs.stdout.splitlines() if line.startswith("{") and "cache_hits" in line]
    return done, run


def on_bucket(proxy: ProxyControl, bucket: str) -> list[dict[str, Any]]:
    """The requests on the bucket's objects that were not the operator's."""
    return [r for r in proxy.log() if f"/b/{bucket}/" in r["path"] and r.get("auth") != "exempt"]


def test_the_warmer_a_gs_reader_and_the_copier_use_expiring_tokens_and_the_copier_outlives_a_dead_one(
        cluster: Credentialed) -> None:
    bed, proxy, metadata = cluster.bed, cluster.proxy, cluster.metadata
    ns = f"cr-{uuid.uuid4().hex[:8]}"
    assert bed.kubectl_run("create", "namespace", ns).returncode == 0
    eventually(lambda: bed.get_json("serviceaccount", "default", ns), what="default ServiceAccount")
    bucket = f"creds-{uuid.uuid4().hex[:10]}"
    metadata.configure(lifetime=2)  # shorter than gcsfs's 5 min refresh buffer: a token per request
    proxy.clear_log()
    proxy.require_tokens(metadata.base_url, [bucket], OPERATOR_CLIENT)
    try:
        # The warmer: the training image's gcsfs, its token from the stand-in.
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "copy"},
                   "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1",
                                                "lifecycle": {"deleteAfterDays": 10}}},
                            "warmup": {"image": images.TRAIN_IMAGE, "targets": ["programs:targets"],
                                       "pools": [{"name": "cpu"}], "env": cluster.client_env()},
                            "injection": {"mode": "ReadOnly", "localCopy": {"workers": 2, "timeoutSeconds": 120}}}},
                  ns)
        warm = wait_warmed(bed, "copy", ns)
        [pool] = warm["status"]["warmup"]["pools"]
        assert pool["keyCount"] == 10, pool
        writes = [r for r in on_bucket(proxy, bucket) if r["method"] == "POST" and r["path"].startswith("/upload/")]
        assert len(writes) >= 10 and {(r["status"], r["auth"]) for r in writes} == {(200, "ok")}, writes
        assert not [r for r in on_bucket(proxy, bucket) if r["status"] == 401]

        # A gs:// reader (gcsfs under JAX, through etils), with the same tokens.
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "direct"},
                   "spec": {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1",
                                                "create": False}},
                            "injection": {"mode": "ReadOnly", "readFrom": "Bucket"}}}, ns)
        eventually(lambda: ((bed.get_json("ccache", "direct", ns) or {}).get("status") or {}).get("observedGeneration"),
                   what="cache direct reconciled")
        proxy.clear_log()
        done, run = run_to_end(bed, ns, programs_pod("direct", "direct", images.TRAIN_IMAGE, cluster.client_env()))
        env = {e["name"]: e.get("value") for e in done["spec"]["containers"][0]["env"]}
        assert env["JAX_COMPILATION_CACHE_DIR"] == f"gs://{bucket}/jax", env
        assert (run["cache_hits"], run["compiled"]) == (10, 0), run
        reads = [r for r in on_bucket(proxy, bucket) if r["method"] == "GET"]
        assert {r["auth"] for r in reads} == {"ok"}, reads  # a 404 of a name JAX looked for is fine
        # gcsfs reads an object's media at its JSON-API path (?alt=media), not /download/.
        assert len([r for r in reads if r["path"].endswith("-cache") and r["status"] == 200]) >= 10, reads

        # The copier: tokens that die at 2 s but say an hour, and downloads answered 2.5 s
        # late (after their token was checked, as GCS checks it on arrival), two at a time.
        metadata.configure(lifetime=2, advertised=3600)
        proxy.faults([{"method": "GET", "path": rf"^/download/storage/v1/b/{bucket}/", "hang": 2.5, "times": 10,
                       "forward": True}])
        proxy.clear_log()
        issued = len(metadata.log())
        done, run = run_to_end(bed, ns, programs_pod("copied", "copy", images.PLAIN_TRAIN_IMAGE, cluster.client_env()))
        copier_log = bed.kubectl_run("logs", "copied", "-n", ns, "-c", "cachewarm-copy")
        assert copier_log.returncode == 0, copier_log.stderr
        [summary] = [json.loads(line)["cachewarm-copier"] for line in copier_log.stdout.splitlines()
                     if "cachewarm-copier" in line]
        assert (summary["copied"], summary["failed"], summary["cold"], summary["auth"]) == (10, 0, False, "metadata"), \
            summary
        assert summary["tokensRefused"] >= 1 and summary["tokens"] == summary["tokensRefused"] + 1, summary
        assert len(metadata.log()) - issued == summary["tokens"]
        requests = on_bucket(proxy, bucket)
        refused = [r for r in requests if r["status"] == 401]
        assert refused and {(r["method"], r["auth"]) for r in refused} == {("GET", "expired")}, requests
        # The warmer packed the 10 small entries beside its manifest (issue 30): the copy is the
        # manifest and the pack, each a download answered 2.5 s late, one pack request for all 10.
        downloads = [r for r in requests if r["path"].startswith("/download/")]
        assert [r for r in downloads if r["path"].endswith("-cache")] == [], requests
        assert len([r for r in downloads if r["path"].endswith(".cachewarm-pack") and r["status"] == 200]) == 1, \
            requests
        assert (summary["packs"], summary["fromPack"]) == (1, 10), summary
        assert (run["cache_hits"], run["compiled"]) == (10, 0), run
    finally:
        proxy.allow_anonymous()
        proxy.clear_faults()
        metadata.configure(lifetime=2)


def test_stop_leaves_the_host_as_it_was(cluster: Credentialed) -> None:
    """Runs last: stopping the testbed leaves nothing of ours on the host (see test_real_install)."""
    cluster.bed.stop()
    assert cluster.before.differences(HostSnapshot.take()) == {}
