"""The warmer as the Job runs it: `python warm.py ...` in the image's working directory,
with the cache env, reporting a JSON summary in the termination-message file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

WARMER = Path(__file__).resolve().parents[2] / "operator" / "cachewarm" / "warmer.py"
DATA = Path(__file__).resolve().parents[1] / "data"


def warm(tmp_path: Path, *args: str, cache: Path | None = None, min_compile: str = "0") -> tuple[int, dict[str, Any], str]:
    summary = tmp_path / "termination-log"
    env = {**os.environ, "CACHEWARM_SUMMARY_FILE": str(summary),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": min_compile,
           "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # Run as a lone file, the way the init container ships it.
    lone = tmp_path / "warm.py"
    lone.write_text(WARMER.read_text())
    out = subprocess.run([sys.executable, str(lone), *args], cwd=DATA, env=env, capture_output=True,
                         text=True, timeout=300)
    return out.returncode, json.loads(summary.read_text()), out.stderr


def test_targets_are_compiled_into_the_cache_then_found(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code, first, log = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0, log
    assert first["entriesWritten"] == 1 and first["entriesFound"] == 0 and first["errors"] == []
    assert first["bytesWritten"] == sum(p.stat().st_size for p in cache.glob("*-cache"))
    assert "Compiled target=warm_targets:slow_targets" in log
    code, again, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=cache)
    assert code == 0
    assert again["entriesWritten"] == 0 and again["entriesFound"] == 1


def test_failing_target_exits_1_with_the_error(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:broken_targets", cache=tmp_path / "c")
    assert code == 1
    assert "TypeError" in summary["errors"][0]


@pytest.mark.parametrize("target", ["warm_targets:no_targets", "warm_targets:missing", "nosuchmodule:x"])
def test_nothing_compiled_is_a_failure(tmp_path: Path, target: str) -> None:
    code, summary, _ = warm(tmp_path, "targets", target, cache=tmp_path / "c")
    assert code in (1, 2)
    assert summary["programs"] == 0 and summary["errors"]


def test_without_cache_dir_nothing_is_cached_and_it_says_so(tmp_path: Path) -> None:
    code, summary, log = warm(tmp_path, "targets", "warm_targets:slow_targets")
    assert code == 2
    assert "JAX_COMPILATION_CACHE_DIR is not set" in log
    assert summary["errors"] == ["nothing was compiled or found in the cache"]


def test_programs_below_the_write_threshold_are_a_failure_not_a_success(tmp_path: Path) -> None:
    code, summary, _ = warm(tmp_path, "targets", "warm_targets:slow_targets", cache=tmp_path / "c", min_compile="1e9")
    assert code == 2
    assert summary["programs"] == 1 and summary["notCached"] == 1
    assert "none was written to or found in the cache" in summary["errors"][0]


def test_command_mode_runs_a_python_entrypoint_in_process(tmp_path: Path) -> None:
    script = tmp_path / "entry.py"
    script.write_text("import sys, jax, jax.numpy as jnp\n"
                      "print(jax.jit(lambda x: x * 2)(jnp.ones(3)))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "0", cache=tmp_path / "c")
    assert code == 0 and summary["mode"] == "command"
    assert summary["programs"] >= 1 and summary["entriesWritten"] >= 1
    code, summary, _ = warm(tmp_path, "command", "--", "python", str(script), "3", cache=tmp_path / "c")
    assert code == 1
    assert summary["errors"] == ["entrypoint exited with status 3"]
