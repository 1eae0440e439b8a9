"""What the apiserver's ServiceAccount admission plugin adds to a pod before any admission
webhook sees it, when the pod's ServiceAccount token is mounted (the pod's
automountServiceAccountToken, else its ServiceAccount's, not false): a projected
kube-api-access volume, mounted read-only in every container. Unit tests' pods get it so that
the webhook sees them as it sees a cluster's (admit.token_withheld reads it)."""

from __future__ import annotations

import copy
from typing import Any

MOUNT = {"name": "kube-api-access-7x2kq", "readOnly": True, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
VOLUME = {"name": "kube-api-access-7x2kq", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1",
                                                                   "fieldPath": "metadata.namespace"}}]}}]}}


def given_api_token(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` as the plugin leaves it for a pod that takes its ServiceAccount token."""
    out = copy.deepcopy(spec)
    out["volumes"] = [*out.get("volumes", []), copy.deepcopy(VOLUME)]
    for kind in ("initContainers", "containers"):
        for container in out.get(kind) or []:
            container["volumeMounts"] = [*container.get("volumeMounts", []), dict(MOUNT)]
    return out
