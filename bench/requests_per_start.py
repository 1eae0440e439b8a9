"""GCS requests and bytes per pod start as the number of programs grows (issue 30): N
programs (default 10, 100, 1000), each a small jitted function of its own (a distinct
constant, so a distinct cache key), compiled once by a "warmer" process that writes them to
a gs:// cache on the testbed's GCS emulator (behind its fidelity proxy; JAX through gcsfs,
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 so every program is written), then read back
by one start of each reader:

  gs://   a fresh process running the same N programs with JAX_COMPILATION_CACHE_DIR at
          the bucket (what a pod does with `gs://` direct: JAX reads each entry through
          gcsfs); asserted to hit every one of the N programs
  copier  the copier as the init container runs it (`python -I -S copier.py`, listing
          mode: every entry under the prefix) into a fresh directory; asserted to copy
          every entry the warmer wrote. Manifest mode adds two requests (the manifest's
          metadata at its generation and its media) per trusted manifest.
  manifest  the copier in manifest mode (what the default local copy runs), pinned to a
          manifest of every entry as a warmer before packs wrote it (no pack)
  packed  the copier pinned to the manifest the warmer writes now (issue 30): the
          warmer's own write_manifest, run in this process against the emulator after the
          warm, writes the pack of the small entries (each at most 1 MiB) and the manifest
          naming it; asserted to copy every entry, those of the pack from it

Every request of a start goes through a counting relay of this file (between the reader
and the proxy: method, path, query, status, bytes of the answer's body), which classifies
it: list (objects.list pages), metadata (an object's JSON), media (alt=media or /download/),
other. The warmer's own requests are not counted. Real GCS latency is not modelled: the
counts are what matter, the seconds beside them are loopback seconds on this machine.

Run: .venv/bin/python bench/requests_per_start.py [--programs 10,100,1000] [--json out.json]
     [--readers gs,copier,manifest,packed]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "testbed"), str(REPO / "operator")]

COPIER = REPO / "operator" / "cachewarm" / "agents" / "copier.py"

# The programs: N jitted functions, each with its own constant in its HLO, and a count of
# JAX's cache hits and misses (its monitoring events) printed at the end.
PROGRAMS = r"""
import json, sys, time
started = time.perf_counter()
import jax, jax.numpy as jnp
from collections import Counter
events = Counter()
jax.monitoring.register_event_listener(lambda e, **_: events.__setitem__(e, events[e] + 1))
x = jnp.arange(8, dtype=jnp.float32)
for i in range(int(sys.argv[1])):
    jax.jit(lambda v, c=float(i): jnp.sin(v) * c + c).lower(x).compile()
print(json.dumps({"seconds": time.perf_counter() - started, "events": dict(events)}))
"""


class Relay(http.server.ThreadingHTTPServer):
    """Forwards every request to `upstream` (HTTP) and records it: method, path, query,
    status, the answer's body bytes."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), RelayHandler)
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname or "", parts.port or 80)
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    @contextlib.contextmanager
    def serving(self) -> Iterator[Relay]:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()

    def take(self) -> list[dict[str, Any]]:
        with self.lock:
            records, self.records = self.records, []
        return records


class RelayHandler(http.server.BaseHTTPRequestHandler):
    server: Relay
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        upstream.request(self.command, self.path, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        upstream.close()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        url = urllib.parse.urlsplit(self.path)
        with self.server.lock:
            self.server.records.append({"method": self.command, "path": url.path, "query": url.query,
                                        "status": answer.status, "bytes": len(data)})
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the reader went away (gcsfs closes some early)
                self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = relay  # noqa: N815


def kind(record: dict[str, Any]) -> str:
    query = urllib.parse.parse_qs(record["query"])
    if record["method"] != "GET":
        return f"other ({record['method']})"
    if record["path"].startswith("/download/") or query.get("alt") == ["media"]:
        return "media"
    if record["path"].endswith("/o"):
        return "list"
    if "/o/" in record["path"]:
        return "metadata"
    return f"other ({record['path'].split('/')[-1] or record['path']})"


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter(kind(r) for r in records)
    sizes: collections.Counter[str] = collections.Counter()
    for r in records:
        sizes[kind(r)] += r["bytes"]
    return {"requests": len(records), "bytes": sum(r["bytes"] for r in records), "byKind": dict(counts),
            "bytesByKind": dict(sizes), "statuses": dict(collections.Counter(str(r["status"]) for r in records))}


def run(command: list[str], env: dict[str, str], timeout: float = 900) -> tuple[str, float]:
    started = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"{command[:3]} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout, time.perf_counter() - started


def jax_env(base: dict[str, str], host: str, cache: str) -> dict[str, str]:
    return {**base, "STORAGE_EMULATOR_HOST": host, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "JAX_PLATFORMS": "cpu"}


def copier_start(relay: Relay, base: dict[str, str], bucket: str, dest: Path, entries: int,
                 manifests: str | None = None) -> dict[str, Any]:
    """One start of the copier through the relay (listing mode, or pinned to `manifests`):
    its requests, bytes and seconds; asserted to copy every one of `entries`."""
    env = {**{k: v for k, v in base.items() if not k.startswith(("CACHEWARM_", "STORAGE_EMULATOR_HOST"))},
           "STORAGE_EMULATOR_HOST": relay.url, "CACHEWARM_COPY_BUCKET": bucket, "CACHEWARM_COPY_PREFIX": "jax",
           "CACHEWARM_COPY_DEST": str(dest), **({"CACHEWARM_COPY_MANIFESTS": manifests} if manifests else {})}
    relay.take()
    out, seconds = run([sys.executable, "-I", "-S", str(COPIER)], env)
    summary = json.loads(out.strip().splitlines()[-1])["cachewarm-copier"]
    assert (summary["copied"], summary["failed"], summary["errors"]) == (entries, 0, []), summary
    return {**summarize(relay.take()), "seconds": round(seconds, 2), "copierSeconds": summary["seconds"],
            **{k: summary[k] for k in ("fromPack", "packBytes", "packFallback") if k in summary}}


def manifests_of(gcs: Any, bucket: str, names: list[str]) -> tuple[str, str, dict[str, Any]]:
    """The warmer's manifest of `names` (with its pack), written by the warmer's own
    write_manifest in this process, and the same manifest as a warmer before packs wrote it:
    both as `<object>#<generation>`, and write_manifest's answer."""
    from cachewarm.agents import warmer as agent  # noqa: PLC0415 - the shipped file itself

    name = "jax/.cachewarm/pools/bench/rps/cpu/rps-cpu-0.json"
    out = agent.write_manifest(f"gs://{bucket}/{name}", names, {"bench": True}, f"gs://{bucket}/jax")
    assert "manifestGeneration" in out, out
    doc = json.loads(gcs.bucket(bucket).blob(name).download_as_bytes())
    doc.pop("pack", None)
    doc["entries"] = [{k: v for k, v in e.items() if k != "packed"} for e in doc["entries"]]
    old = gcs.bucket(bucket).blob("jax/.cachewarm/pools/bench/rps/cpu/rps-cpu-old.json")
    old.upload_from_string(json.dumps(doc))
    return f"{name}#{out['manifestGeneration']}", f"{old.name}#{old.generation}", out


def one_size(programs: int, bed_host: str, relay: Relay, base: dict[str, str], work: Path,
             dump: Path | None, readers: set[str]) -> dict[str, Any]:
    from conftest import storage_client  # noqa: PLC0415 - the tests' own helper

    gcs = storage_client(bed_host)
    bucket = f"rps-{uuid.uuid4().hex[:8]}"
    gcs.create_bucket(bucket, location="us-central1")
    cache = f"gs://{bucket}/jax"
    # The warmer: straight to the proxy, not counted.
    out, warm_seconds = run([sys.executable, "-c", PROGRAMS, str(programs)], jax_env(base, bed_host, cache))
    warmer = json.loads(out.strip().splitlines()[-1])
    entries = [b for b in gcs.list_blobs(bucket, prefix="jax/") if b.name.endswith("-cache")]
    row: dict[str, Any] = {"programs": programs, "entries": len(entries),
                           "entryBytes": sum(b.size or 0 for b in entries), "warmerSeconds": round(warm_seconds, 2),
                           "warmerEvents": warmer["events"]}
    if "manifest" in readers or "packed" in readers:
        started = time.perf_counter()
        packed, unpacked, written = manifests_of(gcs, bucket, [b.name.rsplit("/", 1)[1] for b in entries])
        row["manifestSeconds"] = round(time.perf_counter() - started, 2)
        row["pack"] = {k: written.get(k) for k in ("manifestEntries", "packEntries", "packBytes", "packError")}
        if "manifest" in readers:
            row["manifest"] = copier_start(relay, base, bucket, work / f"manifest-{programs}", len(entries), unpacked)
        if "packed" in readers:
            row["packed"] = copier_start(relay, base, bucket, work / f"packed-{programs}", len(entries), packed)
    if "copier" in readers:
        row["copier"] = copier_start(relay, base, bucket, work / f"copy-{programs}", len(entries))
    if "gs" not in readers:
        return row
    # gs:// direct: one start, through the relay.
    relay.take()
    out, seconds = run([sys.executable, "-c", PROGRAMS, str(programs)], jax_env(base, relay.url, cache))
    reader = json.loads(out.strip().splitlines()[-1])
    hits = reader["events"].get("/jax/compilation_cache/cache_hits", 0)
    assert hits >= programs, (hits, reader["events"])  # every program (JAX's helpers may add a few)
    records = relay.take()
    if dump:
        (dump / f"gs-{programs}.json").write_text(json.dumps(records, indent=0))
    row["gs"] = {**summarize(records), "seconds": round(seconds, 2), "hits": hits,
                 "misses": reader["events"].get("/jax/compilation_cache/cache_misses", 0)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default="10,100,1000")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--records", help="a directory to write the gs:// reader's requests to (gs-N.json)")
    parser.add_argument("--readers", default="gs,copier,manifest,packed", help="which starts to measure")
    args = parser.parse_args()
    readers = set(args.readers.split(","))
    from cachewarm_testbed.cluster import Testbed  # noqa: PLC0415

    bed = Testbed().start_gcs()
    # The warmer's write_manifest, in this process: its gcsfs against the emulator.
    os.environ.update({k: v for k, v in bed.env().items() if k != "KUBECONFIG"})
    work = Path(tempfile.mkdtemp(prefix="requests-per-start-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    rows = []
    try:
        with Relay(bed.storage_emulator_host).serving() as relay:
            for programs in (int(p) for p in args.programs.split(",")):
                row = one_size(programs, bed.storage_emulator_host, relay, base, work,
                               Path(args.records) if args.records else None, readers)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        bed.stop()
    print("\n| programs | entries (bytes) | reader | requests per start: list / metadata / media / other | bytes | "
          "seconds (whole process) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for reader in ("gs", "copier", "manifest", "packed"):
            if reader not in r:
                continue
            got = r[reader]
            k = got["byKind"]
            other = sum(v for key, v in k.items() if key.startswith("other"))
            print(f"| {r['programs']} | {r['entries']} ({r['entryBytes']:,}) | {reader} | {got['requests']:,}: "
                  f"{k.get('list', 0)} / {k.get('metadata', 0)} / {k.get('media', 0)} / {other} | {got['bytes']:,} | "
                  f"{got['seconds']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
