"""Why a warm pod still compiled a program: one cause per missed program (module name), in
words a user acts on, from what the pods reported of it and what the cache's warmers did.
Pure.

The causes, checked in this order (the first that holds is the one said):
- NotCacheable: JAX said it does not write the program (a host callback: jax.pure_callback,
  io_callback, jax.debug.print); no warmer can fix it.
- FingerprintDiffers: the pods that missed it compute keys from other versions, devices or
  XLA flags than every pool's warmer (KeysMatch's comparison).
- KeyUnstable: the pods' cache held the program under other keys (or a pool's warmer saw
  it get a second key: status.warmup.pools[].unstablePrograms), and their fingerprint is
  the warmer's: something per-process is in its HLO (custom_partitioning's callback).
- BelowWriteThreshold: the cache held no entry of it, and it compiled in less than the
  cache's warmup.minCompileTimeSecs, under which a warmer does not write what it compiled
  (or a pool's warmer said it compiled it without writing it). Unset, that is 0: then it
  appears only where a cache sets it.
- NotWarmed: the cache held no entry of it: no warmer compiled it.
- Unknown: what the cache held is not known (a pod reading gs:// directly lists nothing), or
  it held this very entry and JAX still missed it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachewarm.api import conditions
from cachewarm.api import constants as c
from cachewarm.api.conditions import Cond
from cachewarm.reconcile.keysmatch import differences

NOT_CACHEABLE = "NotCacheable"
FINGERPRINT_DIFFERS = "FingerprintDiffers"
KEY_UNSTABLE = "KeyUnstable"
BELOW_WRITE_THRESHOLD = "BelowWriteThreshold"
NOT_WARMED = "NotWarmed"
UNKNOWN = "Unknown"
CAUSES = (NOT_CACHEABLE, FINGERPRINT_DIFFERS, KEY_UNSTABLE, BELOW_WRITE_THRESHOLD, NOT_WARMED, UNKNOWN)
# A program (JAX module) name as text a terminal shows as it is: any character but a letter,
# digit or one of `_.-<>()[]` becomes `?` (printable), in pods' reports and warmers' summaries
# alike, so neither can put terminal escapes or lines into `cachewarm inspect`, a condition or
# an Event (attacker review), and a program with an odd name still counts.
PROGRAM_UNSAFE = re.compile(r"[^A-Za-z0-9_.<>()\[\]\-]")


def printable(program: str) -> str:
    return PROGRAM_UNSAFE.sub("?", program)


@dataclass(frozen=True)
class Missed:
    """One program as the pods that missed it in the window reported it."""

    program: str
    misses: int
    compile_seconds: float  # what those misses cost the pods, in all
    pods: frozenset[str]
    keys: frozenset[str]  # key hashes (16 hex digits) it missed with
    # Key hashes the pods' caches held for it, other than the one each process missed with;
    # None: not known (no process could list its cache).
    cached: frozenset[str] | None
    not_written: str | None  # "hostCallbacks", "belowThreshold" (the pod's own JAX said so)
    fingerprints: tuple[Mapping[str, Any], ...]  # of the processes that missed it
    held_missed: bool = False  # a process's cache held the very key it missed with


@dataclass(frozen=True)
class Warmed:
    """What the cache's warmers did, from its spec and status.warmup.pools."""

    pools: tuple[tuple[str, Mapping[str, Any]], ...]  # (pool, fingerprint) of the pools that succeeded
    min_compile_time_secs: float | None  # spec.warmup.minCompileTimeSecs, the warmers' (None: not known)
    # program -> (key hashes written, compiled without writing) from pools[].compiledPrograms, when
    # a warmer reports it (absent: not known).
    programs: Mapping[str, tuple[frozenset[str], bool]]
    # Programs a pool's warmer saw get a second key (pools[].unstablePrograms[].program).
    unstable: frozenset[str] = frozenset()


def _listed(pool: Mapping[str, Any], name: str) -> list[Any]:
    found = pool.get(name)
    return found if isinstance(found, list) else []


def warmed(spec: Mapping[str, Any], status: Mapping[str, Any]) -> Warmed:
    """Warmed from a cache's spec and status (read defensively: a field of another shape is
    taken as not known)."""
    pools = [p for p in (status.get("warmup") or {}).get("pools") or [] if isinstance(p, Mapping)]
    fingerprints = tuple((str(p.get("name")), p["fingerprint"]) for p in pools
                         if isinstance(p.get("fingerprint"), Mapping) and p.get("state") == "Succeeded")
    # The warmers' own threshold (warmup.minCompileTimeSecs, unset: 0, every program).
    warmup = spec.get("warmup") if isinstance(spec.get("warmup"), Mapping) else {}
    threshold = warmup.get("minCompileTimeSecs", 0.0) if isinstance(warmup, Mapping) else 0.0
    programs: dict[str, tuple[frozenset[str], bool]] = {}
    for pool in pools:
        for one in _listed(pool, "compiledPrograms"):
            if not isinstance(one, Mapping) or not isinstance(one.get("program"), str):
                continue
            keys, unwritten = programs.get(one["program"], (frozenset(), False))
            key = one.get("key")
            programs[one["program"]] = (keys | ({key} if isinstance(key, str) and one.get("written") is not False
                                                else set()), unwritten or one.get("written") is False)
    number = threshold if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) else None
    unstable = frozenset(str(one["program"]) for pool in pools
                         for one in _listed(pool, "unstablePrograms") if isinstance(one, Mapping) and isinstance(one.get("program"), str))
    return Warmed(fingerprints, float(number) if number is not None else None, programs, unstable)


def _differs(missed: Missed, pools: Sequence[tuple[str, Mapping[str, Any]]]) -> str | None:
    """What the missing pods' fingerprints differ in from the closest pool's, when every
    process that missed it (with a fingerprint) matches no pool; None otherwise."""
    found = [fp for fp in missed.fingerprints if fp]
    if not pools or not found:
        return None
    said = []
    for fp in found:
        fields, pool = min(((differences(w, fp), name) for name, w in pools), key=lambda d: len(d[0]))
        if not fields:
            return None
        said.append(f"{', '.join(fields)} (closest pool {pool})")
    return said[0]


def classify(missed: Missed, warm: Warmed) -> tuple[str, str]:
    """(cause, message) of a missed program; the message says what to do."""
    name, lost = missed.program, f"{missed.misses} compile(s), {missed.compile_seconds:.2f}s"
    if missed.not_written == "hostCallbacks":
        return NOT_CACHEABLE, (
            f"{name} uses a host callback (jax.pure_callback, io_callback, jax.debug.print): JAX never writes such a "
            f"program to its persistent cache, so no warmer can warm it ({lost} in the window); move the callback "
            "out of the jitted function to cache the rest")
    differs = _differs(missed, warm.pools)
    if differs is not None:
        return FINGERPRINT_DIFFERS, (
            f"The pods that compiled {name} compute other keys than the warmers: they differ in {differs} "
            f"({lost}); see KeysMatch")
    written, unwritten = warm.programs.get(name, (frozenset(), False))
    other = (missed.cached or frozenset()) | (written - missed.keys)
    if other and name not in warm.unstable:
        # Another key of the program, the same fingerprint: most often other code or shapes
        # than the warmers' (a new image before its re-warm, another batch size); a
        # per-process value in the HLO only where a warmer saw it change (unstablePrograms).
        return NOT_WARMED, (
            f"{name} was warmed with another key than the pods compute, with the same fingerprint ({lost}): the "
            "pods run other code or shapes than the warmers compiled (a new image before its re-warm, another "
            "batch size), or its HLO holds a per-process value (a custom_partitioning primitive: wrap it in "
            "shard_map), which a warmer that runs it twice names in its pool's unstablePrograms")
    if name in warm.unstable:
        return KEY_UNSTABLE, (
            f"{name} was warmed with another key than the pods compute, with the same fingerprint ({lost}): its "
            "HLO holds a per-process value, as a custom_partitioning primitive does; JAX's documented workaround "
            "is to wrap the primitive in shard_map (jax_remove_custom_partitioning_ptr_from_cache_key also "
            "removes it from the key, but its help calls it potentially unsafe)")
    threshold = warm.min_compile_time_secs
    per_compile = missed.compile_seconds / max(missed.misses, 1)
    held = missed.held_missed or bool(written & missed.keys)
    if unwritten or (missed.cached is not None and not held and threshold and per_compile < threshold):
        known = "the warmer compiled it and did not write it" if unwritten else (
            "a warmer that compiles it does not write it (if none does, add it to a pool's warmup too)")
        return BELOW_WRITE_THRESHOLD, (
            f"{name} compiled in {per_compile:.2f}s, under the cache's warmup.minCompileTimeSecs of {threshold}: "
            f"{known} ({lost}); unset warmup.minCompileTimeSecs (0) to have every program written")
    if missed.cached is not None and not held:
        return NOT_WARMED, (
            f"No warmer of this cache compiled {name} ({lost}): add the program to a pool's warmup (targets or "
            "command) so that it is written")
    if not held:
        return UNKNOWN, (
            f"cachewarm cannot tell whether a warmer wrote {name} ({lost}): the pods that compiled it could not "
            "list their cache (a gs:// path); a local copy lists it")
    return UNKNOWN, (f"The pods' cache held {name} under the very key they missed with ({lost}): the entry could "
                     "not be read (see the pods' logs)")


PROGRAMS_NAMED = 5  # in the condition's message


def programs_warm(usage: Mapping[str, Any] | None) -> Cond:
    """The ProgramsWarm condition from status.usage (what the pods reported in the window):
    True when they loaded every program they ran, False with the cause of the costliest
    program they compiled (status.usage.missedPrograms, costliest first), Unknown while no
    pod reported or pods missed without saying which programs. Its message names programs
    and causes only (no seconds), so it changes when they do, not with every report."""
    if not isinstance(usage, Mapping) or not usage.get("compileRequests"):
        return Cond(c.Condition.PROGRAMS_WARM, None, "NoReports", "No training pod reported a compile in the window")
    missed = [m for m in usage.get("missedPrograms") or [] if isinstance(m, Mapping) and m.get("program")]
    if not missed:
        if usage.get("misses"):
            return Cond(c.Condition.PROGRAMS_WARM, None, "ProgramsNotReported", (
                f"Pods reported {usage.get('misses')} compile(s) in the window but not of which programs (a reporter "
                "that does not read JAX's cache records: the process set the level of JAX's compiler logger)"))
        return Cond(c.Condition.PROGRAMS_WARM, True, "ProgramsLoaded",
                    "The pods loaded every program they ran in the window from the cache")
    cause = str(missed[0].get("cause") or UNKNOWN)
    named = ", ".join(f"{m['program']} ({m.get('cause') or UNKNOWN})" for m in missed[:PROGRAMS_NAMED])
    more = f" and {len(missed) - PROGRAMS_NAMED} more" if len(missed) > PROGRAMS_NAMED else ""
    return Cond(c.Condition.PROGRAMS_WARM, False, cause, (
        f"Pods compiled {len(missed)} program(s) in the window instead of loading them, costliest first: {named}"
        f"{more}; status.usage.missedPrograms and cachewarm inspect say why and what to do")[:1000])


def unstable(usage: Mapping[str, Any] | None) -> list[str]:
    """The programs status.usage says got another key than the warmer's with the same
    fingerprint (KeysMatch cannot be True while there is one)."""
    if not isinstance(usage, Mapping):
        return []
    return [str(m.get("program")) for m in usage.get("missedPrograms") or []
            if isinstance(m, Mapping) and m.get("cause") == KEY_UNSTABLE]


def stale(status: Mapping[str, Any]) -> bool:
    """Whether status's ProgramsWarm condition is not the one its usage gives (a reconcile
    brings it up to date): the leader's usage flush asks for one then."""
    want = programs_warm(status.get("usage"))
    have = conditions.get(status.get("conditions"), c.Condition.PROGRAMS_WARM)
    return have is None or (have.get("status"), have.get("reason"), have.get("message")) != (
        want.status_text, want.reason, want.message)
