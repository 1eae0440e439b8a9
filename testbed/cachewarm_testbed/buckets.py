"""What a bucket's owner does on GCS for cachewarm, as tests and benchmarks do it on the
emulator: grant a bucket (a prefix of it) to a namespace with the label the operator's
BucketNotGranted message names (docs/bucket-and-data-safety.md#bucket-consent)."""

from __future__ import annotations

from google.cloud import storage

from cachewarm.builders.bucket import grant_label


def grant(client: storage.Client, bucket: str, namespace: str, prefix: str = "", instance: str = "default") -> str:
    """Add the grant label for (instance, namespace, prefix) to the bucket, as its owner
    would with `gcloud storage buckets update --update-labels`; returns the label's key."""
    key, value = grant_label(namespace, prefix, instance)
    found = client.get_bucket(bucket)
    found.labels = {**(found.labels or {}), key: value}
    found.patch()
    return key


def revoke(client: storage.Client, bucket: str, key: str) -> None:
    """Remove a grant label, as its owner would with `--remove-labels`."""
    found = client.get_bucket(bucket)
    labels = dict(found.labels or {})
    labels.pop(key, None)
    found.labels = labels
    found.patch()
