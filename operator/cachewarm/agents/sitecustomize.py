"""cachewarm's start-up hook in training pods, first on the pod's PYTHONPATH, so python
imports it at the start of every process (shipped as sitecustomize.py beside
cachewarm_copier.py, cachewarm_reporter.py and warm.py: an emptyDir that init containers
fill, or a ConfigMap volume). In order, each step on its own, never raising:

1. The image's own PYTHONPATH (which the pod's replaced) is put back, by this file alone and
   in syntax any Python 3 reads, so that a copier or reporter that cannot load (an old
   interpreter, a broken file) still leaves the process the paths its image set.
2. With CACHEWARM_COPY_IN_PROCESS=1, the pod's local copy, once per pod: the first process
   (the one that takes the pod's lock, `<CACHEWARM_COPY_SUMMARY>.lock`, and finds no
   summary) starts the copier as a child process (`python -s -S -P`, the lock handed to it,
   released when it exits). Every process of the pod that started while no summary was
   there is held, once its `import jax` returns (a meta path hook wraps jax's loader), only
   for the entries JAX reads, not for the whole copy: the hook wraps JAX's file cache read
   of the copy's directory (jax._src.lru_cache.LRUCache.get; _OnDemand) until the copy is
   over, so that a key whose file is not there yet waits for the copier's plan (the names
   it keeps, written once the directory holds only verified entries; `import jax` waits for
   it too, so that what reads the directory next, the reporter, knows them) and, when
   planned, asks the copier for it (a file of its name in `<summary>.want/`, the pod's own
   emptyDir; the copier fetches it before the rest) and waits until its file is there; a
   key not planned is read as it would be without a copy. Where this jax has no such read
   (another layout), the process waits there for the whole copy instead. Every wait polls
   (the file, the summary, the lock) for at most the copy's deadline and grace. The copy
   overlaps the program's own start, imports and first steps, and none of the copier's
   modules or objects stay in the process (a copy in process left them behind, which in
   the benchmark's program moved a full garbage collection of ~40 ms into its first step):
   what stays is this module, the hooks until jax is imported and the copy is over, and
   the child's pid until it is reaped (when a wait sees the copy over; a process that
   never imports jax, or reads nothing after the copy ended, keeps it a zombie). Where the
   child cannot be started (no lock file, no python to spawn), the copy runs in process
   before the program's own code (cachewarm_copier.copy_in_process); where a wait finds the
   lock free and no summary (the copier died), in process then (another deadline and grace
   at most). A process whose jax was imported before this file ran (a .pth file) is hooked
   here, at once. In a torch cache's pods (CACHEWARM_FRAMEWORK=torch) the same hook is on
   `import torch`, and there it always waits for the whole copy: the copier extracts the
   torch archives into the Inductor directory before it writes its summary, and no compile
   may read that directory half seeded.
3. The image's own sitecustomize (the one this file shadows), exactly once.
4. With CACHEWARM_REPORT_URL, the reporter, which counts the process's JAX cache use and
   reports it to cachewarm (loaded only then: every process pays for what it loads, and
   a ConfigMap volume keeps no bytecode cache of its own; the operator ships the
   bytecode of its own python's version, reconcile/configmaps.compile_boot, which other versions
   cannot use).

The shipped modules are imported by name (importlib), not by import statements: they are
not this package's modules, nor third-party packages."""

# The env names this hook reads. Each is the copier's or the reporter's (cachewarm_copier.ENV_...,
# cachewarm_reporter.ENV_..., which the operator's builders import), spelled again here
# because this file must not load those modules to read them; tests/unit/test_layout.py
# checks that the two spellings agree.
ENV_RESTORE_IMAGE_PYTHONPATH = "CACHEWARM_RESTORE_IMAGE_PYTHONPATH"
ENV_COPY_IN_PROCESS = "CACHEWARM_COPY_IN_PROCESS"
ENV_COPY_SUMMARY = "CACHEWARM_COPY_SUMMARY"
ENV_COPY_DEST = "CACHEWARM_COPY_DEST"
ENV_COPY_DEADLINE_SECONDS = "CACHEWARM_COPY_DEADLINE_SECONDS"
ENV_COPY_GRACE_SECONDS = "CACHEWARM_COPY_GRACE_SECONDS"
ENV_REPORT_URL = "CACHEWARM_REPORT_URL"
ENV_FRAMEWORK = "CACHEWARM_FRAMEWORK"  # the warmer's: "torch" in a torch cache's pods

try:
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get(ENV_RESTORE_IMAGE_PYTHONPATH) == "1":
        with open(os.path.join(_here, "image-pythonpath")) as _f:
            _entries = [p for p in _f.read().strip().split(os.pathsep) if p and p not in sys.path]
        _at = sys.path.index(_here) + 1 if _here in sys.path else 0
        sys.path[_at:_at] = _entries
except Exception:  # noqa: BLE001 - no file (nothing recorded) or anything else: start as is
    pass


MYPY = False
if MYPY:  # the annotations are comments: this file is read by any Python 3
    from typing import Any, Dict, List, Optional


def _copy_in_process():  # type: () -> None
    import importlib

    importlib.import_module("cachewarm_copier").copy_in_process()


def _bound():  # type: () -> float
    """How long a process waits for the copy at most: its deadline (at least 1 s) and its
    grace, as the copier reads them (cachewarm_copier.bound_seconds, which the process
    does not import)."""
    total = 0.0
    for name, default, least in ((ENV_COPY_DEADLINE_SECONDS, 300.0, 1.0), (ENV_COPY_GRACE_SECONDS, 15.0, 0.0)):
        try:
            value = float(os.environ.get(name) or default)
        except ValueError:
            value = default
        total += max(value if abs(value) < float("inf") else default, least)
    return total


def _copy_done(lock_path, summary):  # type: (str, str) -> bool
    """Whether the pod's copy is over: its summary is there, or nobody holds its lock."""
    import fcntl

    if os.path.exists(summary):
        return True
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return True  # no lock file: nothing holds a copy
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and the lock with it: this process never keeps it


def _until(lock_path, summary, deadline, ready=None):  # type: (str, str, float, Any) -> bool
    """Polls until `ready()` (when given) or the pod's copy is over (_copy_done), at most
    until `deadline` (time.monotonic()); whether the copy is over. Polled (the summary, then
    the lock taken and let go at once), so that a wait that gives up leaves nothing behind
    that could take the lock later."""
    import time

    start = time.monotonic()
    pause = 0.002
    while True:
        if ready is not None and ready():
            return False
        if _copy_done(lock_path, summary):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # 10 ms at most while a copy is likely (5 s), then 50 ms
        pause = min(pause * 2, 0.01 if time.monotonic() - start < 5 else 0.05)


def _over(summary, child, done):  # type: (str, Optional[int], bool) -> None
    """After a wait for the copy: the copier child reaped (once done, it is exiting: the
    summary is its last act; 1 s at most), and a copy that ended without a summary (its
    copier died) done here, in process."""
    import time

    if child is not None:
        for tries_left in range(99 if done else 0, -1, -1):
            try:
                if os.waitpid(child, os.WNOHANG)[0]:
                    break
            except OSError:
                break  # a forked process (not its child), or the program reaped it
            if tries_left:
                time.sleep(0.01)
    if done and not os.path.exists(summary):
        _copy_in_process()


def _wait(lock_path, summary, child):  # type: (str, str, Optional[int]) -> None
    """Wait for the whole copy, at most _bound() (where _OnDemand cannot serve the process)."""
    import time

    _over(summary, child, _until(lock_path, summary, time.monotonic() + _bound()))


class _OnDemand(object):
    """JAX's file cache read (jax._src.lru_cache.LRUCache.get, wrapped while the copy runs)
    of the copy's directory, entry by entry: a key whose file is not there yet waits for
    the copier's plan (`<summary>.plan`, the names it keeps, written once the directory is
    swept: before it, nothing there is read while the copy runs); a planned one is asked
    for (a file of its name in `<summary>.want/`, the pod's own emptyDir, which the copier
    looks for every few ms and downloads first) and waited for, until its file is there
    (renamed into place once checked) or the copy is over; one not planned is read as
    without a copy (a miss). Every wait ends at the copy's deadline and grace (from
    `import jax`); once the copy is over (or that bound passed) JAX's own read is put back,
    a child reaped, and a copy that ended without a summary done in process (_over)."""

    def __init__(self, lock_path, summary, child, dest, cache_class):  # type: (str, str, Optional[int], str, Any) -> None
        import threading
        import time

        self.lock_path, self.summary, self.child, self.cache_class = lock_path, summary, child, cache_class
        self.dest = os.path.realpath(dest)
        self.same = {}  # type: Dict[str, bool]
        self.deadline = time.monotonic() + _bound()
        self.plan = None  # type: Any
        self.over = False
        self.ending = threading.Lock()
        self.original = cache_class.__dict__["get"]
        hook = self

        def get(cache, key):  # type: (Any, Any) -> Any
            if not hook.over:
                try:
                    hook.before(cache, key)
                except Exception:  # noqa: BLE001 - JAX reads as it would have
                    pass
            return hook.original(cache, key)

        get.__wrapped__ = self.original  # type: ignore[attr-defined]
        self.get = get

    def before(self, cache, key):  # type: (Any, Any) -> None
        if not isinstance(key, str) or not key or not self.reads_copy(cache):
            return
        name = key + "-cache"
        path = os.path.join(self.dest, name)
        if self.plan is None:
            self.load_plan()
        if self.over or name not in self.plan or os.path.exists(path):
            return
        try:  # a new file, never through a link another container of the pod put there (attacker review)
            os.close(os.open(os.path.join(self.summary + ".want", name),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        except OSError:
            pass  # asked already, or no want directory (the copy is ending): its file or its end is waited for
        # The copier's `<entry>.failed` beside the ask: it will not come (a miss now, not at the copy's end).
        failed = os.path.join(self.summary + ".want", name + ".failed")
        done = _until(self.lock_path, self.summary, self.deadline,
                      lambda: os.path.exists(path) or os.path.exists(failed))
        if done or not (os.path.exists(path) or os.path.exists(failed)):
            self.end(done)

    def reads_copy(self, cache):  # type: (Any) -> bool
        """Whether this JAX cache reads the copy's directory: the same directory by identity
        (device and inode), not by path, since pods read it through another mount of the
        same volume (/cachewarm-cache, read-only) than the copier writes (/cachewarm-copy).
        Remembered per directory path."""
        where = str(cache.path)
        same = self.same.get(where)
        if same is None:
            try:
                same = os.path.samefile(where, self.dest)
            except OSError:  # not there (yet): not the copy's
                return False
            self.same[where] = same
        return same

    def load_plan(self):  # type: () -> None
        """The copier's plan, waited for (or the copy's end, or the bound: then over)."""
        plan_file = self.summary + ".plan"
        if _until(self.lock_path, self.summary, self.deadline, lambda: os.path.exists(plan_file)):
            return self.end(True)
        try:
            with open(plan_file) as f:
                self.plan = frozenset(f.read().split())
        except OSError:  # none by the bound, or gone: the copy is ending (its summary next)
            self.end(_until(self.lock_path, self.summary, self.deadline))

    def end(self, done):  # type: (bool) -> None
        """The copy is over (`done`) or its bound passed: JAX's read as it was, once."""
        with self.ending:
            if self.over:
                return
            self.over = True
            if self.cache_class.__dict__.get("get") is self.get:
                self.cache_class.get = self.original
            _over(self.summary, self.child, done)


def _on_demand(lock_path, summary, child):  # type: (str, str, Optional[int]) -> bool
    """Whether _OnDemand could wrap this jax's file cache read (the layout of jax 0.4.36
    and later: jax._src.lru_cache.LRUCache.get(self, key), entries `<key>-cache`, a module
    `import jax` loads, the class jax._src.compilation_cache reads through), so the process
    need not wait for the whole copy now; False for anything else (nothing is imported
    here: a jax that has not loaded them is another)."""
    dest = os.environ.get(ENV_COPY_DEST, "")
    module = sys.modules.get("jax._src.lru_cache")
    if not dest or module is None:
        return False
    cache_class = getattr(module, "LRUCache", None)
    code = getattr(getattr(cache_class, "__dict__", {}).get("get"), "__code__", None)
    # JAX's compile reads through that class (its compilation_cache module makes its cache of
    # it): else the hook would wrap a read JAX never makes, and nothing would wait.
    if getattr(sys.modules.get("jax._src.compilation_cache"), "LRUCache", None) is not cache_class:
        return False
    if cache_class is None or getattr(module, "_CACHE_SUFFIX", None) != "-cache" or code is None or \
            code.co_argcount != 2 or code.co_varnames[:2] != ("self", "key"):
        return False
    hook = _OnDemand(lock_path, summary, child, dest, cache_class)
    cache_class.get = hook.get
    try:  # now, so that what reads the directory next (the reporter) can read the plan too
        hook.load_plan()
    except Exception:  # noqa: BLE001 - then at the first read
        pass
    return True


class _WaitForCopy(object):
    """A meta path finder, first on sys.meta_path, for `jax` only: it gives jax's own spec
    with a loader that, once jax's __init__ has run, hooks JAX's reads of the copy
    (_OnDemand) or else waits for the whole copy, then takes this finder out. JAX reads its persistent cache only when it compiles, which needs
    `jax` imported. A find_spec that imports nothing (an "is jax installed" check) leaves
    it in place."""

    def __init__(self, lock_path, summary, child, module="jax"):  # type: (str, str, Optional[int], str) -> None
        self.lock_path, self.summary, self.child = lock_path, summary, child
        self.module = module  # "torch" for a torch cache: waits there for the whole copy
        self.done = False

    def find_spec(self, name, path=None, target=None):  # type: (str, Any, Any) -> Any
        if name != self.module or self.done:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Waiting(spec.loader, self)
                return spec
        return None

    def wait(self):  # type: () -> None
        if self.done:
            return
        self.done = True
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:  # torch reads its directory as a whole (the archives extracted): the whole copy, always
            if self.module == "jax" and not _copy_done(self.lock_path, self.summary) and \
                    _on_demand(self.lock_path, self.summary, self.child):
                return
        except Exception:  # noqa: BLE001 - another jax: wait for the whole copy
            pass
        _wait(self.lock_path, self.summary, self.child)


class _Waiting(object):
    """jax's loader, waiting for the copy once jax's module has run."""

    def __init__(self, loader, hook):  # type: (Any, _WaitForCopy) -> None
        self.loader, self.hook = loader, hook

    def __getattr__(self, name):  # type: (str) -> Any
        return getattr(self.loader, name)

    def create_module(self, spec):  # type: (Any) -> Any
        return self.loader.create_module(spec)

    def exec_module(self, module):  # type: (Any) -> None
        try:
            self.loader.exec_module(module)
        finally:  # jax's own loader, as if we had never been there (another's, not ours)
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                module.__spec__.loader = self.loader
        try:
            self.hook.wait()
        except Exception:  # noqa: BLE001 - training goes on whatever happens here
            pass


def _spawn_copier(fd):  # type: (int) -> int
    """The copier child, holding the lock `fd` (moved to 3 or above, the only descriptor it
    gets beyond stderr: stdin and stdout /dev/null, so that it keeps no pipe of the
    process's open but stderr, where its summary goes). python -s -S -P: no site, no user
    site, no script directory; the environment without PYTHON* (the pod's PYTHONPATH
    starts with this directory) but PYTHONHOME, which some images need to start."""
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)  # stays open in the child (F_DUPFD: inheritable)
    try:
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]  # type: List[Any]
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            names = []  # no /proc: the child keeps what it inherits
        for name in names:
            other = int(name)
            try:
                if other > 2 and other != high and os.get_inheritable(other):
                    actions.append((os.POSIX_SPAWN_CLOSE, other))
            except OSError:
                pass  # listdir's own descriptor, closed since
        env = dict((k, v) for k, v in os.environ.items() if not k.startswith("PYTHON") or k == "PYTHONHOME")
        flags = ["-s", "-S"] + (["-P"] if sys.version_info >= (3, 11) else []) + ["-v"] * sys.flags.verbose
        code = ("import sys; sys.path[:] = [p for p in sys.path if p]; sys.path.insert(0, %r); "
                "import cachewarm_copier; cachewarm_copier.child()" % _here)
        os.set_inheritable(high, True)
        return os.posix_spawn(sys.executable, [sys.executable] + flags + ["-c", code], env, file_actions=actions)
    finally:
        os.close(high)


def _drop_stale_plan(summary):  # type: (str) -> None
    """A plan and asks a copier left when it was killed (a container restart keeps the pod's
    emptyDir), removed by the lock holder before its copier starts: else a process would read
    the directory by the old plan before the new copier's sweep (cachewarm_copier.drop_plan,
    which the process does not import)."""
    want = summary + ".want"
    try:
        os.unlink(summary + ".plan")
    except OSError:
        pass
    if os.path.islink(want):  # never listed nor emptied through a link another container put there
        try:
            os.unlink(want)
        except OSError:
            pass
        return
    try:
        fd = os.open(want, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(want)
    except OSError:
        pass


def _start_copy():  # type: () -> bool
    """The copy started by a child process, or waited for; False where neither can be (the
    caller then copies in process)."""
    summary = os.environ.get(ENV_COPY_SUMMARY, "")
    if not summary or not sys.executable or getattr(os, "posix_spawn", None) is None:
        return False
    if os.path.exists(summary):
        return True  # copied already: the usual case for every process but the first
    import fcntl
    lock_path = summary + ".lock"
    try:
        os.makedirs(os.path.dirname(lock_path) or ".", exist_ok=True)
    except OSError:
        pass
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(lock_path, flags, 0o666)
            break
        except OSError:
            continue
    if fd is None:
        return False
    hook = None
    module = "torch" if os.environ.get(ENV_FRAMEWORK) == "torch" else "jax"
    try:  # every way out closes fd: copy_in_process, after, takes the lock on another
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process of the pod copies: wait for it when jax (torch) is imported
            hook = _WaitForCopy(lock_path, summary, None, module)
        else:
            if os.path.exists(summary):
                return True  # copied meanwhile
            _drop_stale_plan(summary)
            hook = _WaitForCopy(lock_path, summary, _spawn_copier(fd), module)
    except Exception:  # noqa: BLE001 - no child: the caller copies in process
        return False
    finally:
        os.close(fd)
    if module in sys.modules:  # imported before us (a .pth file): wait now
        hook.wait()
    else:
        sys.meta_path.insert(0, hook)
    return True


def _link_precompiled_headers(directory):
    # type: (str) -> str
    """Inductor keeps its precompiled header (a ~160 MB .gch that every fresh container
    builds with g++ before it loads the cached kernels: ~5.5 s of the demo's warm first step)
    in <tempdir>/torchinductor_<user>/precompiled_headers, as torch computes it
    (torch/_inductor/runtime/cache_dir_utils.default_cache_dir), outside
    TORCHINDUCTOR_CACHE_DIR: a link there to <directory>/precompiled_headers has the pod read
    the header its copy seeded (the warmer builds it there: warm.py's
    link_precompiled_headers, the same code). Nothing where that path exists already (the
    image's own, or another process of this container linked it). Returns what was done
    ("linked", "exists", or an error's text); never raises."""
    try:
        import getpass
        import re
        import tempfile

        try:
            user = getpass.getuser()
        except (KeyError, ImportError, OSError):
            user = "uid_%d" % os.getuid()
        default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
        link = os.path.join(default, "precompiled_headers")
        if os.path.islink(link) and not os.path.exists(link):
            os.unlink(link)  # a link of an earlier process to a directory gone since
        if os.path.lexists(link):
            return "exists"
        target = os.path.join(directory, "precompiled_headers")
        if not os.path.isdir(target):
            os.makedirs(target)
        if not os.path.isdir(default):
            os.makedirs(default)
        os.symlink(target, link)
        return "linked"
    except Exception as exc:  # noqa: BLE001 - the pod builds the header itself then
        return ("%s: %s" % (type(exc).__name__, exc))[:200]


try:
    if os.environ.get(ENV_FRAMEWORK) == "torch" and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        _link_precompiled_headers(os.environ["TORCHINDUCTOR_CACHE_DIR"])
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass

try:
    if os.environ.get(ENV_COPY_IN_PROCESS) == "1":
        try:
            _started = _start_copy()
        except Exception:  # noqa: BLE001 - then in process
            _started = False
        if not _started:
            _copy_in_process()
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass

try:
    # The image's own sitecustomize (or the environment's), which this one shadows: run
    # as python would have run it, once, and left as `sitecustomize`; its errors told as
    # site.py tells them. Our directory is told by its real path: the kubelet's ConfigMap
    # volume holds symlinks (key -> ..data/key), so a file's resolved directory is not it.
    import importlib.machinery
    import importlib.util

    _real = os.path.realpath(_here)
    _spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if p and os.path.realpath(p) != _real])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["sitecustomize"] = _module
        try:
            _spec.loader.exec_module(_module)
        except Exception as _exc:  # noqa: BLE001 - as site.py: say so, go on
            print("cachewarm: error in the image's sitecustomize (%s: %s)" % (type(_exc).__name__, _exc),
                  file=sys.stderr)
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass

try:
    if os.environ.get(ENV_REPORT_URL):
        import importlib
        import pathlib

        importlib.import_module("cachewarm_reporter").start(pathlib.Path(_here))
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass
