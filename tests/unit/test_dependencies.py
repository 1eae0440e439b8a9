"""Every third-party module the operator and the testbed import is declared in their own
pyproject.toml, so an install from the wheel alone does not rely on a transitive dependency."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imported_top_levels(root: Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def declared(pyproject: Path) -> set[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


@pytest.mark.parametrize(("package", "pyproject", "own"), [
    ("operator/cachewarm", "pyproject.toml", {"cachewarm"}),
    ("testbed/cachewarm_testbed", "testbed/pyproject.toml", {"cachewarm", "cachewarm_testbed"}),
])
def test_third_party_imports_are_declared(package: str, pyproject: str, own: set[str]) -> None:
    distributions = importlib.metadata.packages_distributions()
    # The warmer runs inside training images that bring jax and friends (the [warm] extra).
    optional = {"jax", "jaxlib", "gcsfs", "etils", "numpy"}
    missing = {}
    for module in imported_top_levels(REPO / package) - own - set(sys.stdlib_module_names) - {"__future__"}:
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if module not in optional and not dists & declared(REPO / pyproject):
            missing[module] = sorted(dists)
    assert not missing, f"imported but not declared in {pyproject}: {missing}"
