"""The operator's one typed settings object; the only module that reads the environment.

Every field is read from an env var with the prefix CACHEWARM_ (e.g. CACHEWARM_LOG_FORMAT)
and validated at startup, so a bad value stops the operator with a message, not later.
"""

from __future__ import annotations

import json
import re
import ssl
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# A Kubernetes namespace name: a DNS-1123 label.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Settings(BaseSettings):
    """Operator settings. Field descriptions are what `cachewarm run --help` shows."""

    model_config = SettingsConfigDict(env_prefix="CACHEWARM_", extra="ignore", frozen=True)

    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description='Namespaces to watch, as a JSON list (["team-a", "team-b"]) or comma-separated '
                    '(team-a,team-b); each a namespace name (DNS-1123 label). Empty watches the whole cluster.',
    )
    log_format: Literal["json", "console"] = Field(
        default="json", description="json for clusters (one object per line), console for terminals."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Minimum log level.")
    gcp_project: str = Field(
        default="",
        description="GCP project that owns buckets cachewarm creates; empty uses the credentials' default.",
    )
    bucket_locations: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Locations a cache may create a bucket in (create: true), as a JSON list or comma-separated "
                    "(us-central1,us-east4; any case); empty allows any. Buckets cachewarm creates are billed to "
                    "gcp_project.",
    )
    bucket_storage_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Storage classes a cache may create a bucket with (STANDARD, NEARLINE, COLDLINE, ARCHIVE), as a "
                    "JSON list or comma-separated; empty allows any.",
    )
    buckets_per_namespace: int = Field(
        default=10, ge=0, le=10_000,
        description="Buckets cachewarm creates for one namespace, at most (those that exist, by their creation "
                    "labels); 0: caches may only use buckets that exist and are granted to them.",
    )
    bucket_count_seconds: float = Field(
        default=60.0, ge=0, le=3600,
        description="How long one listing of the project's buckets serves the per-namespace count "
                    "(buckets_per_namespace) for every namespace; the operator adds the buckets it creates meanwhile, "
                    "and one made or deleted by anyone else counts from the next listing. 0 lists at every creation.",
    )
    instance: str = Field(
        default="default", pattern=r"^[a-z][a-z0-9_-]{0,62}$",
        description="This operator's name on GCS buckets (lowercase letter first, then letters, digits, - or _; "
                    "at most 63): operators of different clusters sharing a bucket need different names, or "
                    "each takes the other's lifecycle rules for its own.",
    )
    resync_seconds: float = Field(
        default=300.0, gt=0, description="How often each cache is re-checked for drift on its bucket."
    )
    retry_delay_seconds: float = Field(
        default=15.0, gt=0, description="First delay before retrying a failed GCS call; doubles up to 10 minutes."
    )
    gcs_timeout_seconds: float = Field(default=30.0, gt=0, description="Timeout of one GCS request.")
    kube_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Timeout of one Kubernetes API request the operator makes outside its watches."
    )
    report_url: str = Field(
        default="https://cachewarm-webhook.cachewarm-system.svc:9444/report/v1",
        description="Where training pods send their reports (the operator's reports listener, reports_port, "
                    "through its Service).",
    )
    reports_port: int = Field(
        default=9444, ge=1, le=65535,
        description="HTTPS port of the reports listener (on webhook_address, with the webhook's certificate; no "
                    "client certificate asked): training pods' reports, apart from admission.",
    )
    admission_client_ca: str = Field(
        default="",
        description="PEM file of the CA that signs the apiserver's webhook client certificate (its "
                    "--admission-control-config-file): the admission listener then refuses, in the TLS handshake, "
                    "any caller without a certificate of it. Empty: any caller that reaches the port is answered "
                    "(GKE cannot give the apiserver a webhook client certificate; see docs/security.md).",
    )
    http_header_seconds: float = Field(
        default=5.0, gt=0, le=300,
        description="Both listeners: a connection's TLS handshake, and a request's headers after it, each within "
                    "this long, or the connection is closed.",
    )
    http_body_seconds: float = Field(
        default=10.0, gt=0, le=300,
        description="Both listeners: a request's body within this long after its headers (else 408, closed).",
    )
    http_keepalive_seconds: float = Field(
        default=5.0, gt=0, le=300,
        description="The reports listener: an idle connection's next request headers within this long, or it is "
                    "closed.",
    )
    admission_keepalive_seconds: float = Field(
        default=120.0, gt=0, le=3600,
        description="The admission listener: an idle connection's next request within this long, or it is closed. "
                    "Longer than the apiserver keeps an idle connection (90 s), so the apiserver closes it first and "
                    "never sends a request on one being closed; a peer holding idle connections is bounded by the "
                    "per-peer cap, not by this.",
    )
    http_max_connections: int = Field(
        default=256, ge=1, le=100_000,
        description="Both listeners, each: connections open at once; more are closed as they are made.",
    )
    http_max_connections_per_peer: int = Field(
        default=16, ge=1, le=100_000,
        description="Both listeners, each: connections open at once from one peer IP address; more from it are "
                    "closed as they are made, so one pod cannot take a listener. Not applied to a caller with the "
                    "apiserver's client certificate (admission_client_ca set); without one, the apiserver's own "
                    "addresses count too: keep this above the admission requests one apiserver sends at once. "
                    "Set explicitly, at most http_max_connections (the default above a smaller one is that cap).",
    )
    report_review_queue: int = Field(
        default=64, ge=1, le=100_000,
        description="Reports waiting for a TokenReview at once (4 run at a time); more are answered 503 at once.",
    )
    report_window_seconds: float = Field(
        default=3600.0, gt=0, description="status.usage sums the reports of training pods from this long back."
    )
    usage_flush_seconds: float = Field(
        default=30.0, gt=0, description="How often the leader writes the usage pods reported into status.usage."
    )
    metrics_port: int = Field(
        default=8383, ge=0, le=65535,
        description="Port of the Prometheus metrics (GET /metrics, plain HTTP, every address); 0 turns them off.",
    )
    liveness_endpoint: str = Field(
        default="http://0.0.0.0:8080/healthz", description="Where kopf serves the liveness probe; empty turns it off."
    )

    warmer_image: str = Field(
        default="cachewarm/warmer:0.1.0",
        description="Image of the warmer init container that copies the warmer into training-image pods.",
    )
    inventory_seconds: float = Field(
        default=3600.0, gt=0,
        description="How often each cache's entries are listed on the bucket (status.cache) when nothing else asks "
                    "for it; a new spec, a finished warm and entries left unstamped list them at once.",
    )
    warm_poll_seconds: float = Field(
        default=10.0, gt=0, description="How often a cache with warmers running or pods waiting is re-checked."
    )
    warm_retries: int = Field(
        default=3, ge=0, le=10,
        description="How often a failed warmer runs again (per pool and program) before its pool stays Failed.",
    )
    warm_retry_seconds: float = Field(
        default=60.0, gt=0,
        description="Wait before the first retry of a failed warmer; each later one waits twice as long (at most 1 h).",
    )
    webhook_enabled: bool = Field(default=True, description="Serve the pod admission webhook that injects the cache env.")
    webhook_port: int = Field(default=9443, ge=1, le=65535, description="HTTPS port of the admission webhook.")
    webhook_address: str = Field(default="0.0.0.0", description="Address the webhook listens on.")
    webhook_cert_dir: str = Field(
        default="",
        description="Directory with tls.crt, tls.key and ca.crt (e.g. from cert-manager); empty makes a CA and certificate at startup.",
    )
    webhook_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["cachewarm-webhook.cachewarm-system.svc", "cachewarm-webhook.cachewarm-system.svc.cluster.local"],
        description="Host names and IPs the self-made webhook certificate is valid for, as a JSON list or comma-separated.",
    )
    webhook_configuration: str = Field(
        default="cachewarm-pod-injector",
        description="MutatingWebhookConfiguration whose caBundle (and URL) the operator keeps pointed at itself; empty leaves it alone (cert-manager).",
    )
    webhook_url: str = Field(
        default="", description="URL to register instead of the Service (e.g. https://127.0.0.1:9443 off-cluster); empty keeps the Service."
    )
    pod_name: str = Field(
        default="", description="This operator's Pod (from the downward API): Events about the operator itself go on it; "
                                "empty logs them only.",
    )
    pod_namespace: str = Field(default="", description="Namespace of pod_name (from the downward API).")
    pod_ip: str = Field(
        default="", description="This operator's Pod IP (from the downward API, status.podIP): the leader names it, "
                                "with webhook_port, in the Lease, and the other replicas forward the reports that "
                                "reach them there; empty, they refuse them (503) instead.",
    )
    workers: int = Field(default=4, ge=1, le=64, description="Caches reconciled at once (threads of the leader).")
    leader_election: bool = Field(
        default=True,
        description="Elect one replica (a Lease in pod_namespace) to reconcile; every replica serves the webhook. "
                    "Off, or without pod_namespace, this process reconciles alone.",
    )
    leader_election_lease: str = Field(
        default="cachewarm-operator", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="Name of the Lease (in pod_namespace) the replicas elect their leader with.",
    )
    webhook_cert_secret: str = Field(
        default="cachewarm-webhook-tls", pattern=r"^$|^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="Secret (in pod_namespace) with the CA and serving certificate every replica shares; the first "
                    "replica creates it, any renews it before expiry. Unused with webhook_cert_dir; empty (or no "
                    "pod_namespace) makes one in memory per process.",
    )
    cert_check_seconds: float = Field(
        default=60.0, gt=0, description="How often the webhook's certificate is re-read (Secret or cert_dir) and "
                                        "reloaded in place when it changed.",
    )
    injection_window_seconds: float = Field(
        default=3600.0, gt=0, description="Window over which status.injection.recentPods counts injected pods."
    )

    @field_validator("admission_client_ca")
    @classmethod
    def _client_ca(cls, value: str) -> str:
        """A readable PEM file of CA certificates (checked now: a typo must not leave the
        admission listener open to anyone, nor stop it later)."""
        if value:
            try:
                ssl.create_default_context(cafile=value)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"not a readable PEM file of CA certificates: {value!r} ({exc})") from exc
        return value

    @model_validator(mode="after")
    def _per_peer_within_cap(self) -> Settings:
        """A per-peer cap set above the listener's own cap is a mistake (it would never
        apply); the default one above a smaller http_max_connections is that cap."""
        if "http_max_connections_per_peer" in self.model_fields_set and \
                self.http_max_connections_per_peer > self.http_max_connections:
            raise ValueError(f"http_max_connections_per_peer ({self.http_max_connections_per_peer}) is more than "
                             f"http_max_connections ({self.http_max_connections})")
        return self

    @model_validator(mode="after")
    def _ports_apart(self) -> Settings:
        """Each listener on a port of its own: two on one port (both bind with SO_REUSEPORT)
        would split the apiserver's calls between them, admitting some pods without injection."""
        ports = [p for p in (self.webhook_port, self.reports_port, self.metrics_port) if p]
        if self.webhook_enabled and len(set(ports)) != len(ports):
            raise ValueError(f"webhook_port ({self.webhook_port}), reports_port ({self.reports_port}) and "
                             f"metrics_port ({self.metrics_port}) must differ")
        return self

    @field_validator("namespaces", "webhook_hosts", "bucket_locations", "bucket_storage_classes", mode="before")
    @classmethod
    def _parse_list(cls, value: object) -> object:
        """A JSON list when the value starts with '[', otherwise comma-separated."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a valid JSON list ({exc.msg} at character {exc.pos}): {value!r}") from exc
            if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
                raise ValueError(f"a JSON list must hold strings only: {value!r}")
            return [item.strip() for item in parsed if item.strip()]
        return [part.strip() for part in value.split(",") if part.strip()]

    @field_validator("namespaces")
    @classmethod
    def _namespace_names(cls, value: list[str]) -> list[str]:
        wrong = [name for name in value if not _NAMESPACE.fullmatch(name)]
        if wrong:
            raise ValueError(f"not namespace names (lowercase letters, digits and '-', at most 63): {wrong}")
        return value

    @field_validator("bucket_locations", "bucket_storage_classes")
    @classmethod
    def _gcs_names(cls, value: list[str]) -> list[str]:
        """GCS location and storage class names: letters, digits, '-' and '_' (compared upper-case)."""
        wrong = [name for name in value if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,62}", name)]
        if wrong:
            raise ValueError(f"not GCS location or storage class names (letters, digits, '-', '_'): {wrong}")
        return [name.upper() for name in value]

    @classmethod
    def from_env(cls) -> Settings:
        """Settings from the environment. Raises pydantic.ValidationError on a bad value."""
        return cls()
