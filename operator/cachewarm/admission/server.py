"""The admission webhook's HTTPS endpoint: our own server for kopf's admission handlers.

kopf documents custom webhook servers (kopf.WebhookServerProtocol): a callable that takes
kopf's WebhookFn, serves it, and yields the client config. Ours makes sure that whatever
arrives (not UTF-8, not JSON, not an AdmissionReview, a resource we have no handler for,
a handler that fails) gets a well-formed answer, and that a pod is never refused because
of us: the webhook only adds settings, so on any doubt it admits the pod unchanged. Its
certificate is reloaded in place (`ServingTls.load`): new connections get the new one,
the listener never closes.

Two listeners share that certificate (`Listener`): the admission one, which asks for a
client certificate of the configured CA when there is one (the apiserver's, through its
admission configuration: anyone else is refused in the TLS handshake and learns nothing),
and the reports one, which training pods reach with their tokens. Both bound what a
client can hold: the TLS handshake, the time to send a request's headers and its body,
the idle time between requests (keep-alive), the connections open at once, and those
open at once from one peer address (so that one pod cannot hold every connection the
listener takes); a connection over any of them is closed.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from cachewarm.admission.keeper import TlsMaterial

log = logging.getLogger("cachewarm.webhook")


def _review(uid: str, *, warning: str | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if warning:
        response["warnings"] = [warning]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _bad_request(message: str, status: int = 400) -> aiohttp.web.Response:
    return aiohttp.web.json_response(
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": status},
        status=status,
    )


def check_review(data: Any) -> str | None:
    """Why `data` is not an AdmissionReview request we can answer, or None if it is."""
    if not isinstance(data, Mapping):
        return "body is not a JSON object"
    if data.get("kind") != "AdmissionReview":
        return f"kind is {data.get('kind')!r}, expected AdmissionReview"
    request = data.get("request")
    if not isinstance(request, Mapping):
        return "request is missing"
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        return "request.uid is missing"
    return None


async def serve(fn: kopf.WebhookFn, request: aiohttp.web.Request) -> aiohttp.web.Response:
    """One admission request: checked, handed to kopf's `fn`, answered; never a denial."""
    raw = await request.read()  # read (bounded in size and time) by the listener's middleware
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _bad_request("request body is not UTF-8")
    except json.JSONDecodeError as exc:
        return _bad_request(f"request body is not JSON: {exc}")
    problem = check_review(data)
    if problem is not None:
        return _bad_request(f"not an AdmissionReview request: {problem}")
    req = data["request"]
    uid = req["uid"]
    obj = req.get("object")
    # The stored object's namespace can be empty at admission; the request has it.
    if isinstance(obj, dict) and isinstance(req.get("namespace"), str):
        meta = obj.setdefault("metadata", {})
        if isinstance(meta, dict) and not meta.get("namespace"):
            meta["namespace"] = req["namespace"]
    try:
        response = await fn(
            data,
            webhook=request.match_info.get("id"),
            sslpeer=request.transport.get_extra_info("peercert") if request.transport else None,
            headers=dict(request.headers),
        )
    except Exception as exc:  # noqa: BLE001 - any failure admits the pod unchanged
        log.warning("Admitted request %s unchanged after an error: %s", uid, exc)
        return aiohttp.web.json_response(
            _review(uid, warning=f"cachewarm did not process this request ({type(exc).__name__}); admitted unchanged")
        )
    payload = response.get("response") if isinstance(response, dict) else None
    if isinstance(payload, dict) and not payload.get("allowed", True):
        # A handler failed: never deny a pod on our account.
        message = ((payload.get("status") or {}).get("message")) or "handler failed"
        log.warning("Admitted request %s unchanged after a handler error: %s", uid, message)
        return aiohttp.web.json_response(
            _review(uid, warning=f"cachewarm did not inject this pod: {message}; admitted unchanged")
        )
    return aiohttp.web.json_response(response)


class ServingTls:
    """The servers' TLS contexts, whose certificate can be replaced while they serve.
    OpenSSL copies the certificate into each connection as it starts, so loading a new
    one into the same context affects new handshakes only. `context` is the admission
    listener's: with `client_ca` (PEM), a client must present a certificate that CA
    signed (the apiserver's webhook client certificate) or the handshake fails;
    `reports_context` never asks for one (pods authenticate with their tokens).
    Raises ssl.SSLError for an unreadable `client_ca`."""

    def __init__(self, client_ca: bytes = b"") -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        if client_ca:
            self.context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.reports_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.material: TlsMaterial | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="cachewarm-tls-"))

    def load(self, material: TlsMaterial) -> bool:
        """Serve `material` from now on; False when it is what is served already.
        Raises ssl.SSLError when the certificate and key do not match."""
        if material == self.material:
            return False
        # ssl loads certificates from files only: private ones, in the writable /tmp.
        certfile, keyfile = self._dir / "tls.crt", self._dir / "tls.key"
        certfile.write_bytes(material.cert_pem)
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(material.key_pem)
        try:
            self.context.load_cert_chain(str(certfile), str(keyfile))
            self.reports_context.load_cert_chain(str(certfile), str(keyfile))
        finally:
            keyfile.unlink()
        self.material = material
        return True


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may hold of a listener (seconds, connections)."""

    handshake_seconds: float = 5.0  # the TLS handshake
    header_seconds: float = 5.0  # from the handshake to a request's complete headers
    body_seconds: float = 10.0  # from the headers to the complete body
    keepalive_seconds: float = 5.0  # from an answer to the next request's complete headers
    max_connections: int = 256  # open at once; more are closed at once
    # open at once from one peer IP; more from it are closed at once (others are still taken);
    # a client with a verified client certificate (the apiserver) is not bound by it
    max_connections_per_peer: int = 16
    max_body_bytes: int = 1024 * 1024  # as aiohttp's default before; etcd stores at most 1.5 MiB an object


class _Guard(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: refuses it past the connection cap or
    its peer address's, and closes it when a deadline passes while it is not being
    answered (the request's headers not in within header_seconds of its start or
    keepalive_seconds of the last answer; the body's deadline is the middleware's)."""

    def __init__(self, listener: Listener, inner: asyncio.Protocol) -> None:
        self.listener, self.inner = listener, inner
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = _peer_host(transport)
        listener = self.listener
        if not _authenticated(transport) and \
                listener.per_peer.get(self.peer, 0) >= listener.limits.max_connections_per_peer:
            listener.refused_per_peer += 1
            transport.abort()  # type: ignore[attr-defined]  # a transport that streams
            return
        if len(listener.open) >= listener.limits.max_connections:
            listener.refused += 1
            transport.abort()  # type: ignore[attr-defined]
            return
        self._admitted = True
        listener.open[transport] = self
        listener.per_peer[self.peer] = listener.per_peer.get(self.peer, 0) + 1
        self.arm(self.listener.limits.header_seconds)
        self.inner.connection_made(transport)

    def arm(self, seconds: float | None) -> None:
        """Close the connection in `seconds` unless re-armed; None: not while answering."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds is not None and self.transport is not None:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.listener.expired += 1
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self._admitted else None

    def pause_writing(self) -> None:
        if self._admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.arm(None)
        if self._admitted:
            self._admitted = False
            self.listener.open.pop(self.transport, None)  # type: ignore[arg-type]
            left = self.listener.per_peer.pop(self.peer, 1) - 1
            if left > 0:
                self.listener.per_peer[self.peer] = left
            self.inner.connection_lost(exc)


def _authenticated(transport: asyncio.BaseTransport) -> bool:
    """Whether the peer presented a client certificate, which a context that asks for one
    (the admission listener's with a client CA, CERT_REQUIRED) has verified in the
    handshake: the apiserver, whose connections only the listener's own cap bounds."""
    ssl_object = transport.get_extra_info("ssl_object")
    return isinstance(ssl_object, ssl.SSLObject) and bool(ssl_object.getpeercert())


def _peer_host(transport: asyncio.BaseTransport) -> str:
    """The connection's peer IP address ("" when the transport does not say)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""


_Route = Callable[[aiohttp.web.Request], Awaitable[aiohttp.web.StreamResponse]]


class Listener:
    """One HTTPS listener of `routes` (POST path -> handler; "/{id:.*}" a catch-all) on
    `addr`:`port` with `context`, bounded by `limits`. `start()` then `stop()`."""

    def __init__(self, *, name: str, addr: str, port: int, context: ssl.SSLContext,
                 routes: Mapping[str, _Route], limits: Limits) -> None:
        self.name, self.addr, self.port, self.context, self.limits = name, addr, port, context, limits
        self.routes = dict(routes)
        self.open: dict[asyncio.BaseTransport, _Guard] = {}
        self.per_peer: dict[str, int] = {}  # peer IP -> its connections in `open`
        self.refused = self.refused_per_peer = self.expired = 0
        self._runner: aiohttp.web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

    @aiohttp.web.middleware
    async def _deadlines(self, request: aiohttp.web.Request, handler: _Route) -> aiohttp.web.StreamResponse:
        """The headers are in: the body within body_seconds (read whole, at most
        max_body_bytes), the answer, then keepalive_seconds for the next request."""
        guard = self.open.get(request.transport) if request.transport is not None else None
        if guard is not None:
            guard.arm(None)
        try:
            try:
                await asyncio.wait_for(request.read(), self.limits.body_seconds)
            except TimeoutError:
                return _closing(_bad_request(f"request body not received within {self.limits.body_seconds:g}s",
                                             status=408))
            except aiohttp.web.HTTPRequestEntityTooLarge:
                return _closing(_bad_request(f"request body larger than {self.limits.max_body_bytes} bytes",
                                             status=413))
            return await handler(request)
        finally:
            if guard is not None:
                guard.arm(self.limits.keepalive_seconds)

    async def start(self) -> None:
        """Listen. Raises OSError (the port taken)."""
        app = aiohttp.web.Application(middlewares=[self._deadlines], client_max_size=self.limits.max_body_bytes)
        app.add_routes([aiohttp.web.post(path, fn) for path, fn in self.routes.items()])
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False, keepalive_timeout=self.limits.keepalive_seconds)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        # reuse_port: replicas on one host (tests, a hostNetwork install) share the port.
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guard(self, server()), self.addr or None, self.port, ssl=self.context,
            ssl_handshake_timeout=self.limits.handshake_seconds, reuse_address=True, reuse_port=True)
        log.info("Serving %s on %s:%s", self.name, self.addr or "*", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()


def _closing(response: aiohttp.web.Response) -> aiohttp.web.Response:
    response.force_close()
    return response


class AdmissionServer:
    """A kopf webhook server (kopf.WebhookServerProtocol) on `addr`:`port` with `tls`
    (its client-authenticating context), bounded by `limits`."""

    def __init__(self, *, addr: str, port: int, tls: ServingTls, url: str = "",
                 limits: Limits | None = None) -> None:
        self.addr, self.port, self.tls, self.url = addr, port, tls, url
        self.limits = limits or Limits()
        self.listener: Listener | None = None

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await serve(fn, request)

        self.listener = Listener(name="the admission webhook", addr=self.addr, port=self.port,
                                 context=self.tls.context, routes={"/{id:.*}": handle}, limits=self.limits)
        await self.listener.start()
        try:
            config = kopf.WebhookClientConfig(url=self.url or f"https://{self.addr}:{self.port}")
            if self.tls.material is not None and self.tls.material.ca_pem:
                config["caBundle"] = base64.b64encode(self.tls.material.ca_pem).decode("ascii")
            yield config
            await asyncio.Event().wait()  # serve until kopf cancels us
        finally:
            await self.listener.stop()
