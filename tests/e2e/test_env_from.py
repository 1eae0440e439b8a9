"""The user's value wins however it is set: a JAX variable a training pod sets through an
envFrom ConfigMap or Secret is the one its running container sees, not the cache's. Pods are
admitted by the operator's webhook through the real apiserver and run by the node agent,
which resolves env as a kubelet does (envFrom sources in order, env over them; shown in
test_node_agent.py). The cache's ConfigMap (cachewarm-<cache>-env-<hash>) is kept by the
operator: deleted, it is created again."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from cachewarm.builders.injection import cache_env
from cachewarm.api.model import parse_spec
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually
from cachewarm_testbed.processes import Proc

pytestmark = pytest.mark.e2e

SHOW_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def create(bed: Testbed, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
    created = bed.kubectl_run("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))
    assert created.returncode == 0, created.stderr
    stored = bed.get_json(obj["kind"].lower(), obj["metadata"]["name"], ns)
    assert stored is not None
    return stored


def training_pod(name: str, env_from: list[dict[str, Any]] | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "train", "image": "test/targets:1", "command": ["python", "-c", SHOW_ENV]}
    if env_from is not None:
        container["envFrom"] = env_from
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"cachewarm.dev/cache": "llama"}},
            "spec": {"restartPolicy": "Never", "containers": [container]}}


def running_env(bed: Testbed, ns: str, name: str) -> dict[str, str]:
    def done() -> dict[str, Any] | None:
        obj = bed.get_json("pod", name, ns) or {}
        return obj if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None
    obj = eventually(done, timeout=120, what=f"pod {name} to finish")
    log = bed.pod_log(ns, name, "train")
    assert obj["status"]["phase"] == "Succeeded", log
    return dict(json.loads(log.strip().splitlines()[-1]))


def test_values_set_through_env_from_win_and_other_containers_get_the_cache_env(
    operator: OperatorHandle, node_agent: Proc, controller_manager: Testbed, namespace: str,
) -> None:
    bed = controller_manager
    bucket = f"ef-{uuid.uuid4().hex[:10]}"
    spec = {"storage": {"gcs": {"bucket": bucket, "prefix": "jax", "location": "us-central1"}},
            "injection": {"report": True}}
    bed.apply({"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "llama"},
               "spec": spec}, namespace)
    ours = {e["name"]: e["value"] for e in cache_env(parse_spec(spec), "pod")}
    # Named by its content's hash; the webhook references it once status says it was checked.
    name = eventually(lambda: ((bed.get_json("ccache", "llama", namespace) or {}).get("status") or {})
                      .get("injection", {}).get("configMaps", {}).get("env"), timeout=60,
                      what="the cache's env ConfigMap verified in status")
    configmap = bed.get_json("configmap", name, namespace)
    assert configmap is not None and configmap["immutable"] is True
    assert configmap["data"] == ours
    create(bed, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "team-env"},
                            "data": {"JAX_COMPILATION_CACHE_DIR": "/mnt/team-cache"}})
    create(bed, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-secret"},
                            "stringData": {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "7"}})
    create(bed, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "unrelated"},
                            "data": {"OTHER": "x"}})

    from_configmap = create(bed, namespace, training_pod("from-configmap", [{"configMapRef": {"name": "team-env"}}]))
    from_secret = create(bed, namespace, training_pod("from-secret", [{"secretRef": {"name": "team-secret"}}]))
    create(bed, namespace, training_pod("unrelated", [{"configMapRef": {"name": "unrelated"}}]))
    plain = create(bed, namespace, training_pod("plain", None))
    assert from_configmap["spec"]["containers"][0]["envFrom"][0] == {
        "configMapRef": {"name": name, "optional": True}}
    assert "env" not in from_secret["spec"]["containers"][0]  # no env entry to override their sources
    plain_env = {e["name"]: e.get("value") for e in plain["spec"]["containers"][0]["env"]}
    assert {k: plain_env[k] for k in ours} == ours  # visible in the spec
    # The reporter goes to containers without envFrom sources only (their PYTHONPATH may come
    # from a source an env entry would override).
    assert plain_env["PYTHONPATH"] == "/cachewarm-reporter"
    assert "PYTHONPATH" not in {e["name"] for e in from_configmap["spec"]["containers"][0].get("env") or []}

    env = running_env(bed, namespace, "from-configmap")
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/mnt/team-cache"  # theirs
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == ours["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]
    env = running_env(bed, namespace, "from-secret")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "7"  # theirs, from a Secret cachewarm never reads
    assert env["JAX_COMPILATION_CACHE_DIR"] == f"gs://{bucket}/jax"
    env = running_env(bed, namespace, "unrelated")
    assert {k: env[k] for k in ours} == ours and env["OTHER"] == "x"
    env = running_env(bed, namespace, "plain")
    assert {k: env[k] for k in ours} == ours

    # Deleted by someone: the operator (its ConfigMap watch) creates it again.
    assert bed.kubectl_run("delete", "configmap", name, "-n", namespace).returncode == 0
    again = eventually(lambda: bed.get_json("configmap", name, namespace), timeout=60,
                       what="the env ConfigMap created again")
    assert again["data"] == ours and again["metadata"]["uid"] != configmap["metadata"]["uid"]
