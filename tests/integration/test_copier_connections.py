"""The copier keeps its connections (issue 30): each thread (the listing's, each worker)
sends its requests on one connection it keeps while the server keeps it (a TLS handshake per entry cost a copy of
1,000 small entries twice a plain client's CPU); a kept connection the server closed
meanwhile is replaced without costing an attempt; through a proxy the environment names,
requests go through urllib's proxy handling as before. Against a server of the test's own,
in process: HTTP/1.1 with keep-alive (GCS keeps connections too; the copier tests' fault
injector and the testbed's emulator answer HTTP/1.0 or close, so they never show reuse)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachewarm.agents import copier

pytestmark = pytest.mark.integration

BUCKET = "kept"


def md5_of(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - GCS's md5Hash


class KeepAlive(http.server.ThreadingHTTPServer):
    """The listing and media downloads of one bucket, HTTP/1.1, connections kept. Counts
    connections and requests; `close_every` N: the connection is closed, without a word,
    after every Nth answer on it (as a server whose idle timeout ran out). Requests in
    absolute form (a proxy's) are served too, and counted `proxied`."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(self, objects: dict[str, bytes], close_every: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), KeepAliveHandler)
        self.objects, self.close_every = objects, close_every
        self.connections = self.requests = self.proxied = 0
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    @contextlib.contextmanager
    def serving(self) -> Iterator[KeepAlive]:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()
            thread.join(10)


class KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    server: KeepAlive
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def setup(self) -> None:
        super().setup()
        self.answered = 0
        with self.server.lock:
            self.server.connections += 1

    def do_GET(self) -> None:  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        with self.server.lock:
            self.server.requests += 1
            self.server.proxied += int(bool(url.scheme))
        objects = f"/storage/v1/b/{BUCKET}/o"
        name = urllib.parse.unquote(url.path.removeprefix(f"/download{objects}/"))
        if url.path == objects:
            body = json.dumps({"items": [{"name": n, "size": str(len(d)), "md5Hash": md5_of(d), "generation": "7"}
                                         for n, d in sorted(self.server.objects.items())]}).encode()
        elif name in self.server.objects:
            body = self.server.objects[name]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.answered += 1
        if self.server.close_every and self.answered % self.server.close_every == 0:
            self.close_connection = True  # said nothing: the client finds out at its next request


def entries(count: int) -> dict[str, bytes]:
    return {f"jax/jit_p{i}-{hashlib.sha256(str(i).encode()).hexdigest()}-cache": os.urandom(3000 + i)
            for i in range(count)}


def copy(url: str, dest: Path, workers: int) -> dict[str, Any]:
    settings = copier.Settings(bucket=BUCKET, prefix="jax/", dest=str(dest), manifests=(), max_bytes=1 << 30,
                               workers=workers, deadline_seconds=60, endpoint=url)
    return copier.run(settings, copier.Client(url, lambda: "token"))


def test_each_worker_sends_its_requests_on_one_kept_connection(tmp_path: Path) -> None:
    objects = entries(20)
    with KeepAlive(objects).serving() as server:
        summary = copy(server.url, tmp_path, workers=1)
    assert (summary["copied"], summary["failed"], summary["errors"]) == (20, 0, []), summary
    # The listing and 20 downloads: one connection for the listing (run's own thread), one for the worker.
    assert (server.requests, server.connections) == (21, 2)
    for name, data in objects.items():
        assert (tmp_path / name.split("/")[1]).read_bytes() == data


def test_a_kept_connection_the_server_closed_is_replaced_without_costing_an_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one attempt per request, a request sent on a connection the server had closed
    would fail the entry, were it not sent again on a new connection."""
    monkeypatch.setattr(copier, "ATTEMPTS", 1)
    objects = entries(12)
    with KeepAlive(objects, close_every=3).serving() as server:
        summary = copy(server.url, tmp_path, workers=2)
    assert (summary["copied"], summary["failed"], summary["errors"]) == (12, 0, []), summary
    assert server.requests == 13 and server.connections >= 13 // 3


def test_through_a_proxy_the_environment_names_requests_go_by_urllib_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint's name resolves nowhere: only the proxy (the test's server, which also
    serves requests in a proxy's absolute form) can answer it."""
    objects = entries(3)
    with KeepAlive(objects).serving() as server:
        monkeypatch.setenv("HTTP_PROXY", server.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        summary = copy("http://storage.copier-test.invalid", tmp_path, workers=1)
    assert (summary["copied"], summary["failed"], summary["errors"]) == (3, 0, []), summary
    assert server.proxied == server.requests == 4
