"""Runs the operator: settings, logging, kopf registry and the event loop."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

import kopf

from cachewarm import handlers, logs
from cachewarm.clients.gcs import GcsClient
from cachewarm.settings import Settings


def run(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT. Blocks."""
    logs.configure(settings.log_format, settings.log_level)
    log = logs.get("cachewarm.operator")
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        handlers.configure_kopf(settings)

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: its ServiceAccount; elsewhere: $KUBECONFIG.
        info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        return info

    handlers.register(registry, settings)
    memo = kopf.Memo(gcs=GcsClient(project=settings.gcp_project, timeout=settings.gcs_timeout_seconds))
    scope: dict[str, Any] = (
        {"namespaces": settings.namespaces} if settings.namespaces else {"clusterwide": True}
    )
    log.info("Started cachewarm operator", scope=settings.namespaces or "cluster",
             resync_seconds=settings.resync_seconds)
    asyncio.run(
        kopf.operator(
            registry=registry,
            memo=memo,
            standalone=True,
            liveness_endpoint=_liveness(settings.liveness_endpoint),
            **scope,
        )
    )


def _liveness(url: str) -> str | None:
    if not url:
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.port:
        raise ValueError(f"CACHEWARM_LIVENESS_ENDPOINT must be http://host:port/path, got {url!r}")
    return url
