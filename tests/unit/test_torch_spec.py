"""spec.torch in the typed model (api/model.py, issue 31): its defaults, the bytes of its
quantity, and the CRD's rules again for objects stored without them, each refused with
InvalidSpec naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cachewarm.api.model import (
    CACHEWARM_PATH,
    TORCH_CACHE_DIR,
    TORCH_CACHE_DIR_FORM,
    TORCH_MAX_ARCHIVE_LIMIT,
    InvalidSpec,
    TorchSettings,
    parse_spec,
    quantity_bytes,
)

REPO = Path(__file__).resolve().parents[2]

GCS = {"bucket": "b-1", "location": "US"}
WARMUP = {"image": "i", "targets": ["m:f"], "pools": [{"name": "cpu"}]}


def torch_spec(torch: Any = None, **rest: Any) -> dict[str, Any]:
    return {"storage": {"gcs": GCS}, "warmup": WARMUP, "torch": {} if torch is None else torch, **rest}


def test_a_spec_without_torch_is_jax() -> None:
    cache = parse_spec({"storage": {"gcs": GCS}, "warmup": WARMUP})
    assert cache.torch is None
    assert cache.framework == "jax"


def test_torch_defaults() -> None:
    cache = parse_spec(torch_spec())
    assert cache.framework == "torch"
    assert cache.torch == TorchSettings(cacheDir="/cachewarm-torch", maxArchiveSize="4Gi")
    assert cache.torch is not None and cache.torch.max_archive_bytes == 4 * 2**30


@pytest.mark.parametrize(("size", "expected"), [
    ("4Gi", 4 * 2**30), ("500M", 500 * 10**6), ("1.5Ki", 1536), (123456, 123456), ("64Gi", 64 * 2**30), ("1", 1),
    ("1e3", 1000),
])
def test_max_archive_size_in_bytes(size: int | str, expected: int) -> None:
    cache = parse_spec(torch_spec({"maxArchiveSize": size}))
    assert cache.torch is not None and cache.torch.max_archive_bytes == expected


@pytest.mark.parametrize("value", ["ten gigs", " 4Gi", "4gi", "", "4 Gi", True])
def test_quantity_bytes_refuses_what_is_not_a_quantity(value: Any) -> None:
    with pytest.raises(ValueError, match="is not a Kubernetes quantity"):
        quantity_bytes(value)


@pytest.mark.parametrize(("size", "says"), [
    ("ten gigs", "is not a Kubernetes quantity"),
    ("4gi", "is not a Kubernetes quantity"),
    (0, "is not between 1 byte and 64Gi"),
    ("0", "is not between 1 byte and 64Gi"),
    ("-1Gi", "is not between 1 byte and 64Gi"),
    ("500m", "is not between 1 byte and 64Gi"),  # half a byte
    ("65Gi", "is not between 1 byte and 64Gi"),
    (64 * 2**30 + 1, "is not between 1 byte and 64Gi"),
    ("1E", "is not between 1 byte and 64Gi"),
])
def test_max_archive_size_wrong(size: Any, says: str) -> None:
    with pytest.raises(InvalidSpec, match=rf"spec\.torch\.maxArchiveSize: .*{says}"):
        parse_spec(torch_spec({"maxArchiveSize": size}))


@pytest.mark.parametrize("cache_dir", ["/cachewarm-torch", "/cachewarm-torch/inductor", "/tmp/torch", "/root/.cache/t",
                                       "/workspace/inductor-cache", "/" + "a" * 199, "/tmp", "/home/me/.cache",
                                       "/opt/app/cache", "/var/tmp/torch", "/var/lib/torch", "/usrx", "/devices",
                                       "/mnt/cache", "/runs/torch"])
def test_cache_dir_accepted(cache_dir: str) -> None:
    cache = parse_spec(torch_spec({"cacheDir": cache_dir}))
    assert cache.torch is not None and cache.torch.cache_dir == cache_dir


@pytest.mark.parametrize(("cache_dir", "says"), [
    ("tmp/torch", "is not an absolute directory"),
    ("/", "is not an absolute directory"),
    ("", "is not an absolute directory"),
    ("/tmp/torch/", "is not an absolute directory"),
    ("/tmp//torch", "is not an absolute directory"),
    ("/tmp/to rch", "is not an absolute directory"),
    ("/tmp/../etc", "has a '.' or '..' segment"),
    ("/..", "has a '.' or '..' segment"),
    ("/tmp/./torch", "has a '.' or '..' segment"),
    ("/cachewarm", "one of cachewarm's own mount paths"),
    ("/cachewarm/torch", "one of cachewarm's own mount paths"),
    ("/cachewarm-cache", "one of cachewarm's own mount paths"),
    ("/cachewarm-copy/x", "one of cachewarm's own mount paths"),
    ("/cachewarm-torchx", "one of cachewarm's own mount paths"),
    ("/opt/cachewarm", "one of cachewarm's own mount paths"),
    ("/opt/cachewarm/torch", "one of cachewarm's own mount paths"),
    ("/var/run/secrets/cachewarm", "one of cachewarm's own mount paths"),
    ("/" + "a" * 200, "at most 200 characters"),
    # System directories: an emptyDir there would hide the image's own files in every labelled container.
    *[(path, "is a system directory") for path in (
        "/usr", "/usr/lib/torch", "/etc", "/etc/torch", "/lib", "/lib64/x", "/bin", "/sbin", "/proc", "/sys/x",
        "/dev", "/dev/shm", "/run", "/run/torch", "/boot", "/var/run", "/var/run/secrets/kubernetes.io",
        "/root", "/home", "/opt", "/var", "/var/lib", "/srv", "/mnt")],
])
def test_cache_dir_wrong(cache_dir: str, says: str) -> None:
    with pytest.raises(InvalidSpec, match=rf"spec\.torch\.cacheDir: .*{says}"):
        parse_spec(torch_spec({"cacheDir": cache_dir}))


def test_torch_needs_warmup() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.torch needs spec\.warmup: only warmers fill a torch cache"):
        parse_spec({"storage": {"gcs": GCS}, "torch": {}})


def test_torch_refuses_read_write() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.torch refuses spec\.injection\.mode ReadWrite: a torch cache is code"):
        parse_spec(torch_spec(injection={"mode": "ReadWrite"}))


def test_torch_refuses_reading_the_bucket() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.torch refuses spec\.injection\.readFrom Bucket"):
        parse_spec(torch_spec(injection={"readFrom": "Bucket"}))


def test_torch_refuses_tpu_pools_by_name() -> None:
    warmup = {**WARMUP, "pools": [{"name": "cpu"}, {"name": "v5p", "tpu": {"type": "tpu-v5p-slice", "topology": "2x2x1"}}]}
    with pytest.raises(InvalidSpec, match=r"spec\.torch refuses TPU pools \(v5p in spec\.warmup\.pools\): .*torch_xla"):
        parse_spec(torch_spec(warmup=warmup))
    # GPU pools are torch's.
    gpu = {**WARMUP, "pools": [{"name": "h100", "accelerator": {"type": "nvidia-h100-80gb", "count": 8}}]}
    assert parse_spec(torch_spec(warmup=gpu)).framework == "torch"


def test_every_broken_rule_is_said_at_once() -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse_spec({"storage": {"gcs": GCS}, "torch": {}, "injection": {"mode": "ReadWrite", "readFrom": "Bucket"}})
    said = str(raised.value)
    assert said.startswith("spec: ")
    assert "needs spec.warmup" in said and "mode ReadWrite" in said and "readFrom Bucket" in said


def test_the_rules_are_torch_only() -> None:
    # The same spec without torch stays as valid as before.
    cache = parse_spec({"storage": {"gcs": GCS}, "injection": {"mode": "ReadWrite", "readFrom": "Bucket"},
                        "warmup": {**WARMUP, "pools": [{"name": "v5p", "tpu": {"type": "tpu-v5p-slice",
                                                                               "topology": "2x2x1"}}]}})
    assert cache.framework == "jax"


def test_a_torch_cache_gets_the_default_local_copy_and_says_why() -> None:
    cache = parse_spec(torch_spec())
    assert cache.injection.local_copy == parse_spec({"storage": {"gcs": GCS}, "injection": {"localCopy": {}}}
                                                     ).injection.local_copy
    assert cache.injection.local_copy_by_default
    assert cache.read_path() == ("LocalCopy", "the default of a torch cache: Inductor reads a local directory only, "
                                 "so its pods always get a local copy (spec.injection.localCopy configures it)")


def test_a_torch_cache_gets_its_copy_whatever_spec_jax_says() -> None:
    # spec.jax does not apply to a torch cache: XLA's caches (which keep a JAX cache from a
    # default copy) change nothing for it.
    cache = parse_spec(torch_spec(jax={"enableXlaCaches": "all"}))
    assert cache.injection.local_copy is not None and cache.injection.local_copy_by_default
    assert cache.read_path()[0] == "LocalCopy"
    jax = parse_spec({"storage": {"gcs": GCS}, "warmup": WARMUP, "jax": {"enableXlaCaches": "all"}})
    assert jax.injection.local_copy is None


def test_a_torch_cache_keeps_the_copy_it_asks_for() -> None:
    cache = parse_spec(torch_spec(injection={"localCopy": {"sizeLimit": "2Gi"}}))
    assert cache.injection.local_copy is not None and cache.injection.local_copy.size_limit == "2Gi"
    assert not cache.injection.local_copy_by_default
    assert cache.read_path() == ("LocalCopy", "spec.injection.localCopy")
    named = parse_spec(torch_spec(injection={"readFrom": "LocalCopy"}))
    assert named.injection.local_copy is not None and not named.injection.local_copy_by_default


@pytest.mark.parametrize("size", [True, 1.5, 2.0, ["4Gi"]])
def test_max_archive_size_is_an_int_or_a_string(size: Any) -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.torch\.maxArchiveSize"):
        parse_spec(torch_spec({"maxArchiveSize": size}))


@pytest.mark.parametrize("name", ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"])
def test_torch_warmup_env_must_not_set_the_cache_dirs(name: str) -> None:
    warmup = {**WARMUP, "env": [{"name": "TORCHINDUCTOR_MAX_AUTOTUNE", "value": "1"}, {"name": name, "value": "/x"}]}
    with pytest.raises(InvalidSpec, match=rf"spec\.warmup\.env of a torch cache must not set {name}: "):
        parse_spec(torch_spec(warmup=warmup))
    assert parse_spec({"storage": {"gcs": GCS}, "warmup": warmup}).framework == "jax"  # a JAX cache's own business


def test_the_models_defaults_and_bounds_are_the_crds() -> None:
    # Objects read as the apiserver stores them: the same defaults, the same limits.
    crd = yaml.safe_load((REPO / "crds" / "cachewarm.dev_compilationcaches.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["torch"]
    fields = schema["properties"]
    assert fields["cacheDir"]["default"] == TorchSettings().cache_dir == TORCH_CACHE_DIR
    assert fields["maxArchiveSize"]["default"] == TorchSettings().max_archive_size
    assert fields["cacheDir"]["maxLength"] == TorchSettings.model_fields["cache_dir"].metadata[0].max_length
    rules = " ".join(rule["rule"] for rule in fields["maxArchiveSize"]["x-kubernetes-validations"])
    assert f"quantity('{TORCH_MAX_ARCHIVE_LIMIT}')" in rules
    assert str(quantity_bytes(TORCH_MAX_ARCHIVE_LIMIT)) in rules
    [form] = [r["rule"] for r in fields["cacheDir"]["x-kubernetes-validations"] if "matches('^(/[" in r["rule"]]
    assert TORCH_CACHE_DIR_FORM.pattern in form
    [ours] = [r["rule"] for r in fields["cacheDir"]["x-kubernetes-validations"] if "/opt/cachewarm" in r["rule"]]
    assert CACHEWARM_PATH.pattern in ours
