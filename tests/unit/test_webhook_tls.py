"""Where the webhook's certificate comes from: cert-manager's files, or made at startup."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from cachewarm.admission import certificates as certs
from cachewarm.admission import keeper as servingcert
from cachewarm.admission.keeper import plan_secret
from cachewarm.admission.server import ServingTls, check_review
from memkube import MemoryKube

NOW = dt.datetime(2026, 11, 22, tzinfo=dt.timezone.utc)
HOSTS = ["cachewarm-webhook.cachewarm-system.svc", "127.0.0.1"]


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
