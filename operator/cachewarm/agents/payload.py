"""The one list of files cachewarm ships into users' pods: their name in a pod, the module of
this folder each one is, and where the warmer image keeps them. The image's COPY lines
(warmer_image/Dockerfile, checked by tests/unit/test_layout.py), the boot ConfigMap's keys
and bytecode, the init containers' `cp` lists and the testbed's simulated warmer image all
read it. Imports nothing: the operator reads it, no pod does."""

from __future__ import annotations

from pathlib import Path
from typing import Final

SOURCE_DIR: Final = "/opt/cachewarm"  # in the warmer image

WARMER: Final = "warm.py"
COPIER: Final = "cachewarm_copier.py"
REPORTER: Final = "cachewarm_reporter.py"
SITECUSTOMIZE: Final = "sitecustomize.py"
BUSYBOX: Final = "busybox"  # static, from the image's base stage: not a module of ours

# Shipped name -> this folder's module. Also the boot ConfigMap's keys, in this order. A pod's
# volume lists its keys, so a pod admitted before a release that adds a file never gets that
# file, while the kubelet does update the files it lists (sitecustomize.py among them): a
# file added here must be one the others do without.
MODULES: Final = {SITECUSTOMIZE: "sitecustomize.py", COPIER: "copier.py", REPORTER: "reporter.py",
                  WARMER: "warmer.py"}

# What the reporter's init container copies into a training pod, in this order.
REPORTER_COPY: Final = (REPORTER, SITECUSTOMIZE, WARMER, BUSYBOX)


def in_image(name: str) -> str:
    """Where the warmer image keeps a shipped file."""
    return f"{SOURCE_DIR}/{name}"


def source(name: str) -> Path:
    """The file in this checkout (or installed package) that ships as `name`."""
    return Path(__file__).resolve().parent / MODULES[name]
