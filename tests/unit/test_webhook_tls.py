"""Where the webhook's certificate comes from: cert-manager's files, or made at startup."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509

from cachewarm import certs
from cachewarm.webhook import check_review, tls_files

NOW = dt.datetime(2026, 11, 22, tzinfo=dt.timezone.utc)


def test_self_made_certificate_names_the_service_and_is_signed_by_the_bundle(tmp_path: Path) -> None:
    tls = tls_files("", tmp_path, ["cachewarm-webhook.cachewarm-system.svc", "127.0.0.1"], NOW)
    cert = x509.load_pem_x509_certificate(tls.certfile.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(tls.ca_pem))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cachewarm-webhook.cachewarm-system.svc"]
    assert oct(tls.keyfile.stat().st_mode & 0o777) == "0o600"


def test_cert_manager_files_are_used_as_they_are(tmp_path: Path) -> None:
    ca = certs.make_ca("cm", now=NOW)
    leaf = certs.make_serving_cert(ca, ["svc"], now=NOW)
    (tmp_path / "tls.crt").write_bytes(leaf.cert_pem)
    (tmp_path / "tls.key").write_bytes(leaf.key_pem)
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    tls = tls_files(str(tmp_path), tmp_path / "unused", ["ignored"], NOW)
    assert tls.certfile == tmp_path / "tls.crt" and tls.ca_pem == ca.cert_pem
    assert not (tmp_path / "unused").exists()


def test_review_shape_checks() -> None:
    assert check_review([]) == "body is not a JSON object"
    assert check_review({"kind": "Pod"}) == "kind is 'Pod', expected AdmissionReview"
    assert check_review({"kind": "AdmissionReview"}) == "request is missing"
    assert check_review({"kind": "AdmissionReview", "request": {"uid": ""}}) == "request.uid is missing"
    assert check_review({"kind": "AdmissionReview", "request": {"uid": "u"}}) is None
