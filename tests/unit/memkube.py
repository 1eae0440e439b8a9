"""An in-memory KubeClient for unit tests of the warm-up, release and reconcile logic.

It keeps Jobs, Services, Pods, ConfigMaps and caches the way an apiserver answers the
calls cachewarm makes: label selectors filter lists, a create of an existing name answers
None (409), a Job deleted with foreground propagation stays listed with a
deletionTimestamp until the test says it is gone, a gate removal tests the gate's name
first. It is not a substitute for the apiserver (no validation, no admission, no
resourceVersions): the e2e tests run the same code against a real one. `fail` makes a
call raise what the test puts there, the way the real client raises KubeError.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from cachewarm.clients.kube import KubeClient


def matches(labels: dict[str, str], selector: str) -> bool:
    """`k=v` and `k` (exists) terms, comma-separated: the forms cachewarm sends."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        if key not in labels or ("=" in term and labels[key] != value):
            return False
    return True


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _namespace(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "")


class MemoryKube(KubeClient):
    """Objects per kind in lists the test may read and replace; every write is recorded."""

    def __init__(self, *, jobs: list[dict[str, Any]] | None = None, services: list[dict[str, Any]] | None = None,
                 pods: list[dict[str, Any]] | None = None) -> None:
        super().__init__(None)  # no connection: a call this class does not answer raises KubeError
        self.jobs: list[dict[str, Any]] = jobs if jobs is not None else []
        self.services: list[dict[str, Any]] = services if services is not None else []
        self.pods: list[dict[str, Any]] = pods if pods is not None else []
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        self.caches: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[tuple[str, str, dict[str, Any]]] = []
        self.reviews: dict[str, dict[str, Any]] = {}  # token -> TokenReview status
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.released: list[tuple[str, str, int]] = []  # (namespace, pod, gate index)
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message)
        self.webhook_bundles: list[bytes] = []
        self.fail: dict[str, Exception] = {}  # method name -> what it raises
        self.calls: list[str] = []  # method names, in order

    def _check(self, method: str) -> None:
        self.calls.append(method)
        if method in self.fail:
            raise self.fail[method]

    def _select(self, objs: list[dict[str, Any]], namespace: str, selector: str) -> list[dict[str, Any]]:
        """Copies, as an apiserver's answer is: a caller changing them changes nothing here."""
        return [copy.deepcopy(o) for o in objs if _namespace(o) == namespace and matches(_labels(o), selector)]

    def list_jobs(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._check("list_jobs")
        return self._select(self.jobs, namespace, selector)

    def list_services(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._check("list_services")
        return self._select(self.services, namespace, selector)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._check("list_pods")
        return self._select(self.pods, namespace, selector)

    def list_labelled_pods(self, namespaces: list[str], selector: str) -> list[dict[str, Any]]:
        self._check("list_labelled_pods")
        return [copy.deepcopy(p) for p in self.pods if matches(_labels(p), selector)
                and (not namespaces or _namespace(p) in namespaces)]

    def create(self, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any] | None:
        self._check("create")
        store = self.jobs if body["kind"] == "Job" else self.services
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        if any(o["metadata"]["name"] == name and _namespace(o) == namespace for o in store):
            return None
        stored = copy.deepcopy(body)
        stored["metadata"].setdefault("uid", f"uid-{len(self.created)}-{name}")  # as the apiserver gives one
        if not dry_run:
            self.created.append(copy.deepcopy(body))
            store.append(copy.deepcopy(stored))
        return stored

    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("read_job")
        return next((copy.deepcopy(j) for j in self.jobs
                     if j["metadata"]["name"] == name and _namespace(j) == namespace), None)

    def delete_job(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        self._check("delete_job")
        self.deleted.append(("Job", name))
        for job in self.jobs:
            if job["metadata"]["name"] == name and _namespace(job) == namespace \
                    and (uid is None or job["metadata"].get("uid") == uid):  # foreground: listed until gone
                job["metadata"].setdefault("deletionTimestamp", "2026-01-01T00:00:00Z")

    def delete_service(self, namespace: str, name: str) -> None:
        self._check("delete_service")
        self.deleted.append(("Service", name))
        self.services = [s for s in self.services if (s["metadata"]["name"], _namespace(s)) != (name, namespace)]

    def remove_scheduling_gate(self, namespace: str, name: str, index: int, gate: str) -> None:
        self._check("remove_scheduling_gate")
        for pod in self.pods:
            if pod["metadata"]["name"] != name or _namespace(pod) != namespace:
                continue
            gates = pod.get("spec", {}).get("schedulingGates") or []
            if index < len(gates) and gates[index].get("name") == gate:  # the patch's test op
                self.released.append((namespace, name, index))
                del gates[index]

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("read_configmap")
        found = self.configmaps.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def create_configmap(self, body: dict[str, Any]) -> dict[str, Any] | None:
        self._check("create_configmap")
        meta = body["metadata"]
        if (meta["namespace"], meta["name"]) in self.configmaps:
            return None
        self.configmaps[(meta["namespace"], meta["name"])] = copy.deepcopy(body)
        return copy.deepcopy(body)

    def post_event(self, involved: dict[str, Any], *, type: str, reason: str, message: str,
                   now: dt.datetime) -> None:
        self._check("post_event")
        self.events.append((type, reason, message))

    def set_webhook_client_config(self, configuration: str, ca_pem: bytes, url: str | None) -> int:
        self._check("set_webhook_client_config")
        self.webhook_bundles.append(ca_pem)
        return 0

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """What `reviews` holds for the token (the apiserver's TokenReview status), else not
        authenticated, as the apiserver answers for a token it does not know."""
        self._check("review_token")
        return copy.deepcopy(self.reviews.get(token, {"authenticated": False, "error": "invalid bearer token"}))

    def list_caches(self, namespaces: list[str]) -> list[dict[str, Any]]:
        self._check("list_caches")
        return [copy.deepcopy(b) for (ns, _), b in self.caches.items() if not namespaces or ns in namespaces]

    def get_cache(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("get_cache")
        found = self.caches.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def patch_cache_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._check("patch_cache_status")
        self.status_patches.append((namespace, name, copy.deepcopy(status)))
