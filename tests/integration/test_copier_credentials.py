"""The copier's credentials as in production (issue 30), without a node: its token from
the testbed's metadata-server stand-in (cachewarm_testbed.metadata), sent to the GCS
emulator behind the proxy in its auth mode, which answers 401 to a request without a live
token of the stand-in's. A token shorter than the copy is fetched again before it expires;
one that dies before the expiry it stated is refused (401), dropped and replaced, once; a
copier that keeps its first token fails once it expires. google-auth's compute-engine
credentials, and so gcsfs, get their token from the stand-in too, with STORAGE_EMULATOR_HOST
set. The copier runs as the init container runs it (`python -I -S copier.py`) except where
its refresh is taken away, which only its own classes can do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.cloud import storage

from cachewarm.agents import copier
from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.gcsproxy import ProxyControl
from cachewarm_testbed.metadata import MetadataControl, Server, serve

pytestmark = pytest.mark.integration

COPIER = Path(copier.__file__)
# The tests' own google-cloud-storage client sends no token to an emulator: exempt (said in gcsproxy).
TEST_CLIENT = ["gcloud-python/"]


@pytest.fixture
def stand_in() -> Iterator[tuple[Server, MetadataControl]]:
    server = serve("127.0.0.1", 0, lifetime=3600)
    try:
        yield server, MetadataControl(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def checked(storage_bed: Testbed, storage_only: storage.Client,
            stand_in: tuple[Server, MetadataControl]) -> Iterator[tuple[str, dict[str, bytes], ProxyControl]]:
    """A bucket of eight entries under jax/ whose requests need the stand-in's tokens; the
    proxy's auth mode is off again afterwards (the rest of the suite sends none)."""
    bucket = f"creds-{uuid.uuid4().hex[:8]}"
    storage_only.create_bucket(bucket, location="us-central1")
    objects = {f"jax/jit_p{i}-{uuid.uuid4().hex}{uuid.uuid4().hex}-cache": bytes([i]) * (1000 + i) for i in range(8)}
    for name, data in objects.items():
        storage_only.bucket(bucket).blob(name).upload_from_string(data)
    proxy = ProxyControl(storage_bed.storage_emulator_host)
    proxy.clear_log()
    proxy.require_tokens(stand_in[1].base_url, [bucket], TEST_CLIENT)
    try:
        yield bucket, objects, proxy
    finally:
        proxy.allow_anonymous()
        proxy.clear_faults()


def slow_downloads(proxy: ProxyControl, seconds: float, count: int) -> None:
    """Each of the next `count` downloads answered `seconds` late (after its token was
    checked): with two workers, the copy outlasts a token of a second or two."""
    proxy.faults([{"method": "GET", "path": r"^/download/", "hang": seconds, "times": count, "forward": True}])


def copier_env(bed: Testbed, bucket: str, dest: Path, metadata: MetadataControl | None) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "STORAGE_EMULATOR_HOST": bed.storage_emulator_host,
           "CACHEWARM_COPY_BUCKET": bucket, "CACHEWARM_COPY_PREFIX": "jax", "CACHEWARM_COPY_DEST": str(dest),
           "CACHEWARM_COPY_WORKERS": "2", "CACHEWARM_COPY_DEADLINE_SECONDS": "120"}
    if metadata is not None:
        env["GCE_METADATA_HOST"] = metadata.host
    return env


def run_copier(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-I", "-S", str(COPIER)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1])["cachewarm-copier"])


def on_bucket(proxy: ProxyControl, bucket: str) -> list[dict[str, Any]]:
    return [r for r in proxy.log() if f"/b/{bucket}/" in r["path"] and r.get("auth") != "exempt"]


def test_a_token_shorter_than_the_copy_is_fetched_again_before_it_expires(
        tmp_path: Path, storage_bed: Testbed, stand_in: tuple[Server, MetadataControl],
        checked: tuple[str, dict[str, bytes], ProxyControl]) -> None:
    bucket, objects, proxy = checked
    metadata = stand_in[1]
    metadata.configure(lifetime=3)  # as stated: expires_in 3
    slow_downloads(proxy, 1.0, len(objects))  # 8 downloads, 2 at a time, 1 s each: 4 s at least
    summary = run_copier(copier_env(storage_bed, bucket, tmp_path / "copy", metadata))
    assert (summary["copied"], summary["failed"], summary["cold"], summary["auth"]) == (8, 0, False, "metadata"), summary
    # More than one token, each fetched before the last one died: GCS refused none.
    assert summary["tokens"] >= 2 and summary["tokensRefused"] == 0, summary
    assert summary["tokens"] == len(metadata.log())
    requests = on_bucket(proxy, bucket)
    assert len([r for r in requests if r["path"].startswith("/download/")]) == 8
    assert {(r["status"], r["auth"]) for r in requests} == {(200, "ok")}, requests
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(n.rsplit("/", 1)[1] for n in objects)


def test_a_token_refused_before_its_stated_expiry_is_replaced_and_the_request_tried_again(
        tmp_path: Path, storage_bed: Testbed, stand_in: tuple[Server, MetadataControl],
        checked: tuple[str, dict[str, bytes], ProxyControl]) -> None:
    """Tokens that live 2 s but state an hour (revoked, or the clocks disagree): the copier
    holds each valid, GCS refuses it once it died, and only the 401 tells the copier."""
    bucket, objects, proxy = checked
    metadata = stand_in[1]
    metadata.configure(lifetime=2, advertised=3600)
    slow_downloads(proxy, 2.5, len(objects))  # each round of two outlasts the token it started with
    summary = run_copier(copier_env(storage_bed, bucket, tmp_path / "copy", metadata))
    assert (summary["copied"], summary["failed"], summary["cold"]) == (8, 0, False), summary
    assert summary["tokensRefused"] >= 1 and summary["tokens"] == summary["tokensRefused"] + 1, summary
    requests = on_bucket(proxy, bucket)
    refused = [r for r in requests if r["status"] == 401]
    assert refused and {r["auth"] for r in refused} == {"expired"}, requests
    assert all(r["path"].startswith("/download/") for r in refused)
    assert len([r for r in requests if r["path"].startswith("/download/") and r["status"] == 200]) == 8


def test_a_copier_that_does_not_refresh_its_token_fails_once_it_expires(
        tmp_path: Path, storage_bed: Testbed, stand_in: tuple[Server, MetadataControl],
        checked: tuple[str, dict[str, bytes], ProxyControl]) -> None:
    """The copier's own run() with a token fetched once and never again (no refresh, no
    401 renewal): what the two tests above would be without them."""
    bucket, objects, proxy = checked
    metadata = stand_in[1]
    metadata.configure(lifetime=1.5)
    slow_downloads(proxy, 1.0, len(objects))  # the third round of two starts 2 s after the token at least
    env = copier_env(storage_bed, bucket, tmp_path / "copy", metadata)
    settings = copier.Settings.from_env(env)
    first = copier.metadata_token(settings.token_url)()
    summary = copier.run(settings, copier.Client(settings.endpoint, lambda: first))
    assert summary["failed"] >= 1 and summary["copied"] < 8, summary
    assert any("HTTP 401" in e for e in summary["errors"]), summary
    assert {r["auth"] for r in on_bucket(proxy, bucket) if r["status"] == 401} == {"expired"}


def test_without_a_token_or_with_one_the_stand_in_never_issued_gcs_answers_401(
        stand_in: tuple[Server, MetadataControl], checked: tuple[str, dict[str, bytes], ProxyControl],
        storage_bed: Testbed) -> None:
    bucket, objects, proxy = checked
    name = next(iter(objects))
    url = (f"{storage_bed.storage_emulator_host}/download/storage/v1/b/{bucket}/o/"
           f"{urllib.parse.quote(name, safe='')}?alt=media")
    for headers, auth in (({}, "missing"), ({"Authorization": "Bearer ya29.forged"}, "unknown")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"].startswith("Bearer ")
        body = json.loads(refused.value.read())
        assert body["error"]["code"] == 401 and body["error"]["errors"][0]["location"] == "Authorization", body
        assert proxy.log()[-1] == {"method": "GET", "path": f"/download/storage/v1/b/{bucket}/o/{name}",
                                   "status": 401, "auth": auth}
    token = copier.metadata_token(f"{stand_in[1].base_url}{copier.METADATA_TOKEN_PATH}")()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}),
                                timeout=10) as answer:
        assert answer.read() == objects[name]
    # Another bucket's requests are not checked (the rest of the suite's).
    listing = f"{storage_bed.storage_emulator_host}/storage/v1/b?project=testbed"
    with urllib.request.urlopen(listing, timeout=10) as answer:
        assert answer.status == 200


def test_the_stand_in_refuses_requests_without_the_metadata_flavor_header_as_gce_does(
        stand_in: tuple[Server, MetadataControl]) -> None:
    url = f"{stand_in[1].base_url}{copier.METADATA_TOKEN_PATH}"
    for headers in ({}, {"Metadata-Flavor": "google-ish"},
                    {"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.1"}):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        assert refused.value.code == 403
    assert stand_in[1].log() == []  # no token was issued


def test_a_metadata_host_that_is_not_host_and_port_or_gives_no_token_is_a_cold_start_that_says_so(
        tmp_path: Path, storage_bed: Testbed) -> None:
    env = copier_env(storage_bed, "any", tmp_path / "copy", None)
    summary = run_copier({**env, "GCE_METADATA_HOST": "http://metadata.google.internal/"})
    assert summary["cold"] and "GCE_METADATA_HOST" in summary["errors"][0], summary
    # Nothing listens there: retried as a refused connection, then given up, cold.
    summary = run_copier({**env, "GCE_METADATA_HOST": "127.0.0.1:9", "CACHEWARM_COPY_DEADLINE_SECONDS": "5"})
    assert summary["cold"] and summary["auth"] == "metadata", summary
    assert any("metadata server token" in e for e in summary["errors"]), summary


def test_with_an_emulator_and_no_metadata_host_named_the_copy_is_anonymous_and_says_so(
        tmp_path: Path, storage_bed: Testbed, storage_only: storage.Client) -> None:
    bucket = f"anon-{uuid.uuid4().hex[:8]}"
    storage_only.create_bucket(bucket, location="us-central1")
    storage_only.bucket(bucket).blob(f"jax/jit_a-{'ab' * 32}-cache").upload_from_string(b"x" * 10)
    summary = run_copier(copier_env(storage_bed, bucket, tmp_path / "copy", None))
    assert (summary["copied"], summary["auth"], "tokens" in summary) == (1, "none", False), summary


GCSFS_ROUND_TRIP = textwrap.dedent("""
    import gcsfs, json, sys
    fs = gcsfs.GCSFileSystem()  # token=None: google-auth's default credentials
    path = sys.argv[1]
    with fs.open(path, "wb") as out:
        out.write(b"written with a token")
    fs.invalidate_cache()
    print(json.dumps({"method": fs.credentials.method, "read": fs.cat(path).decode(),
                      "type": type(fs.credentials.credentials).__name__}))
""")


def test_gcsfs_with_an_emulator_takes_its_token_from_the_stand_in_through_google_auth(
        storage_bed: Testbed, stand_in: tuple[Server, MetadataControl],
        checked: tuple[str, dict[str, bytes], ProxyControl]) -> None:
    """What the warmer and gs:// readers (JAX through etils) do: gcsfs's default, with
    STORAGE_EMULATOR_HOST set and the stand-in named by GCE_METADATA_HOST and
    GCE_METADATA_IP (google-auth pings the latter); its tokens last 2 s, less than gcsfs's
    5 min refresh buffer, so it fetches one for each request."""
    bucket, _, proxy = checked
    metadata = stand_in[1]
    metadata.configure(lifetime=2)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "STORAGE_EMULATOR_HOST": storage_bed.storage_emulator_host,
           "GCE_METADATA_HOST": metadata.host, "GCE_METADATA_IP": metadata.host,
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": storage_bed.env()["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"]}
    out = subprocess.run([sys.executable, "-c", GCSFS_ROUND_TRIP, f"{bucket}/jax/by-gcsfs"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"method": "google_default", "read": "written with a token", "type": "Credentials"}, got
    requests = on_bucket(proxy, bucket)
    assert requests and {r["auth"] for r in requests} == {"ok"}, requests
    assert any(r["method"] == "POST" and r["path"].startswith("/upload/") for r in requests), requests
    assert len(metadata.log()) >= 2
