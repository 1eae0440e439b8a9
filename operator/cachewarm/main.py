"""Runs the operator: settings, logging, kopf registry, webhook endpoint and event loop."""

from __future__ import annotations

import asyncio
import datetime as dt
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import kopf

from cachewarm import handlers, logs
from cachewarm.clients import kube
from cachewarm.clients.gcs import GcsClient
from cachewarm.injections import RecentInjections
from cachewarm.settings import Settings
from cachewarm.webhook import AdmissionServer, tls_files


def run(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT. Blocks. Raises ValueError for unusable settings."""
    logs.configure(settings.log_format, settings.log_level)
    log = logs.get("cachewarm.operator")
    registry = kopf.OperatorRegistry()
    liveness = _liveness(settings.liveness_endpoint)

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: its ServiceAccount; elsewhere: $KUBECONFIG.
        info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        return info

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        handlers.configure_kopf(settings)
        if ours.webhook_enabled:
            settings.admission.server = _webhook_server(ours)

    ours = settings
    kube.load_config()  # warmer Jobs, pods and webhook events go through the official client
    handlers.register(registry, settings)
    memo = kopf.Memo(
        gcs=GcsClient(project=settings.gcp_project, timeout=settings.gcs_timeout_seconds),
        injections=RecentInjections(settings.injection_window_seconds),
    )
    scope: dict[str, Any] = (
        {"namespaces": settings.namespaces} if settings.namespaces else {"clusterwide": True}
    )
    log.info("Started cachewarm operator", scope=settings.namespaces or "cluster",
             resync_seconds=settings.resync_seconds, webhook=settings.webhook_enabled)
    asyncio.run(
        kopf.operator(registry=registry, memo=memo, standalone=True, liveness_endpoint=liveness, **scope)
    )


def _webhook_server(settings: Settings) -> AdmissionServer:
    """Serving certificate, our webhook configuration pointed at it, and the server."""
    log = logs.get("cachewarm.webhook")
    hosts = list(settings.webhook_hosts)
    if settings.webhook_url:
        url_host = urllib.parse.urlparse(settings.webhook_url).hostname
        if url_host and url_host not in hosts:
            hosts.append(url_host)
    tls = tls_files(settings.webhook_cert_dir, Path(tempfile.mkdtemp(prefix="cachewarm-tls-")), hosts,
                    dt.datetime.now(dt.timezone.utc))
    if settings.webhook_configuration and tls.ca_pem:
        url = f"{settings.webhook_url.rstrip('/')}/{handlers.WEBHOOK_ID}" if settings.webhook_url else None
        changed = kube.set_webhook_client_config(settings.webhook_configuration, tls.ca_pem, url)
        log.info("Pointed webhook configuration at this operator", configuration=settings.webhook_configuration,
                 webhooks_changed=changed, url=url or "(service)")
    return AdmissionServer(
        addr=settings.webhook_address, port=settings.webhook_port,
        certfile=str(tls.certfile), pkeyfile=str(tls.keyfile), cadata=tls.ca_pem or None,
    )


def _liveness(url: str) -> str | None:
    if not url:
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.port:
        raise ValueError(f"CACHEWARM_LIVENESS_ENDPOINT must be http://host:port/path, got {url!r}")
    return url
