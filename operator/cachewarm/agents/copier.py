"""cachewarm's copier: a cache's entries from its bucket into a local directory, so that a
training process reads them as from local disk (issue 14's local copy, the part that runs
in the pod). It runs with the training image's own python, as the warmer does, so it needs
only the standard library and the image needs no GCS library; in one of two ways:

- As an init container (main()): the webhook adds one to a training pod that runs
  /opt/cachewarm/cachewarm_copier.py, shipped in the warmer image, as `python -I -S
  cachewarm_copier.py`; its summary goes to stdout.
- In process: no init container, which saves the pod's start the second or so the kubelet
  takes to notice one's exit. The pod's PYTHONPATH starts with a ConfigMap volume holding
  this file as cachewarm_copier.py, the reporter, the warmer and cachewarm's
  sitecustomize.py, which starts the copy at interpreter start (with
  CACHEWARM_COPY_IN_PROCESS=1). Once per pod: the process takes an exclusive flock on
  `<CACHEWARM_COPY_SUMMARY>.lock` (beside the summary, in the pod's emptyDir), and if the
  summary file is not there yet it starts this file as its child (child(): `python -s -S -P`,
  the locked descriptor inherited, so the lock is held until the child exits; its stdout
  /dev/null, its summary on stderr) and goes on with its own code. Every process of the
  pod that started before the copy was done (this one, the pod's other python processes:
  other containers, subprocesses, torchrun's workers) waits for the lock when its `import
  jax` returns, at most the deadline plus the grace, so JAX, which reads its cache only
  when it compiles, never reads a copy half done; a process that never imports jax never
  waits. The child stops itself the grace after its deadline (as main(), the summary
  says so). Where no child can be started (no lock file can be opened, no python to
  spawn), copy_in_process() copies in the process itself, before its own code, and where
  the copier ended without a summary (killed), the process that finds so at `import jax`
  does: a daemon thread that the process waits for at most the
  deadline plus the grace, past which it goes on, the copy left behind to end by its own
  deadline (the summary says so); it never raises, never exits the process and writes
  nothing to stdout. Without CACHEWARM_COPY_SUMMARY every process copies, in process. The
  modules only a copy needs (ssl, http, hashlib, concurrent.futures) are imported when one
  starts.

Where `STORAGE_EMULATOR_HOST` is set it talks to that (no auth); otherwise to GCS with the
pod's token from the metadata server (GKE Workload Identity).

- What it copies: the union of the entries named by the manifests of the pod's pools (each
  pool's warmer writes one, `<prefix>.cachewarm/pools/<namespace>/<cache>/<pool>.json`:
  `{"version": 1, "entries": [{"name": "<program>-<sha256>-cache", "size": N}, ...], ...}`),
  matched by name against the JAX entries (`<program>-<sha256>-cache`) directly under the
  prefix; names a manifest has that the bucket does not are counted (`notInBucket`). When
  no manifest is given, or one is missing (404) or unreadable (not JSON, not that shape),
  every entry under the prefix instead, and the summary says why (`source: "prefix"`,
  `manifestsMissing`, `manifestError`). At most `max_bytes` in all: the entries already in
  the destination with GCS's size first (not downloaded again, counted `present`; they are
  on disk anyway), then the smallest first (the most entries for the budget); the rest are
  left out and counted.
- How: `workers` downloads at once; each into a hidden partial file whose name is unique
  to the copier process and the download (pid, a random token, a counter, created with
  O_EXCL), so several copiers can fill one shared directory (a node's hostPath) at once;
  it is checked against GCS's MD5 (every object that is not a composite has one) and only
  then renamed to its entry name (os.replace, atomic), so JAX never opens a partial or
  corrupt entry. Partial files left by a killed copier are removed after an hour.
- Retries: each request and the reading of its answer are one attempt, so a connection
  that breaks mid-body (reset, closed early, timed out) is tried again as one refused at
  the start; 408, 429, 5xx and broken connections get 4 attempts, a download whose bytes
  do not match GCS's MD5 or size (a corrupted transfer) 3, and a failed attempt's partial
  file is removed. Between attempts a full-jitter backoff (uniform(0, 0.5 s x 2^n), so the
  pods of a job started at once do not retry in step), or the Retry-After seconds of a 429
  or 503; never beyond the deadline, which bounds every request and after which nothing
  is started.
- TLS: run with `-I`, python reads no PYTHON* variables, and requests' REQUESTS_CA_BUNDLE
  is not OpenSSL's; pods behind a TLS-intercepting proxy set it (google-auth users too), so
  the copier trusts the CAs of REQUESTS_CA_BUNDLE, else CURL_CA_BUNDLE (a PEM file, or a
  directory of c_rehash'ed ones), as well as the defaults (which honor SSL_CERT_FILE and
  SSL_CERT_DIR): unlike requests, not instead of them, since pods often set the variable
  to an internal CA for their own services while reaching GCS directly. A bundle that
  cannot be loaded is an error in the summary and the defaults are used; a certificate
  that does not verify is not retried. One TLS context serves every connection of a copy
  (see ssl_context: urllib's default loads the CA store again for each).
- It never fails the pod: whatever goes wrong (no bucket, no network, a bad entry), it
  says so in its summary and exits 0 (in process: returns); the process then starts with
  what was copied, a cold start for the rest. A copy still running the grace after its
  deadline (a read that the deadline cannot interrupt) is stopped (the init container
  exits) or left behind (in process), cold unless something was copied or present.

Settings (environment):
  CACHEWARM_COPY_BUCKET      the bucket (required)
  CACHEWARM_COPY_PREFIX      the entries' object-name prefix ('' or 'a/b', slashes trimmed)
  CACHEWARM_COPY_DEST        the local directory (required; created if missing)
  CACHEWARM_COPY_MANIFESTS   comma-separated object names of the pools' manifests; unset or
                             empty: every entry under the prefix
  CACHEWARM_COPY_MAX_BYTES   byte budget (default 8 GiB)
  CACHEWARM_COPY_WORKERS     downloads at once (default 16, 1..64)
  CACHEWARM_COPY_DEADLINE_SECONDS  no download is started after this (default 300)
  CACHEWARM_COPY_GRACE_SECONDS  after the deadline, how long a copy still running is waited
                             for before it is stopped or left behind (default 15)
  CACHEWARM_COPY_SUMMARY     if set, a file the summary JSON is also written to (atomically);
                             in process, also the once-per-pod guard (see above)
  CACHEWARM_COPY_IN_PROCESS  "1": sitecustomize.py starts child() or runs copy_in_process()
                             (not read here)
  STORAGE_EMULATOR_HOST      a GCS emulator's base URL (no auth) instead of GCS
  REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE  the CAs to trust for HTTPS (see TLS above)

Summary (one line `{"cachewarm-copier": {...}}` on stdout, in process (child or not) on
stderr, and in CACHEWARM_COPY_SUMMARY):
  source "manifest" | "prefix"; wanted (entries planned: copied + present + failed);
  copied, bytes (downloaded); present, presentBytes (already there, kept); failed;
  leftOut {notAnEntry, notInManifest, notInBucket, overBudget}; errors (at most 5, 300
  characters each); cold (the pod starts without entries it should have had: nothing
  copied or present and something went wrong, or the listing failed); seconds; and, on a
  fallback, manifestsMissing (the names that were 404, at most 5) and/or manifestError (the
  first other failure, after which no further manifest is read). Manifests are read with
  the same retries as entries.
"""

from __future__ import annotations

# Only what is cheap to import here: in process, every python process of the pod imports
# this module, most of them to find the copy done. What a copy needs is imported by the
# code that needs it.
import itertools
import json
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    import ssl
    import urllib.error
    from collections.abc import Callable, Iterable, Mapping
    from typing import TextIO

ENTRY = re.compile(r"^[^/]+-(?P<hash>[0-9a-f]{64})-cache$")
GCS = "https://storage.googleapis.com"
METADATA_TOKEN = "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token"
ATTEMPTS = 4
CORRUPT_ATTEMPTS = 3  # of the ATTEMPTS, at most this many that read bytes other than GCS's
BACKOFF_SECONDS = 0.5
RETRIED = frozenset({408, 429, 500, 502, 503, 504})
RETRY_AFTER = frozenset({429, 503})  # the statuses whose Retry-After is honored
REQUEST_TIMEOUT_SECONDS = 30.0
PARTIAL = ".cachewarm-partial-"
STALE_PARTIAL_SECONDS = 3600.0
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_ERRORS, MAX_ERROR_CHARS = 5, 300
# The env names of the settings above, spelled here only: the operator's builders import them
# (through cachewarm.api.constants). sitecustomize.py reads some of them without importing
# this module and keeps copies, which tests/unit/test_layout.py compares with these.
ENV_COPY_BUCKET = "CACHEWARM_COPY_BUCKET"
ENV_COPY_PREFIX = "CACHEWARM_COPY_PREFIX"
ENV_COPY_DEST = "CACHEWARM_COPY_DEST"
ENV_COPY_MANIFESTS = "CACHEWARM_COPY_MANIFESTS"
ENV_COPY_MAX_BYTES = "CACHEWARM_COPY_MAX_BYTES"
ENV_COPY_WORKERS = "CACHEWARM_COPY_WORKERS"
ENV_COPY_DEADLINE_SECONDS = "CACHEWARM_COPY_DEADLINE_SECONDS"
ENV_COPY_GRACE_SECONDS = "CACHEWARM_COPY_GRACE_SECONDS"
ENV_COPY_SUMMARY = "CACHEWARM_COPY_SUMMARY"
ENV_COPY_IN_PROCESS = "CACHEWARM_COPY_IN_PROCESS"  # read by sitecustomize.py, not here


# NamedTuples, not dataclasses: those import inspect, milliseconds of every process's start.
class Settings(NamedTuple):
    bucket: str
    prefix: str  # object-name prefix, '' or ending in '/'
    dest: str
    manifests: tuple[str, ...]  # the manifests' object names; (): every entry under the prefix
    max_bytes: int
    workers: int
    deadline_seconds: float
    endpoint: str  # GCS's or the emulator's base URL
    ca_bundle: str = ""  # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE; '': the default CAs

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Raises KeyError or ValueError for a missing or malformed setting."""
        prefix = env.get(ENV_COPY_PREFIX, "").strip("/")
        manifests = (m.strip() for m in env.get(ENV_COPY_MANIFESTS, "").split(","))
        return cls(
            bucket=env[ENV_COPY_BUCKET], prefix=f"{prefix}/" if prefix else "",
            dest=env[ENV_COPY_DEST],
            manifests=tuple(dict.fromkeys(m for m in manifests if m)),
            max_bytes=int(env.get(ENV_COPY_MAX_BYTES, str(8 << 30))),
            workers=max(1, min(int(env.get(ENV_COPY_WORKERS, "16")), 64)),
            deadline_seconds=float(env.get(ENV_COPY_DEADLINE_SECONDS, "300")),
            endpoint=(env.get("STORAGE_EMULATOR_HOST") or GCS).rstrip("/"),
            # requests' order; an empty one is unset, as there.
            ca_bundle=env.get("REQUESTS_CA_BUNDLE") or env.get("CURL_CA_BUNDLE") or "",
        )


def manifest_entries(data: bytes) -> frozenset[str]:
    """The entry names a manifest lists. Raises ValueError for anything but a version-1
    manifest whose entries all have an entry name. Pure."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        raise ValueError(f"not a version-{MANIFEST_VERSION} manifest")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError("entries is not a list")
    names: set[str] = set()
    for item in entries:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or ENTRY.match(name) is None:
            raise ValueError(f"not an entry name: {name!r}"[:100])
        names.add(name)
    return frozenset(names)


class Plan(NamedTuple):
    download: list[Mapping[str, Any]]  # smallest first
    present: list[Mapping[str, Any]]  # already in the destination with GCS's size
    left: dict[str, int]  # left out, by reason

    @property
    def present_bytes(self) -> int:
        return sum(_size(o) for o in self.present)


def _size(obj: Mapping[str, Any]) -> int:
    return int(obj.get("size") or 0)


def plan(objects: Iterable[Mapping[str, Any]], prefix: str, names: frozenset[str] | None, max_bytes: int,
         present: Mapping[str, int] | None = None) -> Plan:
    """What to copy of a listing: the entries directly under `prefix` (the others counted
    `notAnEntry`) that are in `names` (every entry when None; `notInManifest`), the names
    not listed counted `notInBucket`; those already in the destination with the listed size
    (`present`: file name -> size) kept and counted against `max_bytes` first, then the rest
    smallest first within what is left of it (`overBudget`). Pure."""
    left = {"notAnEntry": 0, "notInManifest": 0, "notInBucket": 0, "overBudget": 0}
    wanted: list[Mapping[str, Any]] = []
    listed: set[str] = set()
    for obj in objects:
        name = str(obj.get("name") or "")
        base = name[len(prefix):] if name.startswith(prefix) else ""
        if ENTRY.match(base) is None:
            left["notAnEntry"] += 1
            continue
        listed.add(base)
        if names is not None and base not in names:
            left["notInManifest"] += 1
        else:
            wanted.append(obj)
    if names is not None:
        left["notInBucket"] = len(names - listed)
    local = present or {}
    by_size = sorted(wanted, key=lambda o: (_size(o), str(o.get("name"))))
    kept = [o for o in by_size if local.get(str(o["name"])[len(prefix):]) == _size(o)]
    total = sum(_size(o) for o in kept)
    download = []
    for obj in by_size:
        if local.get(str(obj["name"])[len(prefix):]) == _size(obj):
            continue
        if total + _size(obj) > max_bytes:
            left["overBudget"] += 1
            continue
        download.append(obj)
        total += _size(obj)
    return Plan(download=download, present=kept, left=left)


class CopyError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status GCS answered, if that was the trouble


class MetadataError(OSError):
    """The metadata server gave no token: retried as a connection error."""


class Broken(CopyError):
    """An answer cut short (the connection ended before the body did, with no error on
    the way): tried again, as a reset connection is."""


class Corrupt(CopyError):
    """A download whose bytes are not GCS's (MD5 or size): a transfer corrupted on the way,
    tried again (CORRUPT_ATTEMPTS in all), or an object changed since it was listed."""


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header's seconds; None when absent or not in the seconds form (an HTTP
    date: the backoff instead, rather than trust the pod's clock against GCS's). Pure."""
    try:
        seconds = float((value or "").strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None  # not nan, inf or negative


def retry_delay(attempt: int, left: float, after: float | None = None,
                uniform: Callable[[float, float], float] | None = None) -> float:
    """Seconds to wait before attempt `attempt` (1: the first retry): the server's
    Retry-After when it gave one, else full jitter, uniform(0, BACKOFF_SECONDS x
    2^(attempt-1)) (`uniform`: random.uniform when None), so that the pods of a job,
    started and refused at once, do not all come back at once too; never more than `left`,
    the time to the deadline. Pure but `uniform`."""
    if uniform is None:
        import random  # noqa: PLC0415

        uniform = random.uniform
    wait = after if after is not None else uniform(0.0, BACKOFF_SECONDS * 2 ** (attempt - 1))
    return max(0.0, min(wait, left))


def ssl_context(ca_bundle: str, https: bool = True) -> tuple[ssl.SSLContext | None, str]:
    """The one context every HTTPS connection of the copy uses, and an error to report (''
    when none): OpenSSL's default CAs (SSL_CERT_FILE and SSL_CERT_DIR included) and, when
    given, `ca_bundle`'s (a PEM file, or a directory of c_rehash'ed ones); the defaults
    alone when the bundle cannot be loaded, which never stops the copy. One for the whole
    copy: without one, urllib's HTTPSConnection makes a new context for each connection,
    and each loads the system's CA store again (25-35 ms of CPU here: a copy of 100
    entries from GCS spent seconds of CPU on it). None when
    the endpoint is not HTTPS (`https` false) and no bundle is given: nothing to load."""
    if not ca_bundle and not https:
        return None, ""
    import ssl  # noqa: PLC0415

    error = ""
    context = ssl.create_default_context()
    if ca_bundle:
        try:
            if os.path.isdir(ca_bundle):
                context.load_verify_locations(capath=ca_bundle)
            else:
                context.load_verify_locations(cafile=ca_bundle)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            error = f"CA bundle {ca_bundle}: {type(exc).__name__}: {exc}; the default CAs instead"
            context = ssl.create_default_context()  # not one the bundle loaded a part of
    context.set_alpn_protocols(["http/1.1"])  # as http.client does with the contexts it makes
    return context, error


T = TypeVar("T")


def _close(answer: urllib.error.HTTPError) -> None:
    try:
        answer.close()
    except Exception:  # noqa: BLE001, S110 - one made without a body has nothing to close
        pass


class Client:
    """The GCS JSON API calls the copier makes (list, media download), with retries."""

    def __init__(self, endpoint: str, token: Callable[[], str | None], context: ssl.SSLContext | None = None) -> None:
        import urllib.request  # noqa: PLC0415

        self.endpoint, self.token = endpoint, token
        # urlopen's handlers (the pod's HTTP(S)_PROXY included), with `context` for HTTPS.
        self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
        self._partials = itertools.count()
        self._lock = threading.Lock()
        # pid alone is not unique: init containers of pods sharing a hostPath are often pid 1 each.
        self._run = f"{os.getpid()}-{os.urandom(6).hex()}"
        # time.monotonic() after which no request starts and downloads in flight stop, so
        # the deadline bounds a black-holed network too (run() sets it).
        self.deadline = float("inf")

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CopyError("the deadline passed")
        return left

    def _open(self, url: str) -> Any:
        """One request, bounded by the time left; urllib's errors as they come."""
        import urllib.request  # noqa: PLC0415

        # Inside the attempts: GKE's metadata server may refuse a pod's first requests for
        # a few seconds after it starts, as an init container does.
        bearer = self.token()
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        return self._opener.open(urllib.request.Request(url, headers=headers),
                                 timeout=min(REQUEST_TIMEOUT_SECONDS, self._remaining()))

    def _attempts(self, url: str, attempt: Callable[[], T]) -> T:
        """`attempt()`, a request and the reading of its whole answer, until it succeeds:
        a connection broken mid-body is retried as one refused at the start. ATTEMPTS at
        most (CORRUPT_ATTEMPTS of them Corrupt), retry_delay apart. Raises CopyError, at
        once for a status not worth retrying and at the deadline."""
        import http.client  # noqa: PLC0415
        import ssl  # noqa: PLC0415
        import urllib.error  # noqa: PLC0415

        last: Exception | None = None
        after: float | None = None
        corrupt = 0
        for number in range(ATTEMPTS):
            if number:
                time.sleep(retry_delay(number, self._remaining(), after))
            after = None
            try:
                return attempt()
            except urllib.error.HTTPError as exc:
                _close(exc)  # its connection, now rather than when collected
                if exc.code not in RETRIED:
                    raise CopyError(f"HTTP {exc.code} for {url}", exc.code) from None
                if exc.code in RETRY_AFTER:
                    after = retry_after_seconds(exc.headers.get("Retry-After"))
                    if after is not None and number + 1 < ATTEMPTS and after >= self._remaining():
                        # Waiting would end at the deadline with nothing to show for it.
                        raise CopyError(f"HTTP {exc.code} for {url}: Retry-After {after:g} s is past the "
                                        f"deadline", exc.code) from None
                last = exc
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, ssl.SSLCertVerificationError):  # the same every time
                    raise CopyError(f"{url}: {exc.reason}") from None
                last = exc
            except Corrupt as exc:
                corrupt += 1
                if corrupt >= CORRUPT_ATTEMPTS:
                    raise CopyError(f"gave up after {corrupt} corrupt downloads: {exc}") from None
                last = exc
            except (Broken, OSError, http.client.HTTPException) as exc:
                # Refused, reset, closed early or timed out, connecting or mid-body
                # (http.client.IncompleteRead is not an OSError).
                last = exc
        raise CopyError(f"gave up after {ATTEMPTS} attempts: {last}")

    def _media(self, bucket: str, name: str) -> str:
        import urllib.parse  # noqa: PLC0415

        return (f"{self.endpoint}/download/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
                f"{urllib.parse.quote(name, safe='')}?alt=media")

    def _json(self, url: str) -> Any:
        def attempt() -> Any:
            with self._open(url) as answer:
                return json.load(answer)  # a body cut short raises IncompleteRead: retried
        return self._attempts(url, attempt)

    def list(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        import urllib.parse  # noqa: PLC0415

        out: list[dict[str, Any]] = []
        token = ""
        while True:
            # matchGlob: the entries directly under the prefix, not other caches' folders below it.
            query = {"prefix": prefix, "matchGlob": f"{prefix}*", "fields": "items(name,size,md5Hash),nextPageToken",
                     "maxResults": "1000"}
            if token:
                query["pageToken"] = token
            page = self._json(f"{self.endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?"
                              f"{urllib.parse.urlencode(query)}")
            out += page.get("items") or []
            token = page.get("nextPageToken") or ""
            if not token:
                return out

    def read(self, bucket: str, name: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """A small object's content. Raises CopyError (with the status on an HTTP error)."""
        url = self._media(bucket, name)

        def attempt() -> bytes:
            with self._open(url) as answer:
                data: bytes = answer.read(limit + 1)
                length = answer.headers.get("Content-Length")
            # read(n) returns what came before the connection ended, without an error.
            if length is not None and length.isdigit() and len(data) < min(int(length), limit + 1):
                raise Broken(f"{name}: the connection ended after {len(data)} of {length} bytes")
            return data
        data = self._attempts(url, attempt)
        if len(data) > limit:
            raise CopyError(f"{name}: larger than {limit} bytes")
        return data

    def partial_name(self) -> str:
        """A partial file name no other download, of this copier or another, uses."""
        with self._lock:
            return f"{PARTIAL}{self._run}-{next(self._partials)}"

    def download(self, bucket: str, obj: Mapping[str, Any], dest: str) -> int:
        """The object into `dest`/<its name within the prefix>, checked and renamed into
        place, retried as a whole (a partial file of its own each attempt). Returns its
        size. Raises CopyError."""
        url = self._media(bucket, str(obj["name"]))
        return self._attempts(url, lambda: self._download_once(url, obj, dest))

    def _download_once(self, url: str, obj: Mapping[str, Any], dest: str) -> int:
        """One attempt of download's; its partial file is removed whatever goes wrong. The
        disk's errors are CopyErrors (not retried), the network's as they come."""
        import base64  # noqa: PLC0415
        import hashlib  # noqa: PLC0415

        name = str(obj["name"])
        final = os.path.join(dest, name.rsplit("/", 1)[-1])
        partial = os.path.join(dest, self.partial_name())
        listed = None if obj.get("size") is None else int(obj["size"])
        digest = hashlib.md5()  # noqa: S324 - GCS's own checksum, not a security measure
        size = 0
        try:
            with self._open(url) as answer:
                try:
                    out = open(partial, "xb")
                except OSError as exc:
                    raise CopyError(f"{name}: {exc}") from None
                # read1: what one receive brings, so a body that trickles in still reaches
                # the deadline check below (read(n) would wait for all n bytes).
                read = getattr(answer, "read1", None) or answer.read
                with out:
                    while chunk := read(1 << 20):  # a reset or timeout mid-body raises here
                        self._remaining()  # a slow download stops at the deadline too
                        digest.update(chunk)
                        size += len(chunk)
                        try:
                            out.write(chunk)
                        except OSError as exc:
                            raise CopyError(f"{name}: {exc}") from None
            # read(n) returns b"" when the connection ends early, without an error.
            if listed is not None and size < listed:
                raise Broken(f"{name}: the connection ended after {size} of {listed} bytes")
            expected = obj.get("md5Hash")
            if expected and base64.b64encode(digest.digest()).decode() != expected:
                raise Corrupt(f"{name}: MD5 does not match GCS's (a corrupted transfer or a changed object)")
            if listed is not None and size != listed:
                raise Corrupt(f"{name}: {size} bytes read, GCS lists {listed}")
            try:
                os.replace(partial, final)
            except OSError as exc:
                raise CopyError(f"{name}: {exc}") from None
        except BaseException:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise
        return size


def metadata_token() -> Callable[[], str | None]:
    """The pod's access token from the metadata server, fetched once and then again
    shortly before it expires."""
    import http.client  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    # Never through the pod's HTTP(S)_PROXY: the metadata server is link-local.
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    lock = threading.Lock()
    state: dict[str, Any] = {"token": None, "until": 0.0}

    def token() -> str | None:
        with lock:
            if state["token"] is None or time.monotonic() > state["until"]:
                request = urllib.request.Request(METADATA_TOKEN, headers={"Metadata-Flavor": "Google"})
                try:
                    with direct.open(request, timeout=5) as answer:
                        got = json.load(answer)
                    state["token"] = str(got["access_token"])
                    state["until"] = time.monotonic() + max(float(got.get("expires_in", 300)) - 60, 30)
                except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as exc:
                    # Retried as a connection error (the server may refuse a new pod's first
                    # requests), and never taken for GCS's answer about an object (a 404 here
                    # is not a missing manifest).
                    raise MetadataError(f"metadata server token: {type(exc).__name__}: {exc}") from None
            return str(state["token"])
    return token


def local_entries(dest: str) -> dict[str, int]:
    """The files in `dest` (name -> size); partial files left by a killed copier over an
    hour ago are removed on the way (a live download writes at least every 30 s)."""
    out: dict[str, int] = {}
    now = time.time()
    with os.scandir(dest) as found:
        for item in found:
            try:
                if not item.is_file():
                    continue
                stat = item.stat()
                if item.name.startswith(PARTIAL):
                    if now - stat.st_mtime > STALE_PARTIAL_SECONDS:
                        os.unlink(item.path)
                    continue
                out[item.name] = stat.st_size
            except OSError:  # gone meanwhile (another copier's partial renamed or removed)
                continue
    return out


def new_summary(source: str) -> dict[str, Any]:
    return {"source": source, "wanted": 0, "copied": 0, "bytes": 0, "present": 0, "presentBytes": 0, "failed": 0,
            "leftOut": {"notAnEntry": 0, "notInManifest": 0, "notInBucket": 0, "overBudget": 0},
            "errors": [], "cold": False, "seconds": 0.0}


def add_error(summary: dict[str, Any], message: str) -> None:
    if len(summary["errors"]) < MAX_ERRORS:
        summary["errors"].append(message[:MAX_ERROR_CHARS])


def read_manifests(settings: Settings, client: Client, summary: dict[str, Any]) -> frozenset[str] | None:
    """The union of the manifests' entry names; None (every entry) when none is given or
    one is missing or unreadable, which the summary then says."""
    if not settings.manifests:
        return None
    names: set[str] = set()
    missing: list[str] = []
    error = ""
    for manifest in settings.manifests:
        try:
            names |= manifest_entries(client.read(settings.bucket, manifest))
        except CopyError as exc:
            if exc.status != 404:
                error = f"{manifest}: {exc}"
                break  # the prefix it is: the rest would not change that (and could be as slow)
            missing.append(manifest)
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            error = f"{manifest}: {exc}"
            break
    if not missing and not error:
        return frozenset(names)
    summary["source"] = "prefix"
    if missing:
        summary["manifestsMissing"] = [m[:MAX_ERROR_CHARS] for m in missing[:MAX_ERRORS]]
    if error:
        summary["manifestError"] = error[:MAX_ERROR_CHARS]
    return None


def run(settings: Settings, client: Client, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy what `plan` picks, counting into `summary` (a new_summary; main's watchdog
    reads the same one). Never raises: the summary says what happened."""
    import concurrent.futures  # noqa: PLC0415

    started = time.monotonic()
    client.deadline = started + settings.deadline_seconds
    summary = new_summary("prefix") if summary is None else summary
    summary["source"] = "manifest" if settings.manifests else "prefix"
    listed = False
    try:
        os.makedirs(settings.dest, exist_ok=True)
        names = read_manifests(settings, client, summary)
        objects = client.list(settings.bucket, settings.prefix)
        listed = True
        picked = plan(objects, settings.prefix, names, settings.max_bytes, local_entries(settings.dest))
        summary["leftOut"] = picked.left
        summary["wanted"] = len(picked.download) + len(picked.present)
        summary["present"], summary["presentBytes"] = len(picked.present), picked.present_bytes
        deadline = started + settings.deadline_seconds
        lock = threading.Lock()

        def one(obj: Mapping[str, Any]) -> None:
            if time.monotonic() > deadline:
                raise CopyError("deadline passed before it started")
            size = client.download(settings.bucket, obj, settings.dest)
            with lock:
                summary["copied"] += 1
                summary["bytes"] += size

        with concurrent.futures.ThreadPoolExecutor(settings.workers) as pool:
            for future in concurrent.futures.as_completed([pool.submit(one, obj) for obj in picked.download]):
                error = future.exception()
                if error is not None:
                    summary["failed"] += 1
                    add_error(summary, str(error))
    except Exception as exc:  # noqa: BLE001 - the pod starts anyway, cold
        add_error(summary, f"{type(exc).__name__}: {exc}")
    summary["cold"] = not listed or (summary["copied"] + summary["present"] == 0
                                     and bool(summary["errors"] or summary["failed"]))
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary


def write_summary(path: str, summary: Mapping[str, Any]) -> None:
    """The summary JSON at `path`, whole or not at all (a temp file renamed over it)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        with open(temp, "x") as out:
            json.dump(summary, out, sort_keys=True)
        os.replace(temp, path)
    except Exception:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


# After the deadline, this long (CACHEWARM_COPY_GRACE_SECONDS) for the requests in flight
# to give up before the init container exits anyway, or the process goes on without them
# (a read blocked in the kernel, or a name lookup, cannot be interrupted otherwise).
HARD_STOP_GRACE_SECONDS = 15.0


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A setting's seconds; `default` when unset or not a finite number."""
    try:
        value = float(env.get(name) or default)
    except ValueError:
        return default
    return value if abs(value) < float("inf") else default  # not nan either


def bound_seconds(env: Mapping[str, str]) -> float:
    """How long a copy is waited for at most: its deadline (at least 1 s) and the grace."""
    return (max(_seconds(env, ENV_COPY_DEADLINE_SECONDS, 300.0), 1.0)
            + max(_seconds(env, ENV_COPY_GRACE_SECONDS, HARD_STOP_GRACE_SECONDS), 0.0))


def copy(env: Mapping[str, str], live: dict[str, Any]) -> dict[str, Any]:
    """The copy `env`'s settings ask for (its CAs, GCS's token or the emulator), counted
    into `live` (a new_summary, which may be read meanwhile): its summary, `live` or, for
    bad settings, a cold one. Never raises. What main and copy_in_process both run."""
    try:
        settings = Settings.from_env(env)
        context, error = ssl_context(settings.ca_bundle, settings.endpoint.lower().startswith("https:"))
        if error:
            add_error(live, error)
        client = Client(settings.endpoint, (lambda: None) if env.get("STORAGE_EMULATOR_HOST") else metadata_token(),
                        context)
        return run(settings, client, live)
    except Exception as exc:  # noqa: BLE001 - bad settings: say so, start cold
        summary = new_summary("manifest" if env.get(ENV_COPY_MANIFESTS, "").strip(" ,") else "prefix")
        summary["cold"] = True
        add_error(summary, f"{type(exc).__name__}: {exc}")
        return summary


def left_behind(live: Mapping[str, Any], started: float, how: str) -> dict[str, Any]:
    """The summary of a copy still running past its deadline and grace: what it has done so
    far (a copy of `live`, which it goes on counting into), an error that says so (room
    made for it), cold unless something was copied or present."""
    summary = {**live, "errors": list(live["errors"])[:MAX_ERRORS - 1], "leftOut": dict(live["leftOut"])}
    add_error(summary, f"still running past the deadline: {how}")
    summary["cold"] = summary["copied"] + summary["present"] == 0
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary


def finish(summary: dict[str, Any], path: str, stream: TextIO | None) -> None:
    """The summary into the file at `path` when one is given (a failure is one more error)
    and as one line on `stream`. Never raises."""
    if path:
        try:
            write_summary(path, summary)
        except Exception as exc:  # noqa: BLE001 - the line still has it
            add_error(summary, f"summary file: {type(exc).__name__}: {exc}")
    try:
        if stream is not None:  # None: no such stream (pythonw)
            print(json.dumps({"cachewarm-copier": summary}, sort_keys=True), file=stream, flush=True)
    except Exception:  # noqa: BLE001, S110 - closed: nowhere to say it
        pass


def _hard_stop(live: dict[str, Any], started: float, stream: TextIO | None) -> None:
    finish(left_behind(live, started, "stopped"), os.environ.get(ENV_COPY_SUMMARY, ""), stream)
    os._exit(0)


def main(stream: TextIO | None = None) -> None:
    """The init container: the copy, its summary on `stream` (stdout unless given) and in its
    file, exit 0; stopped (os._exit) when it still runs the grace after its deadline."""
    out = sys.stdout if stream is None else stream
    live = new_summary("prefix")
    watchdog = threading.Timer(bound_seconds(os.environ), _hard_stop, args=(live, time.monotonic(), out))
    watchdog.daemon = True
    watchdog.start()
    finish(copy(os.environ, live), os.environ.get(ENV_COPY_SUMMARY, ""), out)
    sys.exit(0)


def child() -> None:
    """The copier child of a pod's python process (sitecustomize starts it, `python -s -S -P`,
    holding the pod's lock for it): main, its summary on stderr, the process's; its stdout
    is /dev/null, the process's own is the program's."""
    main(sys.stderr)


def pod_lock(path: str, summary: str, until: float) -> int | None:
    """A descriptor of the lock file `path` (made if missing, with its directory) holding an
    exclusive flock, taken once whoever holds it lets go (closing it releases it); read-only
    when it cannot be opened to write (another uid's file: flock takes a read-only one too).
    None when it can be neither opened nor locked, or when the file `summary` appears
    meanwhile (the copy is done). Polled, never past `until` (time.monotonic()): then
    TimeoutError (whoever holds it may hold it for good: a forked worker of a process that
    copied, a stopped copier)."""
    import fcntl  # noqa: PLC0415

    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError:
        pass  # then opening it says
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(path, flags, 0o666)
        except OSError:
            continue
        pause = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                pass
            except OSError:
                os.close(fd)
                return None
            if os.path.exists(summary) or time.monotonic() >= until:
                os.close(fd)
                if os.path.exists(summary):
                    return None
                raise TimeoutError(f"the pod's copy lock {path} still held")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
    return None


def copy_in_process() -> None:
    """From sitecustomize, where no copier child can copy (at interpreter start) or one
    ended without a summary (at `import jax`): the copy, once per pod, waited for at most
    its deadline and grace (see the module's doc); its summary on stderr and in its file.
    Never raises, never exits the process, writes nothing to stdout."""
    try:
        path = os.environ.get(ENV_COPY_SUMMARY, "")
        # Unguarded when there is no summary to tell that the copy is done, or no lock.
        try:
            lock = pod_lock(f"{path}.lock", path, time.monotonic() + bound_seconds(os.environ)) if path else None
        except TimeoutError:
            return  # another copy still holds the pod's lock: go on without (its copy may finish)
        try:
            if path and os.path.exists(path):
                return  # another process of the pod copied (or its copy is cold: no better now)
            live = new_summary("prefix")
            started = time.monotonic()
            done: list[dict[str, Any]] = []
            worker = threading.Thread(target=lambda: done.append(copy(os.environ, live)), name="cachewarm-copier",
                                      daemon=True)
            worker.start()
            worker.join(bound_seconds(os.environ))
            finish(done[0] if done else left_behind(live, started, "left behind"), path, sys.stderr)
        finally:
            if lock is not None:
                os.close(lock)
    except Exception as exc:  # noqa: BLE001 - the process starts whatever happens here
        try:
            print(f"cachewarm copier: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001, S110 - stderr closed
            pass


if __name__ == "__main__":
    main()
