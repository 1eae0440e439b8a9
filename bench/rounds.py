"""Shared by the benchmarks that compare two sides within one run: the order of the sides
in each round (A B, then B A, ...: load that drifts during the run hits both alike), the
per-round paired ratios and their median, min and max, and the operator of another git
revision (the baseline), unpacked beside this tree without touching its checkout."""

from __future__ import annotations

import io
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def order(round_index: int, sides: Sequence[str]) -> list[str]:
    """The sides in round `round_index`: as given in even rounds, reversed in odd ones."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def paired(measured: Sequence[float], baseline: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """measured[i] / baseline[i] for each round i (rounds where the baseline is 0 are left
    out), with their median, min and max."""
    ratios = [m / b for m, b in zip(measured, baseline, strict=True) if b]
    if not ratios:
        return {"ratios": [], "median": None, "min": None, "max": None}
    return {"ratios": [round(r, digits) for r in ratios], "median": round(statistics.median(ratios), digits),
            "min": round(min(ratios), digits), "max": round(max(ratios), digits)}


def difference(measured: Sequence[float], baseline: Sequence[float], scale: float = 1000.0,
               digits: int = 1) -> dict[str, Any]:
    """(measured[i] - baseline[i]) * scale for each round i (milliseconds from seconds by
    default), with their median, min and max."""
    diffs = [(m - b) * scale for m, b in zip(measured, baseline, strict=True)]
    return {"differences": [round(d, digits) for d in diffs], "median": round(statistics.median(diffs), digits),
            "min": round(min(diffs), digits), "max": round(max(diffs), digits)}


def unpack(rev: str, paths: Sequence[str] = ("operator", "manifests", "crds")) -> tuple[Path, str]:
    """`paths` of git revision `rev` of this repository, extracted (git archive) into a new
    temporary directory; returns it and the revision's full hash. The operator there runs
    with PYTHONPATH=<dir>/operator (before the venv's editable path to this tree)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit, *paths],
                             capture_output=True, check=True).stdout
    where = Path(tempfile.mkdtemp(prefix=f"cachewarm-{commit[:8]}-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    return where, commit


def imported_from(pythonpath: str | None) -> str:
    """Where `import cachewarm` resolves with PYTHONPATH=`pythonpath` (None: this tree's),
    in a fresh interpreter: proof that a side runs the code it names."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", "import cachewarm; print(cachewarm.__file__)"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
