"""The copier (issue 14's local copy, the part that runs in the pod) against the GCS
emulator behind its fidelity proxy, over HTTP as in a pod: it copies the union of the
pools' manifests' entries and nothing else (every entry under the prefix when a manifest is
missing or corrupt, and says so), checks each against GCS's MD5 and renames it into place,
keeps what is already there, retries 503s, keeps to its byte budget, shares a directory
with another copier running at once, writes its summary file, and never fails the pod, not
even with the bucket out of reach. Run as the init container runs it: `python -I -S
copier.py`, settings in the environment, with the standard library only."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
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
MANIFESTS = "jax/.cachewarm/pools/team-a/llama"


def entry(program: str, seed: str) -> str:
    return f"{program}-{hashlib.sha256(seed.encode()).hexdigest()}-cache"


def base(name: str) -> str:
    return name.rsplit("/", 1)[1]


def fill(gcs: storage.Client, size: int = 100) -> tuple[str, dict[str, bytes]]:
    """A bucket with five entries under jax/ (sizes 1..5 × `size` bytes), an atime file,
    someone else's object and an entry in a sub-folder (another cache's)."""
    bucket = f"copy-{uuid.uuid4().hex[:8]}"
    gcs.create_bucket(bucket, location="us-central1")
    objects = {f"jax/{entry(f'jit_p{i}', str(i))}": os.urandom(size * (i + 1)) for i in range(5)}
    others = {f"jax/{entry('jit_p0', '0').removesuffix('-cache')}-atime": b"1", "jax/README": b"not ours",
              f"jax/sub/{entry('jit_x', 'x')}": b"another cache's"}
    for name, data in {**objects, **others}.items():
        gcs.bucket(bucket).blob(name).upload_from_string(data)
    return bucket, objects


def manifest(gcs: storage.Client, bucket: str, pool: str, names: list[str], data: bytes | None = None) -> str:
    """A pool's manifest as its warmer writes it (or `data` instead); returns its name."""
    name = f"{MANIFESTS}/{pool}.json"
    doc = {"version": 1, "pool": pool, "entries": [{"name": base(n), "size": 1} for n in names],
           "fingerprint": {"jaxlib": "0.0"}, "writtenTime": "2026-01-01T00:00:00Z"}
    gcs.bucket(bucket).blob(name).upload_from_string(data if data is not None else json.dumps(doc).encode())
    return name


def env_for(bed: Testbed, bucket: str, dest: Path, **settings: str) -> dict[str, str]:
    """The copier's settings: CACHEWARM_COPY_<NAME> for each of `settings`."""
    return {"STORAGE_EMULATOR_HOST": bed.storage_emulator_host, "CACHEWARM_COPY_BUCKET": bucket,
            "CACHEWARM_COPY_PREFIX": "jax", "CACHEWARM_COPY_DEST": str(dest),
            **{f"CACHEWARM_COPY_{k.upper()}": v for k, v in settings.items()}}


def process_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without its copier settings, with `settings`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEWARM_", "STORAGE_EMULATOR_HOST"))}
    return {**clean, **settings}


def summary_of(stdout: str) -> dict[str, Any]:
    return dict(json.loads(stdout.strip().splitlines()[-1])["cachewarm-copier"])


def run_copier(settings: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-I", "-S", str(COPIER)], env=process_env(settings), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr  # never fails the pod
    return summary_of(out.stdout)


def downloads(proxy: ProxyControl, name: str) -> int:
    return sum(1 for r in proxy.log() if r["method"] == "GET" and r["path"].startswith("/download/")
               and r["path"].endswith(base(name)) and r["status"] == 200)


def test_the_union_of_the_pools_manifests_is_copied_checked_and_nothing_else(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    listed = list(copier.Client(storage_bed.storage_emulator_host, lambda: None).list(bucket, "jax/"))
    assert all(o.get("md5Hash") for o in listed)  # what the check relies on, as GCS lists it
    p0, p1, p2, p3, p4 = sorted(objects)
    gone = f"jax/{entry('jit_gone', 'gone')}"  # a warm's entry evicted since: not in the bucket
    h100 = manifest(storage_only, bucket, "h100", [p0, p1])
    v5p = manifest(storage_only, bucket, "v5p", [p1, p3, gone])
    dest, summary_file = tmp_path / "cache", tmp_path / "report" / "copier.json"
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    # The first two downloads of one entry and the first read of a manifest fail with 503: retried.
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(p0)}", "status": 503, "times": 2},
                  {"method": "GET", "path": "/download/.*v5p.json", "status": 503, "times": 1}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, dest, manifests=f"{h100}, {v5p}",
                                     summary=str(summary_file)))
    finally:
        proxy.clear_faults()
    assert {k: summary[k] for k in ("source", "wanted", "copied", "present", "failed", "cold", "errors")} == {
        "source": "manifest", "wanted": 3, "copied": 3, "present": 0, "failed": 0, "cold": False, "errors": []}
    assert summary["bytes"] == sum(len(objects[n]) for n in (p0, p1, p3))
    # Listed with matchGlob: the sub-folder's entry and the manifests are not even listed; README and atime are.
    assert summary["leftOut"] == {"notAnEntry": 2, "notInManifest": 2, "notInBucket": 1, "overBudget": 0}
    assert "manifestsMissing" not in summary and "manifestError" not in summary
    assert sorted(p.name for p in dest.iterdir()) == sorted(base(n) for n in (p0, p1, p3))
    for name in (p0, p1, p3):
        assert (dest / base(name)).read_bytes() == objects[name]
    # The summary file: the same summary, for the pod's reporter, and nothing else left beside it.
    assert json.loads(summary_file.read_text()) == summary
    assert [p.name for p in summary_file.parent.iterdir()] == ["copier.json"]


def test_a_missing_manifest_means_the_whole_prefix_within_the_budget(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    h100 = manifest(storage_only, bucket, "h100", sorted(objects)[4:])  # the 500-byte entry only
    missing = f"{MANIFESTS}/v5p.json"  # that pool's warmer has not written one (yet)
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=f"{h100},{missing}", max_bytes="650"))
    # Every entry under the prefix, smallest first: 100 + 200 + 300 bytes fit in 650, 400 and 500 do not.
    assert (summary["source"], summary["manifestsMissing"], summary["wanted"], summary["copied"], summary["bytes"],
            summary["cold"]) == ("prefix", [missing], 3, 3, 600, False)
    assert summary["leftOut"] == {"notAnEntry": 2, "notInManifest": 0, "notInBucket": 0, "overBudget": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(base(n) for n in sorted(objects)[:3])


@pytest.mark.parametrize("data", [b'{"version": 1, "entries": [{"na', b'{"version": 1, "entries": ["jit_p0"]}'],
                         ids=["cut-short", "wrong-shape"])
def test_a_corrupt_manifest_means_the_whole_prefix(
        data: bytes, tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    h100 = manifest(storage_only, bucket, "h100", sorted(objects)[:1])
    v5p = manifest(storage_only, bucket, "v5p", [], data=data)
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=f"{h100},{v5p}"))
    assert (summary["source"], summary["copied"], summary["cold"]) == ("prefix", 5, False)
    assert v5p in summary["manifestError"] and "manifestsMissing" not in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(base(n) for n in objects)


def test_entries_already_there_are_kept_not_downloaded_again(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    p0, p1, *_ = sorted(objects)
    # p0 is there with GCS's size (another pod on the node copied it): kept as it is, even
    # with other bytes (the proof that it was not downloaded again). p1 is there with
    # another size: not the entry, copied again.
    kept = os.urandom(len(objects[p0]))
    (tmp_path / base(p0)).write_bytes(kept)
    (tmp_path / base(p1)).write_bytes(b"short")
    # A partial file of a copier killed two hours ago is removed; one being written now is not.
    (tmp_path / f"{copier.PARTIAL}1-dead-0").write_bytes(b"x")
    os.utime(tmp_path / f"{copier.PARTIAL}1-dead-0", (time.time() - 7200, time.time() - 7200))
    (tmp_path / f"{copier.PARTIAL}1-live-0").write_bytes(b"x")
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, max_bytes=str(100 + 200 + 300)))
    assert (summary["wanted"], summary["present"], summary["presentBytes"], summary["copied"], summary["bytes"],
            summary["leftOut"]["overBudget"]) == (3, 1, 100, 2, 500, 2)  # the present entry counts in the budget
    assert (downloads(proxy, p0), downloads(proxy, p1)) == (0, 1)
    assert (tmp_path / base(p0)).read_bytes() == kept
    assert (tmp_path / base(p1)).read_bytes() == objects[p1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(copier.PARTIAL)) == [
        f"{copier.PARTIAL}1-live-0"]


def test_two_copiers_into_one_directory_at_once_both_succeed_with_whole_entries_only(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    # Entries of 1..5 MiB, downloaded by both at once (16 workers each): the two write the
    # same entries at about the same time, as two pods starting on one node with a hostPath do.
    bucket, objects = fill(storage_only, size=1 << 20)
    env = process_env(env_for(storage_bed, bucket, tmp_path))
    both = [subprocess.Popen([sys.executable, "-I", "-S", str(COPIER)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], results
    summaries = [summary_of(out) for out, _ in results]
    for summary in summaries:
        assert (summary["wanted"], summary["copied"] + summary["present"], summary["failed"], summary["errors"],
                summary["cold"]) == (5, 5, 0, [], False), summary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(base(n) for n in objects)  # no partial file left
    for name, data in objects.items():
        assert (tmp_path / base(name)).read_bytes() == data


class Lockstep(copier.Client):
    """A client whose every entry download, once its partial file is open, waits at
    `barrier` for the other copier's download: with one worker each and the same plan, the
    two write the same entry at the very same time."""

    def __init__(self, endpoint: str, barrier: threading.Barrier) -> None:
        super().__init__(endpoint, lambda: None)
        self.barrier = barrier

    def _open(self, url: str) -> Any:
        answer = super()._open(url)
        if "-cache?" not in url:
            return answer
        barrier = self.barrier

        class Held:
            waited = False

            def __enter__(self) -> Held:
                return self

            def __exit__(self, *_: object) -> None:
                answer.close()

            def read(self, n: int = -1) -> bytes:
                if not self.waited:  # the partial file is open by now
                    self.waited = True
                    barrier.wait(timeout=30)
                return bytes(answer.read(n))
        return Held()


def test_two_copiers_writing_the_same_entry_at_the_same_instant_do_not_share_a_partial_file(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    # Two copiers in one process, so with one pid, as two pods' init containers (pid 1 each).
    bucket, objects = fill(storage_only)
    settings = copier.Settings(bucket=bucket, prefix="jax/", dest=str(tmp_path), manifests=(), max_bytes=1 << 30,
                               workers=1, deadline_seconds=60, endpoint=storage_bed.storage_emulator_host)
    barrier = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        summaries = list(pool.map(lambda _: copier.run(settings, Lockstep(settings.endpoint, barrier)), range(2)))
    for summary in summaries:
        assert (summary["copied"], summary["failed"], summary["errors"]) == (5, 0, []), summary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(base(n) for n in objects)
    for name, data in objects.items():
        assert (tmp_path / base(name)).read_bytes() == data


def test_a_corrupt_download_is_never_renamed_into_place(tmp_path: Path, storage_bed: Testbed,
                                                      storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    client = copier.Client(storage_bed.storage_emulator_host, lambda: None)
    [obj] = [o for o in client.list(bucket, "jax/") if o["name"] == sorted(objects)[0]]
    changed = {**obj, "md5Hash": "AAAAAAAAAAAAAAAAAAAAAA=="}  # as if the object changed under us
    with pytest.raises(copier.CopyError, match="MD5"):
        client.download(bucket, changed, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # neither the entry nor a partial file


def test_without_manifests_the_prefix_is_copied_and_cold_only_when_nothing_could_be(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    # One entry refused for good (403, not retried): the rest copied, not a cold start.
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(sorted(objects)[2])}", "status": 403}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path / "some", manifests=""))
    finally:
        proxy.clear_faults()
    assert (summary["source"], summary["wanted"], summary["copied"], summary["failed"], summary["cold"]) == (
        "prefix", 5, 4, 1, False)
    assert "HTTP 403" in summary["errors"][0]
    # Every download refused (of 7 entries now): nothing copied because something went
    # wrong, a cold start; the errors are capped at 5.
    for extra in ("5", "6"):
        storage_only.bucket(bucket).blob(f"jax/{entry('jit_q', extra)}").upload_from_string(b"q" * 50)
    proxy.faults([{"method": "GET", "path": "/download/", "status": 403, "times": 100}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path / "none"))
    finally:
        proxy.clear_faults()
    assert (summary["wanted"], summary["copied"], summary["failed"], summary["cold"]) == (7, 0, 7, True)
    assert len(summary["errors"]) == 5 and all(len(e) <= 300 for e in summary["errors"])
    # The same into the first directory: 4 entries there already, so not a cold start.
    proxy.faults([{"method": "GET", "path": "/download/", "status": 403, "times": 100}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path / "some"))
    finally:
        proxy.clear_faults()
    assert (summary["wanted"], summary["present"], summary["copied"], summary["failed"], summary["cold"]) == (
        7, 4, 0, 3, False)
    # An empty prefix: nothing wanted, nothing wrong, not cold.
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "empty", prefix="nothing-here"))
    assert (summary["wanted"], summary["cold"], summary["errors"]) == (0, False, [])


def test_the_bucket_out_of_reach_is_a_cold_start_not_a_failure(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    summary = run_copier({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}",
                          "CACHEWARM_COPY_BUCKET": "gone", "CACHEWARM_COPY_DEST": str(tmp_path / "cache"),
                          "CACHEWARM_COPY_MANIFESTS": "jax/.cachewarm/pools/a/b/c.json",
                          "CACHEWARM_COPY_SUMMARY": str(summary_file)}, timeout=60)
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"]
    assert summary["source"] == "prefix" and "manifestError" in summary  # unreadable, then the listing failed
    assert list((tmp_path / "cache").iterdir()) == []
    assert json.loads(summary_file.read_text()) == summary


def test_bad_settings_are_a_cold_start_too(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    summary = run_copier({"CACHEWARM_COPY_DEST": str(tmp_path), "CACHEWARM_COPY_SUMMARY": str(summary_file)})
    assert summary["cold"] is True and "CACHEWARM_COPY_BUCKET" in summary["errors"][0]  # no bucket
    assert json.loads(summary_file.read_text()) == summary


def test_a_bucket_that_never_answers_is_given_up_at_the_deadline(tmp_path: Path) -> None:
    """A black-holed network (connections accepted, nothing ever answered): every request
    of the copier's is bounded by what is left of its deadline, so the init container ends
    soon after CACHEWARM_COPY_DEADLINE_SECONDS (3 s here), cold, exit 0. Without the bound
    it would take 4 attempts x 30 s per request, minutes: run_copier's 30 s timeout is the
    behaviour under test, not a speed measurement (the slow machine gets 10x slack)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        summary = run_copier({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{silent.getsockname()[1]}",
                              "CACHEWARM_COPY_BUCKET": "silent", "CACHEWARM_COPY_DEST": str(tmp_path / "cache"),
                              "CACHEWARM_COPY_MANIFESTS": "jax/.cachewarm/pools/a/b/c.json",
                              "CACHEWARM_COPY_DEADLINE_SECONDS": "3",
                              "CACHEWARM_COPY_SUMMARY": str(tmp_path / "summary.json")}, timeout=30)
    assert summary["cold"] is True and summary["copied"] == 0, summary
    assert json.loads((tmp_path / "summary.json").read_text())["cold"] is True  # the reporter hears of it
    assert any("deadline" in e or "timed out" in e for e in summary["errors"]), summary


def test_an_image_whose_python_cannot_run_the_copier_still_starts_and_says_so_to_the_reporter(tmp_path: Path) -> None:
    """The init container's command as the webhook writes it, run by the static busybox
    (as in the pod): with no such python in the image it prints a cold summary, writes it
    where the reporter reads it, and exits 0."""
    from cachewarm.builders.localcopy import RUN_COPIER  # noqa: PLC0415
    busybox = shutil.which("busybox")
    assert busybox, "make node-deps installs busybox-static"
    summary_file = tmp_path / "local-copy.json"
    out = subprocess.run([busybox, "sh", "-c", RUN_COPIER, "no-such-python", str(COPIER)], capture_output=True,
                         text=True, timeout=30, env={"PATH": "/nonexistent", "CACHEWARM_COPY_SUMMARY": str(summary_file)})
    assert out.returncode == 0, out.stderr
    printed = summary_of(out.stdout)
    assert printed["cold"] is True and "could not run no-such-python (exit 127)" in printed["errors"][0]
    assert json.loads(summary_file.read_text()) == printed
