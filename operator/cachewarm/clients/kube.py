"""Kubernetes API calls the operator makes outside kopf's own machinery.

kopf watches, patches status and posts events; this module does the rest with the
official client. ApiException becomes KubeError here and nowhere else.
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException


class KubeError(Exception):
    """A Kubernetes API call failed; `status` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def load_config() -> None:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG. Raises KubeError."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        except (config.ConfigException, FileNotFoundError) as exc:
            raise KubeError(f"no Kubernetes credentials: {exc}") from exc


def set_webhook_client_config(configuration: str, ca_pem: bytes, url: str | None) -> int:
    """Point every webhook of MutatingWebhookConfiguration `configuration` at our endpoint:
    the CA bundle, and the URL when given (else its Service stays). Returns how many
    webhooks were changed; 0 means it already pointed at us.
    Raises KubeError (404 when the configuration is not installed)."""
    api = client.AdmissionregistrationV1Api()
    try:
        current: Any = api.read_mutating_webhook_configuration(configuration)
    except ApiException as exc:
        raise KubeError(f"reading MutatingWebhookConfiguration {configuration}: {exc.reason}", exc.status) from exc
    bundle = base64.b64encode(ca_pem).decode()
    changed = 0
    for hook in current.webhooks or []:
        cc = hook.client_config
        wanted_url = url if url else cc.url
        if cc.ca_bundle != bundle or cc.url != wanted_url:
            cc.ca_bundle = bundle
            if url:
                cc.url = url
                cc.service = None
            changed += 1
    if changed:
        try:
            api.replace_mutating_webhook_configuration(configuration, current)
        except ApiException as exc:
            raise KubeError(f"updating MutatingWebhookConfiguration {configuration}: {exc.reason}", exc.status) from exc
    return changed


def post_event(involved: dict[str, Any], *, type: str, reason: str, message: str, now: dt.datetime) -> None:
    """Create a core/v1 Event about `involved` (apiVersion, kind, metadata name/namespace/uid).
    Used where kopf's own event queue is not available (the admission path).
    Raises KubeError."""
    meta = involved["metadata"]
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=client.V1ObjectReference(
            api_version=involved["apiVersion"], kind=involved["kind"], name=meta["name"],
            namespace=meta["namespace"], uid=meta.get("uid"),
        ),
        type=type, reason=reason, message=message[:1024],
        first_timestamp=now, last_timestamp=now, count=1,
        source=client.V1EventSource(component="cachewarm"),
        reporting_component="cachewarm", reporting_instance="cachewarm-operator",
    )
    try:
        client.CoreV1Api().create_namespaced_event(meta["namespace"], event)
    except ApiException as exc:
        raise KubeError(f"posting event {reason}: {exc.reason}", exc.status) from exc


def _dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = client.ApiClient().sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
    return out


def _list(call: Any, what: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    try:
        found = call(namespace, label_selector=selector)
    except ApiException as exc:
        raise KubeError(f"listing {what} in {namespace}: {exc.reason}", exc.status) from exc
    return [_dict(item) for item in found.items]


def list_jobs(namespace: str, selector: str) -> list[dict[str, Any]]:
    """Jobs matching a label selector, as plain dicts. Raises KubeError."""
    return _list(client.BatchV1Api().list_namespaced_job, "Jobs", namespace, selector)


def create(body: dict[str, Any]) -> bool:
    """Create a namespaced Job or Service; False when it already exists (same name).
    Raises KubeError."""
    namespace = body["metadata"]["namespace"]
    try:
        if body["kind"] == "Job":
            client.BatchV1Api().create_namespaced_job(namespace, body)  # type: ignore[arg-type]  # dicts are accepted
        elif body["kind"] == "Service":
            client.CoreV1Api().create_namespaced_service(namespace, body)  # type: ignore[arg-type]
        else:
            raise ValueError(f"cannot create {body['kind']}")
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise KubeError(f"creating {body['kind']} {namespace}/{body['metadata']['name']}: {exc.reason}",
                        exc.status) from exc
    return True


def delete_job(namespace: str, name: str) -> None:
    """Delete a Job and, in the background, its pods; a Job already gone is fine.
    Raises KubeError."""
    try:
        client.BatchV1Api().delete_namespaced_job(name, namespace, propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise KubeError(f"deleting Job {namespace}/{name}: {exc.reason}", exc.status) from exc


def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching a label selector, as plain dicts. Raises KubeError."""
    return _list(client.CoreV1Api().list_namespaced_pod, "Pods", namespace, selector)


def remove_scheduling_gate(namespace: str, name: str, index: int, gate: str) -> None:
    """Remove scheduling gate `gate` at `index` of a pod (a JSON patch that first tests the
    name, so a concurrent change fails instead of removing another gate). A pod already gone
    or already released is fine. Raises KubeError."""
    patch = [
        {"op": "test", "path": f"/spec/schedulingGates/{index}/name", "value": gate},
        {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
    ]
    try:
        client.CoreV1Api().patch_namespaced_pod(name, namespace, patch)
    except ApiException as exc:
        if exc.status not in (404, 422):
            raise KubeError(f"releasing Pod {namespace}/{name}: {exc.reason}", exc.status) from exc
