"""The operator's HTTPS listeners (admission/server.Listener) in process, over real TLS
sockets on loopback: a client that sends its headers or body too slowly, idles after an
answer, or comes past the connection cap is closed; the admission context refuses a
caller without the apiserver's client certificate in the handshake. Each refusal moves its
reason's series of cachewarm_listener_connections_dropped_total, and no other's.

Deadlines here are short (a fraction of a second) so a test ends quickly; the asserts
are on what happened (closed or answered, what was counted), never on how long it took:
counters are polled until they match or WAIT passes (the server counts a refusal as it
closes the connection, which the client may see first). A read that waits
WAIT seconds without the server closing is a failure: the defaults without these limits
(aiohttp's keep-alive of an hour, no header deadline) would hold the connection far
longer."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

import aiohttp.web
import pytest

from cachewarm.admission import certificates as certs
from cachewarm.admission.keeper import TlsMaterial
from cachewarm.admission.server import DROP_REASONS, Limits, Listener, RefusalLog, ServingTls
from cachewarm.api.metrics import Metrics
from cachewarm_testbed.processes import free_port

NOW = dt.datetime.now(dt.timezone.utc)
WAIT = 20.0  # far beyond any limit below
FAST = Limits(handshake_seconds=1.0, header_seconds=0.5, body_seconds=0.5, keepalive_seconds=0.5,
              max_connections=2, max_body_bytes=1024)
T = TypeVar("T")


async def ok(request: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"got": len(await request.read())})


def pki() -> tuple[TlsMaterial, certs.KeyPair, certs.KeyPair]:
    ca = certs.make_ca("serving", now=NOW)
    leaf = certs.make_serving_cert(ca, ["127.0.0.1"], now=NOW)
    client_ca = certs.make_ca("apiserver-client-ca", now=NOW)
    return TlsMaterial(leaf.cert_pem, leaf.key_pem, ca.cert_pem), client_ca, certs.make_client_cert(
        client_ca, "kube-apiserver", now=NOW)


def client_context(ca_pem: bytes, client: certs.KeyPair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    if client is not None:
        with tempfile.TemporaryDirectory() as where:
            crt, key = Path(where) / "c.crt", Path(where) / "c.key"
            crt.write_bytes(client.cert_pem)
            key.write_bytes(client.key_pem)
            context.load_cert_chain(str(crt), str(key))
    return context


def dropped(metrics: Metrics, listener: str = "test") -> dict[str, float]:
    """The listener's non-zero counts of cachewarm_listener_connections_dropped_total by reason."""
    counts = {reason: metrics.registry.get_sample_value("cachewarm_listener_connections_dropped_total",
                                                        {"listener": listener, "reason": reason})
              for reason in DROP_REASONS}
    assert all(value is not None for value in counts.values()), counts  # every series exported from 0
    return {reason: value for reason, value in counts.items() if value}


async def settled(metrics: Metrics, expected: Mapping[str, float], listener: str = "test") -> dict[str, float]:
    """The counts once they are `expected`, or as they are when WAIT has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while dropped(metrics, listener) != expected and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return dropped(metrics, listener)


def serving(limits: Limits, body: Callable[[int, ServingTls], Awaitable[T]], client_ca: bytes = b"",
            admission: bool = False, metrics: Metrics | None = None,
            expect_dropped: Mapping[str, float] | None = None) -> T:
    """`body`'s result with a listener serving; with `expect_dropped`, after the listener's
    counts in `metrics` settled on it (or WAIT passed): the caller asserts on them."""
    material, _, _ = MATERIAL
    tls = ServingTls(client_ca)
    tls.load(material)

    async def run() -> T:
        port = free_port()
        listener = Listener(name="test", addr="127.0.0.1", port=port,
                            context=tls.context if admission else tls.reports_context,
                            routes={"/x": ok}, limits=limits, metrics=metrics)
        await listener.start()
        try:
            result = await body(port, tls)
            if metrics is not None and expect_dropped is not None:
                await settled(metrics, expect_dropped)
            return result
        finally:
            await listener.stop()
    return asyncio.run(run())


MATERIAL = pki()


async def connect(port: int, context: ssl.SSLContext | None = None,
                  source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection to the listener from the loopback address `source` (Linux answers
    all of 127.0.0.0/8 on lo: another address is another peer, as another pod is)."""
    return await asyncio.open_connection("127.0.0.1", port, ssl=context or client_context(MATERIAL[0].ca_pem),
                                         server_hostname="127.0.0.1", local_addr=(source, 0))


async def closed(reader: asyncio.StreamReader) -> bool:
    """True when the server closes the connection (EOF or reset) before WAIT passes."""
    try:
        while await asyncio.wait_for(reader.read(65536), WAIT):
            pass
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return True


async def post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes = b"{}") -> bytes:
    writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"}"), WAIT)


def test_headers_sent_too_slowly_close_the_connection() -> None:
    # Keep-alive far off: only the header deadline can close this one, which sends a
    # header byte every 0.1 s and never ends them (slowloris).
    limits = Limits(handshake_seconds=5, header_seconds=0.5, body_seconds=5, keepalive_seconds=WAIT * 2,
                    max_connections=2, max_body_bytes=1024)

    async def body(port: int, _: ServingTls) -> bool:
        reader, writer = await connect(port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")

        async def dribble() -> None:
            for _ in range(int(WAIT * 10)):  # one byte of one header's value at a time
                writer.write(b"y")
                await asyncio.sleep(0.1)
        task = asyncio.create_task(dribble())
        try:
            return await closed(reader)
        finally:
            task.cancel()
    metrics = Metrics()
    assert serving(limits, body, metrics=metrics, expect_dropped={"header_deadline": 1})
    assert dropped(metrics) == {"header_deadline": 1}


def test_a_body_sent_too_slowly_gets_408_and_is_closed() -> None:
    async def body(port: int, _: ServingTls) -> tuple[bytes, bool]:
        reader, writer = await connect(port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), WAIT)
        return status, await closed(reader)
    metrics = Metrics()
    status, was_closed = serving(FAST, body, metrics=metrics, expect_dropped={"body_deadline": 1})
    assert status.startswith(b"HTTP/1.1 408") and was_closed
    assert dropped(metrics) == {"body_deadline": 1}


def test_an_idle_connection_after_an_answer_is_closed_and_a_body_over_the_cap_is_413() -> None:
    async def body(port: int, _: ServingTls) -> tuple[bytes, bytes, bool]:
        reader, writer = await connect(port)
        answered = await post(reader, writer)
        reader2, writer2 = await connect(port)
        writer2.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        await writer2.drain()
        too_large = await asyncio.wait_for(reader2.readline(), WAIT)
        return answered, too_large, await closed(reader)
    metrics = Metrics()
    answered, too_large, idle_closed = serving(FAST, body, metrics=metrics, expect_dropped={"body_too_large": 1})
    assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b'{"got": 2}')
    assert too_large.startswith(b"HTTP/1.1 413")
    assert idle_closed
    assert dropped(metrics) == {"body_too_large": 1}  # a keep-alive that ends idle is not a refusal


def test_a_next_request_whose_headers_come_too_slowly_after_an_answer_is_counted_as_late_headers() -> None:
    # The header deadline far off: only the keep-alive timer can close it, and it counts
    # it as late headers since bytes of a request came (an idle one is not counted).
    limits = Limits(handshake_seconds=5, header_seconds=WAIT * 2, body_seconds=5, keepalive_seconds=0.5,
                    max_connections=2, max_body_bytes=1024)

    async def body(port: int, _: ServingTls) -> tuple[bytes, bool]:
        reader, writer = await connect(port)
        answered = await post(reader, writer)
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        await writer.drain()
        return answered, await closed(reader)
    metrics = Metrics()
    answered, was_closed = serving(limits, body, metrics=metrics, expect_dropped={"header_deadline": 1})
    assert answered.startswith(b"HTTP/1.1 200") and was_closed
    assert dropped(metrics) == {"header_deadline": 1}


def test_connections_past_the_cap_are_closed_and_those_within_it_served() -> None:
    limits = Limits(handshake_seconds=5, header_seconds=WAIT * 2, body_seconds=5, keepalive_seconds=WAIT * 2,
                    max_connections=2, max_body_bytes=1024)

    async def body(port: int, _: ServingTls) -> tuple[bool, bytes]:
        held = [await connect(port), await connect(port)]
        await asyncio.sleep(0)  # both handshakes done by connect(): they count
        reader, _writer = await connect(port)
        third_closed = await closed(reader)
        return third_closed, await post(*held[0])
    metrics = Metrics()
    third_closed, first = serving(limits, body, metrics=metrics, expect_dropped={"connection_cap": 1})
    assert third_closed and first.startswith(b"HTTP/1.1 200")
    assert dropped(metrics) == {"connection_cap": 1}


def test_one_peer_at_its_cap_is_refused_more_while_another_peer_is_still_served() -> None:
    # The listener's own cap far above: only the per-peer one can refuse here.
    limits = Limits(handshake_seconds=5, header_seconds=WAIT * 2, body_seconds=5, keepalive_seconds=WAIT * 2,
                    max_connections=50, max_connections_per_peer=2, max_body_bytes=1024)

    async def body(port: int, _: ServingTls) -> tuple[bool, bytes, bytes, bytes]:
        held = [await connect(port, source="127.0.0.2"), await connect(port, source="127.0.0.2")]
        reader, _writer = await connect(port, source="127.0.0.2")
        third_closed = await closed(reader)
        other = await post(*await connect(port, source="127.0.0.3"))
        first = await post(*held[0])
        # One of its own closed (by the server, after its answer: the server has let it
        # go before the client sees the end): that peer is taken again.
        reader, writer = held[1]
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        assert await closed(reader)
        return third_closed, other, first, await post(*await connect(port, source="127.0.0.2"))
    metrics = Metrics()
    third_closed, other, first, again = serving(limits, body, metrics=metrics, expect_dropped={"peer_cap": 1})
    assert third_closed
    assert dropped(metrics) == {"peer_cap": 1}
    assert other.startswith(b"HTTP/1.1 200") and first.startswith(b"HTTP/1.1 200")
    assert again.startswith(b"HTTP/1.1 200")


def test_the_apiservers_verified_connections_are_not_bound_by_the_per_peer_cap() -> None:
    material, client_ca, client = MATERIAL
    limits = Limits(handshake_seconds=5, header_seconds=WAIT * 2, body_seconds=5, keepalive_seconds=WAIT * 2,
                    max_connections=50, max_connections_per_peer=1, max_body_bytes=1024)

    async def body(port: int, _: ServingTls) -> list[bytes]:
        context = client_context(material.ca_pem, client)
        held = [await connect(port, context) for _ in range(3)]
        return [await post(*one) for one in held]
    metrics = Metrics()
    answers = serving(limits, body, client_ca=client_ca.cert_pem, admission=True, metrics=metrics)
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    assert dropped(metrics) == {}


def test_the_admission_context_refuses_a_caller_without_the_apiservers_client_certificate(
        caplog: pytest.LogCaptureFixture) -> None:
    material, client_ca, client = MATERIAL
    stranger_ca = certs.make_ca("not-the-apiserver", now=NOW)
    stranger = certs.make_client_cert(stranger_ca, "kube-apiserver", now=NOW)

    async def body(port: int, _: ServingTls) -> list[str]:
        outcomes = []
        for who in (None, stranger, client):
            try:
                reader, writer = await connect(port, client_context(material.ca_pem, who))
                outcomes.append((await post(reader, writer)).split(b"\r\n")[0].decode())
            except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError) as exc:
                outcomes.append(f"refused: {type(exc).__name__}")
        return outcomes
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, logger="cachewarm.webhook"):
        outcomes = serving(FAST, body, client_ca=client_ca.cert_pem, admission=True, metrics=metrics,
                           expect_dropped={"tls_handshake": 2})
    assert outcomes[0].startswith("refused") and outcomes[1].startswith("refused"), outcomes
    assert outcomes[2] == "HTTP/1.1 200 OK"
    assert dropped(metrics) == {"tls_handshake": 2}
    # Both from 127.0.0.1 for the same reason: one log line says it, within the minute.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Dropped a connection")]
    assert len(lines) == 1 and "from 127.0.0.1 (tls_handshake)" in lines[0], lines


def test_a_client_that_speaks_no_tls_or_never_finishes_the_handshake_is_refused_and_counted() -> None:
    async def body(port: int, _: ServingTls) -> tuple[bool, bool]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        plain = await closed(reader)
        reader, _writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing
        return plain, await closed(reader)
    metrics = Metrics()
    plain, silent = serving(FAST, body, metrics=metrics, expect_dropped={"tls_handshake": 1, "handshake_deadline": 1})
    assert plain and silent
    assert dropped(metrics) == {"tls_handshake": 1, "handshake_deadline": 1}


def test_refusal_log_lines_are_one_per_reason_and_peer_and_bounded_per_window(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog("the test listener", window=60, lines=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="cachewarm.webhook"):
        logged = [refusals.note("tls_handshake", "10.0.0.1", "x"),
                  refusals.note("tls_handshake", "10.0.0.1", "x"),  # the same: left out
                  refusals.note("peer_cap", "10.0.0.1", "x"),
                  refusals.note("tls_handshake", "10.0.0.2", "x"),
                  refusals.note("tls_handshake", "10.0.0.3", "x")]  # a fourth line in the window: left out
        now[0] = 59.0
        logged.append(refusals.note("tls_handshake", "10.0.0.1", "x"))
        now[0] = 60.0
        logged.append(refusals.note("tls_handshake", "10.0.0.1", "x"))
    assert logged == [True, False, True, True, False, False, True]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5 and messages[3].startswith("Left 3 dropped connections of the test listener"), messages


def test_without_a_client_ca_the_admission_context_asks_for_no_certificate() -> None:
    async def body(port: int, _: ServingTls) -> bytes:
        return await post(*await connect(port))
    assert serving(FAST, body, admission=True).startswith(b"HTTP/1.1 200")


def test_an_unreadable_client_ca_stops_the_start() -> None:
    with pytest.raises(ssl.SSLError):
        ServingTls(b"-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")


def test_a_burst_of_connections_from_one_address_waits_for_handshake_slots_and_is_served() -> None:
    """As the apiserver opens one connection per admission in flight: 24 at once from one
    address, with 3 handshakes allowed at once (2 per address): none refused, all served."""
    limits = Limits(handshake_seconds=WAIT, header_seconds=WAIT, body_seconds=5, keepalive_seconds=WAIT,
                    max_connections=50, max_connections_per_peer=50, max_body_bytes=1024,
                    max_handshakes=3, max_handshakes_per_peer=2)

    async def body(port: int, _: ServingTls) -> list[bytes]:
        async def one() -> bytes:
            return await post(*await connect(port, source="127.0.0.2"))
        return list(await asyncio.gather(*(one() for _ in range(24))))
    metrics = Metrics()
    answers = serving(limits, body, metrics=metrics, expect_dropped={})
    assert len(answers) == 24 and all(a.startswith(b"HTTP/1.1 200") for a in answers)
    assert dropped(metrics) == {}


def test_stalled_handshakes_of_one_address_hold_only_its_share_and_waiting_is_bounded() -> None:
    """One address opens connections and never starts TLS: it holds its 2 handshake slots,
    its other connections wait (closed, counted, when they waited handshake_seconds, or at
    once past max_waiting), and another address is still served at once."""
    limits = Limits(handshake_seconds=3, header_seconds=WAIT, body_seconds=5, keepalive_seconds=WAIT,
                    max_connections=50, max_connections_per_peer=50, max_body_bytes=1024,
                    max_handshakes=3, max_handshakes_per_peer=2, max_waiting=2)

    async def body(port: int, _: ServingTls) -> tuple[bool, float, bytes, float]:
        writers = []  # kept: a writer collected closes its connection
        loop = asyncio.get_running_loop()

        async def silent() -> asyncio.StreamReader:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            writers.append(writer)
            return reader
        held = [await silent() for _ in range(4)]  # 2 in handshake, 2 waiting
        await asyncio.sleep(0.2)
        started = loop.time()
        past_waiting = await closed(await silent())  # a third would wait: max_waiting is 2
        refused_in = loop.time() - started
        started = loop.time()
        other = await post(*await connect(port, source="127.0.0.3"))  # its own slot, at once
        served_in = loop.time() - started
        for reader in held:  # two at their handshake deadline, two at their wait's
            await closed(reader)
        return past_waiting, refused_in, other, served_in
    metrics = Metrics()
    past_waiting, refused_in, other, served_in = serving(
        limits, body, metrics=metrics, expect_dropped={"handshake_cap": 1, "handshake_deadline": 4})
    assert past_waiting and refused_in < limits.handshake_seconds
    assert other.startswith(b"HTTP/1.1 200") and served_in < limits.handshake_seconds
    assert dropped(metrics) == {"handshake_cap": 1, "handshake_deadline": 4}

def test_a_client_ca_configured_but_empty_at_start_lets_no_caller_in_until_one_loads() -> None:
    """An empty CA file at start (the settings' check passed a moment before) asks for a
    certificate all the same: no caller without one gets in (never open to all), and an
    empty file again is refused, not taken as the CA already loaded."""
    material, apiserver, _ = MATERIAL
    tls = ServingTls(b"", require_client_cert=True)
    tls.load(material)
    assert tls.context.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match="empty"):
        tls.load_client_ca(b"")
    assert tls.load_client_ca(material.ca_pem) and tls.context.verify_mode == ssl.CERT_REQUIRED
    assert ServingTls(b"").context.verify_mode == ssl.CERT_NONE  # no client CA configured: none asked
