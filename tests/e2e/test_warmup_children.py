"""Warmup commands whose program compiles in a child process (issue 30), through the
operator: `python -c`, a shell wrapper and `python -m` each give the pool a fingerprint and
keys, and KeysMatch turns True once a training pod of the same program reports (False for
one on two devices), not Unknown. And a program whose key changes in every process
(tests/data/unstable_program.py): its re-warm names it in the pool's status, and nothing
is deleted (the older entry expires by the lifecycle rule). The test/targets:1 image holds tests/data in /app (cachewarm_testbed:
local_images); kube-scheduler and the stand-in kubelet run the pods as in test_warmup.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from google.cloud import storage
from test_last_use import warmed_by
from test_warmup import conditions, train_in_pod, warm_cache

from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, local_images
from cachewarm_testbed.nodeagent import DEFAULT_PATH
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

IMAGE = "test/targets:1"
COMMANDS = {
    "-c": ["python", "-c", "import runpy, sys; sys.argv = ['jax_train.py', '--steps', '1']; "
                           "runpy.run_path('jax_train.py', run_name='__main__')"],
    "sh -c": ["sh", "-c", "python jax_train.py --steps 1"],
    "-m": ["python", "-m", "jax_train", "--steps", "1"],
}


def image_path() -> list[dict[str, str]]:
    """The warmup's env: PATH with the image's python first. A python image has `python` on
    its PATH (python:3.11-slim: /usr/local/bin); the stand-in kubelet gives a container
    the image's python only as its argv[0] (nodeagent), so a shell or a `python -c` child
    would find none. This puts it where the real image has it, nothing more."""
    python = str(local_images()[IMAGE]["python"])
    return [{"name": "PATH", "value": f"{python.rsplit('/', 1)[0]}:{DEFAULT_PATH}"}]


def run_pod(bed: Testbed, ns: str, cache: str, name: str, command: list[str],
            env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A training pod of `cache` through the webhook (reporter injected; test_warmup.train_in_pod)."""
    return train_in_pod(bed, ns, cache, name, env, image=IMAGE, command=command, log_compiles=False)


def warmed(bed: Testbed, ns: str, not_job: str | None = None) -> dict[str, Any]:
    """warmed_by, saying on timeout what the cache's status and the warmer's log were."""
    try:
        return warmed_by(bed, ns, "llama", not_job=not_job)
    except AssertionError as exc:
        obj = bed.get_json("ccache", "llama", ns) or {}
        logs = {str(p): p.read_text()[-2000:] for p in (bed.workdir / "pods" / ns).glob("*/warm.log")}
        raise AssertionError(f"{exc}\nstatus: {json.dumps(obj.get('status'))[:4000]}\nlogs: {logs}") from None


def keys_match(bed: Testbed, ns: str, status: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = conditions(bed.get_json("ccache", "llama", ns)).get("KeysMatch") or {}
        return cond if cond.get("status") == status else None
    return eventually(check, timeout=60, what=f"KeysMatch {status}")


@pytest.mark.parametrize("form", list(COMMANDS))
def test_a_warmup_command_in_a_child_process_has_a_fingerprint_and_keys_match(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
    gcs: storage.Client, form: str,
) -> None:
    bucket = f"child-{uuid.uuid4().hex[:8]}"
    # Pods read gs:// directly (readFrom Bucket): what is tested is the warmer's fingerprint
    # and keys against a pod's, not the local copy (test_warmup.py tests both paths).
    controller_manager.apply(warm_cache("llama", bucket, {"image": IMAGE, "command": COMMANDS[form],
                                                          "env": image_path()},
                                        injection={"readFrom": "Bucket"}), namespace)
    obj = warmed(controller_manager, namespace)
    [pool] = obj["status"]["warmup"]["pools"]
    fingerprint = pool["fingerprint"]
    assert (fingerprint["platform"], fingerprint["devices"], fingerprint["cacheDir"]) == ("cpu", 1, f"gs://{bucket}/jax")
    entries = [b.name for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    assert any("jit_train_step" in n for n in entries)
    assert pool["entriesWritten"] == len(entries) == pool["keyCount"] and pool.get("manifestGeneration")
    # What the child's compile of the step took, by the key it wrote (pods' hits are measured against it).
    [step] = [p for p in pool["compiledPrograms"] if p["program"] == "jit_train_step"]
    assert step["written"] and step["compileSeconds"] > 0 and step["key"] in pool["keys"]
    run = run_pod(controller_manager, namespace, "llama", "trainer", ["python", "jax_train.py", "--steps", "2"])
    assert run["hits"] >= 1 and run["compiled"] == 0, run["log"][-3000:]
    cond = keys_match(controller_manager, namespace, "True")
    assert cond["reason"] != "Unknown"
    if form != "sh -c":
        return  # one form is enough for the other side
    other = run_pod(controller_manager, namespace, "llama", "two-devices", ["python", "jax_train.py", "--steps", "2"],
                    env=[{"name": "XLA_FLAGS", "value": "--xla_force_host_platform_device_count=2"}])
    assert other["hits"] == 0 and other["compiled"] >= 1
    cond = keys_match(controller_manager, namespace, "False")
    assert cond["reason"] == "FingerprintsDiffer"


def test_a_program_with_a_new_key_every_warm_is_named_in_the_pools_status_and_nothing_is_deleted(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str, gcs: storage.Client,
) -> None:
    bucket = f"unstable-{uuid.uuid4().hex[:8]}"
    # A wrapper (sh -c): the program's compiles are a child's, counted all the same.
    warmup = {"image": IMAGE, "command": ["sh", "-c", "python unstable_program.py"], "env": image_path()}
    controller_manager.apply(warm_cache("llama", bucket, warmup), namespace)
    first = warmed(controller_manager, namespace)
    [pool] = first["status"]["warmup"]["pools"]
    assert "unstablePrograms" not in pool and pool["fingerprint"]["devices"] == 2

    def unstable() -> list[str]:
        return sorted(b.name for b in gcs.list_blobs(bucket, prefix="jax/jit_unstable_step-")
                      if b.name.endswith("-cache"))
    [older] = unstable()
    annotated = controller_manager.kubectl_run("annotate", "ccache", "llama", "-n", namespace, "cachewarm.dev/rewarm=1")
    assert annotated.returncode == 0, annotated.stderr
    second = warmed(controller_manager, namespace, not_job=pool["job"])
    [again] = second["status"]["warmup"]["pools"]
    # Both entries stay: the warmer deletes nothing (the older one, no longer refreshed by
    # warmers, expires by the lifecycle rule).
    [newer] = [n for n in unstable() if n != older]
    assert older in unstable()
    hashes = [n.removesuffix("-cache").rsplit("-", 1)[1][:16] for n in (older, newer)]
    assert again["unstablePrograms"] == [{"program": "jit_unstable_step", "keys": hashes, "seen": "runs"}]
    assert "unstableRemoved" not in again
