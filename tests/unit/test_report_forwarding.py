"""A follower forwards the reports that reach it to the leader and answers what the leader
answered: two Receivers through aiohttp, the leader's over TLS with a certificate of the
CA the follower serves (webhook.ServingTls, as the operator serves it), the TokenReview
answered by an in-memory client. The e2e test (tests/e2e/test_reports_ha.py) does it with
two operator processes and a real apiserver."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp.web
from aiohttp.test_utils import TestClient, TestServer

from cachewarm.admission import certificates as certs
from cachewarm.api.metrics import Metrics
from cachewarm.reports.receiver import FORWARDED_HEADER, PATH, Forwarder, Receiver
from cachewarm.reports.store import MAX_BODY_BYTES, Store
from cachewarm.admission.keeper import TlsMaterial
from cachewarm.admission.server import ServingTls
from memkube import MemoryKube
from reportdata import GOOD, REVIEW, bearer, labelled, token

NOW = dt.datetime.now(dt.timezone.utc)
SERVICE = "cachewarm-webhook.cachewarm-system.svc"
CA = certs.make_ca("cachewarm-webhook-ca", now=NOW)
SERVING = certs.make_serving_cert(CA, [SERVICE], now=NOW)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Replica:
    store: Store = field(default_factory=Store)
    metrics: Metrics = field(default_factory=Metrics)

    def reports(self, code: str) -> float:
        return float(self.metrics.reports.labels(code)._value.get())

    def forwarded(self, code: str) -> float:
        return float(self.metrics.reports_forwarded.labels(code)._value.get())


@asynccontextmanager
async def leader_at(port: int, leader: Replica, material: TlsMaterial) -> AsyncIterator[None]:
    """The leader's receiver over HTTPS on 127.0.0.1:`port`, serving `material`."""
    kube = MemoryKube()
    kube.reviews = {token("good"): REVIEW}
    receiver = Receiver(kube=kube, store=leader.store, metrics=leader.metrics, leading=lambda: True,
                        cache_exists=lambda ns, name: (ns, name) == ("ml", "llama"), pods=labelled())
    tls = ServingTls()
    tls.load(material)
    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.post(PATH, receiver.handle)])
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.context).start()
    try:
        yield
    finally:
        await runner.cleanup()


def exchange(requests: list[tuple[dict[str, str], bytes]], *, leader: Replica, follower: Replica,
             leader_address: Callable[[int], str | None] = lambda port: f"127.0.0.1:{port}",
             own_address: str = "127.0.0.1:1", ca: bytes = CA.cert_pem, server_hostname: str = SERVICE,
             material: TlsMaterial = TlsMaterial(SERVING.cert_pem, SERVING.key_pem, CA.cert_pem),
             leader_up: bool = True) -> list[tuple[int, dict[str, object], str | None]]:
    """POST each request to a follower whose leader listens (or not) at a port of its own;
    (status, JSON body, Retry-After) of each answer."""
    port = free_port()

    async def run() -> list[tuple[int, dict[str, object], str | None]]:
        forwarder = Forwarder(leader_address=lambda: leader_address(port), own_address=own_address,
                              ca=lambda: ca, server_hostname=server_hostname, metrics=follower.metrics)
        receiver = Receiver(kube=MemoryKube(), store=follower.store, metrics=follower.metrics, leading=lambda: False,
                            cache_exists=lambda ns, name: True, pods=labelled(), forwarder=forwarder)
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(PATH, receiver.handle)])
        answers = []
        async with TestClient(TestServer(app)) as http:
            async with (leader_at(port, leader, material) if leader_up else _nothing()):
                for headers, body in requests:
                    answer = await http.post(PATH, data=body, headers=headers)
                    answers.append((answer.status, await answer.json(), answer.headers.get("Retry-After")))
        await forwarder.close()
        return answers
    return asyncio.run(run())


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def test_the_follower_answers_what_the_leader_answered_and_only_the_leader_keeps_and_counts() -> None:
    leader, follower = Replica(), Replica()
    answers = exchange([
        (bearer("forged"), GOOD),   # the leader's review refuses it
        ({}, GOOD),                 # no token: refused by the follower itself, not forwarded
        (bearer("good"), GOOD),     # taken
        (bearer("good"), GOOD),     # too soon again: 429 with the leader's Retry-After
    ], leader=leader, follower=follower)
    assert [a[0] for a in answers] == [401, 401, 202, 429]
    assert "does not accept this token" in str(answers[0][1]["message"])
    assert answers[2][1] == {"accepted": True, "sequence": 1}
    assert answers[3][2] == "60"
    assert leader.store.usage("ml", "llama", dt.datetime.now(dt.timezone.utc)) is not None
    assert follower.store.caches() == []
    assert (leader.reports("202"), leader.reports("401"), leader.reports("429")) == (1, 1, 1)
    assert (follower.forwarded("202"), follower.forwarded("401"), follower.forwarded("429")) == (1, 1, 1)
    assert follower.reports("202") == 0  # counted where taken, the leader
    assert follower.reports("401") == 1  # the one without a token, answered here


def test_nothing_is_forwarded_twice_to_nobody_or_to_itself_nor_larger_than_a_report() -> None:
    leader, follower = Replica(), Replica()
    answers = exchange([({**bearer("good"), FORWARDED_HEADER: "1"}, GOOD),
                        (bearer("good"), b" " * (MAX_BODY_BYTES + 1))], leader=leader, follower=follower)
    assert [(a[0], a[2]) for a in answers] == [(503, "60"), (413, None)]
    assert "not forwarded again" in str(answers[0][1]["message"])
    for where in (lambda port: None, lambda port: "127.0.0.1:1"):  # not known; this replica (own_address)
        answers = exchange([(bearer("good"), GOOD)], leader=leader, follower=follower, leader_address=where)
        assert answers[0][0] == 503 and "knows no other replica" in str(answers[0][1]["message"])
    assert leader.reports("202") + leader.reports("503") + leader.reports("413") == 0
    assert follower.forwarded("202") == follower.forwarded("failed") == 0
    assert (follower.reports("503"), follower.reports("413")) == (3, 1)


def test_a_leader_not_reached_or_not_trusted_is_a_503_counted_as_failed() -> None:
    other_ca = certs.make_ca("someone-else", now=NOW)
    cases = {
        "down": {"leader_up": False},
        "another CA": {"ca": other_ca.cert_pem},
        "no CA": {"ca": b""},
        "another name": {"server_hostname": "elsewhere.example"},
        "served by another CA": {"material": TlsMaterial(
            (cert := certs.make_serving_cert(other_ca, [SERVICE], now=NOW)).cert_pem, cert.key_pem, other_ca.cert_pem)},
    }
    for why, how in cases.items():
        leader, follower = Replica(), Replica()
        answers = exchange([(bearer("good"), GOOD)], leader=leader, follower=follower, **how)  # type: ignore[arg-type]
        assert [(a[0], a[2]) for a in answers] == [(503, "60")], why
        assert "could not reach the leader" in str(answers[0][1]["message"]), why
        assert follower.forwarded("failed") == 1 and leader.reports("202") == 0, why


def test_the_ca_is_read_at_each_forward() -> None:
    """After a rotation to a new CA, the follower trusts the new one from its next forward."""
    leader, follower = Replica(), Replica()
    new_ca = certs.make_ca("rotated", now=NOW)
    new_cert = certs.make_serving_cert(new_ca, [SERVICE], now=NOW)
    served = [CA.cert_pem]
    port = free_port()

    async def run() -> list[int]:
        forwarder = Forwarder(leader_address=lambda: f"127.0.0.1:{port}", own_address="", ca=lambda: served[-1],
                              server_hostname=SERVICE, metrics=follower.metrics)
        receiver = Receiver(kube=MemoryKube(), store=follower.store, metrics=follower.metrics, leading=lambda: False,
                            cache_exists=lambda ns, name: True, pods=labelled(), forwarder=forwarder)
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post(PATH, receiver.handle)])
        codes = []
        async with TestClient(TestServer(app)) as http, \
                leader_at(port, leader, TlsMaterial(new_cert.cert_pem, new_cert.key_pem, new_ca.cert_pem)):
            codes.append((await http.post(PATH, data=GOOD, headers=bearer("good"))).status)
            served.append(new_ca.cert_pem)
            codes.append((await http.post(PATH, data=GOOD, headers=bearer("good"))).status)
        await forwarder.close()
        return codes
    assert asyncio.run(run()) == [503, 202]
