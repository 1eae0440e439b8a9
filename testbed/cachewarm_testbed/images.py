"""Images from our Dockerfiles, built without a Docker daemon, for the real node.

buildah (Debian's) builds `Dockerfile` (the operator), `warmer_image/Dockerfile`,
`demo/Dockerfile` (the demo's training image with jax) and `demo/torch/Dockerfile` (the
torch demo's, 5.4 GB: only callers that ask for it get its archive) in a private store under
`.cache/images/` (vfs driver, chroot isolation: no daemon, no mounts left behind; its run
state in /run is removed after each build), and
exports each as an OCI archive that the real node's containerd imports
(`RealNode.import_images`). No registry is reachable here, so the bases are made on this
machine and passed as the Dockerfiles' base build arguments (whose defaults are the public
images a user builds from): a Debian bookworm rootfs with python3 and pip by `mmdebstrap`,
and busybox-static as a one-layer image (cachewarm_testbed.realnode).

Everything is cached by content: an archive's name carries the hash of its Dockerfile, of
every file the build copies, of its base's key, of its build args and of buildah's version,
so a second run with nothing changed runs no build at all. RUN steps reach PyPI through the
host's network with the host's CA bundle mounted read-only (the sandbox intercepts TLS).

The images keep the names a user's manifests use (IMAGES), so `kubectl apply -k manifests/`
finds them in containerd without rewriting anything.

Run: python -m cachewarm_testbed.images build
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cachewarm.agents import payload
from cachewarm_testbed.processes import StartError
from cachewarm_testbed.realnode import BUSYBOX, busybox_layer, oci_archive

OPERATOR_IMAGE = "docker.io/cachewarm/operator:0.1.0"
WARMER_IMAGE = "docker.io/cachewarm/warmer:0.1.0"
# The name pods use: CRI normalizes it to docker.io/cachewarm/demo-train:0.1.0.
TRAIN_IMAGE = "cachewarm/demo-train:0.1.0"
# The torch demo's training image (demo/torch/Dockerfile, issue 31): torch and g++, ~5.4 GB.
TORCH_TRAIN_IMAGE = "cachewarm/demo-torch:0.1.0"
# The same without any GCS library (demo/Dockerfile's stage `plain`): pods with a local copy.
PLAIN_TRAIN_IMAGE = "cachewarm/demo-train-plain:0.1.0"
PYTHON_BASE = "localhost/cachewarm-base/python"
BUSYBOX_BASE = "localhost/cachewarm-base/busybox"
RUNROOT_PARENT = Path("/run")
SUITE = "bookworm"
# The python base: Debian's python3 (3.11, as python:3.11-slim) and pip, made to look like
# the official image where our Dockerfiles lean on it (python and pip on PATH, pip allowed
# to install system-wide, libstdc++ as jaxlib needs and python:3.11-slim has).
MMDEBSTRAP = ["--variant=essential", "--include=python3,python3-pip,passwd,ca-certificates,libstdc++6"]
# The full python image's part that torch's Inductor needs at run time: a C++ compiler (and
# python's headers, which its C++ kernels include), as python:3.11 (not -slim) has.
CXX_PACKAGES = "g++,python3-dev"
PYTHON_HOOK = ('rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; ln -sf python3 "$1"/usr/bin/python; '
               'ln -sf pip3 "$1"/usr/bin/pip; rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* '
               '"$1"/usr/share/doc "$1"/usr/share/man')


@dataclass(frozen=True)
class Build:
    """One image: its Dockerfile, the files its build copies (the whole context), the
    base it takes as a build argument."""

    ref: str
    dockerfile: str
    context: tuple[str, ...]
    base_arg: str
    base: str  # "python", "python-cxx" (python with g++) or "busybox"
    target: str = ""  # the Dockerfile's stage to build ("": its last)
    # Built by `make images` but given only to callers that ask for it (build_all(torch=True)):
    # the torch image is 5.4 GB, which every real node would otherwise import.
    torch: bool = False


BUILDS = (
    Build(OPERATOR_IMAGE, "Dockerfile", ("pyproject.toml", "README.md", "operator"), "PYTHON_IMAGE", "python"),
    Build(WARMER_IMAGE, "warmer_image/Dockerfile", tuple(f"operator/cachewarm/agents/{m}" for m in payload.MODULES.values()),
          "BUSYBOX_IMAGE", "busybox"),
    Build(f"docker.io/{TRAIN_IMAGE}", "demo/Dockerfile", ("demo/train.py", "demo/programs.py"), "PYTHON_IMAGE", "python"),
    Build(f"docker.io/{PLAIN_TRAIN_IMAGE}", "demo/Dockerfile", ("demo/train.py", "demo/programs.py"), "PYTHON_IMAGE",
          "python", target="plain"),
    Build(f"docker.io/{TORCH_TRAIN_IMAGE}", "demo/torch/Dockerfile", ("demo/torch/train_torch.py",), "PYTHON_IMAGE",
          "python-cxx", torch=True),
)


def _files(root: Path, paths: tuple[str, ...]) -> list[Path]:
    """Every file under `paths` (relative to root), sorted, without caches of ours."""
    out: list[Path] = []
    for rel in paths:
        path = root / rel
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out += [p for p in candidates if "__pycache__" not in p.parts and not p.name.endswith(".pyc")
                and ".egg-info" not in str(p)]
    return sorted(out)


def build_key(root: Path, build: Build, base_key: str, tool_version: str) -> str:
    """The content hash of one image's build: Dockerfile, copied files (names and bytes),
    base key, build args and buildah's version."""
    h = hashlib.sha256()
    for part in (build.ref, build.base_arg, base_key, tool_version, build.target):
        h.update(part.encode() + b"\0")
    for path in [root / build.dockerfile, *_files(root, build.context)]:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class Builder:
    """buildah with a private store; `build_all()` returns ref -> OCI archive."""

    def __init__(self, root: Path, cache: Path | None = None) -> None:
        self.root = root
        self.cache = cache or root / ".cache" / "images"
        self.store = self.cache / "storage"
        # buildah's run state, one per store: two checkouts building at once share nothing.
        self.runroot = RUNROOT_PARENT / f"cachewarm-buildah-{hashlib.sha256(str(self.store.resolve()).encode()).hexdigest()[:12]}"
        self.timings: dict[str, float] = {}

    def buildah(self, *args: str, step: str, timeout: float = 1800) -> str:
        argv = ["buildah", f"--root={self.store}", f"--runroot={self.runroot}", "--storage-driver=vfs", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise StartError(f"{step} failed (buildah {args[0]}, exit {result.returncode}):\n"
                             f"{_tail(result.stdout + result.stderr)}")
        return result.stdout

    def _preflight(self) -> str:
        missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
        if missing:
            raise StartError(f"building images needs {', '.join(missing)}: run `make node-deps` (Debian packages)")
        if os.geteuid() != 0:
            raise StartError("building images with buildah and mmdebstrap here needs root")
        return subprocess.run(["buildah", "--version"], capture_output=True, text=True, check=True).stdout.strip()

    def _has(self, name: str) -> bool:
        return subprocess.run(["buildah", f"--root={self.store}", f"--runroot={self.runroot}", "--storage-driver=vfs",
                               "inspect", "--type=image", name], capture_output=True).returncode == 0

    def python_base(self, tool_version: str, base: str = "python") -> tuple[str, str]:
        """(image name, key) of the Debian python base (`python-cxx`: with g++), made once per key."""
        key = self._base_key(base, tool_version)
        name = f"{PYTHON_BASE}{'-cxx' if base == 'python-cxx' else ''}:{key}"
        if self._has(name):
            return name, key
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="cachewarm-base-") as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            result = subprocess.run(["mmdebstrap", "--quiet", "--mode=root", *self._mmdebstrap(base),
                                     f"--customize-hook={PYTHON_HOOK}", SUITE, str(rootfs)],
                                    capture_output=True, text=True, timeout=1800)
            if result.returncode != 0:
                raise StartError(f"mmdebstrap (python base) failed, exit {result.returncode}:\n"
                                 f"{_tail(result.stdout + result.stderr)}")
            container = self.buildah("from", "scratch", step="python base").strip()
            try:
                self.buildah("add", container, str(rootfs), "/", step="python base (add rootfs)")
                self.buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                             "--env", "LANG=C.UTF-8", "--cmd", "python3", container, step="python base (config)")
                self.buildah("commit", "--quiet", container, name, step="python base (commit)")
            finally:
                self.buildah("rm", container, step="python base (rm)")
        self.timings[f"{base}-base"] = round(time.monotonic() - t0, 1)
        return name, key

    def busybox_base(self, tool_version: str) -> tuple[str, str]:
        """(image name, key) of the busybox-static base, made once per key."""
        key = self._base_key("busybox", tool_version)
        name = f"{BUSYBOX_BASE}:{key}"
        if self._has(name):
            return name, key
        applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
        with tempfile.TemporaryDirectory(prefix="cachewarm-base-") as tmp:
            archive = Path(tmp) / "busybox.tar"
            with open(archive, "wb") as out:
                oci_archive(name, busybox_layer(BUSYBOX.read_bytes(), applets),
                            {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]}, out)
            image_id = self.buildah("pull", "--quiet", f"oci-archive:{archive}", step="busybox base (pull)").strip()
            self.buildah("tag", image_id.splitlines()[-1], name, step="busybox base (tag)")
        return name, key

    def build_all(self, torch: bool = False) -> dict[str, Path]:
        """Build (or find in the cache) every image of BUILDS (the torch image only with
        `torch`); ref -> OCI archive."""
        tool_version = self._preflight()
        self.cache.mkdir(parents=True, exist_ok=True)
        bases: dict[str, tuple[str, str]] = {}
        out: dict[str, Path] = {}
        try:
            for build in BUILDS:
                if build.torch and not torch:
                    continue
                archive_name = build.ref.rsplit("/", 1)[1].replace(":", "-")
                if build.base not in bases:
                    # Computing the key needs no build; the base is made only if an archive is missing.
                    bases[build.base] = ("", self._base_key(build.base, tool_version))
                key = build_key(self.root, build, bases[build.base][1], tool_version)
                archive = self.cache / f"{archive_name}-{key}.tar"
                if archive.is_file():
                    out[build.ref] = archive
                    continue
                if not bases[build.base][0]:
                    bases[build.base] = (self.python_base(tool_version, build.base) if build.base.startswith("python")
                                         else self.busybox_base(tool_version))
                t0 = time.monotonic()
                self._build(build, bases[build.base][0], archive)
                self.timings[build.ref] = round(time.monotonic() - t0, 1)
                for old in self.cache.glob(f"{archive_name}-*.tar"):
                    if old != archive:
                        old.unlink()
                out[build.ref] = archive
        finally:
            # buildah's run state, also after a failed build: nothing of ours stays in /run.
            shutil.rmtree(self.runroot, ignore_errors=True)
        return out

    @staticmethod
    def _mmdebstrap(base: str) -> list[str]:
        return MMDEBSTRAP[:-1] + [f"{MMDEBSTRAP[-1]},{CXX_PACKAGES}"] if base == "python-cxx" else MMDEBSTRAP

    def _base_key(self, base: str, tool_version: str) -> str:
        if base.startswith("python"):
            # The plain python base's key is what it was before python-cxx existed (no rebuild).
            return hashlib.sha256(json.dumps([SUITE, self._mmdebstrap(base), PYTHON_HOOK, tool_version]).encode()
                                  ).hexdigest()[:16]
        return hashlib.sha256(BUSYBOX.read_bytes() + tool_version.encode()).hexdigest()[:16]

    def _build(self, build: Build, base: str, archive: Path) -> None:
        """buildah bud in a context holding only the files the build copies."""
        with tempfile.TemporaryDirectory(prefix="cachewarm-context-") as tmp:
            context = Path(tmp)
            for path in [self.root / build.dockerfile, *_files(self.root, build.context)]:
                dest = context / path.relative_to(self.root)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
            self.buildah(
                "bud", "--quiet", "--isolation=chroot", "--network=host", "--pull=never", "--layers=false",
                "--volume=/etc/ssl/certs:/etc/ssl/certs:ro", f"--build-arg={build.base_arg}={base}",
                *([f"--target={build.target}"] if build.target else []),
                f"--file={context / build.dockerfile}", f"--tag={build.ref}", str(context),
                step=f"building {build.ref} from {build.dockerfile}")
        tmp_archive = archive.with_suffix(".partial")
        tmp_archive.unlink(missing_ok=True)
        self.buildah("push", "--quiet", build.ref, f"oci-archive:{tmp_archive}:{build.ref}",
                     step=f"exporting {build.ref}")
        tmp_archive.rename(archive)
        # The archive is the cache; the store keeps only the bases.
        self.buildah("rmi", build.ref, step=f"removing {build.ref} from the build store")


def build_all(root: Path | None = None, *, torch: bool = False) -> dict[str, Path]:
    """Every image's OCI archive (built when its content changed), the torch image's only
    with `torch`. Raises StartError."""
    from cachewarm_testbed.cluster import repo_root
    return Builder(root or repo_root()).build_all(torch=torch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--skip-without-root", action="store_true",
                        help="say so and exit 0 when not root (`make test` then skips the real-node tests)")
    args = parser.parse_args()
    if args.skip_without_root and os.geteuid() != 0:
        print("warning: building images needs root (buildah, mmdebstrap); the real-node tests will skip", file=sys.stderr)
        return
    from cachewarm_testbed.cluster import repo_root
    builder = Builder(repo_root())
    t0 = time.monotonic()
    try:
        archives = builder.build_all(torch=True)
    except StartError as exc:
        sys.exit(f"error: {exc}")
    for ref, archive in archives.items():
        print(f"{ref}  {archive}  {archive.stat().st_size / 2**20:.0f} MiB")
    print(f"built: {builder.timings or 'nothing (all cached)'}; {time.monotonic() - t0:.1f}s in all")


if __name__ == "__main__":
    main()
