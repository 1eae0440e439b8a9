"""Certificates made for the testbed and the webhook verify as a Go TLS client needs."""

from __future__ import annotations

import datetime as dt
import ipaddress

import pytest
from cryptography import x509

from cachewarm.admission import certificates as certs

NOW = dt.datetime(2026, 11, 22, tzinfo=dt.timezone.utc)


def test_serving_cert_is_signed_by_ca_and_names_every_host() -> None:
    ca = certs.make_ca("test-ca", now=NOW)
    pair = certs.make_serving_cert(ca, ["127.0.0.1", "webhook.cachewarm-system.svc"], now=NOW)
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["webhook.cachewarm-system.svc"]
    assert cert.not_valid_before_utc <= NOW < cert.not_valid_after_utc


def test_ca_is_a_ca_and_leaf_is_not() -> None:
    ca = certs.make_ca("test-ca", now=NOW)
    leaf = certs.make_serving_cert(ca, ["localhost"], now=NOW)
    ca_bc = x509.load_pem_x509_certificate(ca.cert_pem).extensions.get_extension_for_class(x509.BasicConstraints)
    leaf_bc = x509.load_pem_x509_certificate(leaf.cert_pem).extensions.get_extension_for_class(x509.BasicConstraints)
    assert ca_bc.value.ca is True
    assert leaf_bc.value.ca is False


def test_serving_cert_without_hosts_is_refused() -> None:
    ca = certs.make_ca("test-ca", now=NOW)
    with pytest.raises(ValueError, match="at least one host"):
        certs.make_serving_cert(ca, [], now=NOW)
