"""The image cache's key (cachewarm_testbed.images.build_key): a build is redone exactly
when something it copies, its Dockerfile, its base or the tool changes."""

from __future__ import annotations

from pathlib import Path

from cachewarm_testbed.images import Build, build_key

BUILD = Build("docker.io/x/op:1", "Dockerfile", ("pyproject.toml", "pkg"), "PYTHON_IMAGE", "python")


def tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "Dockerfile").write_text("FROM ${PYTHON_IMAGE}\nCOPY pkg /pkg\n")
    (root / "pyproject.toml").write_text("[project]\nname='x'\n")
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    (root / "unrelated.md").write_text("notes\n")
    return root


def test_the_same_content_gives_the_same_key(tmp_path: Path) -> None:
    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    assert build_key(one, BUILD, "base", "buildah 1") == build_key(two, BUILD, "base", "buildah 1")


def test_a_copied_file_the_dockerfile_the_base_or_the_tool_changes_the_key(tmp_path: Path) -> None:
    root = tree(tmp_path)
    before = build_key(root, BUILD, "base", "buildah 1")
    (root / "pkg" / "sub" / "b.py").write_text("B = 3\n")
    after_file = build_key(root, BUILD, "base", "buildah 1")
    assert after_file != before
    (root / "pkg" / "sub" / "c.py").write_text("")  # a new file in a copied folder
    after_new = build_key(root, BUILD, "base", "buildah 1")
    assert after_new != after_file
    (root / "Dockerfile").write_text("FROM ${PYTHON_IMAGE}\nCOPY pkg /opt/pkg\n")
    after_dockerfile = build_key(root, BUILD, "base", "buildah 1")
    assert after_dockerfile != after_new
    assert build_key(root, BUILD, "other-base", "buildah 1") != after_dockerfile
    assert build_key(root, BUILD, "base", "buildah 2") != after_dockerfile


def test_files_the_build_does_not_copy_leave_the_key_alone(tmp_path: Path) -> None:
    root = tree(tmp_path)
    before = build_key(root, BUILD, "base", "buildah 1")
    (root / "unrelated.md").write_text("other notes\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert build_key(root, BUILD, "base", "buildah 1") == before
