"""A small HTTP proxy in front of the GCS emulator, for tests: fidelity and faults.

Fidelity: the proxy makes the emulator answer what real GCS answers where cachewarm
depends on it:
- gcp-storage-emulator ignores the body of a bucket insert (location, storage class,
  labels, access settings) though it stores the same fields on PATCH; real GCS keeps them
  at insert, and reports locations upper-case ("US-CENTRAL1"). The proxy follows a
  successful insert with a PATCH of those fields, the location upper-cased.
- The emulator ignores ifGenerationMatch / ifMetagenerationMatch (and their NotMatch
  forms) on metadata PATCH and DELETE of buckets and objects; GCS answers 412 when they do
  not hold. The proxy checks them against the current resource and answers 412 itself.
  Metadata writes through the proxy are serialized, so check and write are atomic.
- A bucket PATCH's labels replace the whole map on the emulator; GCS merges them (a null
  value removes a label). The proxy sends the merged map.
- objects.list: the emulator answers every object in one response; GCS pages them, at most
  1000 per page (maxResults), with a nextPageToken, and bills each page. The proxy lists
  the emulator once per page and cuts the answer into GCS's pages (the token is opaque to
  clients; here it carries the last name sent), so each page is one logged request.
  With matchGlob, the proxy cuts the page from every name under the prefix first and then
  keeps the matching ones: a page may be empty and still not the last, and names that do
  not match still cost pages. That is the costlier of the two readings of GCS's docs (which
  do not say whether the glob is applied before or after a page is cut), so nothing here
  looks cheaper than GCS may be. `fields` is applied as a partial response (top-level
  keys and `items(...)`), so a field the client did not ask for is not in the answer.
- customTime: the emulator silently keeps the old value when a PATCH moves it backwards;
  GCS refuses that request (400: customTime can only move forward). The proxy answers 400.
  The emulator stores and returns customTime otherwise, as GCS does.
- Lifecycle rules: GCS allows at most 100 on a bucket
  (https://cloud.google.com/storage/docs/lifecycle) and refuses a PATCH or PUT with more
  (400); the emulator stores any number. The proxy answers 400. (GCS's exact message is
  not reproduced; a client must not depend on it.)

Faults: `POST /_proxy/faults` with a JSON list of rules makes matching requests fail with
an HTTP status (429, 503, ...) or hang for a while, without reaching the emulator. `GET
/_proxy/log` lists the requests that did reach it, so tests can count writes.

Holds: a rule with `"hold": NAME` keeps each request it matches waiting until the test
releases NAME (`POST /_proxy/release` with `{"hold": NAME}`), then answers its status as
any fault does. `GET /_proxy/holds` says, per name, how many requests arrived there and
how many wait there now, so a test waits for the event it means (the request is held)
and lets it go when it has seen what it wanted to see meanwhile, instead of a hang that
must outlast something on a loaded machine. New rules or a clear release every hold.
A rule with `"forward": true` does not answer: it waits its `hang` (a slow answer) and
then lets the request through to the emulator.

Auth (off by default, so the rest of the suite talks to it as before): `POST /_proxy/auth`
`{"tokeninfo": URL, "buckets": [...], "exemptAgents": [...]}` makes every request on those
buckets' objects and metadata (all requests when `buckets` is empty; the batch endpoint
too) carry `Authorization: Bearer <token>` with a token the metadata stand-in at URL
(cachewarm_testbed.metadata) issued and that has not expired, asked of its tokeninfo as
GCS asks Google's; otherwise 401 with GCS's JSON error and `WWW-Authenticate`, before the
emulator sees it. The log says which (`auth`: ok, missing, expired, unknown, exempt). The
token is checked when the request arrives, as GCS does (not again while a long answer is
sent). Kinder than GCS, and said here: a request whose User-Agent contains one of
`exemptAgents` (e.g. "gcloud-python/": google-cloud-storage, the operator's and the tests'
own client, which sends no token to an emulator at all) passes unchecked. `DELETE
/_proxy/auth` turns it off.

Run: python -m cachewarm_testbed.gcsproxy --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

HOP_HEADERS = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "date", "server"}
INSERT_FIELDS = ("location", "storageClass", "labels", "iamConfiguration", "lifecycle", "softDeletePolicy")
PRECONDITIONS = ("ifGenerationMatch", "ifMetagenerationMatch", "ifGenerationNotMatch", "ifMetagenerationNotMatch")
MAX_LIFECYCLE_RULES = 100  # per bucket (GCS's documented limit)
METADATA_PATH = re.compile(r"^/storage/v1/b/[^/]+(/o/.+)?/?$")
BUCKET_PATH = re.compile(r"^/storage/v1/b/[^/]+/?$")
LIST_PATH = re.compile(r"^/storage/v1/b/[^/]+/o/?$")
BUCKET_IN_PATH = re.compile(r"/b/([^/?]+)")  # the bucket of a JSON-API, upload or download path
MAX_PAGE = 1000  # GCS's largest objects.list page (and its default)


@dataclass
class Rule:
    method: str
    path: re.Pattern[str]
    status: int
    hang: float
    times: int
    hold: str = ""  # a gate's name: wait there until released
    forward: bool = False  # after `hang`, let the request through instead of answering `status`

    def matches(self, request: web.Request) -> bool:
        return (self.method in ("*", request.method)) and bool(self.path.search(request.path))


@dataclass
class Gate:
    """A named hold: requests wait on `opened` until the test releases it."""

    opened: asyncio.Event
    arrived: int = 0
    waiting: int = 0


class Proxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.rules: list[Rule] = []
        self.log: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None
        self.metadata_writes = asyncio.Lock()
        self.gates: dict[str, Gate] = {}
        self.auth: dict[str, Any] | None = None  # None: no token checked (the default)

    def _release_all(self) -> None:
        for gate in self.gates.values():
            gate.opened.set()
        self.gates = {}

    def _gate(self, name: str) -> Gate:
        return self.gates.setdefault(name, Gate(asyncio.Event()))

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._release_all()
        self.rules = [
            Rule(method=r.get("method", "*"), path=re.compile(r.get("path", ".*")), status=int(r.get("status", 503)),
                 hang=float(r.get("hang", 0)), times=int(r.get("times", 1)), hold=str(r.get("hold", "")),
                 forward=bool(r.get("forward", False)))
            for r in body
        ]
        for rule in self.rules:
            if rule.hold:
                self._gate(rule.hold)
        return web.json_response({"rules": len(self.rules)})

    async def clear_faults(self, _: web.Request) -> web.Response:
        self.rules = []
        self._release_all()
        return web.json_response({})

    async def release(self, request: web.Request) -> web.Response:
        """Let every request held at the named gate go, and any that arrives there later."""
        name = str((await request.json()).get("hold", ""))
        gate = self._gate(name)
        gate.opened.set()
        return web.json_response({"hold": name, "arrived": gate.arrived, "waiting": gate.waiting})

    async def get_holds(self, _: web.Request) -> web.Response:
        return web.json_response({name: {"arrived": g.arrived, "waiting": g.waiting, "released": g.opened.is_set()}
                                  for name, g in self.gates.items()})

    async def set_auth(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict) or not str(body.get("tokeninfo") or "").startswith("http"):
            return _error(400, "auth needs tokeninfo: the metadata stand-in's base URL")
        self.auth = {"tokeninfo": str(body["tokeninfo"]).rstrip("/"), "buckets": set(body.get("buckets") or []),
                     "exemptAgents": [str(a) for a in body.get("exemptAgents") or []]}
        return web.json_response({"tokeninfo": self.auth["tokeninfo"], "buckets": sorted(self.auth["buckets"])})

    async def clear_auth(self, _: web.Request) -> web.Response:
        self.auth = None
        return web.json_response({})

    async def _unauthorized(self, request: web.Request) -> tuple[web.Response | None, str]:
        """(GCS's 401, or None to go on; what the log says of the token: '' when the
        auth mode is off or the request is not on a checked bucket)."""
        if self.auth is None:
            return None, ""
        bucket = BUCKET_IN_PATH.search(request.path)
        if self.auth["buckets"] and not (bucket is None and request.path.startswith("/batch/")) and (
                bucket is None or bucket.group(1) not in self.auth["buckets"]):
            return None, ""
        agent = request.headers.get("User-Agent", "")
        if any(a in agent for a in self.auth["exemptAgents"]):
            return None, "exempt"
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _unauthenticated("Anonymous caller does not have storage.objects.get access to the Google "
                                    "Cloud Storage object.", "required"), "missing"
        assert self.session is not None
        async with self.session.get(f"{self.auth['tokeninfo']}/_metadata/tokeninfo",
                                    params={"access_token": token.strip()}) as resp:
            info = await resp.json(content_type=None)
        if resp.status == 200:
            return None, "ok"
        return _unauthenticated("Invalid Credentials", "authError"), str(info.get("error_description") or "invalid")

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
        # The token first, as GCS checks it when a request arrives (a slow answer after it
        # is a `forward` rule's hang).
        refused, auth = await self._unauthorized(request)
        if auth:
            request["auth"] = auth  # for the log
        if refused is not None:
            self.log.append({"method": request.method, "path": request.path, "status": refused.status, "auth": auth})
            return refused
        rule = self._fault(request)
        if rule is not None:
            if rule.hold:
                gate = self._gate(rule.hold)
                gate.arrived += 1
                gate.waiting += 1
                try:
                    await gate.opened.wait()
                finally:
                    gate.waiting -= 1
            if rule.hang:
                await asyncio.sleep(rule.hang)
            if not rule.forward:
                return web.json_response(
                    {"error": {"code": rule.status, "message": f"injected fault {rule.status}"}}, status=rule.status
                )
        assert self.session is not None
        data = await request.read()
        if request.method == "GET" and LIST_PATH.match(request.path):
            return await self._list_page(request)
        if request.method not in ("PATCH", "PUT", "DELETE") or not METADATA_PATH.match(request.path):
            return await self._send(request, data)
        async with self.metadata_writes:
            current = await self._current(request)
            refused = _refusal(request, data, current)
            if refused is not None:
                self.log.append({"method": request.method, "path": request.path, "status": refused.status,
                                 **_auth(request)})
                return refused
            if current is not None and BUCKET_PATH.match(request.path) and request.method == "PATCH":
                data = _merge_labels(data, current)
            return await self._send(request, data)

    async def _current(self, request: web.Request) -> dict[str, Any] | None:
        """The bucket or object as the emulator has it now (None when absent)."""
        assert self.session is not None
        async with self.session.get(self.upstream + request.rel_url.raw_path) as resp:
            if resp.status != 200:
                return None
            current: dict[str, Any] = await resp.json(content_type=None)
            return current

    async def _send(self, request: web.Request, data: bytes) -> web.StreamResponse:
        assert self.session is not None
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
        self.log.append({"method": request.method, "path": request.path, "status": status, **_auth(request)})
        if request.method == "POST" and re.fullmatch(r"/storage/v1/b/?", request.path) and status == 200:
            payload, status = await self._complete_insert(json.loads(data or b"{}"), payload, status)
        return web.Response(body=payload, status=status, headers=out_headers)

    async def _list_page(self, request: web.Request) -> web.Response:
        """One page of an objects.list, as GCS cuts them (see the module docstring)."""
        assert self.session is not None
        query = {k: v for k, v in request.query.items() if k not in ("pageToken", "maxResults", "matchGlob", "fields")}
        async with self.session.get(self.upstream + request.path, params=query) as resp:
            payload, status = await resp.read(), resp.status
        self.log.append({"method": request.method, "path": request.path, "status": status, **_auth(request)})
        if status != 200:
            return web.Response(body=payload, status=status, content_type="application/json")
        body = json.loads(payload)
        after = base64.urlsafe_b64decode(request.query["pageToken"]).decode() if request.query.get("pageToken") else ""
        items = sorted((i for i in body.get("items") or [] if i["name"] > after), key=lambda i: i["name"])
        size = min(int(request.query.get("maxResults") or MAX_PAGE), MAX_PAGE)
        glob = glob_regex(request.query["matchGlob"]) if request.query.get("matchGlob") else None
        body["items"] = [i for i in items[:size] if glob is None or glob.fullmatch(i["name"])]
        body.pop("nextPageToken", None)
        if len(items) > size:
            body["nextPageToken"] = base64.urlsafe_b64encode(items[size - 1]["name"].encode()).decode()
        if after:
            body.pop("prefixes", None)  # sent with the first page
        if request.query.get("fields"):
            body = partial_response(body, request.query["fields"])
        return web.json_response(body)

    async def _complete_insert(self, body: dict[str, Any], payload: bytes, status: int) -> tuple[bytes, int]:
        fields = {k: body[k] for k in INSERT_FIELDS if k in body}
        if "location" in fields:
            fields["location"] = str(fields["location"]).upper()  # GCS reports "US-CENTRAL1"
        if not fields:
            return payload, status
        assert self.session is not None
        name = json.loads(payload)["name"]
        async with self.session.patch(f"{self.upstream}/storage/v1/b/{name}", json=fields) as resp:
            return await resp.read(), resp.status


def glob_regex(glob: str) -> re.Pattern[str]:
    """GCS's matchGlob syntax as a regex: `**` any characters, `*` any but `/`, `?` one
    character but `/`, `[...]` a class, `{a,b}` alternatives."""
    out, i = [], 0
    while i < len(glob):
        ch = glob[i]
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = glob.index("]", i + 1)
            body = glob[i + 1:end]
            body = body.replace("\\", "\\\\")  # ranges stay ranges; a backslash is literal
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        elif ch == "{":
            end = glob.index("}", i + 1)
            out.append("(?:" + "|".join(re.escape(a) for a in glob[i + 1:end].split(",")) + ")")
            i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out))


def partial_response(body: dict[str, Any], fields: str) -> dict[str, Any]:
    """The `fields` selector of a list answer, as GCS applies it: `a,b,items(c,d)`."""
    wanted: dict[str, list[str] | None] = {}
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", fields):
        name, _, inner = part.strip().partition("(")
        wanted[name] = [f.strip() for f in inner.rstrip(")").split(",")] if inner else None
    out: dict[str, Any] = {}
    for key, sub in wanted.items():
        if key not in body:
            continue
        if sub is not None and isinstance(body[key], list):
            out[key] = [{k: v for k, v in item.items() if k in sub} for item in body[key]]
        else:
            out[key] = body[key]
    return out


def _error(status: int, message: str) -> web.Response:
    reason = {412: "conditionNotMet", 400: "invalid"}.get(status, "error")
    return web.json_response({"error": {"code": status, "message": message,
                                        "errors": [{"domain": "global", "reason": reason, "message": message}]}},
                             status=status)


def _unauthenticated(message: str, reason: str) -> web.Response:
    """GCS's 401: its JSON error and the challenge header."""
    return web.json_response({"error": {"code": 401, "message": message, "errors": [
        {"message": message, "domain": "global", "reason": reason, "locationType": "header",
         "location": "Authorization"}]}}, status=401,
        headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'})


def _auth(request: web.Request) -> dict[str, str]:
    """The log's `auth` field, when the request's token was looked at."""
    return {"auth": request["auth"]} if "auth" in request else {}


def _refusal(request: web.Request, data: bytes, current: dict[str, Any] | None) -> web.Response | None:
    """The 412 (or 400) GCS would answer instead of applying this write, if any."""
    if current is None:
        return None  # the emulator answers 404 itself
    for param in PRECONDITIONS:
        if param not in request.query:
            continue
        have = str(current.get("metageneration" if "Metageneration" in param else "generation", ""))
        wanted = request.query[param]
        if (have == wanted) == param.endswith("NotMatch"):
            return _error(412, f"At least one of the pre-conditions you specified did not hold ({param}={wanted}, "
                               f"current {have})")
    body = json.loads(data or b"{}") if request.method in ("PATCH", "PUT") else {}
    rules = ((body.get("lifecycle") or {}).get("rule") or []) if isinstance(body, dict) else []
    if BUCKET_PATH.match(request.path) and len(rules) > MAX_LIFECYCLE_RULES:
        return _error(400, f"A bucket may have at most {MAX_LIFECYCLE_RULES} lifecycle rules; this request sets "
                           f"{len(rules)}")
    new_time = body.get("customTime") if isinstance(body, dict) else None
    old_time = current.get("customTime")
    if new_time and old_time and _rfc3339(str(new_time)) < _rfc3339(str(old_time)):
        return _error(400, "customTime can only move forward")
    return None


def _rfc3339(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _merge_labels(data: bytes, current: dict[str, Any]) -> bytes:
    """GCS PATCH semantics for labels: merged into the current ones, null removes one."""
    body = json.loads(data or b"{}")
    if not isinstance(body, dict) or "labels" not in body:
        return data
    merged = {**(current.get("labels") or {}), **(body["labels"] or {})}
    body["labels"] = {k: v for k, v in merged.items() if v is not None}
    return json.dumps(body).encode()


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
    app.router.add_post("/_proxy/auth", proxy.set_auth)
    app.router.add_delete("/_proxy/auth", proxy.clear_auth)
    app.router.add_post("/_proxy/release", proxy.release)
    app.router.add_get("/_proxy/holds", proxy.get_holds)
    app.router.add_delete("/_proxy/log", proxy.clear_log)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the emulator's base URL")
    args = parser.parse_args()
    web.run_app(make_app(args.upstream), host=args.host, port=args.port, print=None)


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
        """Each rule: method ("*"), path (regex), status (503), hang (seconds), times (1),
        hold (a name: each matching request waits until `release(name)`, then answers),
        forward (true: after `hang`, the request goes on to the emulator)."""
        self._call("POST", "/_proxy/faults", rules)

    def release(self, hold: str) -> dict[str, Any]:
        """Let the requests held at `hold` go (and any that arrives there later); returns
        how many arrived and how many were waiting."""
        result: dict[str, Any] = self._call("POST", "/_proxy/release", {"hold": hold})
        return result

    def holds(self) -> dict[str, dict[str, Any]]:
        """Per hold: requests that arrived, are waiting now, and whether it was released."""
        result: dict[str, dict[str, Any]] = self._call("GET", "/_proxy/holds")
        return result

    def wait_held(self, hold: str, count: int = 1, timeout: float = 120) -> None:
        """Until `count` requests wait at `hold` (the timeout only a failure guard)."""
        import time

        deadline = time.monotonic() + timeout
        while (self.holds().get(hold) or {}).get("waiting", 0) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} requests held at {hold!r} within {timeout:.0f}s: {self.holds()}")
            time.sleep(0.05)

    def clear_faults(self) -> None:
        self._call("DELETE", "/_proxy/faults")

    def require_tokens(self, tokeninfo: str, buckets: list[str] | None = None,
                       exempt_agents: list[str] | None = None) -> None:
        """Auth mode (see the module's doc): requests on `buckets` (all when None) need a
        live token of the metadata stand-in at `tokeninfo`."""
        self._call("POST", "/_proxy/auth", {"tokeninfo": tokeninfo, "buckets": buckets or [],
                                            "exemptAgents": exempt_agents or []})

    def allow_anonymous(self) -> None:
        """Auth mode off (the default): no token is checked."""
        self._call("DELETE", "/_proxy/auth")

    def log(self) -> list[dict[str, Any]]:
        """Requests that reached the emulator: method, path, status."""
        result: list[dict[str, Any]] = self._call("GET", "/_proxy/log")
        return result

    def clear_log(self) -> None:
        self._call("DELETE", "/_proxy/log")

    def writes(self) -> list[dict[str, Any]]:
        """Successful non-GET requests that reached the emulator."""
        return [r for r in self.log() if r["method"] != "GET" and r["status"] < 300]
