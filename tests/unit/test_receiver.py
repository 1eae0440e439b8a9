"""POST /report/v1 through aiohttp, with the apiserver's TokenReview answered by an
in-memory client: each refusal in its order, and a report taken once it passes them all
(the e2e test does the same against a real apiserver's TokenReview)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import aiohttp.web
from aiohttp.test_utils import TestClient, TestServer

from cachewarm.clients.kube import KubeError
from cachewarm.api.metrics import Metrics
from cachewarm.admission import certificates as certs
from cachewarm.admission.keeper import TlsMaterial
from cachewarm.admission.server import Limits, Listener, ServingTls
from cachewarm.reports.receiver import FORWARD_CONNECTIONS, PATH, Forwarder, Receiver
from cachewarm_testbed.processes import free_port
from cachewarm.reports.store import Store
from memkube import MemoryKube
from cachewarm.reports.store import LabelledPods, ReportError, check_token
from reportdata import GOOD, REPORT, REVIEW, bearer, labelled, token



def exchange(kube: MemoryKube, requests: list[tuple[dict[str, str], bytes]], leading: bool = True,
             caches: tuple[tuple[str, str], ...] = (("ml", "llama"),),
             pods: LabelledPods | None = None) -> tuple[list[int], Metrics, Store]:
    metrics, store = Metrics(), Store()

    async def run() -> list[int]:
        receiver = Receiver(kube=kube, store=store, metrics=metrics, leading=lambda: leading,
                            cache_exists=lambda ns, name: (ns, name) in caches,
                            pods=pods if pods is not None else labelled())
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(PATH, receiver.handle)])
        async with TestClient(TestServer(app)) as http:
            codes = []
            for headers, body in requests:
                answer = await http.post(PATH, data=body, headers=headers)
                codes.append(answer.status)
            return codes
    return asyncio.run(run()), metrics, store




def test_each_refusal_and_then_the_report_taken() -> None:
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW,
                    token("other-audience"): {**REVIEW, "audiences": ["https://kubernetes.default.svc"]}}
    codes, metrics, store = exchange(kube, [
        ({}, GOOD),                                   # no token
        (bearer("forged"), GOOD),                     # not authenticated
        (bearer("other-audience"), GOOD),             # authenticated, but not for cachewarm
        (bearer("good"), b"{}"),                      # malformed
        (bearer("good"), json.dumps({**REPORT, "cache": "other"}).encode()),  # not the cache of its label
        (bearer("good"), GOOD),                       # taken
    ])
    assert codes == [401, 401, 401, 400, 403, 202]
    assert store.usage("ml", "llama", dt.datetime.now(dt.timezone.utc)) is not None
    assert metrics.cache_hits.labels("ml", "llama")._value.get() == 2.0
    # One review per distinct token: the accepted one is not reviewed again.
    assert kube.calls.count("review_token") == 3


def test_a_pod_labelled_for_a_cache_that_does_not_exist_gets_404() -> None:
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}
    gone = json.dumps({**REPORT, "cache": "gone"}).encode()
    assert exchange(kube, [(bearer("good"), gone)], pods=labelled(("ml", "trainer", "u-1", "gone")))[0] == [404]
    assert kube.calls.count("review_token") == 0  # found out before the apiserver is asked


def test_a_report_counts_only_for_a_known_pod_labelled_for_its_cache() -> None:
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}
    for pods in (labelled(("ml", "trainer", "u-1", "mistral")),  # labelled for another cache
                 labelled(("ml", "trainer", "u-old", "llama")),  # a pod of that name, but another one (uid)
                 labelled(("ml", "other", "u-1", "llama")),      # not watched at all
                 LabelledPods("cachewarm.dev/cache")):
        codes, metrics, store = exchange(kube, [(bearer("good"), GOOD)], pods=pods)
        assert codes == [403] and store.caches() == []
        assert metrics.cache_hits.labels("ml", "llama")._value.get() == 0.0
    deleted = labelled()
    deleted.observe("DELETED", {"metadata": {"namespace": "ml", "name": "trainer", "uid": "u-1"}})
    assert exchange(kube, [(bearer("good"), GOOD)], pods=deleted)[0] == [403]
    # None of them cost a TokenReview: what the operator knows of its pods is checked first.
    assert kube.calls.count("review_token") == 0


def test_forged_tokens_naming_a_pod_the_operator_does_not_watch_never_reach_the_reviewer() -> None:
    kube = MemoryKube()  # reviews nothing: any review asked would be a 401
    unknown = {**REPORT, "pod": {"namespace": "ml", "name": "nobody", "uid": "u-x"}}
    forged = bearer("forged", **{"kubernetes.io": {"namespace": "ml", "pod": {"name": "nobody", "uid": "u-x"}}})
    codes, _, _ = exchange(kube, [(forged, json.dumps(unknown).encode())] * 20)
    assert codes == [403] * 20
    assert kube.calls.count("review_token") == 0
    # The same forgery naming the watched pod is reviewed (and refused by the apiserver).
    assert exchange(kube, [(bearer("forged"), GOOD)])[0] == [401]
    assert kube.calls.count("review_token") == 1


def test_a_token_that_cannot_pass_a_review_is_refused_without_one() -> None:
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}
    shapes = [
        {"Authorization": "Bearer not-a-jwt"},
        {"Authorization": "Bearer a.b.c"},                          # not base64url JSON
        bearer("good", aud=["https://kubernetes.default.svc"]),      # another audience
        bearer("good", aud="cachewarm", exp=1),                     # expired
        bearer("good", exp="4102444800"),                           # exp not a number
        bearer("good", **{"kubernetes.io": {"namespace": "ml"}}),   # not bound to a pod
    ]
    codes, _, _ = exchange(kube, [(h, GOOD) for h in shapes])
    assert codes == [401] * len(shapes)
    other_pod = bearer("good", **{"kubernetes.io": {"namespace": "ml", "pod": {"name": "x", "uid": "u-x"}}})
    assert exchange(kube, [(other_pod, GOOD)])[0] == [403]
    assert kube.calls.count("review_token") == 0


def test_check_token_accepts_a_projected_token_shape_and_returns_its_pod() -> None:
    assert check_token(token("t", aud="cachewarm"), now=0) == ("ml", "trainer", "u-1")
    try:
        check_token(token("t"), now=4102444800)
    except ReportError as exc:
        assert exc.status == 401 and "expired" in str(exc)
    else:
        raise AssertionError("an expired token passed")


def test_a_full_review_queue_answers_503_at_once() -> None:
    """With the queue full, a report that needs a review is answered 503 without one."""
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}

    async def run() -> list[int]:
        receiver = Receiver(kube=kube, store=Store(), metrics=Metrics(), leading=lambda: True,
                            cache_exists=lambda ns, name: True, pods=labelled(), review_queue=1)
        receiver._queued = 1  # one report already waits (a slow apiserver)
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(PATH, receiver.handle)])
        async with TestClient(TestServer(app)) as http:
            first = (await http.post(PATH, data=GOOD, headers=bearer("good"))).status
            receiver._queued = 0
            second = (await http.post(PATH, data=GOOD, headers=bearer("good"))).status
            return [first, second]
    assert asyncio.run(run()) == [503, 202]
    assert kube.calls.count("review_token") == 1


def test_a_follower_and_a_failed_review_answer_503() -> None:
    assert exchange(MemoryKube(), [(bearer("good"), GOOD)], leading=False)[0] == [503]
    kube = MemoryKube()
    kube.fail["review_token"] = KubeError("reviewing a report's token: 500 Internal Server Error", 500)
    assert exchange(kube, [(bearer("good"), GOOD)])[0] == [503]


def test_an_accepted_token_for_another_pod_is_forbidden() -> None:
    kube = MemoryKube()
    kube.reviews = {token("theirs"): {**REVIEW, "user": {**REVIEW["user"], "extra": {
        "authentication.kubernetes.io/pod-name": ["trainer-2"], "authentication.kubernetes.io/pod-uid": ["u-2"]}}}}
    codes, metrics, store = exchange(kube, [(bearer("theirs"), GOOD)])
    assert codes == [403] and store.caches() == []
    assert metrics.cache_hits.labels("ml", "llama")._value.get() == 0.0


def test_a_followers_forwards_stay_within_the_leaders_per_peer_cap() -> None:
    """Every report a follower forwards comes from its one address: a burst of them must
    not open more connections than the leader takes from one peer (they would be refused,
    and the pods answered 503). The leader here is a real listener whose per-peer cap is
    the follower's connection count, and answers slowly, so the burst overlaps."""
    now = dt.datetime.now(dt.timezone.utc)
    ca = certs.make_ca("cachewarm-webhook-ca", now=now)
    serving = certs.make_serving_cert(ca, ["leader.test"], now=now)
    tls = ServingTls()
    tls.load(TlsMaterial(serving.cert_pem, serving.key_pem, ca.cert_pem))

    async def slow(request: aiohttp.web.Request) -> aiohttp.web.Response:
        await request.read()
        await asyncio.sleep(0.2)  # held while the others arrive; nothing asserts on time
        return aiohttp.web.json_response({"accepted": True}, status=202)

    async def run() -> tuple[list[int], int]:
        port = free_port()
        listener = Listener(name="leader", addr="127.0.0.1", port=port, context=tls.reports_context,
                            routes={PATH: slow}, limits=Limits(max_connections_per_peer=FORWARD_CONNECTIONS))
        await listener.start()
        forwarder = Forwarder(leader_address=lambda: f"127.0.0.1:{port}", own_address="127.0.0.1:1",
                              ca=lambda: ca.cert_pem, server_hostname="leader.test", metrics=Metrics())
        try:
            answers = await asyncio.gather(*(forwarder.forward(f"127.0.0.1:{port}", GOOD, "Bearer x")
                                             for _ in range(3 * FORWARD_CONNECTIONS)))
            return [answer.status for answer in answers], listener.refused_per_peer
        finally:
            await forwarder.close()
            await listener.stop()
    statuses, refused = asyncio.run(run())
    assert statuses == [202] * (3 * FORWARD_CONNECTIONS) and refused == 0


TORCH = {"fxGraphHits": 3, "fxGraphMisses": 0, "fxGraphBypasses": 0, "aotAutogradHits": 2, "aotAutogradMisses": 0,
         "aotAutogradBypasses": 0, "compileSeconds": 1.5}


def test_a_torch_report_is_taken_and_a_malformed_torch_section_refused_before_any_review() -> None:
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}
    fingerprint = {"framework": "torch", "versions": {"torch": "2.15.0"}, "inductorEnv": {"TORCHINDUCTOR_X": "1"}}
    torch = {**REPORT, "counts": {**REPORT["counts"], "requests": 3, "hits": 3}, "torch": TORCH,
             "fingerprint": fingerprint}
    bad = {**torch, "torch": {**TORCH, "fxGraphHits": "3"}}
    codes, metrics, store = exchange(kube, [(bearer("good"), json.dumps(bad).encode()),
                                            (bearer("good"), json.dumps(torch).encode())])
    assert codes == [400, 202]
    assert kube.calls.count("review_token") == 1  # the malformed one never reached the apiserver
    usage = store.usage("ml", "llama", dt.datetime.now(dt.timezone.utc))
    assert usage is not None and usage["torch"]["fxGraphHits"] == 3 and usage["torch"]["pods"] == 1
    assert store.fingerprints("ml", "llama", dt.datetime.now(dt.timezone.utc)) == [("trainer", fingerprint)]
    # A torch report's hits are not added to the hits counter (whether they saved time is known
    # only against the warm: status.usage.torch and its gauges say them).
    assert metrics.cache_hits.labels("ml", "llama")._value.get() == 0.0
