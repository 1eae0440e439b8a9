"""The reporter's part of the pod patch: what each container gets, who is left alone, and
that patching again changes nothing (webhook reinvocation)."""

from __future__ import annotations

from typing import Any

import pytest

from cachewarm.builders.reporting import Reporting, add_reporter

REPORTING = Reporting(image="cachewarm/warmer:0.1.0", url="https://op/report/v1", ca_pem="-----BEGIN CERTIFICATE-----")


def spec(**extra: Any) -> dict[str, Any]:
    return {"containers": [{"name": "train", "image": "train:1", "env": [{"name": "PYTHONPATH", "value": "/app"}]},
                           {"name": "side", "image": "train:1", "envFrom": [{"configMapRef": {"name": "x"}}]},
                           {"name": "ref", "image": "train:1", "env": [{"name": "PYTHONPATH", "valueFrom": {
                               "configMapKeyRef": {"name": "x", "key": "p"}}}]}],
            "initContainers": [{"name": "setup", "image": "train:1"}], **extra}


def test_containers_that_can_take_it_get_the_reporter_and_the_others_stay_as_they_were() -> None:
    s = spec()
    added = add_reporter(s, s["containers"], s["initContainers"], "llama", REPORTING)
    assert added is not None
    containers, init, volumes = added
    env = {e["name"]: e for e in containers[0]["env"]}
    assert env["PYTHONPATH"] == {"name": "PYTHONPATH", "value": "/cachewarm-reporter:/app"}
    assert env["CACHEWARM_CACHE"]["value"] == "llama" and env["CACHEWARM_REPORT_CA"]["value"] == REPORTING.ca_pem
    assert containers[1] == s["containers"][1]  # envFrom: its PYTHONPATH may come from there
    assert containers[2] == s["containers"][2]  # PYTHONPATH from a reference the webhook cannot read
    assert [c["name"] for c in init] == ["cachewarm-reporter", "cachewarm-pythonpath", "setup"]
    assert init[1]["command"][-1] == "/cachewarm-reporter/image-pythonpath"
    assert [v["name"] for v in volumes] == ["cachewarm-reporter", "cachewarm-report-token"]


def test_a_pod_patched_already_is_not_patched_again_and_one_with_no_taker_is_not_patched() -> None:
    s = spec()
    added = add_reporter(s, s["containers"], s["initContainers"], "llama", REPORTING)
    assert added is not None
    again = {"containers": added[0], "initContainers": added[1], "volumes": added[2]}
    assert add_reporter(again, again["containers"], again["initContainers"], "llama", REPORTING) is None
    only_env_from = {"containers": [spec()["containers"][1]]}
    assert add_reporter(only_env_from, only_env_from["containers"], [], "llama", REPORTING) is None


def d7(user: int) -> dict[str, Any]:
    """The one securityContext of every init container we add (D7)."""
    return {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": user, "seccompProfile": {"type": "RuntimeDefault"},
            "readOnlyRootFilesystem": True}


def test_the_recorder_never_runs_as_the_privileged_training_container_and_windows_pods_are_left_alone() -> None:
    privileged = {"containers": [{"name": "train", "image": "tpu:1", "imagePullPolicy": "Never",
                                  "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}
    added = add_reporter(privileged, privileged["containers"], [], "llama", REPORTING)
    assert added is not None
    copier, recorder = added[1]
    assert recorder["securityContext"] == copier["securityContext"] == d7(65532)
    assert recorder["imagePullPolicy"] == "Never"
    assert "resources" not in recorder  # none set: a LimitRange's defaults apply, as to the container
    windows = {**privileged, "os": {"name": "windows"}}
    assert add_reporter(windows, windows["containers"], [], "llama", REPORTING) is None


def test_pythonpath_stays_in_place_and_the_images_is_restored_only_where_the_spec_set_none() -> None:
    s = {"containers": [
        {"name": "train", "image": "train:1", "env": [{"name": "APP", "value": "/app"},
                                                      {"name": "PYTHONPATH", "value": "$(APP)/lib"}]},
        {"name": "eval", "image": "train:1"},
        {"name": "proxy", "image": "envoy:1"}]}  # another image: its ENV PYTHONPATH is not the recorded one
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    train, evaluate, proxy = added[0]
    names = [e["name"] for e in train["env"]]
    assert names.index("APP") < names.index("PYTHONPATH")  # $(APP) still expands
    assert train["env"][1] == {"name": "PYTHONPATH", "value": "/cachewarm-reporter:$(APP)/lib"}
    assert "CACHEWARM_RESTORE_IMAGE_PYTHONPATH" not in names
    assert {e["name"]: e.get("value") for e in evaluate["env"]}["CACHEWARM_RESTORE_IMAGE_PYTHONPATH"] == "1"
    assert proxy == s["containers"][2]


def test_init_containers_take_the_training_containers_cpu_memory_and_storage_but_not_its_gpus() -> None:
    resources = {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"},
                 "limits": {"memory": "64Gi", "ephemeral-storage": "10Gi", "nvidia.com/gpu": "8"}}
    s = {"containers": [{"name": "train", "image": "train:1", "resources": resources}]}
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    for init in added[1]:
        assert init["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                     "limits": {"memory": "64Gi", "ephemeral-storage": "10Gi"}}, init["name"]
    assert s["containers"][0]["resources"] == resources  # the spec given is not changed


def test_the_recorder_needs_nothing_of_the_training_image_but_the_busybox_the_copy_brought() -> None:
    s = {"containers": [{"name": "train", "image": "distroless-train:1"}]}
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    copy_, recorder = added[1]
    assert "/opt/cachewarm/busybox" in copy_["command"] and copy_["command"][-1] == "/cachewarm-reporter"
    assert recorder["image"] == "distroless-train:1"
    assert recorder["command"][:3] == ["/cachewarm-reporter/busybox", "sh", "-c"]
    assert recorder["command"][-1] == "/cachewarm-reporter/image-pythonpath"


def test_on_reinvocation_the_init_containers_follow_resources_a_later_webhook_changed() -> None:
    s = {"containers": [{"name": "train", "image": "train:1",
                         "resources": {"requests": {"cpu": "32", "memory": "64Gi"}}}]}
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    patched = {"containers": added[0], "initContainers": added[1], "volumes": added[2]}
    patched["containers"][0]["resources"] = {"requests": {"cpu": "8", "memory": "16Gi"}}  # e.g. VPA, after us
    again = add_reporter(patched, patched["containers"], patched["initContainers"], "llama", REPORTING)
    assert again is not None
    assert [c["resources"] for c in again[1]] == [{"requests": {"cpu": "8", "memory": "16Gi"}}] * 2
    assert again[0] == patched["containers"] and again[2] == patched["volumes"]
    settled = {"containers": again[0], "initContainers": again[1], "volumes": again[2]}
    assert add_reporter(settled, settled["containers"], settled["initContainers"], "llama", REPORTING) is None


@pytest.mark.parametrize(("pod_context", "container_context", "user"), [
    ({}, {}, 65532),  # the image's user, perhaps root: ours
    ({"runAsUser": 0}, {}, 65532),  # root: ours (runAsNonRoot would refuse 0)
    ({"runAsUser": 1000, "runAsNonRoot": False}, {}, 1000),  # the pod's user
    ({"runAsUser": 1000}, {"runAsUser": 2000}, 2000),  # the container's wins over the pod's
    ({"runAsUser": 1000}, {"runAsUser": 0, "privileged": True}, 65532),  # the container's root
    ({}, {"runAsUser": True}, 65532),  # not a user (the apiserver would refuse it): ours
])
def test_our_init_containers_run_as_the_training_containers_user_unless_root(
        pod_context: dict[str, Any], container_context: dict[str, Any], user: int) -> None:
    s = {"containers": [{"name": "train", "image": "train:1", "securityContext": container_context}],
         "securityContext": pod_context}
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    assert [ct["securityContext"] for ct in added[1]] == [d7(user), d7(user)]


def test_on_reinvocation_what_a_later_webhook_added_to_our_init_containers_stays() -> None:
    s = {"containers": [{"name": "train", "image": "train:1", "resources": {"limits": {"cpu": "4"}}}]}
    added = add_reporter(s, s["containers"], [], "llama", REPORTING)
    assert added is not None
    init = added[1]
    init[0]["resources"] = {"limits": {"cpu": "4", "example.com/dongle": "1"}, "claims": [{"name": "x"}]}
    s2 = {"containers": added[0], "initContainers": init, "volumes": added[2]}
    s2["containers"][0]["resources"] = {"limits": {"cpu": "2"}}
    again = add_reporter(s2, s2["containers"], s2["initContainers"], "llama", REPORTING)
    assert again is not None
    assert again[1][0]["resources"] == {"limits": {"cpu": "2", "example.com/dongle": "1"}, "claims": [{"name": "x"}]}
    assert again[1][1]["resources"] == {"limits": {"cpu": "2"}}
