"""Runs the operator: settings, logging, kopf registry, webhook endpoint and event loop."""

from __future__ import annotations

import asyncio
import datetime as dt
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import kopf

from cachewarm import constants as c
from cachewarm import handlers, logs
from cachewarm.clients import kube
from cachewarm.clients.gcs import GcsClient
from cachewarm.injections import RecentInjections
from cachewarm.settings import Settings
from cachewarm.webhook import AdmissionServer, tls_files

# Retries of the webhook configuration stop doubling here: once it is installed, the
# operator should notice within a minute.
WEBHOOK_RETRY_MAX_SECONDS = 60.0


def run(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT. Blocks. Raises ValueError for unusable settings."""
    logs.configure(settings.log_format, settings.log_level)
    log = logs.get("cachewarm.operator")
    registry = kopf.OperatorRegistry()
    liveness = _liveness(settings.liveness_endpoint)

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Through the official client's config, as every other call here: in a pod its
        # ServiceAccount at $KUBERNETES_SERVICE_HOST (as client-go does; kopf's own
        # login_with_service_account asks for https://kubernetes.default.svc, which needs
        # cluster DNS), elsewhere $KUBECONFIG.
        info: kopf.ConnectionInfo | None = kopf.login_via_client(**kwargs)
        return info

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        handlers.configure_kopf(settings)
        if ours.webhook_enabled:
            settings.admission.server, ca_pem = _webhook_server(ours)
            if ours.webhook_configuration and ca_pem:
                # The first attempt is awaited (so a working cluster has the webhook pointed
                # at us before anything reconciles); a failed one never holds up startup.
                first_attempt = asyncio.Event()
                memo.webhook_configuration_task = asyncio.create_task(
                    _keep_webhook_configuration(ours, ca_pem, first_attempt))
                await first_attempt.wait()

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
        task = memo.get("webhook_configuration_task")
        if task is not None:
            task.cancel()

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


def _webhook_server(settings: Settings) -> tuple[AdmissionServer, bytes]:
    """Serving certificate and the server; the CA that signed it (b"" when unknown)."""
    hosts = list(settings.webhook_hosts)
    if settings.webhook_url:
        url_host = urllib.parse.urlparse(settings.webhook_url).hostname
        if url_host and url_host not in hosts:
            hosts.append(url_host)
    tls = tls_files(settings.webhook_cert_dir, Path(tempfile.mkdtemp(prefix="cachewarm-tls-")), hosts,
                    dt.datetime.now(dt.timezone.utc))
    server = AdmissionServer(
        addr=settings.webhook_address, port=settings.webhook_port,
        certfile=str(tls.certfile), pkeyfile=str(tls.keyfile), cadata=tls.ca_pem or None,
    )
    return server, tls.ca_pem or b""


async def _keep_webhook_configuration(settings: Settings, ca_pem: bytes, first_attempt: asyncio.Event) -> None:
    """Point our MutatingWebhookConfiguration at this operator, retrying until it works.

    Runs beside reconciliation, never in its way: while the configuration is missing or
    unwritable, caches are still reconciled but pods are admitted without the cache env,
    so every failed attempt is a warning log line, and an Event on the operator's Pod
    (when settings.pod_name is known) when the error is new. Sets `first_attempt` after
    the first try, whatever its outcome."""
    log = logs.get("cachewarm.webhook")
    name = settings.webhook_configuration
    url = f"{settings.webhook_url.rstrip('/')}/{handlers.WEBHOOK_ID}" if settings.webhook_url else None
    retry, last_error = 0, ""
    while True:
        try:
            changed = await asyncio.to_thread(kube.set_webhook_client_config, name, ca_pem, url)
        except Exception as exc:  # noqa: BLE001 - any failure is retried, never fatal
            first_attempt.set()
            delay = min(handlers.backoff(settings, retry), WEBHOOK_RETRY_MAX_SECONDS)
            error = str(exc) or type(exc).__name__
            log.warning("Failed to point webhook configuration at this operator; pods are admitted without "
                        "the cache env until it is", configuration=name, error=error, retry_in_seconds=delay)
            if error != last_error:
                await _operator_event(settings, "Warning", c.Reason.WEBHOOK_NOT_CONFIGURED,
                                      f"MutatingWebhookConfiguration {name} could not be pointed at this operator "
                                      f"({error}); pods are admitted without the cache env; retrying")
            retry, last_error = retry + 1, error
            await asyncio.sleep(delay)
            continue
        log.info("Pointed webhook configuration at this operator", configuration=name,
                 webhooks_changed=changed, url=url or "(service)")
        if last_error:
            await _operator_event(settings, "Normal", c.Reason.WEBHOOK_CONFIGURED,
                                  f"Pointed MutatingWebhookConfiguration {name} at this operator")
        first_attempt.set()
        return


async def _operator_event(settings: Settings, type_: str, reason: str, message: str) -> None:
    """An Event on the operator's own Pod; none when the Pod is not known (the caller's
    log line is then all there is)."""
    if not (settings.pod_name and settings.pod_namespace):
        return
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": settings.pod_name, "namespace": settings.pod_namespace}}
    try:
        await asyncio.to_thread(kube.post_event, pod, type=type_, reason=reason, message=message,
                                now=dt.datetime.now(dt.timezone.utc))
    except kube.KubeError as exc:
        logs.get("cachewarm.webhook").warning("Failed to post event on the operator's Pod", reason=reason, error=str(exc))


def _liveness(url: str) -> str | None:
    if not url:
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.port:
        raise ValueError(f"CACHEWARM_LIVENESS_ENDPOINT must be http://host:port/path, got {url!r}")
    return url
