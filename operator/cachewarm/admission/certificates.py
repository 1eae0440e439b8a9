"""X.509 material for TLS endpoints we serve (webhook) or start (test control plane).

Made with `cryptography`: kopf's self-signed path needs `oscrypto`, which fails on
OpenSSL >= 3.0.10. Builders here are pure apart from key generation: the clock is passed in.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(common_name: str, *, now: dt.datetime, days: int = 365) -> KeyPair:
    """A self-signed CA that can sign serving certificates."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_client_cert(ca: KeyPair, common_name: str, *, now: dt.datetime, days: int = 365) -> KeyPair:
    """A client certificate (TLS client auth) for `common_name`, signed by `ca`: what the
    apiserver presents to the admission webhook (its admission configuration's
    kubeConfigFile). Raises ValueError for a CA key make_ca did not make."""
    return _leaf(ca, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), None,
                 ExtendedKeyUsageOID.CLIENT_AUTH, now=now, days=days)


def make_serving_cert(
    ca: KeyPair, hosts: list[str], *, now: dt.datetime, days: int = 365
) -> KeyPair:
    """A server certificate for `hosts` (DNS names or IP addresses), signed by `ca`.

    Raises ValueError when `hosts` is empty: a certificate without a SAN is not accepted
    by Go clients such as kube-apiserver calling a webhook.
    """
    if not hosts:
        raise ValueError("a serving certificate needs at least one host name or IP")
    return _leaf(ca, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), _san(hosts),
                 ExtendedKeyUsageOID.SERVER_AUTH, now=now, days=days)


def _leaf(ca: KeyPair, subject: x509.Name, san: x509.SubjectAlternativeName | None, usage: x509.ObjectIdentifier,
          *, now: dt.datetime, days: int) -> KeyPair:
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an EC key made by make_ca")
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_signing_key() -> tuple[bytes, bytes]:
    """An RSA key pair (private PEM, public PEM) for signing service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    return private, public


def reissue_reason(cert_pem: bytes, hosts: list[str], *, now: dt.datetime, renew_before: dt.timedelta) -> str:
    """Why a serving certificate must be made again ('' when it is fine): unreadable,
    expiring within `renew_before`, or not valid for one of `hosts`."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        return f"unreadable certificate ({exc})"
    if cert.not_valid_after_utc - now < renew_before:
        return f"expires {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "no subjectAltName"
    covered = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))
    missing = [h for h in hosts if _normal(h) not in covered]
    return f"not valid for {', '.join(missing)}" if missing else ""


def _normal(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def expires(cert_pem: bytes) -> dt.datetime:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
