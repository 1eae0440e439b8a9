"""The node agent's images are read from their Dockerfiles (cachewarm_testbed.simimages):
what a stage installs, copies and sets, and the distributions that makes in this
environment. Building them runs processes: tests/integration/test_sim_images.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachewarm_testbed.simimages import ImageError, closure, parse_dockerfile

REPO = Path(__file__).resolve().parents[2]


def test_demo_dockerfile_stages_are_read_as_docker_builds_them() -> None:
    stages = parse_dockerfile(REPO / "demo" / "Dockerfile", REPO)
    plain, full = stages["plain"], stages[""]
    assert plain.requirements == ["jax==0.10.2", "jaxlib==0.10.2"]
    assert full.requirements == [*plain.requirements, "gcsfs==2026.10.1", "etils[epath]==1.15.0"]
    assert plain.files == full.files == {"/app/train.py": REPO / "demo" / "train.py",
                                         "/app/programs.py": REPO / "demo" / "programs.py"}
    assert plain.workdir == full.workdir == "/app"
    assert full.env == {"PYTHONUNBUFFERED": "1", "PYTHONPATH": "/app"}


def test_a_step_the_testbed_cannot_reproduce_is_refused(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nRUN apt-get install -y gcc\n")
    with pytest.raises(ImageError, match="only `pip install`"):
        parse_dockerfile(dockerfile, tmp_path)


def names(requirements: list[str]) -> set[str]:
    return {d.metadata["Name"].lower().replace("_", "-") for d in closure(requirements)}


def test_the_closure_holds_what_pip_would_install_and_nothing_else() -> None:
    plain = names(["jax==0.10.2", "jaxlib==0.10.2"])
    assert {"jax", "jaxlib", "numpy", "ml-dtypes", "scipy", "opt-einsum"} <= plain
    assert not plain & {"gcsfs", "etils", "kubernetes", "pytest", "cachewarm", "pydantic", "pyyaml"}
    # An extra brings what it names: etils[epath] more than etils alone.
    assert names(["etils"]) < names(["etils[epath]"])


def test_a_pin_the_runner_does_not_have_is_refused() -> None:
    with pytest.raises(ImageError, match="the test runner has jax 0.10.2"):
        closure(["jax==0.0.1"])
    with pytest.raises(ImageError, match="not installed"):
        closure(["no-such-distribution-cachewarm"])
