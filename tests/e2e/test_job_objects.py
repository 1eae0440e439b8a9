"""Every warmer Job and Service the builders make, for every pool kind, sent through the
same KubeClient method the operator uses (so the kubernetes client's own argument
validation runs) to the real kube-apiserver in a server-side dry run. This checks the
objects' schema and the client's validation for every shape; what the operator itself
creates, and that it runs, is proven through the operator in test_accelerator_pools.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from cachewarm.builders import job as jb
from cachewarm.builders import placement
from cachewarm.builders.tpu import TPU_SHAPES, tpu_shape
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.api.model import parse_spec
from cachewarm_testbed.cluster import Testbed

pytestmark = pytest.mark.e2e

OWNER = {"name": "llama", "uid": "6f1c7a2e-0000-4000-8000-000000000000"}

# (id, pool, expected hosts, expected container resources as stored)
POOLS: list[tuple[str, dict[str, Any], int, dict[str, Any] | None]] = [
    ("cpu", {"name": "cpu"}, 1, None),
    ("gpu", {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}, 1,
     {"limits": {"nvidia.com/gpu": "8"}}),
    ("tpu-single-host", {"name": "v5e", "tpu": {"type": "tpu-v5-lite-podslice", "topology": "2x4"}}, 1,
     {"requests": {"google.com/tpu": "8"}, "limits": {"google.com/tpu": "8"}}),
    ("tpu-v5p-2-hosts", {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x2"}}, 2,
     {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}),
    ("tpu-v6e-4-hosts", {"name": "v6e", "tpu": {"type": "tpu-v6e-slice", "topology": "4x4"}}, 4,
     {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}),
    ("tpu-override", {"name": "v6e8", "tpu": {"type": "tpu-v6e-slice", "topology": "2x4"}, "chipsPerHost": 4}, 2,
     {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}),
    ("gpu-user-placement", {
        "name": "h100b", "accelerator": {"type": "nvidia-h100-80gb", "count": 8},
        "nodeSelector": {"cloud.google.com/gke-nodepool": "train-a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
                        {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}],
        "resources": {"requests": {"memory": "64Gi", "cpu": 8}, "limits": {"nvidia.com/gpu": 4, "memory": "80Gi"}},
    }, 1, {"requests": {"memory": "64Gi", "cpu": "8"}, "limits": {"nvidia.com/gpu": "4", "memory": "80Gi"}}),
    ("gpu-two-hosts", {"name": "h100x2", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}, "hosts": 2}, 2,
     {"limits": {"nvidia.com/gpu": "8"}}),
]


@pytest.fixture(scope="module")
def operator_client(installed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeClient]:
    """The operator's KubeClient, talking to the testbed as the operator's ServiceAccount:
    manifests/policy/warmer_jobs.yaml refuses a Job with a CompilationCache as controller to
    anyone else, the testbed's admin included."""
    kubeconfig = installed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator",
                                                      tmp_path_factory.mktemp("objects") / "kubeconfig")
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig),  # type: ignore[no-untyped-call]
                            client_configuration=configuration)
    api = client.ApiClient(configuration)
    yield KubeClient(api)
    api.close()


def objects(namespace: str, pool: dict[str, Any], mode: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec({
        "storage": {"gcs": {"bucket": "objects-check", "prefix": "llama", "location": "us-central1"}},
        "warmup": {"image": "us-docker.pkg.dev/team/train:2026-11-20", "pools": [pool],
                   "env": [{"name": "XLA_FLAGS", "value": "--xla_dump_to=/tmp/x"}], **mode},
    })
    assert spec.warmup is not None
    p = spec.warmup.pools[0]
    out = [jb.warmer_job(spec, cache_name="llama", namespace=namespace, pool=p, digest=jb.spec_hash(spec, p),
                         owner=OWNER, warmer_image="cachewarm/warmer:0.1.0", generation=3)]
    if placement.pool_shape(p).hosts > 1:
        out.insert(0, jb.headless_service("llama", namespace, p, OWNER))
    return out


@pytest.mark.parametrize("mode", [{"targets": ["train.warm:targets"]}, {"command": ["python", "-m", "train"]}],
                         ids=["targets", "command"])
@pytest.mark.parametrize(("pool", "hosts", "resources"), [pytest.param(p, h, r, id=i) for i, p, h, r in POOLS])
def test_builder_objects_pass_the_client_and_the_apiserver(
    operator_client: KubeClient, namespace: str, pool: dict[str, Any], hosts: int, resources: dict[str, Any] | None,
    mode: dict[str, Any],
) -> None:
    built = objects(namespace, pool, mode)
    assert [o["kind"] for o in built] == (["Service", "Job"] if hosts > 1 else ["Job"])
    stored = {}
    for obj in built:
        answer = operator_client.create(obj, dry_run=True)
        assert answer is not None, f"{obj['kind']} {obj['metadata']['name']} reported as existing"
        assert answer["kind"] == obj["kind"] and answer["metadata"]["name"] == obj["metadata"]["name"]
        stored[obj["kind"]] = answer
    job = stored["Job"]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    if resources is None:
        assert not container.get("resources")
    else:
        assert container["resources"] == resources
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == hosts
    assert job["metadata"]["annotations"]["cachewarm.dev/generation"] == "3"
    env = {e["name"]: e for e in container["env"]}
    if hosts > 1:
        svc = stored["Service"]
        assert job["spec"]["completionMode"] == "Indexed"
        assert pod["subdomain"] == svc["metadata"]["name"]
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"cachewarm.dev/warmer-for": "llama", "cachewarm.dev/pool": pool["name"]}
        assert env["JAX_COORDINATOR_ADDRESS"]["value"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}:8476"
        assert env["JAX_NUM_PROCESSES"]["value"] == str(hosts)
        assert job["spec"]["backoffLimit"] == 0  # one runtime: the first pod failure fails the Job
        [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "cloud.google.com/gke-nodepool"
        assert term["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    else:
        assert "completionMode" not in job["spec"] or job["spec"]["completionMode"] == "NonIndexed"
        assert "JAX_COORDINATOR_ADDRESS" not in env
    for key, value in (pool.get("nodeSelector") or {}).items():
        assert pod["nodeSelector"][key] == value
    for toleration in pool.get("tolerations") or []:
        assert toleration in pod["tolerations"]


def test_the_longest_names_leave_every_pod_hostname_a_dns_label(operator_client: KubeClient, namespace: str) -> None:
    # The CRD's longest cache (52) and pool (20) names, and the most hosts a pool can have:
    # the table's largest slice, or the CRD's maximum for an explicit hosts.
    cache_name, pool_name = "c" * 52, "p" * 20
    (tpu_type, topology), hosts = max(((key, tpu_shape(*key).hosts) for key in TPU_SHAPES), key=lambda kv: kv[1])
    assert hosts >= 256
    spec = parse_spec({
        "storage": {"gcs": {"bucket": "objects-check", "location": "us-central1"}},
        "warmup": {"image": "train:1", "targets": ["train.warm:targets"],
                   "pools": [{"name": pool_name, "tpu": {"type": tpu_type, "topology": topology}}]},
    })
    assert spec.warmup is not None
    pool = spec.warmup.pools[0]
    assert placement.pool_shape(pool).hosts == hosts
    for obj in [jb.headless_service(cache_name, namespace, pool, OWNER),
                jb.warmer_job(spec, cache_name=cache_name, namespace=namespace, pool=pool,
                              digest=jb.spec_hash(spec, pool), owner=OWNER, warmer_image="w:1")]:
        answer = operator_client.create(obj, dry_run=True)
        assert answer is not None
        if answer["kind"] == "Job":
            job = answer["metadata"]["name"]
            assert answer["spec"]["completions"] == hosts
            # The longest pod hostname, <job>-<index>, must be a DNS label.
            assert len(f"{job}-{hosts - 1}") <= 63, job
        else:
            assert len(answer["metadata"]["name"]) <= 63


def test_an_object_the_client_would_refuse_is_a_kube_error(operator_client: KubeClient, namespace: str) -> None:
    [job] = objects(namespace, {"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
                    {"targets": ["train.warm:targets"]})
    job["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    with pytest.raises(KubeError) as refused:
        operator_client.create(job, dry_run=True)
    assert refused.value.reason == "InvalidObject"
    assert "nvidia.com/gpu" in str(refused.value)


def test_operator_identity_may_create_jobs_that_block_owner_deletion(
    installed: Testbed, namespace: str, tmp_path: Path
) -> None:
    # The testbed's apiserver runs OwnerReferencesPermissionEnforcement (as OpenShift does):
    # a Job whose ownerReference has blockOwnerDeletion needs update on
    # compilationcaches/finalizers, which manifests/ must grant the operator.
    cache = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "owner"},
             "spec": {"storage": {"gcs": {"bucket": "objects-check", "prefix": "owner", "location": "us-central1"}}}}
    made = installed.kubectl_run("create", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(cache))
    assert made.returncode == 0, made.stderr
    uid = json.loads(made.stdout)["metadata"]["uid"]
    built = objects(namespace, {"name": "cpu"}, {"targets": ["train.warm:targets"]})
    [job] = built
    job["metadata"]["ownerReferences"] = [jb.owner_reference({"name": "owner", "uid": uid})]
    assert job["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] is True
    kubeconfig = installed.service_account_kubeconfig("cachewarm-system", "cachewarm-operator", tmp_path / "kubeconfig")
    created = installed.kubectl_run("create", "-n", namespace, "--dry-run=server", "-f", "-",
                                    input=json.dumps(job), kubeconfig=kubeconfig)
    assert created.returncode == 0, created.stderr
