"""The warmer image by digest (issue 28): the image every warmer Job and labelled pod's
init containers run, pinned to the digest the operator's own node resolved.

The Deployment (manifests/manager/deployment.yaml) runs the warmer image as its init
container `warmer-image` (it only exits), so the kubelet pulls it and reports what it ran
in the pod's status (`imageID`, `<repository>@sha256:<digest>` for an image from a
registry) and so a kustomize `images:` override (or a Helm value) of the warmer image
reaches the operator the way the operator's own image does. At start the operator reads
its own pod and, unless `CACHEWARM_WARMER_IMAGE` is set, references the warmer image by that
digest in everything it makes: a tag moved later, or a node that would resolve it to other
bytes, runs no other code in training pods. We publish no image, so no digest can be
written into the manifests themselves; docs/security.md says how to pin one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

WARMER_CONTAINER = "warmer-image"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def digest_reference(image_id: str) -> str | None:
    """A pullable reference by digest from a container status's imageID
    (`<repository>@sha256:<64 hex>`; dockershim-era kubelets prefix `docker-pullable://`),
    or None where it names none (a node-local image id `sha256:...`, as for an image
    loaded into the node rather than pulled)."""
    ref = image_id.split("://", 1)[-1]
    repository, sep, digest = ref.partition("@")
    return ref if sep and repository and _DIGEST.fullmatch(digest) else None


def repository(image: str) -> str:
    """The repository an image reference names, as container runtimes normalise it
    (`busybox` -> `docker.io/library/busybox`, `team/w:1` -> `docker.io/team/w`)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    if first == "docker.io" and "/" not in rest:
        return f"docker.io/library/{rest}"
    return name


def warmer_image_of(pod: Mapping[str, Any]) -> tuple[str | None, str]:
    """The warmer image by digest from the operator's own pod (None: none to be had), and
    a sentence saying where it came from or why there is none."""
    spec = next((ct for ct in (pod.get("spec") or {}).get("initContainers") or []
                 if ct.get("name") == WARMER_CONTAINER), None)
    if spec is None:
        return None, f"the operator's pod has no init container {WARMER_CONTAINER}"
    status: Mapping[str, Any] = next((st for st in (pod.get("status") or {}).get("initContainerStatuses") or []
                   if st.get("name") == WARMER_CONTAINER), {})
    pinned = digest_reference(str(status.get("imageID") or ""))
    if pinned is None:
        return None, (f"the node reports no repository digest for {spec.get('image')} "
                      f"(imageID {status.get('imageID') or 'unset'}): it is referenced by tag")
    # Only under the repository the Deployment names: a node that holds the same image under
    # several names reports one of them (the first in its own order), which anyone who can
    # make the node pull a copy from their registry could choose, and that copy's digest
    # need not exist in ours (every pull of it would fail).
    wanted = repository(str(spec.get("image") or ""))
    if repository(pinned) != wanted:
        return None, (f"the node reports {spec.get('image')} as {pinned}, another repository than {wanted}: "
                      "it is referenced by tag")
    return pinned, f"the digest the node resolved {spec.get('image')} to"


def reported(pod: Mapping[str, Any]) -> bool:
    """The kubelet has reported what the init container warmer-image ran (its imageID), or
    the pod has no such init container (nothing to wait for)."""
    if not any(ct.get("name") == WARMER_CONTAINER for ct in (pod.get("spec") or {}).get("initContainers") or []):
        return True
    return any(st.get("name") == WARMER_CONTAINER and st.get("imageID")
               for st in (pod.get("status") or {}).get("initContainerStatuses") or [])
