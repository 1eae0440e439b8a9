"""Test tooling: run a stored Pod's container command as a local process with the env a
kubelet would give it, for a test that needs one container's process and no node: PATH
and HOME (as containerd sets them when the image does not), HOSTNAME, the image's own ENV,
what the test passes as the node's (the GCS endpoint), then the pod spec's env. Nothing of
the test runner's environment reaches the process, so a variable the webhook did not
patch in is not there. Only plain `value` env is supported; anything else is an error, so
a test never runs with env it did not mean. Pods that need volumes, references or an
image's own python run on the node agent (cachewarm_testbed.nodeagent) instead."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

# What containerd sets when the image sets no PATH (as the node agent does).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def container_env(pod: Mapping[str, Any], container: str | None = None) -> dict[str, str]:
    """The env of `container` (default: the first) as the pod spec gives it.
    Raises ValueError for env it cannot reproduce (valueFrom, envFrom) or an unknown container."""
    containers = (pod.get("spec") or {}).get("containers") or []
    chosen = next((c for c in containers if container is None or c.get("name") == container), None)
    if chosen is None:
        raise ValueError(f"pod has no container {container!r}")
    if chosen.get("envFrom"):
        raise ValueError("envFrom: podrun reproduces plain values only")
    env: dict[str, str] = {}
    for var in chosen.get("env") or []:
        if "value" not in var:
            raise ValueError(f"env {var.get('name')} uses valueFrom; podrun reproduces plain values only")
        env[var["name"]] = var["value"]
    return env


def kubelet_env(pod: Mapping[str, Any], *, node_env: Mapping[str, str], image_env: Mapping[str, str] | None = None,
                container: str | None = None) -> dict[str, str]:
    """The whole env of the container's process: PATH, HOME, HOSTNAME, the image's ENV,
    `node_env`, then the pod spec's (later wins). Raises ValueError as container_env."""
    meta = pod.get("metadata") or {}
    hostname = str((pod.get("spec") or {}).get("hostname") or meta.get("name") or "pod")
    return {"PATH": DEFAULT_PATH, "HOME": "/root", **(image_env or {}), "HOSTNAME": hostname, **node_env,
            **container_env(pod, container)}


def run_container(
    pod: Mapping[str, Any], argv: Sequence[str], *, node_env: Mapping[str, str],
    image_env: Mapping[str, str] | None = None, timeout: float = 600, container: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` with kubelet_env (never this process's environment). Raises ValueError
    as container_env, subprocess.TimeoutExpired after `timeout`."""
    env = kubelet_env(pod, node_env=node_env, image_env=image_env, container=container)
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
