"""Reports from training pods (cachewarm.agents.reporter): checked, kept, and summed per cache.

The HTTP side (webhook.AdmissionServer's /report/v1) hands a report here only after the
apiserver vouched for its token (a TokenReview, audience `cachewarm`) and the token's pod
is the pod the report names; what is checked here is the report itself. Kept in memory by
the replica that leads (the others forward reports to it, receiver.Forwarder, so one replica holds every cache's
view); a new leader starts empty and fills up as pods report again (every minute).
Counts in a report are the process's totals so far: the latest report of each process
replaces its previous one, so a lost or repeated report never counts twice, and a process
adds to a cache's counters at most the most it ever reported (counts that go down and up
again add nothing twice). What one pod can weigh is bounded by its uid, not by what it
says of its processes: MAX_PROCESSES_PER_POD processes in the window, POD_REPORT_BURST
reports at once and POD_REPORTS_PER_MINUTE after, and when a cache holds
MAX_PROCESSES_PER_CACHE the process forgotten is one of the pod that holds the most. A pod with a
local copy of the cache says what the copy did in every report of every process
(`localCopy`); usage counts it once per pod, and the leader says, once per pod, when a
copy failed and the pod started cold (a LocalCopyCold Event).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import datetime as dt
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cachewarm.api import timefmt
from cachewarm.reconcile import misses as causes
from cachewarm.reconcile.keysmatch import differences, one_line
from cachewarm.reconcile.warmplan import compiled_fingerprint

MAX_BODY_BYTES = 16 * 1024
AUDIENCE = "cachewarm"
MIN_SECONDS_BETWEEN = 5.0  # per process: the reporter sends every minute, and once at exit
# Per pod (its uid, which the apiserver vouched for; pid and start time are the reporter's
# to choose): processes kept in the window (a report of a new one past this is 429), and
# reports taken at once and per minute (a token bucket; the reporter sends one a minute per
# process).
MAX_PROCESSES_PER_POD = 64
POD_REPORT_BURST = 64
POD_REPORTS_PER_MINUTE = 64.0
MAX_PROCESSES_PER_CACHE = 2000  # past it, the oldest process of the pod that keeps the most is forgotten
LAST_MISSES = 10  # per cache, in status
RECENT_HITS = 50  # entries hit within the window, newest first, in status (cachewarm inspect names their pods)
HIT_PODS = 5  # pod names kept per entry hit (podCount counts them all)
COLD_PODS_NAMED = 5  # pods named in one LocalCopyCold Event (it counts them all)
MISSED_PROGRAMS = 10  # in status: the programs that cost the most compile seconds, each with its cause
HIT_PROGRAMS = 10  # in status: the programs hit most, with what they cost and saved
POD_STARTS = 10  # in status: pods' compile seconds warm against cold, the ones that saved most


TORCH_NAMED = 20  # env settings and config values a torch fingerprint names, each (torch_fingerprint's bound)


class ReportError(Exception):
    """A report refused; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class PodRef(_Strict):
    namespace: str = Field(min_length=1, max_length=63)
    name: str = Field(min_length=1, max_length=253)
    uid: str = Field(min_length=1, max_length=64)


class ProgramKey(_Strict):
    """A program and its persistent-cache key, as JAX logs them."""

    program: str = Field(max_length=200)
    key: str = Field(max_length=200)


HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{1,16}$")]


PROGRAM_UNSAFE = causes.PROGRAM_UNSAFE  # the warmers' summaries are read with the same rule


class ProgramUse(_Strict):
    """What one program's compile requests did in a process (the reporter's per-program
    tally): hits, misses, the seconds its misses took to compile and its hits to load, the
    key hashes it missed with, those of the entries the pod's cache held for it (None: not
    listed), and why JAX did not write it, when it said so."""

    program: str = Field(min_length=1, max_length=200)
    hits: int = Field(ge=0, le=10**9)
    misses: int = Field(ge=0, le=10**9)
    compile_seconds: float = Field(alias="compileSeconds", ge=0, le=1e9)
    load_seconds: float = Field(alias="loadSeconds", ge=0, le=1e9)
    keys: list[HexKey] = Field(default_factory=list, max_length=4)
    cached: list[HexKey] | None = Field(default=None, max_length=4)
    not_written: Literal["hostCallbacks", "belowThreshold"] | None = Field(default=None, alias="notWritten")
    helper: bool = False

    @field_validator("program")
    @classmethod
    def _printable(cls, value: str) -> str:
        """A JAX module name as text a terminal shows as it is: any character but a letter,
        digit or one of `_.-<>()[]` becomes `?`, so a report cannot put terminal escapes or
        lines into an admin's `cachewarm inspect`, a condition or an Event (attacker review),
        and a program with an odd name still counts."""
        return causes.printable(value)


class Counts(_Strict):
    requests: int = Field(ge=0, le=10**9)
    hits: int = Field(ge=0, le=10**9)
    misses: int = Field(ge=0, le=10**9)
    compile_seconds_saved: float = Field(alias="compileSecondsSaved", ge=-1e9, le=1e9)
    compile_seconds_spent: float = Field(alias="compileSecondsSpent", ge=0, le=1e9)
    last_misses: list[ProgramKey] = Field(alias="lastMisses", default_factory=list, max_length=50)
    hit_keys: list[ProgramKey] = Field(alias="hitKeys", default_factory=list, max_length=50)
    # JAX's helper programs left out (the reporter's HELPER_PROGRAMS); None: not counted.
    user_requests: int | None = Field(default=None, alias="userRequests", ge=0, le=10**9)
    user_hits: int | None = Field(default=None, alias="userHits", ge=0, le=10**9)
    programs: list[ProgramUse] = Field(default_factory=list, max_length=50)


class Process(_Strict):
    pid: int = Field(ge=0, le=2**31)
    started: int = Field(ge=0, le=2**63)
    index: int = Field(default=0, ge=0, le=10**6)


class LocalCopy(_Strict):
    """What the pod's local copy did (its init container's summary, as the reporter read
    it). Checked strictly: a count that is a string or a bool is refused, not converted."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    copied: int = Field(ge=0, le=10**9)  # entries downloaded
    present: int = Field(ge=0, le=10**9)  # entries already in the local directory
    bytes_copied: int = Field(alias="bytes", ge=0, le=10**15)
    failed: int = Field(ge=0, le=10**9)
    cold: bool  # the pod started without the entries it should have had: the copy failed
    seconds: float = Field(ge=0, le=1e9)
    source: Literal["manifest", "prefix"] | None = None
    error: str | None = Field(default=None, max_length=200)  # the first error, when cold

    @field_validator("error")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        """The pod's text reaches a LocalCopyCold Event and status as one line of plain
        text: control characters (terminal escapes, newlines) become `?` (attacker review)."""
        return None if value is None else "".join(ch if ch.isprintable() else "?" for ch in value)


class Fingerprint(_Strict):
    """What a process's cache keys depend on (agents/warmer.fingerprint), as KeysMatch
    compares it: every field typed strictly and bounded, so a report whose fingerprint is
    not one (`{"versions": "xx"}`, a count that is a string) is refused with a 400 here and
    never reaches a reconcile. Fields a newer reporter adds are dropped, not refused."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, populate_by_name=True)

    jax: str | None = Field(default=None, max_length=100)
    versions: dict[Annotated[str, Field(max_length=100)], Annotated[str, Field(max_length=100)]] | None = Field(
        default=None, max_length=16)
    flags_hash: str | None = Field(default=None, alias="flagsHash", max_length=64)
    flag_count: int | None = Field(default=None, alias="flagCount", ge=0, le=10**6)
    cache_dir: str | None = Field(default=None, alias="cacheDir", max_length=1024)
    platform: str | None = Field(default=None, max_length=100)
    platform_version: str | None = Field(default=None, alias="platformVersion", max_length=300)
    device_kind: str | None = Field(default=None, alias="deviceKind", max_length=300)
    devices: int | None = Field(default=None, ge=0, le=10**7)
    processes: int | None = Field(default=None, ge=0, le=10**7)
    topology: str | None = Field(default=None, max_length=100)
    error: str | None = Field(default=None, max_length=300)
    # torch's (agents/warmer.torch_fingerprint): the names and values reach KeysMatch's
    # message, so they are kept printable (_printable_map).
    framework: str | None = Field(default=None, max_length=20)
    inductor_config_hash: str | None = Field(default=None, alias="inductorConfigHash", max_length=64)
    torch_key: str | None = Field(default=None, alias="torchKey", max_length=64)
    inductor_env: dict[Annotated[str, Field(max_length=100)], Annotated[str, Field(max_length=100)]] | None = Field(
        default=None, alias="inductorEnv", max_length=TORCH_NAMED)
    inductor_changed: dict[Annotated[str, Field(max_length=100)], Annotated[str, Field(max_length=100)]] | None = \
        Field(default=None, alias="inductorChanged", max_length=TORCH_NAMED)

    @field_validator("framework", "inductor_config_hash", "torch_key")
    @classmethod
    def _printable_text(cls, value: str | None) -> str | None:
        return None if value is None else one_line(value)

    @field_validator("inductor_env", "inductor_changed")
    @classmethod
    def _printable_map(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """Env names and values, config keys and reprs as one line of plain text each (a
        pod's text reaches a condition and an Event: attacker review)."""
        return None if value is None else {one_line(k): one_line(v) for k, v in value.items()}

    def as_status(self) -> dict[str, Any]:
        """The fields the reporter sent, by their wire names (what keys_match reads)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TorchCounts(_Strict):
    """What torch's own counters said in a process of a torch cache (the reporter's `torch`
    section): FX graph and AOTAutograd cache hits, misses and bypasses, and the seconds
    torch spent compiling. Checked strictly, as LocalCopy is."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, allow_inf_nan=False)

    fx_graph_hits: int = Field(alias="fxGraphHits", ge=0, le=10**9)
    fx_graph_misses: int = Field(alias="fxGraphMisses", ge=0, le=10**9)
    fx_graph_bypasses: int = Field(alias="fxGraphBypasses", ge=0, le=10**9)
    aot_autograd_hits: int = Field(alias="aotAutogradHits", ge=0, le=10**9)
    aot_autograd_misses: int = Field(alias="aotAutogradMisses", ge=0, le=10**9)
    aot_autograd_bypasses: int = Field(alias="aotAutogradBypasses", ge=0, le=10**9)
    compile_seconds: float = Field(alias="compileSeconds", ge=0, le=1e9)

    @property
    def hit(self) -> bool:
        return bool(self.fx_graph_hits or self.aot_autograd_hits)


class Report(_Strict):
    version: Literal[1]
    pod: PodRef
    cache: str = Field(min_length=1, max_length=253)
    process: Process
    sequence: int = Field(ge=1, le=2**63)
    final: bool = False  # the process's last report, at exit
    counts: Counts
    fingerprint: Fingerprint = Field(default_factory=Fingerprint)
    local_copy: LocalCopy | None = Field(default=None, alias="localCopy")
    torch: TorchCounts | None = None


def parse(body: bytes) -> Report:
    """A report from its JSON body. Raises ReportError (413 too large, 400 malformed)."""
    if len(body) > MAX_BODY_BYTES:
        raise ReportError(f"report is larger than {MAX_BODY_BYTES} bytes", 413)
    try:
        report = Report.model_validate_json(body)
    except ValidationError as exc:
        raise ReportError(f"not a cachewarm report: {exc.errors()[0].get('loc')}: {exc.errors()[0].get('msg')}") \
            from None
    if report.counts.hits > report.counts.requests:
        raise ReportError("not a cachewarm report: more hits than compile requests")
    if (report.counts.user_hits or 0) > (report.counts.user_requests or 0):
        raise ReportError("not a cachewarm report: more user hits than user compile requests")
    return report


def check_identity(report: Report, reviewed: Mapping[str, Any]) -> None:
    """The token's pod (a TokenReview's status.user, audience checked by the apiserver) must
    be the report's pod, and the cache must be in that pod's namespace. Raises ReportError
    (403)."""
    user = reviewed.get("user") or {}
    extra = user.get("extra") or {}
    username = str(user.get("username") or "")
    parts = username.split(":")
    namespace = parts[2] if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"] else ""
    pod_name = next(iter(extra.get("authentication.kubernetes.io/pod-name") or []), "")
    pod_uid = next(iter(extra.get("authentication.kubernetes.io/pod-uid") or []), "")
    if not namespace or not pod_name or not pod_uid:
        raise ReportError("the token is not bound to a pod (a projected ServiceAccount token is needed)", 403)
    if (namespace, pod_name, pod_uid) != (report.pod.namespace, report.pod.name, report.pod.uid):
        raise ReportError(f"the token belongs to pod {namespace}/{pod_name}, not to the pod the report names", 403)
    if "/" in report.cache:
        raise ReportError("a pod reports only for a cache in its own namespace", 403)


MAX_TOKEN_BYTES = 16 * 1024  # a projected token is about 1 KiB


def _segment(part: str) -> Any:
    """One base64url JWT segment as JSON. Raises ValueError."""
    try:
        raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        return json.loads(raw)
    except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(str(exc)) from None


def check_token(token: str, now: float) -> tuple[str, str, str]:
    """The pod a projected ServiceAccount token claims to be bound to (namespace, name,
    uid), checked locally before the apiserver is asked to review it: a JWT (three
    base64url parts, a JSON header and payload), for audience cachewarm, not expired at
    `now` (epoch seconds), with the kubernetes.io pod claim. Nothing here is trusted
    (the signature is the apiserver's to check); it only spares a TokenReview for what
    cannot pass one. Raises ReportError (401)."""
    if len(token) > MAX_TOKEN_BYTES:
        raise ReportError("the token is not a ServiceAccount token (too long)", 401)
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        raise ReportError("the token is not a ServiceAccount token (not a JWT)", 401)
    try:
        header, payload = _segment(parts[0]), _segment(parts[1])
    except ValueError:
        raise ReportError("the token is not a ServiceAccount token (not base64url JSON)", 401) from None
    if not isinstance(header, dict) or not isinstance(payload, dict):
        raise ReportError("the token is not a ServiceAccount token (not a JSON object)", 401)
    aud = payload.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if AUDIENCE not in audiences:
        raise ReportError(f"the token is not for audience {AUDIENCE}", 401)
    exp = payload.get("exp")
    if not isinstance(exp, (int, float)) or isinstance(exp, bool) or exp <= now:
        raise ReportError("the token has expired (or says no expiry)", 401)
    claim = payload.get("kubernetes.io")
    pod = claim.get("pod") if isinstance(claim, dict) else None
    namespace = claim.get("namespace") if isinstance(claim, dict) else None
    if not isinstance(pod, dict) or not all(isinstance(v, str) and v for v in
                                            (namespace, pod.get("name"), pod.get("uid"))):
        raise ReportError("the token is not bound to a pod (a projected ServiceAccount token is needed)", 401)
    return str(namespace), str(pod["name"]), str(pod["uid"])


class LabelledPods:
    """The labelled pods the operator watches (namespace, name) -> (uid, the cache it is
    labelled for): a report counts only for the cache its pod is labelled for. Kept on
    the event loop (watch events in, report checks out)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._pods: dict[tuple[str, str], tuple[str, str]] = {}

    def observe(self, event_type: str | None, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        cache = (meta.get("labels") or {}).get(self.label)
        if event_type == "DELETED" or not cache:
            self._pods.pop(key, None)
        else:
            self._pods[key] = (str(meta.get("uid") or ""), str(cache))

    def get(self, namespace: str, name: str) -> tuple[str, str] | None:
        return self._pods.get((namespace, name))

    def check(self, report: Report) -> None:
        """The report's pod is one we watch, that very pod (uid), labelled for the
        report's cache. Raises ReportError (403)."""
        found = self.get(report.pod.namespace, report.pod.name)
        if found is None or found[0] != report.pod.uid:
            raise ReportError(f"pod {report.pod.namespace}/{report.pod.name} is not a labelled pod the operator "
                              "knows (yet)", 403)
        if found[1] != report.cache:
            raise ReportError(f"pod {report.pod.namespace}/{report.pod.name} is labelled for CompilationCache "
                              f"{found[1]!r}, not {report.cache!r}", 403)


@dataclasses.dataclass(frozen=True)
class _Latest:
    report: Report
    at: dt.datetime
    peak: tuple[int, int, float]  # the most hits, misses, seconds saved it reported (what it added)


_ProcessKey = tuple[str, int, int]  # pod uid, pid, started


@dataclasses.dataclass
class _Pod:
    """One pod (uid): its processes' last accepted reports in the window, and what it may
    still send at once (a token bucket: POD_REPORT_BURST, refilled POD_REPORTS_PER_MINUTE)."""

    processes: dict[_ProcessKey, dt.datetime]
    allowance: float
    at: dt.datetime

    def admit(self, proc: _ProcessKey, report: Report, before: _Latest | None, now: dt.datetime) -> None:
        """Take a report of `proc` at `now` or raise ReportError (429): a new process past
        MAX_PROCESSES_PER_POD; the process's previous report less than MIN_SECONDS_BETWEEN
        ago; the pod's allowance spent. A process's one final report, at exit, is taken
        within the last two (bounded: one per process)."""
        last = self.processes.get(proc)
        if last is None and len(self.processes) >= MAX_PROCESSES_PER_POD:
            raise ReportError(f"this pod has {len(self.processes)} processes reporting; at most "
                              f"{MAX_PROCESSES_PER_POD} are taken at once (a new one once an old one's reports are "
                              "out of the window)", 429)
        one_final = report.final and not (before is not None and before.report.final)
        if last is not None and (now - last).total_seconds() < MIN_SECONDS_BETWEEN and not one_final:
            raise ReportError(f"this process reported {int((now - last).total_seconds())}s ago; at most one "
                              f"report every {int(MIN_SECONDS_BETWEEN)}s", 429)
        allowance = min(float(POD_REPORT_BURST),
                        self.allowance + max((now - self.at).total_seconds(), 0.0) * POD_REPORTS_PER_MINUTE / 60)
        if allowance < 1 and not one_final:
            raise ReportError(f"this pod sent more than {POD_REPORT_BURST} reports at once or "
                              f"{int(POD_REPORTS_PER_MINUTE)} a minute", 429)
        self.allowance, self.at = max(allowance - 1, 0.0), now
        self.processes[proc] = now


class Store:
    """The latest report of every process, per cache; thread-safe and bounded."""

    def __init__(self, window: dt.timedelta = dt.timedelta(hours=1)) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._by_cache: dict[tuple[str, str], dict[_ProcessKey, _Latest]] = {}
        self._pods: dict[str, _Pod] = {}  # pod uid -> its processes and report allowance
        # Per cache, the pods (uid) whose cold local copy was said (LocalCopyCold), oldest first.
        self._cold_said: dict[tuple[str, str], dict[str, None]] = {}

    def record(self, report: Report, now: dt.datetime) -> dict[str, float]:
        """Keep `report`; returns how much it adds to the cache's totals (hits, misses,
        seconds saved; increases only), above the most the process reported before. A
        process not seen before counts in full only with its first report: a later one
        (after a leader change, or once it was forgotten) was counted, up to some point,
        before, so it only sets the baseline. Raises ReportError (429) past the pod's and
        the process's limits (_Pod.admit)."""
        key = (report.pod.namespace, report.cache)
        proc = (report.pod.uid, report.process.pid, report.process.started)
        none = {"hits": 0.0, "misses": 0.0, "saved": 0.0}
        with self._lock:
            processes = self._by_cache.setdefault(key, {})
            before = processes.get(proc)
            pod = self._pods.get(report.pod.uid) or _Pod({}, float(POD_REPORT_BURST), now)
            pod.admit(proc, report, before, now)
            self._pods[report.pod.uid] = pod
            if before is not None and before.report.sequence >= report.sequence:
                return none  # older than what is kept
            # A torch report's hits are not yet known to have saved time (torch_usage decides, over
            # the window): they are not added to the cache's hits counter; its gauges say them.
            new = (report.counts.hits if report.torch is None else 0, report.counts.misses,
                   report.counts.compile_seconds_saved)
            if before is None and report.sequence > 1:
                processes[proc] = _Latest(report, now, new)
                self._bound(processes)
                return none
            peak = before.peak if before is not None else (0, 0, 0.0)
            processes[proc] = _Latest(report, now, (max(peak[0], new[0]), max(peak[1], new[1]),
                                                    max(peak[2], new[2])))
            self._bound(processes)
            return {"hits": float(max(new[0] - peak[0], 0)), "misses": float(max(new[1] - peak[1], 0)),
                    "saved": max(new[2] - peak[2], 0.0)}

    @staticmethod
    def _bound(processes: dict[_ProcessKey, _Latest]) -> None:
        """At most MAX_PROCESSES_PER_CACHE processes: past it, the oldest of the pod that
        keeps the most is forgotten (one pod's many processes never push out another's)."""
        if len(processes) <= MAX_PROCESSES_PER_CACHE:
            return
        per_pod = collections.Counter(uid for uid, _, _ in processes)
        most = max(per_pod.values())
        oldest = min((p for p in processes if per_pod[p[0]] == most), key=lambda p: processes[p].at)
        processes.pop(oldest)

    def prune(self, now: dt.datetime, caches: set[tuple[str, str]] | None = None) -> None:
        """Forget processes that last reported before the window, and caches not in
        `caches` (deleted), so memory follows what is reported now."""
        with self._lock:
            for key in list(self._by_cache):
                kept = {p: latest for p, latest in self._by_cache[key].items() if now - latest.at <= self.window}
                if kept and (caches is None or key in caches):
                    self._by_cache[key] = kept
                else:
                    del self._by_cache[key]
            for uid in list(self._pods):
                pod = self._pods[uid]
                pod.processes = {p: at for p, at in pod.processes.items() if now - at <= self.window}
                if not pod.processes:
                    del self._pods[uid]  # nothing of it in the window: as a pod never seen
            if caches is not None:
                self._cold_said = {key: said for key, said in self._cold_said.items() if key in caches}

    def usage(self, namespace: str, cache: str, now: dt.datetime,
              body: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """status.usage of a cache: pods and processes that reported in the window, their
        hits, misses, hit ratio, compile seconds saved and spent, the last misses
        (pod, program, key) and the entries hit (program, key, the pods that hit it); with
        the cache's object (`body`: its spec and status), the programs missed with their
        causes (programs_usage). None when no pod reported in the window."""
        with self._lock:  # a snapshot: what follows reads immutable reports, outside the lock every intake takes
            processes = [latest for latest in (self._by_cache.get((namespace, cache)) or {}).values()
                         if now - latest.at <= self.window]
        if not processes:
            return None
        return self._usage(processes, body)

    def _usage(self, processes: list[_Latest], body: Mapping[str, Any] | None) -> dict[str, Any]:
        """usage's figures from its snapshot of the window's processes."""
        requests = sum(p.report.counts.requests for p in processes)
        # A torch pod whose counters hit but that saved no time is not counted as a hit (torch_usage).
        torch, not_saved = torch_usage(processes, body)
        hits = sum(p.report.counts.hits for p in processes if p.report.pod.uid not in not_saved)
        misses: list[tuple[dt.datetime, dict[str, str]]] = []
        for latest in processes:
            for miss in latest.report.counts.last_misses:
                misses.append((latest.at, {"pod": latest.report.pod.name, "program": miss.program,
                                           "key": miss.key}))
        misses.sort(key=lambda m: m[0], reverse=True)
        hit: dict[str, tuple[dt.datetime, str, set[str]]] = {}  # key -> (latest, program, pods)
        for latest in processes:
            for one in latest.report.counts.hit_keys:
                when, program, pods = hit.get(one.key, (latest.at, one.program, set()))
                pods.add(latest.report.pod.name)
                hit[one.key] = (max(when, latest.at), program, pods)
        recent = sorted(hit.items(), key=lambda h: (h[1][0], h[0]), reverse=True)[:RECENT_HITS]
        usage: dict[str, Any] = {
            "windowSeconds": int(self.window.total_seconds()),
            "pods": len({p.report.pod.uid for p in processes}),
            "processes": len(processes),
            "compileRequests": requests,
            "hits": hits,
            "misses": sum(p.report.counts.misses for p in processes),
            # A torch process's own estimate is none: its pod's saving is usage.torch.secondsSaved.
            "compileSecondsSaved": round(sum(p.report.counts.compile_seconds_saved for p in processes
                                             if p.report.torch is None) + float(torch.get("secondsSaved", 0.0)), 3),
            "compileSecondsSpent": round(sum(p.report.counts.compile_seconds_spent for p in processes), 3),
            "lastReportTime": timefmt.rfc3339(max(p.at for p in processes)),
            "lastMisses": [m for _, m in misses[:LAST_MISSES]],
            "recentHits": [{"program": program, "key": key, "pods": sorted(pods)[:HIT_PODS], "podCount": len(pods)}
                           for key, (_, program, pods) in recent],
        }
        if requests:  # absent rather than null: a merge patch would remove a null again and again
            usage["hitRatio"] = round(hits / requests, 3)
        copies = self._local_copies(processes)
        if copies:
            usage["localCopy"] = {
                "pods": len(copies),
                "coldPods": sum(1 for _, local in copies.values() if local.cold),
                "entriesCopied": sum(local.copied for _, local in copies.values()),
                "entriesPresent": sum(local.present for _, local in copies.values()),
                "bytesCopied": sum(local.bytes_copied for _, local in copies.values()),
                "maxSeconds": round(max(local.seconds for _, local in copies.values()), 3),
            }
        usage.update(programs_usage(processes, body))
        if torch:
            usage["torch"] = torch
        return usage

    @staticmethod
    def _local_copies(processes: list[_Latest]) -> dict[str, tuple[str, LocalCopy]]:
        """pod uid -> (pod name, its local copy): one per pod, from its latest report that
        has one (every process of a pod reports the same copy)."""
        found: dict[str, tuple[dt.datetime, str, LocalCopy]] = {}
        for latest in processes:
            uid, local = latest.report.pod.uid, latest.report.local_copy
            if local is not None and (uid not in found or latest.at > found[uid][0]):
                found[uid] = (latest.at, latest.report.pod.name, local)
        return {uid: (name, local) for uid, (_, name, local) in found.items()}

    def newly_cold(self, namespace: str, cache: str, now: dt.datetime) -> list[tuple[str, str]]:
        """(pod name, error) of each pod that reported a cold local copy in the window and
        was not returned before (by this replica, for this cache), by name; from then on
        they are said."""
        with self._lock:
            processes = [latest for latest in (self._by_cache.get((namespace, cache)) or {}).values()
                         if now - latest.at <= self.window]
            said = self._cold_said.get((namespace, cache)) or {}
            new = sorted((name, local.error or "", uid) for uid, (name, local) in self._local_copies(processes).items()
                         if local.cold and uid not in said)
            if new:
                said = self._cold_said.setdefault((namespace, cache), said)
                for _, _, uid in new:
                    said[uid] = None
                while len(said) > MAX_PROCESSES_PER_CACHE:
                    said.pop(next(iter(said)))
            return [(name, error) for name, error, _ in new]

    def fingerprints(self, namespace: str, cache: str, now: dt.datetime) -> list[tuple[str, dict[str, Any]]]:
        """(pod name, fingerprint) of every process that reported in the window."""
        with self._lock:
            return [(latest.report.pod.name, latest.report.fingerprint.as_status())
                    for latest in (self._by_cache.get((namespace, cache)) or {}).values()
                    if now - latest.at <= self.window and latest.report.fingerprint.as_status()]

    def caches(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._by_cache)


# program -> the compile seconds a pool's warmer measured for it (the mean over its keys, and
# per key hash where known), with that pool's fingerprint
References = Mapping[str, list[tuple[Mapping[str, Any], float, Mapping[str, float]]]]


def warmer_references(body: Mapping[str, Any] | None
                      ) -> dict[str, list[tuple[Mapping[str, Any], float, Mapping[str, float]]]]:
    """What the cache's warmers measured each program they compiled and wrote took
    (status.warmup.pools[].compiledPrograms, whatever the pool's state, with the
    fingerprint they were compiled with, warmplan.compiled_fingerprint: kept through a
    re-warm, running or failed, they still count; a program with several keys: their mean,
    and each key's own seconds, for pods that say which key they hit). Status is the
    operator's (the warmers' summaries read from the cache's own warmer Jobs' pods, bounded
    and typed there); read defensively all the same."""
    out: dict[str, list[tuple[Mapping[str, Any], float, Mapping[str, float]]]] = {}
    pools = ((body or {}).get("status") or {}).get("warmup") or {}
    for pool in pools.get("pools") or [] if isinstance(pools, Mapping) else []:
        fp = compiled_fingerprint(pool) if isinstance(pool, Mapping) else None
        if fp is None:
            continue
        seconds: dict[str, list[float]] = {}
        by_key: dict[str, dict[str, float]] = {}
        for one in pool.get("compiledPrograms") or []:
            value = one.get("compileSeconds") if isinstance(one, Mapping) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1e7 and \
                    isinstance(one.get("program"), str) and one.get("written") is not False:
                seconds.setdefault(one["program"], []).append(float(value))
                if isinstance(one.get("key"), str):
                    by_key.setdefault(one["program"], {})[one["key"]] = float(value)
        for program, found in seconds.items():
            out.setdefault(program, []).append((fp, sum(found) / len(found), by_key.get(program) or {}))
    return out


def warmer_rests(body: Mapping[str, Any] | None) -> list[tuple[Mapping[str, Any], float]]:
    """(fingerprint, maxSeconds) of each pool whose warmer compiled more programs than its
    compiledPrograms name (status.warmup.pools[].compiledRest): a hit of a program no
    reference names, by a pod of that fingerprint, may be one of them."""
    out: list[tuple[Mapping[str, Any], float]] = []
    pools = ((body or {}).get("status") or {}).get("warmup") or {}
    for pool in pools.get("pools") or [] if isinstance(pools, Mapping) else []:
        rest = pool.get("compiledRest") if isinstance(pool, Mapping) else None
        if not isinstance(rest, Mapping):
            continue
        fp, longest, programs = compiled_fingerprint(pool), rest.get("maxSeconds"), rest.get("programs")
        if fp is not None and isinstance(longest, (int, float)) and not isinstance(longest, bool) and \
                0 <= longest <= 1e7 and isinstance(programs, int) and programs > 0:
            out.append((fp, float(longest)))
    return out


class _Same:
    """Whether a warmer's fingerprint is a process's (keysmatch.differences finds none),
    each distinct pair compared once per usage pass: a pass compares every program each
    process hit against every pool, and a namespace can make those many (32 pools, 64
    processes a pod, 50 programs each) on the operator's one loop (attacker review). The
    processes' fingerprints are told apart by their canonical JSON (_fingerprint)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], bool] = {}

    def __call__(self, pool: Mapping[str, Any], fp: Mapping[str, Any], fp_key: str) -> bool:
        key = (id(pool), fp_key)
        same = self.seen.get(key)
        if same is None:
            same = self.seen[key] = bool(fp) and not differences(pool, fp)
        return same


def _fingerprint(latest: _Latest, memo: dict[int, tuple[dict[str, Any], str]]) -> tuple[dict[str, Any], str]:
    """A process's fingerprint as status says it, and its canonical JSON, once per process."""
    found = memo.get(id(latest))
    if found is None:
        fp = latest.report.fingerprint.as_status()
        found = memo[id(latest)] = (fp, json.dumps(fp, sort_keys=True, default=str))
    return found


def _reference(refs: References, program: str, fp: Mapping[str, Any],
               keys: frozenset[str] = frozenset(), same: _Same | None = None, fp_key: str = "") -> float | None:
    """The warmers' compile seconds of `program` for a process of fingerprint `fp`: the mean
    over the pools warmed with that very fingerprint (keysmatch's fields), of the entries
    the process hit where it named them (`keys`, key hashes) and a warmer measured them,
    else of all the program's; None when no pool of that fingerprint compiled it (a pool
    warmed on other hardware or versions is no reference)."""
    match = same or _Same()
    key = fp_key or json.dumps(fp, sort_keys=True, default=str)
    pools = [(mean, by_key) for pool, mean, by_key in refs.get(program) or [] if match(pool, fp, key)]
    found = [by_key[k] for _, by_key in pools for k in sorted(keys) if k in by_key] or [mean for mean, _ in pools]
    return sum(found) / len(found) if found else None


def _hit_hashes(latest: _Latest, program: str) -> frozenset[str]:
    """The key hashes (as warmers name them) of the entries of `program` the process said
    it hit (its report's hitKeys, the latest ones)."""
    return frozenset(one.key.rsplit("-", 1)[-1][:16] for one in latest.report.counts.hit_keys
                     if one.program == program)


def programs_usage(processes: list[_Latest], body: Mapping[str, Any] | None) -> dict[str, Any]:
    """The per-program part of status.usage: the user's requests and hits apart from JAX's
    helper programs (from the processes that counted them), the programs missed (top
    MISSED_PROGRAMS by compile seconds, each with its cause when `body` is given) and hit
    (top HIT_PROGRAMS by hits, with their load seconds against the seconds a compile of them
    took: where a pod in the window compiled one, else as the cache's warmer measured it,
    warmer_references), and the seconds those hits saved."""
    out: dict[str, Any] = {}
    counted = [p.report.counts for p in processes if p.report.counts.user_requests is not None]
    if counted:
        requests, hits = sum(c.user_requests or 0 for c in counted), sum(c.user_hits or 0 for c in counted)
        out.update(userCompileRequests=requests, userHits=hits)
        if requests:
            out["userHitRatio"] = round(hits / requests, 3)
    per: dict[str, dict[str, Any]] = {}
    refs = warmer_references(body)
    same, fps = _Same(), dict[int, tuple[dict[str, Any], str]]()
    for latest in processes:
        fp, fp_key = _fingerprint(latest, fps)
        for one in latest.report.counts.programs:
            seen = per.setdefault(one.program, {"hits": 0, "misses": 0, "compile": 0.0, "load": 0.0, "pods": set(),
                                                "keys": set(), "cached": None, "notWritten": None, "fps": [],
                                                "helper": one.helper, "held": False, "warmer": [0, 0.0, 0.0]})
            seen["hits"] += one.hits
            seen["load"] += one.load_seconds
            reference = _reference(refs, one.program, fp, _hit_hashes(latest, one.program), same,
                                   fp_key) if one.hits else None
            if reference is not None:  # hits, what they would have cost compiled, their load seconds
                seen["warmer"] = [seen["warmer"][0] + one.hits, seen["warmer"][1] + one.hits * reference,
                                  seen["warmer"][2] + one.load_seconds]
            if one.misses:
                seen["misses"] += one.misses
                seen["compile"] += one.compile_seconds
                seen["pods"].add(latest.report.pod.name)
                seen["keys"] |= set(one.keys)
                seen["fps"].append(fp)
                seen["notWritten"] = seen["notWritten"] or one.not_written
                if one.cached is not None:  # other keys than its own miss's, and whether it held that one
                    seen["cached"] = (seen["cached"] or set()) | (set(one.cached) - set(one.keys))
                    seen["held"] = seen["held"] or bool(set(one.cached) & set(one.keys))
    if not per:
        return out
    warm = causes.warmed(body.get("spec") or {}, body.get("status") or {}) if body is not None else None
    missed = sorted((p for p in per.items() if p[1]["misses"]), key=lambda p: (-p[1]["compile"], p[0]))
    out["missedPrograms"] = [_missed(name, seen, warm) for name, seen in missed[:MISSED_PROGRAMS]]
    hit = [(name, seen) for name, seen in per.items() if seen["hits"]]
    saved = [_hit(name, seen) for name, seen in sorted(hit, key=lambda p: (-p[1]["hits"], p[0]))]
    out["hitPrograms"] = saved[:HIT_PROGRAMS]
    known = [one["secondsSaved"] for one in saved if "secondsSaved" in one]
    if known:
        out["measuredSecondsSaved"] = round(sum(known), 3)
    starts = _pod_starts(processes, per, refs, warmer_rests(body), same, fps)
    if starts:
        out["podStarts"] = starts
    return out


def _pod_starts(processes: list[_Latest], per: Mapping[str, Mapping[str, Any]],
                refs: References | None = None,
                rests: Sequence[tuple[Mapping[str, Any], float]] = (), same: _Same | None = None,
                fps: dict[int, tuple[dict[str, Any], str]] | None = None) -> list[dict[str, Any]]:
    """Per pod that hit something, the seconds its compile requests took (compiling what
    missed, loading what hit) against what they would have taken all compiled (each
    program's compile seconds as measured in the window by the pods that compiled it, else
    by a warmer of the pod's fingerprint, _reference): where both are known, that is where
    every request of its processes is in their program lists and every program it hit has
    such a reference, or may be one of the programs a warmer of its fingerprint compiled
    past those it named (warmer_rests): those hits count 0 seconds cold (coldCompileSeconds
    is then a lower bound, the saving not overstated), and unmeasuredHits with
    unmeasuredAtMostSeconds (each at most the warmer's maxSeconds) say so. The POD_STARTS
    that saved most."""
    pods: dict[str, list[_Latest]] = {}
    for latest in processes:
        pods.setdefault(latest.report.pod.uid, []).append(latest)
    out: list[dict[str, Any]] = []
    same, fps = same or _Same(), {} if fps is None else fps
    for mine in pods.values():
        listed = [(one, _cold_once(per[one.program], refs or {}, one.program, *_fingerprint(latest, fps),
                                   _hit_hashes(latest, one.program), same),
                   _bound(rests, *_fingerprint(latest, fps), same))
                  for latest in mine for one in latest.report.counts.programs]
        complete = all(sum(one.hits + one.misses for one in latest.report.counts.programs)
                       == latest.report.counts.requests for latest in mine)
        measured = all(one.hits == 0 or once is not None or bound is not None for one, once, bound in listed)
        if not listed or not complete or not measured or not any(one.hits for one, _, _ in listed):
            continue
        warm = sum(one.compile_seconds + one.load_seconds for one, _, _ in listed)
        cold = sum(one.compile_seconds + one.hits * (once or 0.0) for one, once, _ in listed)
        start: dict[str, Any] = {"pod": mine[0].report.pod.name, "compileSeconds": round(warm, 3),
                                 "coldCompileSeconds": round(cold, 3)}
        unmeasured = [(one.hits, bound or 0.0) for one, once, bound in listed if one.hits and once is None]
        if unmeasured:
            start["unmeasuredHits"] = sum(hits for hits, _ in unmeasured)
            start["unmeasuredAtMostSeconds"] = round(sum(hits * bound for hits, bound in unmeasured), 3)
        out.append(start)
    out.sort(key=lambda one: (float(one["compileSeconds"]) - float(one["coldCompileSeconds"]), str(one["pod"])))
    return out[:POD_STARTS]


def _bound(rests: Sequence[tuple[Mapping[str, Any], float]], fp: Mapping[str, Any], fp_key: str = "",
           same: _Same | None = None) -> float | None:
    """The longest compile among the programs warmers of fingerprint `fp` compiled but did
    not name (None: none of them left any out)."""
    match, key = same or _Same(), fp_key or json.dumps(fp, sort_keys=True, default=str)
    found = [longest for pool, longest in rests if match(pool, fp, key)]
    return max(found) if found else None


def _cold_once(seen: Mapping[str, Any], refs: References, program: str, fp: Mapping[str, Any], fp_key: str = "",
               keys: frozenset[str] = frozenset(), same: _Same | None = None) -> float | None:
    """What one compile of `program` takes, for a process of fingerprint `fp`: as the pods
    that compiled it in the window measured it, else as a warmer of that fingerprint did."""
    if seen["misses"]:
        return float(seen["compile"]) / int(seen["misses"])
    return _reference(refs, program, fp, keys, same, fp_key)


def _missed(name: str, seen: Mapping[str, Any], warm: causes.Warmed | None) -> dict[str, Any]:
    one: dict[str, Any] = {"program": name, "pods": len(seen["pods"]), "misses": seen["misses"],
                           "compileSeconds": round(seen["compile"], 3), "helper": seen["helper"]}
    if warm is not None:
        cause, message = causes.classify(causes.Missed(
            name, seen["misses"], seen["compile"], frozenset(seen["pods"]), frozenset(seen["keys"]),
            frozenset(seen["cached"]) if seen["cached"] is not None else None, seen["notWritten"],
            tuple(seen["fps"]), seen["held"]), warm)
        one.update(cause=cause, message=message[:1000])
    return one


def _hit(name: str, seen: Mapping[str, Any]) -> dict[str, Any]:
    """A program hit: its load seconds per hit against what a compile of it took (measured
    in the window by the pods that missed it, compileSecondsFrom Pods; else by the cache's
    warmer, for the hits of processes of that warmer's fingerprint: Warmer), and the seconds
    those hits saved."""
    one: dict[str, Any] = {"program": name, "hits": seen["hits"], "loadSeconds": round(seen["load"] / seen["hits"], 3),
                           "helper": seen["helper"]}
    hits, compiled, loaded = seen.get("warmer") or (0, 0.0, 0.0)
    if seen["misses"]:
        compile_once = seen["compile"] / seen["misses"]
        one["compileSeconds"] = round(compile_once, 3)
        one["secondsSaved"] = round(seen["hits"] * compile_once - seen["load"], 3)
        one["compileSecondsFrom"] = "Pods"
    elif hits:
        one["compileSeconds"] = round(compiled / hits, 3)
        one["secondsSaved"] = round(compiled - loaded, 3)
        one["compileSecondsFrom"] = "Warmer"
        if hits < seen["hits"]:
            one["hitsMeasured"] = hits  # the others' processes had another fingerprint than every warmer's
    return one


TORCH_PROGRAM = "torch.compile"  # how a torch warmer names its compile in compiledPrograms (one per warm)


# A pod of a torch cache saved time only when its processes that hit compiled at most this
# share of the seconds the warm of their fingerprint took: a warm directory measured here gives
# 0.05-0.1x, torch's Mega-Cache artifact alone 0.64-0.85x with every counter a hit (docs/torch.md).
TORCH_SAVED_AT_MOST = 0.5


def torch_usage(processes: list[_Latest], body: Mapping[str, Any] | None) -> tuple[dict[str, Any], frozenset[str]]:
    """status.usage.torch: what torch's counters said in the processes of a torch cache
    (their reports' `torch` sections; {} when none sent one), and the pods (uid) whose
    counters hit but that saved no time. A pod whose processes hit is measured against the
    warm of its fingerprint (a pool whose warmer compiled with that very fingerprint,
    keysmatch's fields: its compiledPrograms' torch.compile seconds, the mean where several
    pools match), process by process: warmerCompileSeconds is what those processes would
    have compiled cold, measuredCompileSeconds what they compiled. The pod saved the
    difference only when its seconds are at most TORCH_SAVED_AT_MOST of the warm's; else its
    counters hit but the time was not saved (on CPU, hits of a cache that lacks the compiled
    kernels still build them): it counts in hitButNotSaved, and its hits in
    fxGraphHitsNotSaved/aotAutogradHitsNotSaved, not in fxGraphHits/aotAutogradHits. A pod
    with no warm of its fingerprint is not measured: its hits stay hits, it saved nothing."""
    torch = [(latest, latest.report.torch) for latest in processes if latest.report.torch is not None]
    if not torch:
        return {}, frozenset()
    refs, same, fps = warmer_references(body), _Same(), dict[int, tuple[dict[str, Any], str]]()
    pods: dict[str, list[tuple[float, float]]] = {}  # uid -> (warmer's seconds, its own) per measured process
    for latest, counts in torch:
        mine = pods.setdefault(latest.report.pod.uid, [])
        fp, fp_key = _fingerprint(latest, fps)
        reference = _reference(refs, TORCH_PROGRAM, fp, frozenset(), same, fp_key) if counts.hit else None
        if reference is not None:
            mine.append((reference, counts.compile_seconds))
    measured = {uid: (sum(w for w, _ in mine), sum(own for _, own in mine)) for uid, mine in pods.items() if mine}
    saved = {uid: (w, own) for uid, (w, own) in measured.items() if own <= TORCH_SAVED_AT_MOST * w}
    not_saved = frozenset(measured) - frozenset(saved)
    kept = [c for latest, c in torch if latest.report.pod.uid not in not_saved]
    lost = [c for latest, c in torch if latest.report.pod.uid in not_saved]
    return {
        "pods": len(pods),
        "fxGraphHits": sum(c.fx_graph_hits for c in kept),
        "fxGraphHitsNotSaved": sum(c.fx_graph_hits for c in lost),
        "fxGraphMisses": sum(c.fx_graph_misses for _, c in torch),
        "aotAutogradHits": sum(c.aot_autograd_hits for c in kept),
        "aotAutogradHitsNotSaved": sum(c.aot_autograd_hits for c in lost),
        "aotAutogradMisses": sum(c.aot_autograd_misses for _, c in torch),
        "compileSeconds": round(sum(c.compile_seconds for _, c in torch), 3),
        "warmerCompileSeconds": round(sum(warmer for warmer, _ in measured.values()), 3),
        "measuredCompileSeconds": round(sum(own for _, own in measured.values()), 3),
        "secondsSaved": round(sum(warmer - own for warmer, own in saved.values()), 3),
        "hitButNotSaved": len(not_saved),
    }, not_saved


def cold_message(pods: list[tuple[str, str]]) -> str:
    """The LocalCopyCold Event's message for pods (name, error) whose local copy failed."""
    named = ", ".join(name for name, _ in pods[:COLD_PODS_NAMED])
    more = f" and {len(pods) - COLD_PODS_NAMED} more" if len(pods) > COLD_PODS_NAMED else ""
    error = next((error for _, error in pods if error), "")
    who, whose = (f"Pod {named}", "its") if len(pods) == 1 else (f"{len(pods)} pods ({named}{more})", "their")
    return (f"{who} started without the cache's entries: the local copy failed{f' ({error})' if error else ''}; "
            f"{whose} processes compile what they would have read from it")[:1000]
