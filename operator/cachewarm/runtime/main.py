"""Runs the operator: settings, logging, kopf registry, leader election, the reconcile
controller, the webhook and reports listeners and their certificate, and the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import os
import signal
import ssl
import time
import urllib.parse
from pathlib import Path
from typing import Any

import kopf

from cachewarm.api import constants as c
from cachewarm.runtime import handlers
from cachewarm.runtime import images, logs
from cachewarm.admission import keeper as servingcert
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.clients.gcs import GcsClient
from cachewarm.runtime.controller import Controller
from cachewarm.reconcile.admitted import RecentInjections
from cachewarm.runtime.leader import AlwaysLeader, Leadership, address, identity, parse_identity
from cachewarm.runtime.queue import backoff
from cachewarm.api.metrics import Metrics
from cachewarm.reports.receiver import PATH as REPORT_PATH
from cachewarm.reports.receiver import Forwarder, Receiver
from cachewarm.reports.store import LabelledPods, Store
from cachewarm.runtime.settings import Settings
from cachewarm.admission.server import AdmissionServer, Limits, Listener, ServingTls

# Retries of the webhook configuration stop doubling here: once it is installed, the
# operator should notice within a minute.
WEBHOOK_RETRY_MAX_SECONDS = 60.0
# At shutdown, reconciles in flight get this long to end before the Lease is given up.
DRAIN_SECONDS = 20.0
# The operator's own pod is read this often, this far apart, for the warmer image's digest.
PIN_ATTEMPTS, PIN_RETRY_SECONDS = 10, 1.0


def run(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT. Blocks. Raises ValueError for unusable settings."""
    logs.configure(settings.log_format, settings.log_level)
    log = logs.get("cachewarm.operator")
    liveness = _liveness(settings.liveness_endpoint)
    # Everything outside kopf's watches goes through this one client, as GCS through GcsClient.
    kube = KubeClient.from_environment(timeout=settings.kube_timeout_seconds)
    settings = pin_warmer_image(settings, kube)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, webhook=settings.webhook_enabled)
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    memo = kopf.Memo()
    # Every replica watches the caches: any of them reports their entries and bytes.
    metrics = Metrics(lambda: memo.controller.store.values() if "controller" in memo else ())
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)  # OSError (port taken) stops the start, with its message
    memo.update(
        settings=settings,
        metrics=metrics,
        reports=Store(dt.timedelta(seconds=settings.report_window_seconds)),
        pods=LabelledPods(c.CACHE_LABEL),
        gcs=GcsClient(project=settings.gcp_project, timeout=settings.gcs_timeout_seconds),
        kube=kube,
        injections=RecentInjections(settings.injection_window_seconds),
        tasks=[],
    )
    scope: dict[str, Any] = (
        {"namespaces": settings.namespaces} if settings.namespaces else {"clusterwide": True}
    )
    log.info("Started cachewarm operator", scope=settings.namespaces or "cluster",
             resync_seconds=settings.resync_seconds, webhook=settings.webhook_enabled)
    if settings.instance == "default":
        log.warning("CACHEWARM_INSTANCE is 'default': bucket grants and the buckets cachewarm creates name the "
                    "cluster by it, so another cluster's operator in the same GCP project also left at 'default' "
                    "gets what a namespace of the same name is granted here; set it to this cluster's name "
                    "(docs/bucket-and-data-safety.md#bucket-consent)", instance=settings.instance)
    asyncio.run(
        kopf.operator(registry=registry, memo=memo, standalone=True, liveness_endpoint=liveness, **scope)
    )


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Through the official client's config, as every other call here: in a pod its
    ServiceAccount at $KUBERNETES_SERVICE_HOST (as client-go does; kopf's own
    login_with_service_account asks for https://kubernetes.default.svc, which needs cluster
    DNS), elsewhere $KUBECONFIG."""
    info: kopf.ConnectionInfo | None = kopf.login_via_client(**kwargs)
    return info


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """The webhook's certificate, server and configuration first, then leader election and
    the controller. Raises nothing: kopf would run a failed startup again, and a second
    controller would reconcile beside the first."""
    ours: Settings = memo.settings
    log = logs.get("cachewarm.operator")
    handlers.configure_kopf(settings)
    # Where this replica takes reports; named in the Lease while it leads.
    reports_at = address(ours.pod_ip, ours.reports_port) if ours.webhook_enabled else ""
    if ours.webhook_enabled:
        tls = ServingTls(Path(ours.admission_client_ca).read_bytes() if ours.admission_client_ca else b"",
                         require_client_cert=bool(ours.admission_client_ca))
        if not ours.admission_client_ca:
            log.warning("The admission listener answers any caller that reaches it (no admission_client_ca): it "
                        "cannot tell the apiserver from a pod; see docs/security.md")
        material, authoritative = await _first_material(ours, memo.kube)
        try:
            tls.load(material)
        except Exception as exc:  # noqa: BLE001 - e.g. cert-manager's tls.crt and tls.key not a pair (yet)
            log.warning("Could not load the webhook's certificate; serving a temporary one until it loads",
                        error=f"{type(exc).__name__}: {exc}")
            tls.load(servingcert.in_memory(webhook_hosts(ours), dt.datetime.now(dt.timezone.utc)))
            authoritative = False
        # Reports from training pods arrive on their own listener (same certificate, no
        # client certificate asked); a follower forwards them to the leader's, trusting
        # what it serves itself.
        memo.forwarder = Forwarder(
            leader_address=lambda: parse_identity(memo.leadership.holder)[1] if "leadership" in memo else None,
            own_address=reports_at,
            ca=lambda: tls.material.ca_pem if tls.material is not None else b"",
            server_hostname=urllib.parse.urlparse(ours.report_url).hostname or "", metrics=memo.metrics)
        receiver = Receiver(
            kube=memo.kube, store=memo.reports, metrics=memo.metrics,
            leading=lambda: "controller" in memo and memo.controller.leader.is_leader,
            cache_exists=lambda ns, name: "controller" in memo and memo.controller.has_cache(ns, name),
            pods=memo.pods, forwarder=memo.forwarder, review_queue=ours.report_review_queue)
        limits, admission_limits = listener_limits(ours)
        memo.report_listener = Listener(name="reports", addr=ours.webhook_address, port=ours.reports_port,
                                        context=tls.reports_context, routes={REPORT_PATH: receiver.handle},
                                        limits=limits, label="reports", metrics=memo.metrics)
        try:
            await memo.report_listener.start()
        except OSError as exc:
            log.error("Could not listen for reports; pods' reports are not taken", port=ours.reports_port,
                      error=str(exc))
        settings.admission.server = AdmissionServer(addr=ours.webhook_address, port=ours.webhook_port, tls=tls,
                                                    url=ours.webhook_url, limits=admission_limits,
                                                    metrics=memo.metrics)
        keeper = WebhookKeeper(ours, memo.kube, tls, authoritative, memo.metrics)
        await keeper.point_configuration()
        memo.tasks.append(asyncio.create_task(keeper.watch(), name="webhook-certificate"))
        memo.keeper = keeper
    if ours.leader_election and ours.pod_namespace:
        leadership: Leadership | AlwaysLeader = Leadership(memo.kube, ours.pod_namespace, ours.leader_election_lease,
                                                          identity(ours.pod_name, reports_at))
    else:
        log.info("Leader election is off: this process reconciles", reason="disabled" if not ours.leader_election
                 else "CACHEWARM_POD_NAMESPACE is not set")
        leadership = AlwaysLeader()
    controller = Controller(ours, memo.gcs, memo.kube, memo.injections, leadership, memo.metrics, memo.reports)
    memo.controller, memo.leadership = controller, leadership
    task = asyncio.create_task(controller.run(), name="controller")
    task.add_done_callback(_controller_ended)
    memo.tasks.append(task)
    leadership.start(controller.leadership_changed)


def listener_limits(ours: Settings) -> tuple[Limits, Limits]:
    """The reports listener's limits and the admission listener's: the same but for the
    keep-alive, which on the admission listener outlasts the apiserver's idle connections
    (it keeps a pool of them; closing one under it costs a new TLS handshake per burst of
    pods, and a request racing the close fails, admitting a pod without injection)."""
    reports = Limits(handshake_seconds=ours.http_header_seconds, header_seconds=ours.http_header_seconds,
                     body_seconds=ours.http_body_seconds, keepalive_seconds=ours.http_keepalive_seconds,
                     max_connections=ours.http_max_connections,
                     max_connections_per_peer=ours.http_max_connections_per_peer)
    return reports, dataclasses.replace(reports, keepalive_seconds=ours.admission_keepalive_seconds)


def _controller_ended(task: asyncio.Task[None]) -> None:
    """The controller only ends when cancelled at shutdown. Ended otherwise (a bug), this
    process stops (SIGTERM: kopf's graceful stop) so the kubelet restarts it, rather than
    serving on while reconciling nothing."""
    if task.cancelled():
        return
    logs.get("cachewarm.operator").critical("The reconcile loop ended; stopping the operator",
                                            error=repr(task.exception()))
    os.kill(os.getpid(), signal.SIGTERM)


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop leading, let reconciles in flight end (bounded), then give the Lease up, so
    the next leader never reconciles a cache this replica still writes."""
    leadership = memo.get("leadership")
    controller = memo.get("controller")
    if leadership is not None and leadership.stop() and controller is not None:
        if not await controller.drain(DRAIN_SECONDS):
            logs.get("cachewarm.operator").warning("Reconciles still running at shutdown; the Lease is kept until "
                                                   "it expires", seconds=DRAIN_SECONDS)
            leadership = None
    for task in memo.get("tasks", []):
        task.cancel()
    keeper = memo.get("keeper")
    if keeper is not None:
        keeper.stop()
    forwarder = memo.get("forwarder")
    if forwarder is not None:
        await forwarder.close()
    report_listener = memo.get("report_listener")
    if report_listener is not None:
        await report_listener.stop()
    if leadership is not None:
        await asyncio.to_thread(leadership.release)


def pin_warmer_image(settings: Settings, kube: KubeClient) -> Settings:
    """The settings with the warmer image by the digest the operator's own pod ran it at
    (runtime/images.py), unless CACHEWARM_WARMER_IMAGE names one or this process is no pod;
    where none can be had, as they were, and the log says why."""
    log = logs.get("cachewarm.operator")
    if "warmer_image" in settings.model_fields_set or not (settings.pod_name and settings.pod_namespace):
        if "@sha256:" not in settings.warmer_image:
            log.warning("The warmer image is referenced by tag: pods run whatever it names when they start",
                        image=settings.warmer_image)
        return settings
    pod: dict[str, Any] | None = None
    for attempt in range(PIN_ATTEMPTS):
        # The kubelet reports the init container's imageID in the pod's status a moment
        # after it exits, which may be after this container starts: read again until then.
        try:
            pod = kube.read_pod(settings.pod_namespace, settings.pod_name)
        except KubeError as exc:
            log.warning("Could not read the operator's pod; the warmer image is referenced by tag",
                        image=settings.warmer_image, error=str(exc))
            return settings
        if pod is None or images.reported(pod) or attempt == PIN_ATTEMPTS - 1:
            break
        time.sleep(PIN_RETRY_SECONDS)
    pinned, why = images.warmer_image_of(pod or {})
    if pinned is None:
        log.warning("The warmer image is referenced by tag", image=settings.warmer_image, why=why)
        return settings
    log.info("Warmer image pinned by digest", image=pinned, why=why)
    return settings.model_copy(update={"warmer_image": pinned})


def webhook_hosts(settings: Settings) -> list[str]:
    hosts = list(settings.webhook_hosts)
    if settings.webhook_url:
        url_host = urllib.parse.urlparse(settings.webhook_url).hostname
        if url_host and url_host not in hosts:
            hosts.append(url_host)
    return hosts


def _material(settings: Settings, kube: KubeClient) -> tuple[servingcert.TlsMaterial, str] | None:
    """The certificate from where settings say it lives (None: nowhere to look again, the
    in-memory one stays). Raises KubeError, OSError."""
    now = dt.datetime.now(dt.timezone.utc)
    if settings.webhook_cert_dir:
        return servingcert.from_dir(settings.webhook_cert_dir), ""
    if settings.webhook_cert_secret and settings.pod_namespace:
        return servingcert.from_secret(kube, settings.pod_namespace, settings.webhook_cert_secret,
                                       webhook_hosts(settings), now)
    return None


async def _first_material(settings: Settings, kube: KubeClient) -> tuple[servingcert.TlsMaterial, bool]:
    """The certificate to start serving with, and whether it is the real one (from its
    source). When the source cannot be read yet, an in-memory one that the webhook
    configuration is never pointed at (its CA would flip the caBundle away from the one
    the other replicas serve): the webhook listens, the keeper swaps in the real one."""
    try:
        found = await asyncio.to_thread(_material, settings, kube)
    except Exception as exc:  # noqa: BLE001 - KubeError, OSError, a corrupt Secret: serve, and say so
        logs.get("cachewarm.webhook").warning(
            "Could not read the webhook's certificate; serving a temporary one until it can be read",
            error=f"{type(exc).__name__}: {exc}")
        return servingcert.in_memory(webhook_hosts(settings), dt.datetime.now(dt.timezone.utc)), False
    if found is not None:
        return found[0], True
    # No source to read (outside a cluster): the in-memory certificate is the real one.
    return servingcert.in_memory(webhook_hosts(settings), dt.datetime.now(dt.timezone.utc)), True


class WebhookKeeper:
    """Keeps the served certificate current (re-read every cert_check_seconds, reloaded
    in place when it changed), the admission client CA too (re-read at the same rounds),
    and the webhook configuration's caBundle on its CA (checked at each round too, so a
    bundle changed by someone else is put back)."""

    def __init__(self, settings: Settings, kube: KubeClient, tls: ServingTls, authoritative: bool,
                 metrics: Metrics | None = None) -> None:
        self.settings, self.kube, self.tls, self.metrics = settings, kube, tls, metrics
        self.authoritative = authoritative  # False: a stand-in, never published
        self._configuring: asyncio.Task[None] | None = None
        self._ca = b""
        self.client_ca_problem = ""  # why the client CA file could not be loaded at the last round

    async def point_configuration(self) -> None:
        """Point the configuration at the served CA: the first attempt awaited, retries in
        the background. Nothing while a stand-in certificate is served."""
        material = self.tls.material
        if not (self.settings.webhook_configuration and self.authoritative and material and material.ca_pem):
            return
        if self._configuring is not None and not self._configuring.done():
            if material.ca_pem == self._ca:
                return  # still retrying this very CA
            self._configuring.cancel()
        self._ca = material.ca_pem
        first_attempt = asyncio.Event()
        self._configuring = asyncio.create_task(
            _keep_webhook_configuration(self.settings, self.kube, self._ca, first_attempt))
        await first_attempt.wait()

    async def watch(self) -> None:
        log = logs.get("cachewarm.webhook")
        while True:
            await asyncio.sleep(self.settings.cert_check_seconds)
            await self.reload_client_ca()
            try:
                found = await asyncio.to_thread(_material, self.settings, self.kube)
                if found is not None:
                    material, why = found
                    if self.tls.load(material):
                        log.info("Serving a new webhook certificate", renewed_because=why or "changed at its source")
                    self.authoritative = True
                await self.point_configuration()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving the current certificate, try again next round
                log.warning("Could not re-read or load the webhook's certificate; serving the current one",
                            error=f"{type(exc).__name__}: {exc}")

    async def reload_client_ca(self) -> None:
        """Re-read the admission client CA file; a changed one is asked of new connections
        (those open stay). One that cannot be read or holds no certificate leaves the CA
        asked for as it is, never none: said in a warning when the problem is new, and by
        the gauge cachewarm_admission_client_ca_stale while it lasts."""
        path = self.settings.admission_client_ca
        if not path:
            return
        log = logs.get("cachewarm.webhook")
        try:
            changed = self.tls.load_client_ca(await asyncio.to_thread(Path(path).read_bytes))
        except (OSError, ValueError, ssl.SSLError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self.client_ca_problem:
                log.warning("Could not reload the admission client CA; still asking callers for a certificate of "
                            "the CA loaded before", file=path, error=problem)
            self.client_ca_problem = problem
            if self.metrics is not None:
                self.metrics.client_ca_stale.set(1)
            return
        if changed:
            log.info("Loaded a new admission client CA; new connections need a certificate of it", file=path)
        elif self.client_ca_problem:
            log.info("The admission client CA file is usable again; it holds the CA asked for already", file=path)
        self.client_ca_problem = ""
        if self.metrics is not None:
            self.metrics.client_ca_stale.set(0)

    def stop(self) -> None:
        if self._configuring is not None:
            self._configuring.cancel()


async def _keep_webhook_configuration(settings: Settings, kube: KubeClient, ca_pem: bytes,
                                      first_attempt: asyncio.Event) -> None:
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
            delay = min(backoff(settings.retry_delay_seconds, retry), WEBHOOK_RETRY_MAX_SECONDS)
            error = str(exc) or type(exc).__name__
            log.warning("Failed to point webhook configuration at this operator; pods are admitted without "
                        "the cache env until it is", configuration=name, error=error, retry_in_seconds=delay)
            if error != last_error:
                await _operator_event(settings, kube, "Warning", c.Reason.WEBHOOK_NOT_CONFIGURED,
                                      f"MutatingWebhookConfiguration {name} could not be pointed at this operator "
                                      f"({error}); pods are admitted without the cache env; retrying")
            retry, last_error = retry + 1, error
            await asyncio.sleep(delay)
            continue
        if changed or retry:
            log.info("Pointed webhook configuration at this operator", configuration=name,
                     webhooks_changed=changed, url=url or "(service)")
        if last_error:
            await _operator_event(settings, kube, "Normal", c.Reason.WEBHOOK_CONFIGURED,
                                  f"Pointed MutatingWebhookConfiguration {name} at this operator")
        first_attempt.set()
        return


async def _operator_event(settings: Settings, kube: KubeClient, type_: str, reason: str, message: str) -> None:
    """An Event on the operator's own Pod; none when the Pod is not known (the caller's
    log line is then all there is)."""
    if not (settings.pod_name and settings.pod_namespace):
        return
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": settings.pod_name, "namespace": settings.pod_namespace}}
    try:
        await asyncio.to_thread(kube.post_event, pod, type=type_, reason=reason, message=message,
                                now=dt.datetime.now(dt.timezone.utc))
    except KubeError as exc:
        logs.get("cachewarm.webhook").warning("Failed to post event on the operator's Pod", reason=reason, error=str(exc))


def _liveness(url: str) -> str | None:
    if not url:
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.port:
        raise ValueError(f"CACHEWARM_LIVENESS_ENDPOINT must be http://host:port/path, got {url!r}")
    return url
