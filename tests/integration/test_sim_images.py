"""The node agent's images are no kinder than real ones (cachewarm_testbed.simimages): an
image's python imports what its Dockerfile installs and nothing of the test runner's,
and the warmer run by the python of an image without GCS libraries fails on a gs://
cache saying what the image lacks. (What env a container gets is the node agent's test,
tests/e2e/test_node_agent.py: pods run there with the env their spec resolves to.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachewarm_testbed.cluster import local_images, repo_root

pytestmark = pytest.mark.integration

REPO = repo_root()


@pytest.fixture(scope="module")
def images() -> dict[str, dict[str, object]]:
    return local_images()


def importable(python: str, module: str) -> bool:
    found = subprocess.run([python, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
                           env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=60)
    return found.returncode == 0


def test_an_images_python_has_what_its_dockerfile_installs_and_nothing_else(images: dict[str, dict[str, object]]) -> None:
    full, plain = str(images["demo/train:1"]["python"]), str(images["cachewarm/demo-train-plain:0.1.0"]["python"])
    assert full != sys.executable and plain != full
    for module in ("jax", "gcsfs", "etils"):
        assert importable(full, module), module
    assert importable(plain, "jax") and not importable(plain, "gcsfs") and not importable(plain, "etils")
    for python in (full, plain):
        for module in ("cachewarm", "cachewarm_testbed", "kubernetes", "pytest", "yaml", "pydantic"):
            assert not importable(python, module), (python, module)
    assert "python" not in images["cachewarm/warmer:0.1.0"]
    # Two builds of one Dockerfile: two folders, one environment (as their site-packages path is one).
    one, two = images["demo/train:1"], images["demo/train:2"]
    assert one["paths"] != two["paths"] and one["python"] == two["python"]


def test_a_warmer_in_an_image_without_gcs_libraries_says_what_it_lacks(
    images: dict[str, dict[str, object]], tmp_path: Path,
) -> None:
    plain = images["cachewarm/demo-train-plain:0.1.0"]
    workdir = Path(str(plain["paths"]["/app"]))  # type: ignore[index]
    summary = tmp_path / "termination-log"
    out = subprocess.run([str(plain["python"]), str(REPO / "operator" / "cachewarm" / "agents" / "warmer.py"), "targets",
                          "train:targets"], cwd=workdir, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CACHEWARM_SUMMARY_FILE": str(summary),
                              "JAX_COMPILATION_CACHE_DIR": "gs://no-such-bucket/jax",
                              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert out.returncode == 1, out.stderr
    report = json.loads(summary.read_text())
    assert report["errors"] == ["JAX_COMPILATION_CACHE_DIR is gs://no-such-bucket/jax, which this image cannot use: "
                                "it lacks etils[epath] and gcsfs (install them in the image: pip install etils[epath] "
                                "gcsfs)"]
    assert report["programs"] == 0 and report["entriesWritten"] == 0
