"""What the copier picks from a listing: entries only, the union of the manifests' entries
only, with the manifest's size, MD5 and generation (or every entry, with the listing's; one
without them skipped), the entries already in the destination with that size and MD5 kept
and counted first, then the smallest first within the byte budget; what a manifest must look
like (version 2, every entry with its digests) and which manifests are trusted (those named
with a generation); that every other name in the destination is removed, before any
download, the copier's own files kept. How long it
waits before a retry (full jitter, a 429's or 503's Retry-After, never past the deadline),
and which CAs it trusts."""

from __future__ import annotations

import datetime as dt
import email.message
import json
import os
import random
import ssl
import time
import urllib.error
from pathlib import Path

import pytest

from cachewarm.admission import certificates as certs
from cachewarm.agents import copier
from cachewarm.agents.copier import (
    Entry,
    Settings,
    manifest_entries,
    pinned_manifests,
    plan,
    retry_after_seconds,
    retry_delay,
    ssl_context,
)

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
STEP, EVAL, INIT = f"jit_step-{A}-cache", f"jit_eval-{B}-cache", f"jit_init-{C}-cache"
M1, M2, M3 = "MTExMTExMTExMTExMTExMQ==", "MjIyMjIyMjIyMjIyMjIyMg==", "MzMzMzMzMzMzMzMzMzMzMw=="
LISTING = [
    {"name": f"jax/{STEP}", "size": "300", "md5Hash": M3, "generation": "30"},  # GCS lists sizes as strings
    {"name": f"jax/{EVAL}", "size": "100", "md5Hash": M1, "generation": "10"},
    {"name": f"jax/{INIT}", "size": "200", "md5Hash": M2, "generation": "20"},
    {"name": f"jax/jit_step-{A}-atime", "size": "8"},     # JAX's LRU bookkeeping
    {"name": f"jax/sub/jit_x-{A}-cache", "size": "10"},   # another cache's folder
    {"name": "jax/README", "size": "10"},
]
# What the pools' warmers recorded (sizes and digests of their own, not the listing's).
RECORDED = {STEP: Entry(301, M1, "31"), INIT: Entry(200, M2, "20"), f"jit_gone-{D}-cache": Entry(5, M3, "5")}


def names(wanted: list) -> list[str]:
    return [w.base for w in wanted]


def test_only_the_union_of_the_manifests_entries_is_picked_as_they_recorded_them() -> None:
    picked = plan(LISTING, "jax/", RECORDED, 10**9)
    assert (names(picked.download), picked.present) == ([INIT, STEP], [])
    # The manifest's size, MD5 and generation, not the listing's.
    assert [w.entry for w in picked.download] == [RECORDED[INIT], RECORDED[STEP]]
    assert picked.left == {"notAnEntry": 3, "notInManifest": 1, "notInBucket": 1, "overBudget": 0, "unverifiable": 0}


def test_without_a_manifest_every_entry_smallest_first_within_the_budget() -> None:
    picked = plan(LISTING, "jax/", None, 350)
    assert [w.entry for w in picked.download] == [Entry(100, M1, "10"), Entry(200, M2, "20")]
    assert picked.left == {"notAnEntry": 3, "notInManifest": 0, "notInBucket": 0, "overBudget": 1, "unverifiable": 0}
    assert plan(LISTING, "jax/", {}, 10**9).download == []  # manifests with no entries: nothing


@pytest.mark.parametrize("broken", [
    {"size": None}, {"md5Hash": None}, {"generation": None}, {"size": "-1"}, {"size": "1e3"}, {"size": True},
    {"md5Hash": "abc"}, {"generation": "12a"}, {"generation": 12}, {"size": "\u0663"},
])
def test_in_prefix_mode_a_listed_entry_without_size_md5_or_generation_is_skipped(broken: dict) -> None:
    listing = [{**LISTING[0], **broken}, *LISTING[1:]]
    listing[0] = {k: v for k, v in listing[0].items() if v is not None}
    picked = plan(listing, "jax/", None, 10**9)
    assert names(picked.download) == [EVAL, INIT] and picked.left["unverifiable"] == 1


def test_entries_present_with_the_wanted_size_and_md5_are_kept_and_count_against_the_budget_first() -> None:
    # STEP is there whole; EVAL is there with another MD5 (tampered, or cut short): copied again.
    local = {STEP: (300, M3), EVAL: (100, M2), "unrelated-file": (5, M1)}
    picked = plan(LISTING, "jax/", None, 500, present=local)
    assert names(picked.present) == [STEP] and picked.present_bytes == 300
    # 500 - 300 left: EVAL (100) fits, then INIT (200) does not.
    assert names(picked.download) == [EVAL]
    assert picked.left["overBudget"] == 1
    # Present entries are on disk anyway: kept even beyond the budget, and nothing more copied.
    over = plan(LISTING, "jax/", {STEP: Entry(300, M3, "30"), EVAL: Entry(100, M1, "10")}, 50, present=local)
    assert (names(over.present), over.download, over.left["overBudget"]) == ([STEP], [], 1)
    # Only what is wanted counts as present, and only with the manifest's digest.
    assert plan(LISTING, "jax/", {INIT: Entry(200, M2, "20")}, 10**9, present=local).present == []
    assert plan(LISTING, "jax/", RECORDED, 10**9, present=local).present == []  # STEP: 301 bytes recorded


GOOD = {"name": STEP, "size": 300, "md5": M3, "generation": "30"}


@pytest.mark.parametrize("doc", [
    "not json", json.dumps([]), json.dumps({"version": 3, "entries": []}), json.dumps({"version": 2}),
    json.dumps({"version": 2, "entries": {}}), json.dumps({"version": 2, "entries": [STEP]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "name": "../etc/passwd"}]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "name": f"sub/{STEP}"}]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "name": ""}]}),
    json.dumps({"version": 2, "entries": [{k: v for k, v in GOOD.items() if k != "md5"}]}),
    json.dumps({"version": 2, "entries": [{k: v for k, v in GOOD.items() if k != "generation"}]}),
    json.dumps({"version": 2, "entries": [{k: v for k, v in GOOD.items() if k != "size"}]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "md5": "not base64 of 16 bytes"}]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "generation": 30}]}),  # a number: not GCS's string
    json.dumps({"version": 2, "entries": [{**GOOD, "size": -1}]}),
    json.dumps({"version": 2, "entries": [{**GOOD, "size": True}]}),
    json.dumps({"version": 2, "entries": [GOOD, {**GOOD, "generation": "31"}]}),  # one name, two entries
])
def test_a_manifest_of_another_shape_is_refused(doc: str) -> None:
    with pytest.raises(ValueError):
        manifest_entries(doc.encode())


def test_a_version_1_manifest_is_refused_as_untrusted() -> None:
    """Version 1 named entries and sizes only: nothing to check an entry against."""
    with pytest.raises(ValueError, match="version-1 manifest: it carries no digests"):
        manifest_entries(json.dumps({"version": 1, "entries": [{"name": STEP, "size": 300}]}).encode())


def test_a_manifest_lists_entries_with_their_digests() -> None:
    doc = {"version": 2, "pool": "h100", "entries": [GOOD, {"name": INIT, "size": 200, "md5": M2, "generation": "20"}],
           "fingerprint": {}, "writtenTime": "2026-01-01T00:00:00Z"}
    assert manifest_entries(json.dumps(doc).encode()) == {STEP: Entry(300, M3, "30"), INIT: Entry(200, M2, "20")}
    assert manifest_entries(json.dumps({"version": 2, "entries": [GOOD, GOOD]}).encode()) == {STEP: Entry(300, M3, "30")}
    assert manifest_entries(b'{"version": 2, "entries": []}') == {}


@pytest.mark.parametrize(("value", "pinned", "untrusted"), [
    ("", (), 0), (" , ", (), 0),
    ("m/a.json#12", (("m/a.json", "12"),), 0),
    ("m/a.json#12, m/b.json#7,,m/a.json#12", (("m/a.json", "12"), ("m/b.json", "7")), 0),
    ("m/a.json", (), 1), ("m/a.json#", (), 1), ("#12", (), 1), ("m/a.json#12x", (), 1), ("m/a.json#-1", (), 1),
    ("m/a#b.json#3,m/c.json", (("m/a#b.json", "3"),), 1),  # the last # splits
])
def test_only_manifests_named_with_a_generation_are_trusted(value: str, pinned: tuple, untrusted: int) -> None:
    assert pinned_manifests(value) == (pinned, untrusted)


def test_settings_come_from_the_environment_with_bounds() -> None:
    s = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d", "CACHEWARM_COPY_PREFIX": "/x/y/",
                           "CACHEWARM_COPY_MANIFESTS": "m/a.json#1, m/b.json,,m/a.json#1",
                           "CACHEWARM_COPY_WORKERS": "500"})
    assert (s.prefix, s.manifests, s.pinned, s.untrusted, s.workers, s.endpoint) == (
        "x/y/", (("m/a.json", "1"),), True, 1, 64, "https://storage.googleapis.com")
    # Set but empty: manifest mode with nothing trusted; unset: the prefix.
    d = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d",
                           "CACHEWARM_COPY_MANIFESTS": " , "})
    assert (d.prefix, d.manifests, d.pinned, d.workers, d.max_bytes) == ("", (), True, 16, 8 << 30)
    u = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d"})
    assert (u.manifests, u.pinned) == ((), False)


def test_settings_take_requests_ca_bundle_then_curls() -> None:
    need = {"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d"}
    assert Settings.from_env(need).ca_bundle == ""
    assert Settings.from_env({**need, "CURL_CA_BUNDLE": "/c.pem"}).ca_bundle == "/c.pem"
    assert Settings.from_env({**need, "REQUESTS_CA_BUNDLE": "/r.pem", "CURL_CA_BUNDLE": "/c.pem"}).ca_bundle == "/r.pem"
    # Empty is unset, as in requests.
    assert Settings.from_env({**need, "REQUESTS_CA_BUNDLE": "", "CURL_CA_BUNDLE": "/c.pem"}).ca_bundle == "/c.pem"


def test_the_backoff_is_full_jitter_within_the_exponential_bound() -> None:
    asked: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        asked.append((low, high))
        return high * 0.25
    assert [retry_delay(n, 100.0, uniform=uniform) for n in (1, 2, 3)] == [0.125, 0.25, 0.5]
    assert asked == [(0.0, 0.5), (0.0, 1.0), (0.0, 2.0)]  # from 0: full jitter, not backoff +- a bit
    # With a real (seeded) random source: within the bounds, and spread over them.
    rng = random.Random(14)
    waits = [retry_delay(3, 100.0, uniform=rng.uniform) for _ in range(1000)]
    assert all(0.0 <= w <= 2.0 for w in waits)
    assert min(waits) < 0.2 and max(waits) > 1.8
    # Never past the deadline.
    assert retry_delay(3, 0.3, uniform=lambda low, high: high) == 0.3


def test_retry_after_replaces_the_jitter_capped_by_the_time_left() -> None:
    def never(low: float, high: float) -> float:
        raise AssertionError("no jitter when the server said when")
    assert retry_delay(1, 100.0, 7.0, uniform=never) == 7.0
    assert retry_delay(1, 3.0, 7.0, uniform=never) == 3.0
    assert retry_delay(2, 100.0, 0.0, uniform=never) == 0.0


@pytest.mark.parametrize(("value", "seconds"), [
    ("7", 7.0), (" 120 ", 120.0), ("1.5", 1.5), ("0", 0.0), (None, None), ("", None), ("-1", None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("nan", None), ("inf", None),
])
def test_retry_after_is_read_in_its_seconds_form_only(value: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(value) == seconds


@pytest.mark.parametrize(("status", "header", "slept"), [
    (503, "7", [7.0]), (429, "2", [2.0]),
    (500, "7", None),  # a 500's Retry-After is not honored: the jitter, at most 0.5 s
    (503, "Wed, 21 Oct 2015 07:28:00 GMT", None),
])
def test_a_429_or_503_retry_after_is_what_the_client_waits(
        status: int, header: str, slept: list[float] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr("cachewarm.agents.copier.time.sleep", waits.append)
    client = copier.Client("http://gcs.invalid", lambda: None)
    client.deadline = time.monotonic() + 50.0
    answers = iter([status, 200])

    def attempt() -> str:
        code = next(answers)
        if code != 200:
            headers = email.message.Message()
            headers["Retry-After"] = header
            raise urllib.error.HTTPError("http://gcs.invalid/o", code, "busy", headers, None)
        return "done"
    assert client._attempts("http://gcs.invalid/o", attempt) == "done"
    if slept is None:
        assert len(waits) == 1 and 0.0 <= waits[0] <= 0.5
    else:
        assert [round(w) for w in waits] == slept


def test_a_retry_after_past_the_deadline_gives_up_at_once_rather_than_wait_for_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr("cachewarm.agents.copier.time.sleep", waits.append)
    client = copier.Client("http://gcs.invalid", lambda: None)
    client.deadline = time.monotonic() + 50.0
    calls = []

    def attempt() -> str:
        calls.append(1)
        headers = email.message.Message()
        headers["Retry-After"] = "600"
        raise urllib.error.HTTPError("http://gcs.invalid/o", 429, "busy", headers, None)
    with pytest.raises(copier.CopyError, match="Retry-After 600 s is past the deadline") as raised:
        client._attempts("http://gcs.invalid/o", attempt)
    assert (waits, len(calls), raised.value.status) == ([], 1, 429)


def test_the_ca_bundle_is_trusted_or_said_to_be_unloadable(tmp_path: Path) -> None:
    assert ssl_context("", https=False) == (None, "")  # plain HTTP (an emulator): nothing to load
    # HTTPS without a bundle: one context of OpenSSL's defaults (SSL_CERT_FILE and SSL_CERT_DIR
    # included) for every connection, not urllib's default of a new one for each.
    plain, error = ssl_context("")
    assert isinstance(plain, ssl.SSLContext) and error == "" and plain.verify_mode == ssl.CERT_REQUIRED
    assert {c["subject"] for c in plain.get_ca_certs()} == \
        {c["subject"] for c in ssl.create_default_context().get_ca_certs()}
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certs.make_ca("intercepting-proxy", now=dt.datetime.now(dt.timezone.utc)).cert_pem)
    context, error = ssl_context(str(ca))
    assert isinstance(context, ssl.SSLContext) and error == ""
    # Besides the defaults, not instead of them: a pod's internal CA does not cut it off GCS.
    trusted = [c["subject"] for c in context.get_ca_certs()]
    assert ((("commonName", "intercepting-proxy"),),) in trusted
    defaults = {c["subject"] for c in ssl.create_default_context().get_ca_certs()}  # SSL_CERT_FILE's here
    assert set(trusted) == defaults | {((("commonName", "intercepting-proxy"),),)}
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    folder, error = ssl_context(str(tmp_path))  # a directory of CAs, as requests allows
    assert isinstance(folder, ssl.SSLContext) and error == ""
    for bad in (tmp_path / "missing.pem", tmp_path / "garbage.pem"):
        if bad.name == "garbage.pem":
            bad.write_text("not a certificate")
        context, error = ssl_context(str(bad))
        assert str(bad) in error and "default CAs" in error
        assert context is not None and ((("commonName", "intercepting-proxy"),),) not in \
            [c["subject"] for c in context.get_ca_certs()]  # the defaults alone


@pytest.mark.parametrize(("status", "body"), [(404, b"not here"), (200, b'{"no_token": 1}'), (200, b"not json")])
def test_the_metadata_servers_failures_are_connection_errors_not_gcs_answers(
        status: int, body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 from the metadata server (no Workload Identity) must not read as a manifest
    GCS does not have: it is retried as a connection error and reported without a status."""
    import http.server  # noqa: PLC0415
    import threading  # noqa: PLC0415

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(copier, "METADATA_TOKEN", f"http://127.0.0.1:{server.server_address[1]}/token")
        monkeypatch.setattr("cachewarm.agents.copier.time.sleep", lambda _: None)
        client = copier.Client("http://127.0.0.1:9", copier.metadata_token())
        client.deadline = time.monotonic() + 30.0
        with pytest.raises(copier.CopyError) as raised:
            client.read("bucket", "prefix/.cachewarm/pools/ns/cache/cpu.json")
        assert raised.value.status is None and "metadata server token" in str(raised.value)
    finally:
        server.shutdown()


class Manifests:
    """A client whose read_pinned answers from a dict of (name, generation) -> bytes; a
    missing key is GCS's 404."""

    def __init__(self, held: dict[tuple[str, str], bytes]) -> None:
        self.held = held
        self.asked: list[tuple[str, str]] = []

    def read_pinned(self, bucket: str, name: str, generation: str) -> bytes:
        self.asked.append((name, generation))
        if (name, generation) not in self.held:
            raise copier.CopyError(f"HTTP 404 for {name}", 404)
        return self.held[(name, generation)]


def manifest_doc(*entries: dict) -> bytes:
    return json.dumps({"version": 2, "entries": list(entries)}).encode()


def test_the_manifests_union_leaves_out_an_entry_two_of_them_record_differently() -> None:
    """Two pools' warmers that recorded one name with other digests: neither is trusted for it."""
    other = {**GOOD, "md5": M1}
    init = {"name": INIT, "size": 200, "md5": M2, "generation": "20"}
    client = Manifests({("m/a.json", "1"): manifest_doc(GOOD, init), ("m/b.json", "2"): manifest_doc(other),
                        ("m/c.json", "3"): b'{"version": 1, "entries": []}'})
    settings = Settings.from_env({"CACHEWARM_COPY_BUCKET": "b", "CACHEWARM_COPY_DEST": "/d",
                                  "CACHEWARM_COPY_MANIFESTS": "m/a.json#1,m/b.json#2,m/c.json#3,m/d.json#4,m/e.json"})
    summary = copier.new_summary("manifest")
    names = copier.read_manifests(settings, client, summary)  # type: ignore[arg-type]
    assert names == {INIT: Entry(200, M2, "20")}
    assert client.asked == [("m/a.json", "1"), ("m/b.json", "2"), ("m/c.json", "3"), ("m/d.json", "4")]  # not e
    assert (summary["trusted"], summary["manifestsRefused"], summary["manifestsUntrusted"],
            summary["manifestsMissing"]) == (2, 1, 1, ["m/d.json#4"])
    assert "version-1" in summary["manifestError"] and "nothingTrusted" not in summary


def test_the_sweep_removes_every_name_but_the_verified_and_the_copiers_own(tmp_path: Path) -> None:
    """Unlinked, never followed: files, symlinks (a partial file's name included), FIFOs; a
    file named as a partial but as an entry too (JAX would read it) is not the copier's. The
    summary, its lock and temp files are kept only where the summary lives in the
    destination. A directory is left: counted, and an error under a name JAX reads;
    lost+found (a new filesystem's) is not counted."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"theirs")
    dest = tmp_path / "dest"
    dest.mkdir()
    for name in (STEP, f"jit_x-{D}-cache", "notes", f"{copier.PARTIAL}1-abc-0", f"{copier.PARTIAL}x-{A}-cache",
                 "copy.json", "copy.json.lock", ".copy.json.7-0a0b0c0d.tmp"):
        (dest / name).write_bytes(b"x")
    (dest / f"jit_y-{D}-cache").symlink_to(outside)
    (dest / f"{copier.PARTIAL}2-abc-0").symlink_to(outside)
    os.mkfifo(dest / f"jit_f-{D}-cache")
    (dest / f"jit_d-{D}-cache").mkdir()
    (dest / "lost+found").mkdir()
    summary = copier.new_summary("prefix")
    removed = copier.sweep(str(dest), {STEP}, str(dest / "copy.json"), summary)
    assert removed == {f"jit_x-{D}-cache", "notes", f"{copier.PARTIAL}x-{A}-cache", f"jit_y-{D}-cache",
                       f"{copier.PARTIAL}2-abc-0", f"jit_f-{D}-cache"}
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [STEP, f"{copier.PARTIAL}1-abc-0", "copy.json", "copy.json.lock", ".copy.json.7-0a0b0c0d.tmp",
         f"jit_d-{D}-cache", "lost+found"])
    assert (summary["removedForeign"], summary["foreignDirs"]) == (6, 1) and outside.read_bytes() == b"theirs"
    assert len(summary["errors"]) == 1 and f"jit_d-{D}-cache" in summary["errors"][0]
    # The summary elsewhere: its names here are nobody's; directories not counted again.
    again = copier.sweep(str(dest), {STEP}, str(tmp_path / "copy.json"), summary, note_dirs=False)
    assert again == {"copy.json", "copy.json.lock", ".copy.json.7-0a0b0c0d.tmp"}
    assert (summary["removedForeign"], summary["foreignDirs"], len(summary["errors"])) == (9, 1, 1)


class Planted:
    """A client that lists two entries and, at each download, records whether the foreign
    file planted in the destination is still there, then writes the entry."""

    def __init__(self, dest: Path, foreign: Path) -> None:
        self.dest, self.foreign, self.deadline = dest, foreign, 0.0
        self.foreign_at_download: list[bool] = []

    def list(self, bucket: str, prefix: str) -> list[dict[str, str]]:
        return LISTING[1:3]

    def download(self, bucket: str, wanted: copier.Wanted, dest: str) -> tuple[int, bool]:
        self.foreign_at_download.append(self.foreign.exists())
        (self.dest / wanted.base).write_bytes(b"x" * wanted.entry.size)
        return wanted.entry.size, False


def test_foreign_names_are_removed_before_any_download(tmp_path: Path) -> None:
    """Before, not only after: a copy stopped at its deadline (the init container's watchdog,
    or in process left behind while the program goes on) leaves nothing foreign either."""
    foreign = tmp_path / f"jit_x-{D}-cache"
    foreign.write_bytes(b"#!evil")
    client = Planted(tmp_path, foreign)
    settings = Settings(bucket="b", prefix="jax/", dest=str(tmp_path), manifests=(), max_bytes=10**9, workers=1,
                        deadline_seconds=60, endpoint="http://unused")
    summary = copier.run(settings, client)  # type: ignore[arg-type]
    assert (summary["copied"], summary["removedForeign"], summary["errors"]) == (2, 1, []), summary
    assert client.foreign_at_download == [False, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == [EVAL, INIT]
