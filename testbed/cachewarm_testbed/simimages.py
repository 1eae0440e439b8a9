"""Test tooling: the node agent's stand-ins for container images, each built from its
Dockerfile into folders of its own, so that an image is no kinder than the real one.

An image here is what its Dockerfile's stage makes of it, read by `parse_dockerfile`: the
files its COPY lines put in (copied into a folder of the image's, which the node agent
copies again for every container, as each container gets its own writable layer), its
WORKDIR and ENV, and a python environment holding exactly the distributions its
`pip install` lines name, with their dependencies (`python_env`: a venv made with
`--without-pip` whose site-packages links to the test runner's installed files of those
distributions only). So a library the Dockerfile does not install is not importable in
the image's containers (`import gcsfs` fails in the plain stage), none of the runner's own
packages (cachewarm, kubernetes, pytest) is, and two tags of one Dockerfile are two
folders with a marker file each (`/etc/cachewarm-testbed-image`, the image's name).

What is shared, as on a real node: two images whose `pip install` lines resolve to the
same distributions and versions share one environment (the same site-packages path, as two
builds of one Dockerfile have). What is not simulated: the base image's own files (the
host's tools run, /bin/sh and cp among them), and versions: an image's distributions are
the runner's, which must have the version a `==` pin names (else ImageError).

Everything is cached under .cache/sim-images by content (the interpreter, the
distributions and their versions; the copied files' bytes), built once and reused.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

FORMAT = "1"  # bump when what a cached folder holds changes
MARKER = "/etc/cachewarm-testbed-image"


class ImageError(Exception):
    """An image the testbed cannot build from this environment (a Dockerfile step it
    does not read, a distribution the runner lacks or has in another version)."""


@dataclass
class Stage:
    """What one Dockerfile stage holds: requirements its pip installs name, files by
    their path in the image, its WORKDIR and ENV, and whether it has python (the python
    base images parse_dockerfile reads do)."""

    requirements: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    python: bool = True

    def copy(self) -> Stage:
        return Stage(list(self.requirements), dict(self.files), self.workdir, dict(self.env), self.python)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def parse_dockerfile(path: Path, context: Path) -> dict[str, Stage]:
    """The stages of a Dockerfile on a python base whose RUN steps are only `pip install`:
    by their `AS` name, and the last one also under "". COPY sources are relative to `context`.
    Raises ImageError for any step it does not read (the simulated image would differ)."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for word, rest in _instructions(path.read_text()):
        if word == "ARG" and current is None:
            continue
        if word == "FROM":
            parts = rest.split()
            base = parts[0]
            current = stages[base].copy() if base in stages else Stage()
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages[parts[2]] = current
            stages[""] = current
            continue
        if current is None:
            raise ImageError(f"{path}: {word} before FROM")
        if word == "RUN":
            args = shlex.split(rest)
            if args[:2] != ["pip", "install"]:
                raise ImageError(f"{path}: RUN {rest!r}: the testbed's images run only `pip install`")
            current.requirements += [a for a in args[2:] if not a.startswith("-")]
        elif word == "WORKDIR":
            current.workdir = str(PurePosixPath(current.workdir) / rest)
        elif word == "COPY":
            *sources, dest = shlex.split(rest)
            if any(s.startswith("--") for s in sources):
                raise ImageError(f"{path}: COPY {rest!r}: options are not read")
            target = PurePosixPath(current.workdir) / dest
            for source in sources:
                local = context / source
                if not local.is_file():
                    raise ImageError(f"{path}: COPY {source}: not a file of the context")
                into = target / local.name if dest.endswith("/") or len(sources) > 1 else target
                current.files[str(into)] = local
        elif word == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                if not sep:
                    raise ImageError(f"{path}: ENV {rest!r}: only KEY=VALUE is read")
                current.env[key] = value
        elif word not in ("CMD", "ENTRYPOINT", "LABEL", "USER", "EXPOSE"):
            raise ImageError(f"{path}: {word} is not read by the testbed")
    if "" not in stages:
        raise ImageError(f"{path}: no FROM")
    return stages


def closure(requirements: Sequence[str]) -> list[md.Distribution]:
    """The runner's distributions that `pip install REQUIREMENTS` would put into an empty
    environment: each named one (its version must satisfy the requirement) and, through
    their metadata's Requires-Dist with markers and extras evaluated, every dependency.
    Raises ImageError when one is not installed here or not in a version that fits."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    found: dict[str, md.Distribution] = {}
    extras_done: set[tuple[str, str]] = set()
    pending = [(Requirement(r), "") for r in requirements]
    while pending:
        req, extra = pending.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = str(canonicalize_name(req.name))
        try:
            dist = found.get(name) or md.distribution(req.name)
        except md.PackageNotFoundError as exc:
            raise ImageError(f"{req} is not installed in the test runner's environment") from exc
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            raise ImageError(f"{req}: the test runner has {dist.metadata['Name']} {dist.version}")
        for wanted in ["", *sorted(req.extras)]:
            if (name, wanted) in extras_done:
                continue
            extras_done.add((name, wanted))
            pending += [(Requirement(r), wanted) for r in dist.requires or []]
        found[name] = dist
    return [found[n] for n in sorted(found)]


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _owners(site: Path) -> dict[PurePosixPath, set[str]]:
    """For every file and folder under `site` that an installed distribution's RECORD
    names, the distributions that own something at or below it."""
    owners: dict[PurePosixPath, set[str]] = {}
    for dist in md.distributions(path=[str(site)]):
        name = str(canonicalize_name(dist.metadata["Name"]))
        for file in dist.files or []:
            rel = PurePosixPath(str(file))
            if rel.parts[:1] == ("..",) or rel.is_absolute():
                continue
            for part in [rel, *rel.parents]:
                if str(part) != ".":
                    owners.setdefault(part, set()).add(name)
    return owners


def _link(site: Path, into: Path, rel: PurePosixPath, wanted: set[str],
          owners: Mapping[PurePosixPath, set[str]]) -> None:
    """Link `rel` into `into`: whole, when only wanted distributions own anything in it;
    else as a folder of its own holding the wanted distributions' entries."""
    source = site / rel
    if owners.get(rel, set()) <= wanted or not source.is_dir() or source.is_symlink():
        (into / rel).symlink_to(source)
        return
    (into / rel).mkdir()
    for child in sorted(source.iterdir()):
        sub = rel / child.name
        if owners.get(sub, set()) & wanted:
            _link(site, into, sub, wanted, owners)


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([FORMAT, *parts], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _publish(build: Path, final: Path) -> Path:
    """Move a finished build to its cached name; another process may have won the race."""
    try:
        build.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(build, ignore_errors=True)
    return final


def python_env(requirements: Sequence[str], cache: Path) -> Path:
    """A venv (no pip) whose site-packages holds exactly the closure of `requirements`,
    linked from the runner's; returns its python. Raises ImageError."""
    dists = closure(requirements)
    site = _site_packages()
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    listed = [(str(canonicalize_name(d.metadata["Name"])), d.version) for d in dists]
    final = cache / f"python-{_key(str(base), sys.version, str(site), listed)}"
    python = final / "bin" / "python"
    if python.exists():
        return python
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
    try:
        env = build / "venv"
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(env)], check=True, capture_output=True)
        [target] = list((env / "lib").glob("python3*/site-packages"))
        wanted = {name for name, _ in listed}
        owners = _owners(site)
        tops = {PurePosixPath(str(f)).parts[0] for d in dists for f in d.files or []
                if PurePosixPath(str(f)).parts[:1] not in (("..",), ("/",))}
        for top in sorted(tops):
            _link(site, target, PurePosixPath(top), wanted, owners)
        (env / "requirements.json").write_text(json.dumps({"requirements": list(requirements),
                                                           "distributions": listed}, indent=1))
        _publish(env, final)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return python


def image_files(name: str, files: Mapping[str, Path], cache: Path) -> Path:
    """A folder laid out as the image's filesystem: `files` (by their path in the image)
    copied in, and the marker naming the image. Returns the folder."""
    contents = sorted((path, hashlib.sha256(src.read_bytes()).hexdigest()) for path, src in files.items())
    final = cache / f"files-{_key(name, contents)}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=cache))
    try:
        tree = build / "tree"
        for path, src in {**files}.items():
            dest = tree / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        marker = tree / MARKER.lstrip("/")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(name + "\n")
        _publish(tree, final)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


def image(name: str, stage: Stage, cache: Path) -> dict[str, Any]:
    """The node agent's entry for one image (cachewarm_testbed.nodeagent's --image-map):
    `paths` maps the folders holding the image's files (and the marker file itself) to
    their local copies, and nothing else of the image's filesystem (a pod's /etc/hosts
    stays the node agent's), `workdir` is the container's default working directory,
    `python` the environment's interpreter (absent: the image has no python), `env` its
    ENV. Raises ImageError."""
    tree = image_files(name, stage.files, cache)
    folders = {str(PurePosixPath(path).parent) for path in stage.files} | {stage.workdir}
    local = {folder: str(tree / folder.lstrip("/")) for folder in folders if folder != "/"}
    entry: dict[str, Any] = {
        "paths": {**local, MARKER: str(tree / MARKER.lstrip("/"))},
        "workdir": stage.workdir,
        "env": dict(stage.env),
    }
    if stage.python:
        entry["python"] = str(python_env(stage.requirements, cache))
    return entry


def default_cache(root: Path) -> Path:
    return Path(os.environ.get("CACHEWARM_SIM_IMAGES", root / ".cache" / "sim-images"))
