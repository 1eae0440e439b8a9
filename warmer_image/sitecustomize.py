"""cachewarm's start-up hook in training pods (copied with cachewarm_reporter.py into the
directory that starts the pod's PYTHONPATH): counts the process's JAX cache use and
reports it to cachewarm. It runs the image's own sitecustomize too, and never raises.

The image's own PYTHONPATH (which the pod's replaced) is put back first, by this file
alone and in syntax any Python 3 reads, so that a reporter that cannot load (an old
interpreter, a broken file) still leaves the process the paths its image set."""

try:
    import os
    import sys

    if os.environ.get("CACHEWARM_RESTORE_IMAGE_PYTHONPATH") == "1":
        _here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(_here, "image-pythonpath")) as _f:
            _entries = [p for p in _f.read().strip().split(os.pathsep) if p and p not in sys.path]
        _at = sys.path.index(_here) + 1 if _here in sys.path else 0
        sys.path[_at:_at] = _entries
except Exception:  # noqa: BLE001 - no file (nothing recorded) or anything else: start as is
    pass

try:
    import cachewarm_reporter

    cachewarm_reporter.start()
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass
