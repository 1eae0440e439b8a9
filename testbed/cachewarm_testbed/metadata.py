"""A stand-in for the GCE/GKE metadata server, for tests: the token endpoint and what
google-auth's compute-engine credentials (and so gcsfs, with token=None or
"google_default") call on the way, with tokens that expire.

What it serves, as GCE's metadata server does (https://cloud.google.com/compute/docs/metadata/querying-metadata):
- Every request must carry `Metadata-Flavor: Google` and no `X-Forwarded-For`; otherwise
  403, as GCE answers. Every answer carries `Metadata-Flavor: Google` (google-auth's ping
  checks it).
- `GET /`: google-auth's ping (`_metadata.ping`, at GCE_METADATA_IP), 200.
- `GET /computeMetadata/v1/project/project-id`, `.../project/numeric-project-id`,
  `.../universe/universe-domain` (text).
- `GET /computeMetadata/v1/instance/service-accounts/{default|EMAIL}/?recursive=true`
  (JSON: email, scopes, aliases; google-auth reads it before each token), `.../email`,
  `.../scopes` (text).
- `GET` or `POST /computeMetadata/v1/instance/service-accounts/{default|EMAIL}/token`
  (`?scopes=` accepted): `{"access_token", "expires_in", "token_type": "Bearer"}`. Each
  request gets a new token (GKE's server hands out a cached one with its remaining
  lifetime; a new one each time is the harder case for a client's cache, not the kinder).

Tokens live `lifetime` seconds. `advertised` (default: the lifetime) is the `expires_in`
the answer states: a token that dies before its stated expiry is what a client meets when
a token is revoked or the clocks disagree, and then only a client that fetches a new one on
a 401 goes on.

Not GCE's (the testbed's own, under /_metadata/, no header needed):
- `GET /_metadata/tokeninfo?access_token=T`: 200 `{"expires_in": seconds left}` for a
  token this server issued that has not expired, else 400 `{"error": "invalid_token",
  "error_description": "expired" | "unknown"}`: the shape of Google's tokeninfo endpoint.
  The GCS proxy asks it (gcsproxy's auth mode), as GCS asks Google's.
- `POST /_metadata/config` `{"lifetime": s, "advertised": s | null}`: new tokens' lifetime.
- `GET /_metadata/log`: the token requests served (time, lifetime, advertised, refused).

Run: python -m cachewarm_testbed.metadata --host H --port P [--lifetime S] [--advertised S]
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROJECT = "cachewarm-testbed"
NUMERIC_PROJECT = "123456789012"
EMAIL = f"cachewarm@{PROJECT}.iam.gserviceaccount.com"
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
ACCOUNT = "/computeMetadata/v1/instance/service-accounts/"


class Tokens:
    """The tokens issued (token -> monotonic expiry) and the lifetimes of new ones."""

    def __init__(self, lifetime: float, advertised: float | None = None) -> None:
        self.lock = threading.Lock()
        self.lifetime = lifetime
        self.advertised = advertised
        self.issued: dict[str, float] = {}
        self.log: list[dict[str, Any]] = []

    def configure(self, lifetime: float, advertised: float | None) -> None:
        if not lifetime > 0 or (advertised is not None and not advertised > 0):
            raise ValueError("lifetime and advertised must be positive seconds")
        with self.lock:
            self.lifetime, self.advertised = lifetime, advertised

    def issue(self) -> dict[str, Any]:
        with self.lock:
            token = f"ya29.cachewarm-{secrets.token_hex(16)}"
            self.issued[token] = time.monotonic() + self.lifetime
            stated = self.advertised if self.advertised is not None else self.lifetime
            self.log.append({"time": time.time(), "token": token[-8:], "lifetime": self.lifetime,
                             "advertised": stated})
            # expires_in is an integer on GCE; at least 1 so a client never reads 0 as unset.
            return {"access_token": token, "expires_in": max(1, int(stated)), "token_type": "Bearer"}

    def check(self, token: str) -> tuple[float | None, str]:
        """(seconds left, '') for a live token of ours, else (None, 'expired' | 'unknown')."""
        with self.lock:
            until = self.issued.get(token)
        if until is None:
            return None, "unknown"
        left = until - time.monotonic()
        return (left, "") if left > 0 else (None, "expired")


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the token log says what matters; the access log would be noise

    def _answer(self, status: int, body: Any, *, flavor: bool = True) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "application/text")
        if flavor:
            self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve()

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self._serve(body)

    def _serve(self, body: bytes = b"") -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path.startswith("/_metadata/"):
            self._control(url.path, query, body)
            return
        # As GCE: the header is required, and a request forwarded by a proxy is refused.
        if self.headers.get("Metadata-Flavor") != "Google" or self.headers.get("X-Forwarded-For"):
            self._answer(403, "Missing Metadata-Flavor:Google header.\n" if self.headers.get("Metadata-Flavor") != "Google"
                         else "Request had X-Forwarded-For header and was rejected.\n")
            return
        path = url.path
        if path in ("", "/"):
            self._answer(200, "computeMetadata/\n")
        elif path == "/computeMetadata/v1/project/project-id":
            self._answer(200, PROJECT)
        elif path == "/computeMetadata/v1/project/numeric-project-id":
            self._answer(200, NUMERIC_PROJECT)
        elif path == "/computeMetadata/v1/universe/universe-domain":
            self._answer(200, "googleapis.com")
        elif path.startswith(ACCOUNT):
            self._account(path[len(ACCOUNT):], query)
        else:
            self._answer(404, "Not Found\n")

    def _account(self, rest: str, query: dict[str, list[str]]) -> None:
        account, _, item = rest.partition("/")
        if account not in ("default", EMAIL):
            self._answer(404, "Not Found\n")
        elif item == "" and query.get("recursive") == ["true"]:
            self._answer(200, {"aliases": ["default"], "email": EMAIL, "scopes": SCOPES})
        elif item == "":
            self._answer(200, "aliases\nemail\nidentity\nscopes\ntoken\n")
        elif item == "email":
            self._answer(200, EMAIL)
        elif item == "scopes":
            self._answer(200, "\n".join(SCOPES) + "\n")
        elif item == "token":
            self._answer(200, self.server.tokens.issue())
        else:
            self._answer(404, "Not Found\n")

    def _control(self, path: str, query: dict[str, list[str]], body: bytes) -> None:
        tokens = self.server.tokens
        if path == "/_metadata/tokeninfo":
            left, why = tokens.check((query.get("access_token") or [""])[0])
            if left is None:
                self._answer(400, {"error": "invalid_token", "error_description": why}, flavor=False)
            else:
                self._answer(200, {"expires_in": int(left), "expires_in_seconds": left}, flavor=False)
        elif path == "/_metadata/log":
            with tokens.lock:
                self._answer(200, list(tokens.log), flavor=False)
        elif path == "/_metadata/config" and self.command == "POST":
            try:
                got = json.loads(body or b"{}")
                advertised = got.get("advertised")
                tokens.configure(float(got["lifetime"]), None if advertised is None else float(advertised))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self._answer(400, {"error": f"{type(exc).__name__}: {exc}"}, flavor=False)
                return
            self._answer(200, {"lifetime": tokens.lifetime, "advertised": tokens.advertised}, flavor=False)
        else:
            self._answer(404, {"error": "no such control path"}, flavor=False)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], tokens: Tokens) -> None:
        super().__init__(address, Handler)
        self.tokens = tokens


def serve(host: str, port: int, lifetime: float, advertised: float | None = None) -> Server:
    """A running stand-in (in a daemon thread); `shutdown()` and `server_close()` end it."""
    server = Server((host, port), Tokens(lifetime, advertised))
    threading.Thread(target=server.serve_forever, name="metadata-stand-in", daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lifetime", type=float, default=3600.0, help="seconds a token lives")
    parser.add_argument("--advertised", type=float, default=None,
                        help="the expires_in stated (default: the lifetime)")
    args = parser.parse_args()
    server = Server((args.host, args.port), Tokens(args.lifetime, args.advertised))
    server.serve_forever()



class MetadataControl:
    """Test-side handle on a running stand-in: its base URL (http://host:port), its token
    log, new tokens' lifetime, and a token's check."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    @property
    def host(self) -> str:
        """host:port, as GCE_METADATA_HOST and GCE_METADATA_IP take it."""
        return urllib.parse.urlsplit(self.base_url).netloc

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def configure(self, lifetime: float, advertised: float | None = None) -> None:
        self._call("POST", "/_metadata/config", {"lifetime": lifetime, "advertised": advertised})

    def log(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/_metadata/log")
        return result


if __name__ == "__main__":
    main()
