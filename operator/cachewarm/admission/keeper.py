"""Where the webhook's serving certificate comes from, for every replica alike.

- `cert_dir` (e.g. cert-manager's Secret mounted as a volume): the files, re-read as
  the kubelet updates them.
- otherwise, in a cluster: one Secret (`CACHEWARM_WEBHOOK_CERT_SECRET` in the operator's
  namespace) holding a CA, its key and a serving certificate. The first replica to start
  creates it; the others read it (a create that loses the race reads the winner's), so
  every replica serves a certificate of the same CA and the webhook configuration's
  caBundle never flips between them. The serving certificate is made again under the
  same CA when it nears expiry or no longer names every host (a replace at the Secret's
  resourceVersion: one replica wins, the others read it), so renewals keep the caBundle.
- outside a cluster (no namespace known): a CA and certificate made in memory.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

from cachewarm.admission import certificates as certs
from cachewarm.api import constants as c
from cachewarm.clients.kube import KubeClient, KubeError

CA_DAYS = 3650
SERVING_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=30)
# A CA this close to its end is replaced (and the caBundle with it) rather than reused.
CA_RENEW_BEFORE = dt.timedelta(days=SERVING_DAYS + 30)
WRITE_ATTEMPTS = 5


@dataclasses.dataclass(frozen=True)
class TlsMaterial:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes  # b"" when unknown (a cert_dir without ca.crt)


def from_dir(cert_dir: str) -> TlsMaterial:
    """tls.crt, tls.key and (if present) ca.crt, as cert-manager writes them.
    Raises FileNotFoundError when tls.crt or tls.key is missing."""
    base = Path(cert_dir)
    ca = base / "ca.crt"
    return TlsMaterial((base / "tls.crt").read_bytes(), (base / "tls.key").read_bytes(),
                       ca.read_bytes() if ca.exists() else b"")


def in_memory(hosts: list[str], now: dt.datetime) -> TlsMaterial:
    ca = certs.make_ca("cachewarm-webhook-ca", now=now, days=CA_DAYS)
    serving = certs.make_serving_cert(ca, hosts, now=now, days=SERVING_DAYS)
    return TlsMaterial(serving.cert_pem, serving.key_pem, ca.cert_pem)


def _material(data: dict[str, bytes]) -> TlsMaterial:
    return TlsMaterial(data["tls.crt"], data["tls.key"], data["ca.crt"])


def plan_secret(data: dict[str, bytes] | None, hosts: list[str], now: dt.datetime) -> tuple[dict[str, bytes] | None, str]:
    """What the Secret should hold, and why it changes: (None, '') when it is fine as it
    is; otherwise its new data and the reason. Keeps the CA while it has more than a
    serving certificate's lifetime left, so a renewal does not change the caBundle."""
    keys = ("tls.crt", "tls.key", "ca.crt", "ca.key")
    if data is None or any(not data.get(k) for k in keys):
        why = "created" if data is None else "incomplete"
        ca = certs.make_ca("cachewarm-webhook-ca", now=now, days=CA_DAYS)
    else:
        why = certs.reissue_reason(data["tls.crt"], hosts, now=now, renew_before=RENEW_BEFORE)
        if not why:
            return None, ""
        ca = certs.KeyPair(data["ca.crt"], data["ca.key"])
        try:
            ca_left = certs.expires(ca.cert_pem) - now
        except ValueError:
            ca_left = dt.timedelta(0)  # unreadable: replaced
        if ca_left < CA_RENEW_BEFORE:
            ca = certs.make_ca("cachewarm-webhook-ca", now=now, days=CA_DAYS)
            why += "; CA renewed"
    try:
        serving = certs.make_serving_cert(ca, hosts, now=now, days=SERVING_DAYS)
    except ValueError:  # the stored CA key is unreadable or not ours: a new CA
        ca = certs.make_ca("cachewarm-webhook-ca", now=now, days=CA_DAYS)
        serving = certs.make_serving_cert(ca, hosts, now=now, days=SERVING_DAYS)
        why += "; CA replaced (unreadable)"
    return {"tls.crt": serving.cert_pem, "tls.key": serving.key_pem, "ca.crt": ca.cert_pem, "ca.key": ca.key_pem}, why


def from_secret(kube: KubeClient, namespace: str, name: str, hosts: list[str], now: dt.datetime) -> tuple[TlsMaterial, str]:
    """The shared certificate, created or renewed first when needed. Returns it and what
    this replica changed ('' when nothing). Raises KubeError."""
    for _ in range(WRITE_ATTEMPTS):
        found = kube.read_secret(namespace, name)
        data, version = (found if found is not None else (None, None))
        wanted, why = plan_secret(data, hosts, now)
        if wanted is None:
            assert data is not None
            return _material(data), ""
        if kube.write_secret(namespace, name, wanted, version, {c.MANAGED_BY_LABEL: c.MANAGED_BY}):
            return _material(wanted), why
        # Another replica wrote it first: read theirs.
    raise KubeError(f"Secret {namespace}/{name} kept changing while this replica wrote it")
