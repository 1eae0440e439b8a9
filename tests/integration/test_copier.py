"""The copier (issue 14's local copy, the part that runs in the pod) against the GCS
emulator behind its fidelity proxy, over HTTP as in a pod: it copies the manifest's
entries and nothing else, checks each against GCS's MD5 and renames it into place,
retries 503s, keeps to its byte budget, and never fails the pod, not even with the
bucket out of reach. Run as the init container runs it: `python copier.py`, settings in
the environment, with the standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm import copier
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.processes import free_port

pytestmark = pytest.mark.integration

COPIER = Path(copier.__file__)


def entry(program: str, seed: str) -> str:
    return f"{program}-{hashlib.sha256(seed.encode()).hexdigest()}-cache"


def fill(gcs: storage.Client) -> tuple[str, dict[str, bytes]]:
    """A bucket with five entries under jax/ (sizes 100..500 bytes), an atime file, someone
    else's object and an entry in a sub-folder (another cache's)."""
    bucket = f"copy-{uuid.uuid4().hex[:8]}"
    gcs.create_bucket(bucket, location="us-central1")
    objects = {f"jax/{entry(f'jit_p{i}', str(i))}": os.urandom(100 * (i + 1)) for i in range(5)}
    others = {f"jax/{entry('jit_p0', '0').removesuffix('-cache')}-atime": b"1", "jax/README": b"not ours",
              f"jax/sub/{entry('jit_x', 'x')}": b"another cache's"}
    for name, data in {**objects, **others}.items():
        gcs.bucket(bucket).blob(name).upload_from_string(data)
    return bucket, objects


def run_copier(env: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEWARM_", "STORAGE_EMULATOR_HOST"))}
    out = subprocess.run([sys.executable, "-S", str(COPIER)], env={**clean, **env}, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr  # never fails the pod
    return dict(json.loads(out.stdout.strip().splitlines()[-1])["cachewarm-copier"])


def key(name: str) -> str:
    return name.rsplit("-", 2)[1][:16]


def test_the_manifests_entries_are_copied_checked_and_nothing_else(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    listed = list(copier.Client(storage_bed.storage_emulator_host, lambda: None).list(bucket, "jax/"))
    assert all(o.get("md5Hash") for o in listed)  # what the check relies on, as GCS lists it
    wanted = sorted(objects)[:3]
    dest = tmp_path / "cache"
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    # The first two downloads of one entry fail with 503: retried, still copied.
    proxy.faults([{"method": "GET", "path": f"/download/.*{wanted[0].rsplit('/', 1)[1]}", "status": 503,
                   "times": 2}])
    try:
        summary = run_copier({"STORAGE_EMULATOR_HOST": storage_bed.storage_emulator_host,
                              "CACHEWARM_COPY_BUCKET": bucket, "CACHEWARM_COPY_PREFIX": "jax",
                              "CACHEWARM_COPY_DEST": str(dest), "CACHEWARM_COPY_KEYS": ",".join(map(key, wanted))})
    finally:
        proxy.clear_faults()
    assert (summary["source"], summary["copied"], summary["failed"], summary["cold"]) == ("manifest", 3, 0, False)
    # Listed with matchGlob: the sub-folder's entry is not even listed; README and atime are.
    assert summary["leftOut"] == {"notAnEntry": 2, "notInManifest": 2, "overBudget": 0}
    assert sorted(p.name for p in dest.iterdir()) == sorted(n.rsplit("/", 1)[1] for n in wanted)
    for name in wanted:
        assert (dest / name.rsplit("/", 1)[1]).read_bytes() == objects[name]


def test_a_corrupt_download_is_never_renamed_into_place(tmp_path: Path, storage_bed: Testbed,
                                                      storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    client = copier.Client(storage_bed.storage_emulator_host, lambda: None)
    [obj] = [o for o in client.list(bucket, "jax/") if o["name"] == sorted(objects)[0]]
    changed = {**obj, "md5Hash": "AAAAAAAAAAAAAAAAAAAAAA=="}  # as if the object changed under us
    with pytest.raises(copier.CopyError, match="MD5"):
        client.download(bucket, changed, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # neither the entry nor a partial file


def test_without_a_manifest_the_prefix_is_copied_within_the_byte_budget(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    summary = run_copier({"STORAGE_EMULATOR_HOST": storage_bed.storage_emulator_host,
                          "CACHEWARM_COPY_BUCKET": bucket, "CACHEWARM_COPY_PREFIX": "jax/",
                          "CACHEWARM_COPY_DEST": str(tmp_path / "cache"), "CACHEWARM_COPY_MAX_BYTES": "650"})
    # Smallest first: 100 + 200 + 300 bytes fit in 650, 400 and 500 do not.
    assert (summary["source"], summary["copied"], summary["bytes"]) == ("prefix", 3, 600)
    assert summary["leftOut"]["overBudget"] == 2


def test_the_bucket_out_of_reach_is_a_cold_start_not_a_failure(tmp_path: Path) -> None:
    summary = run_copier({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}",
                          "CACHEWARM_COPY_BUCKET": "gone", "CACHEWARM_COPY_DEST": str(tmp_path / "cache")},
                         timeout=60)
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"]
    assert list((tmp_path / "cache").iterdir()) == []


def test_bad_settings_are_a_cold_start_too(tmp_path: Path) -> None:
    summary = run_copier({"CACHEWARM_COPY_DEST": str(tmp_path)})  # no bucket
    assert summary["cold"] is True and "CACHEWARM_COPY_BUCKET" in summary["errors"][0]
