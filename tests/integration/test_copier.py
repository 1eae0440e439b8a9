"""The copier (issue 14's local copy, the part that runs in the pod) against the GCS
emulator behind its fidelity proxy, over HTTP as in a pod: it copies the union of the
pools' manifests' entries and nothing else (every entry under the prefix when a manifest is
missing or corrupt, and says so), checks each against GCS's MD5 and renames it into place,
keeps what is already there, removes from the destination every other name (JAX loads any
`*-cache` there), retries 503s, keeps to its byte budget, shares a directory
with another copier running at once, writes its summary file, and never fails the pod, not
even with the bucket out of reach. Run as the init container runs it: `python -I -S
copier.py`, settings in the environment, with the standard library only. Against a fault
injector of the test's own (not an emulator), downloads broken mid-body or corrupted on the
way are tried again, and over HTTPS the CAs of REQUESTS_CA_BUNDLE are trusted."""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import http.server
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm.admission import certificates as certs
from cachewarm.agents import copier
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


def md5_of(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - GCS's md5Hash


def recorded(gcs: storage.Client, bucket: str, name: str) -> dict[str, Any]:
    """A manifest's entry for the object `name` as the warmer records it, from GCS's own
    metadata; for a name the bucket does not hold, made-up values of the right shape."""
    blob = gcs.bucket(bucket).get_blob(name)
    if blob is None:
        return {"name": base(name), "size": 1, "md5": md5_of(b"gone"), "generation": "1"}
    return {"name": base(name), "size": blob.size, "md5": blob.md5_hash, "generation": str(blob.generation)}


def manifest(gcs: storage.Client, bucket: str, pool: str, names: list[str], data: bytes | None = None,
             version: int = 2) -> str:
    """A pool's manifest as its warmer writes it (or `data` instead); returns what the
    operator records and the webhook passes: `<name>#<generation>`."""
    name = f"{MANIFESTS}/{pool}.json"
    entries = [recorded(gcs, bucket, n) for n in names]
    if version == 1:
        entries = [{"name": e["name"], "size": e["size"]} for e in entries]
    doc = {"version": version, "pool": pool, "entries": entries,
           "fingerprint": {"jaxlib": "0.0"}, "writtenTime": "2026-01-01T00:00:00Z"}
    blob = gcs.bucket(bucket).blob(name)
    blob.upload_from_string(data if data is not None else json.dumps(doc).encode())
    return f"{name}#{blob.generation}"


def env_for(bed: Testbed, bucket: str, dest: Path, **settings: str) -> dict[str, str]:
    """The copier's settings: CACHEWARM_COPY_<NAME> for each of `settings`."""
    return {"STORAGE_EMULATOR_HOST": bed.storage_emulator_host, "CACHEWARM_COPY_BUCKET": bucket,
            "CACHEWARM_COPY_PREFIX": "jax", "CACHEWARM_COPY_DEST": str(dest),
            **{f"CACHEWARM_COPY_{k.upper()}": v for k, v in settings.items()}}


def process_env(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment without its copier settings and CAs, with `settings`."""
    ours = ("CACHEWARM_", "STORAGE_EMULATOR_HOST", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    return {**clean, **settings}


def summary_of(stdout: str) -> dict[str, Any]:
    return dict(json.loads(stdout.strip().splitlines()[-1])["cachewarm-copier"])


def run_copier(settings: dict[str, str], timeout: float = 120, umask: int | None = None) -> dict[str, Any]:
    """The copier as the init container runs it (under `umask` when given); its summary."""
    out = subprocess.run([sys.executable, "-I", "-S", str(COPIER)], env=process_env(settings), capture_output=True,
                         text=True, timeout=timeout, preexec_fn=None if umask is None else lambda: os.umask(umask))
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
    assert all(o.get("generation") for o in listed) and h100.rsplit("#", 1)[1].isdigit()  # the emulator has them too
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
    assert summary["leftOut"] == {"notAnEntry": 2, "notInManifest": 2, "notInBucket": 1, "overBudget": 0,
                                  "unverifiable": 0}
    assert (summary["trusted"], summary["manifestsUntrusted"], summary["manifestsRefused"]) == (2, 0, 0)
    assert "manifestsMissing" not in summary and "manifestError" not in summary and "nothingTrusted" not in summary
    assert sorted(p.name for p in dest.iterdir()) == sorted(base(n) for n in (p0, p1, p3))
    for name in (p0, p1, p3):
        assert (dest / base(name)).read_bytes() == objects[name]
    # The summary file: the same summary, for the pod's reporter, and nothing else left beside it.
    assert json.loads(summary_file.read_text()) == summary
    assert [p.name for p in summary_file.parent.iterdir()] == ["copier.json"]


def test_a_missing_manifest_adds_nothing_and_is_never_a_fallback_to_the_prefix(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """Whoever can delete a manifest can write the prefix: the prefix is not the fallback."""
    bucket, objects = fill(storage_only)
    h100 = manifest(storage_only, bucket, "h100", sorted(objects)[4:])  # the 500-byte entry only
    missing = f"{MANIFESTS}/v5p.json#123"  # that pool's warmer has not written one (yet)
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=f"{h100},{missing}"))
    assert (summary["source"], summary["manifestsMissing"], summary["trusted"], summary["wanted"], summary["copied"],
            summary["bytes"], summary["cold"]) == ("manifest", [missing], 1, 1, 1, 500, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [base(sorted(objects)[4])]
    # Only missing ones: nothing trusted, nothing copied, a cold start that says why.
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "none", manifests=missing))
    assert (summary["trusted"], summary["copied"], summary["wanted"], summary["cold"]) == (0, 0, 0, True)
    assert "no manifest could be read" in summary["nothingTrusted"] and summary["errors"]
    assert list((tmp_path / "none").iterdir()) == []


@pytest.mark.parametrize("data", [b'{"version": 2, "entries": [{"na', b'{"version": 2, "entries": ["jit_p0"]}', None],
                         ids=["cut-short", "wrong-shape", "version-1"])
def test_a_corrupt_or_version_1_manifest_is_refused_and_adds_nothing(
        data: bytes | None, tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    h100 = manifest(storage_only, bucket, "h100", sorted(objects)[:1])
    v5p = manifest(storage_only, bucket, "v5p", sorted(objects)[1:], data=data, version=1)
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=f"{h100},{v5p}"))
    assert (summary["source"], summary["copied"], summary["trusted"], summary["manifestsRefused"],
            summary["cold"]) == ("manifest", 1, 1, 1, False)
    assert v5p in summary["manifestError"] and "manifestsMissing" not in summary
    if data is None:
        assert "version-1 manifest: it carries no digests" in summary["manifestError"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [base(sorted(objects)[0])]


def test_entries_already_there_are_kept_not_downloaded_again(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    p0, p1, *_ = sorted(objects)
    # p0 is there whole (an earlier copy of the pod's, before a container restart): kept,
    # not downloaded again. p1 is there with another size: not the entry, copied again.
    kept = objects[p0]
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
            summary["replaced"], summary["leftOut"]["overBudget"]) == (3, 1, 100, 2, 500, 1, 2)  # present: in budget
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
            headers = answer.headers

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
    changed = copier.Entry(int(obj["size"]), "AAAAAAAAAAAAAAAAAAAAAA==", obj["generation"])  # as if it changed under us
    with pytest.raises(copier.CopyError, match="MD5"):
        client.download(bucket, copier.Wanted(obj["name"], changed), str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # neither the entry nor a partial file


def test_without_manifests_the_prefix_is_copied_and_cold_only_when_nothing_could_be(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    # One entry refused for good (403, not retried): the rest copied, not a cold start.
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(sorted(objects)[2])}", "status": 403}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path / "some"))
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
                          "CACHEWARM_COPY_MANIFESTS": "jax/.cachewarm/pools/a/b/c.json#1",
                          "CACHEWARM_COPY_SUMMARY": str(summary_file)}, timeout=60)
    assert summary["cold"] is True and summary["copied"] == 0 and summary["errors"]
    assert summary["source"] == "manifest" and "manifestError" in summary  # unreadable: nothing else trusted
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
                              "CACHEWARM_COPY_MANIFESTS": "jax/.cachewarm/pools/a/b/c.json#1",
                              "CACHEWARM_COPY_DEADLINE_SECONDS": "3",
                              "CACHEWARM_COPY_SUMMARY": str(tmp_path / "summary.json")}, timeout=30)
    assert summary["cold"] is True and summary["copied"] == 0, summary
    assert json.loads((tmp_path / "summary.json").read_text())["cold"] is True  # the reporter hears of it
    assert any("deadline" in e or "timed out" in e for e in summary["errors"]), summary
    # Ended by the bound on each request, not by the watchdog 15 s after the deadline.
    assert not any("stopped" in e for e in summary["errors"]), summary


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


class FaultInjector(http.server.ThreadingHTTPServer):
    """A fault injector, not a GCS emulator: for one bucket of objects held in memory it
    answers just the three calls the copier makes, at the GCS JSON API's paths (the listing,
    /storage/v1/b/<bucket>/o?prefix=..., an object's metadata, /storage/v1/b/<bucket>/o/<name>
    ?generation=G, and the media download, /download/storage/v1/b/<bucket>/o/<name>?alt=media
    [&generation=G], by which it reads manifests too), and anything else 404; a generation
    other than the object's is a 404, as GCS answers without object versioning. Each object's
    generation is 1000 + its place in name order; `unlisted` leaves fields out of one's
    listing (name -> field names). Its faults (`faults`:
    object name, or "list", -> what its first answers do, in order; then whole): "cut" (the
    headers with the full Content-Length, half the body, then the connection closed), "reset"
    (the same, ended by a TCP reset), "corrupt" (the full length, every byte flipped),
    "drip" (the full length, then a byte every 0.2 s, so no read ever times out), "long"
    (a Content-Length and body 1 KiB longer than the object), "unbounded" (1 KiB more,
    without a Content-Length: the body ends when the connection closes), "othergen" (the
    object's bytes with an x-goog-generation header of another generation). With
    `tls`, HTTPS. It counts the requests for each object ("list" for the listing)."""

    daemon_threads = True
    bucket = "faulty"
    # Not socketserver's 5: a full backlog drops the SYNs of the copier's parallel
    # connections, a one-second stall each that GCS never causes (see gcsemulator.py).
    request_queue_size = socket.SOMAXCONN

    def __init__(self, objects: dict[str, bytes], faults: dict[str, list[str]] | None = None,
                 tls: ssl.SSLContext | None = None, unlisted: dict[str, list[str]] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), FaultHandler)
        self.objects = objects
        self.unlisted = unlisted or {}
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.requests: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server_address[1]}"

    def generation(self, name: str) -> str:
        return str(1000 + sorted(self.objects).index(name)) if name in self.objects else ""

    def metadata(self, name: str) -> dict[str, str]:
        data = self.objects[name]
        return {"name": name, "size": str(len(data)), "md5Hash": md5_of(data), "generation": self.generation(name)}

    @contextlib.contextmanager
    def serving(self) -> Iterator[FaultInjector]:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()
            thread.join(10)


class FaultHandler(http.server.BaseHTTPRequestHandler):
    server: FaultInjector

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        objects = self.server.objects
        bucket = f"/b/{self.server.bucket}/o"
        name = urllib.parse.unquote(url.path.removeprefix(f"/download/storage/v1{bucket}/"))
        query = urllib.parse.parse_qs(url.query)
        generation = query.pop("generation", [self.server.generation(name)])
        if url.path == f"/storage/v1{bucket}":
            prefix = query.get("prefix", [""])[0]
            items = [{k: v for k, v in self.server.metadata(n).items() if k not in self.server.unlisted.get(n, ())}
                     for n in sorted(objects) if n.startswith(prefix)]
            self.answer("list", json.dumps({"items": items}).encode())
        elif url.path.startswith(f"/storage/v1{bucket}/"):
            name = urllib.parse.unquote(url.path.removeprefix(f"/storage/v1{bucket}/"))
            if name in objects and generation == [self.server.generation(name)]:
                self.answer(f"meta:{name}", json.dumps(self.server.metadata(name)).encode())
            else:
                self.send_error(404)
        elif url.path.startswith("/download/") and name in objects and query == {"alt": ["media"]} and \
                generation == [self.server.generation(name)]:
            self.answer(name, objects[name])
        else:
            self.send_error(404)

    def answer(self, key: str, body: bytes) -> None:
        with self.server.lock:
            self.server.requests[key] += 1
            queued = self.server.faults.get(key) or []
            fault = queued.pop(0) if queued else None
        if fault == "corrupt":
            body = bytes(b ^ 0xFF for b in body)
        if fault in ("long", "unbounded"):
            body += os.urandom(1024)
        if fault == "othergen":  # the right bytes, said to be another generation's
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-goog-generation", "5")
            self.end_headers()
            self.wfile.write(body)
            return
        if fault == "unbounded":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
            return
        if fault == "drip":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:  # never a pause long enough for a socket timeout
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if key == "list" else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if fault not in ("cut", "reset"):
            self.wfile.write(body)
            return
        self.wfile.write(body[:len(body) // 2])
        self.wfile.flush()
        self.close_connection = True
        if fault == "reset":  # closed now with SO_LINGER 0: an RST instead of a FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()
            self.connection.close()


def faulty_manifest(server: FaultInjector, *names: str) -> bytes:
    """A version-2 manifest of `names` as the FaultInjector holds them."""
    return json.dumps({"version": 2, "entries": [
        {"name": base(n), "size": int(m["size"]), "md5": m["md5Hash"], "generation": m["generation"]}
        for n in names for m in [server.metadata(n)]]}).encode()


def faulty_env(server: FaultInjector, dest: Path, **settings: str) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": server.url, "CACHEWARM_COPY_BUCKET": server.bucket,
            "CACHEWARM_COPY_PREFIX": "jax", "CACHEWARM_COPY_DEST": str(dest),
            **{f"CACHEWARM_COPY_{k.upper()}": v for k, v in settings.items()}}


def test_a_download_broken_mid_body_is_tried_again_whole(tmp_path: Path) -> None:
    """The first answer to the listing, to a manifest and to two entries ends mid-body:
    the connection closed after half the Content-Length (which python's read(n) returns
    as a short body, no error), or reset (an error while reading, not while connecting).
    Each is tried again as a whole and arrives complete; the partial files of the broken
    attempts are gone. The entries are larger than the client's read buffer, so the break
    comes while the body is being read."""
    a, b, c = (f"jax/{entry(f'jit_{x}', x)}" for x in "abc")
    objects = {a: os.urandom(300_000), b: os.urandom(400_000), c: os.urandom(1000)}
    pool = f"{MANIFESTS}/h100.json"
    objects[pool] = b""
    faults = {"list": ["cut"], pool: ["cut"], a: ["cut"], b: ["reset"]}
    with FaultInjector(objects, faults).serving() as server:
        objects[pool] = faulty_manifest(server, a, b, c)
        summary = run_copier(faulty_env(server, tmp_path, manifests=f"{pool}#{server.generation(pool)}"), timeout=60)
    assert {k: summary[k] for k in ("source", "wanted", "copied", "failed", "cold", "errors")} == {
        "source": "manifest", "wanted": 3, "copied": 3, "failed": 0, "cold": False, "errors": []}, summary
    assert summary["bytes"] == 701_000
    assert "manifestError" not in summary
    assert server.requests == {"list": 2, f"meta:{pool}": 1, pool: 2, a: 2, b: 2, c: 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(base(n) for n in (a, b, c))  # no partial file
    for name in (a, b, c):
        assert (tmp_path / base(name)).read_bytes() == objects[name]


def test_a_download_that_trickles_in_is_given_up_at_the_deadline_by_the_copier_itself(tmp_path: Path) -> None:
    """A body that keeps arriving a byte at a time never times out a read; the copier
    still stops it at its deadline (it reads what each receive brings and checks the
    deadline in between), not its watchdog, which in process would leave the download
    running in the training process."""
    a, b = f"jax/{entry('jit_a', 'a')}", f"jax/{entry('jit_b', 'b')}"
    objects = {a: os.urandom(200), b: os.urandom(100)}
    with FaultInjector(objects, {a: ["drip"]}).serving() as server:
        summary = run_copier(faulty_env(server, tmp_path, deadline_seconds="3", grace_seconds="30"), timeout=60)
    assert (summary["copied"], summary["failed"]) == (1, 1), summary
    assert any("deadline" in e for e in summary["errors"]), summary
    assert not any("still running past the deadline" in e for e in summary["errors"]), summary  # not the watchdog
    assert sorted(p.name for p in tmp_path.iterdir()) == [base(b)]  # the partial file removed


def test_a_corrupted_download_is_tried_again_then_given_up(tmp_path: Path) -> None:
    """A download whose bytes do not match GCS's MD5 is tried again: corrupted once, it
    arrives whole; corrupted every time, it is given up after CORRUPT_ATTEMPTS (not
    ATTEMPTS: an object changed since it was listed stays changed), counted failed, and no
    partial file of any attempt is left."""
    once, always = f"jax/{entry('jit_once', 'once')}", f"jax/{entry('jit_always', 'always')}"
    objects = {once: os.urandom(5000), always: os.urandom(6000)}
    with FaultInjector(objects, {once: ["corrupt"], always: ["corrupt"] * 10}).serving() as server:
        summary = run_copier(faulty_env(server, tmp_path), timeout=60)
    assert (summary["wanted"], summary["copied"], summary["failed"], summary["cold"]) == (2, 1, 1, False), summary
    [error] = summary["errors"]
    assert "MD5" in error and base(always) in error
    assert server.requests == {"list": 1, once: 2, always: copier.CORRUPT_ATTEMPTS}
    assert [p.name for p in tmp_path.iterdir()] == [base(once)]
    assert (tmp_path / base(once)).read_bytes() == objects[once]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA made now, its PEM, and a serving certificate of 127.0.0.1 it signed."""
    folder = tmp_path_factory.mktemp("tls")
    now = dt.datetime.now(dt.timezone.utc)
    ca = certs.make_ca("cachewarm-test-intercepting-proxy", now=now)
    serving = certs.make_serving_cert(ca, ["127.0.0.1"], now=now)
    files = {"ca": folder / "ca.pem", "cert": folder / "tls.crt", "key": folder / "tls.key",
             "garbage": folder / "garbage.pem"}
    files["ca"].write_bytes(ca.cert_pem)
    files["cert"].write_bytes(serving.cert_pem)
    files["key"].write_bytes(serving.key_pem)
    files["garbage"].write_bytes(b"-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    return files


@pytest.mark.parametrize(("cas", "copied", "error"), [
    ({"REQUESTS_CA_BUNDLE": "ca"}, True, None),
    ({"CURL_CA_BUNDLE": "ca"}, True, None),
    ({"REQUESTS_CA_BUNDLE": "ca", "CURL_CA_BUNDLE": "garbage"}, True, None),  # requests' order
    ({}, False, "CERTIFICATE_VERIFY_FAILED"),
    # A bundle that cannot be loaded: said, and the defaults instead (SSL_CERT_FILE among them).
    ({"REQUESTS_CA_BUNDLE": "garbage", "SSL_CERT_FILE": "ca"}, True, "CA bundle"),
    ({"REQUESTS_CA_BUNDLE": "missing"}, False, "CA bundle"),
], ids=["requests", "curl", "requests-first", "none", "unloadable-defaults", "missing"])
def test_over_https_the_cas_of_requests_ca_bundle_are_trusted(
        cas: dict[str, str], copied: bool, error: str | None, tmp_path: Path, tls_files: dict[str, Path]) -> None:
    """The bucket behind a TLS-intercepting proxy, whose CA the pod trusts by
    REQUESTS_CA_BUNDLE, as requests and google-auth do: the copier, run with `-I` as in the
    pod, trusts it too. Without it, a cold start that says why (the certificate, not
    retried); with one that cannot be loaded, the same, saying so, and never a crash."""
    names = [f"jax/{entry('jit_tls', str(i))}" for i in range(2)]
    objects = {n: os.urandom(2000) for n in names}
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tls_files["cert"], tls_files["key"])
    paths = {**{k: str(v) for k, v in tls_files.items()}, "missing": str(tmp_path / "no-such-ca.pem")}
    with FaultInjector(objects, tls=tls).serving() as server:
        summary = run_copier({**faulty_env(server, tmp_path / "cache"), **{k: paths[v] for k, v in cas.items()}},
                             timeout=60)
    assert (summary["copied"], summary["cold"]) == ((2, False) if copied else (0, True)), summary
    if error is None:
        assert summary["errors"] == []
    else:
        assert any(error in e for e in summary["errors"]), summary
    if not copied:
        assert any("CERTIFICATE_VERIFY_FAILED" in e and "gave up" not in e for e in summary["errors"]), summary
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == (sorted(base(n) for n in names) if copied else [])


def test_the_copier_that_records_for_the_reporter_writes_the_images_pythonpath_then_copies(tmp_path: Path) -> None:
    """The folded init container (copier + the reporter's recorder), run by busybox as in
    the pod: the PYTHONPATH the image set lands where the reporter's sitecustomize restores
    it from, also when the copier then cannot run; a record that cannot be written (its
    directory missing) still lets the copy's cold summary out."""
    from cachewarm.builders.localcopy import RECORD_AND_RUN_COPIER  # noqa: PLC0415
    busybox = shutil.which("busybox")
    assert busybox, "make node-deps installs busybox-static"
    record = tmp_path / "image-pythonpath"
    summary_file = tmp_path / "local-copy.json"
    env = {"PATH": "/nonexistent", "CACHEWARM_COPY_SUMMARY": str(summary_file), "PYTHONPATH": "/app:/opt/lib"}
    out = subprocess.run([busybox, "sh", "-c", RECORD_AND_RUN_COPIER, "no-such-python", str(COPIER), str(record)],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert record.read_text() == "/app:/opt/lib"
    assert summary_of(out.stdout)["cold"] is True
    missing = tmp_path / "no-dir" / "image-pythonpath"
    out = subprocess.run([busybox, "sh", "-c", RECORD_AND_RUN_COPIER, "no-such-python", str(COPIER), str(missing)],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0 and not missing.exists()
    assert summary_of(out.stdout)["cold"] is True


def test_an_https_copy_loads_the_ca_store_once_however_many_connections(
        tmp_path: Path, tls_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every download is a connection of its own. urllib left to itself makes each one a
    new TLS context, which loads the system's CA store again (25-35 ms of CPU each here,
    under the GIL); the copier makes one for the whole copy. Counted in this process
    (copier.copy, as copy_in_process runs it) by the CA-store loads of the default
    contexts, which trust the test CA through SSL_CERT_FILE, as a pod's would."""
    names = [f"jax/{entry('jit_ctx', str(i))}" for i in range(6)]
    objects = {n: os.urandom(500) for n in names}
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tls_files["cert"], tls_files["key"])
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files["ca"]))
    loads: list[int] = []
    load_default_certs = ssl.SSLContext.load_default_certs

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(1)
        load_default_certs(self, *args, **kwargs)
    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", counted)
    with FaultInjector(objects, tls=tls).serving() as server:
        summary = copier.copy(faulty_env(server, tmp_path / "cache"), copier.new_summary("prefix"))
    assert (summary["copied"], summary["errors"]) == (6, []), summary
    assert len(loads) == 1


# --- issue 28: what the copier trusts, and what it keeps ---------------------------------------
# The GCS emulator gives md5Hash, crc32c and generation as GCS does (decimal strings), but
# ignores `generation=` on reads: it always answers the live object, where GCS answers 404
# for a generation no longer live (without object versioning). The copier does not rely on
# the pin alone (a manifest's metadata must name the pinned generation, an entry's bytes
# must match the manifest's MD5), so against the emulator these tests see those checks
# refuse what GCS would have refused with a 404; the FaultInjector below answers 404 as GCS.


def crc32c_forgery(original: bytes, tampered: bytes) -> bytes:
    """`tampered` with its last 4 bytes chosen so that its CRC32C equals `original`'s: a
    CRC is affine in the message bits, so 32 free bits solve any target (GF(2) elimination)."""
    import google_crc32c  # noqa: PLC0415 - google-cloud-storage's own dependency

    head = tampered[:-4]

    def crc(tail: int) -> int:
        return int(google_crc32c.value(head + tail.to_bytes(4, "little")))
    zero = crc(0)
    basis: dict[int, tuple[int, int]] = {}  # highest bit -> (CRC difference, tail bits giving it)
    for i in range(32):
        value, combo = crc(1 << i) ^ zero, 1 << i
        for bit in reversed(range(32)):
            if value >> bit & 1:
                if bit not in basis:
                    basis[bit] = (value, combo)
                    break
                value, combo = value ^ basis[bit][0], combo ^ basis[bit][1]
    want, tail = int(google_crc32c.value(original)) ^ zero, 0
    for bit in reversed(range(32)):
        if want >> bit & 1:
            want, tail = want ^ basis[bit][0], tail ^ basis[bit][1]
    assert want == 0
    return head + tail.to_bytes(4, "little")


def test_a_tampered_same_size_same_crc32c_entry_or_a_symlink_planted_in_the_destination_is_replaced(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """What a process with the copy volume mounted writable could plant before a later copy
    (a container restart): an entry's name holding other bytes of the same size and the same
    CRC32C as GCS's (a forgery of 4 bytes), or a symlink to a file elsewhere. Each is
    replaced by the entry, the symlink's target is untouched, and only the entry that is
    really there counts as present (the reporter's hits)."""
    bucket, objects = fill(storage_only, size=1000)
    p0, p1, p2, *_ = sorted(objects)
    dest = tmp_path / "cache"
    dest.mkdir()
    forged = crc32c_forgery(objects[p0], b"#!evil" + objects[p0][6:])
    blob = storage_only.bucket(bucket).get_blob(p0)
    assert blob is not None and len(forged) == blob.size and forged != objects[p0]
    import google_crc32c  # noqa: PLC0415

    # GCS's own CRC32C of the entry (base64, big-endian) is the forgery's too.
    assert base64.b64encode(struct.pack(">I", int(google_crc32c.value(forged)))).decode() == blob.crc32c
    (dest / base(p0)).write_bytes(forged)
    outside = tmp_path / "outside"
    outside.write_bytes(objects[p1])  # the entry's very bytes: followed, it would pass any check
    (dest / base(p1)).symlink_to(outside)
    (dest / base(p2)).write_bytes(objects[p2])  # whole: kept
    pool = manifest(storage_only, bucket, "h100", [p0, p1, p2])
    summary = run_copier(env_for(storage_bed, bucket, dest, manifests=pool))
    assert (summary["wanted"], summary["present"], summary["copied"], summary["replaced"], summary["failed"],
            summary["removedForeign"]) == (3, 1, 2, 2, 0, 0), summary  # replaced by the entry: not foreign
    for name in (p0, p1, p2):
        assert not (dest / base(name)).is_symlink() and (dest / base(name)).read_bytes() == objects[name]
    assert outside.read_bytes() == objects[p1] and not outside.is_symlink()
    # The same in prefix mode (the listing's MD5): the forgery is not kept either.
    (dest / base(p0)).unlink()
    (dest / base(p0)).write_bytes(forged)
    summary = run_copier(env_for(storage_bed, bucket, dest))
    assert (summary["present"], summary["copied"], summary["replaced"]) == (2, 3, 1), summary  # p3, p4 new
    assert (dest / base(p0)).read_bytes() == objects[p0]


def test_a_fifo_or_a_directory_planted_under_an_entrys_name_neither_hangs_nor_counts_as_present(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """A FIFO (opening it to read would wait for a writer) is replaced; a directory cannot
    be replaced by a file: that entry fails, said, and the rest is copied."""
    bucket, objects = fill(storage_only)
    p0, p1, *_ = sorted(objects)
    os.mkfifo(tmp_path / base(p0))
    (tmp_path / base(p1)).mkdir()
    summary = run_copier(env_for(storage_bed, bucket, tmp_path), timeout=60)
    assert (summary["present"], summary["copied"], summary["replaced"], summary["failed"]) == (0, 4, 1, 1), summary
    assert base(p1) in summary["errors"][0]
    assert (tmp_path / base(p0)).read_bytes() == objects[p0]


def test_the_destination_is_made_not_writable_by_others_and_a_foreign_world_writable_root_is_said(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    import stat  # noqa: PLC0415

    bucket, _ = fill(storage_only)
    # umask 0, so that what the copier asks for is what it gets (a pod's umask may be anything).
    summary = run_copier(env_for(storage_bed, bucket, tmp_path / "made" / "here"), umask=0)
    made = tmp_path / "made" / "here"
    assert stat.S_IMODE(made.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in made.iterdir()} == {0o644}
    assert "destWorldWritable" not in summary and summary["copied"] == 5
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")  # the note itself is tested above
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    foreign.chmod(0o777)
    os.chown(foreign, 65534, -1)  # as an emptyDir's root is someone else's (root's) to the copier
    assert run_copier(env_for(storage_bed, bucket, foreign))["destWorldWritable"] is True
    foreign.chmod(0o1777)  # sticky: others cannot replace our files
    assert "destWorldWritable" not in run_copier(env_for(storage_bed, bucket, foreign))


def test_a_rewritten_manifest_is_not_followed_the_pinned_generation_is(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket, objects = fill(storage_only)
    p0, *rest = sorted(objects)
    pinned = manifest(storage_only, bucket, "h100", [p0])
    rewritten = manifest(storage_only, bucket, "h100", rest)  # by whoever can write the bucket
    assert pinned.rsplit("#", 1)[0] == rewritten.rsplit("#", 1)[0] and pinned != rewritten
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=pinned))
    # The emulator answers the live (rewritten) object; its generation is not the pinned one.
    assert (summary["trusted"], summary["manifestsRefused"], summary["copied"], summary["cold"]) == (0, 1, 0, True)
    assert "is not the trusted" in summary["manifestError"]
    assert list(tmp_path.iterdir()) == []


def test_an_entry_overwritten_after_its_manifest_is_refused(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """Same size, new generation: GCS answers the pinned generation 404, the emulator the new
    bytes, which the manifest's MD5 refuses."""
    bucket, objects = fill(storage_only)
    p0, p1, *_ = sorted(objects)
    pool = manifest(storage_only, bucket, "h100", [p0, p1])
    storage_only.bucket(bucket).blob(p1).upload_from_string(os.urandom(len(objects[p1])))
    summary = run_copier(env_for(storage_bed, bucket, tmp_path, manifests=pool))
    assert (summary["wanted"], summary["copied"], summary["failed"]) == (2, 1, 1), summary
    assert "MD5" in summary["errors"][0] and base(p1) in summary["errors"][0]
    assert [p.name for p in tmp_path.iterdir()] == [base(p0)]


def test_a_pinned_generation_gcs_no_longer_has_is_a_404_and_refused(tmp_path: Path) -> None:
    """As GCS answers (the FaultInjector pins generations): an entry whose generation is not
    the manifest's is not found, and not copied; a manifest's old generation is missing."""
    a, b = f"jax/{entry('jit_a', 'a')}", f"jax/{entry('jit_b', 'b')}"
    pool = f"{MANIFESTS}/h100.json"
    objects = {a: os.urandom(100), b: os.urandom(200), pool: b""}
    with FaultInjector(objects).serving() as server:
        doc = json.loads(faulty_manifest(server, a, b))
        doc["entries"][1]["generation"] = "999"  # b was rewritten since: GCS no longer has 999
        objects[pool] = json.dumps(doc).encode()
        summary = run_copier(faulty_env(server, tmp_path, manifests=f"{pool}#{server.generation(pool)}"))
        old = run_copier(faulty_env(server, tmp_path / "old", manifests=f"{pool}#7"))
    assert (summary["copied"], summary["failed"]) == (1, 1) and "HTTP 404" in summary["errors"][0], summary
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [base(a)]
    assert (old["manifestsMissing"], old["trusted"], old["copied"]) == ([f"{pool}#7"], 0, 0)


def test_a_manifest_read_corrupted_is_tried_again_then_refused(tmp_path: Path) -> None:
    """A manifest's bytes must match its metadata's MD5 at the pinned generation: a transfer
    corrupted once is read again; corrupted every time (or rewritten between the two
    requests), it is refused and nothing of it copied."""
    a = f"jax/{entry('jit_a', 'a')}"
    pool = f"{MANIFESTS}/h100.json"
    for faults, trusted in (["corrupt"], 1), (["corrupt"] * 10, 0):
        objects = {a: os.urandom(100), pool: b""}
        with FaultInjector(objects, {pool: faults}).serving() as server:
            objects[pool] = faulty_manifest(server, a)
            summary = run_copier(faulty_env(server, tmp_path / str(trusted), manifests=f"{pool}#{server.generation(pool)}"))
        assert (summary["trusted"], summary["copied"]) == (trusted, trusted), summary
        assert server.requests[pool] == (2 if trusted else copier.CORRUPT_ATTEMPTS)
        if not trusted:
            assert "MD5" in summary["manifestError"] and summary["manifestsRefused"] == 1


def test_in_prefix_mode_a_listed_object_without_size_or_md5_is_skipped(tmp_path: Path) -> None:
    a, b, c = (f"jax/{entry(f'jit_{x}', x)}" for x in "abc")
    objects = {a: os.urandom(100), b: os.urandom(200), c: os.urandom(300)}
    with FaultInjector(objects, unlisted={a: ["size"], b: ["md5Hash"]}).serving() as server:
        summary = run_copier(faulty_env(server, tmp_path))
    assert (summary["source"], summary["wanted"], summary["copied"], summary["leftOut"]["unverifiable"]) == (
        "prefix", 1, 1, 2), summary
    assert server.requests == {"list": 1, c: 1}  # never downloaded
    assert [p.name for p in tmp_path.iterdir()] == [base(c)]


@pytest.mark.parametrize("fault", ["long", "unbounded"])
def test_a_server_answering_more_bytes_than_the_entry_has_is_refused(fault: str, tmp_path: Path) -> None:
    """With a Content-Length over the entry's size, or none (the body ends when the
    connection does): at most the size (and one byte) is read, and the entry refused."""
    a, b = f"jax/{entry('jit_a', 'a')}", f"jax/{entry('jit_b', 'b')}"
    objects = {a: os.urandom(5000), b: os.urandom(100)}
    with FaultInjector(objects, {a: [fault] * 10}).serving() as server:
        summary = run_copier(faulty_env(server, tmp_path))
    assert (summary["copied"], summary["failed"]) == (1, 1), summary
    assert "bytes answered" in summary["errors"][0] and base(a) in summary["errors"][0]
    assert server.requests[a] == copier.CORRUPT_ATTEMPTS
    assert [p.name for p in tmp_path.iterdir()] == [base(b)]  # no partial file either


def test_an_answer_that_says_it_is_another_generation_is_refused(tmp_path: Path) -> None:
    """GCS names the generation it sent (x-goog-generation): one other than the pinned is
    refused even when its bytes would pass (a server or proxy that ignored the pin)."""
    a, b = f"jax/{entry('jit_a', 'a')}", f"jax/{entry('jit_b', 'b')}"
    objects = {a: os.urandom(100), b: os.urandom(200)}
    with FaultInjector(objects, {a: ["othergen"] * 10}).serving() as server:
        summary = run_copier(faulty_env(server, tmp_path))
    assert (summary["copied"], summary["failed"]) == (1, 1), summary
    assert "generation 5 sent" in summary["errors"][0]
    assert [p.name for p in tmp_path.iterdir()] == [base(b)]


def test_manifests_set_but_naming_none_with_a_generation_copy_nothing(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """Set but empty: the cache has warm-up pools, none with a manifest the operator saw its
    warmer write: nothing is trusted (not the prefix instead). An item without a generation is
    not even read."""
    bucket, objects = fill(storage_only)
    unpinned = manifest(storage_only, bucket, "h100", sorted(objects)).rsplit("#", 1)[0]
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    empty = run_copier(env_for(storage_bed, bucket, tmp_path / "empty", manifests=""))
    assert (empty["source"], empty["trusted"], empty["manifestsUntrusted"], empty["wanted"], empty["copied"],
            empty["cold"], empty["errors"]) == ("manifest", 0, 0, 0, 0, False, [])
    assert "no manifest was given with the generation" in empty["nothingTrusted"]
    untrusted = run_copier(env_for(storage_bed, bucket, tmp_path / "untrusted", manifests=f"{unpinned}, x.json#"))
    assert (untrusted["trusted"], untrusted["manifestsUntrusted"], untrusted["copied"], untrusted["cold"]) == (
        0, 2, 0, True)
    assert [r for r in proxy.log() if r["method"] == "GET"] == []  # neither listed nor read
    assert list((tmp_path / "empty").iterdir()) == list((tmp_path / "untrusted").iterdir()) == []


def test_what_no_manifest_lists_is_removed_from_the_destination_and_the_entries_stay(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """JAX loads any `<key>-cache` in its directory by name: what a process with the copy
    writable (or an Ephemeral claim cloned from another's volume) left there under a name no
    manifest lists would be loaded for a program of that key. Such a file, a symlink, a
    FIFO and a file of any other name are removed (unlinked, the link's target untouched),
    and so is a file under a listed entry's name whose download failed; a directory is left
    and said; the copier's own files (another download's partial file, the summary and its
    lock, here in the destination) stay; the entries are copied and kept as before."""
    bucket, objects = fill(storage_only)
    p0, p1, p2, *_ = sorted(objects)
    dest = tmp_path / "cache"
    dest.mkdir()
    (dest / base(p0)).write_bytes(objects[p0])  # a verified entry already there: kept
    foreign, linked, fifo = entry("jit_x", "planted"), entry("jit_y", "linked"), entry("jit_f", "fifo")
    (dest / foreign).write_bytes(b"#!evil: an executable JAX would load for jit_x's key")
    outside = tmp_path / "outside"
    outside.write_bytes(b"someone's file")
    (dest / linked).symlink_to(outside)
    os.mkfifo(dest / fifo)
    (dest / "notes.txt").write_bytes(b"any other name")
    (dest / base(p2)).write_bytes(b"planted under a listed name")  # its download is refused below
    (dest / "sub").mkdir()
    (dest / "sub" / "kept").write_bytes(b"x")
    live = f"{copier.PARTIAL}1-live-0"
    (dest / live).write_bytes(b"x")  # another copier's download in flight
    summary_file = dest / "copy.json"
    (dest / "copy.json.lock").write_bytes(b"")  # in process, the pod's lock is taken first
    pool = manifest(storage_only, bucket, "h100", [p0, p1, p2])
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": f"/download/.*{base(p2)}", "status": 403, "times": 100}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, dest, manifests=pool, summary=str(summary_file)))
    finally:
        proxy.clear_faults()
    assert (summary["wanted"], summary["present"], summary["copied"], summary["failed"], summary["replaced"],
            summary["removedForeign"], summary["foreignDirs"], summary["cold"]) == (
        3, 1, 1, 1, 0, 5, 1, False), summary
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [base(p0), base(p1), "sub", live, "copy.json", "copy.json.lock"])
    # What JAX would read (`*-cache` directly in its directory): the listed entries, GCS's bytes.
    for path in dest.glob("*-cache"):
        assert not path.is_symlink() and path.read_bytes() == objects[f"jax/{path.name}"]
    assert outside.read_bytes() == b"someone's file" and (dest / "sub" / "kept").exists()
    assert json.loads(summary_file.read_text()) == summary
    # Nothing foreign left: a copy again removes nothing more and keeps both entries.
    again = run_copier(env_for(storage_bed, bucket, dest, manifests=pool, summary=str(summary_file)))
    assert (again["present"], again["copied"], again["removedForeign"], again["foreignDirs"]) == (2, 1, 0, 1), again


def test_a_copy_that_fails_before_its_plan_keeps_nothing_unverified(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    """The listing refused: no entry could be verified, so nothing in the destination is
    kept, not even a whole entry of an earlier copy (a cold start rather than a file JAX
    would load unchecked)."""
    bucket, objects = fill(storage_only)
    p0 = sorted(objects)[0]
    (tmp_path / base(p0)).write_bytes(objects[p0])
    (tmp_path / entry("jit_x", "planted")).write_bytes(b"#!evil")
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.faults([{"method": "GET", "path": "^/storage/v1/b/[^/]+/o$", "status": 403, "times": 100}])
    try:
        summary = run_copier(env_for(storage_bed, bucket, tmp_path))
    finally:
        proxy.clear_faults()
    assert (summary["cold"], summary["copied"], summary["removedForeign"]) == (True, 0, 2), summary
    assert "HTTP 403" in summary["errors"][0]
    assert list(tmp_path.iterdir()) == []
