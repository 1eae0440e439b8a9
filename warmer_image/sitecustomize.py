"""cachewarm's start-up hook in training pods (copied with cachewarm_reporter.py into the
directory that starts the pod's PYTHONPATH): counts the process's JAX cache use and
reports it to cachewarm. It runs the image's own sitecustomize too, and never raises."""

try:
    import cachewarm_reporter

    cachewarm_reporter.start()
except Exception:  # noqa: BLE001 - training must start whatever happens here
    pass
