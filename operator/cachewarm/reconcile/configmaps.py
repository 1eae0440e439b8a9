"""The ConfigMaps a cache's pods read, created and checked on every reconcile: the cache
env (for containers with envFrom sources) and, with a local copy, the boot ConfigMap
holding the shipped agents' code (agents/payload.py) and its bytecode, compiled once per
process. Both are immutable and named by their content's hash; anyone with ConfigMap write
in the namespace may create one of those names first, so each is used (recorded in
status.injection.configMaps, which is all the webhook reads) only while what the API holds
is what the operator wrote (D4).

Older ConfigMaps of a cache (another content: its spec or the operator changed) are left
to the garbage collector, which deletes them with the cache: a pod admitted with an older
name may still be starting, and nothing here can prove that none is."""

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
from cachewarm.builders.injection import CONTENT_SHA256_ANNOTATION, body_sha256, env_configmap
from cachewarm.builders.localcopy import BOOT_FILES, BYTECODE_SCRIPT, BYTECODE_TAG, boot_configmap, bytecode_key
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.reconcile.status import changed

log = logging.getLogger("cachewarm.service")


ROLES = {"env": "the cache env, for containers with envFrom sources",
         "boot": "the code of the local copy pods make in process"}


def not_ours(existing: Mapping[str, Any], desired: Mapping[str, Any], uid: str) -> str:
    """Why `existing` (a ConfigMap as the API returns it) is not the one the operator
    wrote as `desired` for the cache of `uid` ("" when it is). Its content must hash to
    what we wrote (the name already says the hash: anyone may create that name first), and
    it must be immutable (no one edits it after it was checked), labelled and controlled
    by the cache (so the ConfigMap watch sees it change and it goes with the cache)."""
    want = desired["metadata"]["annotations"][CONTENT_SHA256_ANNOTATION]
    meta = existing.get("metadata") or {}
    why = []
    try:
        content = body_sha256(existing)
    except ValueError:
        content = ""
    if content != want:
        why.append("its content is not what the operator wrote")
    if existing.get("immutable") is not True:
        why.append("it is not immutable")
    if (meta.get("labels") or {}).get(c.MANAGED_BY_LABEL) != c.MANAGED_BY:
        why.append(f"it lacks the label {c.MANAGED_BY_LABEL}={c.MANAGED_BY}")
    if not any(r.get("controller") and r.get("uid") == uid for r in meta.get("ownerReferences") or []):
        why.append("its controller is not this cache")
    return ", ".join(why)


def ensure_configmap(kube: KubeClient, desired: dict[str, Any], uid: str) -> str:
    """Create `desired` unless a ConfigMap of its name exists, then check what is there
    (not_ours; "" when it is ours). Never updates nor deletes one: a ConfigMap of our name
    with other content is someone else's. Raises KubeError."""
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    existing = kube.read_configmap(namespace, name)
    if existing is None:
        existing = kube.create_configmap(desired) or kube.read_configmap(namespace, name)
    if existing is None:
        raise KubeError(f"ConfigMap {namespace}/{name} was created by someone else and deleted again; retrying")
    return not_ours(existing, desired, uid)


def publish_configmaps(kube: KubeClient, cache: CacheSpec, status: Mapping[str, Any], events: list[Event], *,
                       namespace: str, name: str, uid: str) -> tuple[Cond, dict[str, str | None]]:
    """The ConfigMaps the cache's pods read (the env one; the boot one with a local copy),
    created when missing and checked on every reconcile (ensure_configmap). Returns
    InjectionReady, and status.injection.configMaps: the name of each one found to be ours,
    None for the others (removed from status by the merge patch, so the webhook stops
    using them); one that could not be read is left out (status keeps the last check: an
    apiserver error is no sign of tampering). A Warning Event when the condition newly fails."""
    owner = {"name": name, "uid": uid}
    wanted = {"env": env_configmap(cache, name, namespace, owner)}
    if cache.injection.local_copy is not None:
        wanted["boot"] = boot_configmap(name, namespace, owner, boot_files(), boot_bytecode_files())
    names: dict[str, str | None] = {"env": None, "boot": None}
    refused: list[str] = []
    failed: KubeError | None = None
    for role, body in wanted.items():
        try:
            why = ensure_configmap(kube, body, uid)
        except KubeError as exc:
            failed = failed or exc
            del names[role]
            continue
        if why:
            refused.append(f"ConfigMap {body['metadata']['name']} ({ROLES[role]}) exists, but {why}")
        else:
            names[role] = str(body["metadata"]["name"])
    cond = _condition(names, refused, failed)
    if not cond.status and changed(status, cond):
        events.append(Event("Warning", cond.reason, cond.message))
    return cond, names


def _condition(names: Mapping[str, str | None], refused: list[str], failed: KubeError | None) -> Cond:
    if refused:
        return Cond(c.Condition.INJECTION_READY, False, c.Reason.CONFIGMAP_NOT_OURS,
                    f"{'; '.join(refused)}: the operator does not use it and never deletes it. Until someone "
                    "deletes it (the operator then creates its own), pods get none of it: containers with envFrom "
                    "sources no cache env, pods with a local copy one made by an init container"[:1000])
    if failed is not None:
        return Cond(c.Condition.INJECTION_READY, False, failed.reason,
                    f"The cache's ConfigMaps could not be read or created: {failed}; pods get only those verified "
                    "before; retrying"[:1000])
    boot = f"; ConfigMap {names['boot']} holds {ROLES['boot']}" if names.get("boot") else ""
    return Cond(c.Condition.INJECTION_READY, True, c.Reason.RECONCILED,
                f"ConfigMap {names['env']} holds the cache env; containers with envFrom sources read it first, so "
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
