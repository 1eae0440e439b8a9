"""cachewarm's start-up hook in training pods, first on the pod's PYTHONPATH, so python
imports it at the start of every process (shipped as sitecustomize.py beside
cachewarm_copier.py, cachewarm_reporter.py and warm.py: an emptyDir that init containers
fill, or a ConfigMap volume). In order, each step on its own, never raising:

1. The image's own PYTHONPATH (which the pod's replaced) is put back, by this file alone and
   in syntax any Python 3 reads, so that a copier or reporter that cannot load (an old
   interpreter, a broken file) still leaves the process the paths its image set.
2. With CACHEWARM_COPY_IN_PROCESS=1, the pod's local copy, once per pod: the first process
   (the one that takes the pod's lock, `<CACHEWARM_COPY_SUMMARY>.lock`, and finds no
   summary) starts the copier as a child process (`python -I -S`, the lock handed to it,
   released when it exits), and every process of the pod that started while no summary was
   there waits for the copy when its `import jax` returns (a meta path hook wraps jax's
   loader), at most the copy's deadline and grace, before JAX can read the cache: the copy
   overlaps the program's own start and imports, and leaves nothing in the process (a copy
   in process left its modules and objects behind, which in the benchmark's program
   moved a full garbage collection of ~40 ms into its first step). Where the child cannot
   be started (no lock file, no python to spawn), the copy runs in process before the
   program's own code (cachewarm_copier.copy_in_process), as it does after a wait that
   found no summary (the child died before writing one).
3. The image's own sitecustomize (the one this file shadows), exactly once.
4. With CACHEWARM_REPORT_URL, the reporter, which counts the process's JAX cache use and
   reports it to cachewarm (loaded only then: every process pays for what it loads, and
   a ConfigMap volume keeps no bytecode cache of its own; the operator ships the
   bytecode of its own python's version, service.compile_boot, which other versions
   cannot use).

The shipped modules are imported by name (importlib), not by import statements: they are
not this package's modules, nor third-party packages."""

try:
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("CACHEWARM_RESTORE_IMAGE_PYTHONPATH") == "1":
        with open(os.path.join(_here, "image-pythonpath")) as _f:
            _entries = [p for p in _f.read().strip().split(os.pathsep) if p and p not in sys.path]
        _at = sys.path.index(_here) + 1 if _here in sys.path else 0
        sys.path[_at:_at] = _entries
except Exception:  # noqa: BLE001 - no file (nothing recorded) or anything else: start as is
    pass


MYPY = False
if MYPY:  # the annotations are comments: this file is read by any Python 3
    from typing import Any, Optional


def _copy_in_process():  # type: () -> None
    import importlib

    importlib.import_module("cachewarm_copier").copy_in_process()


def _bound():  # type: () -> float
    """How long a process waits for the copy at most: its deadline (at least 1 s) and its
    grace, as the copier reads them (cachewarm_copier.bound_seconds)."""
    total = 0.0
    for name, default, least in (("DEADLINE", 300.0, 1.0), ("GRACE", 15.0, 0.0)):
        try:
            value = float(os.environ.get("CACHEWARM_COPY_%s_SECONDS" % name) or default)
        except ValueError:
            value = default
        total += max(value if abs(value) < float("inf") else default, least)
    return total


class _WaitForCopy(object):
    """A meta path finder, first on sys.meta_path, for `jax` only: it gives jax's own spec
    with a loader that, once jax's __init__ has run, waits for the pod's copy (the pod's
    lock free), then takes itself out. JAX reads its persistent cache only when it
    compiles, which needs `jax` imported; the lock is held by the copier child for as long
    as it copies (and that ends at its deadline and grace: its watchdog)."""

    def __init__(self, lock_path, summary, child):  # type: (str, str, Optional[int]) -> None
        self.lock_path, self.summary, self.child = lock_path, summary, child

    def find_spec(self, name, path=None, target=None):  # type: (str, Any, Any) -> Any
        if name != "jax":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Waiting(spec.loader, self)
                return spec
        return None

    def wait(self):  # type: () -> None
        import fcntl
        import threading

        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except OSError:
            fd = None
        ended = True  # no lock file (removed): nothing holds the copy
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the copy is done: the usual case
                os.close(fd)
            except OSError:
                waiter = threading.Thread(target=fcntl.flock, args=(fd, fcntl.LOCK_EX), daemon=True,
                                          name="cachewarm-copy-wait")
                waiter.start()
                waiter.join(_bound())
                ended = not waiter.is_alive()
                if ended:
                    os.close(fd)
                # else: left behind (the copier's child says so); the fd stays with the thread.
        if self.child is not None:
            try:
                # Reaped: the lock is let go as the child exits (else it is left behind).
                os.waitpid(self.child, 0 if ended else os.WNOHANG)
            except OSError:
                pass  # a forked process: not its child
        if ended and not os.path.exists(self.summary):
            _copy_in_process()  # the copier died before its summary: copy here (once per pod)


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
        finally:
            module.__loader__ = self.loader  # jax's own, as if we had never been there
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self.loader
        try:
            self.hook.wait()
        except Exception:  # noqa: BLE001 - training goes on whatever happens here
            pass


def _start_copy():  # type: () -> bool
    """The copy started by a child process, or waited for; False where neither can be (the
    caller then copies in process)."""
    import fcntl

    summary = os.environ.get("CACHEWARM_COPY_SUMMARY", "")
    spawn = getattr(os, "posix_spawn", None)
    if not summary or not sys.executable or spawn is None:
        return False
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
    try:  # every way out closes fd: copy_in_process, after, takes the lock on another
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process of the pod copies: wait for it when jax is imported
            sys.meta_path.insert(0, _WaitForCopy(lock_path, summary, None))
            return True
        if os.path.exists(summary):
            return True  # copied already
        argv = [sys.executable, "-I", "-S"] + ["-v"] * sys.flags.verbose + [
            "-c", "import sys; sys.path.insert(0, %r); import cachewarm_copier; cachewarm_copier.child()" % _here]
        os.set_inheritable(fd, True)  # the child holds the lock while it copies
        child = spawn(sys.executable, argv, dict(os.environ),
                      file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
        sys.meta_path.insert(0, _WaitForCopy(lock_path, summary, child))
        return True
    except Exception:  # noqa: BLE001 - no child: the caller copies in process
        return False
    finally:
        os.close(fd)


try:
    if os.environ.get("CACHEWARM_COPY_IN_PROCESS") == "1":
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
    if os.environ.get("CACHEWARM_REPORT_URL"):
        import importlib
        import pathlib

        importlib.import_module("cachewarm_reporter").start(pathlib.Path(_here))
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass
