"""Where the webhook's certificate comes from: cert-manager's files, or made at startup."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp.web

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from structlog.testing import capture_logs

from cachewarm.admission import certificates as certs
from cachewarm.admission import keeper as servingcert
from cachewarm.admission.keeper import plan_secret
from cachewarm.admission.server import Limits, Listener, ServingTls, check_review
from cachewarm.api.metrics import Metrics
from cachewarm_testbed.processes import free_port
from memkube import MemoryKube

NOW = dt.datetime(2026, 11, 22, tzinfo=dt.timezone.utc)
HOSTS = ["cachewarm-webhook.cachewarm-system.svc", "127.0.0.1"]
WAIT = 20.0  # far beyond a reload round (cert_check_seconds below)


def _san(cert_pem: bytes) -> list[str]:
    san = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return [*san.value.get_values_for_type(x509.DNSName), *map(str, san.value.get_values_for_type(x509.IPAddress))]


def test_self_made_certificate_names_the_service_and_is_signed_by_the_bundle() -> None:
    tls = servingcert.in_memory(HOSTS, NOW)
    cert = x509.load_pem_x509_certificate(tls.cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(tls.ca_pem))
    assert _san(tls.cert_pem) == HOSTS


def test_cert_manager_files_are_used_as_they_are(tmp_path: Path) -> None:
    ca = certs.make_ca("cm", now=NOW)
    leaf = certs.make_serving_cert(ca, ["svc"], now=NOW)
    (tmp_path / "tls.crt").write_bytes(leaf.cert_pem)
    (tmp_path / "tls.key").write_bytes(leaf.key_pem)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    assert servingcert.from_dir(str(tmp_path)) == servingcert.TlsMaterial(leaf.cert_pem, leaf.key_pem, ca.cert_pem)


def test_a_missing_secret_is_created_with_a_ca_and_a_certificate_for_every_host() -> None:
    data, why = plan_secret(None, HOSTS, NOW)
    assert why == "created" and data is not None
    x509.load_pem_x509_certificate(data["tls.crt"]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(data["ca.crt"]))
    assert _san(data["tls.crt"]) == HOSTS


def test_a_current_secret_is_left_as_it_is() -> None:
    data, _ = plan_secret(None, HOSTS, NOW)
    assert plan_secret(data, HOSTS, NOW + dt.timedelta(days=300)) == (None, "")


def test_a_certificate_near_expiry_is_renewed_under_the_same_ca_so_the_ca_bundle_stays() -> None:
    data, _ = plan_secret(None, HOSTS, NOW)
    assert data is not None
    renewed, why = plan_secret(data, HOSTS, NOW + dt.timedelta(days=340))
    assert renewed is not None and why.startswith("expires")
    assert renewed["ca.crt"] == data["ca.crt"] and renewed["ca.key"] == data["ca.key"]
    assert renewed["tls.crt"] != data["tls.crt"]
    x509.load_pem_x509_certificate(renewed["tls.crt"]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(data["ca.crt"]))


def test_a_certificate_missing_a_host_is_made_again_for_every_host() -> None:
    data, _ = plan_secret(None, HOSTS[:1], NOW)
    renewed, why = plan_secret(data, HOSTS, NOW)
    assert renewed is not None and why == "not valid for 127.0.0.1"
    assert _san(renewed["tls.crt"]) == HOSTS and renewed["ca.crt"] == data["ca.crt"]  # type: ignore[index]


def test_a_ca_near_its_end_is_replaced_with_the_certificate() -> None:
    data, _ = plan_secret(None, HOSTS, NOW)
    assert data is not None
    later = NOW + dt.timedelta(days=servingcert.CA_DAYS - 300)
    renewed, why = plan_secret(data, HOSTS, later)
    assert renewed is not None and why.endswith("CA renewed") and renewed["ca.crt"] != data["ca.crt"]


def test_an_incomplete_secret_is_made_again() -> None:
    data, _ = plan_secret(None, HOSTS, NOW)
    assert data is not None
    renewed, why = plan_secret({k: v for k, v in data.items() if k != "ca.key"}, HOSTS, NOW)
    assert renewed is not None and why == "incomplete"


def test_serving_tls_reloads_in_place_new_connections_get_the_new_certificate() -> None:
    async def peer_cert(port: int, ca_pem: bytes) -> bytes:
        client = ssl.create_default_context(cadata=ca_pem.decode())
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="127.0.0.1")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return bytes(der)

    async def scenario() -> tuple[bytes, bytes, bytes, bytes]:
        first, second = servingcert.in_memory(["127.0.0.1"], NOW), servingcert.in_memory(["127.0.0.1"], NOW)
        tls = ServingTls()
        assert tls.load(first) and not tls.load(first)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=tls.context)
        port = server.sockets[0].getsockname()[1]
        before = await peer_cert(port, first.ca_pem)
        assert tls.load(second)
        after = await peer_cert(port, second.ca_pem)
        server.close()
        return before, after, first.cert_pem, second.cert_pem

    before, after, first, second = asyncio.run(scenario())
    assert before == x509.load_pem_x509_certificate(first).public_bytes(serialization.Encoding.DER)
    assert after == x509.load_pem_x509_certificate(second).public_bytes(serialization.Encoding.DER)


def test_review_shape_checks() -> None:
    assert check_review([]) == "body is not a JSON object"
    assert check_review({"kind": "Pod"}) == "kind is 'Pod', expected AdmissionReview"
    assert check_review({"kind": "AdmissionReview"}) == "request is missing"
    assert check_review({"kind": "AdmissionReview", "request": {"uid": ""}}) == "request.uid is missing"
    assert check_review({"kind": "AdmissionReview", "request": {"uid": "u"}}) is None


def test_a_renewed_cert_manager_certificate_is_loaded_by_the_keeper_without_a_restart(tmp_path: Path) -> None:
    from cachewarm.runtime.main import WebhookKeeper
    from cachewarm.runtime.settings import Settings

    def write(material: servingcert.TlsMaterial) -> None:
        for name, data in (("tls.crt", material.cert_pem), ("tls.key", material.key_pem), ("ca.crt", material.ca_pem)):
            (tmp_path / name).write_bytes(data)

    first, renewed = servingcert.in_memory(["svc"], NOW), servingcert.in_memory(["svc"], NOW)
    write(first)
    settings = Settings(webhook_cert_dir=str(tmp_path), webhook_configuration="", cert_check_seconds=0.05)

    async def scenario() -> list[servingcert.TlsMaterial | None]:
        tls = ServingTls()
        tls.load(servingcert.from_dir(str(tmp_path)))
        keeper = WebhookKeeper(settings, MemoryKube(), tls, True)
        task = asyncio.create_task(keeper.watch())
        seen = [tls.material]
        write(renewed)  # as the kubelet updates a mounted Secret
        for _ in range(100):
            await asyncio.sleep(0.05)
            if tls.material == renewed:
                break
        seen.append(tls.material)
        task.cancel()
        return seen

    assert asyncio.run(scenario()) == [first, renewed]


def test_a_corrupt_secret_is_made_again_rather_than_failing_the_operator() -> None:
    data, _ = plan_secret(None, HOSTS, NOW)
    assert data is not None
    for broken in ({**data, "tls.crt": b"garbage"}, {**data, "tls.crt": b"garbage", "ca.crt": b"garbage"},
                   {**data, "tls.crt": b"garbage", "ca.key": b"garbage"}):
        renewed, why = plan_secret(broken, HOSTS, NOW)
        assert renewed is not None and why.startswith("unreadable certificate")
        x509.load_pem_x509_certificate(renewed["tls.crt"]).verify_directly_issued_by(
            x509.load_pem_x509_certificate(renewed["ca.crt"]))


def test_a_stand_in_certificate_is_never_published_as_the_ca_bundle() -> None:
    """A replica that could not read the shared Secret serves a stand-in, but never points
    the webhook configuration at the stand-in's CA (the other replicas serve the Secret's)."""
    from cachewarm.runtime.main import WebhookKeeper
    from cachewarm.runtime.settings import Settings

    kube = MemoryKube()
    pointed = kube.webhook_bundles
    settings = Settings(webhook_configuration="cachewarm-pod-injector")

    async def scenario(authoritative: bool) -> None:
        tls = ServingTls()
        tls.load(servingcert.in_memory(["svc"], NOW))
        await WebhookKeeper(settings, kube, tls, authoritative).point_configuration()

    asyncio.run(scenario(False))
    assert pointed == []
    asyncio.run(scenario(True))
    assert len(pointed) == 1


def test_a_changed_admission_client_ca_is_reloaded_and_a_broken_one_keeps_the_last_good(
        tmp_path: Path) -> None:
    """The keeper re-reads CACHEWARM_ADMISSION_CLIENT_CA at its certificate rounds: a new
    CA's client is refused before the file changes and answered after, the old CA's is
    refused after, and a connection open since before is still answered. A file that
    becomes garbage, empty or missing keeps the last good CA (never none: a caller
    without a certificate is still refused), said by the gauge and one warning per problem."""
    from cachewarm.runtime.main import WebhookKeeper
    from cachewarm.runtime.settings import Settings

    old_ca, new_ca = certs.make_ca("apiserver-client-ca", now=NOW), certs.make_ca("apiserver-client-ca-2", now=NOW)
    old_client = certs.make_client_cert(old_ca, "kube-apiserver", now=NOW)
    new_client = certs.make_client_cert(new_ca, "kube-apiserver", now=NOW)
    serving = servingcert.in_memory(["127.0.0.1"], NOW)
    ca_file = tmp_path / "client-ca.crt"
    ca_file.write_bytes(old_ca.cert_pem)
    settings = Settings(admission_client_ca=str(ca_file), webhook_configuration="", cert_check_seconds=0.05)
    metrics = Metrics()
    tls = ServingTls(old_ca.cert_pem)
    tls.load(serving)
    keeper = WebhookKeeper(settings, MemoryKube(), tls, True, metrics)

    def client(who: certs.KeyPair | None) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=serving.ca_pem.decode())
        if who is not None:
            (tmp_path / "c.crt").write_bytes(who.cert_pem)
            (tmp_path / "c.key").write_bytes(who.key_pem)
            context.load_cert_chain(str(tmp_path / "c.crt"), str(tmp_path / "c.key"))
        return context

    async def answer(port: int, who: certs.KeyPair | None) -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client(who),
                                                           server_hostname="127.0.0.1")
            return (await ask(reader, writer)).decode()
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
            return "refused"

    async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return (await asyncio.wait_for(reader.readuntil(b"}"), WAIT)).split(b"\r\n")[0]

    async def until(done: Callable[[], Awaitable[bool]]) -> bool:
        deadline = asyncio.get_running_loop().time() + WAIT
        while not await done():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def problem_is(start: str) -> bool:
        return keeper.client_ca_problem.startswith(start)

    async def cleared() -> bool:
        return keeper.client_ca_problem == ""

    async def ok(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"got": len(await request.read())})

    async def scenario() -> dict[str, object]:
        port = free_port()
        listener = Listener(name="admission", addr="127.0.0.1", port=port, context=lambda: tls.context,
                            routes={"/x": ok}, limits=Limits(keepalive_seconds=WAIT * 2), label="admission",
                            metrics=metrics)
        await listener.start()
        task = asyncio.create_task(keeper.watch())
        seen: dict[str, object] = {}
        try:
            held = await asyncio.open_connection("127.0.0.1", port, ssl=client(old_client),
                                                 server_hostname="127.0.0.1")
            seen["held before"] = (await ask(*held)).decode()
            seen["new before"] = await answer(port, new_client)
            ca_file.write_bytes(new_ca.cert_pem)

            async def new_answered() -> bool:
                return await answer(port, new_client) == "HTTP/1.1 200 OK"
            seen["new after"] = await until(new_answered)
            seen["old after"] = await answer(port, old_client)
            seen["held after"] = (await ask(*held)).decode()
            for broken, problem in ((b"not a certificate", "SSLError"), (b"", "ValueError"), (None, "FileNotFound")):
                if broken is None:
                    ca_file.unlink()
                else:
                    ca_file.write_bytes(broken)
                seen[f"{problem} seen"] = await until(lambda: problem_is(problem))
                seen[f"{problem} stale"] = metrics.registry.get_sample_value("cachewarm_admission_client_ca_stale")
                seen[f"{problem} answers"] = [await answer(port, who) for who in (new_client, old_client, None)]
            ca_file.write_bytes(new_ca.cert_pem)
            seen["good again"] = await until(cleared)
            seen["stale again"] = metrics.registry.get_sample_value("cachewarm_admission_client_ca_stale")
            return seen
        finally:
            task.cancel()
            await listener.stop()

    with capture_logs() as logged:
        seen = asyncio.run(scenario())
    assert seen["held before"] == "HTTP/1.1 200 OK" and seen["new before"] == "refused"
    assert seen["new after"] is True and seen["old after"] == "refused"
    assert seen["held after"] == "HTTP/1.1 200 OK"  # open before the reload: not dropped
    for problem in ("SSLError", "ValueError", "FileNotFound"):
        assert seen[f"{problem} seen"] is True and seen[f"{problem} stale"] == 1.0, (problem, seen)
        assert seen[f"{problem} answers"] == ["HTTP/1.1 200 OK", "refused", "refused"], (problem, seen)
    assert seen["good again"] is True and seen["stale again"] == 0.0
    warnings = [line["error"] for line in logged
                if line["event"].startswith("Could not reload the admission client CA")]
    assert len(warnings) == 3, warnings  # one per problem, not one per round
