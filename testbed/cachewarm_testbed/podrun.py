"""Test tooling: run a stored Pod's container command as a local process with the env the
apiserver stored for it (after admission), standing in for a kubelet that this machine
does not have. Only plain `value` env is supported; anything else is an error, so a
test never runs with env it did not mean."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def container_env(pod: Mapping[str, Any], container: str | None = None) -> dict[str, str]:
    """The env of `container` (default: the first) as the pod spec gives it.
    Raises ValueError for env it cannot reproduce (valueFrom) or an unknown container."""
    containers = (pod.get("spec") or {}).get("containers") or []
    chosen = next((c for c in containers if container is None or c.get("name") == container), None)
    if chosen is None:
        raise ValueError(f"pod has no container {container!r}")
    env: dict[str, str] = {}
    for var in chosen.get("env") or []:
        if "value" not in var:
            raise ValueError(f"env {var.get('name')} uses valueFrom; podrun reproduces plain values only")
        env[var["name"]] = var["value"]
    return env


def run_container(
    pod: Mapping[str, Any], argv: Sequence[str], *, base_env: Mapping[str, str], timeout: float = 600,
    container: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` with `base_env` (PATH, emulator endpoints) overlaid by the pod's env."""
    env = {**os.environ, **base_env, **container_env(pod, container)}
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
