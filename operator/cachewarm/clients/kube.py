"""Kubernetes API calls the operator makes outside kopf's own machinery.

kopf watches; everything else goes through one `KubeClient` (the official client, one
connection pool, a timeout on every request), made once at startup and handed to the
controller, the warm-up logic, the certificate keeper and the election the way the
`GcsClient` is, so each can be given another in tests. ApiException becomes KubeError
here and nowhere else.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pydantic
import urllib3
import urllib3.exceptions
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from cachewarm.api import constants as c


class KubeError(Exception):
    """A Kubernetes API call failed; `status` is the HTTP status when there was one,
    `reason` a constants.Reason for conditions and events."""

    def __init__(self, message: str, status: int | None = None, reason: str = c.Reason.KUBERNETES_ERROR) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@contextmanager
def _errors(what: str, ok: tuple[int, ...] = ()) -> Iterator[None]:
    """ApiException (unless its status is in `ok`), connection errors and the client's own
    argument validation (pydantic) become KubeError."""
    try:
        yield
    except ApiException as exc:
        if exc.status in ok:
            return
        raise KubeError(f"{what}: {exc.status} {exc.reason}: {_api_message(exc)}".rstrip(": "), exc.status) from exc
    except pydantic.ValidationError as exc:
        raise KubeError(f"{what}: the Kubernetes client refused the object: {exc}", None,
                        c.Reason.INVALID_OBJECT) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _api_message(exc: ApiException) -> str:
    """The apiserver's Status message, which names the field at fault."""
    try:
        return str(json.loads(exc.body or "{}").get("message", ""))
    except (ValueError, AttributeError):
        return ""


_TYPED: dict[str, Any] = {"Job": client.V1Job, "Service": client.V1Service, "ConfigMap": client.V1ConfigMap}
# Turns the client's models into plain dicts; it only serializes and never connects.
_SERIALIZER = client.ApiClient(client.Configuration())


def _dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
    return out


def typed(body: dict[str, Any]) -> Any:
    """The client's model of a Job or Service built as a dict (quantities as strings, etc.).
    The client validates every argument; building the model here, and checking that it
    serializes back to exactly `body`, makes sure nothing we built is refused or silently
    dropped on the way. Raises KubeError (reason InvalidObject)."""
    model = _TYPED.get(str(body.get("kind")))
    if model is None:
        raise KubeError(f"cannot create {body.get('kind')}", None, c.Reason.INVALID_OBJECT)
    what = f"building {body['kind']} {body['metadata'].get('namespace')}/{body['metadata'].get('name')}"
    with _errors(what):
        obj = model.model_validate(body)
    if _dict(obj) != body:
        raise KubeError(f"{what}: the Kubernetes client would not send it as built (unknown or mistyped fields)",
                        None, c.Reason.INVALID_OBJECT)
    return obj


class KubeClient:
    """Every Kubernetes API call of the operator outside kopf's watches. Thread-safe (the
    reconcile workers share it). Each request gives up after `timeout` seconds (KubeError),
    so a hung connection never keeps a cache's reconcile busy."""

    def __init__(self, api: client.ApiClient | None = None, *, timeout: float = 30.0) -> None:
        self._api = api
        self.timeout = timeout

    @classmethod
    def from_environment(cls, *, timeout: float = 30.0) -> KubeClient:
        """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG. Raises KubeError."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except (config.ConfigException, FileNotFoundError) as exc:
                raise KubeError(f"no Kubernetes credentials: {exc}") from exc
        return cls.for_configuration(configuration, timeout=timeout)

    @classmethod
    def for_configuration(cls, configuration: client.Configuration, *, timeout: float = 30.0) -> KubeClient:
        """A client for `configuration`, with the operator's retry policy: a connection
        that could not be made is tried again (twice), a request that was sent is not
        (urllib3 would repeat a GET after a read timeout three times, so a hung apiserver
        would hold a call for four timeouts; the reconcile's own backoff retries instead)."""
        configuration.retries = urllib3.Retry(total=2, connect=2, read=0, status=0, other=0, redirect=0,
                                              raise_on_status=False)
        return cls(client.ApiClient(configuration), timeout=timeout)

    @property
    def api_client(self) -> client.ApiClient:
        if self._api is None:
            raise KubeError("this KubeClient has no connection (made without an ApiClient)")
        return self._api

    def _core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    def _batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    def _custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    def _list(self, call: Any, what: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        with _errors(f"listing {what} in {namespace}"):
            found = call(namespace, label_selector=selector, _request_timeout=self.timeout)
        return [_dict(item) for item in found.items]

    # --- the webhook configuration and Events ---

    def set_webhook_client_config(self, configuration: str, ca_pem: bytes, url: str | None) -> int:
        """Point every webhook of MutatingWebhookConfiguration `configuration` at our
        endpoint: the CA bundle, and the URL when given (else its Service stays). Returns
        how many webhooks were changed; 0 means it already pointed at us. A JSON patch of
        each webhook's clientConfig alone, on the resourceVersion read (a field this client
        does not model is never dropped, and the policy cachewarm-operator-webhook allows
        exactly this). Raises KubeError (404 when the configuration is not installed, 409/422
        when it changed since it was read: the next check tries again)."""
        api = client.AdmissionregistrationV1Api(self.api_client)
        current: Any = None
        with _errors(f"reading MutatingWebhookConfiguration {configuration}"):
            current = api.read_mutating_webhook_configuration(configuration, _request_timeout=self.timeout)
        bundle = base64.b64encode(ca_pem).decode()
        ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/resourceVersion",
                                      "value": current.metadata.resource_version}]
        changed = 0
        for i, hook in enumerate(current.webhooks or []):
            cc = hook.client_config
            wanted_url = url if url else cc.url
            if cc.ca_bundle == bundle and cc.url == wanted_url:
                continue
            changed += 1
            ops += [{"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name},
                    {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}]
            if url:
                ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/url", "value": url})
                if cc.service is not None:
                    ops.append({"op": "remove", "path": f"/webhooks/{i}/clientConfig/service"})
        if changed:
            with _errors(f"updating MutatingWebhookConfiguration {configuration}"):
                api.patch_mutating_webhook_configuration(configuration, ops, _request_timeout=self.timeout)
        return changed

    def post_event(self, involved: dict[str, Any], *, type: str, reason: str, message: str,
                   now: dt.datetime) -> None:
        """Create a core/v1 Event about `involved` (apiVersion, kind, metadata
        name/namespace/uid). Raises KubeError."""
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
        with _errors(f"posting event {reason}"):
            self._core().create_namespaced_event(meta["namespace"], event, _request_timeout=self.timeout)

    # --- warmer Jobs, their Services and pods ---

    def list_jobs(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Jobs matching a label selector, as plain dicts. Raises KubeError."""
        return self._list(self._batch().list_namespaced_job, "Jobs", namespace, selector)

    def list_services(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Services matching a label selector, as plain dicts. Raises KubeError."""
        return self._list(self._core().list_namespaced_service, "Services", namespace, selector)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching a label selector, as plain dicts. Raises KubeError."""
        return self._list(self._core().list_namespaced_pod, "Pods", namespace, selector)

    def create(self, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any] | None:
        """Create a namespaced Job or Service through the typed client (what it validates
        is what we send). Returns the object as the apiserver stored it (with `dry_run`, as
        it would store it: a server-side dry run, every admission and validation step,
        nothing persisted), or None when one of that name already exists.
        Raises KubeError (reason InvalidObject when the client refuses the object)."""
        namespace = body["metadata"]["namespace"]
        obj = typed(body)
        mode = "All" if dry_run else None
        created: Any = None
        with _errors(f"creating {body['kind']} {namespace}/{body['metadata']['name']}", ok=(409,)):
            if body["kind"] == "Job":
                created = self._batch().create_namespaced_job(namespace, obj, dry_run=mode,
                                                              _request_timeout=self.timeout)
            else:
                created = self._core().create_namespaced_service(namespace, obj, dry_run=mode,
                                                                 _request_timeout=self.timeout)
        return None if created is None else _dict(created)

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Job of that name (None: none), listed by its name (the operator's RBAC lists
        Jobs and gets none). Raises KubeError."""
        with _errors(f"reading Job {namespace}/{name}"):
            listed = self._batch().list_namespaced_job(namespace, field_selector=f"metadata.name={name}",
                                                       _request_timeout=self.timeout)
        items = [_dict(j) for j in listed.items or []]
        return items[0] if items else None

    def delete_job(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        """Delete a Job with foreground propagation: the Job stays (with
        deletionTimestamp) until its pods are gone, so "no unfinished Job left" means no
        warmer pod is left either. With `uid`, only while the Job of that name has it (a
        precondition: one made again since is left, and planned for anew). A Job already
        gone, or another by then, is fine. Raises KubeError."""
        options = client.V1DeleteOptions(propagation_policy="Foreground",
                                         preconditions=client.V1Preconditions(uid=uid) if uid else None)
        with _errors(f"deleting Job {namespace}/{name}", ok=(404, 409)):
            self._batch().delete_namespaced_job(name, namespace, body=options, _request_timeout=self.timeout)

    def delete_service(self, namespace: str, name: str) -> None:
        """Delete a Service; one already gone is fine. Raises KubeError."""
        with _errors(f"deleting Service {namespace}/{name}", ok=(404,)):
            self._core().delete_namespaced_service(name, namespace, _request_timeout=self.timeout)

    def remove_scheduling_gate(self, namespace: str, name: str, index: int, gate: str) -> None:
        """Remove scheduling gate `gate` at `index` of a pod (a JSON patch that first tests
        the name, so a concurrent change fails instead of removing another gate). A pod
        already gone or already released is fine. Raises KubeError."""
        patch = [
            {"op": "test", "path": f"/spec/schedulingGates/{index}/name", "value": gate},
            {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
        ]
        with _errors(f"releasing Pod {namespace}/{name}", ok=(404, 422)):
            self._core().patch_namespaced_pod(name, namespace, patch, _request_timeout=self.timeout)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod of that name (None: none), listed by its name (the operator lists pods and
        gets none). Raises KubeError."""
        with _errors(f"reading Pod {namespace}/{name}"):
            listed = self._core().list_namespaced_pod(namespace, field_selector=f"metadata.name={name}",
                                                      _request_timeout=self.timeout)
        items = [_dict(p) for p in listed.items or []]
        return items[0] if items else None

    def list_labelled_pods(self, namespaces: list[str], selector: str) -> list[dict[str, Any]]:
        """Pods matching `selector` in `namespaces` (every namespace when empty).
        Raises KubeError."""
        api = self._core()
        if not namespaces:
            with _errors("listing Pods in all namespaces"):
                found = api.list_pod_for_all_namespaces(label_selector=selector, _request_timeout=self.timeout)
            return [_dict(item) for item in found.items]
        return [pod for ns in namespaces for pod in self._list(api.list_namespaced_pod, "Pods", ns, selector)]

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ConfigMap as stored (binaryData in base64), or None when it does not exist.
        Raises KubeError."""
        found: Any = None
        with _errors(f"reading ConfigMap {namespace}/{name}", ok=(404,)):
            found = self._core().read_namespaced_config_map(name, namespace, _request_timeout=self.timeout)
        return None if found is None else _dict(found)

    def create_configmap(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a ConfigMap through the typed client. Returns it as the apiserver stored
        it, or None when one of that name exists (never changed: it may be someone else's).
        Raises KubeError (reason InvalidObject when the client refuses the object)."""
        meta = body["metadata"]
        obj = typed(body)
        created: Any = None
        with _errors(f"creating ConfigMap {meta['namespace']}/{meta['name']}", ok=(409,)):
            created = self._core().create_namespaced_config_map(meta["namespace"], obj, _request_timeout=self.timeout)
        return None if created is None else _dict(created)

    # --- CompilationCaches, read and written by the operator's own controller (not kopf) ---

    def get_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The CompilationCache as stored now (None when it is gone). Raises KubeError."""
        found: Any = None
        with _errors(f"reading {c.KIND} {namespace}/{name}", ok=(404,)):
            found = self._custom().get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name,
                                                                _request_timeout=self.timeout)
        return None if found is None else dict(found)

    def list_caches(self, namespaces: list[str]) -> list[dict[str, Any]]:
        """Every CompilationCache in `namespaces` (every namespace when empty).
        Raises KubeError."""
        api = self._custom()
        found: list[dict[str, Any]] = []
        for ns in namespaces or [""]:
            with _errors(f"listing {c.KIND}s in {ns or 'all namespaces'}"):
                if not ns:
                    answer: Any = api.list_cluster_custom_object(c.GROUP, c.VERSION, c.PLURAL,
                                                                 _request_timeout=self.timeout)
                else:
                    answer = api.list_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL,
                                                               _request_timeout=self.timeout)
            found.extend(dict(item) for item in answer.get("items") or [])
        return found

    def patch_cache_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """A JSON merge patch of the cache's status subresource (a None value removes the
        key). A cache already gone is fine. Raises KubeError."""
        with _errors(f"writing the status of {c.KIND} {namespace}/{name}", ok=(404,)):
            self._custom().patch_namespaced_custom_object_status(
                c.GROUP, c.VERSION, namespace, c.PLURAL, name, {"status": status},
                _content_type="application/merge-patch+json", _request_timeout=self.timeout)

    def set_cache_finalizers(self, namespace: str, name: str, finalizers: list[str], resource_version: str) -> bool:
        """Replace the cache's finalizers, only if it is still at `resource_version` (the
        merge patch carries it as a precondition, so someone else's finalizer added
        meanwhile is never dropped). Returns False on a conflict or when the cache is gone.
        Raises KubeError."""
        patch = {"metadata": {"finalizers": finalizers or None, "resourceVersion": resource_version}}
        done: Any = None
        with _errors(f"setting the finalizers of {c.KIND} {namespace}/{name}", ok=(404, 409)):
            done = self._custom().patch_namespaced_custom_object(
                c.GROUP, c.VERSION, namespace, c.PLURAL, name, patch,
                _content_type="application/merge-patch+json", _request_timeout=self.timeout)
        return done is not None

    # --- the webhook's serving certificate, shared by every replica through one Secret ---

    def read_secret(self, namespace: str, name: str) -> tuple[dict[str, bytes], str] | None:
        """A Secret's data (decoded) and resourceVersion; None when it does not exist.
        Raises KubeError."""
        found: Any = None
        with _errors(f"reading Secret {namespace}/{name}", ok=(404,)):
            found = self._core().read_namespaced_secret(name, namespace, _request_timeout=self.timeout)
        if found is None:
            return None
        data = {key: base64.b64decode(value) for key, value in (found.data or {}).items()}
        return data, str(found.metadata.resource_version)

    def write_secret(self, namespace: str, name: str, data: dict[str, bytes], resource_version: str | None,
                     labels: dict[str, str]) -> bool:
        """Create the Secret (`resource_version` None) or replace it if it is still at
        `resource_version`. Returns False when another writer got there first (409), so
        the caller reads what that writer wrote. Raises KubeError."""
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels=labels,
                                         resource_version=resource_version),
            type="kubernetes.io/tls",
            data={key: base64.b64encode(value).decode() for key, value in data.items()},
        )
        done: Any = None
        with _errors(f"writing Secret {namespace}/{name}", ok=(409,)):
            api = self._core()
            done = (api.create_namespaced_secret(namespace, body, _request_timeout=self.timeout)
                    if resource_version is None
                    else api.replace_namespaced_secret(name, namespace, body, _request_timeout=self.timeout))
        return done is not None

    # --- reports from training pods ---

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """What the apiserver says of a bearer token for `audiences` (a TokenReview's
        status: authenticated, user with the bound pod in its extra, audiences, error).
        Raises KubeError when the review itself could not be made."""
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
        answer: Any = None
        with _errors("reviewing a report's token"):
            answer = client.AuthenticationV1Api(self.api_client).create_token_review(
                review, _request_timeout=self.timeout)
        return _dict(answer.status) if answer is not None and answer.status is not None else {}

    # --- leader election ---

    def release_lease(self, namespace: str, name: str, identity: str) -> bool:
        """Give up a Lease this process holds (holder cleared, so another replica takes it
        at its next try instead of waiting out the lease). Returns False when someone else
        holds it. Raises KubeError."""
        api = client.CoordinationV1Api(self.api_client)
        with _errors(f"releasing Lease {namespace}/{name}"):
            lease: Any = api.read_namespaced_lease(name, namespace, _request_timeout=self.timeout)
            if lease.spec is None or lease.spec.holder_identity != identity:
                return False
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            api.replace_namespaced_lease(name, namespace, lease, _request_timeout=self.timeout)
        return True
