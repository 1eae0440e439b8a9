"""A small HTTP proxy in front of the GCS emulator, for tests: fidelity and faults.

Fidelity: gcp-storage-emulator ignores the body of a bucket insert (location, storage
class, labels, access settings) though it stores the same fields on PATCH; real GCS keeps
them at insert. The proxy follows a successful insert with a PATCH of those fields, so
what a test reads back is what GCS would have stored.

Faults: `POST /_proxy/faults` with a JSON list of rules makes matching requests fail with
an HTTP status (429, 503, ...) or hang for a while, without reaching the emulator. `GET
/_proxy/log` lists the requests that did reach it, so tests can count writes.

Run: python -m cachewarm_testbed.gcsproxy --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

HOP_HEADERS = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "date", "server"}
INSERT_FIELDS = ("location", "storageClass", "labels", "iamConfiguration", "lifecycle", "softDeletePolicy")


@dataclass
class Rule:
    method: str
    path: re.Pattern[str]
    status: int
    hang: float
    times: int

    def matches(self, request: web.Request) -> bool:
        return (self.method in ("*", request.method)) and bool(self.path.search(request.path))


class Proxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.rules: list[Rule] = []
        self.log: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.rules = [
            Rule(method=r.get("method", "*"), path=re.compile(r.get("path", ".*")), status=int(r.get("status", 503)),
                 hang=float(r.get("hang", 0)), times=int(r.get("times", 1)))
            for r in body
        ]
        return web.json_response({"rules": len(self.rules)})

    async def clear_faults(self, _: web.Request) -> web.Response:
        self.rules = []
        return web.json_response({})

    async def get_log(self, _: web.Request) -> web.Response:
        return web.json_response(self.log)

    async def clear_log(self, _: web.Request) -> web.Response:
        self.log = []
        return web.json_response({})

    def _fault(self, request: web.Request) -> Rule | None:
        for rule in self.rules:
            if rule.times > 0 and rule.matches(request):
                rule.times -= 1
                return rule
        return None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        rule = self._fault(request)
        if rule is not None:
            if rule.hang:
                await asyncio.sleep(rule.hang)
            return web.json_response(
                {"error": {"code": rule.status, "message": f"injected fault {rule.status}"}}, status=rule.status
            )
        assert self.session is not None
        data = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length", "accept-encoding")}
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=data, headers=headers
        ) as resp:
            payload = await resp.read()
            status = resp.status
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        # Resumable uploads answer with a Location on the emulator: point it back at us.
        if "Location" in out_headers:
            out_headers["Location"] = out_headers["Location"].replace(self.upstream, f"http://{request.host}")
        self.log.append({"method": request.method, "path": request.path, "status": status})
        if request.method == "POST" and re.fullmatch(r"/storage/v1/b/?", request.path) and status == 200:
            payload, status = await self._complete_insert(json.loads(data or b"{}"), payload, status)
        return web.Response(body=payload, status=status, headers=out_headers)

    async def _complete_insert(self, body: dict[str, Any], payload: bytes, status: int) -> tuple[bytes, int]:
        fields = {k: body[k] for k in INSERT_FIELDS if k in body}
        if not fields:
            return payload, status
        assert self.session is not None
        name = json.loads(payload)["name"]
        async with self.session.patch(f"{self.upstream}/storage/v1/b/{name}", json=fields) as resp:
            return await resp.read(), resp.status


def make_app(upstream: str) -> web.Application:
    proxy = Proxy(upstream)
    app = web.Application(client_max_size=1024**3)

    async def on_startup(_: web.Application) -> None:
        proxy.session = aiohttp.ClientSession()

    async def on_cleanup(_: web.Application) -> None:
        if proxy.session is not None:
            await proxy.session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/_proxy/faults", proxy.set_faults)
    app.router.add_delete("/_proxy/faults", proxy.clear_faults)
    app.router.add_get("/_proxy/log", proxy.get_log)
    app.router.add_delete("/_proxy/log", proxy.clear_log)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the emulator's base URL")
    args = parser.parse_args()
    web.run_app(make_app(args.upstream), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()


class ProxyControl:
    """Test-side handle on a running proxy: set faults, read and clear the request log."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def faults(self, rules: list[dict[str, Any]]) -> None:
        """Each rule: method ("*"), path (regex), status (503), hang (seconds), times (1)."""
        self._call("POST", "/_proxy/faults", rules)

    def clear_faults(self) -> None:
        self._call("DELETE", "/_proxy/faults")

    def log(self) -> list[dict[str, Any]]:
        """Requests that reached the emulator: method, path, status."""
        result: list[dict[str, Any]] = self._call("GET", "/_proxy/log")
        return result

    def clear_log(self) -> None:
        self._call("DELETE", "/_proxy/log")

    def writes(self) -> list[dict[str, Any]]:
        """Successful non-GET requests that reached the emulator."""
        return [r for r in self.log() if r["method"] != "GET" and r["status"] < 300]
