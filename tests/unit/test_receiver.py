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
from cachewarm.reports.receiver import PATH, Receiver
from cachewarm.reports.store import Store
from memkube import MemoryKube
from reportdata import GOOD, REPORT, REVIEW, bearer



def exchange(kube: MemoryKube, requests: list[tuple[dict[str, str], bytes]], leading: bool = True,
             caches: tuple[tuple[str, str], ...] = (("ml", "llama"),)) -> tuple[list[int], Metrics, Store]:
    metrics, store = Metrics(), Store()

    async def run() -> list[int]:
        receiver = Receiver(kube=kube, store=store, metrics=metrics, leading=lambda: leading,
                            cache_exists=lambda ns, name: (ns, name) in caches)
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
    kube.reviews = {"good": REVIEW, "other-audience": {**REVIEW, "audiences": ["https://kubernetes.default.svc"]}}
    codes, metrics, store = exchange(kube, [
        ({}, GOOD),                                   # no token
        (bearer("forged"), GOOD),                     # not authenticated
        (bearer("other-audience"), GOOD),             # authenticated, but not for cachewarm
        (bearer("good"), b"{}"),                      # malformed
        (bearer("good"), json.dumps({**REPORT, "cache": "gone"}).encode()),  # no such cache
        (bearer("good"), GOOD),                       # taken
    ])
    assert codes == [401, 401, 401, 400, 404, 202]
    assert store.usage("ml", "llama", dt.datetime.now(dt.timezone.utc)) is not None
    assert metrics.cache_hits.labels("ml", "llama")._value.get() == 2.0
    # One review per distinct token: the accepted one is not reviewed again.
    assert kube.calls.count("review_token") == 3


def test_a_follower_and_a_failed_review_answer_503() -> None:
    assert exchange(MemoryKube(), [(bearer("good"), GOOD)], leading=False)[0] == [503]
    kube = MemoryKube()
    kube.fail["review_token"] = KubeError("reviewing a report's token: 500 Internal Server Error", 500)
    assert exchange(kube, [(bearer("good"), GOOD)])[0] == [503]


def test_an_accepted_token_for_another_pod_is_forbidden() -> None:
    kube = MemoryKube()
    kube.reviews = {"theirs": {**REVIEW, "user": {**REVIEW["user"], "extra": {
        "authentication.kubernetes.io/pod-name": ["trainer-2"], "authentication.kubernetes.io/pod-uid": ["u-2"]}}}}
    codes, metrics, store = exchange(kube, [(bearer("theirs"), GOOD)])
    assert codes == [403] and store.caches() == []
    assert metrics.cache_hits.labels("ml", "llama")._value.get() == 0.0
