"""cachewarm: a Kubernetes operator that keeps JAX/XLA compilation caches on GCS warm."""

__version__ = "0.1.0"
