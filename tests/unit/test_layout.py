"""The layout's rules that import-linter (.importlinter, `make lint-imports`) cannot see.

- The files shipped into pods reach each other by module name (importlib strings), which a
  linter does not read: each one is imported here as a pod imports it, alone in a folder
  under its shipped name, by an isolated python (-I -S), and must load nothing beyond the
  standard library, even where jax, etils, gcsfs and the operator's libraries are there to
  be found (the agents import those lazily, inside the functions that need them).
- The warmer image ships exactly agents/payload.py's list (and its static busybox).
- The env names pods read are spelled in the agents alone (JAX's own in api/constants.py).
- No function of the operator's package (outside agents/) is over 80 lines.
- Each folder of the package says in its __init__.py what it holds.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cachewarm.agents import copier, payload, reporter

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "operator" / "cachewarm"
AGENTS = PACKAGE / "agents"
MAX_FUNCTION_LINES = 80
ENV_NAME = re.compile(r"(CACHEWARM|JAX)_[A-Z0-9_]*[A-Z0-9]")  # a whole string that is one
CACHEWARM_NAME = re.compile(r"CACHEWARM_[A-Z0-9_]*[A-Z0-9]")

# Run by `python -I -S -c PROBE FOLDER MODULE [LIBRARIES]`: the folder first on sys.path,
# then the standard library, then (where given) a folder of libraries whose .pth files are
# not run (so the operator's own editable install is not there). Prints the top-level
# modules outside the standard library that importing MODULE loaded, one per line.
PROBE = """
import sys
folder, name, libraries = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [folder]
sys.path += libraries
before = set(sys.modules)
__import__(name)
loaded = {m.partition(".")[0] for m in set(sys.modules) - before} - {name}
print("\\n".join(sorted(loaded - set(sys.stdlib_module_names))))
"""


def _shipped_folder(tmp_path: Path) -> Path:
    """A folder holding every shipped file under its shipped name, as a pod's emptyDir or
    boot ConfigMap volume does, and nothing else."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    for name in payload.MODULES:
        shutil.copyfile(payload.source(name), folder / name)
    return folder


@pytest.mark.parametrize("with_libraries", [False, True], ids=["standard-library-only", "libraries-at-hand"])
@pytest.mark.parametrize("name", list(payload.MODULES))
def test_a_shipped_file_imports_alone_and_loads_only_the_standard_library(
        name: str, with_libraries: bool, tmp_path: Path) -> None:
    libraries = [sysconfig.get_paths()["purelib"]] if with_libraries else []
    if with_libraries:
        assert (Path(libraries[0]) / "jax").is_dir(), "the test environment has no jax to tempt the agents with"
    module = name.removesuffix(".py")
    # No CACHEWARM_* from the caller's environment: sitecustomize's steps stay off.
    done = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, str(_shipped_folder(tmp_path)), module,
                           *libraries], capture_output=True, text=True, env={}, check=False)
    assert done.returncode == 0, f"{name} does not import on its own:\n{done.stderr}"
    assert done.stdout.split() == [], f"importing {name} loaded modules outside the standard library"


def test_the_warmer_image_copies_exactly_the_payload_list() -> None:
    copies: dict[str, str] = {}  # destination in the image -> what the COPY line takes
    for line in (REPO / "warmer_image" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            *source, destination = words[1:]
            if destination.startswith(payload.SOURCE_DIR + "/"):
                assert destination not in copies, f"{destination} copied twice"
                copies[destination] = " ".join(source)
    expected = {payload.in_image(name): str(payload.source(name).relative_to(REPO)) for name in payload.MODULES}
    expected[payload.in_image(payload.BUSYBOX)] = "--from=static /busybox"
    assert copies == expected


def _string_assignments(path: Path, prefix: str) -> dict[str, str]:
    """The module-level `NAME = "..."` of a file whose name starts with `prefix`, read
    without running it."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.startswith(prefix) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out[node.targets[0].id] = node.value.value
    return out


def test_the_start_up_hooks_env_names_are_the_copiers_and_the_reporters() -> None:
    # sitecustomize.py runs its steps when imported, so it is read, not imported; it must not
    # load the copier or the reporter to learn their names, and so spells them again.
    hook = _string_assignments(AGENTS / "sitecustomize.py", "ENV_")
    assert hook, "sitecustomize.py defines no ENV_ names"
    owners = {**vars(copier), **vars(reporter)}
    for constant, value in hook.items():
        assert owners.get(constant) == value, f"sitecustomize.{constant} = {value!r}, its owner's is {owners.get(constant)!r}"


@pytest.mark.parametrize("name", list(payload.MODULES))
def test_a_shipped_file_spells_each_of_its_env_names_once_as_a_constant(name: str) -> None:
    path = payload.source(name)
    constants = _string_assignments(path, "ENV_")
    literals = [node.value for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and CACHEWARM_NAME.fullmatch(node.value)]
    assert sorted(literals) == sorted(v for v in constants.values() if CACHEWARM_NAME.fullmatch(v)), \
        "a CACHEWARM_ name spelled outside a module-level ENV_ constant"
    assert len(set(constants.values())) == len(constants), "two constants for one name"


def _env_literals(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{node.lineno} {node.value}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)]


def test_env_names_pods_read_are_spelled_by_the_agents_and_jaxs_by_the_constants_alone() -> None:
    spelled = [hit for path in sorted(PACKAGE.rglob("*.py")) if AGENTS not in path.parents
               and path != PACKAGE / "api" / "constants.py" for hit in _env_literals(path)]
    spelled += [hit for hit in _env_literals(PACKAGE / "api" / "constants.py") if " CACHEWARM_" in hit]
    assert spelled == [], f"env names spelled outside their owner (import them from cachewarm.api.constants): {spelled}"


def _long_functions(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_of_the_operator_is_over_80_lines() -> None:
    # From `def` to its last line, nested functions and methods too; the agents are exempt
    # (single files shipped into pods, read top to bottom).
    long = [hit for path in sorted(PACKAGE.rglob("*.py")) if AGENTS not in path.parents
            for hit in _long_functions(path)]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines, split them:\n" + "\n".join(long)


def test_each_folder_of_the_package_says_what_it_holds() -> None:
    folders = [PACKAGE, *(p for p in sorted(PACKAGE.rglob("*")) if p.is_dir() and p.name != "__pycache__")]
    silent = [str(f.relative_to(REPO)) for f in folders
              if not (f / "__init__.py").is_file() or not ast.get_docstring(ast.parse((f / "__init__.py").read_text()))]
    assert silent == [], f"folders whose __init__.py is missing or has no docstring: {silent}"


def _string_imports(tree: ast.AST) -> list[str]:
    """Modules an agent imports by name at run time: the literal argument of
    importlib.import_module / __import__, and `import X` inside code strings it runs
    (python -c)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.append(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names += re.findall(r"(?:^|;|\n)\s*import\s+([A-Za-z_][\w.]*)", node.value)
    return names


@pytest.mark.parametrize("name", list(payload.MODULES))
def test_what_a_shipped_file_imports_by_name_is_shipped_beside_it_or_standard(name: str) -> None:
    """import_module strings are invisible to import-linter, and the python -I probe runs no
    start-up step: every module an agent names in a string is another shipped file (by its
    shipped name) or the standard library's, never cachewarm's own package."""
    shipped = {n.removesuffix(".py") for n in payload.MODULES}
    tree = ast.parse(payload.source(name).read_text())
    named = _string_imports(tree)
    wrong = [m for m in named if m.partition(".")[0] not in shipped | set(sys.stdlib_module_names)]
    assert wrong == [], f"{name} imports by name what no pod has: {wrong}"
    if name == payload.SITECUSTOMIZE:  # the start-up hook reaches the copier and reporter this way
        assert {"cachewarm_copier", "cachewarm_reporter"} <= set(named)


def test_the_pack_suffix_is_spelled_alike_by_the_warmer_the_copier_and_the_operator() -> None:
    # The operator's lifecycle rule and deletion recognise packs by the suffix the warmer
    # writes and the copier checks (issue 30); the agents cannot import the operator's.
    from cachewarm.builders import placement  # noqa: PLC0415

    spelled = {f: _string_assignments(AGENTS / f, "PACK_SUFFIX").get("PACK_SUFFIX") for f in ("warmer.py", "copier.py")}
    assert spelled == {"warmer.py": placement.PACK_SUFFIX, "copier.py": placement.PACK_SUFFIX}
