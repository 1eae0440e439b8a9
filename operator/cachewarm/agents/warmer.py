"""The warmer: precompile a training program into JAX's persistent cache.

It runs inside the user's training image with that image's own python and jax, so it
uses nothing but the standard library and jax (plus etils, which any gs:// cache needs
anyway). An init container copies this one file into the pod; `cachewarm warm` is the
same code.

    python warm.py targets [--parallel N] MODULE:CALLABLE ...
    python warm.py command -- python -m train --steps=1

targets: each callable returns or yields `jax.stages.Lowered` objects, or tuples
(jitted_fn, args[, kwargs]) of abstract arguments (jax.ShapeDtypeStruct); each is compiled
into the cache. command: the real entrypoint runs with the cache env; `python FILE` and
`python -m MODULE` run in this process so JAX's own counters are read; anything else
(python -c, a shell wrapper, a launcher) runs as a child, whose python processes count
their own JAX cache use through a start-up hook the warmer gives them (ChildHook) and
leave it for the warmer to merge: fingerprint, counts, keys, as for a program run here.

A JSON summary goes to the termination message ($CACHEWARM_SUMMARY_FILE, default
/dev/termination-log) so the operator reads it from the pod; its `compiledPrograms` says what
each program the warm compiled took (JAX's own measure of the backend compile, children's
included), which pods' hits are measured against once no pod compiles. Exit status: 0 when every
target compiled and at least one program was compiled or found in the cache; 1 when a
target failed; 2 when nothing ended up in the cache (nothing compiled, or every program
below the cache's size/time thresholds, or no cache directory).

Manifest ($CACHEWARM_MANIFEST, a gs:// URL the operator sets per warmer Job): process 0 writes
there the entries the warm relied on, for training pods' local copies, or removes it when
it cannot name them (an entrypoint in a child process the hook could not count: python -E,
-S or -I, or a PYTHONPATH the command replaces). Never fatal. Version 2 (issue 28):
each entry with its size, GCS's md5Hash and generation, read from GCS after the warm (an
entry whose digests cannot be read is left out, `manifestLeftOut`); the summary's
`manifestGeneration` is the generation of the manifest object written, read back and
checked to hold these very bytes, which the operator records (from this Job's own pod
only) and pods' copiers then trust, and only that.

Multi-host pools (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in the env):
targets mode joins the JAX distributed runtime once; command mode leaves that to the
entrypoint. Only process 0 writes entries, so only its summary counts written entries
(`processIndex` says which process reported); another process exits 0 when it compiled
what it was given without error, 2 when it compiled nothing.

Every process's summary carries `imagePythonPath`: the PYTHONPATH this process started
with ("" when none), which is the image's own (its ENV) unless spec.warmup.env sets one;
the webhook keeps it behind its own directory in training pods. Left out when longer than
IMAGE_PYTHONPATH_LIMIT characters or not valid text.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import runpy
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

KEY_HASH_CHARS = 16
SUMMARY_LIMIT = 4000  # the kubelet keeps at most 4096 bytes of a termination message
IMAGE_PYTHONPATH_LIMIT = 1000  # characters; the CRD's maxLength of a pool's imagePythonPath
EVENT_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
EVENT_HITS = "/jax/compilation_cache/cache_hits"
# PJRT plugins whose version goes into a compiled program's key, as jaxlib's does.
PLUGIN_DISTRIBUTIONS = ("libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                        "jax-cuda13-pjrt", "jax-rocm7-plugin", "jax-rocm7-pjrt")
# XLA flags JAX leaves out of its cache key (jax/_src/cache_key.py, as of jax 0.10): used
# when the running jax does not have the list itself.
KEY_EXCLUDED_FLAGS = ("--xla_dump_to", "--xla_dump_hlo_as_text", "--xla_dump_hlo_as_proto", "--xla_dump_hlo_pass_re",
                      "--xla_dump_hlo_module_re", "--xla_force_host_platform_device_count", "--xla_gpu_cuda_data_dir",
                      "--xla_gpu_experimental_autotune_cache_mode")


def log(message: str, **fields: Any) -> None:
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} warmer: {message} {extra}".rstrip(),
          file=sys.stderr, flush=True)


def missing_libraries(url: str) -> list[str]:
    """What this image lacks to use the cache directory `url`: JAX reads and writes a
    non-local one through etils.epath (without it JAX only warns at each compile and caches
    nothing). Which library epath then needs is epath's choice (gcsfs through fsspec, or
    tensorflow's gfile where tensorflow is installed), so epath is asked: one lookup of the
    directory, and only an ImportError counts as lacking (any other error is the bucket's
    or the network's, reported where entries are listed). Empty for a local path."""
    if "://" not in url:
        return []
    try:
        from etils import epath  # noqa: PLC0415 - only non-local caches need it
    except ImportError:
        # Nothing to ask: name what epath would need too, unless tensorflow serves it.
        gs_library = url.startswith("gs://") and not importlib.util.find_spec("tensorflow")
        return ["etils[epath]"] + (["gcsfs"] if gs_library and not importlib.util.find_spec("gcsfs") else [])
    try:
        epath.Path(url).exists()
    except ImportError as exc:
        return ["gcsfs" if url.startswith("gs://") and "gcsfs" in str(exc) else (exc.name or str(exc)[:200])]
    except Exception:  # noqa: BLE001 - not a missing library (see the docstring)
        return []
    return []


class CacheDir:
    """Entries in the cache directory (local path or gs://), for counting what was written."""

    def __init__(self, url: str) -> None:
        self.url = url

    def entries(self) -> dict[str, int]:
        if not self.url:
            return {}
        try:
            if self.url.startswith("gs://"):
                listed = self.gcs_entries()
                if listed is not None:
                    return listed
            if "://" in self.url:
                from etils import epath  # noqa: PLC0415 - only gs:// caches need it

                root: Any = epath.Path(self.url)
            else:
                import pathlib  # noqa: PLC0415

                root = pathlib.Path(self.url)
            if not root.exists():
                return {}
            sizes = {}
            for p in root.iterdir():
                if p.name.endswith("-cache"):
                    st = p.stat()
                    sizes[p.name] = int(getattr(st, "length", None) or getattr(st, "st_size", 0) or 0)
            return sizes
        except Exception as exc:  # noqa: BLE001 - counting is best effort, never fatal
            log("Could not list the cache directory", url=self.url, error=repr(exc))
            return {}

    def gcs_entries(self) -> dict[str, int] | None:
        """The gs:// directory's entries as GCS lists them now (one listing, not gcsfs's
        cached one: an entrypoint in a child process writes where this process's cache of
        the listing cannot see); None without gcsfs (epath then lists through its own
        backend). Raises what the listing raises."""
        try:
            fs = gcs_filesystem()
        except ImportError:
            return None
        try:
            listed = fs.ls(self.url[len("gs://"):].rstrip("/"), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {str(o.get("name", "")).rsplit("/", 1)[-1]: int(o.get("size") or 0) for o in listed
                if isinstance(o, dict) and str(o.get("name", "")).endswith("-cache")}


class Counters:
    """JAX's own cache events, counted process-wide."""

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()
        self.lock = threading.Lock()

    def install(self) -> None:
        import jax  # noqa: PLC0415

        def on_event(event: str, **_: str | int) -> None:
            with self.lock:
                self.events[event] += 1

        jax.monitoring.register_event_listener(on_event)

    @property
    def requests(self) -> int:
        return self.events[EVENT_REQUESTS]

    @property
    def hits(self) -> int:
        return self.events[EVENT_HITS]


class UsedKeys(logging.Filter):
    """The cache keys this process looked up (hits and misses), read from jax's own log
    records ("Persistent compilation cache hit for %r with key %r" and the MISS one, on
    logger jax._src.compiler at DEBUG). jax's monitoring events carry no key. Records below
    the level the logger had before still go nowhere, so the warmer's log stays as it was.

    Also what each program it compiled took (`compiled`, by key): JAX's record of the
    compile's own seconds (compiler._cache_write: "'%s' took at least %.2f seconds to
    compile (%.2fs)" before it writes the entry, "Not writing persistent cache entry for
    '%s' because it took < %.2f seconds to compile (%.2fs)" when under the threshold; the
    module name first, the seconds last), measured around the backend compile alone (not
    the key, the lookup or the write), after the MISS record of the same thread named the
    key. The reporter reads the same records for its notWritten (COMPILE_TOOK_WORDS)."""

    LOGGER = "jax._src.compiler"
    PREFIXES = ("Persistent compilation cache hit for", "PERSISTENT COMPILATION CACHE MISS for")
    MISS = PREFIXES[1]
    COMPILE_TOOK = "seconds to compile"  # the reporter's COMPILE_TOOK_WORDS
    NOT_WRITTEN = "Not writing persistent cache entry for"

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()
        self.quiet_below = logging.WARNING
        # key -> {"program", "key", "seconds", "written"}; a compile whose key is not known
        # (no MISS record on its thread) under "<program>-" alone.
        self.compiled: dict[str, dict[str, Any]] = {}
        self.current = threading.local()  # the key this thread's MISS record named

    def install(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        self.quiet_below = logger.getEffectiveLevel()
        logger.setLevel(logging.DEBUG)
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        message = str(record.msg)
        if message.startswith(self.PREFIXES) and len(args) >= 2:
            self.keys.add(str(args[1]))
            self.current.key = str(args[1]) if message.startswith(self.MISS) else None
        elif self.COMPILE_TOOK in message and len(args) >= 3:
            self.took(str(args[0]), args[-1], written=not message.startswith(self.NOT_WRITTEN))
        return record.levelno >= self.quiet_below

    def took(self, program: str, seconds: Any, written: bool) -> None:
        """A compile of `program` took `seconds` (JAX's record); its key is the one this
        thread's last MISS record named, when that is the same program's. Bounded: past
        MAX_COMPILED_KEPT keys, further compiles are not kept."""
        key = getattr(self.current, "key", None)
        self.current.key = None
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e7:
            return
        key = key if isinstance(key, str) and program_of(key) == program else f"{program}-"
        if key in self.compiled or len(self.compiled) < MAX_COMPILED_KEPT:
            self.compiled[key] = {"program": program, "key": key, "seconds": float(seconds), "written": written}


# Child processes (issue 30). An entrypoint the warmer runs as a child (python -c, a shell
# wrapper, a launcher such as torchrun) compiles where this process's counters cannot see.
# The warmer gives its children a directory first on PYTHONPATH (the image's own PYTHONPATH
# behind it) holding a sitecustomize.py it writes itself (CHILD_SITECUSTOMIZE): every python
# child that starts with site imports it, which loads this very file and calls child_hook().
# The hook counts what the process's JAX cache did, as the warmer counts its own, and at exit
# leaves a record (CHILD_RECORD_SUFFIX) in the directory $CACHEWARM_CHILD_RECORDS names,
# which the warmer reads once its entrypoint has exited (read_child_records). Not counted: a
# python started with -S, -I or -E, one whose PYTHONPATH the command replaces, and one that
# ends without running atexit (os._exit, as forked multiprocessing workers do, or a signal).
ENV_CHILD_RECORDS = "CACHEWARM_CHILD_RECORDS"
CHILD_RECORD_SUFFIX = ".cachewarm-child.json"
MAX_CHILD_RECORDS = 1000  # records read; more processes than that are not counted
MAX_CHILD_RECORD_BYTES = 1 << 20
# What programs took to compile (UsedKeys.compiled): keys kept per process, and named in the
# summary's compiledPrograms (the slowest; write_summary may name fewer).
MAX_COMPILED_KEPT = 1000
MAX_COMPILED = 16
CHILD_SITECUSTOMIZE = '''\
"""Written by cachewarm's warmer for its child processes: count this process's JAX cache use
(warm.py's child_hook), then run the image's own sitecustomize, which this file shadows."""
try:
    import importlib.util as _util
    import os as _os

    if _os.environ.get({records!r}):
        _spec = _util.spec_from_file_location("cachewarm_warmer_hook", {warmer!r})
        _hook = _util.module_from_spec(_spec)
        _spec.loader.exec_module(_hook)
        _hook.child_hook()
except Exception as _exc:  # noqa: BLE001 - the program runs whatever happens here
    import sys as _sys

    print("cachewarm warmer: this process is not counted (%s: %s)" % (type(_exc).__name__, _exc), file=_sys.stderr)
try:
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in _sys.path if p and _os.path.realpath(p) != _here])
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["sitecustomize"] = _module
        try:
            _spec.loader.exec_module(_module)
        except Exception as _exc:  # noqa: BLE001 - as site.py: say so, go on
            print("Error in sitecustomize; set PYTHONVERBOSE for traceback:\\n%s: %s" % (type(_exc).__name__, _exc),
                  file=_sys.stderr)
except Exception:  # noqa: BLE001
    pass
'''


class _AfterJaxImport:
    """A meta path finder, first on sys.meta_path, for `jax` only: jax's own spec, with a
    loader that calls `then()` once jax's __init__ has run (jax.monitoring needs jax), then
    takes itself out. A process that never imports jax pays for nothing else."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "jax":
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                loader = spec.loader
                if loader is not None and hasattr(loader, "exec_module"):
                    hook = self

                    class Loader:
                        def create_module(self, s: Any) -> Any:
                            return loader.create_module(s)

                        def exec_module(self, module: Any) -> None:
                            loader.exec_module(module)
                            if getattr(module, "__loader__", None) is self:
                                module.__loader__ = loader
                            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                                module.__spec__.loader = loader
                            hook.fire()

                    spec.loader = Loader()
                return spec
        return None

    def fire(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            self.then()
        except Exception as exc:  # noqa: BLE001 - the program runs whatever happens here
            log("Could not count this process's JAX cache use", error=repr(exc))


def child_hook() -> None:
    """In a child process of the warmer (CHILD_SITECUSTOMIZE calls it at start-up): once
    jax is imported, count JAX's cache events and the keys looked up, and at exit write a
    record {"pid", "requests", "hits", "keys", "fingerprint"} into $CACHEWARM_CHILD_RECORDS.
    A process that never imported jax writes none. A forked child starts its own count."""
    import atexit  # noqa: PLC0415

    records = os.environ.get(ENV_CHILD_RECORDS, "")
    if not records:
        return
    state: dict[str, Any] = {"counters": Counters(), "used": UsedKeys(), "pid": os.getpid()}
    state["used"].install()

    def fresh() -> None:  # after fork: the parent's counts are the parent's
        state["counters"].events.clear()
        state["used"].keys.clear()
        state["used"].compiled.clear()
        state["pid"] = os.getpid()

    def write() -> None:
        if "jax" not in sys.modules or state["pid"] != os.getpid():
            return
        counters, used = state["counters"], state["used"]
        record = {"pid": os.getpid(), "argv": [str(a)[:200] for a in sys.argv[:8]], "requests": counters.requests,
                  "hits": counters.hits, "keys": sorted(used.keys),
                  "compiled": [used.compiled[k] for k in sorted(used.compiled)],
                  "fingerprint": fingerprint() if counters.requests else {}}
        path = os.path.join(records, f"{os.getpid()}-{time.monotonic_ns()}{CHILD_RECORD_SUFFIX}")
        try:
            with open(path + ".tmp", "w") as out:
                json.dump(record, out)
            os.replace(path + ".tmp", path)
        except OSError as exc:
            log("Could not record this process's JAX cache use", path=path, error=repr(exc))

    def after_jax() -> None:
        state["counters"].install()
        # Registered after jax's own import-time exit handlers, so it runs before them.
        atexit.register(write)

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=fresh)
    if "jax" in sys.modules:  # imported before the hook ran (a .pth file)
        after_jax()
    else:
        sys.meta_path.insert(0, _AfterJaxImport(after_jax))


class ChildHook:
    """The warmer's side: a private directory with CHILD_SITECUSTOMIZE and the records
    directory, and the env that puts them before a child (PYTHONPATH: this directory, then
    what the warmer's own was, the image's)."""

    def __init__(self) -> None:
        import tempfile  # noqa: PLC0415

        self.root = tempfile.mkdtemp(prefix="cachewarm-children-")
        self.site = os.path.join(self.root, "site")
        self.records = os.path.join(self.root, "records")
        os.mkdir(self.site)
        os.mkdir(self.records)
        with open(os.path.join(self.site, "sitecustomize.py"), "w") as out:
            out.write(CHILD_SITECUSTOMIZE.format(records=ENV_CHILD_RECORDS, warmer=os.path.abspath(__file__)))

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        own = environ.get("PYTHONPATH", "")
        return {**environ, "PYTHONPATH": self.site + (os.pathsep + own if own else ""),
                ENV_CHILD_RECORDS: self.records}

    def records_read(self) -> list[dict[str, Any]]:
        return read_child_records(self.records)

    def close(self) -> None:
        import shutil  # noqa: PLC0415

        shutil.rmtree(self.root, ignore_errors=True)


def read_child_records(folder: str) -> list[dict[str, Any]]:
    """The records child processes left in `folder`, each {"requests": int, "hits": int,
    "keys": [str], "fingerprint": dict}, in the order they were written; a file that is not
    such a record is skipped (said in the log)."""
    try:
        names = sorted((n for n in os.listdir(folder) if n.endswith(CHILD_RECORD_SUFFIX)),
                       key=lambda n: os.stat(os.path.join(folder, n)).st_mtime_ns)
    except OSError as exc:
        log("Could not read the child processes' records", folder=folder, error=repr(exc))
        return []
    out: list[dict[str, Any]] = []
    for name in names[:MAX_CHILD_RECORDS]:
        try:
            with open(os.path.join(folder, name)) as f:
                raw = json.loads(f.read(MAX_CHILD_RECORD_BYTES))
            record = {"requests": int(raw["requests"]), "hits": int(raw["hits"]),
                      "keys": [str(k) for k in raw["keys"]], "fingerprint": dict(raw.get("fingerprint") or {}),
                      "pid": int(raw.get("pid") or 0), "compiled": _compiled_records(raw.get("compiled"))}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log("Skipped a child process's record", file=name, error=repr(exc))
            continue
        out.append(record)
    return out


def _compiled_records(raw: Any) -> list[dict[str, Any]]:
    """A child record's `compiled` (UsedKeys.compiled's values), each checked; [] when it
    has none (a record of an older warmer) or is not a list."""
    out: list[dict[str, Any]] = []
    for one in raw[:MAX_COMPILED_KEPT] if isinstance(raw, list) else []:
        if isinstance(one, dict) and isinstance(one.get("program"), str) and isinstance(one.get("key"), str) and \
                isinstance(one.get("seconds"), (int, float)) and not isinstance(one.get("seconds"), bool):
            out.append({"program": one["program"], "key": one["key"], "seconds": float(one["seconds"]),
                        "written": one.get("written") is not False})
    return out


def compiled_programs(own: Iterable[Mapping[str, Any]], records: list[dict[str, Any]],
                      limit: int | None = MAX_COMPILED) -> list[dict[str, Any]]:
    """The summary's compiledPrograms: what each program this warm compiled took (this
    process's, `own`, and its children's records), each {"program" (at most 200 characters),
    "key" (the key's hash as `keys` names it; absent when not known), "compileSeconds",
    "written": whether JAX went on to write it}; one per key (a key compiled twice: the
    slower), the `limit` slowest first (None: all; those past MAX_COMPILED go to
    compiledRest, compiled_rest)."""
    by_key: dict[str, dict[str, Any]] = {}
    for one in [*own, *(c for r in records for c in r.get("compiled") or [])]:
        item = {"program": str(one["program"])[:200], "compileSeconds": round(float(one["seconds"]), 3),
                "written": bool(one["written"])}
        digest = key_hash(str(one["key"])) if not str(one["key"]).endswith("-") else ""
        if digest:
            item["key"] = digest
        name = digest or f"{item['program']}-"
        if name not in by_key or by_key[name]["compileSeconds"] < item["compileSeconds"]:
            by_key[name] = item
    return sorted(by_key.values(), key=lambda i: (-i["compileSeconds"], i["program"], i.get("key", "")))[:limit]


def compiled_rest(left_out: Sequence[Mapping[str, Any]], rest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary's compiledRest: the programs this warm compiled that compiledPrograms does
    not name (past its MAX_COMPILED slowest, or cut for the summary's size), added to an
    earlier `rest`: {"programs": how many, "maxSeconds": the longest any of them took}.
    Pods' hits of them are counted, as unmeasured, with that bound."""
    programs = int((rest or {}).get("programs") or 0) + len(left_out)
    longest = max([float((rest or {}).get("maxSeconds") or 0.0),
                   *(float(p.get("compileSeconds", p.get("seconds")) or 0.0) for p in left_out)])
    return {"programs": programs, "maxSeconds": round(longest, 3)} if programs else {}


def merge_fingerprints(own: Mapping[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The warm's fingerprint: this process's when it compiled (`own`, a python entrypoint
    run in process), else that of the child that compiled the most. Children whose
    fingerprints differ from it are counted in `otherFingerprints` (their keys are not the
    ones a pod like the first would compute)."""
    chosen = dict(own) if own else {}
    if not chosen:
        ranked = sorted((r for r in records if r["fingerprint"]), key=lambda r: -r["requests"])
        chosen = dict(ranked[0]["fingerprint"]) if ranked else {}
    others = sum(1 for r in records if r["fingerprint"] and r["fingerprint"] != chosen)
    if chosen and others:
        chosen["otherFingerprints"] = others
    return chosen


REFRESH_THREADS = 8  # customTime PATCHes in flight at once
# The env names the warmer reads besides JAX's own, spelled here only: the operator's builders
# import them (through cachewarm.api.constants).
ENV_MANIFEST = "CACHEWARM_MANIFEST"  # the pool's manifest, a gs:// URL
ENV_SUMMARY_FILE = "CACHEWARM_SUMMARY_FILE"  # where the summary goes (default /dev/termination-log)
MANIFEST_ENV = ENV_MANIFEST  # the older name, which tests/unit/test_job_builder.py reads
MANIFEST_VERSION = 2  # entries carry size, md5 (GCS md5Hash) and generation
_FILESYSTEM: Any = None


def gcs_filesystem() -> Any:
    """One gcsfs filesystem for the warmer's own GCS calls (refresh, manifest). gs://
    caches alone need it, and they have it (JAX's gs:// cache goes through etils/gcsfs).
    Raises what the import or the constructor raises."""
    global _FILESYSTEM  # noqa: PLW0603 - one per process, made on first use
    if _FILESYSTEM is None:
        import gcsfs  # noqa: PLC0415 - only gs:// caches need it, and they have it

        _FILESYSTEM = gcsfs.GCSFileSystem()
    return _FILESYSTEM


def refresh_last_use(url: str, keys: Iterable[str]) -> dict[str, Any]:
    """Move the customTime of the entries this run found or wrote to now. cachewarm's
    lifecycle rule deletes an entry deleteAfterDays after its customTime, so an entry every
    warm finds stays, and one no warm uses any more expires. gs:// caches only; only objects
    the directory listing shows (a miss below the write thresholds has no entry, and there
    is no -atime while jax's LRU is off). Process 0 alone calls it.

    Returns {"entriesRefreshed": -cache entries refreshed, "refreshFailed": PATCHes that
    failed, "refreshError": why, when the warmer's identity may not update objects (the
    first 403 stops the refresh: every other PATCH would be refused too)}."""
    out: dict[str, Any] = {"entriesRefreshed": 0, "refreshFailed": 0}
    keys = sorted(keys)
    if not url.startswith("gs://") or not keys:
        return out
    base = url[len("gs://"):].rstrip("/")
    try:
        fs = gcs_filesystem()
        try:
            listed = {str(p).rsplit("/", 1)[-1] for p in fs.ls(base, detail=False, refresh=True)}
        except FileNotFoundError:
            listed = set()  # nothing was written under the prefix
    except Exception as exc:  # noqa: BLE001
        log("Could not refresh customTime of entries", error=repr(exc))
        out["refreshFailed"] = len(keys)
        out["refreshError"] = f"could not list {url} to refresh customTime: {type(exc).__name__}: {exc}"[:300]
        return out
    t = time.time()
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    names = [f"{key}{suffix}" for key in keys for suffix in ("-cache", "-atime") if f"{key}{suffix}" in listed]
    denied = threading.Event()
    lock = threading.Lock()

    def one(name: str) -> None:
        if denied.is_set():
            with lock:
                out["refreshFailed"] += 1
            return
        try:
            fs.setxattrs(f"{base}/{name}", fixed_key_metadata={"custom_time": now})
        except Exception as exc:  # noqa: BLE001
            forbidden = isinstance(exc, PermissionError) or str(exc).startswith(("Forbidden", "Unauthorized"))
            with lock:
                out["refreshFailed"] += 1
                if forbidden and not denied.is_set():
                    denied.set()
                    out["refreshError"] = (
                        f"permission denied setting customTime of gs://{base}/{name}: the warmer's identity needs "
                        "storage.objects.update on the bucket (e.g. Storage Object User); entries in use will "
                        "expire deleteAfterDays after they were last refreshed")
            log("Could not refresh customTime", entry=name, error=repr(exc))
            return
        if name.endswith("-cache"):
            with lock:
                out["entriesRefreshed"] += 1

    with concurrent.futures.ThreadPoolExecutor(REFRESH_THREADS) as pool:
        list(pool.map(one, names))
    log("Refreshed customTime of entries found or written", entries=out["entriesRefreshed"],
        failed=out["refreshFailed"])
    return out


def manifest_pool(url: str) -> str:
    """The pool a manifest is for: the folder its object is in (the operator names it
    <...>/pools/<namespace>/<cache>/<pool>/<job>.json, one per warmer Job)."""
    parts = url.rstrip("/").split("/")
    return parts[-2] if len(parts) > 1 else ""


def _md5_base64(data: bytes) -> str:
    import base64  # noqa: PLC0415

    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - GCS's md5Hash form


def entry_digests(cache_url: str, names: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """The manifest's entries for `names` (objects directly under the gs:// cache
    directory): each {"name", "size", "md5", "generation"} as GCS lists it now, sorted by
    name, and how many were left out (not listed, or without md5Hash or generation: a
    composite object has no MD5). Raises what the listing raises."""
    base = cache_url[len("gs://"):].rstrip("/")
    listed = {str(o.get("name", "")).rsplit("/", 1)[-1]: o
              for o in gcs_filesystem().ls(base, detail=True, refresh=True) if isinstance(o, dict)}
    out: list[dict[str, Any]] = []
    for name in sorted(set(names)):
        obj = listed.get(name) or {}
        md5, generation, size = obj.get("md5Hash"), obj.get("generation"), obj.get("size")
        if isinstance(md5, str) and md5 and generation is not None and str(generation).isdigit() and \
                isinstance(size, int) and not isinstance(size, bool) and size >= 0:
            out.append({"name": name, "size": size, "md5": md5, "generation": str(generation)})
    return out, len(set(names)) - len(out)


def written_generation(path: str, data: bytes) -> str:
    """The generation of the object at `path` (bucket/name), read back from GCS, when it
    holds `data` (its MD5 and size): the manifest this warmer wrote, not one rewritten
    since. Raises ValueError when it does not, or what the read raises."""
    return generation_holding(path, _md5_base64(data), len(data))


def generation_holding(path: str, md5: str, size: int) -> str:
    """written_generation for bytes known by their MD5 (GCS's base64 form) and size."""
    fs = gcs_filesystem()
    fs.invalidate_cache(path)
    info = fs.info(path)
    generation = str(info.get("generation") or "")
    if info.get("md5Hash") != md5 or int(info.get("size") or -1) != size or not generation.isdigit():
        raise ValueError(f"gs://{path} does not hold the manifest just written (rewritten meanwhile?)")
    return generation


# Packs (issue 30): a pod's copy reads each entry its pools' manifests name, one GET per
# entry per pod start; a warm that caches every program can name hundreds of small entries
# (JAX's helper programs, small jitted functions: 2-100 KB each), so requests per start, times a
# fleet, grew with the program count (BENCHMARKS.md, requests per start). Process 0 therefore
# also writes ONE pack per manifest: the manifest's small entries (each at most
# PACK_ENTRY_BYTES, the smallest first, at most PACK_BYTES in all), back to back, read back
# from the bucket and kept only where their bytes are the MD5 the manifest records. The
# manifest names the pack (object, size, md5, generation) and marks its members
# (`"packed": true`); every entry is still an object of its own, which gs:// readers and
# copiers before packs read. A copier trusts no byte of the pack that the manifest's MD5 of
# the entry does not vouch for, and names come from the manifest, never from the pack.
# Format (stdlib reads it): PACK_MAGIC, then per member the line "<entry name> <size>\n" and
# its size bytes. JAX entries are already compressed, so the pack is not.
# Name: the manifest's, `.json` replaced by PACK_SUFFIX, in the pool's manifest folder: not a
# JAX entry (JAX reads `<key>-cache` directly under the prefix; this is in a sub-folder and
# does not end in -cache, so neither the operator's entry listing, nor a recursive listing for
# `-cache`, nor the copier's matchGlob listing takes it), nor a manifest (those end in .json).
# A retry of the same Job replaces it (as it does the manifest); packs of earlier Jobs stay
# for pods pinned to those manifests, written with a customTime so that a lifecycle rule
# naming PACK_SUFFIX expires them as it does entries (deleteAfterDays after the warm).
# Why 1 MiB: below it an entry costs its request more than its bytes (GCS's first byte takes
# ~30-50 ms, 1 MiB at ~100 MB/s per stream 10 ms); above it entries are accelerator
# executables of tens to hundreds of MB, which the copier fetches 16 at once at the floor's
# rate (bench/copier_floor.py), and a pack, one stream held in the copier's memory, would
# only serialise them. 64 MiB bounds what a copier holds in memory for a pack.
PACK_SUFFIX = ".cachewarm-pack"
PACK_MAGIC = b"cachewarm-pack 1\n"
PACK_ENTRY_BYTES = 1 << 20
PACK_BYTES = 64 << 20
PACK_MIN_ENTRIES = 2  # one entry in a pack saves no request
PACK_READ_THREADS = 16
PACK_MEMBER = re.compile(r"[A-Za-z0-9_.\-]{1,300}-[0-9a-f]{64}-cache")  # a JAX entry's name: no "/", no space


def pack_object(manifest: str) -> str:
    """The pack's object path (bucket/name) for the manifest at `manifest` (bucket/…/<job>.json)."""
    return (manifest[:-len(".json")] if manifest.endswith(".json") else manifest) + PACK_SUFFIX


def pack_bytes(members: Iterable[tuple[str, bytes]]) -> bytes:
    """The pack of these (entry name, bytes) members (see above). Raises ValueError for a
    name that is not a JAX entry's (a path separator, "..", a space: a reader must never be
    handed one)."""
    parts = [PACK_MAGIC]
    for name, data in members:
        if PACK_MEMBER.fullmatch(name) is None:
            raise ValueError(f"not an entry name for a pack: {name[:100]!r}")
        parts += [f"{name} {len(data)}\n".encode(), data]
    return b"".join(parts)


def pack_candidates(recorded: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The manifest entries a pack takes: each at most PACK_ENTRY_BYTES, the smallest first
    (by size, then name), at most PACK_BYTES in all. Pure."""
    out: list[Mapping[str, Any]] = []
    total = 0
    for item in sorted(recorded, key=lambda e: (int(e["size"]), str(e["name"]))):
        if int(item["size"]) > PACK_ENTRY_BYTES or total + int(item["size"]) > PACK_BYTES:
            continue
        out.append(item)
        total += int(item["size"])
    return out


def put_object(path: str, data: bytes, content_type: str, custom_time: bool = False) -> str:
    """Write `data` at `path` (bucket/name), with customTime now when asked (in the upload
    itself where gcsfs can, so only create rights are needed), and return its generation,
    read back (written_generation). Raises what gcsfs raises, or ValueError."""
    fs = gcs_filesystem()
    if not custom_time:
        fs.pipe_file(path, data, content_type=content_type)
    else:
        t = time.time()
        now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
        try:
            fs.pipe_file(path, data, content_type=content_type, fixed_key_metadata={"custom_time": now})
        except TypeError:  # a gcsfs older than fixed_key_metadata on uploads
            fs.pipe_file(path, data, content_type=content_type)
            fs.setxattrs(path, fixed_key_metadata={"custom_time": now})
    return written_generation(path, data)


def put_file(path: str, local: str, md5: str, size: int, custom_time: bool = False) -> str:
    """put_object for the bytes of the local file `local` (their MD5, GCS's base64 form, and
    size given), streamed from it: a torch archive of gigabytes is never held in memory."""
    fs = gcs_filesystem()
    kind = "application/octet-stream"
    if not custom_time:
        fs.put_file(local, path, content_type=kind)
    else:
        t = time.time()
        now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
        try:
            fs.put_file(local, path, content_type=kind, fixed_key_metadata={"custom_time": now})
        except TypeError:  # a gcsfs older than fixed_key_metadata on uploads
            fs.put_file(local, path, content_type=kind)
            fs.setxattrs(path, fixed_key_metadata={"custom_time": now})
    return generation_holding(path, md5, size)


def write_pack(manifest: str, recorded: list[dict[str, Any]], cache_url: str) -> dict[str, Any]:
    """Write the pack of manifest `manifest` (bucket/…/<job>.json) holding its small entries
    `recorded` (entry_digests', under the gs:// `cache_url`), each read from the bucket and
    taken only when its bytes have the recorded size and MD5 (rewritten since: left out,
    still listed alone). Returns the manifest's "pack" ({"name", "size", "md5",
    "generation"}) and the members' names under "members", or {} when fewer than
    PACK_MIN_ENTRIES would go in. Raises what reading or writing raises."""
    chosen = pack_candidates(recorded)
    if len(chosen) < PACK_MIN_ENTRIES:
        return {}
    base = cache_url[len("gs://"):].rstrip("/")
    fs = gcs_filesystem()

    def read(item: Mapping[str, Any]) -> tuple[str, bytes] | None:
        data = fs.cat_file(f"{base}/{item['name']}")
        if len(data) != int(item["size"]) or _md5_base64(data) != item["md5"]:
            log("Left an entry out of the pack: it changed since it was listed", entry=item["name"])
            return None
        return str(item["name"]), data

    with concurrent.futures.ThreadPoolExecutor(PACK_READ_THREADS) as pool:
        members = [m for m in pool.map(read, chosen) if m is not None]
    if len(members) < PACK_MIN_ENTRIES:
        return {}
    data = pack_bytes(members)
    path = pack_object(manifest)
    generation = put_object(path, data, "application/octet-stream", custom_time=True)
    return {"name": path.split("/", 1)[1], "size": len(data), "md5": _md5_base64(data), "generation": generation,
            "members": [name for name, _ in members]}


def write_manifest(url: str, entries: Iterable[str], fp: dict[str, Any] | None, cache_url: str = "",
                   own: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Write the pool's manifest: the entries (names ending in -cache, under the gs:// cache
    directory `cache_url`) this warm relied on, with GCS's size, md5Hash and generation of
    each (or, given `own`, those entries as the writer built them: nothing listed), so a pod's
    local copy takes only those and checks each; and, first, the pack of its
    small entries (write_pack), which the manifest names. gs:// only. Never raises:
    returns {"manifestEntries": n, "manifestGeneration": g[, "manifestLeftOut": k]
    [, "packEntries": m, "packBytes": b | , "packError": why]}, or {"manifestError": why}
    (the warm stands either way; a manifest without its pack too: pods then read each
    entry on its own)."""
    out: dict[str, Any] = {}
    try:
        if not url.startswith("gs://") or not cache_url.startswith("gs://"):
            raise ValueError(f"{ENV_MANIFEST} and the cache directory must be gs:// URLs")
        if own is None:
            recorded, left_out = entry_digests(cache_url, entries)
        else:  # the writer's own entries (a torch archive: its bytes' size and MD5, the generation read back)
            recorded, left_out = sorted((dict(e) for e in own), key=lambda e: str(e["name"])), 0
        path = url[len("gs://"):]
        try:
            pack = write_pack(path, recorded, cache_url)
        except Exception as exc:  # noqa: BLE001 - without a pack pods read each entry on its own
            log("Could not write the pack", url=url, error=repr(exc))
            out["packError"] = f"could not write the pack of {url}: {type(exc).__name__}: {exc}"[:300]
            pack = {}
        members = set(pack.pop("members", ()))
        manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "pool": manifest_pool(url),
            "entries": [{**e, "packed": True} if e["name"] in members else e for e in recorded],
            "writtenTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if pack:
            manifest["pack"] = pack
        if fp:
            manifest["fingerprint"] = fp
        data = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
        generation = put_object(path, data, "application/json")
    except Exception as exc:  # noqa: BLE001 - the manifest helps pods copy less; never fatal
        log("Could not write the manifest", url=url, error=repr(exc))
        return {"manifestError": f"could not write the manifest {url}: {type(exc).__name__}: {exc}"[:300]}
    log("Wrote the manifest", url=url, entries=len(recorded), generation=generation, leftOut=left_out,
        packed=len(members), packBytes=pack.get("size", 0))
    out.update(manifestEntries=len(recorded), manifestGeneration=generation)
    if left_out:
        out["manifestLeftOut"] = left_out
    if pack:
        out.update(packEntries=len(members), packBytes=pack["size"])
    return out


# Unstable keys (issue 30): a program (a key's module name) that gets a new key while the
# fingerprint is the same. JAX's key hashes the program's HLO, and some programs carry a
# per-process value in it (a custom_partitioning primitive's callback pointer, with jax 0.10
# on more than one device): each process computes another key, so no pod ever hits the
# entry a warmer wrote, and each warm adds one more. The warmer sees it two ways:
# - across runs: this pool's previous manifest (the newest in the pool's folder, written by
#   an earlier warmer Job of the pool, with the same fingerprint) names an entry of the
#   program that this warm did not use, and this warm wrote one of its own;
# - within a run: two processes that ran the same programs (the same module names, the same
#   fingerprint, e.g. a launcher's workers) looked the program up under different keys.
# It says so in the summary (`unstablePrograms`). Across runs the same signs follow a program
# whose code or shapes changed between warms with the same image fingerprint (a new image
# of the training program): the status says both causes. It deletes nothing (the reviews:
# a manifest also names entries the warm only found, which may be another cache's on a
# shared prefix, and pods on the older image still use the older entry): the older entry is
# no longer refreshed by warmers and expires by the cache's lifecycle rule, so such entries
# do not pile up past deleteAfterDays.
MAX_UNSTABLE = 5  # programs named in a summary (write_summary may name fewer)
MAX_UNSTABLE_KEYS = 4  # key hashes named per program, the newest
MAX_MANIFEST_READ = 4 << 20
KEY_SHAPE = re.compile(r"[A-Za-z0-9_.\-]{1,300}-[0-9a-f]{16,128}")  # <module name>-<hash>, no "/"


def program_of(key: str) -> str:
    """The program a cache key is for: its module name, the key without the final -<hash>."""
    return key.rsplit("-", 1)[0]


def previous_manifest(url: str) -> dict[str, Any] | None:
    """The newest manifest in the pool's folder (the folder of `url`, this Job's manifest,
    not written yet in this run): the previous warm's. None when there is none, or it
    cannot be read (said in the log)."""
    if not url.startswith("gs://"):
        return None
    folder = url[len("gs://"):].rsplit("/", 1)[0]
    try:
        listed = [o for o in gcs_filesystem().ls(folder, detail=True, refresh=True)
                  if isinstance(o, dict) and str(o.get("name", "")).endswith(".json") and o.get("type") != "directory"]
        if not listed:
            return None
        newest = max(listed, key=lambda o: (str(o.get("updated") or ""), str(o.get("name"))))
        if int(newest.get("size") or 0) > MAX_MANIFEST_READ:
            raise ValueError(f"{newest.get('name')} is over {MAX_MANIFEST_READ} bytes")
        data = json.loads(gcs_filesystem().cat_file(str(newest["name"])))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the warm
        log("Could not read the pool's previous manifest", folder=folder, error=repr(exc))
        return None


def _same_fingerprint(one: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    def strip(fp: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in fp.items() if k != "otherFingerprints"}
    return bool(one) and strip(one) == strip(other)


def unstable_programs(previous: Mapping[str, Any] | None, fp: Mapping[str, Any], used: set[str],
                      written: set[str], processes: list[tuple[Mapping[str, Any], set[str]]]
                      ) -> tuple[list[dict[str, Any]], set[str]]:
    """The programs whose key is unstable (see above), each {"program", "keys" (key hashes;
    across runs the older first), "seen": "runs" or "processes"}, sorted by program; and the older keys to
    remove. `previous`: the previous manifest; `used`: the keys this warm looked up or
    wrote; `written`: those it wrote; `processes`: each process's (fingerprint, keys)."""
    found: dict[str, dict[str, Any]] = {}
    stale: set[str] = set()
    entries = (previous or {}).get("entries")
    if previous is not None and isinstance(entries, list) and _same_fingerprint(fp, previous.get("fingerprint") or {}):
        older = {str(e.get("name", "")).removesuffix("-cache") for e in entries if isinstance(e, dict)}
        older = {k for k in older if KEY_SHAPE.fullmatch(k)} - used
        for key in sorted(written):
            old = sorted(k for k in older if program_of(k) == program_of(key))
            if old:
                item = found.setdefault(program_of(key), {"program": program_of(key), "keys": old, "seen": "runs"})
                item["keys"] = [*item["keys"], key]
                stale.update(old)
    by_names: dict[str, list[dict[str, set[str]]]] = {}
    for process_fp, keys in processes:
        programs: dict[str, set[str]] = {}
        for key in keys:
            programs.setdefault(program_of(key), set()).add(key)
        if process_fp and programs:
            identity = json.dumps([sorted(programs), process_fp], sort_keys=True, default=str)
            by_names.setdefault(identity, []).append(programs)
    for group in by_names.values():
        for name in sorted(group[0]):
            if name not in found and len({frozenset(p[name]) for p in group}) > 1:
                found[name] = {"program": name, "keys": sorted(set().union(*(p[name] for p in group))),
                               "seen": "processes"}
    out = [{**item, "program": item["program"][:100],
            "keys": [key_hash(k) for k in item["keys"]][-MAX_UNSTABLE_KEYS:]} for _, item in sorted(found.items())]
    return out[:MAX_UNSTABLE], stale


def remove_manifest(url: str) -> dict[str, Any]:
    """Remove the pool's manifest: this warm cannot name the entries it relied on (an
    entrypoint in a child process), and an older manifest names an older program's; without
    one, a pod's local copy takes the whole prefix. Never raises: returns {} (removed, or
    there was none) or {"manifestError": why}."""
    try:
        if not url.startswith("gs://"):
            raise ValueError(f"{ENV_MANIFEST} must be a gs:// URL")
        try:
            gcs_filesystem().rm_file(url[len("gs://"):])
        except FileNotFoundError:
            return {}
    except Exception as exc:  # noqa: BLE001 - never fatal, as write_manifest
        log("Could not remove the manifest", url=url, error=repr(exc))
        return {"manifestError": f"could not remove the manifest {url}: {type(exc).__name__}: {exc}"[:300]}
    log("Removed the manifest: this warm cannot name its entries", url=url)
    return {}


def _items(produced: Any) -> Iterator[Any]:
    if produced is None:
        return iter(())
    if isinstance(produced, (list, tuple)) and produced and callable(getattr(produced[0], "lower", None)):
        return iter([produced])  # a single (fn, args) tuple
    if isinstance(produced, Iterable) and not hasattr(produced, "compile"):
        return iter(produced)
    return iter([produced])


def _compile(item: Any) -> str:
    """Compile one target item; returns a display name. Raises what the compile raises."""
    if hasattr(item, "compile") and hasattr(item, "as_text"):  # jax.stages.Lowered
        lowered = item
    elif isinstance(item, (list, tuple)) and item and hasattr(item[0], "lower"):
        fn, args = item[0], tuple(item[1]) if len(item) > 1 else ()
        kwargs = dict(item[2]) if len(item) > 2 else {}
        lowered = fn.lower(*args, **kwargs)
    else:
        raise TypeError(f"expected jax.stages.Lowered or (jitted_fn, args[, kwargs]), got {type(item).__name__}")
    name = getattr(item[0], "__name__", None) if isinstance(item, (list, tuple)) else None
    lowered.compile()
    return name or "lowered"


def load_target(spec: str) -> Any:
    """Import "module:callable" (the callable may be dotted) and return the callable."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {spec!r} is not module:callable")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_targets(targets: list[str], parallel: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Compile every item of every target. Returns (per-target results, errors)."""
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    work: list[tuple[str, int, Any]] = []
    for spec in targets:
        try:
            produced = load_target(spec)()
            items = list(_items(produced))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{spec}: {type(exc).__name__}: {exc}")
            log("Target failed to load", target=spec, error=repr(exc))
            traceback.print_exc(file=sys.stderr)
            continue
        if not items:
            errors.append(f"{spec}: produced nothing to compile")
        work.extend((spec, i, item) for i, item in enumerate(items))
    log("Compiling", programs=len(work), parallel=parallel)

    def one(entry: tuple[str, int, Any]) -> dict[str, Any]:
        spec, index, item = entry
        t0 = time.monotonic()
        name = _compile(item)
        seconds = round(time.monotonic() - t0, 3)
        log("Compiled", target=spec, item=index, program=name, seconds=seconds)
        return {"target": spec, "item": index, "seconds": seconds}

    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = {pool.submit(one, entry): entry for entry in work}
        for future in concurrent.futures.as_completed(futures):
            spec, index, _ = futures[future]
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{spec}[{index}]: {type(exc).__name__}: {exc}")
                log("Compile failed", target=spec, item=index, error=repr(exc))
    return results, errors


def in_process(argv: list[str]) -> bool:
    """Whether the entrypoint runs in this process: `python FILE ...` and `python -m MODULE
    ...` (no other option before them). Anything else (python -c, python -u FILE, a shell
    wrapper, a launcher) runs as a child, counted by its records (ChildHook)."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


def entrypoint(argv: Sequence[str]) -> list[str]:
    """The entrypoint of `command -- ENTRYPOINT...` as argparse leaves it: without the
    leading "--" (the separator), every later "--" kept (the entrypoint's own). Pure."""
    argv = list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def run_command(argv: list[str], child_env: Mapping[str, str] | None = None) -> int:
    """Run the entrypoint: a python one in this process (JAX counters visible), else a child.
    `child_env`: the environment for child processes (ChildHook.env); an in-process
    entrypoint's own children get its PYTHONPATH and records directory (os.environ's two
    values are put back after)."""
    if not argv:
        raise ValueError("command mode needs the entrypoint after --")
    if child_env is None:
        child_env = dict(os.environ)
    if in_process(argv):
        saved = sys.argv
        saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_CHILD_RECORDS)}
        os.environ.update({k: v for k, v in child_env.items() if k in saved_env})
        try:
            if argv[1] == "-m" and len(argv) > 2:
                sys.argv = [argv[2], *argv[3:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv[1:]
                runpy.run_path(argv[1], run_name="__main__")
        except SystemExit as exc:
            code = exc.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        finally:
            sys.argv = saved
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return 0
    return subprocess.call(argv, env=dict(child_env))


def key_flags() -> list[str]:
    """The XLA flags that go into this process's cache keys, as JAX gathers them: XLA_FLAGS,
    LIBTPU_INIT_ARGS and --xla arguments, sorted, without the ones JAX leaves out."""
    flags = [*(os.environ.get("XLA_FLAGS") or "").split(), *(os.environ.get("LIBTPU_INIT_ARGS") or "").split(),
             *(a for a in sys.argv if a.startswith("--xla"))]
    excluded = getattr(sys.modules.get("jax._src.cache_key"), "xla_flags_to_exclude_from_cache_key", None)
    skip = set(excluded) if isinstance(excluded, (list, tuple, set)) else set(KEY_EXCLUDED_FLAGS)
    return sorted(f for f in flags if f.split("=")[0] not in skip)


def fingerprint() -> dict[str, Any]:
    """What this process's cache keys depend on besides the program itself: versions of
    jax, jaxlib and the PJRT plugins, the platform and device kind, device and process
    counts, the TPU topology, the XLA flags (a hash), and the cache directory JAX uses. A
    pod whose fingerprint differs from the warmer's computes other keys. Empty when jax was
    never imported here; never raises (a part it could not read becomes `error`)."""
    jax: Any = sys.modules.get("jax")
    if jax is None:
        return {}
    out: dict[str, Any] = {"jax": str(getattr(jax, "__version__", ""))}
    try:
        for dist in ("jaxlib", *PLUGIN_DISTRIBUTIONS):
            try:
                out.setdefault("versions", {})[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        flags = key_flags()
        out["flagsHash"] = hashlib.sha256("\n".join(flags).encode()).hexdigest()[:12]
        out["flagCount"] = len(flags)
        out["cacheDir"] = str(jax.config.jax_compilation_cache_dir or "")
        devices = jax.devices()
        out["platform"] = str(devices[0].platform)
        version = getattr(getattr(devices[0], "client", None), "platform_version", None)
        if version:
            out["platformVersion"] = str(version)[:200]  # the CUDA or libtpu build, as keys have it
        out["deviceKind"] = str(devices[0].device_kind)
        out["devices"] = int(jax.device_count())
        out["processes"] = int(jax.process_count())
        coords: list[Any] = [getattr(d, "coords", None) for d in devices]
        if coords and all(isinstance(c, (list, tuple)) and c for c in coords):  # TPU devices have coordinates
            out["topology"] = "x".join(str(max(int(c[i]) for c in coords) + 1) for i in range(len(coords[0])))
    except Exception as exc:  # noqa: BLE001 - a fingerprint is a report, never a reason to fail
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


# torch.compile caches (issue 31). With CACHEWARM_FRAMEWORK=torch the warm runs the torch
# way (torch imported only then): the entrypoint or targets run with TORCHINDUCTOR_CACHE_DIR
# on a local directory, and process 0 uploads that directory, as the warm left it, as ONE
# archive `torch-inductor-<sha256 of its bytes>-cache` under CACHEWARM_CACHE_URL (a JAX
# entry's shape: the copier's, the operator's listing and the lifecycle rules take it as
# one), and the manifest naming it. On CPU there is no device index in Inductor's keys, so
# process 0's directory serves every rank; on GPU a rank with another device index may miss.
ENV_FRAMEWORK = "CACHEWARM_FRAMEWORK"  # "torch": a torch cache's warmer and pods
ENV_CACHE_URL = "CACHEWARM_CACHE_URL"  # gs://bucket[/prefix]: where the torch warmer uploads
ENV_TORCH_MAX_ARCHIVE_BYTES = "CACHEWARM_TORCH_MAX_ARCHIVE_BYTES"
TORCH_ARCHIVE_PREFIX = "torch-inductor-"
TORCH_MAX_ARCHIVE_BYTES = 4 << 30  # the CRD's default maxArchiveSize: the uncompressed bytes of one archive
TORCH_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_")
TORCH_ENV_OPERATORS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # set by the operator, alike in both
TORCH_MAX_NAMES = 20
TORCH_MAX_VALUE = 100


# Temporary names that torch and the copier leave in the directory (a warm or a copy stopped
# mid-write), never an entry: Inductor's write_atomic writes `.<pid>.<thread>.tmp` beside the
# file (torch/_inductor/codecache.py), Triton a folder `tmp.pid_<pid>_<uuid>` in its cache
# (triton/runtime/cache.py) and names ending `.tmp.pid_<pid>_<uuid>` (triton/compiler/compiler.py),
# the copier `.cachewarm.tmp-<pid>-<hex>` (copier.TORCH_TEMP_PREFIX). Entries' own names are
# content hashes (base32 or hex), which may start with "tmp": those are kept.
TORCH_TEMP_NAME = re.compile(r"^\..*\.tmp$|^tmp\.pid_|\.tmp\.pid_|^\.cachewarm\.tmp-")


def torch_member_kept(relative: str, is_dir: bool) -> bool:
    """Whether the archive takes the directory's member `relative` ("a/b", "/"-separated):
    not the `locks` directory nor anything under it, no `*.lock`, nothing under a temporary
    name (TORCH_TEMP_NAME) nor in a temporary folder. Pure."""
    parts = relative.split("/")
    if parts[0] == "locks":
        return False
    if not is_dir and parts[-1].endswith(".lock"):
        return False
    return not any(TORCH_TEMP_NAME.search(part) for part in parts)


def torch_members(directory: str) -> list[tuple[str, os.stat_result]]:
    """The members the archive of `directory` takes (relative name, lstat), sorted by name:
    only regular files and directories (links, devices, FIFOs are left out, never followed),
    the exclusions of torch_member_kept. Raises OSError."""
    import stat  # noqa: PLC0415 - torch caches alone need it

    found: list[tuple[str, os.stat_result]] = []
    for root, dirs, leaves in os.walk(directory, followlinks=False):
        for name in dirs + leaves:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            st = os.lstat(path)
            is_dir = stat.S_ISDIR(st.st_mode)
            if not (is_dir or stat.S_ISREG(st.st_mode)) or not torch_member_kept(relative, is_dir):
                continue
            found.append((relative, st))
        dirs[:] = [d for d in dirs if torch_member_kept(
            os.path.relpath(os.path.join(root, d), directory).replace(os.sep, "/"), True)]
    return sorted(found)


def torch_archive_into(directory: str, found: Sequence[tuple[str, os.stat_result]], out: Any,
                       limit: int | None = None) -> int:
    """The gzip'd PAX tar of `found` (torch_members of `directory`) written to the binary
    file object `out`: members sorted by path, relative names, mode 0o644 (files) or 0o755
    (directories), files' mtime kept (directories' 0), uid/gid 0, no owner names; the gzip
    header without a name or time, so the same directory gives the same bytes. Each file is
    read as it is when opened (its size then); past `limit` uncompressed bytes in all
    (a file grown since the walk): ValueError. Returns the files written. Raises OSError."""
    import gzip  # noqa: PLC0415 - torch caches alone need them
    import stat  # noqa: PLC0415
    import tarfile  # noqa: PLC0415

    files = total = 0
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, st in found:
            info = tarfile.TarInfo(relative)
            info.mtime = int(st.st_mtime)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if stat.S_ISDIR(st.st_mode):
                # A directory's mtime says when it last got a file, not what it holds: 0, so that a
                # directory seeded from an archive archives to the same bytes again.
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                tar.addfile(info)
                continue
            info.type, info.mode = tarfile.REGTYPE, 0o644
            with open(os.path.join(directory, relative), "rb") as source:
                info.size = os.fstat(source.fileno()).st_size
                total += info.size
                if limit is not None and total > limit:
                    raise ValueError(f"{directory} grew past maxArchiveSize ({limit} bytes) while archived")
                tar.addfile(info, source)
            files += 1
    return files


def torch_archive(directory: str) -> tuple[bytes, int]:
    """The archive of `directory` (torch_members, torch_archive_into) in memory, and its
    files: for tests and small directories (the warmer streams it to a file). Raises OSError."""
    import io  # noqa: PLC0415

    raw = io.BytesIO()
    files = torch_archive_into(directory, torch_members(directory), raw)
    return raw.getvalue(), files


class _Hashing:
    """A binary file object that writes through to `out`, hashing (SHA-256, MD5) and counting."""

    def __init__(self, out: Any) -> None:
        self.out, self.size = out, 0
        self.sha256, self.md5 = hashlib.sha256(), hashlib.md5()  # noqa: S324 - GCS's md5Hash

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.md5.update(data)
        self.size += len(data)
        return int(self.out.write(data))

    def flush(self) -> None:
        self.out.flush()


# An env name like these holds a secret (a token in TRITON_*, say): its value enters the
# fingerprint (compared) only as a hash, never shown in status, conditions or Events.
TORCH_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)


def _plain(text: str) -> str:
    """`text` as valid UTF-8 (an undecodable env byte becomes "?"), at most TORCH_MAX_VALUE characters."""
    return text.encode("utf-8", "replace").decode("utf-8")[:TORCH_MAX_VALUE]


def _torch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The env names that enter torch's keys (TORCH_ENV_PREFIXES, but the operator's
    TORCH_ENV_OPERATORS), at most TORCH_MAX_NAMES, names and values cut to TORCH_MAX_VALUE
    (the report store's bounds); the value of a name that looks like a secret's
    (TORCH_SECRET_NAME) as "sha256:<its first 12 hex>": still compared, never shown."""
    names = sorted(k for k in environ if k.startswith(TORCH_ENV_PREFIXES) and k not in TORCH_ENV_OPERATORS)
    out: dict[str, str] = {}
    for name in names[:TORCH_MAX_NAMES]:
        value = environ[name]
        if TORCH_SECRET_NAME.search(name):
            value = "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        out[_plain(name)] = _plain(value)
    return out


def _torch_module(name: str) -> Any:
    """torch's module `name` as this process loaded it (torch.compile loads them with its
    first compile). Nothing of torch is imported here: the agents never load more of the
    image's torch than its program did. Raises LookupError when it is not loaded."""
    module = sys.modules.get(name)
    if module is None:
        raise LookupError(f"{name} is not loaded (nothing was compiled in this process)")
    return module


def torch_fingerprint(warmer: bool = False) -> dict[str, Any]:
    """What a torch process's Inductor keys depend on besides the program: torch's and
    Triton's versions, platform (cpu, cuda, rocm) and its version, the device's name and the
    device count (the warmer's, or where torch.cuda is already initialized: asking would
    initialize it, so a process that has not is "cpu"), a hash of Inductor's portable config and the settings that differ from
    their defaults, the env that sets them (an env value is a config's default, so only the
    env tells it), torch's own source hash, and TORCHINDUCTOR_CACHE_DIR. {} when torch was
    never imported here; never raises (a part it could not read becomes `error`)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return {}
    out: dict[str, Any] = {"framework": "torch", "versions": {"torch": str(getattr(torch, "__version__", ""))}}
    try:
        out["inductorEnv"] = _torch_env(os.environ)
        out["cacheDir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
        try:
            out["versions"]["triton"] = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            pass
        version = getattr(torch, "version", None)
        # is_available() and device_count() initialize the CUDA driver (cuInit), which a
        # reporter's thread must not do in a process that has not (it may fork after, and a
        # forked child of an initialized driver fails): only the warmer, or where torch already
        # did. A process that has not touched CUDA compiled for the CPU.
        cuda = bool((warmer or getattr(torch.cuda, "is_initialized", lambda: False)()) and torch.cuda.is_available())
        hip = getattr(version, "hip", None)
        out["platform"] = ("rocm" if hip else "cuda") if cuda else "cpu"
        if cuda:
            out["platformVersion"] = str(hip or getattr(version, "cuda", "") or "")[:200]
            out["deviceKind"] = str(torch.cuda.get_device_name(0))[:200]
            out["devices"] = int(torch.cuda.device_count())
        else:
            out["deviceKind"], out["devices"] = "cpu", 1
        codecache, inductor_config = _torch_module("torch._inductor.codecache"), _torch_module("torch._inductor.config")
        portable = inductor_config.save_config_portable()
        out["inductorConfigHash"] = hashlib.sha256(repr(sorted(portable.items())).encode()).hexdigest()[:12]
        defaults = getattr(inductor_config, "_config", {})
        changed: dict[str, str] = {}
        for key in sorted(portable):
            entry = defaults.get(key)
            default = getattr(entry, "default", portable[key])
            if portable[key] != default and len(changed) < TORCH_MAX_NAMES:
                changed[key] = repr(portable[key])[:60]
        out["inductorChanged"] = changed
        out["torchKey"] = codecache.torch_key().hex()[:16]
    except Exception as exc:  # noqa: BLE001 - a fingerprint is a report, never a reason to fail
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def key_hash(key: str) -> str:
    """How a summary names a cache entry: the first 16 hex digits of the hash its key ends
    in (`jit_step-<sha256>`), enough to tell a prefix's entries apart, short enough for
    about 200 of them in the termination message."""
    return key.rsplit("-", 1)[-1][:KEY_HASH_CHARS]


def image_pythonpath(environ: Mapping[str, str]) -> dict[str, str]:
    """{"imagePythonPath": PYTHONPATH} ("" when unset) for the summary, or {} when it is
    longer than IMAGE_PYTHONPATH_LIMIT characters or not valid text (undecodable bytes):
    status could not hold it as it is, and a cut one would name other directories."""
    value = environ.get("PYTHONPATH", "")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return {}
    return {"imagePythonPath": value} if len(value) <= IMAGE_PYTHONPATH_LIMIT else {}


COMPILED_KEPT_BEFORE_KEYS = 4  # compiledPrograms kept while keys are cut (the slowest compiles)


def write_summary(summary: dict[str, Any]) -> None:
    """Write the summary as JSON within SUMMARY_LIMIT characters: errors and targets are
    cut first, then a torch fingerprint's inductorChanged and inductorEnv (the last names
    first, `fingerprintCut` said in it), then compiledPrograms down to COMPILED_KEPT_BEFORE_KEYS (the fastest
    compiles first, counted in compiledRest), then keys (said so), then the rest of compiledPrograms, then
    unstablePrograms; imagePythonPath (at most 1000
    characters) survives them, and is left out only when the summary would not be whole
    JSON otherwise."""
    text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    if len(text) > SUMMARY_LIMIT:
        summary = {**summary, "errors": [e[:200] for e in summary.get("errors", [])[:3]], "targets": []}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    fp = summary.get("fingerprint")
    while len(text) > SUMMARY_LIMIT and isinstance(fp, dict) and (fp.get("inductorChanged") or fp.get("inductorEnv")):
        # A torch fingerprint at its bounds (20 env names and 20 config values of 100
        # characters) is near the limit alone: its last names go, said so (fingerprintCut).
        field = "inductorChanged" if fp.get("inductorChanged") else "inductorEnv"
        fp = {**fp, field: dict(list(fp[field].items())[:-1]), "fingerprintCut": True}
        summary = {**summary, "fingerprint": fp}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    keys = list(summary.get("keys") or [])
    compiled = list(summary.get("compiledPrograms") or [])
    while len(text) > SUMMARY_LIMIT and len(compiled) > COMPILED_KEPT_BEFORE_KEYS:
        compiled = compiled[:-1]  # the fastest compiles go first (the list is slowest first)
        summary = {**summary, "compiledPrograms": compiled,
                   "compiledRest": compiled_rest(summary["compiledPrograms"][-1:], summary.get("compiledRest"))}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    while len(text) > SUMMARY_LIMIT and keys:
        # Fewer keys, said so: the operator checks those reported, and knows the count.
        keys = keys[: len(keys) * 3 // 4]
        summary = {**summary, "keys": keys, "keysTruncated": True}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    while len(text) > SUMMARY_LIMIT and summary.get("compiledPrograms"):
        summary = {**summary, "compiledPrograms": summary["compiledPrograms"][:-1],
                   "compiledRest": compiled_rest(summary["compiledPrograms"][-1:], summary.get("compiledRest"))}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    while len(text) > SUMMARY_LIMIT and summary.get("unstablePrograms"):
        summary = {**summary, "unstablePrograms": summary["unstablePrograms"][:-1]}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    if len(text) > SUMMARY_LIMIT and "imagePythonPath" in summary:
        # Only here (e.g. a non-ASCII path, which JSON escapes to several times its length):
        # without it the webhook falls back; cut, the whole summary would be lost.
        summary = {k: v for k, v in summary.items() if k != "imagePythonPath"}
        text = json.dumps(summary, separators=(",", ":"), sort_keys=True)
    if len(text) > SUMMARY_LIMIT:
        text = summary_at_last(summary)
    path = os.environ.get(ENV_SUMMARY_FILE, "/dev/termination-log")
    try:
        with open(path, "w") as out:
            out.write(text)
    except OSError as exc:
        log("Could not write the summary", path=path, error=repr(exc))
    print(text, flush=True)


# What a summary keeps to the last (summary_at_last): what the operator records from a warm.
SUMMARY_KEPT_AT_LAST = ("mode", "processIndex", "cacheDir", "programs", "entriesFound", "entriesWritten",
                        "bytesWritten", "compileSeconds", "keys", "keyCount", "keysTruncated", "compiledPrograms",
                        "compiledRest", "manifestEntries", "manifestGeneration", "torch")


def summary_at_last(summary: Mapping[str, Any]) -> str:
    """The summary as whole JSON within SUMMARY_LIMIT when write_summary's cuts were not
    enough (text fields at their bounds, and non-ASCII, which JSON writes as six characters
    each): the largest fields the operator does not record go first (said: summaryCut),
    then all but SUMMARY_KEPT_AT_LAST. Never a cut string: a summary that is not JSON is no
    summary, and the operator would record nothing of the warm. Pure."""
    out = {**summary, "summaryCut": True}
    text = json.dumps(out, separators=(",", ":"), sort_keys=True)
    while len(text) > SUMMARY_LIMIT:
        # The fingerprint (KeysMatch reads it) goes only after every other field not kept.
        rest = [k for k in out if k not in SUMMARY_KEPT_AT_LAST and k not in ("summaryCut", "fingerprint")]
        if not rest and "fingerprint" in out:
            rest = ["fingerprint"]
        if not rest:
            break
        del out[max(rest, key=lambda k: (len(json.dumps(out[k])), k))]
        text = json.dumps(out, separators=(",", ":"), sort_keys=True)
    if len(text) > SUMMARY_LIMIT:
        out = {"summaryCut": True, **{k: summary[k] for k in ("mode", "processIndex", "entriesWritten",
                                                               "manifestGeneration") if k in summary}}
        text = json.dumps(out, separators=(",", ":"), sort_keys=True)[:SUMMARY_LIMIT]
    return text


def process_index() -> int:
    """This host's index in a multi-host warmer (JAX_PROCESS_ID, which the Job sets from
    the pod's completion index); 0 on a single host."""
    try:
        return int(os.environ.get("JAX_PROCESS_ID") or 0)
    except ValueError:
        return 0


def multi_host() -> bool:
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) and int(os.environ.get("JAX_NUM_PROCESSES") or 1) > 1


def initialize_distributed() -> bool:
    """targets mode on a multi-host pool: join the JAX distributed runtime, once. (jax's
    initialize() reads only the coordinator address from the env; the process count and
    id are passed here.) Returns whether it initialized. Raises what jax raises."""
    if not multi_host():
        return False
    import jax  # noqa: PLC0415

    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    log("Joined the JAX distributed runtime", process=os.environ["JAX_PROCESS_ID"],
        processes=os.environ["JAX_NUM_PROCESSES"])
    return True


def distributed_by_entrypoint() -> bool:
    """Whether an in-process entrypoint joined the JAX distributed runtime (then the
    warmer leaves it together with the other processes before exiting)."""
    jax = sys.modules.get("jax")
    is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


def shutdown_distributed() -> None:
    """Leave the runtime together (a barrier), so process 0, which hosts the coordinator,
    does not exit while the others still need it."""
    import jax  # noqa: PLC0415

    try:
        jax.distributed.shutdown()  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - the work is done; say so and exit normally
        log("Could not shut down the JAX distributed runtime cleanly", error=repr(exc))


def check_unstable(manifest: str, fp: Mapping[str, Any], cache_url: str, used: set[str], written: set[str],
                   processes: list[tuple[Mapping[str, Any], set[str]]]) -> dict[str, Any]:
    """The summary's unstablePrograms: unstable_programs against the pool's previous
    manifest (`manifest`: this Job's, "" for none). {} when no program is unstable. Nothing
    is deleted: an older entry of such a program is no longer refreshed by warmers and
    expires by the cache's lifecycle rule (deleteAfterDays)."""
    unstable, _ = unstable_programs(previous_manifest(manifest) if manifest else None, fp, used, written,
                                    processes)
    if not unstable:
        return {}
    for item in unstable:
        log("A program got a new key with the same fingerprint", program=item["program"], seen=item["seen"],
            keys=",".join(item["keys"]))
    return {"unstablePrograms": unstable}


def run_counted(command: list[str]) -> tuple[int, list[dict[str, Any]]]:
    """run_command with child processes counted (ChildHook): its exit status and the
    children's records. Without a private directory (no writable temporary directory) the
    children run uncounted, as before issue 30."""
    try:
        hook = ChildHook()
    except OSError as exc:
        log("Could not prepare counting child processes; they run uncounted", error=repr(exc))
        return run_command(command), []
    try:
        code = run_command(command, hook.env(os.environ))
        records = hook.records_read()
    finally:
        hook.close()
    if records:
        log("Counted child processes", processes=len(records), programs=sum(r["requests"] for r in records))
    return code, records


# torch's compile seconds: every frame's compile (dynamo, AOT, Inductor's forward), the lazy backward
TORCH_COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")


def torch_counts() -> dict[str, Any]:
    """torch's own cache counters and compile seconds in this process (the summary's and
    the reporter's `torch`); {} when torch was never imported. Never raises."""
    if "torch" not in sys.modules:
        return {}
    try:
        utils = _torch_module("torch._dynamo.utils")
        # Read with .get(): counters is a defaultdict, and indexing one inserts a key, from the
        # reporter's polling thread while torch's own threads may iterate it.
        inductor, aot = utils.counters.get("inductor") or {}, utils.counters.get("aot_autograd") or {}
        seconds = sum(float(s) for name in TORCH_COMPILE_METRICS
                      for s in list(utils.compilation_time_metrics.get(name, [])))
        return {"fxGraphHits": int(inductor.get("fxgraph_cache_hit", 0)),
                "fxGraphMisses": int(inductor.get("fxgraph_cache_miss", 0)),
                "fxGraphBypasses": int(inductor.get("fxgraph_cache_bypass", 0)),
                "aotAutogradHits": int(aot.get("autograd_cache_hit", 0)),
                "aotAutogradMisses": int(aot.get("autograd_cache_miss", 0)),
                "aotAutogradBypasses": int(aot.get("autograd_cache_bypass", 0)), "compileSeconds": round(seconds, 3)}
    except Exception:  # noqa: BLE001 - another torch: counts unknown
        return {}


def upload_torch_archive(cache_url: str, local: str, sha256: str, md5: str, size: int
                         ) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """The archive (the local file `local`, of that SHA-256 hex, MD5 in GCS's base64 form and
    size) at `<cache_url>/torch-inductor-<sha256>-cache` (put_file, with customTime now), or,
    when an object of that name already holds these bytes (its MD5 and size, read back:
    generation_holding), its customTime refreshed; one of that name that does not (a
    same-size object placed there by someone with write on the prefix) is replaced by an
    upload. Returns (the manifest's entry, uploaded, refresh_last_use's answer): the entry
    built from the warmer's own bytes (name, size, MD5) and the generation read back holding
    them, never from a later listing (the object could be swapped between the upload and a
    listing). Raises what gcsfs raises, or ValueError."""
    key = TORCH_ARCHIVE_PREFIX + sha256
    path = f"{cache_url[len('gs://'):].rstrip('/')}/{key}-cache"
    entry: dict[str, Any] = {"name": f"{key}-cache", "size": size, "md5": md5}
    try:
        generation = generation_holding(path, md5, size)
    except FileNotFoundError:
        generation = ""
    except ValueError:
        log("An object of the archive's name does not hold its bytes: uploading it again", entry=entry["name"])
        generation = ""
    if generation:
        return {**entry, "generation": generation}, False, refresh_last_use(cache_url, [key])
    generation = put_file(path, local, md5, size, custom_time=True)
    return {**entry, "generation": generation}, True, {"entriesRefreshed": 0, "refreshFailed": 0}


def run_torch(mode: str, targets: Sequence[str], command: list[str], errors: list[str]
              ) -> tuple[int, bool, list[dict[str, Any]]]:
    """The torch warm's run: the entrypoint (in process for `python FILE`/`-m MOD`, else a
    child, uncounted) or each target called (its return value ignored). Returns (exit
    status, counted, targets' results); failures are appended to `errors`."""
    results: list[dict[str, Any]] = []
    if mode == "targets":
        for spec in targets:
            began = time.monotonic()
            try:
                load_target(spec)()
                results.append({"target": spec, "seconds": round(time.monotonic() - began, 3)})
                log("Ran target", target=spec)
            except Exception as exc:  # noqa: BLE001 - said in the summary; the others go on
                errors.append(f"{spec}: {type(exc).__name__}: {exc}"[:500])
                traceback.print_exc(file=sys.stderr)
        return (1 if errors else 0), True, results
    counted = in_process(command)
    code = run_command(command)
    if code != 0:
        errors.append(f"entrypoint exited with status {code}")
    return code, counted, results


def link_precompiled_headers(directory: str) -> str:
    """Inductor keeps its precompiled header (a ~160 MB .gch that every fresh container
    builds with g++ before it loads the cached kernels: ~5.5 s of the demo's warm first step)
    in <tempdir>/torchinductor_<user>/precompiled_headers, as torch computes it
    (torch/_inductor/runtime/cache_dir_utils.default_cache_dir), outside
    TORCHINDUCTOR_CACHE_DIR: a link there to <directory>/precompiled_headers has this warm
    build it into the directory it archives, and pods (sitecustomize.py's
    _link_precompiled_headers, the same code) read it from the directory their copy seeded.
    Nothing where that path exists already. Returns what was done ("linked", "exists", or an
    error's text); never raises."""
    try:
        import getpass  # noqa: PLC0415 - torch caches alone need it
        import tempfile  # noqa: PLC0415

        try:
            user = getpass.getuser()
        except (KeyError, ImportError, OSError):
            user = f"uid_{os.getuid()}"
        default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
        link = os.path.join(default, "precompiled_headers")
        if os.path.islink(link) and not os.path.exists(link):
            os.unlink(link)  # a link of an earlier process to a directory gone since
        if os.path.lexists(link):
            return "exists"
        os.makedirs(os.path.join(directory, "precompiled_headers"), exist_ok=True)
        os.makedirs(default, exist_ok=True)
        os.symlink(os.path.join(directory, "precompiled_headers"), link)
        return "linked"
    except Exception as exc:  # noqa: BLE001 - the warm goes on; the header is then not carried
        return f"{type(exc).__name__}: {exc}"[:200]


def torch_warm(mode: str, targets: Sequence[str], command: list[str], pythonpath: Mapping[str, str]) -> int:
    """The warm of a torch cache (CACHEWARM_FRAMEWORK=torch; docs/torch.md): run, then process 0 archives TORCHINDUCTOR_CACHE_DIR, uploads it and
    writes the manifest naming it. Exit 0 when the archive is in the bucket (uploaded or
    already there), 1 when the command or a target failed (or the upload did), 2 when the
    directory held nothing (nothing compiled)."""
    cache_url = os.environ.get(ENV_CACHE_URL, "").rstrip("/")
    directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    index = process_index()
    errors: list[str] = []
    if not directory:
        errors.append("TORCHINDUCTOR_CACHE_DIR is not set: torch would cache in a temporary directory")
    if index == 0 and not cache_url.startswith("gs://"):
        errors.append(f"{ENV_CACHE_URL} must be a gs:// URL, not {cache_url[:200]!r}")
    try:
        limit = int(os.environ.get(ENV_TORCH_MAX_ARCHIVE_BYTES) or TORCH_MAX_ARCHIVE_BYTES)
    except ValueError:
        errors.append(f"{ENV_TORCH_MAX_ARCHIVE_BYTES} is not a whole number of bytes")
        limit = TORCH_MAX_ARCHIVE_BYTES
    sys.path.insert(0, os.getcwd())
    code, counted = 1, False
    results: list[dict[str, Any]] = []
    headers = link_precompiled_headers(directory) if directory and not errors else ""
    if not errors:
        try:
            code, counted, results = run_torch(mode, targets, command, errors)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:500])
            traceback.print_exc(file=sys.stderr)
    failed = bool(errors)
    counts = torch_counts() if counted else {}
    fp = torch_fingerprint(warmer=True) if counted else {}
    torch_out: dict[str, Any] = {**counts, "counted": bool(counts), "files": 0, "archiveBytes": 0}
    if headers:
        torch_out["precompiledHeaders"] = headers
    summary: dict[str, Any] = {
        "mode": mode, "processIndex": index, "cacheDir": cache_url,
        "programs": counts.get("fxGraphHits", 0) + counts.get("fxGraphMisses", 0),
        "entriesFound": counts.get("fxGraphHits", 0), "entriesWritten": 0, "bytesWritten": 0,
        "entriesRefreshed": 0, "refreshFailed": 0, "notCached": 0,
        "targets": results, "torch": torch_out, **pythonpath}
    if counts:  # torch's own compile seconds; uncounted, none: the run's wall time is not a compile's
        summary["compileSeconds"] = counts["compileSeconds"]
    elif not failed:
        torch_out["note"] = (("the entrypoint ran in a child process" if not counted else "torch was not imported here")
                             + ": torch's counters and compile seconds are unknown (the archive is uploaded all "
                             "the same)")
    if fp:
        summary["fingerprint"] = fp
    empty = False
    if index == 0 and not failed:
        try:
            empty, failed = torch_upload(directory, cache_url, limit, summary, errors)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"could not archive or upload {directory}: {type(exc).__name__}: {exc}"[:500])
            failed = True
            traceback.print_exc(file=sys.stderr)
    summary["errors"] = errors
    write_summary(summary)
    log("Finished", framework="torch", files=torch_out["files"], bytes=torch_out["archiveBytes"], errors=len(errors))
    if failed or code != 0:
        return 1
    return 2 if empty else 0


def torch_upload(directory: str, cache_url: str, limit: int, summary: dict[str, Any], errors: list[str]
                 ) -> tuple[bool, bool]:
    """Process 0's part of a torch warm: the archive of `directory`, refused before it is built
    when its files hold more than `limit` bytes (maxArchiveSize: the uncompressed bytes of one
    archive), else built into a temporary file in `directory` (hashed while written, never
    held in memory),
    uploaded and named by the manifest; said in `summary` (its `torch`) and `errors`. Returns
    (empty: no file to archive, failed). Raises OSError or what the upload raises."""
    import stat  # noqa: PLC0415 - torch caches alone need them
    import tempfile  # noqa: PLC0415

    torch_out = summary["torch"]
    found = torch_members(directory)
    sizes = [st.st_size for _, st in found if stat.S_ISREG(st.st_mode)]
    files, total = len(sizes), sum(sizes)
    torch_out.update(files=files, uncompressedBytes=total)
    if files == 0:
        errors.append(f"nothing was compiled: {directory} holds no file")
        return True, False
    if total > limit:
        errors.append(f"the files of {directory} hold {total} bytes, over maxArchiveSize ({limit} bytes, "
                      "uncompressed): not archived, not uploaded")
        return False, True
    # In the directory itself: the one place the warmer surely may write (an emptyDir; the
    # image's /tmp may be read-only), under a temp name no archive takes (TORCH_TEMP_NAME).
    with tempfile.NamedTemporaryFile(prefix=".cachewarm.tmp-archive-", dir=directory) as spool:
        hashing = _Hashing(spool)
        torch_archive_into(directory, found, hashing, limit)
        spool.flush()
        size, sha256 = hashing.size, hashing.sha256.hexdigest()
        md5 = base64.b64encode(hashing.md5.digest()).decode()
        torch_out["archiveBytes"] = size
        entry, uploaded, refreshed = upload_torch_archive(cache_url, spool.name, sha256, md5, size)
    name = str(entry["name"])
    key = name[:-len("-cache")]
    summary.update(refreshed)
    summary.update(entriesWritten=int(uploaded), bytesWritten=size if uploaded else 0,
                   keys=[key_hash(key)], keyCount=1)
    if "compileSeconds" in summary:  # counted: what torch spent compiling, for pods' seconds saved
        summary["compiledPrograms"] = [{"program": "torch.compile", "compileSeconds": summary["compileSeconds"],
                                        "key": key_hash(key)}]
    log("Uploaded the torch cache directory" if uploaded else "The same archive is already there",
        entry=name, files=files, bytes=size)
    manifest = os.environ.get(ENV_MANIFEST, "")
    if manifest:
        summary.update(write_manifest(manifest, [name], summary.get("fingerprint") or None, cache_url, own=[entry]))
    return False, False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachewarm warm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p_targets = sub.add_parser("targets", help="compile module:callable targets into the cache")
    p_targets.add_argument("--parallel", type=int, default=1, help="programs compiled at once")
    p_targets.add_argument("targets", nargs="+", metavar="MODULE:CALLABLE")
    p_command = sub.add_parser("command", help="run the training entrypoint with the cache env")
    p_command.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT")
    args = parser.parse_args(argv)

    # Before anything runs here: an in-process entrypoint may change os.environ.
    pythonpath = image_pythonpath(os.environ)
    if os.environ.get(ENV_FRAMEWORK) == "torch":
        return torch_warm(args.mode, getattr(args, "targets", None) or [],
                          entrypoint(getattr(args, "argv", None) or []), pythonpath)
    cache = CacheDir(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
    if not cache.url:
        log("JAX_COMPILATION_CACHE_DIR is not set; nothing would be cached")
    sys.path.insert(0, os.getcwd())
    lacking = missing_libraries(cache.url)
    before = cache.entries() if not lacking else {}
    counters = Counters()
    used = UsedKeys()
    used.install()
    started = time.monotonic()
    errors: list[str] = []
    results: list[dict[str, Any]] = []
    code = 0
    counted = True  # whether JAX's counters saw the compiles (here, or in children's records)
    own_counted = True  # whether they were this process's (then its fingerprint is the warm's)
    records: list[dict[str, Any]] = []
    index = process_index()
    distributed = False
    if lacking:
        # Nothing to compile for: every entry would be lost, and the failure would read as
        # programs below the write thresholds.
        errors.append(f"JAX_COMPILATION_CACHE_DIR is {cache.url}, which this image cannot use: it lacks "
                      f"{' and '.join(lacking)} (install them in the image: pip install {' '.join(lacking)})")
        log("The image lacks what the cache directory needs", url=cache.url, missing=",".join(lacking))
    try:
        if not lacking:
            counters.install()
            if args.mode == "targets":
                # command mode: the entrypoint initializes the distributed runtime itself (as it
                # does in training); calling it here too would fail its second initialize().
                distributed = initialize_distributed()
                results, errors = run_targets(args.targets, args.parallel)
            else:
                command = entrypoint(args.argv)
                own_counted = in_process(command)
                code, records = run_counted(command)
                counted = own_counted or bool(records)
                if code != 0:
                    errors.append(f"entrypoint exited with status {code}")
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stderr)
    # While the runtime is up (a multi-host warmer's devices are the whole slice's).
    # A child's entrypoint leaves this process's jax without devices: asking for them here
    # would take an accelerator a later child needs.
    fp = merge_fingerprints(fingerprint() if own_counted else {}, records) if index == 0 and counted \
        and not lacking else None
    if distributed or distributed_by_entrypoint():
        shutdown_distributed()
    after = cache.entries() if not lacking else {}
    # Only process 0 writes cache entries; what another process sees appear in a shared
    # cache directory is process 0's work, so it is not counted twice.
    written = {k: v for k, v in after.items() if k not in before} if index == 0 else {}
    requests = counters.requests + sum(r["requests"] for r in records)
    found = counters.hits + sum(r["hits"] for r in records)
    looked_up = used.keys | {k for r in records for k in r["keys"]}
    summary = {
        "mode": args.mode,
        "processIndex": index,
        "cacheDir": cache.url,
        "programs": requests,
        "entriesFound": found if counted else len(before),
        "entriesWritten": len(written),
        "bytesWritten": sum(written.values()),
        # Process 0 alone (every host finds the same keys): N hosts would PATCH each object N times.
        **(refresh_last_use(cache.url, looked_up | {n.removesuffix("-cache") for n in written}) if index == 0
           else {"entriesRefreshed": 0, "refreshFailed": 0}),
        "compileSeconds": round(sum(r["seconds"] for r in results), 3) if results else round(time.monotonic() - started, 3),
        "errors": errors,
        "targets": results,
        **pythonpath,  # every process reports it, process 0 included
    }
    if counted:  # what each program this warm compiled took, for pods' seconds saved
        every = compiled_programs(used.compiled.values() if own_counted else (), records, limit=None)
        summary["compiledPrograms"] = every[:MAX_COMPILED]
        if len(every) > MAX_COMPILED:
            summary["compiledRest"] = compiled_rest(every[MAX_COMPILED:])
    if fp is not None:
        summary["fingerprint"] = fp
    cached = (found + len(written)) if counted else len(after)
    if index != 0:
        # Processes other than 0 never write: they succeed when they compiled everything
        # they were given without error (their part of the collective program).
        cached = max(cached, requests if counted else 1)
    failed = bool(errors)
    if not failed and cached == 0:
        if requests and cache.url:
            errors.append(
                f"{requests} programs compiled but none was written to or found in the cache; "
                "check JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS and ..._MIN_ENTRY_SIZE_BYTES"
            )
        else:
            errors.append("nothing was compiled or found in the cache")
    summary["notCached"] = max(0, requests - found - len(written)) if counted and index == 0 else 0
    # The entries this warm relies on (what it found or wrote, and is in the cache now):
    # the operator checks that they are in the bucket before it calls the cache Warmed.
    # Only when JAX's lookups were seen (targets, a python entrypoint run in process, or
    # children that left records): an entrypoint in an uncounted child process finds entries
    # this process cannot name, so no `keys` at all then (the operator falls back to "the
    # bucket holds entries").
    # The same entries go to the pool's manifest (CACHEWARM_MANIFEST, which the operator
    # sets), for pods' local copies; when this process cannot name them, an older manifest
    # would name another program's entries, so it is removed (pods then copy the prefix).
    # Process 0 alone, and only after a warm that succeeded.
    manifest = os.environ.get(ENV_MANIFEST, "")
    if index == 0 and counted:
        present = {n.removesuffix("-cache") for n in after if n.endswith("-cache")}
        relied = (looked_up | {n.removesuffix("-cache") for n in written}) & present
        summary["keys"] = sorted({key_hash(k) for k in relied})
        summary["keyCount"] = len(summary["keys"])
        summary.update(check_unstable(manifest if not errors else "", fp or {}, cache.url, relied,
                                      {n.removesuffix("-cache") for n in written},
                                      ([(fp or {}, used.keys)] if own_counted else [])
                                      + [(r["fingerprint"], set(r["keys"])) for r in records]))
        # A warm that failed or relied on nothing leaves the manifest as it was: an empty or
        # partial one would have pods copy less than the cache holds for them.
        if manifest and relied and not errors:
            summary.update(write_manifest(manifest, [f"{k}-cache" for k in relied], fp, cache.url))
    elif index == 0 and manifest:
        summary.update(remove_manifest(manifest))
    summary["errors"] = errors
    write_summary(summary)
    log("Finished", programs=requests, found=found, written=len(written), errors=len(errors))
    if failed:
        return 1
    return 2 if cached == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
