"""The admission webhook's HTTPS endpoint: our own server for kopf's admission handlers.

kopf documents custom webhook servers (kopf.WebhookServerProtocol): a callable that takes
kopf's WebhookFn, serves it, and yields the client config. Ours makes sure that whatever
arrives (not UTF-8, not JSON, not an AdmissionReview, a resource we have no handler for,
a handler that fails) gets a well-formed answer, and that a pod is never refused because
of us: the webhook only adds settings, so on any doubt it admits the pod unchanged. Its
certificate is reloaded in place (`ServingTls.load`): new connections get the new one,
the listener never closes.
"""

from __future__ import annotations

import asyncio
import base64
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
    try:
        raw = await request.read()
    except aiohttp.web.HTTPRequestEntityTooLarge as exc:
        return _bad_request(f"request body too large: {exc.text}", status=413)
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
    """The server's TLS context, whose certificate can be replaced while it serves.
    OpenSSL copies the certificate into each connection as it starts, so loading a new
    one into the same context affects new handshakes only."""

    def __init__(self) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
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
        finally:
            keyfile.unlink()
        self.material = material
        return True


class AdmissionServer:
    """A kopf webhook server (kopf.WebhookServerProtocol) on `addr`:`port` with `tls`."""

    def __init__(self, *, addr: str, port: int, tls: ServingTls, url: str = "",
                 routes: Mapping[str, Callable[[aiohttp.web.Request], Awaitable[aiohttp.web.StreamResponse]]]
                 | None = None) -> None:
        self.addr, self.port, self.tls, self.url = addr, port, tls, url
        self.routes = dict(routes or {})  # POST paths served beside the admission webhook (reports)

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await serve(fn, request)

        app = aiohttp.web.Application()
        app.add_routes([*(aiohttp.web.post(path, fn) for path, fn in self.routes.items()),
                        aiohttp.web.post("/{id:.*}", handle)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False)
        await runner.setup()
        try:
            # reuse_port: replicas on one host (tests, a hostNetwork install) share the port.
            site = aiohttp.web.TCPSite(runner, self.addr or None, self.port, ssl_context=self.tls.context,
                                       reuse_address=True, reuse_port=True)
            await site.start()
            log.info("Serving the admission webhook on %s:%s", self.addr or "*", self.port)
            config = kopf.WebhookClientConfig(url=self.url or f"https://{self.addr}:{self.port}")
            if self.tls.material is not None and self.tls.material.ca_pem:
                config["caBundle"] = base64.b64encode(self.tls.material.ca_pem).decode("ascii")
            yield config
            await asyncio.Event().wait()  # serve until kopf cancels us
        finally:
            await runner.cleanup()
