"""Reports with two replicas, as the Deployment runs them: the webhook Service sends a
report to either, and the follower forwards it to the leader (at the address the leader
names in the Lease, over TLS checked against the CA both serve) and answers the pod what
the leader answered. Through a real apiserver: the token is one it issued for the pod
(bound to the Pod object, audience cachewarm), the leader has it reviewed and writes
status.usage.

Two operator processes on this machine, each with its webhook on a loopback port of its
own (as two Pods have an IP each), on a control plane of their own (the Lease's name is
fixed by the manifests' Role; the session's operator would compete for it)."""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from cachewarm.runtime.leader import parse_identity
from cachewarm_testbed import install
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, scrape

pytestmark = pytest.mark.e2e

NS = "cachewarm-system"
SECRET = "cachewarm-webhook-tls"
ENV = {"CACHEWARM_RESYNC_SECONDS": "3", "CACHEWARM_RETRY_DELAY_SECONDS": "0.5",
       "CACHEWARM_GCS_TIMEOUT_SECONDS": "2", "CACHEWARM_GCP_PROJECT": "testbed",
       "CACHEWARM_POD_NAMESPACE": NS, "CACHEWARM_USAGE_FLUSH_SECONDS": "1",
       # Each replica would point the webhook configuration at its own port; no pod here
       # needs the webhook.
       "CACHEWARM_WEBHOOK_CONFIGURATION": ""}


@pytest.fixture(scope="module")
def bed(own_install: Testbed) -> Testbed:
    return own_install


def token(bed: Testbed, ns: str, pod_name: str) -> str:
    """A token as the kubelet projects it for the pod: audience cachewarm, bound to the Pod."""
    uid = bed.get_json("pod", pod_name, ns)["metadata"]["uid"]  # type: ignore[index]
    made = bed.kubectl_run("create", "token", "trainer", "-n", ns, "--audience=cachewarm", "--duration=10m",
                           "--bound-object-kind=Pod", f"--bound-object-name={pod_name}", f"--bound-object-uid={uid}")
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def report(bed: Testbed, ns: str, pod_name: str) -> bytes:
    uid = bed.get_json("pod", pod_name, ns)["metadata"]["uid"]  # type: ignore[index]
    return json.dumps({
        "version": 1, "pod": {"namespace": ns, "name": pod_name, "uid": uid}, "cache": "llama",
        "process": {"pid": 42, "started": 1_763_900_000, "index": 0}, "sequence": 1,
        "counts": {"requests": 4, "hits": 3, "misses": 1, "compileSecondsSaved": 9.5, "compileSecondsSpent": 1.25,
                   "lastMisses": [{"program": "jit_eval", "key": "jit_eval-" + "e" * 64}]}}).encode()


def post(bed: Testbed, replica: OperatorHandle, body: bytes, bearer: str,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST /report/v1 to this one replica, trusting only the CA of the Secret both serve."""
    secret = bed.get_json("secret", SECRET, NS)
    assert secret is not None
    context = ssl.create_default_context(cadata=base64.b64decode(secret["data"]["ca.crt"]).decode())
    request = urllib.request.Request(replica.report_url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {bearer}",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_report_reaching_the_follower_is_forwarded_to_the_leader_and_answered_as_the_leader_answers(
    bed: Testbed, tmp_path: Path,
) -> None:
    kubeconfig = bed.service_account_kubeconfig(NS, "cachewarm-operator", tmp_path / "kubeconfig")
    names = ("cachewarm-operator-0", "cachewarm-operator-1")
    replicas = {name: OperatorHandle(bed, kubeconfig, {**ENV, "CACHEWARM_POD_NAME": name}) for name in names}
    try:
        # The leader names where it takes reports: its own reports port.
        name, where = parse_identity(eventually(lambda: install.lease_identity(bed), timeout=30, what="a Lease holder"))
        leader = replicas[name]
        [follower] = [r for n, r in replicas.items() if n != name]
        assert where == urllib.parse.urlparse(leader.report_url).netloc
        assert where != urllib.parse.urlparse(follower.report_url).netloc

        ns = f"t-{uuid.uuid4().hex[:10]}"
        assert bed.kubectl_run("create", "namespace", ns).returncode == 0
        assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", ns).returncode == 0
        bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
                   "spec": {"storage": {"gcs": {"bucket": f"fwd-{uuid.uuid4().hex[:8]}", "location": "us-central1"}}}},
                  ns)

        def status() -> dict[str, Any]:
            return dict((bed.get_json("ccache", "llama", ns) or {}).get("status") or {})

        def usage_now() -> dict[str, Any] | None:
            return status().get("usage")
        eventually(lambda: status().get("bucket"), timeout=60, what="the cache reconciled")
        # A training pod that stays Pending (no node): only its identity matters.
        bed.apply({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "trainer-a", "labels": {"cachewarm.dev/cache": "llama"}},
                   "spec": {"serviceAccountName": "trainer", "nodeSelector": {"cachewarm.test/nowhere": "true"},
                            "containers": [{"name": "train", "image": "demo/train:1"}]}}, ns)
        good, mine = report(bed, ns, "trainer-a"), token(bed, ns, "trainer-a")

        # A forged token: the leader's review refuses it, and the follower relays its 401
        # (once the follower has read the Lease: until then it answers 503 itself).
        def forwarded_forged() -> tuple[int, dict[str, Any]] | None:
            got = post(bed, follower, good, "not-a-token")
            return got if got[0] != 503 else None
        forged = eventually(forwarded_forged, timeout=30, what="the follower forwarding")
        assert forged[0] == 401 and "not a ServiceAccount token" in forged[1]["message"], forged
        assert scrape(leader.metrics_url, "cachewarm_reports_total", code="401") == 1
        assert scrape(follower.metrics_url, "cachewarm_reports_total", code="401") == 0
        # A report forwarded already is answered by the follower itself, never sent on.
        again = post(bed, follower, good, mine, {"X-Cachewarm-Forwarded": "1"})
        assert again[0] == 503 and "not forwarded again" in again[1]["message"], again
        # Neither was taken: the leader counts a report before it answers, so its counter
        # says so now, with no wait for a usage flush (the usage written below holds the one
        # report taken, and only it).
        assert scrape(leader.metrics_url, "cachewarm_reports_total", code="202") == 0
        assert scrape(leader.metrics_url, "cachewarm_cache_hits_total", namespace=ns, cache="llama") == 0

        # The pod's report with its own token, to the follower: taken by the leader.
        taken = post(bed, follower, good, mine)
        assert taken == (202, {"accepted": True, "sequence": 1}), taken
        usage = eventually(usage_now, timeout=30, what="status.usage written by the leader")
        assert (usage["pods"], usage["compileRequests"], usage["hits"], usage["misses"]) == (1, 4, 3, 1)
        scope = {"namespace": ns, "cache": "llama"}
        assert scrape(leader.metrics_url, "cachewarm_cache_hits_total", **scope) == 3
        assert scrape(leader.metrics_url, "cachewarm_reports_total", code="202") == 1
        assert scrape(follower.metrics_url, "cachewarm_cache_hits_total", **scope) == 0
        assert scrape(follower.metrics_url, "cachewarm_reports_total", code="202") == 0
        assert scrape(follower.metrics_url, "cachewarm_reports_forwarded_total", code="202") == 1
        assert scrape(follower.metrics_url, "cachewarm_reports_forwarded_total", code="401") == 1

        # The leader dies; until its Lease runs out the follower cannot reach it: 503.
        os.kill(leader.pid, signal.SIGKILL)
        leader.proc.stop(timeout=5)
        lost = post(bed, follower, good, mine)
        assert lost[0] == 503 and "could not reach the leader" in lost[1]["message"], lost
        assert scrape(follower.metrics_url, "cachewarm_reports_forwarded_total", code="failed") == 1
        assert "Could not forward a report to the leader" in follower.log.read_text(errors="replace")
    finally:
        for handle in replicas.values():
            handle.stop()
