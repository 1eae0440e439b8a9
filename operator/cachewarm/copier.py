"""cachewarm's copier: a cache's entries from its bucket into a local directory, so that a
training process reads them as from local disk (issue 14's local copy, the part that runs
in the pod; the webhook does not add it to pods yet, and the warmer image does not ship it
yet).

It is meant to run with the training image's own python (as the warmer does) and needs
only the standard library, so the image needs no GCS library. Where
`STORAGE_EMULATOR_HOST` is set it talks to that (no auth); otherwise to GCS with the pod's
token from the metadata server (GKE Workload Identity).

- What it copies: the JAX entries (`<program>-<sha256>-cache`) directly under the prefix
  whose key hash starts with one of `keys` (what the warmers of the pod's pool reported),
  or every entry when no keys are given; at most `max_bytes` in all, smallest first (the
  most entries for the budget), the rest left out and counted.
- How: `workers` downloads at once; each into a hidden partial file that is checked
  against GCS's MD5 (every object that is not a composite has one) and only then renamed
  to its entry name, so JAX never opens a partial or corrupt entry; 429, 5xx and broken
  connections are retried (4 attempts, backoff from 0.5 s); nothing is started after the
  deadline.
- It never fails the pod: whatever goes wrong (no bucket, no network, a bad entry), it
  says so on stdout (one JSON line) and exits 0; the process then starts with what was
  copied, a cold start for the rest.

Run: python copier.py  (settings from CACHEWARM_COPY_* in the environment; see `Settings`)
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ENTRY = re.compile(r"^[^/]+-(?P<hash>[0-9a-f]{64})-cache$")
GCS = "https://storage.googleapis.com"
METADATA_TOKEN = "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token"
ATTEMPTS = 4
BACKOFF_SECONDS = 0.5
RETRIED = frozenset({408, 429, 500, 502, 503, 504})
REQUEST_TIMEOUT_SECONDS = 30.0
PARTIAL = ".cachewarm-partial-"


@dataclasses.dataclass(frozen=True)
class Settings:
    bucket: str
    prefix: str  # object-name prefix, '' or ending in '/'
    dest: str
    keys: tuple[str, ...] | None  # key-hash prefixes to copy; None: every entry
    max_bytes: int
    workers: int
    deadline_seconds: float
    endpoint: str  # GCS's or the emulator's base URL

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Raises KeyError or ValueError for a missing or malformed setting."""
        prefix = env.get("CACHEWARM_COPY_PREFIX", "").strip("/")
        keys = env.get("CACHEWARM_COPY_KEYS")
        return cls(
            bucket=env["CACHEWARM_COPY_BUCKET"], prefix=f"{prefix}/" if prefix else "",
            dest=env["CACHEWARM_COPY_DEST"],
            keys=None if keys is None else tuple(k.strip() for k in keys.split(",") if k.strip()),
            max_bytes=int(env.get("CACHEWARM_COPY_MAX_BYTES", str(8 << 30))),
            workers=max(1, min(int(env.get("CACHEWARM_COPY_WORKERS", "8")), 64)),
            deadline_seconds=float(env.get("CACHEWARM_COPY_DEADLINE_SECONDS", "300")),
            endpoint=(env.get("STORAGE_EMULATOR_HOST") or GCS).rstrip("/"),
        )


def plan(objects: Iterable[Mapping[str, Any]], prefix: str, keys: tuple[str, ...] | None,
         max_bytes: int) -> tuple[list[Mapping[str, Any]], dict[str, int]]:
    """(the objects to copy, counts of what is left out and why). Pure."""
    wanted, left = [], {"notAnEntry": 0, "notInManifest": 0, "overBudget": 0}
    for obj in objects:
        name = str(obj.get("name") or "")
        found = ENTRY.match(name[len(prefix):]) if name.startswith(prefix) else None
        if found is None:
            left["notAnEntry"] += 1
        elif keys is not None and not any(found.group("hash").startswith(k) for k in keys):
            left["notInManifest"] += 1
        else:
            wanted.append(obj)
    out, total = [], 0
    for obj in sorted(wanted, key=lambda o: (int(o.get("size") or 0), str(o.get("name")))):
        size = int(obj.get("size") or 0)
        if total + size > max_bytes:
            left["overBudget"] += 1
            continue
        out.append(obj)
        total += size
    return out, left


class CopyError(Exception):
    pass


class Client:
    """The two GCS JSON API calls the copier makes, with retries."""

    def __init__(self, endpoint: str, token: Callable[[], str | None]) -> None:
        self.endpoint, self.token = endpoint, token

    def _open(self, url: str) -> Any:
        headers = {}
        bearer = self.token()
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        last: Exception | None = None
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1))
            try:
                return urllib.request.urlopen(urllib.request.Request(url, headers=headers),  # noqa: S310
                                              timeout=REQUEST_TIMEOUT_SECONDS)
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRIED:
                    raise CopyError(f"HTTP {exc.code} for {url}") from None
                last = exc
            except (urllib.error.URLError, OSError) as exc:
                last = exc
        raise CopyError(f"gave up after {ATTEMPTS} attempts: {last}")

    def list(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token = ""
        while True:
            # matchGlob: the entries directly under the prefix, not other caches' folders below it.
            query = {"prefix": prefix, "matchGlob": f"{prefix}*", "fields": "items(name,size,md5Hash),nextPageToken",
                     "maxResults": "1000"}
            if token:
                query["pageToken"] = token
            url = f"{self.endpoint}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?{urllib.parse.urlencode(query)}"
            with self._open(url) as answer:
                page = json.load(answer)
            out += page.get("items") or []
            token = page.get("nextPageToken") or ""
            if not token:
                return out

    def download(self, bucket: str, obj: Mapping[str, Any], dest: str) -> int:
        """The object into `dest`/<its name within the prefix>, checked and renamed into
        place. Returns its size. Raises CopyError."""
        name = str(obj["name"])
        url = (f"{self.endpoint}/download/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
               f"{urllib.parse.quote(name, safe='')}?alt=media")
        final = os.path.join(dest, name.rsplit("/", 1)[-1])
        partial = os.path.join(dest, PARTIAL + name.rsplit("/", 1)[-1])
        digest = hashlib.md5()  # noqa: S324 - GCS's own checksum, not a security measure
        size = 0
        try:
            with self._open(url) as answer, open(partial, "wb") as out:
                while chunk := answer.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            expected = obj.get("md5Hash")
            if expected and base64.b64encode(digest.digest()).decode() != expected:
                raise CopyError(f"{name}: MD5 does not match GCS's (a corrupt or changed object)")
            if obj.get("size") is not None and size != int(obj["size"]):
                raise CopyError(f"{name}: {size} bytes read, GCS lists {obj['size']}")
            os.replace(partial, final)
        except (CopyError, OSError) as exc:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise CopyError(str(exc)) from None
        return size


def metadata_token() -> Callable[[], str | None]:
    """The pod's access token from the metadata server, fetched once and then again
    shortly before it expires."""
    lock = threading.Lock()
    state: dict[str, Any] = {"token": None, "until": 0.0}

    def token() -> str | None:
        with lock:
            if state["token"] is None or time.monotonic() > state["until"]:
                request = urllib.request.Request(METADATA_TOKEN, headers={"Metadata-Flavor": "Google"})
                with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310
                    got = json.load(answer)
                state["token"] = got["access_token"]
                state["until"] = time.monotonic() + max(float(got.get("expires_in", 300)) - 60, 30)
            return str(state["token"])
    return token


def run(settings: Settings, client: Client) -> dict[str, Any]:
    """Copy what `plan` picks. Never raises: the summary says what happened."""
    started = time.monotonic()
    summary: dict[str, Any] = {"source": "prefix" if settings.keys is None else "manifest", "copied": 0, "bytes": 0,
                               "failed": 0, "errors": [], "cold": False}
    try:
        os.makedirs(settings.dest, exist_ok=True)
        objects = client.list(settings.bucket, settings.prefix)
        todo, summary["leftOut"] = plan(objects, settings.prefix, settings.keys, settings.max_bytes)
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
            for future in concurrent.futures.as_completed([pool.submit(one, obj) for obj in todo]):
                error = future.exception()
                if error is not None:
                    summary["failed"] += 1
                    if len(summary["errors"]) < 5:
                        summary["errors"].append(str(error)[:300])
    except Exception as exc:  # noqa: BLE001 - the pod starts anyway, cold
        summary["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
    summary["cold"] = summary["copied"] == 0 and bool(summary["errors"] or summary["failed"])
    summary["seconds"] = round(time.monotonic() - started, 3)
    return summary


def main() -> None:
    try:
        settings = Settings.from_env(os.environ)
        client = Client(settings.endpoint, (lambda: None) if os.environ.get("STORAGE_EMULATOR_HOST")
                        else metadata_token())
        summary = run(settings, client)
    except Exception as exc:  # noqa: BLE001 - bad settings: say so, start cold
        summary = {"copied": 0, "cold": True, "errors": [f"{type(exc).__name__}: {exc}"[:300]]}
    print(json.dumps({"cachewarm-copier": summary}, sort_keys=True), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
