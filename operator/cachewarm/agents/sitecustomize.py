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
   released when it exits), and every process of the pod that started while no summary was
   there waits for the copy when its `import jax` returns (a meta path hook wraps jax's
   loader), polling the summary and the lock for at most the copy's deadline and grace,
   before JAX can read the cache. The copy overlaps the program's own start and imports,
   and none of the copier's modules or objects stay in the process (a copy in process left
   them behind, which in the benchmark's program moved a full garbage collection of ~40 ms
   into its first step): what stays is this module, the hook until jax is imported, and
   the child's pid until it is reaped (after the wait; a process that never imports jax
   keeps it a zombie). Where the child cannot be started (no lock file, no python to
   spawn), the copy runs in process before the program's own code
   (cachewarm_copier.copy_in_process); where the wait finds the lock free and no summary
   (the copier died), at `import jax` (another deadline and grace at most). A process
   whose jax was imported before this file ran (a .pth file) waits here, at once.
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
ENV_COPY_DEADLINE_SECONDS = "CACHEWARM_COPY_DEADLINE_SECONDS"
ENV_COPY_GRACE_SECONDS = "CACHEWARM_COPY_GRACE_SECONDS"
ENV_REPORT_URL = "CACHEWARM_REPORT_URL"

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
    from typing import Any, List, Optional


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


def _wait(lock_path, summary, child):  # type: (str, str, Optional[int]) -> None
    """Wait for the pod's copy, at most _bound(): polled (the summary, then the lock taken
    and let go at once), so that a wait that gives up leaves nothing behind that could take
    the lock later. A copy that ended without a summary (its copier died) is done here, in
    process."""
    import time

    start = time.monotonic()
    deadline = start + _bound()
    pause = 0.002
    done = _copy_done(lock_path, summary)
    while not done and time.monotonic() < deadline:
        time.sleep(pause)  # 10 ms at most while a copy is likely (5 s), then 50 ms
        pause = min(pause * 2, 0.01 if time.monotonic() - start < 5 else 0.05)
        done = _copy_done(lock_path, summary)
    if child is not None:
        # Reaped: once done, it is exiting (the summary is its last act); 1 s at most.
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


class _WaitForCopy(object):
    """A meta path finder, first on sys.meta_path, for `jax` only: it gives jax's own spec
    with a loader that, once jax's __init__ has run, waits for the pod's copy, then takes
    this finder out. JAX reads its persistent cache only when it compiles, which needs
    `jax` imported. A find_spec that imports nothing (an "is jax installed" check) leaves
    it in place."""

    def __init__(self, lock_path, summary, child):  # type: (str, str, Optional[int]) -> None
        self.lock_path, self.summary, self.child = lock_path, summary, child
        self.done = False

    def find_spec(self, name, path=None, target=None):  # type: (str, Any, Any) -> Any
        if name != "jax" or self.done:
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
    try:  # every way out closes fd: copy_in_process, after, takes the lock on another
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process of the pod copies: wait for it when jax is imported
            hook = _WaitForCopy(lock_path, summary, None)
        else:
            if os.path.exists(summary):
                return True  # copied meanwhile
            hook = _WaitForCopy(lock_path, summary, _spawn_copier(fd))
    except Exception:  # noqa: BLE001 - no child: the caller copies in process
        return False
    finally:
        os.close(fd)
    if "jax" in sys.modules:  # imported before us (a .pth file): wait now
        hook.wait()
    else:
        sys.meta_path.insert(0, hook)
    return True


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
