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
listener takes); a connection over any of them is closed, counted by listener and reason
(cachewarm_listener_connections_dropped_total) and said in a log line that a client cannot
flood (`RefusalLog`). The client CA can be replaced while the listener serves
(`ServingTls.load_client_ca`: new connections need a certificate of the new one).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import json
import logging
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from cachewarm.admission.keeper import TlsMaterial
from cachewarm.api.metrics import Metrics

log = logging.getLogger("cachewarm.webhook")

# Why a listener refused a connection or closed it before its client did (the label
# `reason` of cachewarm_listener_connections_dropped_total). An idle keep-alive connection
# closed after keepalive_seconds is not counted: that is how one ends.
DROP_REASONS = (
    "connection_cap",  # the listener had max_connections open
    "peer_cap",  # its peer address had max_connections_per_peer open
    "tls_handshake",  # the handshake failed: not TLS, no or an unverified client certificate, ...
    "handshake_deadline",  # no complete handshake within handshake_seconds
    "handshake_cap",  # max_waiting connections already waiting for a handshake slot
    "header_deadline",  # a request's headers not complete in time
    "body_deadline",  # a request's body not complete within body_seconds (answered 408)
    "body_too_large",  # a request's body over max_body_bytes (answered 413)
)
REFUSAL_LOG_SECONDS = 60.0  # one line per reason and peer address in this long
REFUSAL_LOG_LINES = 50  # and at most this many lines in it, whatever the addresses


class RefusalLog:
    """Log lines of refused or dropped connections that a client cannot flood the log
    with: one per (reason, peer address) per `window` seconds, at most `lines` in a
    window in all; those left out are counted in the next window's first line."""

    def __init__(self, what: str, window: float = REFUSAL_LOG_SECONDS, lines: int = REFUSAL_LOG_LINES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.window, self.lines, self.clock = what, window, lines, clock
        self._since = clock()
        self._seen: set[tuple[str, str]] = set()  # at most `lines` of them
        self.left_out = 0

    def note(self, reason: str, peer: str, detail: str) -> bool:
        """Log this refusal unless one like it was logged in this window (False then)."""
        now = self.clock()
        if now - self._since >= self.window:
            if self.left_out:
                log.warning("Left %d dropped connections of %s out of the log in the last %ds (the metric "
                            "cachewarm_listener_connections_dropped_total counts them all)",
                            self.left_out, self.what, int(self.window))
            self._since, self._seen, self.left_out = now, set(), 0
        if (reason, peer) in self._seen or len(self._seen) >= self.lines:
            self.left_out += 1
            return False
        self._seen.add((reason, peer))
        log.warning("Dropped a connection to %s from %s (%s): %s; more like it within %ds are not logged",
                    self.what, peer or "an unknown address", reason, detail, int(self.window))
        return True


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
    signed (the apiserver's webhook client certificate) or the handshake fails; a new CA
    (`load_client_ca`) makes a new `context` (OpenSSL can add to a context's CAs, never
    take one away), which new connections take; `reports_context` never asks for one
    (pods authenticate with their tokens). Raises ssl.SSLError for an unreadable `client_ca`."""

    def __init__(self, client_ca: bytes = b"", *, require_client_cert: bool = False) -> None:
        """`require_client_cert`: a client CA is configured, so a certificate is asked for
        even where `client_ca` holds none yet (an empty file at start): no caller gets in
        until load_client_ca loads one, never every caller."""
        self.client_ca = client_ca
        self.context = _admission_context(client_ca, required=require_client_cert)
        self.reports_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.material: TlsMaterial | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="cachewarm-tls-"))

    def load(self, material: TlsMaterial) -> bool:
        """Serve `material` from now on; False when it is what is served already.
        Raises ssl.SSLError when the certificate and key do not match."""
        if material == self.material:
            return False
        self._load_chain(material, self.context, self.reports_context)
        self.material = material
        return True

    def load_client_ca(self, client_ca: bytes) -> bool:
        """Ask new admission connections for a certificate of `client_ca` (PEM) from now
        on; connections open keep the CA they were verified with. False when it is the
        one asked for already. Raises ValueError (empty) or ssl.SSLError (no certificate
        in it), and then the CA asked for stays: never none."""
        if not client_ca.strip():
            raise ValueError("the client CA file is empty")
        if client_ca == self.client_ca:
            return False
        context = _admission_context(client_ca)
        if self.material is not None:
            self._load_chain(self.material, context)
        self.context, self.client_ca = context, client_ca
        return True

    def _load_chain(self, material: TlsMaterial, *contexts: ssl.SSLContext) -> None:
        # ssl loads certificates from files only: private ones, in the writable /tmp.
        certfile, keyfile = self._dir / "tls.crt", self._dir / "tls.key"
        certfile.write_bytes(material.cert_pem)
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(material.key_pem)
        try:
            for context in contexts:
                context.load_cert_chain(str(certfile), str(keyfile))
        finally:
            keyfile.unlink()


def _admission_context(client_ca: bytes, *, required: bool = False) -> ssl.SSLContext:
    """A server context that, with `client_ca` (or `required`), requires a client
    certificate `client_ca` signed (with none loaded: no client is let in). Raises
    ssl.SSLError for a `client_ca` without a PEM certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    if client_ca.strip():
        context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
    if client_ca.strip() or required:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


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
    # TLS handshakes under way at once (each holds ~0.3 MiB of buffers until it ends: 256
    # of them ~80 MiB), and from one peer address. A connection beyond either waits (its
    # TCP socket only, not read) for a slot, the waiting peers served in turn, so a burst
    # from the apiserver is served as slots free and one address's stalled handshakes hold
    # at most its own share; it is closed if it waited handshake_seconds, or when
    # max_waiting wait already.
    max_handshakes: int = 256
    max_handshakes_per_peer: int = 64
    max_waiting: int = 4096


class _Guard(asyncio.Protocol):
    """One connection of a listener, from its TCP accept: the TLS handshake through
    `loop.start_tls` (so that a handshake that fails or runs past its deadline is seen and
    counted, and each connection takes the listener's context as it is then), then the
    connection cap and its peer address's (refused: closed at once), then aiohttp's
    protocol, closed when a deadline passes while it is not being answered (the request's
    headers not in within header_seconds of its start or keepalive_seconds of the last
    answer; the body's deadline is the middleware's)."""

    def __init__(self, listener: Listener, inner: asyncio.Protocol) -> None:
        self.listener, self.inner = listener, inner
        self.transport: asyncio.BaseTransport | None = None  # the TLS transport, once the handshake is done
        self._timer: asyncio.TimerHandle | None = None
        self._reason = ""  # what the armed timer's expiry is counted as ("" not counted)
        self._admitted = self._lost = False
        self._early: list[bytes] = []  # decrypted before the caps were checked (TLS 1.3: with the Finished)
        self._early_eof = False
        self._handshake: asyncio.Task[None] | None = None
        self._raw: asyncio.BaseTransport | None = None  # the TCP transport while it waits for a handshake slot
        self._waited: asyncio.TimerHandle | None = None
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The TCP connection (start_tls never calls this for the TLS one).
        self.peer = _peer_host(transport)
        self._raw = transport
        transport.pause_reading()  # type: ignore[attr-defined]  # start_tls reads its ClientHello
        self.listener.waits(self)

    def wait(self) -> None:
        """Wait for a handshake slot, at most handshake_seconds."""
        self._waited = asyncio.get_running_loop().call_later(self.listener.limits.handshake_seconds, self._waited_out)

    def _waited_out(self) -> None:
        if self.listener.unqueue(self):
            self.listener.drop("handshake_deadline", self.peer, "no TLS handshake slot in time")
            self._close_raw()

    def _close_raw(self) -> None:
        if self._raw is not None:
            self._raw.abort()  # type: ignore[attr-defined]

    def start_handshake(self) -> None:
        """Take a handshake slot (the listener counts it) and start the TLS handshake."""
        if self._waited is not None:
            self._waited.cancel()
            self._waited = None
        assert self._raw is not None
        self._handshake = asyncio.get_running_loop().create_task(self._secure(self._raw))

    async def _secure(self, raw: asyncio.BaseTransport) -> None:
        listener = self.listener
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw, self, listener.context(), server_side=True,  # type: ignore[arg-type]  # a stream transport
                ssl_handshake_timeout=listener.limits.handshake_seconds)
        except ConnectionAbortedError:  # asyncio's handshake timeout
            listener.drop("handshake_deadline", self.peer,
                          f"no TLS handshake within {listener.limits.handshake_seconds:g}s")
            return
        except ssl.SSLError as exc:  # not TLS, no or a wrong client certificate, ...
            listener.drop("tls_handshake", self.peer, f"TLS handshake failed: {exc.reason or exc}")
            return
        except (ConnectionError, OSError):  # the client went away during the handshake: not refused
            return
        finally:
            self._handshake = self._raw = None  # no cycle through the finished task keeps this connection
            listener.handshake_done(self)
        if tls is None or self._lost:  # lost between the handshake and now
            return
        self.transport = tls
        if not _authenticated(tls) and listener.per_peer.get(self.peer, 0) >= listener.limits.max_connections_per_peer:
            listener.drop("peer_cap", self.peer, f"{listener.limits.max_connections_per_peer} connections from it open")
            tls.abort()
            return
        if len(listener.open) >= listener.limits.max_connections:
            listener.drop("connection_cap", self.peer, f"{listener.limits.max_connections} connections open")
            tls.abort()
            return
        self._admitted = True
        listener.open[tls] = self
        listener.per_peer[self.peer] = listener.per_peer.get(self.peer, 0) + 1
        self.arm(listener.limits.header_seconds, "header_deadline")
        self.inner.connection_made(tls)
        for data in self._early:
            self.inner.data_received(data)
        self._early.clear()
        if self._early_eof and not self.inner.eof_received():
            tls.close()

    def abort(self) -> None:
        """Close the connection while its handshake runs or waits (the listener stops)."""
        if self._handshake is not None:
            self._handshake.cancel()
        elif self.listener.unqueue(self):
            self._close_raw()

    def arm(self, seconds: float | None, reason: str = "") -> None:
        """Close the connection in `seconds` unless re-armed, counted as `reason` ("":
        not counted: a keep-alive that ends); None: not while answering."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._reason = reason
        if seconds is not None and self.transport is not None:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        if self._reason:
            self.listener.drop(self._reason, self.peer, "request headers not received in time")
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            # Bytes of a next request after an answer: its headers are due (late ones are
            # counted; aiohttp's own keep-alive may close such a connection first, uncounted).
            self._reason = self._reason or "header_deadline"
            self.inner.data_received(data)
        elif self.transport is None and not self._lost:
            self._early.append(data)

    def eof_received(self) -> bool | None:
        if self._admitted:
            return self.inner.eof_received()
        self._early_eof = True
        return True  # closed by _secure: after aiohttp had what came before, or refused

    def pause_writing(self) -> None:
        if self._admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.arm(None)
        if self.listener.unqueue(self) and self._waited is not None:  # gone while it waited for a slot
            self._waited.cancel()
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
    `addr`:`port` with `context` (or a function that gives the context each new connection
    takes, so that one can be replaced while the listener serves), bounded by `limits`.
    Each connection it refuses or closes on a limit is counted by reason in `dropped` and
    in `metrics` (label `label`: admission, reports), and said in a rate-limited log line.
    `start()` then `stop()`."""

    def __init__(self, *, name: str, addr: str, port: int,
                 context: ssl.SSLContext | Callable[[], ssl.SSLContext],
                 routes: Mapping[str, _Route], limits: Limits, label: str = "",
                 metrics: Metrics | None = None) -> None:
        self.name, self.addr, self.port, self.limits = name, addr, port, limits
        self.context: Callable[[], ssl.SSLContext] = context if callable(context) else (lambda: context)
        self.routes = dict(routes)
        self.open: dict[asyncio.BaseTransport, _Guard] = {}
        self.handshaking: set[_Guard] = set()
        self.handshaking_per_peer: collections.Counter[str] = collections.Counter()
        # Connections waiting for a handshake slot, by peer address, the peers in turn.
        self.waiting: collections.OrderedDict[str, collections.deque[_Guard]] = collections.OrderedDict()
        self.queued = 0
        self.per_peer: dict[str, int] = {}  # peer IP -> its connections in `open`
        self.label, self.metrics = label or name, metrics
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> connections
        self.refusals = RefusalLog(f"the {name} listener")
        if metrics is not None:
            for reason in DROP_REASONS:  # every series from 0, so that rate() sees the first one
                metrics.listener_dropped.labels(self.label, reason)
        self._runner: aiohttp.web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def refused_per_peer(self) -> int:
        return self.dropped["peer_cap"]

    def _has_slot(self, peer: str) -> bool:
        return (len(self.handshaking) < self.limits.max_handshakes
                and self.handshaking_per_peer[peer] < self.limits.max_handshakes_per_peer)

    def _start(self, guard: _Guard) -> None:
        self.handshaking.add(guard)
        self.handshaking_per_peer[guard.peer] += 1
        guard.start_handshake()

    def waits(self, guard: _Guard) -> None:
        """A new connection: its handshake now if a slot is free (and no other connection
        of its address waits), else it waits its turn, unless max_waiting already do."""
        if guard.peer not in self.waiting and self._has_slot(guard.peer):
            self._start(guard)
        elif self.queued >= self.limits.max_waiting:
            self.drop("handshake_cap", guard.peer, f"{self.limits.max_waiting} connections wait for a TLS handshake")
            guard._close_raw()
        else:
            self.waiting.setdefault(guard.peer, collections.deque()).append(guard)
            self.queued += 1
            guard.wait()

    def unqueue(self, guard: _Guard) -> bool:
        """Take `guard` out of the waiting connections; False when it was not waiting."""
        queue = self.waiting.get(guard.peer)
        if queue is None or guard not in queue:
            return False
        queue.remove(guard)
        self.queued -= 1
        if not queue:
            del self.waiting[guard.peer]
        return True

    def handshake_done(self, guard: _Guard) -> None:
        """A handshake ended (done, failed, cancelled): its slot goes to the waiting
        connections, one per address in turn."""
        if guard in self.handshaking:
            self.handshaking.discard(guard)
            self.handshaking_per_peer[guard.peer] -= 1
            if self.handshaking_per_peer[guard.peer] <= 0:
                del self.handshaking_per_peer[guard.peer]
        while self.waiting and len(self.handshaking) < self.limits.max_handshakes:
            peer = next((p for p in self.waiting if self._has_slot(p)), None)
            if peer is None:
                return
            queue = self.waiting[peer]
            waiting = queue.popleft()
            self.queued -= 1
            if queue:
                self.waiting.move_to_end(peer)  # the next slot to another address first
            else:
                del self.waiting[peer]
            self._start(waiting)

    def drop(self, reason: str, peer: str, detail: str) -> None:
        """Count a connection refused or closed for `reason` (one of DROP_REASONS)."""
        self.dropped[reason] += 1
        if self.metrics is not None:
            self.metrics.listener_dropped.labels(self.label, reason).inc()
        self.refusals.note(reason, peer, detail)

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
                self._drop_request(request, "body_deadline", f"request body not received within "
                                                             f"{self.limits.body_seconds:g}s")
                return _closing(_bad_request(f"request body not received within {self.limits.body_seconds:g}s",
                                             status=408))
            except aiohttp.web.HTTPRequestEntityTooLarge:
                self._drop_request(request, "body_too_large", f"request body over {self.limits.max_body_bytes} bytes")
                return _closing(_bad_request(f"request body larger than {self.limits.max_body_bytes} bytes",
                                             status=413))
            return await handler(request)
        finally:
            if guard is not None:
                guard.arm(self.limits.keepalive_seconds)

    def _drop_request(self, request: aiohttp.web.Request, reason: str, detail: str) -> None:
        guard = self.open.get(request.transport) if request.transport is not None else None
        self.drop(reason, guard.peer if guard is not None else request.remote or "", detail)

    async def start(self) -> None:
        """Listen. Raises OSError (the port taken)."""
        app = aiohttp.web.Application(middlewares=[self._deadlines], client_max_size=self.limits.max_body_bytes)
        app.add_routes([aiohttp.web.post(path, fn) for path, fn in self.routes.items()])
        # Our keep-alive timer closes idle connections (and counts a next request's late
        # headers); aiohttp's, later, is only a backstop.
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False,
                                             keepalive_timeout=2 * self.limits.keepalive_seconds)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        # reuse_port: replicas on one host (tests, a hostNetwork install) share the port.
        # Plain TCP here: each _Guard starts its connection's TLS itself.
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guard(self, server()), self.addr or None, self.port, reuse_address=True, reuse_port=True)
        log.info("Serving %s on %s:%s", self.name, self.addr or "*", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for guard in [*self.handshaking, *(g for queue in self.waiting.values() for g in queue)]:
            guard.abort()
        if self._runner is not None:
            await self._runner.cleanup()


def _closing(response: aiohttp.web.Response) -> aiohttp.web.Response:
    response.force_close()
    return response


class AdmissionServer:
    """A kopf webhook server (kopf.WebhookServerProtocol) on `addr`:`port` with `tls`
    (its client-authenticating context, as it is at each new connection), bounded by
    `limits`, its refusals counted in `metrics`."""

    def __init__(self, *, addr: str, port: int, tls: ServingTls, url: str = "",
                 limits: Limits | None = None, metrics: Metrics | None = None) -> None:
        self.addr, self.port, self.tls, self.url, self.metrics = addr, port, tls, url, metrics
        self.limits = limits or Limits()
        self.listener: Listener | None = None

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await serve(fn, request)

        tls = self.tls
        self.listener = Listener(name="admission", addr=self.addr, port=self.port, context=lambda: tls.context,
                                 routes={"/{id:.*}": handle}, limits=self.limits, label="admission",
                                 metrics=self.metrics)
        await self.listener.start()
        try:
            config = kopf.WebhookClientConfig(url=self.url or f"https://{self.addr}:{self.port}")
            if self.tls.material is not None and self.tls.material.ca_pem:
                config["caBundle"] = base64.b64encode(self.tls.material.ca_pem).decode("ascii")
            yield config
            await asyncio.Event().wait()  # serve until kopf cancels us
        finally:
            await self.listener.stop()
