"""POST /report/v1 on the operator's HTTPS server: reports from training pods.

In order, each step refusing with its own status and changing nothing: only the leader
takes reports (503, the reporter sends again later); a body of at most
reports.MAX_BODY_BYTES (413); a bearer token (401); a well-formed report (400); the
apiserver's TokenReview for audience `cachewarm` (401 when it does not authenticate the
token, 503 when the review cannot be made); the token's pod is the report's pod and the
cache is in its namespace (403); the cache exists (404); at most one report per pod every
few seconds (429). Then the report is kept (202).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.web

from cachewarm import reports
from cachewarm.clients.kube import KubeClient, KubeError
from cachewarm.metrics import Metrics

PATH = "/report/v1"
# TokenReviews in flight at once: a flood of reports waits here, not in the apiserver.
MAX_REVIEWS = 4
# An accepted token is taken again for this long without another review (the kubelet
# rotates projected tokens well before they expire; a pod deleted meanwhile reports nothing).
REVIEW_CACHE_SECONDS = 300.0
REVIEW_CACHE_SIZE = 10_000
log = logging.getLogger("cachewarm.reports")


class Receiver:
    def __init__(self, *, kube: KubeClient, store: reports.Store, metrics: Metrics,
                 leading: Callable[[], bool], cache_exists: Callable[[str, str], bool]) -> None:
        self.kube, self.store, self.metrics = kube, store, metrics
        self.leading, self.cache_exists = leading, cache_exists
        self._reviews = asyncio.Semaphore(MAX_REVIEWS)
        self._accepted: dict[str, tuple[float, Mapping[str, Any]]] = {}  # sha256(token) -> (until, review)

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        try:
            report = await self._accept(request)
        except reports.ReportError as exc:
            self.metrics.reports.labels(str(exc.status)).inc()
            if exc.status >= 500:
                log.warning("Refused a report: %s", exc)
            return aiohttp.web.json_response({"accepted": False, "message": str(exc)}, status=exc.status,
                                              headers={"Retry-After": "60"} if exc.status in (429, 503) else None)
        self.metrics.reports.labels("202").inc()
        return aiohttp.web.json_response({"accepted": True, "sequence": report.sequence}, status=202)

    async def _accept(self, request: aiohttp.web.Request) -> reports.Report:
        if not self.leading():
            raise reports.ReportError("this replica does not lead; another takes reports", 503)
        body = await _body(request)
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise reports.ReportError("a report needs the pod's ServiceAccount token (Authorization: Bearer)", 401)
        report = reports.parse(body)
        reviewed = await self._review(token.strip())
        reports.check_identity(report, reviewed)
        if not self.cache_exists(report.pod.namespace, report.cache):
            raise reports.ReportError(f"no CompilationCache {report.pod.namespace}/{report.cache}", 404)
        delta = self.store.record(report, dt.datetime.now(dt.timezone.utc))
        labels = (report.pod.namespace, report.cache)
        self.metrics.cache_hits.labels(*labels).inc(delta["hits"])
        self.metrics.cache_misses.labels(*labels).inc(delta["misses"])
        self.metrics.seconds_saved.labels(*labels).inc(delta["saved"])
        return report

    async def _review(self, token: str) -> Mapping[str, Any]:
        """The apiserver's review of `token` for audience cachewarm, from the cache of
        accepted ones when it is there. Raises ReportError (401 not accepted, 503 the
        review could not be made)."""
        digest = hashlib.sha256(token.encode()).hexdigest()
        cached = self._accepted.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        async with self._reviews:
            try:
                reviewed: Mapping[str, Any] = await asyncio.to_thread(self.kube.review_token, token,
                                                                      [reports.AUDIENCE])
            except KubeError as exc:
                raise reports.ReportError(f"the token could not be reviewed: {exc}", 503) from None
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
    """The whole body, read until it ends or passes the size cap (ReportError 413); a
    single read may return only what has arrived so far."""
    if (request.content_length or 0) > reports.MAX_BODY_BYTES:
        raise reports.ReportError(f"report is larger than {reports.MAX_BODY_BYTES} bytes", 413)
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(65536):
        size += len(chunk)
        if size > reports.MAX_BODY_BYTES:
            raise reports.ReportError(f"report is larger than {reports.MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)
