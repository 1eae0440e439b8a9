"""POST /report/v1 on the operator's reports listener (its own port): reports from training pods.

Only the leader takes reports. The webhook Service spreads them over every replica, so a
follower forwards each to the leader (`Forwarder`: to the address the leader names in the
Lease, over TLS verified as the pods verify us) and answers the pod what the leader
answered. It answers 503 itself (the reporter sends again later) when it cannot: the
leader not known or this very replica, the report forwarded to it already (a leader that
just lost the Lease never sends it round again), or the leader not reached.

In order on the leader, each step refusing with its own status and changing nothing: a
body of at most reports.MAX_BODY_BYTES (413, on a follower too: it never forwards more);
a bearer token (401); a well-formed report (400); the token's shape checked locally (a
JWT for audience cachewarm, not expired, bound to a pod, that pod the report's: 401/403,
no review asked); the pod is a labelled pod the operator watches, of the uid the token
claims, labelled for the report's cache (403), and the cache exists (404): all still
without a review, so a forged token costs the apiserver nothing unless it names a pod
that is there, by its uid, and that pod's own cache; a place in the bounded TokenReview
queue (503 at once when it is full, never an unbounded wait); the apiserver's
TokenReview for audience `cachewarm` (401 when it does not authenticate the token, 503
when the review cannot be made); the token's pod is the report's pod and the cache is in
its namespace (403); the pod's and its process's report rate and process count
(reports.Store.record: 429). Then the report is kept (202).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web

from cachewarm.reports import store as reports
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.api.metrics import Metrics

PATH = "/report/v1"
# TokenReviews in flight at once: a flood of reports waits here, not in the apiserver.
MAX_REVIEWS = 4
# Reports waiting for one of those: past this many, a report is answered 503 at once.
MAX_REVIEW_QUEUE = 64
# An accepted token is taken again for this long without another review (the kubelet
# rotates projected tokens well before they expire; a pod deleted meanwhile reports nothing).
REVIEW_CACHE_SECONDS = 300.0
REVIEW_CACHE_SIZE = 10_000
# Set on a report a follower forwards: the replica it reaches answers it itself, whether
# it leads or not, so a report never goes round between replicas.
FORWARDED_HEADER = "X-Cachewarm-Forwarded"
# The leader answers within its TokenReview's time or not at all; the reporter in the pod
# waits a few seconds only, and sends again a minute later.
FORWARD_TIMEOUT_SECONDS = 5.0
# Connections a follower holds to the leader at once (more forwards wait for one, within
# the timeout): every forward comes from the follower's one address, so this stays below
# the leader's per-peer cap (admission.server.Limits.max_connections_per_peer, 16 by
# default), which would refuse the connections past it.
FORWARD_CONNECTIONS = 8
# A leader out of reach fails every forward: one warning per this many seconds, the rest
# at debug.
FORWARD_WARNING_SECONDS = 60.0
log = logging.getLogger("cachewarm.reports")


class Forwarder:
    """A follower's way to the leader. `leader_address()` is the `host:port` the leader
    names in the Lease (None: not known); `ca()` the CA this replica serves a certificate
    of, read at each forward (the certificate rotates; every replica serves one of the same
    CA); `server_hostname` the name the pods send reports to (the host of report_url),
    which that certificate names, so the leader is checked exactly as a pod checks us."""

    def __init__(self, *, leader_address: Callable[[], str | None], own_address: str, ca: Callable[[], bytes],
                 server_hostname: str, metrics: Metrics) -> None:
        self.leader_address, self.own_address, self.ca = leader_address, own_address, ca
        self.server_hostname, self.metrics = server_hostname, metrics
        self._session: aiohttp.ClientSession | None = None
        self._context: tuple[bytes, ssl.SSLContext] | None = None
        self._warned_at = -FORWARD_WARNING_SECONDS

    def target(self) -> str | None:
        """Where to forward to: the leader's address, unless it is not known or is this
        replica's own (it does not lead right now, whatever the Lease said last)."""
        leader = self.leader_address()
        return leader if leader and leader != self.own_address else None

    async def forward(self, leader: str, body: bytes, authorization: str | None) -> aiohttp.web.Response:
        """POST `body` with the pod's `authorization` to the leader at `leader` and answer
        what it answered (status, JSON body, Retry-After); 503 when it could not be asked."""
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: "1"}
        if authorization is not None:
            headers["Authorization"] = authorization
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_SECONDS),
                    connector=aiohttp.TCPConnector(limit_per_host=FORWARD_CONNECTIONS))
            async with self._session.post(f"https://{leader}{PATH}", data=body, headers=headers,
                                          ssl=self._tls(), server_hostname=self.server_hostname or None) as answer:
                raw = await answer.read()
                status, content_type, charset = answer.status, answer.content_type, answer.charset
                retry_after = answer.headers.get("Retry-After")
        except (aiohttp.ClientError, OSError, TimeoutError, ssl.SSLError, ValueError) as exc:
            self.metrics.reports_forwarded.labels("failed").inc()
            self._warn(leader, f"{type(exc).__name__}: {exc}")
            message = f"this replica does not lead and could not reach the leader at {leader}"
            return aiohttp.web.json_response({"accepted": False, "message": message}, status=503,
                                             headers={"Retry-After": "60"})
        self.metrics.reports_forwarded.labels(str(status)).inc()
        return aiohttp.web.Response(status=status, body=raw, content_type=content_type, charset=charset,
                                    headers={"Retry-After": retry_after} if retry_after else None)

    def _tls(self) -> ssl.SSLContext:
        """A client context trusting only the CA served now (made again when it changed).
        Raises ValueError without one, ssl.SSLError for an unreadable one."""
        ca = self.ca()
        if not ca:
            raise ValueError("no CA to verify the leader with (a certificate directory without ca.crt)")
        if self._context is None or self._context[0] != ca:
            self._context = (ca, ssl.create_default_context(cadata=ca.decode("ascii", "replace")))
        return self._context[1]

    def _warn(self, leader: str, error: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= FORWARD_WARNING_SECONDS:
            self._warned_at = now
            log.warning("Could not forward a report to the leader at %s (answered 503; further failures within %ds "
                        "are logged at debug): %s", leader, int(FORWARD_WARNING_SECONDS), error)
        else:
            log.debug("Could not forward a report to the leader at %s: %s", leader, error)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Receiver:
    def __init__(self, *, kube: KubeClient, store: reports.Store, metrics: Metrics,
                 leading: Callable[[], bool], cache_exists: Callable[[str, str], bool],
                 pods: reports.LabelledPods, forwarder: Forwarder | None = None,
                 review_queue: int = MAX_REVIEW_QUEUE) -> None:
        self.kube, self.store, self.metrics = kube, store, metrics
        self.leading, self.cache_exists, self.forwarder = leading, cache_exists, forwarder
        self.pods, self.review_queue = pods, review_queue
        self._reviews = asyncio.Semaphore(MAX_REVIEWS)
        self._queued = 0  # reports waiting for, or in, a review
        self._accepted: dict[str, tuple[float, Mapping[str, Any]]] = {}  # sha256(token) -> (until, review)

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        try:
            if not self.leading():
                return await self._forward(request)  # counted where it is taken, the leader
            report = await self._accept(request)
        except reports.ReportError as exc:
            self.metrics.reports.labels(str(exc.status)).inc()
            if exc.status >= 500:
                log.warning("Refused a report: %s", exc)
            return aiohttp.web.json_response({"accepted": False, "message": str(exc)}, status=exc.status,
                                              headers={"Retry-After": "60"} if exc.status in (429, 503) else None)
        self.metrics.reports.labels("202").inc()
        return aiohttp.web.json_response({"accepted": True, "sequence": report.sequence}, status=202)

    async def _forward(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        """On a follower: the leader's answer to the report. Raises ReportError (503 when
        it is not forwarded, 413 too large: never more than a report is forwarded)."""
        if FORWARDED_HEADER in request.headers:
            raise reports.ReportError("this replica does not lead (any more); a forwarded report is not forwarded "
                                      "again", 503)
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():  # the leader would refuse it: no hop for that
            raise reports.ReportError("a report needs the pod's ServiceAccount token (Authorization: Bearer)", 401)
        leader = self.forwarder.target() if self.forwarder is not None else None
        if self.forwarder is None or leader is None:
            raise reports.ReportError("this replica does not lead and knows no other replica that does; another "
                                      "takes reports", 503)
        return await self.forwarder.forward(leader, await _body(request), request.headers.get("Authorization"))

    async def _accept(self, request: aiohttp.web.Request) -> reports.Report:
        body = await _body(request)
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise reports.ReportError("a report needs the pod's ServiceAccount token (Authorization: Bearer)", 401)
        report = reports.parse(body)
        claimed = reports.check_token(token.strip(), time.time())
        if claimed != (report.pod.namespace, report.pod.name, report.pod.uid):
            raise reports.ReportError("the token is bound to another pod than the one the report names", 403)
        # What needs no apiserver before a review is queued: a forged token naming a pod
        # we do not watch, or a cache that is not its label's or does not exist, costs none.
        self.pods.check(report)
        if not self.cache_exists(report.pod.namespace, report.cache):
            raise reports.ReportError(f"no CompilationCache {report.pod.namespace}/{report.cache}", 404)
        reviewed = await self._review(token.strip())
        reports.check_identity(report, reviewed)
        delta = self.store.record(report, dt.datetime.now(dt.timezone.utc))
        self.metrics.count_report(report.pod.namespace, report.cache, delta["hits"], delta["misses"], delta["saved"])
        return report

    async def _review(self, token: str) -> Mapping[str, Any]:
        """The apiserver's review of `token` for audience cachewarm, from the cache of
        accepted ones when it is there. Raises ReportError (401 not accepted, 503 the
        review could not be made)."""
        digest = hashlib.sha256(token.encode()).hexdigest()
        cached = self._accepted.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        if self._queued >= self.review_queue:
            raise reports.ReportError(f"{self._queued} reports are waiting for a token review; try again later", 503)
        self._queued += 1
        try:
            async with self._reviews:
                try:
                    reviewed: Mapping[str, Any] = await asyncio.to_thread(self.kube.review_token, token,
                                                                          [reports.AUDIENCE])
                except KubeError as exc:
                    raise reports.ReportError(f"the token could not be reviewed: {exc}", 503) from None
        finally:
            self._queued -= 1
        if not reviewed.get("authenticated") or reports.AUDIENCE not in (reviewed.get("audiences") or []):
            raise reports.ReportError("the apiserver does not accept this token for audience cachewarm", 401)
        if len(self._accepted) >= REVIEW_CACHE_SIZE:
            now = time.monotonic()
            self._accepted = {d: v for d, v in self._accepted.items() if v[0] > now}
            if len(self._accepted) >= REVIEW_CACHE_SIZE:
                self._accepted.clear()
        self._accepted[digest] = (time.monotonic() + REVIEW_CACHE_SECONDS, reviewed)
        return reviewed


async def _body(request: aiohttp.web.Request) -> bytes:
    """The whole body (the listener reads it first, within its size and time limits; a
    report is much smaller still: ReportError 413)."""
    if (request.content_length or 0) > reports.MAX_BODY_BYTES:
        raise reports.ReportError(f"report is larger than {reports.MAX_BODY_BYTES} bytes", 413)
    try:
        body = await request.read()
    except aiohttp.web.HTTPRequestEntityTooLarge:
        raise reports.ReportError(f"report is larger than {reports.MAX_BODY_BYTES} bytes", 413) from None
    if len(body) > reports.MAX_BODY_BYTES:
        raise reports.ReportError(f"report is larger than {reports.MAX_BODY_BYTES} bytes", 413)
    return body
