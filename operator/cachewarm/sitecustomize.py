"""cachewarm's start-up hook in training pods, first on the pod's PYTHONPATH, so python
imports it at the start of every process (shipped as sitecustomize.py beside
cachewarm_copier.py, cachewarm_reporter.py and warm.py: an emptyDir that init containers
fill, or a ConfigMap volume). In order, each step on its own, never raising:

1. The image's own PYTHONPATH (which the pod's replaced) is put back, by this file alone and
   in syntax any Python 3 reads, so that a copier or reporter that cannot load (an old
   interpreter, a broken file) still leaves the process the paths its image set.
2. With CACHEWARM_COPY_IN_PROCESS=1, the pod's local copy (cachewarm_copier.copy_in_process:
   once per pod, bounded), before the process's own code and the reporter, which reports
   what the copy did.
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

try:
    if os.environ.get("CACHEWARM_COPY_IN_PROCESS") == "1":
        import importlib

        importlib.import_module("cachewarm_copier").copy_in_process()
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
