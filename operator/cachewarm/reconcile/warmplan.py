"""The warm-up's decisions, without a client: from what the cluster holds for one cache's
warmers (a WarmView, listed by reconcile.warmup) and what this reconcile knows besides (a
WarmContext: the spec, the previous status, `now`), a WarmPlan: the Jobs and Services to
create and delete, in order, each pool's status entry, the Events and Warmed. An
import-linter contract keeps cachewarm.clients out of this module, and no clock is read
here, so every decision is table-tested (tests/unit/test_warmplan.py).

Everything is derived from observed Jobs and Pods plus the previous status, so a restart
of the operator at any point (even mid-warm) finds the same Job by its deterministic name
and creates nothing twice. A pool never has two unfinished warmers: stale ones are deleted
(foreground) and the new one is created on a later reconcile, once they are gone; a
reconcile holding an older spec than a Job's generation annotation leaves the pool alone.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from croniter import croniter
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from cachewarm.api import constants as c
from cachewarm.api import timefmt
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.api.model import CacheSpec, Pool, Warmup
from cachewarm.builders import job as jobs
from cachewarm.builders.placement import is_pool_manifest, legacy_manifest_object, pool_shape
from cachewarm.builders.tpu import TpuShapeError
from cachewarm.reconcile.keysmatch import differences, one_line
from cachewarm.reconcile.misses import printable

ACTIVE_STATES = ("Pending", "Running")
MAX_KEYS = 250  # key hashes kept per pool in status (a termination message holds about 200)
IMAGE_PYTHONPATH_LIMIT = 1000  # characters: the CRD's maxLength (warmer.IMAGE_PYTHONPATH_LIMIT)


@dataclass(frozen=True)
class WarmRetry:
    """How often a failed warmer runs again: `retries` more times, the first after
    `delay_seconds`, each later one after twice the one before (at most an hour)."""

    retries: int = 3
    delay_seconds: float = 60.0

    def delay(self, attempt: int) -> dt.timedelta:
        """The wait after failed attempt number `attempt` (1 is the first run)."""
        return dt.timedelta(seconds=min(self.delay_seconds * 2 ** max(0, attempt - 1), 3600.0))


def last_slot(schedule: str, now: dt.datetime) -> dt.datetime:
    """The most recent slot of a cron `schedule` at `now` (UTC): the latest one not after
    `now`, so a slot counts from its very instant and not a moment before."""
    slot: dt.datetime = croniter(schedule, now).get_prev(dt.datetime)  # exclusive of `now`
    following: dt.datetime = croniter(schedule, slot).get_next(dt.datetime)
    return following if following <= now else slot


def next_slot(schedule: str, now: dt.datetime) -> dt.datetime:
    """The first slot of a cron `schedule` after `now` (UTC)."""
    slot: dt.datetime = croniter(schedule, now).get_next(dt.datetime)  # exclusive of `now`
    return slot


def scheduled_slot(cache: CacheSpec, now: dt.datetime) -> dt.datetime | None:
    """The cron slot the cache's warmers run for at `now` (None: no schedule)."""
    if cache.warmup is None or not cache.warmup.schedule:
        return None
    return last_slot(cache.warmup.schedule, now)


def next_scheduled_warm(cache: CacheSpec, now: dt.datetime) -> dt.datetime | None:
    """When the cache's next cron slot asks for a new warm (None: no schedule): the time
    the controller reconciles it again, since no event marks a slot's start."""
    if cache.warmup is None or not cache.warmup.schedule:
        return None
    return next_slot(cache.warmup.schedule, now)


def rewarm_token(cache: CacheSpec, annotations: Mapping[str, str], now: dt.datetime) -> str:
    """What forces a new warm for an unchanged program: the manual annotation and the most
    recent cron slot."""
    token = annotations.get(c.REWARM_ANNOTATION, "")
    slot = scheduled_slot(cache, now)
    if slot is not None:
        token += "|" + slot.strftime("%Y-%m-%dT%H:%MZ")
    return token


def _job_state(job: Mapping[str, Any]) -> str:
    """Succeeded or Failed only once the Job controller says the Job's pods are gone
    (Complete, Failed). SuccessCriteriaMet and FailureTarget (Kubernetes 1.31+) come
    while pods still terminate: a Job with only those is Running, so its pool gets no new
    warmer and keeps its Service until the old pods have stopped."""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") == "Complete":
            return "Succeeded"
        if cond.get("status") == "True" and cond.get("type") == "Failed":
            return "Failed"
    return "Running" if status.get("active") or status.get("startTime") else "Pending"


def _job_failure(job: Mapping[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Failed", "FailureTarget") and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip(": ")
    return ""


def owned_pods(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]
               ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """`pods` (listed by the label job-name=<job>) split into those the Job made (their
    controller ownerReference is the Job, by uid) and the others. Anyone who may create
    pods in the namespace can put that label on a pod of their own with any termination
    message; only the Job's pods are warmers, so only theirs are read. A Job without a
    uid (never one an apiserver lists) owns nothing."""
    uid = str((job.get("metadata") or {}).get("uid") or "")
    owned: list[Mapping[str, Any]] = []
    others: list[Mapping[str, Any]] = []
    for pod in pods:
        controllers = [r for r in (pod.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")]
        # batch/ too: manifests/policy/warmer_pods.yaml refuses a Job controller reference
        # of that group to all but the Job controller; one of another group ("Job", the
        # Job's uid) it lets through, so it must not count here.
        mine = bool(uid) and any(r.get("kind") == "Job" and str(r.get("apiVersion") or "").startswith("batch/")
                                 and r.get("uid") == uid for r in controllers)
        (owned if mine else others).append(pod)
    return owned, others


MAX_COUNT = 10**9  # entries, programs, PATCHes: far above any warm, far below int64
MAX_BYTES = 2**53  # bytesWritten: exact in JSON and in status' int64
MAX_SECONDS = 10.0**7  # compileSeconds: about 115 days
Text = Annotated[str, Field(max_length=4096)]  # a termination message holds at most 4096 bytes


class UnstableProgram(BaseModel):
    """A program the warmer saw get a new key with the same fingerprint (warmer.unstable_programs)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    program: Annotated[str, Field(min_length=1, max_length=100)]
    keys: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=4)
    seen: Literal["runs", "processes"]


MAX_COMPILED = 16  # compiledPrograms per pool (the warmer's MAX_COMPILED)


class CompiledProgram(BaseModel):
    """What one program the warmer compiled took (warmer.compiled_programs): its compile
    seconds as JAX measured them around the backend compile, the entry's key hash (absent:
    not known), and whether JAX went on to write it. The name is kept printable, as pods'
    program names are (misses.printable)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    program: Annotated[str, Field(min_length=1, max_length=200)]
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{1,16}$")] | None = None
    # A torch warmer's one program (torch.compile) may name its seconds `seconds`.
    compileSeconds: float = Field(ge=0.0, le=MAX_SECONDS, validation_alias=AliasChoices("compileSeconds", "seconds"))
    written: bool = True

    @field_validator("program")
    @classmethod
    def _printable(cls, value: str) -> str:
        return printable(value)


class CompiledRest(BaseModel):
    """The programs a warmer compiled beyond those compiledPrograms names (warmer.compiled_rest):
    at least `programs` of them, each took at most `maxSeconds`."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    programs: int = Field(ge=1, le=MAX_COUNT)
    maxSeconds: float = Field(ge=0.0, le=MAX_SECONDS)


class TorchWarm(BaseModel):
    """What a torch warmer's counters said (its summary's `torch`): FX graph and
    AOTAutograd cache hits, misses and bypasses, torch's compile seconds, and the archive
    it uploaded (files, bytes); `counted` false: the command ran as a child, so the counts
    are not known (the archive is still uploaded)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    fxGraphHits: int = Field(0, ge=0, le=MAX_COUNT)
    fxGraphMisses: int = Field(0, ge=0, le=MAX_COUNT)
    fxGraphBypasses: int = Field(0, ge=0, le=MAX_COUNT)
    aotAutogradHits: int = Field(0, ge=0, le=MAX_COUNT)
    aotAutogradMisses: int = Field(0, ge=0, le=MAX_COUNT)
    aotAutogradBypasses: int = Field(0, ge=0, le=MAX_COUNT)
    compileSeconds: float = Field(0.0, ge=0.0, le=MAX_SECONDS)
    files: int = Field(0, ge=0, le=MAX_COUNT)
    archiveBytes: int = Field(0, ge=0, le=MAX_BYTES)
    counted: bool = False


class WarmerSummary(BaseModel):
    """A warmer's summary (its termination message) as the operator reads it. The warmer
    runs the user's image and code, so nothing in it is trusted to be tidy: each field is
    strictly typed (no "12" for 12, no true for 1) and bounded, NaN and infinities are
    refused (Python's json reads them), and unknown fields are ignored. A field that fails
    is dropped alone (parse_summary), so a bad summary never fails a reconcile."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    processIndex: int = Field(0, ge=0, le=65535)
    entriesFound: int = Field(0, ge=0, le=MAX_COUNT)
    entriesWritten: int = Field(0, ge=0, le=MAX_COUNT)
    bytesWritten: int = Field(0, ge=0, le=MAX_BYTES)
    compileSeconds: float = Field(0.0, ge=0.0, le=MAX_SECONDS)
    refreshFailed: int = Field(0, ge=0, le=MAX_COUNT)
    refreshError: Text = ""
    notCached: int = Field(0, ge=0, le=MAX_COUNT)
    keys: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=4096)
    keyCount: int | None = Field(None, ge=0, le=MAX_COUNT)
    manifestGeneration: str | None = Field(None, pattern=r"^[0-9]{1,20}$")
    fingerprint: dict[Annotated[str, Field(max_length=100)], Any] | None = Field(None, max_length=64)
    imagePythonPath: Annotated[str, Field(max_length=IMAGE_PYTHONPATH_LIMIT)] | None = None
    unstablePrograms: list[UnstableProgram] | None = Field(None, max_length=5)
    compiledPrograms: list[CompiledProgram] | None = Field(None, max_length=MAX_COMPILED)
    compiledRest: CompiledRest | None = None
    packEntries: int | None = Field(None, ge=0, le=MAX_COUNT)
    packBytes: int | None = Field(None, ge=0, le=MAX_BYTES)
    packError: Text | None = None
    torch: TorchWarm | None = None
    errors: list[Text] = Field(default_factory=list, max_length=100)


def parse_summary(raw: Mapping[str, Any]) -> tuple[WarmerSummary, tuple[str, ...]]:
    """`raw` as a WarmerSummary, and the names of the fields dropped as invalid (sorted)."""
    data = {k: v for k, v in raw.items() if k in WarmerSummary.model_fields}
    try:
        return WarmerSummary.model_validate(data), ()
    except ValidationError as exc:
        bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]} or set(data)
    try:
        return WarmerSummary.model_validate({k: v for k, v in data.items() if k not in bad}), tuple(sorted(bad))
    except ValidationError:  # not expected: fields are checked one by one
        return WarmerSummary.model_validate({}), tuple(sorted(data))


def read_summaries(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The warmers' JSON summaries from their terminated containers' messages."""
    out = []
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("name") != "warm":
                continue
            message = ((status.get("state") or {}).get("terminated") or {}).get("message") or ""
            try:
                summary = json.loads(message)
            except ValueError:
                summary = {"errors": [message.strip()[-500:]]} if message.strip() else None
            if isinstance(summary, dict):
                out.append(summary)
    return out


@dataclass(frozen=True)
class PodsView:
    """What a Job's pods say beyond the Job's status: where they ran, and why one waits."""

    nodes: tuple[str, ...] = ()
    unschedulable: str = ""  # the scheduler's message, verbatim
    image: str = ""  # the image the warm container ran, by digest (its imageID), as the kubelet reports it
    # The warm container's spec, as admitted, sets PYTHONPATH or may (envFrom): another
    # webhook's (a tracer's library injection), or the warmup's env; the warmer then saw
    # that, not the image's own.
    pythonpath_set: bool = False


def read_pods(pods: Sequence[Mapping[str, Any]]) -> PodsView:
    nodes = sorted({str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")})
    unschedulable = ""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable" and not unschedulable):
                unschedulable = str(cond.get("message") or "no node fits the pod")
    # Every host runs the same image; a tag may have moved, the digest the kubelet pulled not.
    image = next((str(s["imageID"]) for p in pods for s in (p.get("status") or {}).get("containerStatuses") or []
                  if s.get("name") == "warm" and s.get("imageID")), "")
    warm = [ct for p in pods for ct in (p.get("spec") or {}).get("containers") or [] if ct.get("name") == "warm"]
    pythonpath_set = any(ct.get("envFrom") or any(e.get("name") == "PYTHONPATH" for e in ct.get("env") or [])
                         for ct in warm)
    return PodsView(tuple(nodes), unschedulable, image, pythonpath_set)


FINGERPRINT_TEXT = ("jax", "flagsHash", "cacheDir", "platform", "platformVersion", "deviceKind", "topology", "error",
                    "framework", "inductorConfigHash", "torchKey")
FINGERPRINT_COUNTS = ("flagCount", "devices", "processes")
FRAMEWORKS = ("jax", "torch")  # the CRD's enum of status.warmup.pools[].fingerprint.framework
# torch's {name: value} maps (agents/warmer.torch_fingerprint): the env settings and the
# config values set in code that enter Inductor's keys, each compared by KeysMatch.
FINGERPRINT_MAPS = ("inductorEnv", "inductorChanged")
FINGERPRINT_MAP_ITEMS = 20


def fingerprint_status(reported: Mapping[str, Any], image: str) -> dict[str, Any]:
    """A warmer's fingerprint as status keeps it: the known fields only, typed and bounded
    (the summary is the warmer's, run in the user's image, so not trusted to be tidy)."""
    # Plain text, as the pods' side keeps it (reports/store.py): a value compares equal to the
    # pods' and reaches no condition, Event or `cachewarm inspect` with a terminal escape.
    out: dict[str, Any] = {k: one_line(str(reported[k])[:300]) for k in FINGERPRINT_TEXT
                           if reported.get(k) not in (None, "")}
    if out.get("framework") not in (None, *FRAMEWORKS):
        # The CRD's enum: another value would make the apiserver refuse the whole status patch.
        del out["framework"]
    for key in FINGERPRINT_COUNTS:
        value = reported.get(key)
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
            value = int(value)  # older warmers wrote some counts as text
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
            out[key] = value
    versions = reported.get("versions")
    if isinstance(versions, Mapping):
        out["versions"] = {one_line(str(k)[:100]): one_line(str(v)[:100]) for k, v in list(versions.items())[:16]}
    for key in FINGERPRINT_MAPS:
        named = reported.get(key)
        if isinstance(named, Mapping):  # plain text each: the names reach KeysMatch's message
            out[key] = {one_line(str(k)[:100]): one_line(str(v)[:100])
                        for k, v in sorted(named.items(), key=lambda kv: str(kv[0]))[:FINGERPRINT_MAP_ITEMS]}
    if image:
        out["image"] = image[:300]
    return out


def _pythonpath(value: Any) -> str | None:
    """A reported imagePythonPath status can hold as it is: text of at most
    IMAGE_PYTHONPATH_LIMIT characters ("" is a value: the image sets none)."""
    if not isinstance(value, str) or len(value) > IMAGE_PYTHONPATH_LIMIT:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


MANIFEST_GENERATION = re.compile(r"[0-9]{1,20}")  # the CRD's pattern: a GCS generation (int64), in decimal
# The CRD's pattern for manifestObject: a GCS object name ending .json, with no "#" or ","
# (CACHEWARM_COPY_MANIFESTS' separators) and no control characters; at most 1024 bytes.
MANIFEST_OBJECT = re.compile(r"[^#,\x00-\x1f\x7f]{1,1019}\.json")


def manifest_generation(value: Any) -> str | None:
    """A reported manifestGeneration status can hold: a decimal string of 1 to 20 ASCII
    digits, as the CRD's pattern says (None otherwise). It is what the copier in every pod
    of the cache trusts (the manifest at that generation), so nothing else is copied."""
    return value if isinstance(value, str) and MANIFEST_GENERATION.fullmatch(value) else None


def pool_status(name: str, pool: Pool, digest: str, job: Mapping[str, Any] | None,
                summaries: Sequence[Mapping[str, Any]], pods: PodsView | None = None, *,
                env_sets_pythonpath: bool = False, manifest: str | None = None) -> dict[str, Any]:
    """One entry of status.warmup.pools. Only process 0 of a multi-host warmer writes cache
    entries, so entries and bytes are process 0's (each entry counted once); the compile
    time is the slowest host's; errors are every host's. `imagePythonPath` is process 0's
    PYTHONPATH, the image's own, unless `env_sets_pythonpath` (spec.warmup.env sets one,
    so the warmer saw that): then none is recorded. `manifest` is the object the Job's
    warmer writes its manifest at (job_manifest): a reported manifestGeneration is recorded
    only with it, as manifestObject."""
    state = _job_state(job) if job is not None else "Pending"
    jstatus = (job or {}).get("status") or {}
    out: dict[str, Any] = {"name": pool.name, "job": name, "specHash": digest, "state": state}
    if jstatus.get("startTime"):
        out["startTime"] = jstatus["startTime"]
    if jstatus.get("completionTime"):
        out["completionTime"] = jstatus["completionTime"]
    if pods is not None and pods.nodes:
        out["nodes"] = list(pods.nodes)
    if pods is not None and pods.unschedulable and state in ACTIVE_STATES:
        out["state"] = "Pending"
        out["reason"] = c.Reason.UNSCHEDULABLE
        out["message"] = f"Unschedulable: {pods.unschedulable}"[:1000]
    parsed = [parse_summary(s) for s in summaries]
    if parsed:
        out.update(_summary_status(parsed, job, pods, env_sets_pythonpath))
        generation = out.pop("manifestGeneration", None)
        if generation is not None and manifest is not None:
            out.update(manifestObject=manifest, manifestGeneration=generation)
        else:  # a pack is part of the manifest it is recorded with
            out = {k: v for k, v in out.items() if k not in PACK_FIELDS}
    errors = [e for one, _ in parsed for e in one.errors]
    if state == "Failed":
        out["lastError"] = "; ".join(errors)[:1000] or _job_failure(job or {}) or "warmer failed"
    return out


def _summary_status(parsed: Sequence[tuple[WarmerSummary, tuple[str, ...]]], job: Mapping[str, Any] | None,
                    pods: PodsView | None, env_sets_pythonpath: bool) -> dict[str, Any]:
    """The fields of a pool's status entry that the warmers' summaries give (pool_status)."""
    summaries = [one for one, _ in parsed]
    writers = [one for one in summaries if one.processIndex == 0] or summaries
    out: dict[str, Any] = {
        "entriesFound": max(w.entriesFound for w in writers),
        "entriesWritten": max(w.entriesWritten for w in writers),
        "bytesWritten": max(w.bytesWritten for w in writers),
        "compileSeconds": round(max(one.compileSeconds for one in summaries), 3),
    }
    # Process 0 alone refreshes customTime; a failure there does not fail the warm.
    failed = max(w.refreshFailed for w in writers)
    if failed:
        out["refreshFailed"] = failed
    refresh_error = next((w.refreshError for w in writers if w.refreshError), "")
    if refresh_error:
        out["refreshError"] = refresh_error[:1000]
    not_cached = max(w.notCached for w in writers)
    if not_cached:
        out["notCached"] = not_cached
    # The entries this warm relies on, by key hash (checked against the bucket).
    reported = next((w for w in writers if w.keys is not None), None)
    if reported is not None and reported.keys is not None:
        out["keys"] = sorted(set(reported.keys))[:MAX_KEYS]
        out["keyCount"] = reported.keyCount if reported.keyCount is not None else len(out["keys"])
    # Programs whose key changed with the same fingerprint: pods miss them however warm.
    out.update(_unstable_status(writers))
    # What the programs process 0 compiled took: pods' hits are measured against it.
    compiler = next((w for w in writers if w.compiledPrograms), None)
    if compiler is not None and compiler.compiledPrograms:
        out["compiledPrograms"] = [p.model_dump(exclude_none=True) for p in compiler.compiledPrograms]
        if compiler.compiledRest is not None:  # more than it could name: counted with a bound
            out["compiledRest"] = compiler.compiledRest.model_dump()
    # A torch warm's counters and archive (process 0's: the only one that uploads).
    torch = next((w.torch for w in writers if w.torch is not None), None)
    if torch is not None:
        out["torch"] = torch.model_dump()
    # The manifest process 0 wrote (D3): the generation pods' copiers read it at.
    generation = next((w.manifestGeneration for w in writers if w.manifestGeneration is not None), None)
    if generation is not None:
        out["manifestGeneration"] = generation
        out.update(_pack_status(writers))
    # What the keys were computed with (process 0's view), and the image by digest.
    found = next((w.fingerprint for w in writers if w.fingerprint), None)
    if found is not None:
        out["fingerprint"] = fingerprint_status(found, pods.image if pods is not None else "")
    # The PYTHONPATH the image sets, for the webhook (image_pythonpath).
    if not env_sets_pythonpath and not (pods is not None and pods.pythonpath_set):
        path = next((p for p in (_pythonpath(w.imagePythonPath) for w in writers) if p is not None), None)
        image = next((str(ct.get("image") or "") for ct in ((((job or {}).get("spec") or {}).get("template") or {})
                                                          .get("spec") or {}).get("containers") or []), "")
        if path is not None and image:
            # With the image the Job ran, as spec.warmup.image named it: what a pod's
            # image is compared with, so a value of an earlier warmup image is never
            # taken for the current one's.
            out["imagePythonPath"] = {"image": image[:1000], "value": path}
    dropped = sorted({name for _, bad in parsed for name in bad})
    if dropped:
        said = f"Ignored invalid fields of the warmer's summary: {', '.join(dropped)}"
        out["message"] = "; ".join(m for m in (said, out.get("message")) if m)[:1000]
    return out


PACK_FIELDS = ("packEntries", "packBytes", "packError")


def _pack_status(writers: Sequence[WarmerSummary]) -> dict[str, Any]:
    """The pack process 0 wrote beside its manifest (packEntries, packBytes), or why it
    wrote none (packError, printable, at most 300 characters; said in the pool's message
    too: pods then read each entry with a request of its own, every start)."""
    writer = next((w for w in writers if w.manifestGeneration is not None), None)
    if writer is None:
        return {}
    if writer.packError:
        error = re.sub(r"[^\x20-\x7e]", "?", writer.packError)[:300]
        return {"packError": error, "message": f"No pack written (pods read each entry on its own): {error}"}
    if writer.packEntries is not None and writer.packBytes is not None:
        return {"packEntries": writer.packEntries, "packBytes": writer.packBytes}
    return {}


def _unstable_status(writers: Sequence[WarmerSummary]) -> dict[str, Any]:
    """unstablePrograms of a pool's status entry, from process 0's summary: each
    {program, keys, seen}."""
    out: dict[str, Any] = {}
    unstable = next((w.unstablePrograms for w in writers if w.unstablePrograms), None)
    if unstable:
        out["unstablePrograms"] = [p.model_dump() for p in unstable]
    return out


def image_pythonpath(pools: Sequence[Mapping[str, Any]], image: str) -> str | None:
    """The PYTHONPATH `image` (the current spec.warmup.image) sets, from
    status.warmup.pools: the value every pool whose warmer ran that image reports in
    `imagePythonPath` agrees on ("" when the image sets none); other pools are left out.
    None when none reports one, or when they disagree."""
    seen = {str(p["imagePythonPath"]["value"]) for p in pools
            if isinstance(p.get("imagePythonPath"), Mapping) and p["imagePythonPath"].get("image") == image
            and isinstance(p["imagePythonPath"].get("value"), str)}
    return seen.pop() if len(seen) == 1 else None


@dataclass(frozen=True)
class ObservedJob:
    """A warmer Job of one pool, as far as the stop-before-start decision needs it."""

    name: str
    state: str
    deleting: bool
    generation: int
    # Controlled by another CompilationCache: a deleted cache of the same name whose Jobs
    # the garbage collector has yet to remove. Never ours to delete or to be superseded by.
    foreign: bool = False
    # Not the Job the operator made: controlled by no CompilationCache (no controller:
    # orphaned by a delete with cascade=orphan, or made by someone else under this cache's
    # warmer label), or of a uid other than the one status recorded for its name. Never
    # read: its results, generation and manifest are not the operator's.
    stray: bool = False
    uid: str = ""

    @property
    def unfinished(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def ours(self) -> bool:
        return not self.foreign and not self.stray


def _cache_controller(ref: Mapping[str, Any]) -> bool:
    return ref.get("kind") == c.KIND and str(ref.get("apiVersion") or "").startswith(f"{c.GROUP}/")


def observe(job: Mapping[str, Any], uid: str, pinned: str | None = None) -> ObservedJob:
    """The Job as plan_pool sees it; `uid` is the cache's. A Job is the cache's only when
    its controller ownerReference is this CompilationCache (by uid); only the operator may
    make such a Job (manifests/policy/warmer_jobs.yaml). One controlled by another
    CompilationCache is foreign; any other (no controller, or one of another kind) is a
    stray: anyone who may create Jobs in the namespace can make one, of any name, label
    and annotation. `pinned`: the uid status recorded for the Job of this name (the
    apiserver's answer to the operator's create); another uid is a stray too, which holds
    where the policy is not installed (a Job deleted and made again under the cache's name
    by someone else)."""
    meta = job.get("metadata") or {}
    try:
        generation = int((meta.get("annotations") or {}).get(c.GENERATION_ANNOTATION, 0))
    except ValueError:
        generation = 0
    controllers = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    caches = [r for r in controllers if _cache_controller(r)]
    foreign = bool(caches) and any(r.get("uid") != uid for r in caches)
    stray = not caches or (not foreign and bool(pinned) and meta.get("uid") != pinned)
    return ObservedJob(str(meta.get("name")), _job_state(job), bool(meta.get("deletionTimestamp")), generation,
                       foreign, stray, str(meta.get("uid") or ""))


@dataclass(frozen=True)
class PoolPlan:
    """What to do about one pool's Jobs. `superseded`: a Job from a newer generation of
    the spec exists, so this reconcile holds an older spec and touches nothing. `strays`:
    Jobs the cache does not own that are stopped (delete, like `delete`), for another
    reason: one that holds the desired name, whatever its state, and unfinished ones."""

    delete: tuple[str, ...] = ()
    create: bool = False
    waiting_for: tuple[str, ...] = ()
    superseded: bool = False
    strays: tuple[str, ...] = ()


def plan_pool(observed: Sequence[ObservedJob], desired: str | None, generation: int) -> PoolPlan:
    """Never two warmers for one pool: every other unfinished Job of the pool is deleted,
    and the desired Job (None: the pool has none, e.g. its shape is invalid) is created
    only once none remains, counting those already being deleted. Nothing is done when a
    Job of this cache from a newer generation exists. Foreign Jobs (another cache's) are
    left to their owner's garbage collection; only one holding the desired name delays the
    create. A stray holding the desired name is never taken for the cache's own (its pods'
    results would be read, and trusted): it is stopped, and the cache's Job created once
    it is gone; unfinished strays are stopped too (never two warmers), finished ones left."""
    ours = [j for j in observed if j.ours]
    if any(j.generation > generation for j in ours):
        return PoolPlan(superseded=True)
    others = [j for j in ours if j.name != desired and j.unfinished]
    strays = [j for j in observed if j.stray and (j.name == desired or j.unfinished)]
    current = next((j for j in observed if j.name == desired), None)
    waiting = [j.name for j in others + strays]
    if current is not None and (current.deleting or current.foreign) and current.name not in waiting:
        waiting.append(current.name)  # deleted by someone, or another cache's; re-created once it is gone
    return PoolPlan(
        delete=tuple(j.name for j in others if not j.deleting),
        create=desired is not None and current is None and not waiting,
        waiting_for=tuple(waiting),
        strays=tuple(j.name for j in strays if not j.deleting),
    )


def _pool_of(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(c.LABEL_POOL, ""))


def failed_at(job: Mapping[str, Any] | None) -> dt.datetime | None:
    """When the Job controller marked the Job Failed."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return timefmt.parse_or_none(cond.get("lastTransitionTime"))
    return None


def plan_retry(entry: Mapping[str, Any], attempt: int, failed: dt.datetime, retry: WarmRetry,
               now: dt.datetime) -> tuple[dict[str, Any], bool]:
    """A failed pool's status with its attempt and, while retries are left, when the next
    one runs; and whether it is due now."""
    out = {**entry, "attempt": attempt, "failedTime": timefmt.rfc3339(failed)}
    out.pop("nextRetryTime", None)
    if attempt > retry.retries:
        out["message"] = f"Failed {attempt} times; no retry is left (spec change or {c.REWARM_ANNOTATION} runs it again)"
        return out, False
    at = failed + retry.delay(attempt)
    out["nextRetryTime"] = timefmt.rfc3339(at)
    out["message"] = f"Attempt {attempt} of {retry.retries + 1} failed; retrying at {timefmt.rfc3339(at)}"
    return out, now >= at


def _retried(pool: str, job: str, attempt: int, retry: WarmRetry, prev: Mapping[str, Any]) -> Event:
    return Event("Normal", c.Reason.WARMER_RETRIED,
                 f"Pool {pool}: running warmer Job {job} again (attempt {attempt} of {retry.retries + 1}) after: "
                 f"{prev.get('lastError', 'a failure')}"[:1000])


def missing_entries(pools: Sequence[Mapping[str, Any]], entry_keys: frozenset[str]) -> dict[str, int]:
    """Per pool, how many entries its warmer reported are not in the bucket."""
    out = {}
    for pool in pools:
        missing = [k for k in pool.get("keys") or [] if k not in entry_keys]
        if missing:
            out[str(pool["name"])] = len(missing)
    return out


# Warmed reasons that come from the bucket's listing (every pool's warmer has finished).
BUCKET_VERDICTS = (c.Reason.WARMED, c.Reason.ENTRIES_MISSING, c.Reason.CACHE_EMPTY)


def warmed_condition(pools: Sequence[Mapping[str, Any]], cache_entries: int, warmed_before: bool = False,
            entry_keys: frozenset[str] | None = None) -> Cond:
    """Warmed once every pool succeeded and the entries their warmers reported (by key)
    are all in the bucket (`entry_keys`; a warmer too old to report keys: the bucket holds
    entries). A re-warm (Warmed was True before) of a bucket that still holds entries stays
    True, reason Rewarming, while its warmers run: the cache pods would read is usable, so
    they are not held. A first warm, and a re-warm that failed, are False."""
    invalid = [p for p in pools if p.get("reason") in (c.Reason.UNKNOWN_TPU_SHAPE, c.Reason.INVALID_TPU_SHAPE)]
    if invalid:
        detail = "; ".join(f"{p['name']}: {p.get('message', '')}" for p in invalid)
        return Cond(c.Condition.WARMED, False, str(invalid[0]["reason"]), f"Cannot warm pool {detail}"[:1000])
    failed = [p for p in pools if p.get("state") == "Failed"]
    if failed:
        detail = "; ".join(f"{p['name']}: {p.get('lastError', 'failed')}"
                           + (f" ({p['message']})" if p.get("attempt") and p.get("message") else "") for p in failed)
        return Cond(c.Condition.WARMED, False, c.Reason.WARMUP_FAILED, f"Warmer failed on {detail}"[:1000])
    waiting = [p for p in pools if p.get("state") != "Succeeded"]
    if waiting:
        detail = ", ".join(f"{p['name']} {p.get('state')}" + (f" ({p['message']})" if p.get("message") else "")
                           for p in waiting)
        if warmed_before and cache_entries > 0:
            return Cond(c.Condition.WARMED, True, c.Reason.REWARMING,
                        f"Re-warming: {detail}; the {cache_entries} entries already cached stay in use"[:1000])
        reason = c.Reason.UNSCHEDULABLE if any(p.get("reason") == c.Reason.UNSCHEDULABLE for p in waiting) \
            else c.Reason.WARMING
        return Cond(c.Condition.WARMED, False, reason, f"Warming: {detail}"[:1000])
    reporting = [p for p in pools if isinstance(p.get("keys"), list)]
    if entry_keys is not None and reporting:
        missing = missing_entries(reporting, entry_keys)
        if missing:
            detail = "; ".join(f"{pool}: {n} of {len(next(p for p in reporting if p['name'] == pool)['keys'])}"
                               for pool, n in sorted(missing.items()))
            return Cond(c.Condition.WARMED, False, c.Reason.ENTRIES_MISSING,
                        f"Entries the warmers reported are not in the bucket ({detail}): deleted since, or "
                        f"written elsewhere; set {c.REWARM_ANNOTATION} to warm again"[:1000])
    if cache_entries == 0 or (reporting and not any(p["keys"] for p in reporting)):
        return Cond(c.Condition.WARMED, False, c.Reason.CACHE_EMPTY,
                    "Every warmer succeeded but the bucket holds none of the entries they compiled under the prefix")
    relied = sum(len(p["keys"]) for p in reporting)
    message = (f"Every pool is warm: the {relied} entries its warmers reported are in the bucket "
               f"({cache_entries} entries in all)" if reporting else
               f"Every pool is warm; the cache holds {cache_entries} entries")
    not_cached = {str(p["name"]): int(p["notCached"]) for p in pools if p.get("notCached")}
    if not_cached:
        message += ("; not cached (below minCompileTimeSecs or minEntrySizeBytes, so pods compile them): "
                    + ", ".join(f"{n} programs of {pool}" for pool, n in sorted(not_cached.items())))
    return Cond(c.Condition.WARMED, True, c.Reason.WARMED, message[:1000])




def services_to_delete(services: Sequence[Mapping[str, Any]], keep: set[str], untouchable: set[str]) -> list[str]:
    """The pool Services no warmer needs any more: all but those in `keep` and those of a
    pool superseded by a newer spec (`untouchable`: left to the reconcile that holds it)."""
    return [str(s["metadata"]["name"]) for s in services
            if _pool_of(s) not in untouchable and str(s["metadata"]["name"]) not in keep]


# --- One reconcile's plan ------------------------------------------------------------


@dataclass(frozen=True)
class WarmContext:
    """What a plan is for besides the cluster: the cache (its spec, where it is, the
    generation this reconcile holds), its previous status.warmup.pools, `now`, and what
    Warmed is judged by."""

    cache: CacheSpec
    namespace: str
    name: str
    uid: str
    now: dt.datetime
    warmer_image: str
    generation: int = 0
    annotations: Mapping[str, str] = field(default_factory=dict)
    previous: Sequence[Mapping[str, Any]] = ()
    retry: WarmRetry = WarmRetry()
    cache_entries: int = 0  # entries the bucket holds under the prefix
    warmed_before: bool = False  # Warmed was True at the previous reconcile (a re-warm)
    entry_keys: frozenset[str] | None = None  # the bucket's entries by key (None: not listed)

    @property
    def warmup(self) -> Warmup:
        assert self.cache.warmup is not None, "a warm-up plan needs spec.warmup"
        return self.cache.warmup

    def previous_of(self, pool: str) -> Mapping[str, Any]:
        return next((p for p in reversed(self.previous) if p.get("name") == pool), {})


@dataclass(frozen=True)
class WarmView:
    """The cache's warmer objects as reconcile.warmup listed them, with no decision in it:
    its Jobs and pool Services (label warmer-for), and by Job name the pods of each Job
    whose results the plan reads (results_to_read)."""

    jobs: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    pods: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class DeleteJob:
    """Delete a warmer Job, foreground: it stays listed (deleting) until its pods are gone.
    `uid`: only while the Job of that name is still the one of this uid ("": any)."""

    name: str
    uid: str = ""


@dataclass(frozen=True)
class DeleteService:
    name: str


@dataclass(frozen=True)
class Create:
    """Create an object. `said` is posted only when the apiserver created it: one that
    answers it exists already (a restart between create and status) says nothing new."""

    body: dict[str, Any]
    said: Event | None = None


# A plan's steps, in order: the writes, and the Events said between them.
Step = DeleteJob | DeleteService | Create | Event


@dataclass(frozen=True)
class WarmPlan:
    """What one reconcile of a cache's warmers does (`steps`, in order) and what it then
    says: status.warmup.pools and the Warmed condition."""

    steps: tuple[Step, ...]
    pools: list[dict[str, Any]]
    condition: Cond


@dataclass(frozen=True)
class Aim:
    """One pool of the spec before any decision on what to write: the Job its current
    program runs in (`job`, "" when its TPU shape is invalid), that Job as listed
    (`current`), the stop-before-start plan over the pool's Jobs, and which run of the
    program this is (`attempt`: 1, then one more per retry after a failure)."""

    pool: Pool
    prev: Mapping[str, Any]  # the pool's previous status entry ({} when none)
    seen: tuple[ObservedJob, ...]
    stop: PoolPlan
    digest: str = ""
    job: str = ""
    hosts: int = 1
    shape_error: TpuShapeError | None = None
    current: Mapping[str, Any] | None = None
    attempt: int = 1

    def recorded(self, state: str) -> bool:
        """Status holds this Job's results already (it finished, and was read then)."""
        return state not in ACTIVE_STATES and self.prev.get("job") == self.job and self.prev.get("state") == state

    @property
    def reads(self) -> bool:
        """The plan reads the current Job's pods: it exists, the pool is this reconcile's
        to act on, and its results are not in status yet."""
        return (self.current is not None and not self.stop.superseded and not self.stop.waiting_for
                and not self.recorded(_job_state(self.current)))


@dataclass(frozen=True)
class PoolDecision:
    """One pool's part of a plan: its steps, its status entry (None: a pool no longer in
    the spec has none), whether its Service stays (a warmer uses it, or may still), and
    the hash of its current program (None: it has no valid one)."""

    pool: str
    steps: tuple[Step, ...] = ()
    entry: dict[str, Any] | None = None
    keep_service: bool = False
    untouchable: bool = False  # superseded by a newer spec: its Service is left alone too
    digest: str | None = None


def jobs_by_pool(listed: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The Jobs by their pool label, in the order listed."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for job in listed:
        out.setdefault(_pool_of(job), []).append(job)
    return out


def aim(ctx: WarmContext, pool: Pool, listed: Sequence[Mapping[str, Any]]) -> Aim:
    """Where `pool` stands, from its listed Jobs and previous status."""
    prev = ctx.previous_of(pool.name)
    pinned = {str(prev["job"]): str(prev["jobUid"])} if prev.get("job") and prev.get("jobUid") else {}
    seen = tuple(observe(j, ctx.uid, pinned.get(j["metadata"]["name"])) for j in listed)
    try:
        digest = jobs.spec_hash(ctx.cache, pool, rewarm_token(ctx.cache, ctx.annotations, ctx.now))
        hosts = pool_shape(pool).hosts
    except TpuShapeError as exc:
        return Aim(pool, prev, seen, plan_pool(seen, None, ctx.generation), shape_error=exc)
    name = jobs.job_name(ctx.name, pool, digest)
    # Only a Job the cache controls is ever the pool's current one (read, recorded, retried).
    current = next((j for j, o in zip(listed, seen) if o.name == name and o.ours), None)
    attempt = int(prev.get("attempt") or 1) if prev.get("specHash") == digest else 1
    return Aim(pool, prev, seen, plan_pool(seen, name, ctx.generation), digest, name, hosts, None, current, attempt)


def results_to_read(ctx: WarmContext, listed: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Jobs whose pods the plan needs (their summaries, nodes, scheduling): each
    pool's current Job unless the pool waits, is superseded, or status holds its results."""
    by_pool = jobs_by_pool(listed)
    aims = [aim(ctx, pool, by_pool.get(pool.name, [])) for pool in ctx.warmup.pools]
    return [a.job for a in aims if a.reads]


def plan_warmup(ctx: WarmContext, view: WarmView) -> WarmPlan:
    """Each pool's warmer for the current program, one Job at a time per pool; multi-host
    pools' Services while (and only while) a warmer needs them; the warmers of pools that
    left the spec stopped. `view.pods` must hold the pods of every Job results_to_read
    names (KeyError otherwise)."""
    by_pool = jobs_by_pool(view.jobs)
    decided = [decide_pool(ctx, aim(ctx, pool, by_pool.get(pool.name, [])), view.pods) for pool in ctx.warmup.pools]
    in_spec = {p.name for p in ctx.warmup.pools}
    decided += [_removed(ctx, pool, listed) for pool, listed in by_pool.items() if pool not in in_spec]
    keep = {jobs.service_name(ctx.name, d.pool) for d in decided if d.keep_service}
    untouchable = {d.pool for d in decided if d.untouchable}
    steps = [s for d in decided for s in d.steps]
    steps += [DeleteService(s) for s in services_to_delete(view.services, keep, untouchable)]
    pools = [d.entry for d in decided if d.entry is not None]
    for entry in pools:
        name = str(entry.get("name"))
        _keep_manifest(entry, ctx.previous_of(name),
                       legacy_manifest_object(ctx.cache.storage.gcs, ctx.namespace, ctx.name, name))
        _keep_compiled(entry, ctx.previous_of(name))
    slot = scheduled_slot(ctx.cache, ctx.now)
    if slot is not None:
        # The slot each pool's current warmer is for (the slot is part of its hash), so the
        # Job's creationTimestamp can be compared with the slot it was due at.
        digests = {d.pool: d.digest for d in decided if d.digest is not None}
        for entry in pools:
            if entry.get("specHash") is not None and entry.get("specHash") == digests.get(str(entry.get("name"))):
                entry["scheduledTime"] = timefmt.rfc3339(slot)
    return WarmPlan(tuple(steps), pools, warmed_condition(pools, ctx.cache_entries, ctx.warmed_before, ctx.entry_keys))


def _keep_manifest(entry: dict[str, Any], prev: Mapping[str, Any], legacy: str) -> None:
    """A pool's manifestObject and manifestGeneration stay, together, the last ones its own
    warmer reported until a later warmer of the pool reports others: pods keep their copy
    while it re-warms (each Job writes its own object, so the one at that generation stays
    in the bucket). A generation recorded before manifestObject existed was one of the
    pool's single manifest, rewritten in place (`legacy`): it is kept with that name."""
    kept = manifest_generation(prev.get("manifestGeneration"))
    kept_object = prev.get("manifestObject", legacy if kept is not None else None)
    if kept is not None and isinstance(kept_object, str) and "manifestGeneration" not in entry:
        entry["manifestObject"] = kept_object
        entry["manifestGeneration"] = kept
        entry.update({k: prev[k] for k in PACK_FIELDS if k in prev})  # the kept manifest's pack


def _keep_compiled(entry: dict[str, Any], prev: Mapping[str, Any]) -> None:
    """A pool's compiledPrograms stay through its re-warms: a warm that found its programs
    in the cache compiles none, and what they took is still what a pod that hits them
    saves. Kept from the previous entry: all of them while the pool's next warm runs or
    after it failed (a failed warm's keys say nothing of the entries that were there),
    those whose entry a succeeded warm relied on (its `keys`: the same key is the same
    program, versions, devices and flags), behind the ones it reports itself; none when
    the new warm reports programs of another fingerprint; at most MAX_COMPILED, the
    slowest. None when a succeeded warm cannot name its entries. compiledFingerprint names
    the fingerprint the kept programs were compiled with (the pool's own fingerprint is
    the running or failed warm's, or absent)."""
    before = [p for p in prev.get("compiledPrograms") or [] if isinstance(p, Mapping)]
    if not before or prev is entry:
        return
    kept_fp = compiled_fingerprint(prev)
    own = [p for p in entry.get("compiledPrograms") or [] if isinstance(p, Mapping)]
    own_fp = entry.get("fingerprint") if own and isinstance(entry.get("fingerprint"), Mapping) else None
    if own and (own_fp is None or kept_fp is None or differences(own_fp, kept_fp)):
        before = []  # compiled with other versions, devices or flags (or not known with what)
    if entry.get("state") == "Succeeded":
        relied = set(entry.get("keys") or [])
        before = [p for p in before if p.get("key") in relied]
    seen = {p.get("key") or f"{p.get('program')}-" for p in own}
    kept = own + [dict(p) for p in before if (p.get("key") or f"{p.get('program')}-") not in seen]
    kept.sort(key=lambda p: -float(p.get("compileSeconds") or 0.0))
    fp = own_fp if own else kept_fp
    if kept and before and fp:
        entry["compiledPrograms"] = kept[:MAX_COMPILED]
        entry["compiledFingerprint"] = dict(fp)
        rest = _kept_rest(entry.get("compiledRest"), prev.get("compiledRest"), kept[MAX_COMPILED:])
        if rest:
            entry["compiledRest"] = rest


def _kept_rest(own: Any, prev: Any, cut: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """compiledRest of a pool entry that keeps earlier programs: at least as many as its own
    warm's, the earlier entry's, or those cut here (the largest: the same entry is kept again
    at each reconcile, so nothing is added up), each at most the longest any of them took."""
    rests = [r for r in (own, prev) if isinstance(r, Mapping) and isinstance(r.get("programs"), int)]
    programs = max([len(cut), *(int(r["programs"]) for r in rests)])
    longest = max([0.0, *(float(p.get("compileSeconds") or 0.0) for p in cut),
                   *(float(r.get("maxSeconds") or 0.0) for r in rests)])
    return {"programs": programs, "maxSeconds": round(longest, 3)} if programs > 0 else {}


def compiled_fingerprint(pool: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The fingerprint a pool entry's compiledPrograms were compiled with: its
    compiledFingerprint when they were kept from an earlier warm, else its own fingerprint
    when its warm succeeded (None: not known)."""
    fp = pool.get("compiledFingerprint")
    if not (isinstance(fp, Mapping) and fp):
        fp = pool.get("fingerprint") if pool.get("state") == "Succeeded" else None
    return fp if isinstance(fp, Mapping) and fp else None


def job_manifest(ctx: WarmContext, pool: str, job: Mapping[str, Any]) -> str | None:
    """The object the warmer Job `job` (as read from the cluster) writes its manifest at:
    its container's CACHEWARM_MANIFEST, if that is one of the names this cache's warmers of
    `pool` write in its bucket (None otherwise: nothing is then recorded for it)."""
    template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    prefix = f"gs://{ctx.cache.storage.gcs.bucket}/"
    for container in template.get("containers") or []:
        for env in container.get("env") or []:
            value = env.get("value") if env.get("name") == c.ENV_MANIFEST else None
            if isinstance(value, str) and value.startswith(prefix) and is_pool_manifest(
                    value[len(prefix):], ctx.cache.storage.gcs, ctx.namespace, ctx.name, pool):
                return value[len(prefix):]
    return None


def decide_pool(ctx: WarmContext, a: Aim, pods: Mapping[str, Sequence[Mapping[str, Any]]]) -> PoolDecision:
    """What to do about one pool of the spec, from where it stands."""
    if a.shape_error is not None:
        return _invalid_shape(a, a.shape_error)
    if a.stop.superseded:
        return _superseded(a, a.digest)
    strays = {o.name for o in a.seen if o.stray}
    if a.current is None and set(a.stop.waiting_for) <= strays and a.prev.get("specHash") == a.digest \
            and a.prev.get("state") in ("Succeeded", "Failed"):
        # Finished earlier; its Job may be gone (TTL), and a stray may hold its name since:
        # the stray is stopped, the recorded results stay. A failure may be due a retry.
        earlier, due = _finished(ctx, a, timefmt.parse_or_none(a.prev.get("failedTime")))
        if not due:
            return PoolDecision(a.pool.name, tuple(_stop_all(a.stop, "the program changed", a.seen)), entry=earlier,
                                digest=a.digest)
        if not a.stop.waiting_for:
            retried = _retried(a.pool.name, a.job, a.attempt + 1, ctx.retry, a.prev)
            if a.prev.get("jobUid"):
                return _unpin(a, a.attempt + 1, retried)
            return _create(ctx, a, a.attempt + 1, retried)
    if a.stop.waiting_for:
        return _wait(a)
    if a.stop.create:
        if a.prev.get("job") == a.job and a.prev.get("jobUid"):
            return _unpin(a, a.attempt)
        return _create(ctx, a, a.attempt)
    assert a.current is not None
    state = _job_state(a.current)
    if a.recorded(state):
        return _recorded(ctx, a, a.current)
    return _results(ctx, a, a.current, state, pods[a.job])


def _stop(names: Sequence[str], why: str) -> list[Step]:
    return [step for old in names
            for step in (DeleteJob(old), Event("Normal", c.Reason.WARMER_STOPPED, f"Stopped warmer Job {old}: {why}"))]


def _stop_all(stop: PoolPlan, why: str, seen: Sequence[ObservedJob] = ()) -> list[Step]:
    """The pool's stale Jobs stopped for `why`, and the strays (Jobs under the cache's
    warmer label that are not the one the operator made) stopped for theirs, each said as a
    Warning, and deleted only if still the Job of the uid listed (a precondition)."""
    uids = {o.name: o.uid for o in seen}
    strays = [step for name in stop.strays for step in (
        DeleteJob(name, uids.get(name, "")),
        Event("Warning", c.Reason.WARMER_JOB_NOT_OURS,
              f"Stopped Job {name}: it is labelled as a warmer of this cache, but it is not the Job the operator "
              "made for it (the cache is not its controller, or its uid is not the one status recorded); its pods' "
              "results are never read"))]
    return _stop(stop.delete, why) + strays


def _superseded(a: Aim, digest: str | None) -> PoolDecision:
    """A newer spec's Job exists: this reconcile keeps the pool's previous entry."""
    pending = {"name": a.pool.name, **({"job": a.job} if a.job else {}), "state": "Pending"}
    return PoolDecision(a.pool.name, entry=dict(a.prev) if a.prev else pending, untouchable=True, digest=digest)


def _invalid_shape(a: Aim, exc: TpuShapeError) -> PoolDecision:
    """No Job can run (it could only ever be Pending): older warmers stop, the pool is
    Failed with the shape's reason, said once."""
    if a.stop.superseded:
        return _superseded(a, None)
    steps = _stop_all(a.stop, "the pool's TPU shape is invalid", a.seen)
    invalid = {"name": a.pool.name, "state": "Failed", "reason": exc.reason, "message": str(exc),
               "lastError": str(exc)}
    if a.prev.get("message") != invalid["message"]:
        steps.append(Event("Warning", exc.reason, f"Pool {a.pool.name}: {exc}"))
    # The stopping warmers may still use the Service.
    return PoolDecision(a.pool.name, tuple(steps), invalid, keep_service=bool(a.stop.waiting_for))


def _removed(ctx: WarmContext, pool: str, listed: Sequence[Mapping[str, Any]]) -> PoolDecision:
    """A pool that left the spec: its warmers stop, and nothing replaces them."""
    seen = [observe(j, ctx.uid) for j in listed]
    stop = plan_pool(seen, None, ctx.generation)
    if stop.superseded:
        return PoolDecision(pool, untouchable=True)
    return PoolDecision(pool, tuple(_stop_all(stop, f"pool {pool} was removed from the spec", seen)))


def _wait(a: Aim) -> PoolDecision:
    """Older warmers stop (or are stopping) first; the new one is created once they are gone."""
    entry = {"name": a.pool.name, "job": a.job, "specHash": a.digest, "state": "Pending", "attempt": a.attempt,
             **({"lastError": a.prev["lastError"]} if a.attempt > 1 and a.prev.get("lastError") else {}),
             "message": f"Waiting for warmer Job {', '.join(a.stop.waiting_for)} to stop"}
    keep = a.hosts > 1 or any(o.unfinished for o in a.seen)  # the stopping warmers may still use it
    if a.prev.get("job") == a.job and a.prev.get("jobUid"):
        entry["jobUid"] = a.prev["jobUid"]  # the Job being waited for may be a stray of its name
    return PoolDecision(a.pool.name, tuple(_stop_all(a.stop, "the program changed", a.seen)), entry, keep,
                        digest=a.digest)


def _unpin(a: Aim, attempt: int, retried: Event | None = None) -> PoolDecision:
    """The Job of the pool's name is made again (a retry after its Job expired, or one
    deleted): status first forgets the old Job's uid, and the Job is created at the next
    reconcile. Else a status write lost after the create would leave the old uid pinned,
    and the operator's own new Job would be taken for a stray."""
    entry = {"name": a.pool.name, "job": a.job, "specHash": a.digest, "state": "Pending", "attempt": attempt,
             **({"lastError": a.prev["lastError"]} if attempt > 1 and a.prev.get("lastError") else {}),
             "message": f"Creating warmer Job {a.job} again"}
    return PoolDecision(a.pool.name, (retried,) if retried is not None else (), entry, keep_service=a.hosts > 1,
                        digest=a.digest)


def _create(ctx: WarmContext, a: Aim, attempt: int, retried: Event | None = None) -> PoolDecision:
    """The pool's warmer Job (after its Service, on more than one host)."""
    steps: list[Step] = [retried] if retried is not None else []
    owner = {"name": ctx.name, "uid": ctx.uid}
    if a.hosts > 1:
        steps.append(Create(jobs.headless_service(ctx.name, ctx.namespace, a.pool, owner)))
    body = jobs.warmer_job(ctx.cache, cache_name=ctx.name, namespace=ctx.namespace, pool=a.pool, digest=a.digest,
                           owner=owner, warmer_image=ctx.warmer_image, generation=ctx.generation)
    steps.append(Create(body, Event("Normal", c.Reason.WARMER_CREATED,
                                    f"Created warmer Job {a.job} for pool {a.pool.name}")))
    entry = {"name": a.pool.name, "job": a.job, "specHash": a.digest, "state": "Pending", "attempt": attempt}
    return PoolDecision(a.pool.name, tuple(steps), entry, keep_service=a.hosts > 1, digest=a.digest)


def _finished(ctx: WarmContext, a: Aim, failed: dt.datetime | None) -> tuple[dict[str, Any], bool]:
    """A finished pool's entry as status holds it; after a failure, with its retry timing,
    and whether that retry is due now."""
    if a.prev.get("state") != "Failed":
        return dict(a.prev), False
    return plan_retry(a.prev, a.attempt, failed or ctx.now, ctx.retry, ctx.now)


def _recorded(ctx: WarmContext, a: Aim, current: Mapping[str, Any]) -> PoolDecision:
    """Finished and already read: no need to list its pods again. A failure due a retry
    is stopped first (foreground): the same Job name runs again once it is gone."""
    entry, due = _finished(ctx, a, failed_at(current))
    if not due:
        return PoolDecision(a.pool.name, entry=entry, digest=a.digest)
    again = {"name": a.pool.name, "job": a.job, "specHash": a.digest, "state": "Pending", "attempt": a.attempt + 1,
             "lastError": a.prev.get("lastError", ""), "message": f"Retrying after attempt {a.attempt} failed"}
    uid = str((current.get("metadata") or {}).get("uid") or "")
    retried = _retried(a.pool.name, a.job, a.attempt + 1, ctx.retry, a.prev)
    return PoolDecision(a.pool.name, (DeleteJob(a.job, uid), retried),
                        again, digest=a.digest)


def _results(ctx: WarmContext, a: Aim, current: Mapping[str, Any], state: str,
             pods: Sequence[Mapping[str, Any]]) -> PoolDecision:
    """The current Job's state, and once it finished, its warmers' summaries."""
    owned, others = owned_pods(current, pods)
    summaries = read_summaries(owned) if state not in ACTIVE_STATES else []
    status = pool_status(a.job, a.pool, a.digest, current, summaries, read_pods(owned),
                         env_sets_pythonpath=any(e.name == "PYTHONPATH" for e in ctx.warmup.env),
                         manifest=job_manifest(ctx, a.pool.name, current))
    status["attempt"] = a.attempt
    if (current.get("metadata") or {}).get("uid"):
        status["jobUid"] = str(current["metadata"]["uid"])
    if state == "Failed":
        status, _ = plan_retry(status, a.attempt, failed_at(current) or ctx.now, ctx.retry, ctx.now)
    said = _said(a, state, status)
    if others and state not in ACTIVE_STATES:
        # Said once: a finished Job's pods are read by this one reconcile (then recorded).
        names = ", ".join(sorted(str((p.get("metadata") or {}).get("name") or "?") for p in others)[:5])
        said.append(Event("Warning", c.Reason.WARMER_POD_IGNORED,
                          f"Ignored {len(others)} pod(s) labelled job-name={a.job} that warmer Job {a.job} did not "
                          f"create ({names}): a warmer's results are read only from the Job's own pods"[:1000]))
    return PoolDecision(a.pool.name, tuple(said), status,
                        keep_service=state in ACTIVE_STATES and a.hosts > 1, digest=a.digest)


def _said(a: Aim, state: str, status: Mapping[str, Any]) -> list[Event]:
    """What a change of the pool's state says (once: not again for the same state)."""
    out = []
    if status.get("reason") == c.Reason.UNSCHEDULABLE and status.get("message") != a.prev.get("message"):
        out.append(Event("Warning", c.Reason.UNSCHEDULABLE,
                         f"Warmer Job {a.job} cannot be scheduled: {status['message']}"[:1000]))
    if state == a.prev.get("state") and a.digest == a.prev.get("specHash"):
        return out
    if state == "Succeeded":
        out.append(Event("Normal", c.Reason.WARMER_SUCCEEDED,
                         f"Warmer Job {a.job} finished: {status.get('entriesWritten', 0)} entries written, "
                         f"{status.get('entriesFound', 0)} already cached"))
    elif state == "Failed":
        out.append(Event("Warning", c.Reason.WARMER_FAILED, f"Warmer Job {a.job} failed: {status['lastError']}"))
    if status.get("refreshError"):
        out.append(Event("Warning", c.Reason.LAST_USE_NOT_REFRESHED,
                         f"Warmer Job {a.job} could not refresh entries' customTime: "
                         f"{status['refreshError']}"[:1000]))
    return out
