"""The admission webhook's HTTPS endpoint: kopf's WebhookServer, hardened, with our certs.

kopf serves the admission handlers; this subclass makes sure that whatever arrives (not
UTF-8, not JSON, not an AdmissionReview, a resource we have no handler for, a handler
that fails) gets a well-formed answer, and that a pod is never refused because of us:
the webhook only adds settings, so on any doubt it admits the pod unchanged.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from cachewarm import certs

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


class AdmissionServer(kopf.WebhookServer):
    """kopf.WebhookServer whose request handling never crashes and never denies."""

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
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


@dataclass(frozen=True)
class TlsFiles:
    certfile: Path
    keyfile: Path
    ca_pem: bytes


def tls_files(cert_dir: str, work_dir: Path, hosts: list[str], now: dt.datetime) -> TlsFiles:
    """The serving certificate: from `cert_dir` (tls.crt, tls.key, ca.crt, as cert-manager
    writes them) when set, else a CA and certificate made now for `hosts` in `work_dir`.
    Raises FileNotFoundError when `cert_dir` lacks a file."""
    if cert_dir:
        base = Path(cert_dir)
        ca = base / "ca.crt"
        return TlsFiles(base / "tls.crt", base / "tls.key", ca.read_bytes() if ca.exists() else b"")
    ca_pair = certs.make_ca("cachewarm-webhook-ca", now=now)
    serving = certs.make_serving_cert(ca_pair, hosts, now=now)
    work_dir.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = work_dir / "tls.crt", work_dir / "tls.key"
    certfile.write_bytes(serving.cert_pem)
    keyfile.touch(mode=0o600)
    keyfile.write_bytes(serving.key_pem)
    return TlsFiles(certfile, keyfile, ca_pair.cert_pem)
