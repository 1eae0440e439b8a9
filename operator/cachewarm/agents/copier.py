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
  /dev/null, its summary on stderr) and goes on with its own code. The child writes its
  plan (the entry names it keeps, `<CACHEWARM_COPY_SUMMARY>.plan`) once the destination is
  swept, before any download, and fetches first any planned entry a process of the pod
  asks for (a file of its name in `<CACHEWARM_COPY_SUMMARY>.want/`: Downloads). Every
  process of the pod that started before the copy was done (this one, the pod's other
  python processes: other containers, subprocesses, torchrun's workers), once its `import
  jax` returns, has JAX's read of a planned entry wait for that entry's file (asked for),
  at most the deadline plus the grace, so JAX, which reads its cache only when it
  compiles, never reads an entry half done nor waits for entries it does not read (with
  another jax, it waits for the whole copy there); a process that never imports jax never
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

Credentials: GCS's (or, where `STORAGE_EMULATOR_HOST` is set, that emulator's) requests
carry the pod's access token from the metadata server (GKE Workload Identity), at
GCE_METADATA_HOST (host[:port], google-auth's variable; GCE_METADATA_ROOT, its old name,
too) or GCE's 169.254.169.254. The emulator does not switch that off: where
GCE_METADATA_HOST names a server the token is sent to the emulator too (the testbed's
proxy checks it). Only where STORAGE_EMULATOR_HOST is set and no metadata host is named
(an emulator on a developer's machine, which has no metadata server) are requests sent
without a token, and the summary says so (`auth: "none"`); a pod on GKE does not set
STORAGE_EMULATOR_HOST. A token is fetched when first needed and again before it expires:
once less than min(300 s, half its stated lifetime) is left (google-auth refreshes 3 min
45 s early, gcsfs 5 min). GCS's 401 to a token the client held valid (revoked, or dead
before the expiry it stated) drops it and the request is tried again, once, with a new
one; a second 401 fails that request. A metadata server that gives no token is retried as
a refused connection (GKE's refuses a new pod's first requests for a few seconds).

- What it copies, and what it trusts (issue 28): with CACHEWARM_COPY_MANIFESTS set, the
  union of the entries named by the pools' manifests, each given as `<object>#<generation>`:
  the generation of the manifest the pool's warmer wrote, which the operator recorded from
  the warmer Job's own pod (status.warmup.pools[].manifestGeneration). Only that generation
  is read (its metadata must name it, its bytes must match that metadata's MD5), so a
  manifest rewritten since by whoever can write the bucket is not followed; an item without
  a generation is not read at all (counted, `manifestsUntrusted`), nor is a version-1
  manifest (it carries no digests; `manifestsRefused`). A manifest
  (`<prefix>.cachewarm/pools/<namespace>/<cache>/<pool>/<job>.json`, version 2: `{"version": 2,
  "entries": [{"name": "<program>-<sha256>-cache", "size": N, "md5": "<GCS md5Hash>",
  "generation": "<decimal>"}], ...}`) gives each entry's size, MD5 and generation, and the
  copier takes those, not the listing's: each entry is downloaded at that generation, at
  most that many bytes, and kept only if its MD5 is that one. The listing still says which
  names the bucket lacks (`notInBucket`). Set but naming no trusted manifest (the cache's
  pools have none recorded yet): nothing is trusted and nothing copied (`trusted: 0`,
  `nothingTrusted` says why). Unset (a cache without warm-up): every entry directly under
  the prefix, with the listing's size, MD5 and generation (the trust is the bucket's IAM);
  a listed object without them is skipped (`unverifiable`). Never a fallback from the
  manifests to the prefix: whoever could break a manifest could write the prefix too.
  Packs (issue 30): a manifest may name a pack (`"pack": {"name", "size", "md5",
  "generation"}`, an object `<job>.cachewarm-pack` in the manifest's own folder, written by
  the same warmer) and mark entries `"packed": true`; the entries to download that one pack
  holds (two or more) come from it in one request, read at that generation and checked
  against its size and MD5, in a thread beside the other downloads; each member is taken
  only under a planned entry's name and only if its bytes are that entry's size and MD5 as
  the manifest records them (names never come from the pack: one that is not such an
  entry's, a path included, is ignored, `packIgnored`), then renamed into place as a
  download is. Whatever a pack does not give (404, corrupt, not a pack, a member missing or
  wrong) is downloaded one by one (`packFallback`, and an error says which pack). A copy
  whose every entry is in a pack does not list the bucket (packed_listing): then 3 requests
  a start (the manifest's metadata and media, the pack) however many entries.
  At most `max_bytes` in all: the entries already in the destination first (not downloaded
  again, counted `present`: only a regular file, opened without following links, whose
  size and MD5 are the entry's; anything else under an entry's name, a symlink included,
  is replaced, counted `replaced`), then the smallest first (the most entries for the
  budget); the rest are left out and counted. Then, before any download, every other name
  in the destination is removed (`removedForeign`; sweep() says why and what is kept: the
  copier's own partial and summary files), so that JAX, which loads any `<key>-cache` there
  by name, finds only verified entries; a directory is left and said (`foreignDirs`). Once
  more after the downloads (a failed one's name) or after a copy that failed before its
  plan (nothing verified: nothing kept).
- How: `workers` downloads at once; each into a hidden partial file whose name is unique
  to the copier process and the download (pid, a random token, a counter, created with
  O_EXCL and O_NOFOLLOW, mode 0644), so several copiers could fill one directory at once;
  it is checked against the entry's MD5 and size and only then renamed to its entry name
  (os.replace, atomic: a symlink planted there is replaced, never followed), so JAX never
  opens a partial, corrupt or foreign entry. The destination is made 0755 where the copier
  makes it; a root that others may write (world-writable without the sticky bit, not ours)
  is said (`destWorldWritable`; an emptyDir is: 0777 and root's, but no other pod's).
  Partial files left by a killed copier are removed after an hour.
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
  CACHEWARM_COPY_MANIFESTS   comma-separated `<object>#<generation>` of the pools' manifests;
                             set but empty: nothing trusted, nothing copied; unset: every
                             entry under the prefix (see above)
  CACHEWARM_COPY_MAX_BYTES   byte budget (default 8 GiB)
  CACHEWARM_COPY_WORKERS     downloads at once (default 16, 1..64)
  CACHEWARM_COPY_DEADLINE_SECONDS  no download is started after this (default 300)
  CACHEWARM_COPY_GRACE_SECONDS  after the deadline, how long a copy still running is waited
                             for before it is stopped or left behind (default 15)
  CACHEWARM_COPY_SUMMARY     if set, a file the summary JSON is also written to (atomically);
                             in process, also the once-per-pod guard (see above)
  CACHEWARM_COPY_IN_PROCESS  "1": sitecustomize.py starts child() or runs copy_in_process()
                             (not read here)
  STORAGE_EMULATOR_HOST      a GCS emulator's base URL instead of GCS (see Credentials)
  GCE_METADATA_HOST          the metadata server, host[:port] (GCE_METADATA_ROOT too;
                             default 169.254.169.254; see Credentials)
  REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE  the CAs to trust for HTTPS (see TLS above)

Summary (one line `{"cachewarm-copier": {...}}` on stdout, in process (child or not) on
stderr, and in CACHEWARM_COPY_SUMMARY):
  source "manifest" | "prefix"; wanted (entries planned: copied + present + failed);
  copied, bytes (downloaded); present, presentBytes (already there, verified, kept);
  replaced (of the copied, those that replaced a file or link of that name); removedForeign
  (names removed from the destination that are not a verified entry, those replaced aside);
  foreignDirs (directories left there, when any); failed;
  leftOut {notAnEntry, notInManifest, notInBucket, overBudget, unverifiable}; in manifest
  mode trusted (manifests read at their generation and accepted), manifestsUntrusted
  (items without a generation, not read), manifestsRefused (read but refused: version 1,
  another generation or MD5) and, when it is 0, nothingTrusted (why); errors (at most 5, 300
  characters each); cold (the pod starts without entries it should have had: nothing
  copied or present and something went wrong, or the listing failed; in a torch cache also
  when no file of its archives is in place and an extraction failed); seconds;
  manifestsMissing (the names that were 404 at their generation, at most 5) and
  manifestError (the first other failure); destWorldWritable when so; auth "metadata" |
  "none" and, with "metadata", tokens (fetched from the metadata server) and tokensRefused
  (GCS's 401s that dropped a token); onDemand, onDemandEntries (in process, when a process
  asked for entries not yet taken: how many were fetched first on ask, the first 5 names).
  Manifests are read with the same retries as entries. In process, the summary may be
  written after the pod's first compiles (those waited only for their own entries): until
  then there is none (the reporter says nothing of the copy, neither cold nor failed).
  With CACHEWARM_TORCH_DIR: torch (seed_torch's counts; an archive extracted whole is
  unlinked from the destination, a mark left for a restarted copy: TORCH_EXTRACTED).
  With packs: packs (read and checked), packBytes, fromPack (of the copied, those written
  from a pack), packFallback, packIgnored.
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
    from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
    from typing import TextIO

ENTRY = re.compile(r"^[^/]+-(?P<hash>[0-9a-f]{64})-cache$")
GCS = "https://storage.googleapis.com"
METADATA_HOST = "169.254.169.254"  # GCE's, where GCE_METADATA_HOST names no other
METADATA_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
METADATA_TOKEN = f"http://{METADATA_HOST}{METADATA_TOKEN_PATH}"
HOST_PORT = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
REFRESH_BEFORE_SECONDS = 300.0  # a token is fetched again this long before it expires (or at half its life)
ATTEMPTS = 4
CORRUPT_ATTEMPTS = 3  # of the ATTEMPTS, at most this many that read bytes other than GCS's
BACKOFF_SECONDS = 0.5
RETRIED = frozenset({408, 429, 500, 502, 503, 504})
RETRY_AFTER = frozenset({429, 503})  # the statuses whose Retry-After is honored
REQUEST_TIMEOUT_SECONDS = 30.0
PARTIAL = ".cachewarm-partial-"
READ_BYTES = 256 << 10  # a download's buffer (see receiver)
STALE_PARTIAL_SECONDS = 3600.0
MANIFEST_VERSION = 2  # 1 named entries without digests: untrusted
GENERATION = re.compile(r"^[0-9]{1,20}$")  # GCS's generations: int64, as decimal strings
MD5 = re.compile(r"^[A-Za-z0-9+/]{22}==$")  # GCS's md5Hash: 16 bytes, base64
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
ENV_TORCH_DIR = "CACHEWARM_TORCH_DIR"  # a torch cache's Inductor directory: its archives are extracted there
ENV_TORCH_MAX_ARCHIVE_BYTES = "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"  # the warmer's too
TORCH_ARCHIVE = re.compile(r"^torch-inductor-[0-9a-f]{64}-cache$")  # the warmer's archive entries
TORCH_MAX_ARCHIVE_BYTES = 4 << 30  # the CRD's default maxArchiveSize: the uncompressed bytes of one archive
TORCH_MAX_FILES = 100000  # members, all archives (refused ones too)


# NamedTuples, not dataclasses: those import inspect, milliseconds of every process's start.
class Settings(NamedTuple):
    bucket: str
    prefix: str  # object-name prefix, '' or ending in '/'
    dest: str
    manifests: tuple[tuple[str, str], ...]  # the trusted manifests: (object name, generation)
    max_bytes: int
    workers: int
    deadline_seconds: float
    endpoint: str  # GCS's or the emulator's base URL
    ca_bundle: str = ""  # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE; '': the default CAs
    pinned: bool = False  # CACHEWARM_COPY_MANIFESTS set: only `manifests` are trusted; else the prefix
    untrusted: int = 0  # its items without a generation (not read)
    summary_path: str = ""  # CACHEWARM_COPY_SUMMARY: kept by the sweep where it is in `dest`
    token_url: str = ""  # the metadata server's token URL; '': no token (an emulator without one)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Raises KeyError or ValueError for a missing or malformed setting."""
        prefix = env.get(ENV_COPY_PREFIX, "").strip("/")
        manifests, untrusted = pinned_manifests(env.get(ENV_COPY_MANIFESTS, ""))
        return cls(
            bucket=env[ENV_COPY_BUCKET], prefix=f"{prefix}/" if prefix else "",
            dest=env[ENV_COPY_DEST],
            manifests=manifests, pinned=ENV_COPY_MANIFESTS in env, untrusted=untrusted,
            max_bytes=int(env.get(ENV_COPY_MAX_BYTES, str(8 << 30))),
            workers=max(1, min(int(env.get(ENV_COPY_WORKERS, "16")), 64)),
            deadline_seconds=float(env.get(ENV_COPY_DEADLINE_SECONDS, "300")),
            endpoint=(env.get("STORAGE_EMULATOR_HOST") or GCS).rstrip("/"),
            # requests' order; an empty one is unset, as there.
            ca_bundle=env.get("REQUESTS_CA_BUNDLE") or env.get("CURL_CA_BUNDLE") or "",
            summary_path=env.get(ENV_COPY_SUMMARY, ""),
            token_url=token_url(env),
        )


def token_url(env: Mapping[str, str]) -> str:
    """The metadata server's token URL the copy's requests take their token from (see the
    module's doc), '' for none: STORAGE_EMULATOR_HOST set and no metadata host named.
    Raises ValueError for a metadata host that is not host[:port]. Pure."""
    host = (env.get("GCE_METADATA_HOST") or env.get("GCE_METADATA_ROOT") or "").strip()
    if not host:
        return "" if env.get("STORAGE_EMULATOR_HOST") else METADATA_TOKEN
    if HOST_PORT.match(host) is None:
        raise ValueError(f"GCE_METADATA_HOST {host[:100]!r} is not host[:port]")
    return f"http://{host}{METADATA_TOKEN_PATH}"


def pinned_manifests(value: str) -> tuple[tuple[tuple[str, str], ...], int]:
    """CACHEWARM_COPY_MANIFESTS's `<object>#<generation>` items (duplicates once) and how
    many items had no generation (or not a decimal one): those are not trusted. Pure."""
    pinned: dict[tuple[str, str], None] = {}
    untrusted = 0
    for item in (m.strip() for m in value.split(",")):
        if not item:
            continue
        name, _, generation = item.rpartition("#")
        if name and GENERATION.match(generation):
            pinned[(name, generation)] = None
        else:
            untrusted += 1
    return tuple(pinned), untrusted


class Entry(NamedTuple):
    """What an entry must be: its size, GCS's md5Hash (base64) and its generation."""
    size: int
    md5: str
    generation: str


def _entry(size: Any, md5: Any, generation: Any) -> Entry | None:
    """An Entry of these values when each is one (size an int or GCS's decimal string),
    else None. Pure."""
    if isinstance(size, str) and size.isascii() and size.isdigit():
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return None
    if not isinstance(md5, str) or MD5.match(md5) is None:
        return None
    if not isinstance(generation, str) or GENERATION.match(generation) is None:
        return None
    return Entry(size, md5, generation)


class Pack(NamedTuple):
    """A manifest's pack (issue 30; the warmer's write_pack): one object holding the
    manifest's small entries back to back, read in one request instead of one per entry."""
    name: str  # the object's name, in the folder of the manifest that names it
    entry: Entry  # what the object must be: its size, MD5 and generation, as the manifest says


class Manifest(NamedTuple):
    entries: dict[str, Entry]  # name -> what the entry must be
    pack: Pack | None  # the pack the manifest names, None without one (or one refused: `pack_error`)
    packed: frozenset[str]  # the entries the manifest says are in the pack
    pack_error: str = ""


PACK_SUFFIX = ".cachewarm-pack"  # the warmer's PACK_SUFFIX
PACK_MAGIC = b"cachewarm-pack 1\n"  # the warmer's PACK_MAGIC
MAX_PACK_BYTES = 64 << 20  # the warmer's PACK_BYTES: a pack is read into memory whole
MAX_PACK_HEADER = 512  # a member's "<name> <size>\n" line, at most


def manifest_pack(doc: Mapping[str, Any], manifest: str) -> tuple[Pack | None, str]:
    """The pack a parsed manifest `doc` (the object `manifest`) names, and '' ; or None and
    why it is refused (a pack that is not an object of the manifest's own folder named
    *.cachewarm-pack, no valid size, MD5 and generation, or over MAX_PACK_BYTES); (None, '')
    without one. Pure."""
    item = doc.get("pack")
    if item is None:
        return None, ""
    folder = manifest.rsplit("/", 1)[0] + "/" if "/" in manifest else ""
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(name, str) or not name.startswith(folder) or "/" in name[len(folder):] \
            or not name.endswith(PACK_SUFFIX) or name == folder + PACK_SUFFIX:
        return None, f"the pack {str(name)[:100]!r} is not a pack in the manifest's folder"
    entry = _entry(item.get("size"), item.get("md5"), item.get("generation"))
    if entry is None:
        return None, f"the pack {name[:100]}: no valid size, md5 and generation"
    if entry.size > MAX_PACK_BYTES:
        return None, f"the pack {name[:100]}: larger than {MAX_PACK_BYTES} bytes"
    return Pack(name, entry), ""


def parse_manifest(data: bytes, manifest: str = "") -> Manifest:
    """A manifest's entries (manifest_entries) and the pack it names (manifest_pack: one
    refused leaves the entries to be read one by one, `pack_error` says why; `manifest` is
    the manifest's object name, whose folder the pack must be in). Raises ValueError as
    manifest_entries. Pure."""
    entries = manifest_entries(data)
    doc = json.loads(data)
    pack, error = manifest_pack(doc, manifest)
    packed = frozenset(str(e.get("name")) for e in doc["entries"] if e.get("packed") is True) if pack else frozenset()
    return Manifest(entries, pack, packed, error)


def pack_members(data: bytes) -> Iterator[tuple[str, memoryview]]:
    """The members of a pack, in order: (the name its header line gives, its bytes). The
    names are the pack's word only: a reader takes a member only under a name its trusted
    manifest gives, with that entry's size and MD5 (unpack). Raises ValueError where the
    bytes are not a pack (another start, a header line over MAX_PACK_HEADER bytes or not
    "<name> <decimal size>", a member past the end); the members before it stand. Pure."""
    if not data.startswith(PACK_MAGIC):
        raise ValueError("not a cachewarm pack")
    view = memoryview(data)
    at = len(PACK_MAGIC)
    while at < len(data):
        end = data.find(b"\n", at, at + MAX_PACK_HEADER)
        name, _, size = data[at:max(end, at)].decode("utf-8", "replace").rpartition(" ")
        if end < 0 or not name or not (size.isascii() and size.isdigit()):
            raise ValueError(f"a member's header at byte {at} is not '<name> <size>'")
        start = end + 1
        if start + int(size) > len(data):
            raise ValueError(f"the member {name[:100]!r} runs past the pack's end")
        yield name, view[start:start + int(size)]
        at = start + int(size)


def manifest_entries(data: bytes) -> dict[str, Entry]:
    """The entries a manifest lists (name -> Entry). Raises ValueError for anything but a
    version-2 manifest whose entries all have an entry name, a size, an MD5 and a
    generation (one name listed twice, differently, too). Pure."""
    doc = json.loads(data)
    if isinstance(doc, dict) and doc.get("version") == 1:
        raise ValueError("a version-1 manifest: it carries no digests, so nothing of it is trusted")
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        raise ValueError(f"not a version-{MANIFEST_VERSION} manifest")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError("entries is not a list")
    out: dict[str, Entry] = {}
    for item in entries:
        if not isinstance(item, dict):
            raise ValueError(f"not an entry: {item!r}"[:100])
        name = item.get("name")
        if not isinstance(name, str) or ENTRY.match(name) is None:
            raise ValueError(f"not an entry name: {name!r}"[:100])
        entry = _entry(item.get("size"), item.get("md5"), item.get("generation"))
        if entry is None:
            raise ValueError(f"{name}: no valid size, md5 and generation"[:100])
        if out.setdefault(name, entry) != entry:
            raise ValueError(f"{name}: listed twice, differently"[:100])
    return out


class Wanted(NamedTuple):
    name: str  # the object's name (prefix included)
    entry: Entry  # what it must be: the manifest's, or the listing's in prefix mode

    @property
    def base(self) -> str:
        return self.name.rsplit("/", 1)[-1]


class Plan(NamedTuple):
    download: list[Wanted]  # smallest first
    present: list[Wanted]  # already in the destination, verified
    left: dict[str, int]  # left out, by reason

    @property
    def present_bytes(self) -> int:
        return sum(w.entry.size for w in self.present)


def wanted_entries(objects: Iterable[Mapping[str, Any]], prefix: str,
                   names: Mapping[str, Entry] | None) -> tuple[list[Wanted], dict[str, int]]:
    """The entries of a listing to copy: those directly under `prefix` (the others counted
    `notAnEntry`) that are in `names` (the manifests' entries, whose size, MD5 and
    generation they take; `notInManifest`), the names not listed counted `notInBucket`; or,
    when `names` is None, every entry with the listing's size, MD5 and generation (one
    without them `unverifiable`). Pure."""
    left = {"notAnEntry": 0, "notInManifest": 0, "notInBucket": 0, "overBudget": 0, "unverifiable": 0}
    wanted: list[Wanted] = []
    listed: set[str] = set()
    for obj in objects:
        name = str(obj.get("name") or "")
        base = name[len(prefix):] if name.startswith(prefix) else ""
        if ENTRY.match(base) is None:
            left["notAnEntry"] += 1
            continue
        listed.add(base)
        if names is None:
            entry = _entry(obj.get("size"), obj.get("md5Hash"), obj.get("generation"))
            if entry is None:
                left["unverifiable"] += 1
            else:
                wanted.append(Wanted(name, entry))
        elif base not in names:
            left["notInManifest"] += 1
        else:
            wanted.append(Wanted(name, names[base]))
    if names is not None:
        left["notInBucket"] = len(set(names) - listed)
    return wanted, left


def plan(objects: Iterable[Mapping[str, Any]], prefix: str, names: Mapping[str, Entry] | None, max_bytes: int,
         present: Mapping[str, tuple[int, str]] | None = None) -> Plan:
    """What to copy of a listing (wanted_entries): those already in the destination
    (`present`: file name -> (size, MD5) of the regular files verified there) with the
    wanted size and MD5 kept and counted against `max_bytes` first, then the rest smallest
    first within what is left of it (`overBudget`). Pure."""
    wanted, left = wanted_entries(objects, prefix, names)
    local = present or {}
    by_size = sorted(wanted, key=lambda w: (w.entry.size, w.name))
    kept = [w for w in by_size if local.get(w.base) == (w.entry.size, w.entry.md5)]
    total = sum(w.entry.size for w in kept)
    download = []
    for w in by_size:
        if local.get(w.base) == (w.entry.size, w.entry.md5):
            continue
        if total + w.entry.size > max_bytes:
            left["overBudget"] += 1
            continue
        download.append(w)
        total += w.entry.size
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


def proxied(url: str) -> bool:
    """Whether a request to `url` goes through a proxy the environment names (HTTP_PROXY,
    HTTPS_PROXY and NO_PROXY, as urllib reads them)."""
    import urllib.parse  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    parts = urllib.parse.urlsplit(url)
    return bool(urllib.request.getproxies().get(parts.scheme)) and not urllib.request.proxy_bypass(parts.netloc)


def receiver(answer: Any) -> Callable[[memoryview], int]:
    """A function that fills a buffer with what one receive of `answer`'s body brings and
    says how many bytes (0: the body ended, or the connection did), so that a body that
    trickles in returns to its caller at each receive (read(n) waits for all n bytes).

    Into the caller's buffer, reused for the whole body: an http.client answer's body read
    from its connection's buffered reader (readinto1: what it holds, else one receive,
    straight into the buffer), never past its Content-Length. read1 would allocate a new
    object of the size asked for at every receive, which over TLS brings one record (16
    KiB): with 1 MiB asked at a time, the copy spent 40% more CPU per byte than a plain
    client (bench/copier_floor.py, issue 30). A chunked answer, or anything not
    http.client's, through its read1 (or read) instead."""
    fp: Any = getattr(answer, "fp", None)
    if getattr(answer, "chunked", None) is not False or not hasattr(fp, "readinto1"):
        read = getattr(answer, "read1", None) or answer.read

        def copied(buffer: memoryview) -> int:
            chunk = read(len(buffer))
            buffer[:len(chunk)] = chunk
            return len(chunk)
        return copied
    length = getattr(answer, "length", None)
    left = [length if isinstance(length, int) else -1]  # -1: until the connection ends (no Content-Length)

    def received(buffer: memoryview) -> int:
        if left[0] == 0:
            return 0
        count: int = fp.readinto1(buffer if left[0] < 0 else buffer[:left[0]])
        if left[0] > 0:
            left[0] -= count
            answer.length = left[0]  # as http.client counts it: 0 once the body is read, so its connection may be kept
        return count
    return received


T = TypeVar("T")


def _close(answer: urllib.error.HTTPError) -> None:
    try:
        answer.close()
    except Exception:  # noqa: BLE001, S110 - one made without a body has nothing to close
        pass


class Client:
    """The GCS JSON API calls the copier makes (list, an object's metadata, media download
    pinned to a generation), with retries."""

    def __init__(self, endpoint: str, token: Callable[[], str | None], context: ssl.SSLContext | None = None) -> None:
        import urllib.request  # noqa: PLC0415

        self.endpoint, self.token = endpoint, token
        self._sent = threading.local()  # the token this thread's last request carried (see _renewed)
        # urlopen's handlers (the pod's HTTP(S)_PROXY included), with `context` for HTTPS:
        # for requests through a proxy. The others go on connections kept per thread (_kept).
        self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
        self._context = context
        self._kept = threading.local()  # this thread's connection and its last answer (see _request)
        self._partials = itertools.count()
        self._lock = threading.Lock()
        # pid alone is not unique: two copiers into one directory (a pod's processes, or the pods
        # of a HostPath copy before issue 28) are often pid 1 each in their containers.
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
        bearer = self._sent.token = self.token()
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        timeout = min(REQUEST_TIMEOUT_SECONDS, self._remaining())
        if proxied(url):
            return self._opener.open(urllib.request.Request(url, headers=headers), timeout=timeout)
        return self._request(url, headers, timeout)

    def _request(self, url: str, headers: dict[str, str], timeout: float) -> Any:
        """A GET on this thread's kept connection to the endpoint (a new one when it has
        none, when its last answer was not read to its end, or when it was to close), its
        answer as urllib's: an http.client answer, a status other than 2xx an HTTPError, a
        certificate that does not verify a URLError. Each download being a connection of
        its own cost a TLS handshake per entry: for 1,000 entries of 10-500 KB the copy
        took 2x the CPU of a plain client that keeps its connections (and the server 3x;
        bench/copier_floor.py, issue 30). A kept connection the server closed meanwhile
        fails before any answer: tried again once on a new one, not counted an attempt."""
        import http.client  # noqa: PLC0415
        import ssl  # noqa: PLC0415
        import urllib.error  # noqa: PLC0415
        import urllib.parse  # noqa: PLC0415

        parts = urllib.parse.urlsplit(url)
        kept = self._kept.__dict__
        connection, last = kept.pop("connection", None), kept.pop("answer", None)
        reusable = (connection is not None and connection.sock is not None and last is not None
                    and last.isclosed() and last.length == 0 and not last.will_close
                    and kept.get("origin") == (parts.scheme, parts.netloc))
        if connection is not None and not reusable:
            connection.close()
        for fresh in ((False, True) if reusable else (True,)):
            if fresh:
                connection = (http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout,
                                                          context=self._context) if parts.scheme == "https"
                              else http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout))
            elif connection.sock is not None:
                connection.sock.settimeout(timeout)
            try:
                connection.request("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path, headers=headers)
                answer = connection.getresponse()
                break
            except ssl.SSLCertVerificationError as exc:  # as urllib raises it: not retried
                connection.close()
                raise urllib.error.URLError(exc) from None
            except (ConnectionError, ssl.SSLEOFError):
                connection.close()
                if fresh:
                    raise
            except BaseException:
                connection.close()
                raise
        kept.update(connection=connection, answer=answer, origin=(parts.scheme, parts.netloc))
        if not 200 <= answer.status < 300:
            kept["answer"] = None  # its body is not read: not kept
            raise urllib.error.HTTPError(url, answer.status, answer.reason, answer.headers, answer)
        return answer

    def _renewed(self) -> bool:
        """After GCS's 401: whether the token this thread sent was dropped for a new one
        (a MetadataToken's refused()); False without a token to renew."""
        refused = getattr(self.token, "refused", None)
        sent = getattr(self._sent, "token", None)
        return bool(refused is not None and sent and refused(sent))

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
        renewed = False
        for number in range(ATTEMPTS):
            if number:
                time.sleep(retry_delay(number, self._remaining(), after))
            after = None
            try:
                return attempt()
            except urllib.error.HTTPError as exc:
                _close(exc)  # its connection, now rather than when collected
                if exc.code == 401 and not renewed and self._renewed():
                    renewed, after, last = True, 0.0, exc  # once, at once, with a new token
                    continue
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

    def _media(self, bucket: str, name: str, generation: str = "") -> str:
        """The media URL of an object, of that generation when one is given (GCS answers
        404 once it is not the live one, unless the bucket keeps versions)."""
        import urllib.parse  # noqa: PLC0415

        return (f"{self.endpoint}/download/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
                f"{urllib.parse.quote(name, safe='')}?alt=media" + (f"&generation={generation}" if generation else ""))

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
            query = {"prefix": prefix, "matchGlob": f"{prefix}*", "fields": "items(name,size,md5Hash,generation),nextPageToken",
                     "maxResults": "1000"}
            if token:
                query["pageToken"] = token
            page = self._json(f"{self.endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?"
                              f"{urllib.parse.urlencode(query)}")
            out += page.get("items") or []
            token = page.get("nextPageToken") or ""
            if not token:
                return out

    def metadata(self, bucket: str, name: str, generation: str) -> dict[str, Any]:
        """An object's metadata (generation, size, md5Hash) at that generation. Raises
        CopyError (with the status on an HTTP error)."""
        import urllib.parse  # noqa: PLC0415

        got = self._json(f"{self.endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
                         f"{urllib.parse.quote(name, safe='')}?generation={generation}&fields=generation,size,md5Hash")
        if not isinstance(got, dict):
            raise CopyError(f"{name}: its metadata is not an object")
        return got

    def read_pinned(self, bucket: str, name: str, generation: str) -> bytes:
        """A small object's content at `generation`, only if it is that generation's: its
        metadata must name that generation (a server that does not pin, as the testbed's
        emulator, answers the live object's) and its bytes must be that metadata's size and
        MD5 (the object rewritten between the two requests). Raises CopyError."""
        meta = self.metadata(bucket, name, generation)
        entry = _entry(meta.get("size"), meta.get("md5Hash"), meta.get("generation"))
        if entry is None or entry.generation != generation:
            raise CopyError(f"{name}: generation {str(meta.get('generation'))[:20]} is not the trusted {generation} "
                            "(rewritten since its warmer wrote it)")
        if entry.size > MAX_MANIFEST_BYTES:
            raise CopyError(f"{name}: larger than {MAX_MANIFEST_BYTES} bytes")
        return self.read(bucket, name, entry.size, generation, entry.md5)

    def read(self, bucket: str, name: str, limit: int = MAX_MANIFEST_BYTES, generation: str = "",
             md5: str = "") -> bytes:
        """A small object's content (of that generation when given; exactly `limit` bytes
        with this MD5 when `md5` is given, else tried again as a corrupted transfer, and
        refused as changed after CORRUPT_ATTEMPTS). Raises CopyError (with the status on an
        HTTP error), also when it is larger than `limit`."""
        import base64  # noqa: PLC0415
        import hashlib  # noqa: PLC0415

        url = self._media(bucket, name, generation)

        def attempt() -> bytes:
            with self._open(url) as answer:
                data: bytes = answer.read(limit + 1)
                length = answer.headers.get("Content-Length")
            # read(n) returns what came before the connection ended, without an error.
            if length is not None and length.isdigit() and len(data) < min(int(length), limit + 1):
                raise Broken(f"{name}: the connection ended after {len(data)} of {length} bytes")
            if md5 and (len(data) != limit or base64.b64encode(hashlib.md5(data).digest()).decode() != md5):  # noqa: S324
                raise Corrupt(f"{name}: its bytes are not generation {generation}'s (MD5; rewritten meanwhile?)")
            return data
        data = self._attempts(url, attempt)
        if len(data) > limit:
            raise CopyError(f"{name}: larger than {limit} bytes")
        return data

    def partial_name(self) -> str:
        """A partial file name no other download, of this copier or another, uses."""
        with self._lock:
            return f"{PARTIAL}{self._run}-{next(self._partials)}"

    def download(self, bucket: str, wanted: Wanted, dest: str) -> tuple[int, bool]:
        """The entry into `dest`/<its name within the prefix>, at its generation, checked
        and renamed into place, retried as a whole (a partial file of its own each
        attempt). Returns its size and whether it replaced something of that name (a
        tampered file, a symlink). Raises CopyError."""
        url = self._media(bucket, wanted.name, wanted.entry.generation)
        return self._attempts(url, lambda: self._download_once(url, wanted, dest))

    def _download_once(self, url: str, wanted: Wanted, dest: str) -> tuple[int, bool]:
        """One attempt of download's; its partial file is removed whatever goes wrong. The
        disk's errors are CopyErrors (not retried), the network's as they come. At most the
        entry's size is read (one byte more says the answer is longer: Corrupt)."""
        import base64  # noqa: PLC0415
        import hashlib  # noqa: PLC0415

        name, entry = wanted.name, wanted.entry
        final = os.path.join(dest, wanted.base)
        partial = os.path.join(dest, self.partial_name())
        digest = hashlib.md5()  # noqa: S324 - GCS's checksum, recorded by the warmer (see the module's doc)
        size = 0
        try:
            with self._open(url) as answer:
                generation = answer.headers.get("x-goog-generation")
                if generation is not None and generation != entry.generation:  # GCS says which it sent
                    raise Corrupt(f"{name}: generation {generation[:20]} sent, {entry.generation} asked for")
                length = answer.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > entry.size:
                    raise Corrupt(f"{name}: {length} bytes answered, the entry has {entry.size}")
                try:
                    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                except OSError as exc:
                    raise CopyError(f"{name}: {exc}") from None
                # One receive at a time (receiver), so a body that trickles in still reaches
                # the deadline check, into one buffer for the whole download; once it is full
                # (or the body ended), one MD5 update and one write for all of it: per
                # receive (16 KiB over TLS), they cost the copy 15% more CPU per byte than a
                # plain client reading 256 KiB at a time (bench/copier_floor.py, issue 30).
                receive = receiver(answer)
                buffer = memoryview(bytearray(READ_BYTES))
                with os.fdopen(fd, "wb") as out:
                    while True:
                        want, filled = min(READ_BYTES, entry.size + 1 - size), 0
                        while filled < want and (count := receive(buffer[filled:want])):  # a reset or timeout raises here
                            self._remaining()  # a slow download stops at the deadline too
                            filled += count
                        if not filled:
                            break
                        size += filled
                        if size > entry.size:
                            raise Corrupt(f"{name}: more bytes answered than the entry's {entry.size}")
                        digest.update(buffer[:filled])
                        try:
                            out.write(buffer[:filled])
                        except OSError as exc:
                            raise CopyError(f"{name}: {exc}") from None
            # A receive brings nothing when the connection ends early, without an error.
            if size < entry.size:
                raise Broken(f"{name}: the connection ended after {size} of {entry.size} bytes")
            if base64.b64encode(digest.digest()).decode() != entry.md5:
                raise Corrupt(f"{name}: MD5 does not match the entry's (a corrupted transfer or a changed object)")
            replaced = os.path.lexists(final)
            try:
                os.replace(partial, final)  # a symlink there is replaced, not followed
            except OSError as exc:
                raise CopyError(f"{name}: {exc}") from None
        except BaseException:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise
        return size, replaced


class MetadataToken:
    """The pod's access token from the metadata server at `url`: fetched when first asked
    for, again once less than min(REFRESH_BEFORE_SECONDS, half its stated lifetime) is
    left, and again after GCS refused it (refused()). Callable: the token, or raises
    MetadataError. Shared by the copy's threads."""

    def __init__(self, url: str = "") -> None:
        import urllib.request  # noqa: PLC0415

        self.url = url or METADATA_TOKEN
        # Never through the pod's HTTP(S)_PROXY: the metadata server is link-local.
        self._direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._lock = threading.Lock()
        self._token: str | None = None
        self._until = 0.0
        self.fetched = 0  # tokens the metadata server gave
        self.refusals = 0  # tokens dropped after GCS's 401

    def __call__(self) -> str | None:
        import http.client  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        with self._lock:
            if self._token is None or time.monotonic() >= self._until:
                request = urllib.request.Request(self.url, headers={"Metadata-Flavor": "Google"})
                try:
                    with self._direct.open(request, timeout=5) as answer:
                        got = json.load(answer)
                    token, lifetime = str(got["access_token"]), float(got.get("expires_in", 300))
                    if not token or not lifetime == lifetime:  # nan
                        raise ValueError("an empty token or a lifetime that is not a number")
                except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as exc:
                    # Retried as a connection error (the server may refuse a new pod's first
                    # requests), and never taken for GCS's answer about an object (a 404 here
                    # is not a missing manifest).
                    raise MetadataError(f"metadata server token: {type(exc).__name__}: {exc}") from None
                self._token = token
                # Early enough that no request starts with a token about to die; a lifetime
                # of seconds (or 0) fetches one for (nearly) every request, never a dead one.
                self._until = time.monotonic() + lifetime - min(REFRESH_BEFORE_SECONDS, max(lifetime, 0.0) / 2)
                self.fetched += 1
            return self._token

    def refused(self, token: str) -> bool:
        """GCS answered 401 to a request that carried `token`: forget it, unless another
        request already did (then the one held now is newer), so the next call fetches a
        new one. True: worth one more try."""
        with self._lock:
            if token == self._token:
                self._token = None
                self.refusals += 1
            return True


def metadata_token(url: str = "") -> MetadataToken:
    """The pod's token from the metadata server's token URL `url` (GCE's when ''), as
    Client takes it (see MetadataToken)."""
    return MetadataToken(url)


def local_entries(dest: str) -> dict[str, int]:
    """The regular files in `dest` (name -> size; symlinks and the rest are not, and an
    entry's name held by one is replaced); partial files left by a killed copier over an
    hour ago are removed on the way (a live download writes at least every 30 s)."""
    out: dict[str, int] = {}
    now = time.time()
    with os.scandir(dest) as found:
        for item in found:
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                stat = item.stat(follow_symlinks=False)
                if item.name.startswith(PARTIAL):
                    if now - stat.st_mtime > STALE_PARTIAL_SECONDS:
                        os.unlink(item.path)
                    continue
                out[item.name] = stat.st_size
            except OSError:  # gone meanwhile (another copier's partial renamed or removed)
                continue
    return out


def file_md5(path: str, size: int) -> str | None:
    """GCS's form of the MD5 (base64) of the regular file at `path` when it has `size`
    bytes: opened without following a link (nor blocking on a FIFO swapped in), checked
    regular and of that size on the descriptor itself; None otherwise or on an error."""
    import base64  # noqa: PLC0415
    import hashlib  # noqa: PLC0415
    import stat  # noqa: PLC0415

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        digest = hashlib.md5()  # noqa: S324 - GCS's checksum (see the module's doc)
        read = 0
        while chunk := os.read(fd, 1 << 20):
            read += len(chunk)
            digest.update(chunk)
        return base64.b64encode(digest.digest()).decode() if read == size else None
    except OSError:
        return None
    finally:
        os.close(fd)


def verified_present(dest: str, wanted: Iterable[Wanted], workers: int) -> dict[str, tuple[int, str]]:
    """The files in `dest` that are a wanted entry: regular, its size and its MD5 (file
    name -> (size, MD5)), hashed `workers` at once (hashlib lets go of the GIL)."""
    import concurrent.futures  # noqa: PLC0415

    local = local_entries(dest)
    candidates = [w for w in wanted if local.get(w.base) == w.entry.size]
    if not candidates:
        return {}
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(candidates))) as pool:
        digests = list(pool.map(lambda w: file_md5(os.path.join(dest, w.base), w.entry.size), candidates))
    return {w.base: (w.entry.size, md5) for w, md5 in zip(candidates, digests) if md5 == w.entry.md5}


def _copiers_own(name: str, summary_name: str) -> bool:
    """Whether `name` in the destination is a file the copier itself uses there: a partial
    download (this copier's or another's in flight; stale ones local_entries removes) or,
    where the summary lives in the destination (`summary_name`, else ''), the summary, its
    lock and write_summary's temp files. Never a name JAX reads (`*-cache`). Pure."""
    if name.endswith("-cache"):
        return False
    if name.startswith((PARTIAL, TORCH_EXTRACTED)):
        return True
    return bool(summary_name) and (name in (summary_name, f"{summary_name}.lock")
                                   or (name.startswith(f".{summary_name}.") and name.endswith(".tmp")))


def sweep(dest: str, keep: Collection[str], summary_path: str, summary: dict[str, Any],
          note_dirs: bool = True) -> set[str]:
    """Remove from `dest` every name that is not in `keep` (the verified entries) nor the
    copier's own (_copiers_own): regular files, symlinks, FIFOs, sockets, devices, each
    unlinked, never followed. A directory is left (emptying one another user may have
    filled is no copier's job; JAX reads none) and, with `note_dirs`, counted `foreignDirs`;
    one under a name JAX would read (`*-cache`) is an error too. Counts the removed in `removedForeign` and
    returns their names (some are replaced by a download later: run() counts those over).

    Why (issue 28): JAX reads `<key>-cache` directly in its directory, by name, for any
    program whose key it computes, so a file there that no manifest lists (planted through
    an Ephemeral claim cloned from another's volume, or left by an earlier process of the
    pod, which has the copy writable in process) would be loaded as an entry. Nothing of
    the pod's own is lost: the destination is the pod's own volume (an emptyDir or a claim
    per pod, never shared with another pod), JAX has it read-only (a local copy is ReadOnly
    only) and only the copier writes it; the reporter's and the summary's files live in
    another volume."""
    import stat  # noqa: PLC0415

    removed: set[str] = set()
    same = bool(summary_path) and os.path.realpath(os.path.dirname(os.path.abspath(summary_path))) == \
        os.path.realpath(dest)
    summary_name = os.path.basename(summary_path) if same else ""
    try:
        with os.scandir(dest) as listing:
            found = list(listing)
    except FileNotFoundError:
        return removed  # never made (the copy failed before): nothing JAX could read
    for item in found:
        if item.name in keep:
            continue
        try:
            info = os.lstat(item.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            add_error(summary, f"{item.name}: not removed: {exc}")
            continue
        if stat.S_ISDIR(info.st_mode):
            if note_dirs and item.name != "lost+found":  # mkfs makes it at a new claim's root
                summary["foreignDirs"] = summary.get("foreignDirs", 0) + 1
                if item.name.endswith("-cache"):
                    add_error(summary, f"{item.name}: a directory under a name JAX reads, left there")
            continue
        if stat.S_ISREG(info.st_mode) and _copiers_own(item.name, summary_name):
            continue
        try:
            os.unlink(item.path)  # a link itself, never its target
        except FileNotFoundError:
            continue
        except OSError as exc:
            add_error(summary, f"{item.name}: not an entry of the copy, and not removed: {exc}")
            continue
        removed.add(item.name)
    summary["removedForeign"] += len(removed)
    return removed


def new_summary(source: str) -> dict[str, Any]:
    return {"source": source, "wanted": 0, "copied": 0, "bytes": 0, "present": 0, "presentBytes": 0, "replaced": 0,
            "removedForeign": 0, "failed": 0,
            "leftOut": {"notAnEntry": 0, "notInManifest": 0, "notInBucket": 0, "overBudget": 0, "unverifiable": 0},
            "errors": [], "cold": False, "seconds": 0.0}


def add_error(summary: dict[str, Any], message: str) -> None:
    if len(summary["errors"]) < MAX_ERRORS:
        summary["errors"].append(message[:MAX_ERROR_CHARS])


def read_manifests(settings: Settings, client: Client, summary: dict[str, Any],
                   packed: dict[str, Pack] | None = None) -> dict[str, Entry]:
    """The union of the trusted manifests' entries, each read at its generation (see the
    module's doc); one missing (404), unreadable or refused adds nothing, which the
    summary says. An entry two manifests list differently is taken from neither. Into
    `packed`: each entry a manifest says is in its pack -> that pack (the first manifest's)."""
    names: dict[str, Entry] = {}
    clashes: set[str] = set()
    missing: list[str] = []
    summary.update(trusted=0, manifestsUntrusted=settings.untrusted, manifestsRefused=0)
    for manifest, generation in settings.manifests:
        try:
            parsed = parse_manifest(client.read_pinned(settings.bucket, manifest, generation), manifest)
            entries = parsed.entries
            if parsed.pack_error:
                add_error(summary, f"{manifest}#{generation}: {parsed.pack_error}; its entries are read one by one")
            for name in parsed.packed:
                if packed is not None and parsed.pack is not None:
                    packed.setdefault(name, parsed.pack)
        except CopyError as exc:
            if exc.status == 404:
                missing.append(f"{manifest}#{generation}")
                continue
            summary.setdefault("manifestError", f"{manifest}#{generation}: {exc}"[:MAX_ERROR_CHARS])
            summary["manifestsRefused"] += 1
            continue
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            summary.setdefault("manifestError", f"{manifest}#{generation}: {exc}"[:MAX_ERROR_CHARS])
            summary["manifestsRefused"] += 1
            continue
        summary["trusted"] += 1
        for name, entry in entries.items():
            if names.setdefault(name, entry) != entry:
                clashes.add(name)
    if missing:
        summary["manifestsMissing"] = [m[:MAX_ERROR_CHARS] for m in missing[:MAX_ERRORS]]
    if not summary["trusted"]:
        summary["nothingTrusted"] = (
            "no manifest was given with the generation its warmer wrote" if not settings.manifests
            else "no manifest could be read at the generation its warmer wrote")
    return {n: e for n, e in names.items() if n not in clashes}


def packed_listing(names: Mapping[str, Entry] | None, packed: Mapping[str, Pack], prefix: str
                   ) -> list[dict[str, Any]]:
    """The listing a copy whose every entry is in a pack uses instead of GCS's (one request
    per 1,000 entries saved, so that requests per start do not grow with the entries): the
    manifests' names under `prefix`, as listed. Its entries' bytes come from the pack and
    are checked against the manifest, so the bucket need not hold them: `notInBucket` is
    then 0, and an entry the pack does not give and the bucket no longer has fails its
    download (404). [] (list GCS) in prefix mode, with no entry, or with any not in a pack. Pure."""
    if not names or any(name not in packed for name in names):
        return []
    return [{"name": f"{prefix}{name}"} for name in sorted(names)]


def in_listing(objects: Iterable[Mapping[str, Any]], leftovers: list[Wanted], summary: dict[str, Any]
               ) -> list[Wanted]:
    """The entries a pack did not give, where packed_listing stood in for the bucket's
    listing: those `objects` (the listing, made now, once) hold; the others are not fetched,
    counted `notInBucket` (and no longer `wanted`), as a listed copy counts them (a pack
    that expired with its entries: one listing, not a 404 per entry, and not cold)."""
    names = {str(obj.get("name") or "") for obj in objects}
    there = [w for w in leftovers if w.name in names]
    summary["leftOut"]["notInBucket"] = summary["leftOut"].get("notInBucket", 0) + len(leftovers) - len(there)
    summary["wanted"] -= len(leftovers) - len(there)
    return there


def by_pack(packed: Mapping[str, Pack], download: Iterable[Wanted]) -> tuple[dict[Pack, list[Wanted]], list[Wanted]]:
    """The downloads a pack can serve, by pack (a pack for at least two of them: for one, the
    entry alone is fewer bytes and as many requests), and the rest, in their order. Pure."""
    groups: dict[Pack, list[Wanted]] = {}
    for wanted in download:
        pack = packed.get(wanted.base)
        if pack is not None:
            groups.setdefault(pack, []).append(wanted)
    served = {p: ws for p, ws in groups.items() if len(ws) >= 2}
    taken = {w.base for ws in served.values() for w in ws}
    return served, [w for w in download if w.base not in taken]


def write_entry(client: Client, dest: str, wanted: Wanted, data: memoryview) -> bool:
    """`data` (checked already: the entry's size and MD5) into `dest`/<the entry's name in the
    manifest>, through a partial file of its own renamed into place, as a download is.
    Returns whether it replaced something of that name. Raises CopyError for the disk's errors."""
    final = os.path.join(dest, wanted.base)
    partial = os.path.join(dest, client.partial_name())
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        replaced = os.path.lexists(final)
        os.replace(partial, final)  # a symlink there is replaced, not followed
    except OSError as exc:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise CopyError(f"{wanted.name}: {exc}") from None
    return replaced


def unpack(client: Client, bucket: str, dest: str, pack: Pack, members: list[Wanted], summary: dict[str, Any],
           done: Callable[[Wanted, int, bool], None], lock: threading.Lock) -> list[Wanted]:
    """The entries `members` from `pack`: read in one request at the manifest's generation,
    exactly its size and MD5 (Client.read, retried as a download is), then each member the
    pack holds under a wanted entry's name whose bytes are that entry's size and MD5 (the
    manifest's: the trust root) written into place (write_entry) and passed to done(wanted,
    size, replaced). A member under any other name (not a wanted entry of a trusted
    manifest: a path, "..", another program's) is ignored and counted `packIgnored`; the
    name a file gets is always the manifest's. Returns the members not written (the pack
    unreadable, not a pack, without them, or their bytes not the manifest's): the caller
    downloads them one by one, counted `packFallback`. Never raises."""
    import base64  # noqa: PLC0415
    import hashlib  # noqa: PLC0415

    left = {w.base: w for w in members}
    gone = False
    try:
        data = client.read(bucket, pack.name, pack.entry.size, pack.entry.generation, pack.entry.md5)
        with lock:
            summary["packs"] += 1
            summary["packBytes"] += len(data)
        for name, body in pack_members(data):
            wanted = left.get(name)
            if wanted is None:
                with lock:
                    summary["packIgnored"] += 1
                continue
            if len(body) != wanted.entry.size or \
                    base64.b64encode(hashlib.md5(body).digest()).decode() != wanted.entry.md5:  # noqa: S324
                continue  # left: downloaded on its own, checked again there
            replaced = write_entry(client, dest, wanted, body)
            del left[name]
            with lock:
                summary["fromPack"] += 1
            done(wanted, len(body), replaced)
    except Exception as exc:  # noqa: BLE001 - CopyError, ValueError (not a pack), or else: read one by one
        # Gone (404): expired deleteAfterDays after its warm, as its entries do (the manifest
        # does not expire): not an error; its members are looked for in the bucket (run).
        gone = isinstance(exc, CopyError) and exc.status == 404
        with lock:
            if gone:
                summary["packsGone"] += 1
            else:
                add_error(summary, f"the pack {pack.name}: {exc}")
    if left:
        with lock:
            summary["packFallback"] += len(left)
            if not gone:
                add_error(summary, f"the pack {pack.name} did not give {len(left)} of its entries; read one by one")
    return [w for w in members if w.base in left]


def unpack_behind(client: Client, bucket: str, dest: str, groups: Mapping[Pack, list[Wanted]],
                  summary: dict[str, Any], done: Callable[[Wanted, int, bool], None],
                  lock: threading.Lock) -> Callable[[], list[Wanted]]:
    """unpack() each pack of `groups` (by_pack's) in a thread of its own, beside the other
    downloads; returns the function that waits for it and gives the entries to download one
    by one after all. With no pack: nothing started, nothing to wait for."""
    if not groups:
        return list
    summary.update(packs=0, packBytes=0, fromPack=0, packFallback=0, packIgnored=0, packsGone=0)
    rest: list[Wanted] = []

    def work() -> None:
        for pack, members in groups.items():
            rest.extend(unpack(client, bucket, dest, pack, members, summary, done, lock))

    thread = threading.Thread(target=work, name="cachewarm-packs", daemon=True)
    thread.start()

    def wait() -> list[Wanted]:
        thread.join()
        return rest
    return wait


def dest_note(dest: str, summary: dict[str, Any]) -> None:
    """Say in `summary` when the destination's root may be written by others: world-
    writable without the sticky bit and not ours (an emptyDir's root is: 0777, root's; it is
    the pod's alone, so this is a note, not a failure)."""
    import stat  # noqa: PLC0415

    info = os.stat(dest)
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX and info.st_uid != os.geteuid():
        summary["destWorldWritable"] = True


# In process (child()), beside the summary, in the pod's own emptyDir (see Downloads):
PLAN_SUFFIX = ".plan"  # the names the copy keeps, one a line, once the destination is swept
WANT_SUFFIX = ".want"  # a directory: a file named as a planned entry asks for it first
FAILED_SUFFIX = ".failed"  # in it, from the copier: `<entry>.failed`, that entry will not come
WATCH_SECONDS = 0.003  # how often the copier looks for a new ask
BACKGROUND_NICE = 10  # the nice value of a copy's workers while the pod's processes start (Downloads)


def plan_path(summary_path: str) -> str:
    return summary_path + PLAN_SUFFIX


def want_dir(summary_path: str) -> str:
    return summary_path + WANT_SUFFIX


def write_plan(summary_path: str, names: Iterable[str]) -> None:
    """The plan's entry names at `<summary>.plan`, whole or not at all (a temp file renamed
    over it), after `<summary>.want/` is made: a process that reads the plan can ask. The
    want directory is 1777 (as /tmp), whatever the copier's umask: the pod's own emptyDir,
    where a process of another container, running as another user, asks too (an ask only
    orders the plan's own entries; the sticky bit keeps one user's files from another)."""
    want = want_dir(summary_path)
    if os.path.islink(want):  # a link another container put there: never made 1777 nor used through it
        os.unlink(want)
    os.makedirs(want, exist_ok=True)
    fd = os.open(want, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o1777)
    except OSError:
        pass  # another user's (left behind): asks as it allows
    finally:
        os.close(fd)
    path = plan_path(summary_path)
    write_whole(path, f"{path}.{os.getpid()}-{os.urandom(4).hex()}.tmp", "".join(f"{name}\n" for name in names))


def mark_failed(asks: str, base: str) -> None:
    """`<asks>/<base>.failed`: the planned entry `base` will not come (its download failed, or
    the bucket lacks it), so that a process waiting for it reads a miss now rather than wait
    for the whole copy's end (sitecustomize's hook looks for it). Best effort."""
    try:
        os.close(os.open(os.path.join(asks, base + FAILED_SUFFIX),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:
        pass  # marked already (or through a link: never followed), or no directory


def drop_plan(summary_path: str) -> None:
    """The plan and the asks gone (the copy is over: the summary says so next)."""
    import shutil  # noqa: PLC0415

    try:
        os.unlink(plan_path(summary_path))
    except OSError:
        pass
    shutil.rmtree(want_dir(summary_path), ignore_errors=True)


def background() -> None:
    """The calling thread at nice BACKGROUND_NICE at least (on Linux, setpriority(PRIO_PROCESS,
    0) sets the calling thread's); where it cannot be (another OS), as it is."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class Downloads:
    """A copy's downloads, each taken once: `workers` threads take them in the plan's order
    (smallest first), and an entry a process of the pod asks for (a file of its name in
    the want directory, which a thread looks for every WATCH_SECONDS: sitecustomize's hook
    on JAX's cache read asks for the key JAX reads) is started at once in a thread of its
    own, beside those, so that it does not wait for a worker to finish another download
    (an entry asked for that is already taken, in flight or done, is not fetched again).
    Only the plan's entries can be asked for: an ask is a name, the entry its plan's (its
    generation, size and MD5), checked as any other. `asked` lists those fetched on ask.
    With asks (in process), the workers' threads run at nice BACKGROUND_NICE (Linux's nice
    value is a thread's): the rest of the copy runs beside the pod's own start on the same
    CPUs and must not take them from it (measured: bench/start_vs_size.py, BENCHMARKS.md),
    while an asked entry's thread, which a process waits for, keeps the process's."""

    def __init__(self, download: list[Wanted]) -> None:
        import collections  # noqa: PLC0415

        self._order = collections.deque(download)
        self._pending = {w.base: w for w in download}
        self._lock = threading.Lock()
        self.asked: list[str] = []

    def _take(self, base: str | None = None) -> Wanted | None:
        with self._lock:
            if base is not None:
                wanted = self._pending.pop(base, None)
                if wanted is not None:
                    self.asked.append(base)
                return wanted
            while self._order:
                wanted = self._pending.pop(self._order.popleft().base, None)
                if wanted is not None:
                    return wanted
            return None

    def _watch(self, directory: str, start: Callable[[Wanted], None], stop: threading.Event) -> None:
        seen: set[str] = set()
        while True:
            try:
                names = os.listdir(directory)
            except OSError:
                names = []
            for name in names:
                if name not in seen:
                    seen.add(name)
                    wanted = self._take(name)
                    if wanted is not None:
                        start(wanted)
            with self._lock:
                if not self._pending:
                    return
            if stop.wait(WATCH_SECONDS):
                return

    def serve(self, one: Callable[[Wanted], None], workers: int, asks: str = "") -> None:
        """Every download through `one` (which never raises), `workers` at once plus those
        asked for in the directory `asks` ('' for none); returns once all are done."""
        threads: list[threading.Thread] = []
        lock = threading.Lock()

        def start(wanted: Wanted) -> None:
            thread = threading.Thread(target=one, args=(wanted,), name="cachewarm-asked", daemon=True)
            with lock:
                threads.append(thread)
            thread.start()

        def work() -> None:
            if asks:
                background()
            while (wanted := self._take()) is not None:
                one(wanted)

        stop = threading.Event()
        watcher = None
        if asks and self._pending:
            self._watch_once(asks, start)
            watcher = threading.Thread(target=self._watch, args=(asks, start, stop), name="cachewarm-asks",
                                       daemon=True)
            watcher.start()
        pool = [threading.Thread(target=work, name="cachewarm-copy", daemon=True)
                for _ in range(min(workers, len(self._pending)))]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        stop.set()
        if watcher is not None:
            watcher.join()
        with lock:
            asked = list(threads)
        for thread in asked:
            thread.join()

    def _watch_once(self, directory: str, start: Callable[[Wanted], None]) -> None:
        """The asks made before the downloads start, taken before any worker's first."""
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            wanted = self._take(name)
            if wanted is not None:
                start(wanted)


def run(settings: Settings, client: Client, summary: dict[str, Any] | None = None, on_demand: str = "",
        verified: set[str] | None = None) -> dict[str, Any]:
    """Copy what `plan` picks, counting into `summary` (a new_summary; main's watchdog
    reads the same one). With `on_demand` (the summary's path, in process: child()), the
    plan's names go to `<on_demand>.plan` once the destination is swept and before any
    download, and the entries the pod's processes ask for in `<on_demand>.want/` jump the
    queue (Downloads). `verified`, given, gets the names of the verified entries the
    destination holds at the end (present or copied). Never raises: the summary says what
    happened."""
    started = time.monotonic()
    client.deadline = started + settings.deadline_seconds
    summary = new_summary("prefix") if summary is None else summary
    summary["source"] = "manifest" if settings.pinned else "prefix"
    listed = stood_in = False
    kept: set[str] = set()  # the verified entries in the destination: present, then copied too
    displaced: set[str] | None = None  # what the first sweep removed
    try:
        os.makedirs(settings.dest, mode=0o755, exist_ok=True)
        dest_note(settings.dest, summary)
        packed: dict[str, Pack] = {}  # entries a trusted manifest's pack holds (unpack)
        names = read_manifests(settings, client, summary, packed) if settings.pinned else None
        if names is not None and not summary["trusted"]:
            listed = True  # nothing to list for: the pod starts with nothing of ours, and says why
            if settings.manifests or settings.untrusted:  # some were given, none trusted: that went wrong
                add_error(summary, f"{summary['nothingTrusted']}: {summary.get('manifestError') or 'missing'}")
            objects: list[dict[str, Any]] = []
        else:
            # Every entry in a pack: no listing (issue 30; packed_listing).
            objects = packed_listing(names, packed, settings.prefix)
            stood_in = bool(objects)
            objects = objects or client.list(settings.bucket, settings.prefix)
            listed = True
        wanted, _ = wanted_entries(objects, settings.prefix, names)
        present = verified_present(settings.dest, wanted, settings.workers)
        present.update(torch_extracted(settings.dest, wanted))  # extracted and unlinked by an earlier copy
        picked = plan(objects, settings.prefix, names, settings.max_bytes, present)
        summary["leftOut"] = picked.left
        summary["wanted"] = len(picked.download) + len(picked.present)
        summary["present"], summary["presentBytes"] = len(picked.present), picked.present_bytes
        kept.update(w.base for w in picked.present)
        # Before any download, so that a copy stopped at its deadline leaves nothing foreign
        # either; an entry to download whose name held something else is counted `replaced`
        # once copied, not `removedForeign`.
        displaced = removed = sweep(settings.dest, kept, settings.summary_path, summary)
        deadline = started + settings.deadline_seconds
        lock = threading.Lock()

        def one(wanted: Wanted) -> None:
            try:
                if time.monotonic() > deadline:
                    raise CopyError("deadline passed before it started")
                size, replaced = client.download(settings.bucket, wanted, settings.dest)
            except Exception as exc:  # noqa: BLE001 - counted; the others go on
                with lock:
                    summary["failed"] += 1
                    add_error(summary, str(exc))
                if asks:
                    mark_failed(asks, wanted.base)
                return
            done(wanted, size, replaced)

        def done(wanted: Wanted, size: int, replaced: bool) -> None:  # a download's or a pack's entry in place
            with lock:
                kept.add(wanted.base)
                summary["copied"] += 1
                summary["bytes"] += size
                if wanted.base in removed:
                    replaced = True
                    summary["removedForeign"] -= 1
                summary["replaced"] += int(replaced)

        groups, alone = by_pack(packed, picked.download)  # a pack's entries come in one request (issue 30)
        queue = Downloads(alone)
        asks = ""
        if on_demand:  # the pod's processes may read every planned entry from now on (the sweep is done)
            try:
                write_plan(on_demand, [w.base for w in picked.present] + [w.base for w in picked.download])
                asks = want_dir(on_demand)
            except OSError as exc:  # then they wait for the whole copy, as without a plan
                add_error(summary, f"plan file: {exc}")
        unpacked = unpack_behind(client, settings.bucket, settings.dest, groups, summary, done, lock)
        queue.serve(one, settings.workers, asks)
        leftovers = unpacked()
        if stood_in and leftovers:  # a pack that did not give them: those the bucket lacks are not fetched
            try:
                there = in_listing(client.list(settings.bucket, settings.prefix), leftovers, summary)
            except Exception as exc:  # noqa: BLE001 - no listing: every leftover is read on its own, as before
                add_error(summary, f"listing what the packs did not give: {type(exc).__name__}: {exc}")
                there = leftovers
            for gone in {w.base for w in leftovers} - {w.base for w in there} if asks else ():
                mark_failed(asks, gone)
            leftovers = there
        rest = Downloads(leftovers)
        rest.serve(one, settings.workers, asks)  # what the packs did not give
        if queue.asked or rest.asked:
            summary["onDemand"] = len(queue.asked) + len(rest.asked)
            summary["onDemandEntries"] = (queue.asked + rest.asked)[:MAX_ERRORS]
    except Exception as exc:  # noqa: BLE001 - the pod starts anyway, cold
        add_error(summary, f"{type(exc).__name__}: {exc}")
    try:  # again: what a failed download left under an entry's name, or a copy that failed before its plan
        sweep(settings.dest, kept, settings.summary_path, summary, note_dirs=displaced is None)
    except Exception as exc:  # noqa: BLE001 - said; the pod starts anyway
        add_error(summary, f"removing what is not an entry: {type(exc).__name__}: {exc}")
    if on_demand:
        drop_plan(on_demand)
    if verified is not None:
        verified.update(kept)
    summary["cold"] = not listed or (summary["copied"] + summary["present"] == 0
                                     and bool(summary["errors"] or summary["failed"]))
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary


# torch caches (issue 31): the warmer uploads its Inductor directory as one archive (a gzip'd
# tar named like an entry, `torch-inductor-<sha256>-cache`); the copy downloads and verifies
# it as any entry, then, with CACHEWARM_TORCH_DIR set, extracts each into that directory,
# which the pod's torch reads (TORCHINDUCTOR_CACHE_DIR). Inductor's artifacts are code
# (pickles, shared objects), and an archive's names are not trusted beyond its MD5: only
# regular files and directories, each name relative, normalized, without "..", NUL or a
# leading "/", every directory opened without following a link (a link planted in the
# directory refuses the member), every file created new (O_EXCL|O_NOFOLLOW: one already
# there, Inductor's names being content hashes, is kept and counted, never overwritten),
# the uncompressed bytes of each archive and the members of all bounded. Directories 0o777 and
# files 0o666 (less the umask), so a training container of any uid writes its own entries
# beside them (the directory is the pod's emptyDir).
class TorchBound(Exception):
    """An archive past the bytes or members bound: extraction stops there."""


def torch_member_parts(name: str) -> list[str] | None:
    """The path components of an archive member's name, or None for a name refused: empty,
    absolute, with NUL or a backslash, or a ".." component. "." and empty components are
    dropped (normalized). Pure."""
    if not name or "\x00" in name or "\\" in name or name.startswith("/"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return parts


# A member is written under TORCH_TEMP_PREFIX + a random suffix beside its final name, then
# linked to that name (never over a file there): a copy stopped mid-write (its watchdog's
# os._exit, a kill) leaves at most a temp file, never a truncated .so under an Inductor name
# that a restarted copier would keep and torch would load (SIGBUS). The prefix starts with
# "." (Inductor skips such names when it lists a key's directory) and holds ".tmp" (the
# warmer's archive leaves it out).
TORCH_TEMP_PREFIX = ".cachewarm.tmp-"


def _open_dir(parent: int, name: str) -> int:
    """The directory `name` under the descriptor `parent`, made (0o777, set with fchmod
    whatever the umask: a training container of another uid writes beside it) when missing,
    opened without following a link (OSError: ELOOP or ENOTDIR for anything else)."""
    try:
        os.mkdir(name, 0o777, dir_fd=parent)
    except FileExistsError:
        pass
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    st = os.fstat(fd)
    # Also one this copier's uid made before it was stopped between mkdir and fchmod (the
    # umask's mode left): not only the one made just now.
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != 0o777:
        try:
            os.fchmod(fd, 0o777)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _regular_of_size(at: int, leaf: str, size: int) -> bool | None:
    """Whether `leaf` under `at` is a regular file of `size` bytes (not following a link);
    None when nothing is there."""
    import stat  # noqa: PLC0415

    try:
        st = os.stat(leaf, dir_fd=at, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _write_new(at: int, leaf: str, parts: list[str], source: Any, size: int, mtime: float) -> str:
    """The member's bytes under a temp name in `at`, linked to `leaf` (never over what is
    there: "kept" when a regular file of its size got there first, "refused" otherwise),
    the temp name removed either way: "written". Raises OSError."""
    temp = f"{TORCH_TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=at)
    try:
        with os.fdopen(fd, "wb") as out:
            left = size
            while left > 0:
                chunk = source.read(min(left, READ_BYTES))
                if not chunk:
                    raise OSError(f"archive member {'/'.join(parts)[:100]} ends early")
                out.write(chunk)
                left -= len(chunk)
            out.flush()
            os.utime(out.fileno(), (mtime, mtime))
        try:
            os.link(temp, leaf, src_dir_fd=at, dst_dir_fd=at, follow_symlinks=False)
        except FileExistsError:
            return "kept" if _regular_of_size(at, leaf, size) else "refused"
        except OSError:  # a filesystem without hard links: a rename, only where nothing is there
            if _regular_of_size(at, leaf, size) is not None:
                return "kept" if _regular_of_size(at, leaf, size) else "refused"
            os.rename(temp, leaf, src_dir_fd=at, dst_dir_fd=at)
        return "written"
    finally:
        try:
            os.unlink(temp, dir_fd=at)
        except FileNotFoundError:
            pass


def _extract_member(root: int, parts: list[str], source: Any, size: int, is_dir: bool, mtime: float = 0) -> str:
    """One member under the directory descriptor `root`: "written" (a file with the
    archive's mtime: the same directory archives to the same bytes again; or a directory),
    "kept" (a regular file of the member's size already there: Inductor's names are content
    hashes) or "refused" (a link, or not a directory, where a directory goes; a directory
    where the file goes). Anything else under the file's name (a link, a file of another
    size: a write cut short before the temp names) is removed (unlink never follows a link)
    and the member written in its place. Raises OSError."""
    import stat  # noqa: PLC0415

    fds: list[int] = []
    try:
        at = root
        for part in parts if is_dir else parts[:-1]:
            try:
                at = _open_dir(at, part)
            except OSError:
                return "refused"  # a link or a file where a directory goes
            fds.append(at)
        if is_dir:
            return "written"
        leaf = parts[-1]
        there = _regular_of_size(at, leaf, size)
        if there:
            return "kept"
        if there is not None:
            if stat.S_ISDIR(os.stat(leaf, dir_fd=at, follow_symlinks=False).st_mode):
                return "refused"
            os.unlink(leaf, dir_fd=at)
        return _write_new(at, leaf, parts, source, size, mtime)
    finally:
        for fd in fds:
            os.close(fd)


class TorchDeadline(Exception):
    """The copy's deadline passed: extraction stops before the next member."""


def extract_torch(archive: str, directory: str, counts: dict[str, Any], max_bytes: int,
                  max_files: int = TORCH_MAX_FILES, deadline: float = float("inf")) -> None:
    """The gzip'd tar at `archive` into `directory` (made if missing), safely (see above),
    counted into `counts` ({"files", "bytes", "kept", "refused", "members"}: files and bytes
    written, members across the archives of one copy). Bounds: the uncompressed bytes of
    this archive's files (written or kept) `max_bytes` (maxArchiveSize, as the warmer
    bounds one archive), the members of every archive of the copy `max_files`. Raises
    TorchBound past a bound, TorchDeadline past `deadline` (time.monotonic()), checked
    before each member (what was written stays: whole files), OSError or tarfile's errors
    for a broken archive."""
    import tarfile  # noqa: PLC0415 - torch caches alone need it

    made = not os.path.isdir(directory)
    total = 0  # this archive's uncompressed bytes
    os.makedirs(directory, mode=0o777, exist_ok=True)
    root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if made:
            os.fchmod(root, 0o777)
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                if time.monotonic() > deadline:
                    raise TorchDeadline("the copy's deadline passed before every torch archive member was extracted")
                counts["members"] += 1
                if counts["members"] > max_files:
                    raise TorchBound(f"more than {max_files} members in the torch archives")
                parts = torch_member_parts(member.name)
                if parts is None or not (member.isreg() or member.isdir()):
                    counts["refused"] += 1
                    continue
                if member.isreg():
                    total += member.size
                    if total > max_bytes:
                        raise TorchBound(f"a torch archive holds more than {max_bytes} bytes uncompressed "
                                         "(maxArchiveSize)")
                    source = tar.extractfile(member)
                else:
                    source = None
                done = _extract_member(root, parts, source, member.size, member.isdir(), member.mtime)
                if done == "written" and member.isreg():
                    counts["files"] += 1
                    counts["bytes"] += member.size
                elif done != "written":
                    counts[done] += 1
    finally:
        os.close(root)


def _sha256_of(path: str) -> str:
    import hashlib  # noqa: PLC0415 - torch caches alone need it

    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for chunk in iter(lambda: source.read(READ_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


# An archive extracted whole is unlinked from the copy's directory (the pod would otherwise hold
# it and its extraction): TORCH_EXTRACTED + its name (without "-cache") is left there instead,
# an empty file that says so. A restarted copier (an init container run again in the same pod,
# whose volumes stay) takes an archive with that mark as present (torch_extracted: not
# downloaded again, not a failure) and does not extract it again (seed_torch). The mark is the
# copier's own (sweep keeps it); its name holds the archive's SHA-256, so it names those bytes
# only. A mark a pod's process planted would only keep its own pod from being seeded.
TORCH_EXTRACTED = ".cachewarm-extracted-"


def torch_mark(name: str) -> str:
    """The mark of the extracted archive `name` (torch-inductor-<sha256>-cache). Pure."""
    return TORCH_EXTRACTED + name[:-len("-cache")]


def torch_extracted(dest: str, wanted: Iterable[Wanted]) -> dict[str, tuple[int, str]]:
    """The wanted torch archives that an earlier copy of this pod extracted whole and
    unlinked (their mark in `dest`, a regular file), as verified_present gives present
    entries (name -> the wanted (size, MD5))."""
    import stat  # noqa: PLC0415

    out: dict[str, tuple[int, str]] = {}
    for w in wanted:
        if TORCH_ARCHIVE.match(w.base) is None:
            continue
        try:
            if stat.S_ISREG(os.lstat(os.path.join(dest, torch_mark(w.base))).st_mode):
                out[w.base] = (w.entry.size, w.entry.md5)
        except OSError:
            continue
    return out


def _extracted(dest: str, name: str) -> None:
    """`name` in `dest` extracted whole: its mark made, then the archive unlinked. Raises OSError."""
    fd = os.open(os.path.join(dest, torch_mark(name)), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.close(fd)
    os.unlink(os.path.join(dest, name))


def seed_torch(dest: str, env: Mapping[str, str], summary: dict[str, Any], names: Iterable[str] | None = None,
               deadline: float = float("inf")) -> dict[str, Any]:
    """The torch archives among `names` (the copy's verified entries in `dest`; None: every
    one there, for tests) extracted into CACHEWARM_TORCH_DIR, each only when its bytes'
    SHA-256 is the one its name says (else refused: "archivesRefused" and an error), until
    `deadline` (time.monotonic(); past it: "stoppedAtDeadline" and an error); each one
    extracted whole then unlinked from `dest` (its mark left: TORCH_EXTRACTED), one an
    earlier copy extracted (its mark there, the archive not) counted "extractedBefore"; one
    that fails (broken, past maxArchiveSize) is an error, and the next is extracted all
    the same. The summary's `torch` ({"archives", "files", "bytes", "kept", "refused",
    "seconds"[, "archivesRefused"][, "extractedBefore"][, "stoppedAtDeadline"][, "error"]},
    "error" the first). Never raises."""
    started = time.monotonic()
    counts: dict[str, Any] = {"archives": 0, "files": 0, "bytes": 0, "kept": 0, "refused": 0, "members": 0}

    def failed(message: str) -> None:
        counts.setdefault("error", message[:MAX_ERROR_CHARS])
        add_error(summary, f"torch archives: {message}"[:MAX_ERROR_CHARS])

    try:
        max_bytes = int(env.get(ENV_TORCH_MAX_ARCHIVE_BYTES) or TORCH_MAX_ARCHIVE_BYTES)
        if names is None:
            names = os.listdir(dest) if os.path.isdir(dest) else []
        for name in sorted(n for n in set(names) if TORCH_ARCHIVE.match(n)):
            path = os.path.join(dest, name)
            if not os.path.lexists(path) and os.path.lexists(os.path.join(dest, torch_mark(name))):
                counts["extractedBefore"] = counts.get("extractedBefore", 0) + 1
                continue
            if _sha256_of(path) != name[len("torch-inductor-"):-len("-cache")]:
                counts["archivesRefused"] = counts.get("archivesRefused", 0) + 1
                add_error(summary, f"torch archive {name[:100]}: its bytes are not the SHA-256 its name says: "
                                   "not extracted")
                continue
            try:
                extract_torch(path, env[ENV_TORCH_DIR], counts, max_bytes, deadline=deadline)
            except TorchDeadline:
                raise
            except Exception as exc:  # noqa: BLE001 - this archive stops here; the next one is extracted
                failed(f"{name[:100]}: {type(exc).__name__}: {exc}")
                continue
            counts["archives"] += 1
            try:
                _extracted(dest, name)
            except OSError as exc:  # extracted whole, only not marked: the next archive is extracted too
                add_error(summary, f"torch archive {name[:100]} extracted but not marked: {exc}"[:MAX_ERROR_CHARS])
    except TorchDeadline as exc:
        counts["stoppedAtDeadline"] = 1
        failed(str(exc))
    except Exception as exc:  # noqa: BLE001 - the pod starts with what was extracted
        failed(f"{type(exc).__name__}: {exc}")
    counts.pop("members")
    counts["seconds"] = round(time.monotonic() - started, 3)
    return counts


def torch_cold(counts: Mapping[str, Any]) -> bool:
    """Whether a torch copy's extraction (seed_torch's counts) leaves the pod cold: no file of
    an archive in place (written, kept or extracted before) and something failed."""
    in_place = int(counts.get("files") or 0) + int(counts.get("kept") or 0) + int(counts.get("extractedBefore") or 0)
    return in_place == 0 and bool(counts.get("error") or counts.get("archivesRefused"))


def write_summary(path: str, summary: Mapping[str, Any]) -> None:
    """The summary JSON at `path`, whole or not at all (a temp file renamed over it)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    write_whole(path, temp, json.dumps(summary, sort_keys=True))


def write_whole(path: str, temp: str, text: str) -> None:
    """`text` at `path`, whole or not at all: written to `temp` (a new file), renamed over it."""
    try:
        with open(temp, "x") as out:
            out.write(text)
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


def copy(env: Mapping[str, str], live: dict[str, Any], on_demand: bool = False) -> dict[str, Any]:
    """The copy `env`'s settings ask for (its CAs, GCS's token or the emulator), counted
    into `live` (a new_summary, which may be read meanwhile): its summary, `live` or, for
    bad settings, a cold one; `on_demand`: its plan and asks beside the summary file (run).
    Never raises. What main and copy_in_process both run."""
    try:
        settings = Settings.from_env(env)
        context, error = ssl_context(settings.ca_bundle, settings.endpoint.lower().startswith("https:"))
        if error:
            add_error(live, error)
        token = metadata_token(settings.token_url) if settings.token_url else None
        client = Client(settings.endpoint, token or (lambda: None), context)
        live["auth"] = "metadata" if token is not None else "none"
        deadline = time.monotonic() + settings.deadline_seconds  # run's, give or take its setup
        verified: set[str] = set()
        summary = run(settings, client, live, settings.summary_path if on_demand else "", verified)
        if env.get(ENV_TORCH_DIR):  # before the summary: a torch process waits for it (sitecustomize)
            summary["torch"] = seed_torch(settings.dest, env, summary, verified, deadline)
            if torch_cold(summary["torch"]):  # usage.localCopy.coldPods and LocalCopyCold, as a failed copy
                summary["cold"] = True
        if token is not None:
            summary.update(tokens=token.fetched, tokensRefused=token.refusals)
        return summary
    except Exception as exc:  # noqa: BLE001 - bad settings: say so, start cold
        summary = new_summary("manifest" if ENV_COPY_MANIFESTS in env else "prefix")
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
    path = os.environ.get(ENV_COPY_SUMMARY, "")
    if path:  # the plan and the asks go before the summary, as at run's end
        drop_plan(path)
    finish(left_behind(live, started, "stopped"), path, stream)
    os._exit(0)


def main(stream: TextIO | None = None, on_demand: bool = False) -> None:
    """The init container: the copy, its summary on `stream` (stdout unless given) and in its
    file, exit 0; stopped (os._exit) when it still runs the grace after its deadline.
    `on_demand` (child()): the pod's processes read entries as they come (run)."""
    out = sys.stdout if stream is None else stream
    live = new_summary("prefix")
    watchdog = threading.Timer(bound_seconds(os.environ), _hard_stop, args=(live, time.monotonic(), out))
    watchdog.daemon = True
    watchdog.start()
    finish(copy(os.environ, live, on_demand), os.environ.get(ENV_COPY_SUMMARY, ""), out)
    sys.exit(0)


def child() -> None:
    """The copier child of a pod's python process (sitecustomize starts it, `python -s -S -P`,
    holding the pod's lock for it): main, its summary on stderr, the process's; its stdout
    is /dev/null, the process's own is the program's. On demand: its plan and the pod's asks
    beside the summary (run), so that a process reads an entry once it is there, not once
    the whole copy is."""
    main(sys.stderr, on_demand=True)


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
            if path:  # a killed copier child's plan and asks: no process reads by them now
                drop_plan(path)
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
