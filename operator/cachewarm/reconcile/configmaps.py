"""The ConfigMaps a cache's pods read, applied on every reconcile: the cache env (for
containers with envFrom sources) and, with a local copy, the boot ConfigMap holding the
shipped agents' code (agents/payload.py) and its bytecode, compiled once per process."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from cachewarm.agents import payload
from cachewarm.api import constants as c
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec
from cachewarm.builders.injection import env_configmap
from cachewarm.builders.localcopy import BOOT_FILES, BYTECODE_SCRIPT, BYTECODE_TAG, boot_configmap, bytecode_key
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.reconcile.status import changed

log = logging.getLogger("cachewarm.service")


def publish_configmaps(kube: KubeClient, cache: CacheSpec, status: Mapping[str, Any], events: list[Event], *, namespace: str, name: str,
                 uid: str) -> Cond:
    """The ConfigMap containers with envFrom sources read the cache env from, applied
    (created, or restored if someone changed it) on every reconcile. Its condition; a
    Warning Event when it newly fails."""
    owner = {"name": name, "uid": uid}
    env_body = env_configmap(cache, name, namespace, owner)
    configmap = env_body["metadata"]["name"]
    try:
        kube.apply_configmap(env_body)
    except KubeError as exc:
        cond = Cond(c.Condition.INJECTION_READY, False, exc.reason,
                    f"ConfigMap {configmap} with the cache env could not be applied: {exc}; pods whose containers "
                    "have envFrom sources may start without the cache env; retrying"[:1000])
        if changed(status, cond):
            events.append(Event("Warning", exc.reason, cond.message))
        return cond
    boot = ""
    if cache.injection.local_copy is not None:
        boot_body = boot_configmap(name, namespace, owner, boot_files(), boot_bytecode_files())
        try:
            kube.apply_configmap(boot_body)
        except KubeError as exc:
            cond = Cond(c.Condition.INJECTION_READY, False, exc.reason,
                        f"ConfigMap {boot_body['metadata']['name']} with the local copy's code could not be applied: "
                        f"{exc}; pods that copy in process start cold; retrying"[:1000])
            if changed(status, cond):
                events.append(Event("Warning", exc.reason, cond.message))
            return cond
        boot = f"; ConfigMap {boot_body['metadata']['name']} holds the code of the local copy pods make in process"
    return Cond(c.Condition.INJECTION_READY, True, c.Reason.RECONCILED,
                f"ConfigMap {configmap} holds the cache env; containers with envFrom sources read it first, so "
                f"their own env and envFrom values win{boot}")


@functools.cache
def boot_files() -> dict[str, str]:
    """The text of the boot ConfigMap's files (agents/payload.py), as installed, read once."""
    return {shipped: payload.source(shipped).read_text(encoding="utf-8") for shipped in BOOT_FILES}


def compile_boot(files: Mapping[str, str], tag: str | None = BYTECODE_TAG) -> dict[str, bytes]:
    """`files` (shipped name -> text) compiled by a fresh interpreter of this python
    (localcopy.BYTECODE_SCRIPT): bytecode_key(name, tag) -> its checked-hash pyc. None
    when this python caches no bytecode (tag None) or cannot be run again (no
    sys.executable, or it fails: logged); then pods compile the files, as they always could."""
    if tag is None or not sys.executable:
        return {}
    # -S: no site (nothing of the environment's loaded first), -B: writes nothing (a
    # read-only root), -P: not the working directory on sys.path. Of the environment only
    # what running python itself may need, and a fixed hash seed.
    env = {k: v for k, v in os.environ.items() if k in ("LD_LIBRARY_PATH", "PYTHONHOME")}
    try:
        done = subprocess.run([sys.executable, "-S", "-B", "-P", "-c", BYTECODE_SCRIPT], input=json.dumps(dict(files)),
                              capture_output=True, text=True, timeout=60, env={**env, "PYTHONHASHSEED": "0"},
                              check=True)
        return {bytecode_key(name, tag): bytes.fromhex(pyc) for name, pyc in json.loads(done.stdout).items()}
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None) or ""
        log.warning("the boot ConfigMap goes without bytecode (pods compile its files): %s %s", exc, stderr[-500:])
        return {}


_bytecode: dict[str, bytes] | None = None
_bytecode_failed_at = -float("inf")
_bytecode_lock = threading.Lock()
BYTECODE_RETRY_SECONDS = 300.0


def boot_bytecode_files() -> dict[str, bytes]:
    """The boot ConfigMap's bytecode (compile_boot of boot_files): compiled once, by one
    reconcile while the others wait; a failure is not kept, but tried again at most every
    BYTECODE_RETRY_SECONDS (meanwhile, and until then, the ConfigMap goes without it), so a
    passing failure does not leave this replica applying ConfigMaps unlike another's."""
    global _bytecode, _bytecode_failed_at  # noqa: PLW0603 - the process's one compile
    with _bytecode_lock:
        if _bytecode is None and time.monotonic() - _bytecode_failed_at >= BYTECODE_RETRY_SECONDS:
            compiled = compile_boot(boot_files())
            if compiled or BYTECODE_TAG is None:
                _bytecode = compiled
            else:
                _bytecode_failed_at = time.monotonic()
        return _bytecode or {}
