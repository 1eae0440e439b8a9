"""Test tooling: the warmer run as a local process the way its init container ships it (a
lone copy of operator/cachewarm/warmer.py, run by the image's python in the image's
working directory, with the cache env), for tests that need what a warmer writes or
refreshes without a Job and a node agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachewarm_testbed.cluster import repo_root


def run_warmer(workdir: Path, args: Sequence[str], *, env: Mapping[str, str], cwd: Path,
               timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """Run `warm.py ARGS` with `env` over this process's environment. Returns the exit
    status, the JSON summary it wrote for the termination message, and its stderr."""
    summary = workdir / "termination-log"
    lone = workdir / "warm.py"
    lone.write_text((repo_root() / "operator" / "cachewarm" / "warmer.py").read_text())
    out = subprocess.run([sys.executable, str(lone), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **env, "CACHEWARM_SUMMARY_FILE": str(summary)})
    return out.returncode, json.loads(summary.read_text()), out.stderr
