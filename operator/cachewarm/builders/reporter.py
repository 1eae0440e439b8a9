"""The part of the webhook's pod patch that adds the reporter (cachewarm.reporter) to a
training pod: pure, spec in, spec out.

- An emptyDir `cachewarm-reporter` that an init container of cachewarm's warmer image (the
  image the cluster already pulls for warmers) fills with the reporter, its
  sitecustomize.py and the warmer (whose fingerprint code the reporter shares).
- An init container of the training image itself that records the PYTHONPATH the image
  sets (ENV), which the container's own PYTHONPATH (ours first) replaces; the reporter puts
  it back behind its own directory. It runs that image's `python3`.
- A projected ServiceAccount token, audience `cachewarm`, bound to the pod, which the
  reporter sends with each report (the operator has the apiserver review it).
- Each container gets PYTHONPATH (ours, then the one its spec sets), where to report, the
  CA to trust, and the pod's identity (downward API). A container with envFrom sources is
  left without the reporter: its PYTHONPATH may come from a source an env entry would
  override.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DIR = "/cachewarm-reporter"
TOKEN_DIR = "/var/run/secrets/cachewarm"
VOLUME = "cachewarm-reporter"
TOKEN_VOLUME = "cachewarm-report-token"
COPY_CONTAINER = "cachewarm-reporter"
PATH_CONTAINER = "cachewarm-pythonpath"
SOURCE_DIR = "/opt/cachewarm"  # in the warmer image (warmer_image/Dockerfile)
TOKEN_SECONDS = 3600  # the kubelet renews it before it expires
RECORD_PYTHONPATH = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('PYTHONPATH', ''))"
# What PodSecurity "restricted" asks of every container; the copy runs as the warmer
# image's user, the recorder as the training container does (its own securityContext).
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "seccompProfile": {"type": "RuntimeDefault"}}


@dataclass(frozen=True)
class Reporting:
    """What the webhook needs to add the reporter: the image carrying it, where reports go,
    the CA (PEM) that signs the certificate the operator serves there."""

    image: str
    url: str
    ca_pem: str


def _env(cache_name: str, reporting: Reporting, pythonpath: str) -> list[dict[str, Any]]:
    field = [("CACHEWARM_POD_NAMESPACE", "metadata.namespace"), ("CACHEWARM_POD_NAME", "metadata.name"),
             ("CACHEWARM_POD_UID", "metadata.uid")]
    return [
        {"name": "PYTHONPATH", "value": f"{DIR}:{pythonpath}" if pythonpath else DIR},
        {"name": "CACHEWARM_REPORT_URL", "value": reporting.url},
        {"name": "CACHEWARM_REPORT_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
        {"name": "CACHEWARM_REPORT_CA", "value": reporting.ca_pem},
        {"name": "CACHEWARM_CACHE", "value": cache_name},
        *({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in field),
    ]


def add_reporter(spec: Mapping[str, Any], containers: Sequence[Mapping[str, Any]],
                 init_containers: Sequence[Mapping[str, Any]], cache_name: str, reporting: Reporting
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(containers, initContainers, volumes) with the reporter added to `containers` and
    its init containers ahead of `init_containers` (both as the rest of the patch leaves
    them), or None when there is nothing to add: already added (webhook reinvocation), or
    no container can take it."""
    volumes = list(spec.get("volumes") or [])
    if any(v.get("name") == VOLUME for v in volumes):
        return None
    takers = [c for c in containers if not c.get("envFrom") and c.get("image")]
    if not takers:
        return None
    mounts = [{"name": VOLUME, "mountPath": DIR, "readOnly": True},
              {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    out = []
    for container in containers:
        new = copy.deepcopy(dict(container))
        if container in takers:
            env = list(new.get("env") or [])
            own = next((e for e in env if e.get("name") == "PYTHONPATH"), None)
            pythonpath = str(own.get("value") or "") if own is not None and "valueFrom" not in own else ""
            if own is not None and "valueFrom" in own:
                out.append(new)  # its PYTHONPATH comes from a reference the webhook cannot read
                continue
            ours = _env(cache_name, reporting, pythonpath)
            names = {e["name"] for e in ours}
            new["env"] = [*ours, *(e for e in env if e.get("name") not in names)]
            new["volumeMounts"] = [*(new.get("volumeMounts") or []), *mounts]
        out.append(new)
    first = next(c for c in takers)
    init = [
        {"name": COPY_CONTAINER, "image": reporting.image,
         "command": ["cp", f"{SOURCE_DIR}/cachewarm_reporter.py", f"{SOURCE_DIR}/sitecustomize.py",
                     f"{SOURCE_DIR}/warm.py", DIR],
         "volumeMounts": [{"name": VOLUME, "mountPath": DIR}],
         "securityContext": {**RESTRICTED, "runAsNonRoot": True, "runAsUser": 65532},
         "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}},
        {"name": PATH_CONTAINER, "image": first["image"],
         "command": ["python3", "-c", RECORD_PYTHONPATH, f"{DIR}/image-pythonpath"],
         "volumeMounts": [{"name": VOLUME, "mountPath": DIR}],
         "securityContext": {**RESTRICTED, **copy.deepcopy(first.get("securityContext") or {})},
         "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}}},
    ]
    volumes += [{"name": VOLUME, "emptyDir": {"sizeLimit": "10Mi"}},
                {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
                    "audience": "cachewarm", "expirationSeconds": TOKEN_SECONDS, "path": "token"}}]}}]
    return out, [*init, *(copy.deepcopy(dict(c)) for c in init_containers)], volumes
