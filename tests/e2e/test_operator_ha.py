"""Two replicas of the operator, as the Deployment runs them: exactly one (the Lease
holder) reconciles, both serve the webhook with a certificate of one CA (one Secret, so the
caBundle never flips), a killed leader is replaced by the other replica, a renewed
certificate is served without a restart, and a replica that stops cleanly gives the Lease
up.

Both replicas are processes on this machine with their webhooks on one loopback port
(SO_REUSEPORT: the kernel spreads connections over both, as a Service spreads them over
Pods), authenticated as the manifests' ServiceAccount, on a control plane of their own
(killing the session's operator would disturb every other test)."""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import os
import signal
import socket
import ssl
import uuid
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from cachewarm.admission import certificates as certs
from cachewarm_testbed import install
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import free_port

pytestmark = pytest.mark.e2e

NS = "cachewarm-system"
SECRET = "cachewarm-webhook-tls"


@pytest.fixture(scope="module")
def bed(own_install: Testbed) -> Testbed:
    return own_install


def served_certificate(port: int) -> bytes:
    """The DER certificate a new TLS connection to the webhook port is given."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            unverified().wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class KeptConnection:
    """One HTTP/1.1 keep-alive connection to the webhook port. A certificate reloaded in
    place leaves it open with the certificate it was opened with (OpenSSL copies it into
    each connection as it starts); a restart of the process, even one in place (exec, same
    pid), closes it."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPSConnection("127.0.0.1", port, context=unverified(), timeout=10)
        self.conn.connect()
        self.sock = self.conn.sock
        assert isinstance(self.sock, ssl.SSLSocket)
        certificate = self.sock.getpeercert(binary_form=True)
        assert certificate is not None
        self.certificate = certificate

    def ask(self) -> int:
        """A GET on this very connection (405: the webhook takes POSTs only). Raises OSError
        (http.client's RemoteDisconnected is one) when the server closed it, and fails when
        http.client had to open another."""
        self.conn.request("GET", "/")
        answer = self.conn.getresponse()
        answer.read()
        assert self.conn.sock is self.sock, "the kept connection was closed and opened again"
        return answer.status

    def close(self) -> None:
        self.conn.close()


def started(pid: int) -> str:
    """The process's start time (/proc/<pid>/stat field 22): with the pid, one process's
    identity; a new process under a reused pid has another."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def ready(bed: Testbed, name: str, namespace: str) -> bool:
    obj = bed.get_json("ccache", name, namespace) or {}
    return any(cd["type"] == "Ready" and cd["status"] == "True"
               for cd in (obj.get("status") or {}).get("conditions") or [])


def cache(name: str) -> dict[str, object]:
    return {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": name},
            "spec": {"storage": {"gcs": {"bucket": f"{name}-{uuid.uuid4().hex[:8]}", "location": "us-central1"}}}}


def test_two_replicas_one_leader_shared_certificate_takeover_and_rotation(bed: Testbed, tmp_path: Path) -> None:
    kubeconfig = bed.service_account_kubeconfig(NS, "cachewarm-operator", tmp_path / "kubeconfig")
    port, reports_port = free_port(), free_port()
    env = {"CACHEWARM_RESYNC_SECONDS": "3", "CACHEWARM_RETRY_DELAY_SECONDS": "0.5",
           "CACHEWARM_GCS_TIMEOUT_SECONDS": "2", "CACHEWARM_GCP_PROJECT": "testbed",
           "CACHEWARM_POD_NAMESPACE": NS, "CACHEWARM_CERT_CHECK_SECONDS": "1",
           "CACHEWARM_WEBHOOK_PORT": str(port), "CACHEWARM_WEBHOOK_URL": f"https://127.0.0.1:{port}",
           "CACHEWARM_REPORTS_PORT": str(reports_port),
           "CACHEWARM_REPORT_URL": f"https://127.0.0.1:{reports_port}/report/v1",
           # This test opens connections to the webhook port itself to see the served
           # certificate; the apiserver's client certificate is test_webhook's subject.
           "CACHEWARM_ADMISSION_CLIENT_CA": ""}
    replicas = [OperatorHandle(bed, kubeconfig, {**env, "CACHEWARM_POD_NAME": f"cachewarm-operator-{i}"})
                for i in range(2)]
    try:
        namespace = f"t-{uuid.uuid4().hex[:10]}"
        assert bed.kubectl_run("create", "namespace", namespace).returncode == 0

        # One leader; the other replica reconciles nothing.
        leader = eventually(lambda: install.lease_holder(bed), timeout=30, what="a Lease holder")
        assert leader in {"cachewarm-operator-0", "cachewarm-operator-1"}
        # ...naming where it takes reports (the follower forwards them there).
        assert install.lease_identity(bed) == f"{leader}@127.0.0.1:{reports_port}"
        first, second = (replicas[0], replicas[1]) if leader.endswith("-0") else (replicas[1], replicas[0])
        cache_obj = cache("before")
        bed.apply(cache_obj, namespace)
        eventually(lambda: ready(bed, "before", namespace), timeout=60, what="Ready under the first leader")
        bucket = str(cache_obj["spec"]["storage"]["gcs"]["bucket"])  # type: ignore[index]
        assert f"Created bucket {bucket}" in first.log.read_text(errors="replace")
        assert bucket not in second.log.read_text(errors="replace")  # not one line about it
        assert "Leading" in first.log.read_text(errors="replace")
        assert "Leading" not in second.log.read_text(errors="replace")
        assert install.lease_holder(bed) == leader

        # Both serve a certificate of the Secret's CA, which is also the caBundle.
        secret = bed.get_json("secret", SECRET, NS)
        assert secret is not None
        ca_pem = base64.b64decode(secret["data"]["ca.crt"])
        tls_pem = base64.b64decode(secret["data"]["tls.crt"])
        served = {served_certificate(port) for _ in range(20)}
        assert served == {x509.load_pem_x509_certificate(tls_pem).public_bytes(Encoding.DER)}
        hooks = (bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "default") or {})["webhooks"]
        assert {base64.b64decode(h["clientConfig"]["caBundle"]) for h in hooks} == {ca_pem}

        # The leader dies (SIGKILL, as a node loss would): the other replica takes over.
        os.kill(first.pid, signal.SIGKILL)
        first.proc.stop(timeout=5)
        eventually(lambda: install.lease_holder(bed) == second.env["CACHEWARM_POD_NAME"] or None, timeout=40,
                   what="the surviving replica holding the Lease")
        bed.apply(cache("after"), namespace)
        eventually(lambda: ready(bed, "after", namespace), timeout=60, what="Ready under the new leader")
        assert "Created bucket after-" in second.log.read_text(errors="replace")

        # A renewed certificate (same CA, as cert renewals are) is served without a restart:
        # the same process (taken before the renewal), which started once, and a connection
        # opened before the renewal still open with the old certificate.
        pid_before, started_before = second.pid, started(second.pid)
        starts = second.log.read_text(errors="replace").count("Started cachewarm operator")
        assert starts == 1
        kept = KeptConnection(port)  # to `second`: the only replica left
        old_der = kept.certificate
        assert old_der == x509.load_pem_x509_certificate(tls_pem).public_bytes(Encoding.DER)
        assert kept.ask() == 405
        ca = certs.KeyPair(ca_pem, base64.b64decode(secret["data"]["ca.key"]))
        san = x509.load_pem_x509_certificate(tls_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
        hosts = [*san.value.get_values_for_type(x509.DNSName), *map(str, san.value.get_values_for_type(x509.IPAddress))]
        renewed = certs.make_serving_cert(ca, hosts, now=dt.datetime.now(dt.timezone.utc))
        secret["data"]["tls.crt"] = base64.b64encode(renewed.cert_pem).decode()
        secret["data"]["tls.key"] = base64.b64encode(renewed.key_pem).decode()
        bed.apply(secret, NS)
        new_der = x509.load_pem_x509_certificate(renewed.cert_pem).public_bytes(Encoding.DER)

        def renewed() -> bool | None:
            # The kept connection used at each look (one idle for 5 s is closed); it
            # raises, failing the test at once, if the process closed it.
            kept.ask()
            return served_certificate(port) == new_der or None
        eventually(renewed, timeout=30, what="the renewed certificate served")
        hooks = (bed.get_json("mutatingwebhookconfiguration", "cachewarm-pod-injector", "default") or {})["webhooks"]
        assert {base64.b64decode(h["clientConfig"]["caBundle"]) for h in hooks} == {ca_pem}
        # Reloaded in place: the connection from before still answers, with the old
        # certificate; the same process (pid and start time), alive, and started once.
        assert kept.ask() == 405 and kept.certificate == old_der
        kept.close()
        assert second.proc.alive() and (second.pid, started(second.pid)) == (pid_before, started_before)
        log = second.log.read_text(errors="replace")
        assert log.count("Started cachewarm operator") == starts
        assert "Serving a new webhook certificate" in log

        # Stopped cleanly, the last replica gives the Lease up.
        second.stop()
        assert install.lease_holder(bed) is None
    finally:
        for handle in replicas:
            handle.stop()
