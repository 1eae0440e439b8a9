"""Both HTTPS endpoints of a running operator under random requests (hypothesis): random
methods, paths, headers and bodies to the admission listener (as the apiserver, with its
client certificate, so the requests reach the handler) and to the reports listener
(random tokens, and the real token of a labelled pod with random reports). Only 2xx or
4xx come back, the operator stays up, and afterwards the cache's next reconcile completes
(a new generation observed in status) and its usage is written: nothing a caller sends
can stop the reconcile of a cache.

A 503 would be the reports listener's bounded TokenReview queue or a review the apiserver
could not make; one request at a time never fills the queue, and every random token fails
the local check before any review, so none is expected here and none is accepted."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually

pytestmark = pytest.mark.e2e

EXAMPLES = 300  # per endpoint; well under a minute in all on two shared cores
TOKEN_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)
HEADER_NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-ABCXYZ"), min_size=1, max_size=30)
HEADERS = st.dictionaries(
    st.one_of(HEADER_NAME, st.sampled_from(["Content-Type", "Content-Encoding", "Transfer-Encoding-X",
                                            "Authorization", "X-Cachewarm-Forwarded", "Expect"])),
    HEADER_VALUE, max_size=6)
PATHS = st.one_of(st.sampled_from(["/", "/inject-cache", "/report/v1", "/report/v1/", "/report", "/metrics",
                                   "//", "/inject-cache?x=1", "/%00", "/..%2f"]),
                  st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60).map(lambda p: "/" + p))
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                     max_size=4), max_leaves=20)
# Mostly in range, so that whole reports get past the schema; sometimes far out of it.
COUNT = st.one_of(st.integers(0, 1000), st.integers(-5, 2**65))
BODIES = st.one_of(st.binary(max_size=2048), JSONISH.map(lambda v: json.dumps(v).encode()))


def _context(bed: Testbed, client_cert: bool) -> ssl.SSLContext:
    cfg = bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "")
    assert cfg is not None
    context = ssl.create_default_context(cadata=base64.b64decode(cfg["webhooks"][0]["clientConfig"]["caBundle"])
                                         .decode())
    if client_cert:
        context.load_cert_chain(*map(str, bed.webhook_client_cert))
    return context


def send(url: str, context: ssl.SSLContext, method: str, path: str, headers: dict[str, str],
         body: bytes) -> int:
    """One request on its own connection; its status."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


def acceptable(status: int) -> bool:
    return 200 <= status < 300 or 400 <= status < 500


def review_around(obj: Any, namespace: str) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
        "operation": "CREATE", "userInfo": {"username": "fuzz"}, "object": obj}}).encode()


def test_random_requests_to_both_endpoints_get_2xx_or_4xx_and_the_cache_still_reconciles(
    operator: OperatorHandle, installed: Testbed, namespace: str,
) -> None:
    bed = installed
    assert bed.kubectl_run("create", "serviceaccount", "trainer", "-n", namespace).returncode == 0
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": f"fz-{uuid.uuid4().hex[:8]}", "location": "us-central1"}}}},
              namespace)
    eventually(lambda: (bed.get_json("ccache", "llama", namespace) or {}).get("status", {}).get("bucket"),
               what="the cache reconciled")
    bed.apply({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "trainer", "labels": {"cachewarm.dev/cache": "llama"}},
               "spec": {"serviceAccountName": "trainer", "nodeSelector": {"cachewarm.test/nowhere": "true"},
                        "containers": [{"name": "train", "image": "demo/train:1"}]}}, namespace)
    uid = bed.get_json("pod", "trainer", namespace)["metadata"]["uid"]  # type: ignore[index]
    made = bed.kubectl_run("create", "token", "trainer", "-n", namespace, "--audience=cachewarm", "--duration=10m",
                           "--bound-object-kind=Pod", "--bound-object-name=trainer", f"--bound-object-uid={uid}")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    admission, reports = _context(bed, client_cert=True), _context(bed, client_cert=False)
    seen: list[tuple[str, int]] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]),
           path=PATHS, headers=HEADERS, body=BODIES,
           pod=st.one_of(st.fixed_dictionaries({
               "metadata": st.fixed_dictionaries({"labels": st.one_of(
                   st.just({"cachewarm.dev/cache": "llama"}), JSONISH)}, optional={"name": JSONISH}),
               "spec": JSONISH}), st.none(), JSONISH))
    def admission_endpoint(method: str, path: str, headers: dict[str, str], body: bytes, pod: Any) -> None:
        # Half the bodies are reviews around a random pod (labelled for the cache or not),
        # so the handler gets past the envelope.
        if pod is not None and method == "POST":
            body = review_around(pod, namespace)
        status = send(operator.webhook_url, admission, method, path, headers, body)
        seen.append(("admission", status))
        assert acceptable(status), (method, path, headers, body[:200], status)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]), path=PATHS, headers=HEADERS,
           body=BODIES, bearer=st.one_of(st.just(token), st.none(), st.just(token), st.text(TOKEN_CHARS, max_size=300)),
           report=st.one_of(st.fixed_dictionaries({
               "version": st.sampled_from([1, 1, 1, 2, "1"]),
               "pod": st.one_of(st.just({"namespace": namespace, "name": "trainer", "uid": uid}), JSONISH,
                                st.just({"namespace": namespace, "name": "trainer", "uid": "0" * 36})),
               "cache": st.sampled_from(["llama", "llama", "other", "", "x" * 300]),
               "process": st.fixed_dictionaries({"pid": COUNT, "started": COUNT}),
               "sequence": COUNT,
               "counts": st.one_of(st.fixed_dictionaries({
                   "requests": COUNT, "hits": COUNT, "misses": COUNT, "compileSecondsSaved": st.floats(-1e10, 1e10),
                   "compileSecondsSpent": st.floats(-1, 1e10)}), JSONISH)},
               # Mostly absent: a random one is almost never valid, and would hide the rest.
               optional={"fingerprint": JSONISH, "localCopy": JSONISH, "final": st.booleans()}), st.none()))
    def reports_endpoint(method: str, path: str, headers: dict[str, str], body: bytes, bearer: str | None,
                         report: Any) -> None:
        if report is not None:
            body, path, method = json.dumps(report).encode(), "/report/v1", "POST"
        if bearer is not None:
            headers = {**headers, "Authorization": f"Bearer {bearer}"}
        status = send(operator.report_url, reports, method, path, headers, body)
        seen.append(("reports", status))
        assert acceptable(status), (method, path, headers, body[:200], status)

    admission_endpoint()
    reports_endpoint()
    # Both handlers were reached, not only refused at the door.
    assert ("admission", 200) in seen and any(s in (400, 401, 403) for e, s in seen if e == "reports"), seen

    # The operator is up, and the cache's next reconcile completes: a new generation is
    # observed, and a good report still lands in usage.
    assert operator.proc.alive()
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": {"storage": {"gcs": {"bucket": bed.get_json("ccache", "llama", namespace)["spec"]["storage"]
                                            ["gcs"]["bucket"], "location": "us-central1"}},  # type: ignore[index]
                        "jax": {"minCompileTimeSecs": 3}}}, namespace)
    generation = bed.get_json("ccache", "llama", namespace)["metadata"]["generation"]  # type: ignore[index]
    eventually(lambda: (bed.get_json("ccache", "llama", namespace) or {}).get("status", {})
               .get("observedGeneration") == generation, timeout=60, what=f"generation {generation} observed")
    good = {"version": 1, "pod": {"namespace": namespace, "name": "trainer", "uid": uid}, "cache": "llama",
            "process": {"pid": 99, "started": 1_763_900_000}, "sequence": 10**6,
            "counts": {"requests": 4, "hits": 3, "misses": 1, "compileSecondsSaved": 1.0,
                       "compileSecondsSpent": 1.0}}

    def taken() -> bool:
        status = send(operator.report_url, reports, "POST", "/report/v1",
                      {"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                      json.dumps({**good, "process": {"pid": 99 + len(seen), "started": 1_763_900_000}}).encode())
        seen.append(("final", status))
        return status == 202
    eventually(taken, timeout=30, what="a good report taken after the fuzz")
    eventually(lambda: ((bed.get_json("ccache", "llama", namespace) or {}).get("status") or {}).get("usage"),
               timeout=60, what="status.usage written after the fuzz")
