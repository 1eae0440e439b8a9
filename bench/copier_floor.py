"""The copier at real sizes, against the floor (issue 30): entries the size of accelerator
executables (default 40 entries, 1-200 MB, about 2 GB in all, random bytes made once under
--cache-dir and kept there, keyed by their sizes) served over TLS with a bearer token check
by a server of this file (its own process; a thread per connection, each doing its own TLS
handshake, each answer read from the page cache in 256 KiB blocks and written whole, so the
server is not what is measured) that answers the GCS JSON API calls the copier makes: the
listing (pages of --page-size), an object's metadata at a generation, and the media
download at a generation (x-goog-generation said). Anything else 404; a request without the
token 401.

Then, in rounds, the two sides back to back (their order alternating round by round), each
into a fresh directory on the same disk, each its own process:

  copier  the copier as the init container runs it (`python -I -S copier.py`, its default
          16 workers unless --workers), listing mode (CACHEWARM_COPY_MANIFESTS unset: every
          entry under the prefix) or, with --manifest, manifest mode (one version-2
          manifest pinned to its generation, as the webhook passes it)
  floor   a plain parallel HTTPS client of this file: as many persistent connections
          (http.client, one TLS context), handed the names, sizes, MD5s and generations
          (it lists nothing), each body read into one 256 KiB buffer (readinto), MD5'd (hashlib, as the
          copier) and written to a partial file renamed into place, smallest first

Before each side: the previous side's directory removed and `sync` (so that neither pays
for the other's writeback). The page cache is not dropped unless --drop-caches (as root:
`sync; echo 3 > /proc/sys/vm/drop_caches`, which also makes the server read its files from
disk). MB/s is the entries' bytes (10^6) over each side's own seconds (the copier's summary
`seconds`: from its start of work to its end; the floor's the same, from its first request);
the process's whole wall time and CPU (user + system, from wait4) are reported beside it,
and the server's CPU from /proc. A round's copier/floor ratio is of MB/s (over 1: the copier
faster). Every copy is checked: every entry there, whole, with its MD5 (the copier's summary
says copied = entries, failed 0; the floor checks its own and fails loudly).

Auth as in production: the server's process also answers the GCE metadata server's token
request (its own port, plain HTTP, the Metadata-Flavor header required; the token lives an
hour), which the copier asks through GCE_METADATA_HOST and sends to the server; the floor is
handed the same token.

With --baseline REV, that revision's copier.py (from git) is a third side of every round,
run the same way; the three sides' order rotates round by round.

Run: .venv/bin/python bench/copier_floor.py [--rounds 5] [--baseline REV] [--entries 40] [--min-mb 1] [--max-mb 200]
     [--total-mb 2048] [--workers 16] [--manifest] [--drop-caches] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import http.client
import http.server
import json
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
COPIER = REPO / "operator" / "cachewarm" / "agents" / "copier.py"
BUCKET = "bench"
PREFIX = "jax/"
MANIFEST = "jax/.cachewarm/pools/bench/cache/pool/job.json"
BLOCK = 256 << 10  # the server's and the floor's reads: 1 MiB cost more CPU (cache misses), 16-256 KiB alike
MB = 1e6


# --- the entries ------------------------------------------------------------------------------

def sizes_for(entries: int, min_mb: float, max_mb: float, total_mb: float) -> list[int]:
    """`entries` sizes from min_mb to max_mb (MiB), spaced as min + (max-min) * (i/(n-1))^p
    with p chosen so that they add up to about total_mb: many small, a few large."""
    def total(p: float) -> float:
        return sum(min_mb + (max_mb - min_mb) * (i / max(entries - 1, 1)) ** p for i in range(entries))
    low, high = 0.01, 50.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) > total_mb else (low, mid)
    p = (low + high) / 2
    return [int((min_mb + (max_mb - min_mb) * (i / max(entries - 1, 1)) ** p) * (1 << 20)) for i in range(entries)]


def md5_b64(digest: Any) -> str:
    return base64.b64encode(digest.digest()).decode()


def make_entries(cache_dir: Path, sizes: list[int]) -> tuple[Path, list[dict[str, Any]]]:
    """The entries' files under cache_dir/<key of the sizes>/ (made once, random bytes) and
    their index: name (the object's), file, size, md5 (GCS's base64), generation."""
    key = hashlib.sha256(json.dumps(sizes).encode()).hexdigest()[:16]
    folder = cache_dir / key
    index_file = folder / "index.json"
    if index_file.exists():
        return folder, list(json.loads(index_file.read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    index = []
    for i, size in enumerate(sizes):
        base = f"jit_bench_{i:03d}-{hashlib.sha256(f'{key}-{i}'.encode()).hexdigest()}-cache"
        digest = hashlib.md5()  # noqa: S324 - GCS's md5Hash
        with open(folder / base, "wb") as out:
            left = size
            while left:
                block = os.urandom(min(BLOCK, left))
                digest.update(block)
                out.write(block)
                left -= len(block)
        index.append({"name": PREFIX + base, "file": base, "size": size, "md5": md5_b64(digest),
                      "generation": str(1_700_000_000_000_000 + i)})
    index_file.write_text(json.dumps(index))
    return folder, index


# --- the server -------------------------------------------------------------------------------

class Server(http.server.ThreadingHTTPServer):
    """The three GCS JSON API calls the copier makes, for one bucket, over TLS (each
    connection's handshake in its own thread), with a bearer token; counts its requests."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(self, folder: Path, index: list[dict[str, Any]], extra: dict[str, bytes], token: str,
                 tls: ssl.SSLContext | None, page_size: int) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.folder, self.token, self.tls, self.page_size = folder, token, tls, page_size
        self.objects: dict[str, dict[str, Any]] = {e["name"]: e for e in index}
        self.extra = extra  # small objects held in memory (a manifest): name -> bytes
        for i, (name, data) in enumerate(sorted(extra.items())):
            self.objects[name] = {"name": name, "size": len(data), "generation": str(1_800_000_000_000_000 + i),
                                  "md5": md5_b64(hashlib.md5(data))}  # noqa: S324
        self.counts: dict[str, int] = {}
        self.sent = 0
        self.lock = threading.Lock()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return
        super().finish_request(request, client_address)

    def count(self, kind: str, sent: int = 0) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.sent += sent


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"  # keep-alive for clients that keep their connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def reply(self, status: int, body: bytes, kind: str) -> None:
        self.server.count(kind, len(body))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def metadata(self, obj: dict[str, Any]) -> dict[str, str]:
        return {"name": obj["name"], "size": str(obj["size"]), "md5Hash": obj["md5"], "generation": obj["generation"]}

    def do_GET(self) -> None:  # noqa: N802
        server = self.server
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/_stats":
            self.reply(200, json.dumps({"counts": server.counts, "sent": server.sent}).encode(), "stats")
            return
        if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
            self.reply(401, b'{"error": {"code": 401, "message": "Invalid Credentials"}}', "401")
            return
        objects = f"/storage/v1/b/{BUCKET}/o"
        if url.path == objects:
            prefix = query.get("prefix", [""])[0]
            size = min(int(query.get("maxResults", ["1000"])[0]), server.page_size)
            names = [n for n in sorted(server.objects) if n.startswith(prefix) and "/" not in n[len(prefix):]]
            after = query.get("pageToken", [""])[0]
            names = [n for n in names if n > after]
            page: dict[str, Any] = {"items": [self.metadata(server.objects[n]) for n in names[:size]]}
            if len(names) > size:
                page["nextPageToken"] = names[size - 1]
            self.reply(200, json.dumps(page).encode(), "list")
            return
        download = url.path.startswith(f"/download{objects}/")
        name = urllib.parse.unquote(url.path.removeprefix(f"/download{objects}/" if download else f"{objects}/"))
        obj = server.objects.get(name)
        if obj is None or not (url.path.startswith(f"{objects}/") or download) or \
                query.get("generation", [obj["generation"]]) != [obj["generation"]]:
            self.reply(404, b'{"error": {"code": 404}}', "404")
            return
        if not download:
            self.reply(200, json.dumps(self.metadata(obj)).encode(), "metadata")
            return
        if query.get("alt") != ["media"]:
            self.reply(404, b'{"error": {"code": 404}}', "404")
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(obj["size"]))
        self.send_header("x-goog-generation", obj["generation"])
        self.end_headers()
        if name in server.extra:
            self.wfile.write(server.extra[name])
        else:
            buffer = bytearray(BLOCK)
            view = memoryview(buffer)
            with open(server.folder / obj["file"], "rb", buffering=0) as source:
                while count := source.readinto(buffer):
                    self.wfile.write(view[:count])
        server.count("media", obj["size"])


class Metadata(http.server.BaseHTTPRequestHandler):
    """The GCE metadata server's token endpoint, for the copier's token."""

    token = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path.split("?")[0] != "/computeMetadata/v1/instance/service-accounts/default/token" or \
                self.headers.get("Metadata-Flavor") != "Google":
            self.send_error(404 if self.headers.get("Metadata-Flavor") == "Google" else 403)
            return
        body = json.dumps({"access_token": self.token, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(args: argparse.Namespace) -> None:
    """The server's process: serves until its stdin closes; its URL and its metadata
    server's host:port on stdout."""
    folder = Path(args.serve)
    index = json.loads((folder / "index.json").read_text())
    extra = {MANIFEST: Path(args.manifest_file).read_bytes()} if args.manifest_file else {}
    tls = None
    if args.cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.cert, args.key)
    server = Server(folder, index, extra, args.token, tls, args.page_size)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Metadata.token = args.token
    metadata = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=metadata.serve_forever, daemon=True).start()
    print(f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]} 127.0.0.1:{metadata.server_address[1]}",
          flush=True)
    sys.stdin.read()
    server.shutdown()


# --- the floor --------------------------------------------------------------------------------

def floor(args: argparse.Namespace) -> None:
    """The plain parallel client: args.floor is a JSON file {url, token, dest, workers,
    entries}. Prints {"seconds", "bytes"}; raises on any entry not whole."""
    job = json.loads(Path(args.floor).read_text())
    started = time.monotonic()
    url = urllib.parse.urlsplit(job["url"])
    context = ssl.create_default_context() if url.scheme == "https" else None
    dest = job["dest"]
    os.makedirs(dest, exist_ok=True)
    todo = sorted(job["entries"], key=lambda e: (e["size"], e["name"]))
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {job['token']}"}

    def worker(number: int) -> int:
        connection: http.client.HTTPConnection = (
            http.client.HTTPSConnection(url.hostname or "", url.port, context=context) if context
            else http.client.HTTPConnection(url.hostname or "", url.port))
        buffer = bytearray(BLOCK)
        view = memoryview(buffer)
        done = 0
        while True:
            with lock:
                if not todo:
                    break
                entry = todo.pop(0)
            path = (f"/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(entry['name'], safe='')}"
                    f"?alt=media&generation={entry['generation']}")
            connection.request("GET", path, headers=headers)
            answer = connection.getresponse()
            if answer.status != 200:
                raise RuntimeError(f"{entry['name']}: HTTP {answer.status}")
            digest = hashlib.md5()  # noqa: S324
            partial = os.path.join(dest, f".partial-{number}-{done}")
            size = 0
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                while count := answer.readinto(buffer):
                    digest.update(view[:count])
                    _write_all(fd, view[:count])
                    size += count
            finally:
                os.close(fd)
            if size != entry["size"] or md5_b64(digest) != entry["md5"]:
                raise RuntimeError(f"{entry['name']}: {size} bytes, MD5 {md5_b64(digest)}, not the entry's")
            os.replace(partial, os.path.join(dest, entry["name"].rsplit("/", 1)[-1]))
            done += 1
        connection.close()
        return done

    with concurrent.futures.ThreadPoolExecutor(job["workers"]) as pool:
        done = sum(pool.map(worker, range(job["workers"])))
    assert done == len(job["entries"])
    print(json.dumps({"seconds": round(time.monotonic() - started, 3), "bytes": sum(e["size"] for e in job["entries"])}))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


# --- the copier side --------------------------------------------------------------------------

def run_measured(command: list[str], env: dict[str, str]) -> tuple[str, float, float]:
    """Runs `command`; its stdout, wall seconds and CPU seconds (user + system, its own)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if process.returncode:
        raise RuntimeError(f"{command[:4]} exited {process.returncode}: {stderr[-2000:]}")
    return stdout, wall, usage.ru_utime + usage.ru_stime


def check_dest(dest: Path, index: list[dict[str, Any]], deep: bool) -> None:
    """Every entry in `dest`, of its size (and MD5 when `deep`), nothing else."""
    names = sorted(p.name for p in dest.iterdir())
    assert names == sorted(e["file"] for e in index), names
    for e in index:
        assert (dest / e["file"]).stat().st_size == e["size"], e["file"]
        if deep:
            digest = hashlib.md5()  # noqa: S324
            with open(dest / e["file"], "rb") as f:
                while block := f.read(BLOCK):
                    digest.update(block)
            assert md5_b64(digest) == e["md5"], e["file"]


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(drop: bool) -> None:
    subprocess.run(["sync"], check=True)
    if drop:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


@contextlib.contextmanager
def server_process(folder: Path, tls_dir: Path, token: str, manifest: bytes | None,
                   page_size: int) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    command = [sys.executable, __file__, "--serve", str(folder), "--token", token, "--page-size", str(page_size),
               "--cert", str(tls_dir / "tls.crt"), "--key", str(tls_dir / "tls.key")]
    if manifest is not None:
        (tls_dir / "manifest.json").write_bytes(manifest)
        command += ["--manifest-file", str(tls_dir / "manifest.json")]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url, metadata = process.stdout.readline().split()
        yield url, metadata, process
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(10)


def make_tls(folder: Path) -> None:
    sys.path.insert(0, str(REPO / "operator"))
    from cachewarm.admission import certificates as certs  # noqa: PLC0415

    now = dt.datetime.now(dt.timezone.utc)
    ca = certs.make_ca("bench-copier-floor", now=now)
    serving = certs.make_serving_cert(ca, ["127.0.0.1"], now=now)
    (folder / "ca.pem").write_bytes(ca.cert_pem)
    (folder / "tls.crt").write_bytes(serving.cert_pem)
    (folder / "tls.key").write_bytes(serving.key_pem)


def stats(url: str, ca: Path) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection(parts.hostname or "", parts.port,
                                             context=ssl.create_default_context(cafile=str(ca)))
    connection.request("GET", "/_stats")
    got: dict[str, Any] = json.loads(connection.getresponse().read())
    connection.close()
    return got


def one_side(kind: str, args: argparse.Namespace, url: str, metadata: str, token: str, index: list[dict[str, Any]],
             dest: Path, work: Path, manifest_pin: str) -> dict[str, Any]:
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEWARM_", "STORAGE_EMULATOR_HOST",
                                                                           "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
                                                                           "GCE_METADATA_"))}
    if kind in ("copier", "baseline"):
        env = {**base_env, "STORAGE_EMULATOR_HOST": url, "CACHEWARM_COPY_BUCKET": BUCKET,
               "CACHEWARM_COPY_PREFIX": PREFIX.strip("/"), "CACHEWARM_COPY_DEST": str(dest),
               "REQUESTS_CA_BUNDLE": str(work / "ca.pem"), "GCE_METADATA_HOST": metadata,
               "CACHEWARM_COPY_MAX_BYTES": str(64 << 30)}
        if args.workers:
            env["CACHEWARM_COPY_WORKERS"] = str(args.workers)
        if manifest_pin:
            env["CACHEWARM_COPY_MANIFESTS"] = manifest_pin
        program = COPIER if kind == "copier" else work / "baseline_copier.py"
        stdout, wall, cpu = run_measured([sys.executable, "-I", "-S", str(program)], env)
        summary = json.loads(stdout.strip().splitlines()[-1])["cachewarm-copier"]
        assert (summary["copied"], summary["failed"], summary["errors"]) == (len(index), 0, []), summary
        assert (summary.get("auth"), summary.get("tokens")) == ("metadata", 1), summary  # the production path
        seconds, size = float(summary["seconds"]), int(summary["bytes"])
    else:
        job = work / "floor.json"
        job.write_text(json.dumps({"url": url, "token": token, "dest": str(dest),
                                   "workers": args.workers or 16, "entries": index}))
        env = {**base_env, "SSL_CERT_FILE": str(work / "ca.pem")}
        stdout, wall, cpu = run_measured([sys.executable, __file__, "--floor", str(job)], env)
        got = json.loads(stdout)
        seconds, size = float(got["seconds"]), int(got["bytes"])
    assert size == sum(e["size"] for e in index)
    return {"seconds": seconds, "wall": wall, "cpu": cpu, "mbps": size / MB / seconds}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sizes = sizes_for(args.entries, args.min_mb, args.max_mb, args.total_mb)
    folder, index = make_entries(Path(args.cache_dir), sizes)
    total = sum(e["size"] for e in index)
    work = Path(tempfile.mkdtemp(prefix="copier-floor-", dir=args.dest_root))
    make_tls(work)
    token = base64.urlsafe_b64encode(os.urandom(24)).decode()
    manifest = None
    if args.manifest:
        manifest = json.dumps({"version": 2, "entries": [
            {"name": e["file"], "size": e["size"], "md5": e["md5"], "generation": e["generation"]} for e in index]}).encode()
    sides = ("copier", "floor", "baseline") if args.baseline else ("copier", "floor")
    if args.baseline:  # that revision's copier.py, run the same way
        (work / "baseline_copier.py").write_bytes(subprocess.run(
            ["git", "-C", str(REPO), "show", f"{args.baseline}:operator/cachewarm/agents/copier.py"],
            check=True, capture_output=True).stdout)
    rounds: list[dict[str, Any]] = []
    print(f"{len(index)} entries, {total / MB:.0f} MB ({min(sizes) / MB:.1f}-{max(sizes) / MB:.1f} MB each), "
          f"{'manifest' if args.manifest else 'listing'} mode, workers {args.workers or 16}; "
          f"drop caches: {args.drop_caches}; work dir {work}", flush=True)
    for path in folder.iterdir():  # the server's files in the page cache, for every side alike
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(BLOCK * 8):
                    pass
    with server_process(folder, work, token, manifest, args.page_size) as (url, metadata, server):
        pin = f"{MANIFEST}#{1_800_000_000_000_000}" if manifest is not None else ""  # Server's generation
        for number in range(args.rounds + 1):  # round 0: a warm-up of each, not counted
            # The sides' order: rotated round by round, and reversed every other rotation.
            turn = sides[number % len(sides):] + sides[:number % len(sides)]
            order = turn if (number // len(sides)) % 2 else turn[::-1]
            row: dict[str, Any] = {"round": number, "order": list(order), "load": os.getloadavg()[0]}
            for kind in order:
                dest = work / f"{kind}-{number}"
                settle(args.drop_caches)
                before, server_cpu = stats(url, work / "ca.pem"), cpu_of(server.pid)
                got = one_side(kind, args, url, metadata, token, index, dest, work, pin)
                after = stats(url, work / "ca.pem")
                got["serverCpu"] = cpu_of(server.pid) - server_cpu
                got["requests"] = {k: v - before["counts"].get(k, 0) for k, v in after["counts"].items()
                                   if v - before["counts"].get(k, 0) and k != "stats"}
                check_dest(dest, index, deep=number == 0)
                shutil.rmtree(dest)
                row[kind] = got
            row["ratio"] = row["copier"]["mbps"] / row["floor"]["mbps"]
            if args.baseline:
                row["baselineRatio"] = row["baseline"]["mbps"] / row["floor"]["mbps"]
            print(f"round {number}{' (warm-up)' if not number else ''}: load {row['load']:.2f}, "
                  + ", ".join(f"{k} {row[k]['mbps']:.0f} MB/s ({row[k]['seconds']:.2f} s, CPU {row[k]['cpu']:.2f} s, "
                              f"server CPU {row[k]['serverCpu']:.2f} s, {row[k]['requests']})" for k in order)
                  + f"; copier/floor {row['ratio']:.3f}"
                  + (f", baseline/floor {row['baselineRatio']:.3f}" if args.baseline else ""), flush=True)
            rounds.append(row)
    shutil.rmtree(work)
    counted = rounds[1:]
    ratios = [r["ratio"] for r in counted]
    result = {"entries": len(index), "bytes": total, "mode": "manifest" if args.manifest else "listing",
              "workers": args.workers or 16, "dropCaches": args.drop_caches, "rounds": rounds,
              "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    if args.baseline:
        base_ratios = [r["baselineRatio"] for r in counted]
        result["baselineRevision"] = args.baseline
        result["baselineRatio"] = {"median": statistics.median(base_ratios), "min": min(base_ratios),
                                   "max": max(base_ratios)}
        print(f"baseline {args.baseline}: baseline/floor paired {result['baselineRatio']['median']:.3f} "
              f"({result['baselineRatio']['min']:.3f}-{result['baselineRatio']['max']:.3f})")
    for kind in sides:
        result[kind] = {m: statistics.median(r[kind][m] for r in counted) for m in ("mbps", "seconds", "wall", "cpu")}
    print(f"median over {len(counted)} rounds: copier {result['copier']['mbps']:.0f} MB/s "
          + (f"(baseline {result['baseline']['mbps']:.0f} MB/s, CPU {result['baseline']['cpu']:.2f} s) "
             if args.baseline else "") +
          f"(CPU {result['copier']['cpu']:.2f} s), floor {result['floor']['mbps']:.0f} MB/s "
          f"(CPU {result['floor']['cpu']:.2f} s); copier/floor paired {result['ratio']['median']:.3f} "
          f"({result['ratio']['min']:.3f}-{result['ratio']['max']:.3f})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--entries", type=int, default=40)
    parser.add_argument("--min-mb", type=float, default=1.0)
    parser.add_argument("--max-mb", type=float, default=200.0)
    parser.add_argument("--total-mb", type=float, default=2048.0)
    parser.add_argument("--workers", type=int, default=0, help="both sides' connections (0: the copier's default, 16)")
    parser.add_argument("--page-size", type=int, default=1000, help="the listing's items per page at most")
    parser.add_argument("--manifest", action="store_true", help="the copier in manifest mode (else listing mode)")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each side (root)")
    parser.add_argument("--cache-dir", default="/tmp/cachewarm-bench-entries")
    parser.add_argument("--dest-root", default="/tmp", help="where the fresh directories are made (the same disk)")
    parser.add_argument("--baseline", help="a git revision whose copier.py is a third side (e.g. one before a change)")
    parser.add_argument("--json", help="write the results here")
    # internal: the server's and the floor's processes
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--floor", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--manifest-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.floor:
        floor(args)
        return
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
