"""The part of the webhook's pod patch that adds the reporter (cachewarm.agents.reporter) to a
training pod: pure, spec in, spec out.

- An emptyDir `cachewarm-reporter` that an init container of cachewarm's warmer image (the
  image the cluster already pulls for warmers) fills with the reporter, its
  sitecustomize.py and the warmer (whose fingerprint code the reporter shares).
- An init container of the training image itself that records the PYTHONPATH the image
  sets (ENV), which the container's own PYTHONPATH (ours first) replaces; the reporter puts
  it back behind its own directory. It runs the static busybox the copy brought along (the
  warmer image's own), so it needs nothing of the training image (no python3, no shell),
  only a node of the warmer image's architecture, and it always exits 0.
- Both init containers take the training container's CPU, memory and ephemeral-storage
  requests and limits: whatever a LimitRange or ResourceQuota admits for that container it
  admits for them, and since init containers run one at a time before the others, the
  pod's effective request does not grow.
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

from cachewarm.agents import payload
from cachewarm.api import constants as c
from cachewarm.api.constants import LOCAL_COPY_CONTAINER

DIR = "/cachewarm-reporter"
TOKEN_DIR = "/var/run/secrets/cachewarm"
VOLUME = "cachewarm-reporter"
TOKEN_VOLUME = "cachewarm-report-token"
COPY_CONTAINER = "cachewarm-reporter"
PATH_CONTAINER = "cachewarm-pythonpath"
SOURCE_DIR = payload.SOURCE_DIR  # in the warmer image (warmer_image/Dockerfile)
TOKEN_SECONDS = 3600  # the kubelet renews it before it expires
BUSYBOX = payload.in_image(payload.BUSYBOX)  # static: it runs in any image of the node's architecture
# `sh -c SCRIPT FILE`: FILE is $0. A write that fails leaves no file (the reporter then
# restores nothing) and the pod still starts.
RECORD_PYTHONPATH = 'printf %s "$PYTHONPATH" > "$0"; exit 0'
RECORD_FILE = f"{DIR}/image-pythonpath"  # the reporter's sitecustomize restores it
SHARED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
# The user of every init container we add where the pod's main container runs as root or
# names no user: the warmer image's (distroless "nonroot").
NONROOT_USER = 65532


def init_security(spec: Mapping[str, Any], main: Mapping[str, Any] | None) -> dict[str, Any]:
    """The securityContext of every init container we add (the reporter's copy and
    recorder, the local copy's copier): fixed, never the user's, whatever the training
    container has (privileged, root, SYS_ADMIN: our containers need none of it). What
    PodSecurity "restricted" asks, and a read-only root filesystem (each writes only to
    our emptyDir and the copy's volume).

    It runs as the `main` container's user where that is not root (its own runAsUser,
    else the pod's), so it reads what that user reads (a credentials file, a CA bundle)
    and runs its image's python; else (root, or no user named: the image's, perhaps root)
    as NONROOT_USER, always with runAsNonRoot, which also holds where the pod sets
    runAsNonRoot false (a container's setting wins over the pod's). 65532 writes an
    emptyDir (created 0777) and the reporter's folder; an Ephemeral volume's root is
    writable by it only where the pod sets an fsGroup (pod-level: the kubelet gives the
    volume to that group, and our container is in it) or the provisioner makes it so:
    otherwise the copier cannot write, says so in its summary, and the pod starts cold.
    Where the image's python, or the credentials it reads, are root's alone (0700, 0400)
    the same: cold, said. A pod-level runAsGroup, fsGroup, seLinuxOptions and
    supplementalGroups still apply to it. (A runAsUser of ours is refused by a policy that
    assigns users from a range, OpenShift's restricted SCC: there, pods name their user.)"""
    user = ((main or {}).get("securityContext") or {}).get("runAsUser")
    if user is None:
        user = (spec.get("securityContext") or {}).get("runAsUser")
    ok = isinstance(user, int) and not isinstance(user, bool) and user > 0
    return {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": user if ok else NONROOT_USER,
            "seccompProfile": {"type": "RuntimeDefault"}, "readOnlyRootFilesystem": True}


@dataclass(frozen=True)
class Reporting:
    """What the webhook needs to add the reporter: the image carrying it, where reports go,
    the CA (PEM) that signs the certificate the operator serves there."""

    image: str
    url: str
    ca_pem: str


def report_env(cache_name: str, reporting: Reporting, restore: bool) -> list[dict[str, Any]]:
    field = [(c.ENV_POD_NAMESPACE, "metadata.namespace"), (c.ENV_POD_NAME, "metadata.name"),
             (c.ENV_POD_UID, "metadata.uid")]
    return [
        {"name": c.ENV_REPORT_URL, "value": reporting.url},
        {"name": c.ENV_REPORT_TOKEN_FILE, "value": f"{TOKEN_DIR}/token"},
        {"name": c.ENV_REPORT_CA, "value": reporting.ca_pem},
        {"name": c.ENV_CACHE, "value": cache_name},
        # Only where the spec set no PYTHONPATH: the image's (recorded) is what python would
        # have had; where the spec set one, that one replaced the image's and stays alone.
        *([{"name": c.ENV_RESTORE_IMAGE_PYTHONPATH, "value": "1"}] if restore else []),
        *({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in field),
    ]


def own_pythonpath(container: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(set in the spec, its literal value: None when it comes from a reference)."""
    own = next((e for e in container.get("env") or [] if e.get("name") == "PYTHONPATH"), None)
    if own is None:
        return False, ""
    return True, None if "valueFrom" in own else str(own.get("value") or "")


def takes_reporter(container: Mapping[str, Any]) -> bool:
    """Whether add_reporter gave this container the reporter (its PYTHONPATH starts with ours)."""
    return any(e.get("name") == "PYTHONPATH" and str(e.get("value") or "").startswith(DIR)
               for e in container.get("env") or [])


def resources_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's requests and limits of CPU, memory and ephemeral storage (not its
    GPUs or TPUs: an init container holding them would gain nothing), {} when it sets none."""
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        values = {k: v for k, v in ((container.get("resources") or {}).get(kind) or {}).items() if k in SHARED_RESOURCES}
        if values:
            out[kind] = values
    return out


def with_shared(resources: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """`resources` with its CPU, memory and ephemeral storage those of `wanted`; anything
    else a later webhook set there (extended resources, claims) kept."""
    out = copy.deepcopy(dict(resources))
    for kind in ("requests", "limits"):
        values = {k: v for k, v in (out.get(kind) or {}).items() if k not in SHARED_RESOURCES}
        values.update(copy.deepcopy(dict(wanted.get(kind) or {})))
        if values:
            out[kind] = values
        else:
            out.pop(kind, None)
    return out


def _resynced(containers: Sequence[Mapping[str, Any]], init_containers: Sequence[Mapping[str, Any]],
              volumes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """A pod patched already (webhook reinvocation): the reporter stays as it is, but its
    init containers take the training container's resources again when a later webhook
    (e.g. VPA's) changed them, so they never ask for more than it. None: nothing changed."""
    # The recorder, or the local copy's copier that records in its place.
    recorder = next((c for c in init_containers if c.get("name") == PATH_CONTAINER or
                     (c.get("name") == LOCAL_COPY_CONTAINER and RECORD_FILE in (c.get("command") or []))), None)
    first = next((c for c in containers if recorder is not None and c.get("image") == recorder.get("image")
                  and takes_reporter(c)), None)
    if first is None:
        return None
    wanted = resources_of(first)
    # Not the local copy's copier: it follows the pod's main container (builders/localcopy.py).
    ours = (COPY_CONTAINER, PATH_CONTAINER)
    if all(resources_of(c) == wanted for c in init_containers if c.get("name") in ours):
        return None
    init = []
    for container in init_containers:
        new = copy.deepcopy(dict(container))
        if container.get("name") in ours:
            new["resources"] = with_shared(new.get("resources") or {}, wanted)
            if not new["resources"]:
                del new["resources"]
        init.append(new)
    return [copy.deepcopy(dict(c)) for c in containers], init, volumes


def copy_container(spec: Mapping[str, Any], image: str, files: Sequence[str], resources: Mapping[str, Any],
                   main: Mapping[str, Any] | None) -> dict[str, Any]:
    """The init container of the warmer image that copies `files` into the VOLUME at DIR
    (the reporter's, and the local copy's copier: builders/localcopy.py), as init_security
    says for the pod's `main` container."""
    return {
        "name": COPY_CONTAINER, "image": image, "command": ["cp", *files, DIR],
        "volumeMounts": [{"name": VOLUME, "mountPath": DIR}],
        "securityContext": init_security(spec, main),
        **({"resources": copy.deepcopy(dict(resources))} if resources else {}),
    }


def add_reporter(spec: Mapping[str, Any], containers: Sequence[Mapping[str, Any]],
                 init_containers: Sequence[Mapping[str, Any]], cache_name: str, reporting: Reporting
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(containers, initContainers, volumes) with the reporter added to `containers` and
    its init containers ahead of `init_containers` (both as the rest of the patch leaves
    them), or None when there is nothing to add: already added (webhook reinvocation; then
    only its init containers' resources follow the training container's, see _resynced), a
    Windows pod, a pod with a volume or mount of its own where ours go, or no container
    can take it.

    A container takes it when it has no envFrom sources, its PYTHONPATH (if any) is a
    literal value, and it runs the first such container's image (the one whose PYTHONPATH
    the recorder reads) or sets its own PYTHONPATH."""
    volumes = list(spec.get("volumes") or [])
    if any(v.get("name") == VOLUME for v in volumes):
        return _resynced(containers, init_containers, volumes)
    if (spec.get("os") or {}).get("name") == "windows":
        return None
    if any(v.get("name") == TOKEN_VOLUME for v in volumes) or any(
            str(m.get("mountPath") or "").rstrip("/") in (DIR, TOKEN_DIR) or m.get("name") in (VOLUME, TOKEN_VOLUME)
            for ct in [*containers, *init_containers] for m in ct.get("volumeMounts") or []):
        # The pod's own volume or mount where ours go (two of one name or path are
        # refused), or a mount of a volume named like ours that the pod lacks (ours would
        # complete it: the token, or our code, where the user put it).
        return None
    eligible = [c for c in containers if not c.get("envFrom") and c.get("image") and own_pythonpath(c)[1] is not None]
    if not eligible:
        return None
    first = eligible[0]
    takers = [c for c in eligible if c.get("image") == first.get("image") or own_pythonpath(c)[0]]
    mounts = [{"name": VOLUME, "mountPath": DIR, "readOnly": True},
              {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    out = []
    for container in containers:
        new = copy.deepcopy(dict(container))
        if any(container is t for t in takers):
            has_own, value = own_pythonpath(container)
            env = list(new.get("env") or [])
            if has_own:
                # In place: $(VAR) references in it still see the variables defined before it.
                env = [{"name": "PYTHONPATH", "value": f"{DIR}:{value}" if value else DIR}
                       if e.get("name") == "PYTHONPATH" else e for e in env]
            else:
                env.append({"name": "PYTHONPATH", "value": DIR})
            ours = report_env(cache_name, reporting, restore=not has_own)
            names = {e["name"] for e in ours}
            new["env"] = [*(e for e in env if e.get("name") not in names), *ours]
            new["volumeMounts"] = [*(new.get("volumeMounts") or []), *mounts]
        out.append(new)
    resources = resources_of(first)
    init: list[dict[str, Any]] = [
        copy_container(spec, reporting.image, [payload.in_image(f) for f in payload.REPORTER_COPY], resources, first),
        {"name": PATH_CONTAINER, "image": first["image"],
         **({"imagePullPolicy": first["imagePullPolicy"]} if first.get("imagePullPolicy") else {}),
         "command": [f"{DIR}/busybox", "sh", "-c", RECORD_PYTHONPATH, RECORD_FILE],
         "volumeMounts": [{"name": VOLUME, "mountPath": DIR}],
         # Never the training container's (privileged, root, capabilities): init_security.
         # Its busybox needs none of it.
         "securityContext": init_security(spec, first),
         **({"resources": copy.deepcopy(resources)} if resources else {})},
    ]
    volumes += [{"name": VOLUME, "emptyDir": {"sizeLimit": "10Mi"}},
                {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
                    "audience": "cachewarm", "expirationSeconds": TOKEN_SECONDS, "path": "token"}}]}}]
    return out, [*init, *(copy.deepcopy(dict(c)) for c in init_containers)], volumes
