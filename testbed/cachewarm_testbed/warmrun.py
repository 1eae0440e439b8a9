"""Test tooling: the warmer run as a local process the way its init container ships it (a
lone copy of operator/cachewarm/agents/warmer.py, run by the image's python in the image's
working directory, with the cache env), for tests that need what a warmer writes or
refreshes without a Job and a node agent. Its environment is only what the caller gives
it (plus PATH and HOME): nothing of the test runner's own environment reaches it, as
nothing of a node's reaches a warmer's container."""

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
    """Run `warm.py ARGS` with exactly `env` (plus PATH and HOME, unless `env` sets them,
    and the summary file's path). Returns the exit status, the JSON summary it wrote for
    the termination message, and its stderr."""
    summary = workdir / "termination-log"
    lone = workdir / "warm.py"
    lone.write_text((repo_root() / "operator" / "cachewarm" / "agents" / "warmer.py").read_text())
    out = subprocess.run([sys.executable, str(lone), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=warmer_env(env, summary))
    return out.returncode, json.loads(summary.read_text()), out.stderr


def warmer_env(env: Mapping[str, str], summary: Path) -> dict[str, str]:
    """The warmer's whole environment: PATH and HOME of this process (a python needs a
    PATH; libraries look under HOME), then `env`, then the summary file's path."""
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return {**base, **env, "CACHEWARM_SUMMARY_FILE": str(summary)}
