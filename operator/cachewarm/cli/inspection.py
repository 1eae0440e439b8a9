"""`cachewarm inspect`: what a cache holds, program by program.

Pure: the caller lists the bucket (GcsClient) and reads the cache (KubeClient); this
module groups the entries by program, matches them to the warmer pools that reported
their keys (with the fingerprint those were computed with) and to the training pods that
reported hitting them (status.usage.recentHits, from the pods' reporters, within the
operator's report window), and renders a table or JSON; then the programs those pods still
compiled, each with its cause (status.usage.missedPrograms). A torch cache's one entry per
warm is its Inductor archive (`torch-inductor-<sha256>-cache`, shown as the program
torch-inductor), and its pods' use is torch's own counters (status.usage.torch).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachewarm.api import timefmt
from cachewarm.builders.bucket import ENTRY_NAME
from cachewarm.clients.gcs import ObjectInfo

KEY_HASH_CHARS = 16  # how warmers name entries in their summaries (warmer.key_hash)
URL = re.compile(r"^gs://(?P<bucket>[a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(?:/(?P<prefix>.*?))?/?$")


class InspectError(Exception):
    """What to inspect cannot be found or read; the message says why."""


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, object-name prefix) of gs://bucket[/prefix]. Raises InspectError."""
    found = URL.match(url)
    if found is None:
        raise InspectError(f"not a gs://BUCKET[/PREFIX] URL: {url!r}")
    prefix = (found.group("prefix") or "").strip("/")
    return found.group("bucket"), f"{prefix}/" if prefix else ""


@dataclass
class Entry:
    key: str  # the hash in the entry's name, 64 hex digits
    size: int
    written: dt.datetime | None
    last_used: dt.datetime | None  # customTime: refreshed by warmers, the lifecycle's clock
    pools: list[str] = field(default_factory=list)  # warmer pools that reported relying on it
    hit_by: list[str] = field(default_factory=list)  # training pods that reported a hit (some of them)
    hit_pods: int = 0  # how many pods reported a hit


@dataclass
class Program:
    name: str  # JAX's module name, e.g. jit_train_step
    entries: list[Entry] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def written(self) -> dt.datetime | None:
        return max((e.written for e in self.entries if e.written), default=None)

    @property
    def last_used(self) -> dt.datetime | None:
        return max((e.last_used for e in self.entries if e.last_used), default=None)

    @property
    def pools(self) -> list[str]:
        return sorted({p for e in self.entries for p in e.pools})

    @property
    def hit_by(self) -> list[str]:
        return sorted({p for e in self.entries for p in e.hit_by})


def programs(objects: Iterable[ObjectInfo], object_prefix: str,
             pools: Sequence[Mapping[str, Any]] = (), hits: Sequence[Mapping[str, Any]] = ()) -> list[Program]:
    """The JAX cache entries (`<program>-<sha256>-cache`) directly under `object_prefix`,
    grouped by program (sorted by name, newest entry first); each entry names the pools
    of `pools` (status.warmup.pools) whose warmer reported its key, and the pods of `hits`
    (status.usage.recentHits) that reported hitting it. Other objects are not entries and
    are left out."""
    hit_by = {str(h.get("key") or "").rsplit("-", 1)[-1]: h for h in hits}
    reported: dict[str, list[str]] = {}
    for pool in pools:
        for key in pool.get("keys") or []:
            reported.setdefault(str(key), []).append(str(pool.get("name")))
    grouped: dict[str, Program] = {}
    for obj in objects:
        rest = obj.name[len(object_prefix):] if obj.name.startswith(object_prefix) else None
        if rest is None or not rest.endswith("-cache") or ENTRY_NAME.match(rest) is None:
            continue
        program, key = rest.removesuffix("-cache").rsplit("-", 1)
        hit = hit_by.get(key) or {}
        grouped.setdefault(program, Program(program)).entries.append(
            Entry(key, obj.size, obj.created, obj.custom_time, sorted(reported.get(key[:KEY_HASH_CHARS], [])),
                  sorted(str(p) for p in hit.get("pods") or []), int(hit.get("podCount") or 0)))
    for prog in grouped.values():
        prog.entries.sort(key=lambda e: e.written or dt.datetime.min.replace(tzinfo=dt.timezone.utc), reverse=True)
    return [grouped[name] for name in sorted(grouped)]


def _iso(when: dt.datetime | None) -> str | None:
    return timefmt.rfc3339(when) if when else None


def _missed_rows(missed: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """status.usage.missedPrograms as a script reads it (fields of another shape left out)."""
    return [{name: one.get(name) for name in ("program", "cause", "pods", "misses", "compileSeconds", "message")}
            for one in missed if isinstance(one, Mapping)]


HIT_FIELDS = ("program", "hits", "loadSeconds", "compileSeconds", "compileSecondsFrom", "secondsSaved")


def _saved(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """status.usage's measured seconds saved (absent: not known) and the programs hit, each
    with its load seconds against the compile seconds it is measured against and where those
    come from (Pods: pods that compiled it in the window; Warmer: the cache's warmer)."""
    usage = usage if isinstance(usage, Mapping) else {}
    hit = [{name: one.get(name) for name in HIT_FIELDS} for one in usage.get("hitPrograms") or []
           if isinstance(one, Mapping)]
    return {"measuredSecondsSaved": usage.get("measuredSecondsSaved"), "hitPrograms": hit}


def as_json(url: str, progs: Sequence[Program], pools: Sequence[Mapping[str, Any]] = (),
            missed: Sequence[Mapping[str, Any]] = (), usage: Mapping[str, Any] | None = None) -> str:
    """The report for scripts: every entry, each pool's fingerprint and the compile seconds
    its warmer measured, the programs pods still compiled with their causes, and the seconds
    the pods' hits saved."""
    return json.dumps({
        "url": url,
        "programs": [{"name": p.name, "entries": len(p.entries), "bytes": p.size, "written": _iso(p.written),
                      "lastUsed": _iso(p.last_used), "pools": p.pools, "hitBy": p.hit_by,
                      "keys": [{"key": e.key, "bytes": e.size, "written": _iso(e.written), "lastUsed": _iso(e.last_used),
                                "pools": e.pools, "hitBy": e.hit_by, "hitPods": e.hit_pods}
                               for e in p.entries]} for p in progs],
        "pools": [{"name": pool.get("name"), "state": pool.get("state"), "job": pool.get("job"),
                   "fingerprint": pool.get("fingerprint") or {},
                   "compiledPrograms": list(pool.get("compiledPrograms") or []),
                   **({"torch": dict(pool["torch"])} if isinstance(pool.get("torch"), Mapping) else {})}
                  for pool in pools],
        "missedPrograms": _missed_rows(missed),
        **_saved(usage),
        **({"torch": torch} if (torch := _torch(usage)) is not None else {}),
    }, indent=2)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def describe(fingerprint: Mapping[str, Any]) -> str:
    """A fingerprint in a few words: jax 0.10.2, tpu TPU v5p x8 (2 processes), flags abc123;
    or torch's: torch 2.15.0, triton 3.9.0, cpu cpu, Inductor config abc123, torch key
    0123, env TORCHINDUCTOR_X=1."""
    if not fingerprint:
        return "-"
    if fingerprint.get("framework") == "torch":
        return _describe_torch(fingerprint)
    devices = f"{fingerprint.get('platform', '?')} {fingerprint.get('deviceKind', '')} x{fingerprint.get('devices', '?')}"
    processes = f" ({fingerprint['processes']} processes)" if int(fingerprint.get("processes") or 1) > 1 else ""
    return f"jax {fingerprint.get('jax', '?')}, {' '.join(devices.split())}{processes}, flags {fingerprint.get('flagsHash', '?')}"


def _describe_torch(fingerprint: Mapping[str, Any]) -> str:
    found = fingerprint.get("versions")
    versions: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    words = [f"{name} {versions[name]}" for name in ("torch", "triton") if name in versions]
    words.append(" ".join(str(fingerprint.get(k)) for k in ("platform", "platformVersion", "deviceKind")
                          if fingerprint.get(k)) or "?")
    words += [f"Inductor config {fingerprint.get('inductorConfigHash', '?')}",
              f"torch key {fingerprint.get('torchKey', '?')}"]
    for key, said in (("inductorEnv", "env"), ("inductorChanged", "set in code")):
        named = fingerprint.get(key)
        if isinstance(named, Mapping) and named:
            words.append(f"{said} " + " ".join(f"{k}={v}" for k, v in sorted(named.items())))
    return ", ".join(words)


TORCH_FIELDS = ("pods", "fxGraphHits", "fxGraphHitsNotSaved", "fxGraphMisses", "aotAutogradHits",
                "aotAutogradHitsNotSaved", "aotAutogradMisses", "compileSeconds", "warmerCompileSeconds",
                "measuredCompileSeconds", "secondsSaved", "hitButNotSaved")


def _torch(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """status.usage.torch, its known fields (None: not a torch cache, or no pod reported)."""
    found = (usage or {}).get("torch")
    return {name: found.get(name) for name in TORCH_FIELDS} if isinstance(found, Mapping) else None


def _torch_lines(pools: Sequence[Mapping[str, Any]], usage: Mapping[str, Any] | None) -> list[str]:
    """A torch cache's warms (each pool's counters, compile seconds and the archive it
    uploaded) and what its pods' counters said in the window, with the seconds saved."""
    lines = []
    warms = [(pool, pool["torch"]) for pool in pools if isinstance(pool.get("torch"), Mapping)]
    if warms:
        lines += ["", "POOL  FX GRAPH HITS/MISSES  AOTAUTOGRAD HITS/MISSES  COMPILE S  ARCHIVE"]
        for pool, warm in warms:
            # An uncounted warm (a child entrypoint: torch's counters and seconds not seen) says so,
            # rather than the 0 its summary holds.
            counted = warm.get("counted") is not False
            hits = (f"{warm.get('fxGraphHits')}/{warm.get('fxGraphMisses')}  "
                    f"{warm.get('aotAutogradHits')}/{warm.get('aotAutogradMisses')}") if counted else "-  -"
            seconds = warm.get("compileSeconds") if counted else "-"
            lines.append(f"{pool.get('name')}  {hits}  {seconds}  {warm.get('files')} files, "
                         f"{_size(int(warm.get('archiveBytes') or 0))}" + ("" if counted else
                         " (not counted: the warm ran its command as a child, torch's counters not seen)"))
    used = _torch(usage)
    if used is not None:
        lines += ["", "TORCH IN PODS (WINDOW)",
                  f"Pods: {used['pods']}; FX graph hits {used['fxGraphHits']}, misses {used['fxGraphMisses']}; "
                  f"AOTAutograd hits {used['aotAutogradHits']}, misses {used['aotAutogradMisses']}",
                  f"Compile seconds: {used['compileSeconds']} in all the pods; the pods measured against their "
                  f"warm: {used['measuredCompileSeconds']}, where the warmer compiled "
                  f"{used['warmerCompileSeconds']}; saved {used['secondsSaved']}",
                  f"Pods that hit but saved no time (above half the warmer's seconds): {used['hitButNotSaved']} "
                  f"(their FX graph hits {used['fxGraphHitsNotSaved']}, AOTAutograd hits "
                  f"{used['aotAutogradHitsNotSaved']}, not counted as hits)"]
    return lines


def _pods(program: Program) -> str:
    """Pods that reported hitting the program's entries: a few names, and how many more
    (at least: a pod that hit two of its entries counts in both)."""
    names, shown = program.hit_by, program.hit_by[:3]
    more = max([len(names), *(e.hit_pods for e in program.entries)]) - len(shown)
    return (",".join(shown) + (f" +{more}" if more > 0 else "")) if names else "-"


def _aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as lines of columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _hit_rows(usage: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """status.usage.hitPrograms as table rows: load seconds per hit against the seconds one
    compile took (FROM: Pods, pods that compiled it in the window; Warmer, the cache's
    warmer), the hits that had such a measure, and what all of them saved."""
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)
    rows: list[tuple[str, ...]] = [
        ("PROGRAM", "HITS", "LOAD S/HIT", "COMPILE S (ONCE)", "FROM", "HITS MEASURED", "SAVED S (TOTAL)")]
    for one in (h for h in usage.get("hitPrograms") or [] if isinstance(h, Mapping)):
        # hitsMeasured is there only where some hits had no measure: else all or none did.
        measured = one.get("hitsMeasured", one.get("hits") if one.get("secondsSaved") is not None else 0)
        rows.append((*(cell(one.get(name)) for name in HIT_FIELDS[:5]), cell(measured), cell(one.get("secondsSaved"))))
    return rows


def as_table(url: str, progs: Sequence[Program], pools: Sequence[Mapping[str, Any]] = (),
             missed: Sequence[Mapping[str, Any]] = (), usage: Mapping[str, Any] | None = None) -> str:
    """The report for people: one row per program, the pools' fingerprints, then the
    programs pods still compiled, each with its cause and what to do, then the programs
    they loaded and the seconds that saved."""
    rows = [("PROGRAM", "ENTRIES", "SIZE", "WRITTEN", "LAST USED", "WARMED BY", "HIT BY (PODS)")]
    rows += [(p.name, str(len(p.entries)), _size(p.size), _iso(p.written) or "-", _iso(p.last_used) or "-",
              ",".join(p.pools) or "-", _pods(p)) for p in progs]
    lines = [url, "", *_aligned(rows)]
    if not progs:
        torch = _torch(usage) is not None or any((p.get("fingerprint") or {}).get("framework") == "torch" for p in pools)
        lines.append("(no torch Inductor archives)" if torch else "(no JAX cache entries)")
    if pools:
        lines += ["", "POOL  STATE  KEYS COMPUTED WITH"]
        lines += [f"{pool.get('name')}  {pool.get('state', '-')}  {describe(pool.get('fingerprint') or {})}"
                  + (f", image {pool['fingerprint']['image']}" if (pool.get("fingerprint") or {}).get("image") else "")
                  for pool in pools]
    rows_missed = _missed_rows(missed)
    if rows_missed:
        lines += ["", "COMPILED BY PODS (WINDOW)  CAUSE  PODS  MISSES  SECONDS"]
        for one in rows_missed:
            lines.append(f"{one['program']}  {one['cause'] or 'Unknown'}  {one['pods']}  {one['misses']}  "
                         f"{one['compileSeconds']}")
            if one["message"]:
                lines.append(f"  {one['message']}")
    saved = _saved(usage)
    if saved["hitPrograms"]:
        lines += ["", "LOADED BY PODS (WINDOW)", *_aligned(_hit_rows(usage or {}))]
    if saved["measuredSecondsSaved"] is not None:
        lines.append(f"Seconds saved (measured): {saved['measuredSecondsSaved']}")
    lines += _torch_lines(pools, usage)
    return "\n".join(lines) + "\n"
