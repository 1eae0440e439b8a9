"""The reporter: what a training process's JAX persistent cache did, told to cachewarm.

It runs inside the user's training image with that image's own python, so it uses nothing
but the standard library (and jax, once the process imports it). It is shipped like the
warmer: an init container copies it, `sitecustomize.py` and the warmer into an emptyDir
whose path starts the pod's PYTHONPATH, so python imports it at start-up and the training
code does not change. Until the process imports jax it does nothing but wait for that
import; from then on it counts JAX's own cache events from the very first compile:

- compile requests that used the cache, hits, misses (requests that did not hit), compile
  seconds saved by hits and spent compiling, and the names and keys of the last programs
  that missed (from JAX's own log records, as the warmer reads keys);
- the process's key fingerprint (the warmer's own code, so the two compare like for like);
- what the pod's local copy did (the copy init container's summary file, named by
  $CACHEWARM_LOCAL_COPY_SUMMARY): entries copied and already there, bytes, seconds, and
  whether the pod started cold because the copy failed.

A small JSON report goes to $CACHEWARM_REPORT_URL (HTTPS, the CA in
$CACHEWARM_REPORT_CA) with the pod's ServiceAccount token for audience `cachewarm`
($CACHEWARM_REPORT_TOKEN_FILE, re-read for every report since the kubelet rotates it):
shortly after the first compiles, then every $CACHEWARM_REPORT_SECONDS while anything
changed, and once at exit.

In a torch cache's pods (CACHEWARM_FRAMEWORK=torch, issue 31) it waits for `import torch`
instead, and each report carries torch's own counters (FX graph cache, AOTAutograd cache,
compile seconds: the warmer's torch_counts) under `torch` and, as `counts`, FX graphs looked
up, hit and missed, and torch's compile seconds; its fingerprint is the warmer's
torch_fingerprint(). torch has no event listener: its counters are looked at every second,
and the first change starts the reports as JAX's first compile does.

It must never break or slow the training process: every hook swallows its own errors;
memory is bounded (the last MAX_MISSES misses, counters); reports are sent from a daemon
thread with a timeout, and the one at exit waits at most EXIT_SECONDS; a report that cannot
be delivered is dropped (the next one carries the totals).
"""

from __future__ import annotations

# Only what every python start-up has loaded anyway: this module is imported by every
# python process of the pod, with or without jax. The rest (logging, json, ssl, urllib) is
# imported once jax is, or when a report is sent.
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.machinery
    import logging
    import ssl
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from types import ModuleType

# The env names the reporter's pod gets, spelled here only: the operator's builders import
# them (through cachewarm.api.constants). sitecustomize.py reads two of them without
# importing this module and keeps copies, which tests/unit/test_layout.py compares with these.
ENV_REPORT_URL = "CACHEWARM_REPORT_URL"
ENV_REPORT_TOKEN_FILE = "CACHEWARM_REPORT_TOKEN_FILE"
ENV_REPORT_CA = "CACHEWARM_REPORT_CA"  # the PEM itself, as the webhook gives it
ENV_REPORT_SECONDS = "CACHEWARM_REPORT_SECONDS"
ENV_CACHE = "CACHEWARM_CACHE"
ENV_POD_NAMESPACE = "CACHEWARM_POD_NAMESPACE"
ENV_POD_NAME = "CACHEWARM_POD_NAME"
ENV_POD_UID = "CACHEWARM_POD_UID"
ENV_LOCAL_COPY = "CACHEWARM_LOCAL_COPY_SUMMARY"  # the local copy's summary file (may be missing)
# "1": put the image's recorded PYTHONPATH back behind ours (read by sitecustomize.py, not here).
ENV_RESTORE_IMAGE_PYTHONPATH = "CACHEWARM_RESTORE_IMAGE_PYTHONPATH"
ENV_FRAMEWORK = "CACHEWARM_FRAMEWORK"  # the warmer's: "torch" in a torch cache's pods (torch's counters)

EVENT_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
EVENT_HITS = "/jax/compilation_cache/cache_hits"
DURATION_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
DURATION_COMPILE = "/jax/core/compile/backend_compile_duration"
MISS_LOG = "PERSISTENT COMPILATION CACHE MISS for"
HIT_LOG = "Persistent compilation cache hit for"
# JAX 0.10's records of a compile it did not write (compiler._cache_write), at DEBUG: a
# program with a host callback is never written (NotCacheable), one that compiled faster
# than jax_persistent_cache_min_compile_time_secs is not written (its own compile seconds
# are the record's last argument, as they are in the record of one that is written).
NOT_WRITTEN_LOG = "Not writing persistent cache entry for"
HOST_CALLBACKS_WORDS = "host callbacks"
COMPILE_TOOK_WORDS = "seconds to compile"
ENV_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"  # a local path: its entries are listed once, at jax import
# JAX's helper programs, counted apart from the user's in userRequests and userHits (the
# rule): `jit_<p>` for p a JAX primitive (the program eager dispatch of one primitive
# compiles, e.g. jit_convert_element_type, jit_broadcast_in_dim, jit_stage), the primitives
# read from JAX's lowering registry once jax is imported (PRIMITIVES_FALLBACK when it cannot
# be read), and the programs of jax.numpy's and jax.random's own jitted helpers below. A
# user's function named like one of them counts as a helper.
HELPER_PROGRAMS = frozenset("jit_" + name for name in (
    "_multi_slice", "_where", "_unstack", "_split", "_reduce_sum", "_reduce_max", "_reduce_min", "_reduce_prod",
    "_mean", "_var", "_std", "_cumsum", "_einsum", "_rbg_split", "_threefry_split", "_threefry_seed",
    "_threefry_fold_in", "_random_bits", "_uniform", "_normal", "_randint", "_gamma", "_bernoulli", "_choice",
    "_permutation"))
PRIMITIVES_FALLBACK = frozenset((
    "convert_element_type", "broadcast_in_dim", "iota", "gather", "scatter", "scatter-add", "dynamic_slice",
    "dynamic_update_slice", "slice", "concatenate", "reshape", "squeeze", "transpose", "select_n", "pad", "copy",
    "copy_p", "device_put", "stage", "add", "sub", "mul", "div", "neg", "max", "min", "eq", "ne", "lt", "le", "gt",
    "ge", "and", "or", "not", "abs", "exp", "log", "sqrt", "integer_pow", "pow", "reduce_sum", "reduce_max",
    "reduce_min", "argmax", "argmin", "cumsum", "sort", "clamp", "dot_general", "random_bits", "random_seed",
    "random_wrap", "random_unwrap", "threefry2x32"))

MAX_MISSES = 20  # the last programs that missed, with their keys
MAX_HIT_KEYS = 20  # the last distinct entries hit (program and key): `cachewarm inspect` names their pods
MAX_PROGRAMS_KEPT = 200  # programs tallied by name in the process (past it, the cheapest is forgotten)
MAX_PROGRAMS = 20  # of those, the report names the ones that cost the most seconds
MAX_PROGRAM_KEYS = 4  # key hashes kept per program (the ones it missed with; the cache's for it)
KEY_HASH_CHARS = 16  # as the warmer names an entry: the first 16 hex digits of its key's sha256
MAX_LISTED = 20000  # names read from the local cache directory at jax import
MAX_BODY_BYTES = 15000  # under the operator's cap (16 KiB): hit keys, then misses, give way first
FIRST_REPORT_SECONDS = 5.0  # after the first compile: the first steps' compiles are in it
COPY_POLL_SECONDS = 1.0  # while the copy's summary is missing: how often the reporter looks for it
DEFAULT_PERIOD_SECONDS = 60.0
SEND_TIMEOUT_SECONDS = 5.0
EXIT_SECONDS = 2.0  # the most the process waits at exit for the last report
EXIT_SEND_SECONDS = 1.5  # the last report's own timeout: it gives up (and says so) inside that wait
REPORT_VERSION = 1
# The local copy's numbers are clipped to what the operator takes (reports.LocalCopy).
MAX_COUNT = 10**9
MAX_BYTES = 10**15
MAX_SECONDS = 1e9
MAX_SUMMARY_BYTES = 64 * 1024  # a summary file larger than this is not read (and not reported)


def _warn(message: str) -> None:
    try:
        print(f"cachewarm reporter: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr closed: nothing to say it on
        pass


class Tally:
    """JAX's cache events in this process; thread-safe, bounded. Also a logging filter
    (logging takes any object with a `filter` method)."""

    def __init__(self) -> None:
        import collections  # noqa: PLC0415

        self.lock = threading.Lock()
        self.requests = 0
        self.hits = 0
        self.saved_seconds = 0.0
        self.compile_seconds = 0.0
        self.compiles = 0
        self.misses: collections.deque[dict[str, str]] = collections.deque(maxlen=MAX_MISSES)
        self.hit_keys: collections.OrderedDict[str, str] = collections.OrderedDict()  # key -> program
        # program name -> what its compile requests did (Tally.program); the user's requests
        # and hits apart from JAX's helper programs (HELPER_PROGRAMS), from the same records.
        self.programs: dict[str, dict[str, Any]] = {}
        self.user_requests = 0
        self.user_hits = 0
        self.reading_logs = False  # the records are ours to read (the per-program counts hold)
        self.primitives: frozenset[str] = PRIMITIVES_FALLBACK  # JAX's, once jax is imported (see HELPER_PROGRAMS)
        # program name -> key hashes of the entries the local cache directory held for it when
        # jax was imported (the warmer's entries: readers write none); None: not listed.
        self.cached: dict[str, list[str]] | None = None
        self.current = threading.local()  # the program this thread's compile request is for
        self.changed = threading.Event()
        self.first = threading.Event()
        self.logger: logging.Logger | None = None

    def on_event(self, event: str, **_: Any) -> None:
        try:
            if event not in (EVENT_REQUESTS, EVENT_HITS):
                return
            with self.lock:
                if event == EVENT_REQUESTS:
                    self.requests += 1
                else:
                    self.hits += 1
            self.first.set()
            self.changed.set()
        except Exception:  # noqa: BLE001 - never into JAX's compile path
            pass

    def on_duration(self, event: str, duration: float, **_: Any) -> None:
        try:
            if event == DURATION_SAVED:
                with self.lock:
                    self.saved_seconds += float(duration)
            elif event == DURATION_COMPILE:
                # The request's whole time (key, lookup, load or compile, write), after the
                # hit or miss record of the same thread named its program.
                current = getattr(self.current, "program", None)
                self.current.program = None
                with self.lock:
                    self.compile_seconds += float(duration)
                    self.compiles += 1
                    if current is not None and current[0] in self.programs:
                        field = "loadSeconds" if current[1] else "compileSeconds"
                        self.programs[current[0]][field] += float(duration)
                self.first.set()
            else:
                return
            self.changed.set()
        except Exception:  # noqa: BLE001
            pass

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003 - logging's name
        """Reads the program name and key of a miss from JAX's DEBUG record. The record goes
        on only if the process's own logging would have let it through: the level its
        parents have now (so a level the user sets later on `jax` still counts), or DEBUG
        when the user asked for this module's debug logs (jax_debug_log_modules)."""
        try:
            args = record.args if isinstance(record.args, tuple) else ()
            if str(record.msg).startswith(MISS_LOG) and len(args) >= 2:
                with self.lock:
                    self.misses.append({"program": str(args[0])[:200], "key": _clip_key(str(args[1]))})
                    self.program(str(args[0])[:200], str(args[1]), hit=False)
            elif str(record.msg).startswith(HIT_LOG) and len(args) >= 2:
                with self.lock:
                    key = _clip_key(str(args[1]))
                    self.hit_keys[key] = str(args[0])[:200]
                    self.hit_keys.move_to_end(key)
                    while len(self.hit_keys) > MAX_HIT_KEYS:
                        self.hit_keys.popitem(last=False)
                    self.program(str(args[0])[:200], str(args[1]), hit=True)
            elif str(record.msg).startswith(NOT_WRITTEN_LOG) and args:
                with self.lock:
                    found = self.programs.get(str(args[0])[:200])
                    if found is not None and HOST_CALLBACKS_WORDS in str(record.msg):
                        found["notWritten"] = "hostCallbacks"
                    elif found is not None and COMPILE_TOOK_WORDS in str(record.msg):
                        found["notWritten"] = "belowThreshold"
            parent = self.logger.parent if self.logger is not None else None
            if parent is None or record.levelno >= parent.getEffectiveLevel():
                return True
            jax = sys.modules.get("jax")
            wanted = str(getattr(getattr(jax, "config", None), "jax_debug_log_modules", "") or "")
            return any(m.strip() and record.name.startswith(m.strip()) for m in wanted.split(","))
        except Exception:  # noqa: BLE001
            return True

    def program(self, name: str, key: str, hit: bool) -> None:
        """Counts a hit or miss of program `name` with `key` (the lock held) and names it
        as this thread's current request, for the request's duration that follows."""
        found = self.programs.get(name)
        if not name:
            return
        if found is None:
            if len(self.programs) >= MAX_PROGRAMS_KEPT:  # the one that cost least goes
                cheapest = min(self.programs, key=lambda n: (self.programs[n]["misses"] > 0,
                                                             self.programs[n]["compileSeconds"]))
                del self.programs[cheapest]
            helper = name in HELPER_PROGRAMS or (name.startswith("jit_") and name[4:] in self.primitives)
            found = self.programs[name] = {"program": name, "hits": 0, "misses": 0, "compileSeconds": 0.0,
                                           "loadSeconds": 0.0, "keys": [], "notWritten": None, "helper": helper}
        found["hits" if hit else "misses"] += 1
        digest = _digest(key)
        if not hit and digest and digest not in found["keys"] and len(found["keys"]) < MAX_PROGRAM_KEYS:
            found["keys"].append(digest)
        if not found["helper"]:
            self.user_requests += 1
            self.user_hits += 1 if hit else 0
        self.current.program = (name, hit)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = {
                "requests": self.requests, "hits": self.hits, "misses": max(self.requests - self.hits, 0),
                "compileSecondsSaved": round(self.saved_seconds, 3),
                "compileSecondsSpent": round(self.compile_seconds, 3), "compiles": self.compiles,
                "lastMisses": list(self.misses),
                "hitKeys": [{"program": program, "key": key} for key, program in self.hit_keys.items()]}
            if self.reading_logs:
                out["userRequests"], out["userHits"] = self.user_requests, self.user_hits
                costly = sorted(self.programs.values(), key=lambda p: (-p["compileSeconds"], -p["misses"],
                                                                        p["program"]))[:MAX_PROGRAMS]
                out["programs"] = [self._program_report(p) for p in costly]
            return out

    def _program_report(self, found: dict[str, Any]) -> dict[str, Any]:
        one = {**found, "keys": list(found["keys"]), "compileSeconds": round(found["compileSeconds"], 3),
               "loadSeconds": round(found["loadSeconds"], 3)}
        if self.cached is not None:  # the warmer's entries of this program the pod's cache held
            one["cached"] = list(self.cached.get(found["program"], []))
        return one

    def list_cache(self, directory: str, plan: str = "") -> None:
        """Reads the names of the entries in the local cache directory (`<program>-<sha256>-cache`)
        once, before any compile of this process: the entries the pod's copy brought (a
        reader writes none), and those its copy still brings (`plan`: the copier's plan
        file, one name a line, while a copy serves entries on demand). Not a directory (a
        gs:// path, none): left unknown."""
        if not directory or "://" in directory or not os.path.isdir(directory):
            return
        with os.scandir(directory) as listing:
            names = {entry.name for _, entry in zip(range(MAX_LISTED + 1), listing)}
        try:
            with open(plan) as planned:
                names.update(planned.read(MAX_LISTED * 400).split()[:MAX_LISTED + 1])
        except OSError:
            pass  # none (no copy, or over: its entries are listed above)
        if len(names) > MAX_LISTED:
            return  # too many to say which programs it lacks: unknown
        found: dict[str, list[str]] = {}
        for name in sorted(names):
            program, digest = name[:-len("-cache")].rpartition("-")[0], _digest(name[:-len("-cache")])
            if not name.endswith("-cache") or not program or not digest:
                continue  # not an entry's name
            keys = found.setdefault(program[:200], [])
            if len(keys) < MAX_PROGRAM_KEYS:
                keys.append(digest)
        self.cached = found


_WARMERS: dict[str, Any] = {}  # the warmer module loaded from a directory, once


def _load_fingerprint(here: Path, attribute: str = "fingerprint") -> Callable[[], dict[str, Any]]:
    """The warmer's fingerprint() (or another of its functions of no argument that return
    a dict: torch_fingerprint, torch_counts), from the warmer file shipped beside this one."""
    import importlib.util  # noqa: PLC0415

    module = _WARMERS.get(str(here))
    for name in ("warm.py", "warmer.py") if module is None else ():
        path = here / name
        if path.is_file():
            spec = importlib.util.spec_from_file_location("_cachewarm_warmer", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _WARMERS[str(here)] = module
                break
    if module is None:
        return lambda: {}
    found: Callable[[], dict[str, Any]] = getattr(module, attribute)
    return found


class Reporter:
    """Sends the tally: soon after the first compiles, then periodically, and at exit."""

    def __init__(self, tally: Tally, env: dict[str, str], here: Path) -> None:
        self.tally = tally
        self.url = env.get(ENV_REPORT_URL, "")
        self.token_file = env.get(ENV_REPORT_TOKEN_FILE, "")
        self.ca_pem = env.get(ENV_REPORT_CA, "")
        try:
            self.period = max(float(env.get(ENV_REPORT_SECONDS) or DEFAULT_PERIOD_SECONDS), 1.0)
        except ValueError:
            self.period = DEFAULT_PERIOD_SECONDS
        self.pod = {"namespace": env.get(ENV_POD_NAMESPACE, ""), "name": env.get(ENV_POD_NAME, ""),
                    "uid": env.get(ENV_POD_UID, "")}
        self.cache = env.get(ENV_CACHE, "")
        self.local_copy_file = env.get(ENV_LOCAL_COPY, "")
        # Read at each report until there is a summary, then kept: the copy may end after the
        # first compiles (entries served on demand), and until then there is none to report.
        self.local_copy: dict[str, Any] | None = None
        self.here = here
        self.sequence = 0
        self.failures = 0
        self.sent = 0
        self.fingerprint: dict[str, Any] | None = None
        self.torch = False  # a torch cache's process that imported torch: torch's counters, not JAX's
        self.started = time.time()
        self.disabled = False
        self.final = False
        self._send_lock = threading.Lock()
        self._context: ssl.SSLContext | None = None

    def forked(self) -> None:
        """In a forked child (a data loader worker, say): it has none of the parent's threads
        and may hold a copy of a lock the parent held; it reports nothing (the parent's
        counts are the parent's) and must never wait on those locks."""
        self.disabled = True
        self._send_lock = threading.Lock()
        self.tally.lock = threading.Lock()

    def report(self) -> dict[str, Any]:
        if self.fingerprint is None:
            try:
                self.fingerprint = _load_fingerprint(self.here, "torch_fingerprint" if self.torch else "fingerprint")()
            except Exception as exc:  # noqa: BLE001
                self.fingerprint = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        self.sequence += 1
        process: dict[str, Any] = {"pid": os.getpid(), "started": int(self.started)}
        jax = sys.modules.get("jax")
        try:
            process["index"] = int(jax.process_index()) if jax is not None and not self.torch else \
                int(os.environ.get("RANK") or 0) if self.torch else 0
        except Exception:  # noqa: BLE001
            process["index"] = 0
        if self.local_copy is None:
            self.local_copy = local_copy(self.local_copy_file)
        counts, torch = self.tally.snapshot(), None
        if self.torch:
            torch = self.torch_counts()
            counts = torch_report_counts(torch)
        report: dict[str, Any] = {
            "version": REPORT_VERSION, "pod": self.pod, "cache": self.cache, "process": process,
            "sequence": self.sequence, "final": self.final, "counts": counts,
            "fingerprint": self.fingerprint}
        if torch is not None:
            report["torch"] = torch
        if self.local_copy is not None:
            report["localCopy"] = dict(self.local_copy)
        return report

    def torch_counts(self) -> dict[str, Any]:
        """torch's counters now (the warmer's torch_counts), each field clipped; zeros when
        they cannot be read."""
        try:
            found = _load_fingerprint(self.here, "torch_counts")()
        except Exception:  # noqa: BLE001 - another torch, no warmer file: zeros
            found = {}
        out: dict[str, Any] = {name: int(_clipped(found.get(name), MAX_COUNT)) for name in TORCH_COUNTS}
        out["compileSeconds"] = round(float(_clipped(found.get("compileSeconds"), MAX_SECONDS)), 3)
        return out

    def send(self, timeout: float = SEND_TIMEOUT_SECONDS) -> bool:
        """One report; True when the operator took it. Never raises."""
        if not self.url or self.disabled:
            return False
        with self._send_lock:
            try:
                import json  # noqa: PLC0415
                import ssl  # noqa: PLC0415
                import urllib.request  # noqa: PLC0415
                from pathlib import Path  # noqa: PLC0415

                self.tally.changed.clear()
                body = _fit(self.report(), json.dumps)
                request = urllib.request.Request(self.url, data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                if self.token_file:
                    request.add_header("Authorization", "Bearer " + Path(self.token_file).read_text().strip())
                if self._context is None and self.url.startswith("https:"):
                    self._context = ssl.create_default_context(cadata=self.ca_pem or None)
                with urllib.request.urlopen(request, timeout=timeout, context=self._context) as answer:  # noqa: S310
                    answer.read(4096)
                self.sent += 1
                return True
            except Exception as exc:  # noqa: BLE001 - the operator down, slow, refusing: training goes on
                self.failures += 1
                if self.failures == 1:
                    _warn(f"could not send a report to {self.url} ({type(exc).__name__}: {exc}); "
                          "training is not affected")
                return False

    def loop(self) -> None:
        try:
            self.tally.first.wait()
            time.sleep(FIRST_REPORT_SECONDS)
            while True:
                self.send()
                self._wait_for_news()
        except Exception:  # noqa: BLE001
            pass

    def _wait_for_news(self) -> None:
        """Until the next report is due: a period has passed and a compile changed the counts,
        or, while the copy's summary is missing, at once when it appears (a copy that serves
        entries on demand often ends after the first report, and compiles may then be over:
        without this the pod's localCopy waits for the process's exit, which SIGTERM skips)."""
        due = time.monotonic() + self.period
        while self.local_copy is None and self.local_copy_file:
            self.local_copy = local_copy(self.local_copy_file)
            if self.local_copy is not None:
                return
            if time.monotonic() >= due and self.tally.changed.is_set():
                return
            time.sleep(COPY_POLL_SECONDS)
        time.sleep(max(due - time.monotonic(), 0.0))
        self.tally.changed.wait()

    def at_exit(self) -> None:
        """The last report, waited for at most EXIT_SECONDS (from a thread: a hung
        connection cannot hold the process longer)."""
        try:
            if self.torch and not self.tally.first.is_set() and _torch_compiled(self.torch_counts()):
                self.tally.first.set()  # compiled since the last look (torch's counters are polled)
            if not self.tally.first.is_set() or self.disabled:
                return  # no compile used the cache: nothing to tell
            self.final = True
            done = threading.Thread(target=self.send, kwargs={"timeout": EXIT_SEND_SECONDS}, daemon=True)
            done.start()
            done.join(EXIT_SECONDS)
        except Exception:  # noqa: BLE001
            pass


def _clipped(value: Any, top: float) -> float:
    """A summary's number within [0, top]; 0 for anything that is not one (a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0
    return min(max(value, 0), top)


def local_copy(path: str) -> dict[str, Any] | None:
    """What a report says of the pod's local copy, from the copy's summary file at `path`
    (a JSON object; also as the copier prints it, under "cachewarm-copier"): copied,
    present, bytes, failed, cold, seconds, and source when it is one the operator knows; the
    first error when the copy was cold. None when there is no path, no file, or no JSON
    object in it. Never raises."""
    if not path:
        return None
    try:
        import json  # noqa: PLC0415

        with open(path, "rb") as file:
            text = file.read(MAX_SUMMARY_BYTES + 1)
        if len(text) > MAX_SUMMARY_BYTES:
            return None
        summary = json.loads(text)
        if isinstance(summary, dict) and isinstance(summary.get("cachewarm-copier"), dict):
            summary = summary["cachewarm-copier"]
        if not isinstance(summary, dict):
            return None
        found: dict[str, Any] = {name: int(_clipped(summary.get(name), MAX_COUNT))
                                 for name in ("copied", "present", "failed")}
        found["bytes"] = int(_clipped(summary.get("bytes"), MAX_BYTES))
        found["cold"] = summary.get("cold") is True
        found["seconds"] = round(float(_clipped(summary.get("seconds"), MAX_SECONDS)), 3)
        if summary.get("source") in ("manifest", "prefix"):
            found["source"] = summary["source"]
        errors = summary.get("errors")
        if found["cold"] and isinstance(errors, list) and errors and isinstance(errors[0], str):
            found["error"] = errors[0][:200]
        return found
    except Exception:  # noqa: BLE001 - unreadable, not JSON: the report goes without it
        return None


def _primitives() -> frozenset[str]:
    """The names of JAX's primitives, from its lowering registry (every primitive that can be
    compiled has a lowering there); empty when it cannot be read (another JAX)."""
    try:
        from jax._src.interpreters import mlir  # noqa: PLC0415

        found = {p.name for p in getattr(mlir, "_lowerings", {})}
        for lowerings in getattr(mlir, "_platform_specific_lowerings", {}).values():
            found |= {p.name for p in lowerings}
        return frozenset(str(name) for name in found)
    except Exception:  # noqa: BLE001 - a JAX without that registry: the fallback list
        return frozenset()


def _digest(key: str) -> str:
    """How the operator names the entry of `key` (`<program>-<sha256>`): the first
    KEY_HASH_CHARS hex digits of its hash; "" when it does not end in one."""
    digest = key.rsplit("-", 1)[-1]
    hexdigits = "0123456789abcdef"
    return digest[:KEY_HASH_CHARS] if len(digest) == 64 and all(ch in hexdigits for ch in digest) else ""


def _clip_key(key: str) -> str:
    """A key of at most 200 characters that still ends in its `-<sha256>` (the entry's
    name): a long program name gives way, not the hash."""
    return key if len(key) <= 200 else key[:135] + key[-65:]


def _fit(report: dict[str, Any], dumps: Callable[..., str]) -> bytes:
    """The report as JSON within MAX_BODY_BYTES: the oldest hit keys, then the oldest
    misses, then the programs that cost least, are left out until it fits (long program
    names could otherwise pass the operator's cap and lose the whole report)."""
    counts = report["counts"]
    while True:
        body = dumps(report, separators=(",", ":")).encode()
        if len(body) <= MAX_BODY_BYTES:
            return body
        listed = next((name for name in ("hitKeys", "lastMisses") if counts.get(name)), None)
        if listed is not None:
            counts[listed] = counts[listed][len(counts[listed]) // 2 + 1:]
        elif counts.get("programs"):  # costliest first: the tail goes
            counts["programs"] = counts["programs"][:len(counts["programs"]) // 2]
        else:
            return body


TORCH_COUNTS = ("fxGraphHits", "fxGraphMisses", "fxGraphBypasses", "aotAutogradHits", "aotAutogradMisses",
                "aotAutogradBypasses")
TORCH_POLL_SECONDS = 1.0  # how often a torch process's counters are looked at (torch has no listener)


def torch_report_counts(torch: dict[str, Any]) -> dict[str, Any]:
    """A report's `counts` from torch's counters: an FX graph looked up is a request, its
    hits and misses as torch counts them, each miss a compile, torch's compile seconds
    spent; JAX's other fields 0 or empty. Pure."""
    hits, misses = torch["fxGraphHits"], torch["fxGraphMisses"]
    return {"requests": hits + misses, "hits": hits, "misses": misses, "compileSecondsSaved": 0.0,
            "compileSecondsSpent": torch["compileSeconds"], "compiles": misses, "lastMisses": [], "hitKeys": []}


def _torch_compiled(counts: dict[str, Any]) -> bool:
    """Whether torch's counters say the process looked up a compiled graph (hit or miss)."""
    return any(counts.get(name) for name in TORCH_COUNTS)


def on_torch_imported(tally: Tally, reporter: Reporter) -> None:
    """A torch cache's process imported torch: its counters are read at each report, and
    looked at every TORCH_POLL_SECONDS so that the first compile (a change) starts the
    reports as JAX's events do; start the report thread."""
    try:
        import atexit  # noqa: PLC0415

        reporter.torch = True

        def poll() -> None:
            last: Any = None
            while True:
                try:
                    now = _load_fingerprint(reporter.here, "torch_counts")()
                except Exception:  # noqa: BLE001 - no counters: nothing to poll
                    return
                if now and now != last and _torch_compiled(now):
                    tally.first.set()
                    tally.changed.set()
                last = now
                time.sleep(TORCH_POLL_SECONDS)

        os.register_at_fork(after_in_child=reporter.forked)
        threading.Thread(target=poll, name="cachewarm-reporter-torch", daemon=True).start()
        threading.Thread(target=reporter.loop, name="cachewarm-reporter", daemon=True).start()
        atexit.register(reporter.at_exit)
    except Exception as exc:  # noqa: BLE001
        _warn(f"not counting cache use ({type(exc).__name__}: {exc})")


def on_jax_imported(jax: ModuleType, tally: Tally, reporter: Reporter) -> None:
    """Listen to JAX's cache events and miss records; start the report thread."""
    try:
        import atexit  # noqa: PLC0415
        import logging  # noqa: PLC0415

        jax.monitoring.register_event_listener(tally.on_event)
        jax.monitoring.register_event_duration_secs_listener(tally.on_duration)
        logger = logging.getLogger("jax._src.compiler")
        tally.logger = logger
        if logger.level == logging.NOTSET:  # one the user set stays theirs (and then so are its records)
            logger.setLevel(logging.DEBUG)
            logger.addFilter(tally)
            tally.reading_logs = True
        try:
            summary = os.environ.get(ENV_LOCAL_COPY, "")
            tally.list_cache(os.environ.get(ENV_CACHE_DIR, ""), f"{summary}.plan" if summary else "")
        except OSError:
            pass  # unreadable: which programs the cache held stays unknown
        tally.primitives = _primitives() or PRIMITIVES_FALLBACK
        os.register_at_fork(after_in_child=reporter.forked)
        threading.Thread(target=reporter.loop, name="cachewarm-reporter", daemon=True).start()
        atexit.register(reporter.at_exit)
    except Exception as exc:  # noqa: BLE001
        _warn(f"not counting cache use ({type(exc).__name__}: {exc})")


class _JaxWatch:
    """Runs `then(jax)` right after `import jax` finishes, whoever imports it first (a
    meta path finder: sys.meta_path takes any object with find_spec)."""

    def __init__(self, then: Callable[[ModuleType], None], module: str = "jax") -> None:
        self.then = then
        self.module = module  # "torch": a torch cache's process (CACHEWARM_FRAMEWORK)
        self.done = False
        self.searching: set[int] = set()  # the threads in our own find_spec("jax")

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        # Left in place until jax's module runs: a find_spec that imports nothing (an "is
        # jax installed" check) must not take it out.
        me = threading.get_ident()
        if fullname != self.module or self.done or me in self.searching:
            return None
        import importlib.util  # noqa: PLC0415

        self.searching.add(me)
        try:
            spec = importlib.util.find_spec(self.module)
        finally:
            self.searching.discard(me)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, then, watch = spec.loader, self.then, self

        class _Loader:
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                watch.done = True
                try:
                    sys.meta_path.remove(watch)
                except ValueError:
                    pass
                # jax's own loader again, for whatever reads it later (importlib.resources).
                module.__loader__ = loader
                if module.__spec__ is not None:
                    module.__spec__.loader = loader
                loader.exec_module(module)  # the import itself: its errors are the importer's
                try:
                    then(module)
                except Exception:  # noqa: BLE001
                    pass

        spec.loader = _Loader()  # type: ignore[assignment]
        return spec


def start(here: Path | None = None, env: dict[str, str] | None = None) -> None:
    """From sitecustomize, at interpreter start. Never raises."""
    try:
        from pathlib import Path  # noqa: PLC0415

        # Not resolved: a ConfigMap volume's files are symlinks into a hidden directory.
        where = here or Path(__file__).parent
        tally = Tally()
        reporter = Reporter(tally, dict(os.environ) if env is None else env, where)
        then: Callable[[ModuleType], None] = lambda jax: on_jax_imported(jax, tally, reporter)  # noqa: E731
        module = "jax"
        if (os.environ if env is None else env).get(ENV_FRAMEWORK) == "torch":  # torch's counters, not JAX's
            then, module = (lambda _: on_torch_imported(tally, reporter)), "torch"  # noqa: E731
        if module in sys.modules:
            then(sys.modules[module])
        else:
            sys.meta_path.insert(0, _JaxWatch(then, module))
    except Exception as exc:  # noqa: BLE001
        _warn(f"not started ({type(exc).__name__}: {exc})")
