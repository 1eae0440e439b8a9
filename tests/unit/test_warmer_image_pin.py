"""The warmer image by digest (runtime/images.py, runtime/main.pin_warmer_image): from the
operator's own pod as the kubelet reported its init container warmer-image. The real
kubelet's imageID is shown in tests/e2e/test_real_install.py; here, every form it takes."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.clients.kube import KubeError
from cachewarm.runtime import images
from cachewarm.runtime.main import pin_warmer_image
from cachewarm.runtime.settings import Settings

DIGEST = "sha256:" + "ab" * 32
PINNED = f"registry.example/team/warmer@{DIGEST}"


@pytest.mark.parametrize(("image_id", "expected"), [
    (PINNED, PINNED),
    (f"docker-pullable://{PINNED}", PINNED),  # dockershim-era kubelets
    (DIGEST, None),  # a node-local image id: no repository to pull it from
    ("", None),
    (f"registry.example/warmer@sha256:{'ab' * 31}", None),  # not a whole digest
    (f"registry.example/warmer@sha512:{'ab' * 64}", None),
    (f"@{DIGEST}", None),
])
def test_only_a_repository_digest_is_a_reference(image_id: str, expected: str | None) -> None:
    assert images.digest_reference(image_id) == expected


def operator_pod(image_id: str = PINNED, init: bool = True) -> dict[str, Any]:
    spec = {"initContainers": [{"name": "warmer-image", "image": "registry.example/team/warmer:1"}] if init else [],
            "containers": [{"name": "operator", "image": "op:1"}]}
    status = {"initContainerStatuses": [{"name": "warmer-image", "imageID": image_id}] if init else []}
    return {"spec": spec, "status": status}


class OnePod:
    """What pin_warmer_image reads: the operator's own pod (or an apiserver error)."""

    def __init__(self, pod: dict[str, Any] | None = None, error: KubeError | None = None) -> None:
        self.pod, self.error = pod, error
        self.read: list[tuple[str, str]] = []

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.read.append((namespace, name))
        if self.error is not None:
            raise self.error
        return self.pod


IN_POD = {"pod_name": "cachewarm-operator-1", "pod_namespace": "cachewarm-system"}


@pytest.mark.parametrize(("image", "expected"), [
    ("busybox", "docker.io/library/busybox"), ("docker.io/busybox:1", "docker.io/library/busybox"),
    ("cachewarm/warmer:0.1.0", "docker.io/cachewarm/warmer"),
    ("docker.io/cachewarm/warmer:0.1.0", "docker.io/cachewarm/warmer"),
    ("registry.example:5000/team/warmer:1", "registry.example:5000/team/warmer"),
    (f"registry.example/team/warmer@{DIGEST}", "registry.example/team/warmer"),
    ("localhost/warmer:2", "localhost/warmer"),
])
def test_repositories_are_named_as_the_runtime_names_them(image: str, expected: str) -> None:
    assert images.repository(image) == expected


def test_a_digest_reported_under_another_repository_is_not_pinned() -> None:
    """A node that holds the same image under another name (a tenant's pod pulled a copy
    from its registry, sorted first) may report that one, whose digest our registry need
    not have: the tag stays, and why is said."""
    pinned, why = images.warmer_image_of(operator_pod(f"0attacker.example/w@{DIGEST}"))
    assert pinned is None and "another repository" in why
    assert images.warmer_image_of(operator_pod(f"registry.example/team/warmer@{DIGEST}"))[0] == PINNED


def test_the_operator_in_a_pod_takes_the_digest_its_node_ran() -> None:
    kube = OnePod(operator_pod())
    pinned = pin_warmer_image(Settings(**IN_POD), kube)  # type: ignore[arg-type]
    assert pinned.warmer_image == PINNED
    assert kube.read == [("cachewarm-system", "cachewarm-operator-1")]


@pytest.mark.parametrize("kube", [
    OnePod(operator_pod(DIGEST)),  # loaded into the node, not pulled
    OnePod(operator_pod(init=False)),  # installed without the init container
    OnePod(None),
    OnePod(error=KubeError("forbidden", 403)),
], ids=["node-local-id", "no-init-container", "pod-not-found", "unreadable"])
def test_without_a_digest_the_tag_stays(kube: OnePod) -> None:
    assert pin_warmer_image(Settings(**IN_POD), kube).warmer_image == "cachewarm/warmer:0.1.0"  # type: ignore[arg-type]


def test_a_set_image_and_a_process_outside_a_pod_read_nothing() -> None:
    kube = OnePod(operator_pod())
    given = Settings(**IN_POD, warmer_image="mine/warmer:2")
    assert pin_warmer_image(given, kube).warmer_image == "mine/warmer:2"  # type: ignore[arg-type]
    assert pin_warmer_image(Settings(), kube).warmer_image == "cachewarm/warmer:0.1.0"  # type: ignore[arg-type]
    assert kube.read == []


class Later(OnePod):
    """The pod as the apiserver holds it while the kubelet has yet to report the init
    container's imageID, then after."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        super().__init__()
        self.pods = pods

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.read.append((namespace, name))
        return self.pods[min(len(self.read), len(self.pods)) - 1]


def test_the_pod_is_read_again_until_the_kubelet_reported_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachewarm.runtime import main
    monkeypatch.setattr(main, "PIN_RETRY_SECONDS", 0.0)
    unreported = operator_pod()
    unreported["status"] = {"initContainerStatuses": [{"name": "warmer-image", "imageID": ""}]}
    kube = Later([unreported, unreported, operator_pod()])
    assert pin_warmer_image(Settings(**IN_POD), kube).warmer_image == PINNED  # type: ignore[arg-type]
    assert len(kube.read) == 3
    never = Later([unreported])
    assert pin_warmer_image(Settings(**IN_POD), never).warmer_image == "cachewarm/warmer:0.1.0"  # type: ignore[arg-type]
    assert len(never.read) == main.PIN_ATTEMPTS
