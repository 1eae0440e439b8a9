"""The copier's credentials settings and its token's refresh schedule (issue 30), pure or
against a local token server; tests/integration/test_copier_credentials.py runs them
against the metadata stand-in and the token-checking GCS proxy."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from cachewarm.agents import copier
from cachewarm.agents.copier import METADATA_TOKEN, METADATA_TOKEN_PATH, token_url


@pytest.mark.parametrize(("env", "want"), [
    ({}, METADATA_TOKEN),  # GKE: GCE's metadata server
    ({"STORAGE_EMULATOR_HOST": "http://gcs:9023"}, ""),  # an emulator without one: no token
    ({"STORAGE_EMULATOR_HOST": "http://gcs:9023", "GCE_METADATA_HOST": "10.0.0.2:8080"},
     f"http://10.0.0.2:8080{METADATA_TOKEN_PATH}"),  # the emulator does not switch it off
    ({"GCE_METADATA_ROOT": "metadata.google.internal"}, f"http://metadata.google.internal{METADATA_TOKEN_PATH}"),
    ({"GCE_METADATA_HOST": "[fd00::2]:80", "GCE_METADATA_ROOT": "ignored"}, f"http://[fd00::2]:80{METADATA_TOKEN_PATH}"),
    ({"STORAGE_EMULATOR_HOST": "http://gcs:9023", "GCE_METADATA_HOST": ""}, ""),  # empty is unset, as google-auth
])
def test_the_token_url_follows_google_auths_variables(env: dict[str, str], want: str) -> None:
    assert token_url(env) == want


@pytest.mark.parametrize("bad", ["http://metadata.google.internal", "169.254.169.254/computeMetadata", "a b",
                                 "host:port", "host:123456"])
def test_a_metadata_host_that_is_not_host_and_port_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="GCE_METADATA_HOST"):
        token_url({"GCE_METADATA_HOST": bad})


@pytest.fixture
def token_server() -> Iterator[tuple[str, list[int]]]:
    """A token endpoint whose answers state `lifetimes[0]` seconds (the test sets it)."""
    lifetimes = [3600]
    served = [0]

    class Tokens(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            served[0] += 1
            body = json.dumps({"access_token": f"t{served[0]}", "expires_in": lifetimes[0]}).encode()
            self.send_response(200 if self.headers.get("Metadata-Flavor") == "Google" else 403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/token", lifetimes
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("lifetime", "kept", "fetched_again"), [
    (3600, 3299.0, 3300.0),  # 5 min before an hour's token expires
    (2, 0.99, 1.0),  # half of a short one's life: never a token about to die
])
def test_a_token_is_fetched_again_before_it_expires(token_server: tuple[str, list[int]], lifetime: int, kept: float,
                                                    fetched_again: float, monkeypatch: pytest.MonkeyPatch) -> None:
    url, lifetimes = token_server
    lifetimes[0] = lifetime
    now = [1000.0]
    monkeypatch.setattr("cachewarm.agents.copier.time.monotonic", lambda: now[0])
    token = copier.MetadataToken(url)
    assert token() == "t1"
    now[0] = 1000.0 + kept
    assert (token(), token.fetched) == ("t1", 1)
    now[0] = 1000.0 + fetched_again
    assert (token(), token.fetched) == ("t2", 2)


def test_a_refused_token_is_dropped_once_however_many_requests_it_failed(token_server: tuple[str, list[int]]) -> None:
    url, _ = token_server
    token = copier.MetadataToken(url)
    first = token()
    assert token.refused(str(first))  # the first 401 drops it
    second = token()
    assert second != first
    assert token.refused(str(first))  # another request's 401 to the old token: worth a retry,
    assert (token(), token.fetched, token.refusals) == (second, 2, 1)  # with the new one, not a third
