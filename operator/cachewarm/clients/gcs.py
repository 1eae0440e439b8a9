"""All of cachewarm's calls to Google Cloud Storage, through google-cloud-storage.

Library exceptions become `GcsError` subclasses here and nowhere else. Retries: reads use
the library's standard retry (DEFAULT_RETRY, bounded in time); every write is either
conditional (bucket PATCH on its metageneration, object PATCH and DELETE on the object's
generation and metageneration), so a retry after a lost response fails its precondition
instead of writing twice, or it is a bucket insert, which the reconcile retries itself
after re-reading (a repeated insert answers 409, handled by the caller).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import google.auth.exceptions
import requests
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from cachewarm.api import constants as c
from cachewarm.api.bucket import BucketInfo

T = TypeVar("T")


# objects.list asks for these fields only: smaller pages than the full object resources.
LIST_FIELDS = "items(name,size,timeCreated,customTime,generation,metageneration),nextPageToken"


class GcsError(Exception):
    """A GCS call failed. `retryable` says whether the same call may work later."""

    reason = "GCSError"
    retryable = True

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GcsUnavailable(GcsError):
    """429, 5xx, a timeout or a broken connection: try again with backoff."""

    reason = c.Reason.GCS_UNAVAILABLE


class GcsForbidden(GcsError):
    """403/401 or missing credentials: the operator's identity lacks a permission."""

    reason = c.Reason.ACCESS_DENIED


class GcsConflict(GcsError):
    """409: e.g. the bucket name is taken by another project."""

    reason = c.Reason.NAME_TAKEN


class GcsNotFound(GcsError):
    """404 on something that must exist."""

    reason = c.Reason.BUCKET_NOT_FOUND


class GcsPreconditionFailed(GcsError):
    """412: the bucket or object changed since it was read; re-read and try again."""

    reason = c.Reason.BUCKET_BUSY


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    created: dt.datetime | None = None
    custom_time: dt.datetime | None = None
    generation: int | None = None
    metageneration: int | None = None


def _translate(call: Callable[[], T], what: str) -> T:
    try:
        return call()
    except gexc.NotFound as exc:
        raise GcsNotFound(f"{what}: not found", status=404) from exc
    except (gexc.Forbidden, gexc.Unauthorized) as exc:
        raise GcsForbidden(f"{what}: permission denied ({exc.message})", status=exc.code) from exc
    except gexc.PreconditionFailed as exc:
        raise GcsPreconditionFailed(f"{what}: changed concurrently ({exc.message})", status=412) from exc
    except gexc.Conflict as exc:
        raise GcsConflict(f"{what}: conflict ({exc.message})", status=409) from exc
    except (gexc.TooManyRequests, gexc.ServerError) as exc:
        raise GcsUnavailable(f"{what}: GCS answered {exc.code} ({exc.message})", status=exc.code) from exc
    except gexc.GoogleAPICallError as exc:
        raise GcsError(f"{what}: GCS answered {exc.code} ({exc.message})", status=exc.code) from exc
    except (requests.Timeout, requests.ConnectionError) as exc:
        raise GcsUnavailable(f"{what}: {type(exc).__name__} talking to GCS") from exc
    except google.auth.exceptions.GoogleAuthError as exc:
        raise GcsForbidden(f"{what}: no usable GCP credentials ({exc})") from exc


def _set(bucket: storage.Bucket, fields: Mapping[str, Any]) -> None:
    """Set the fields of a builders.bucket.bucket_patch on the library's bucket object."""
    if "labels" in fields:
        bucket.labels = fields["labels"]
    if "lifecycle" in fields:
        bucket.lifecycle_rules = fields["lifecycle"]["rule"]
    if "softDeletePolicy" in fields:
        bucket.soft_delete_policy.retention_duration_seconds = fields["softDeletePolicy"]["retentionDurationSeconds"]
    if "iamConfiguration" in fields:
        iam = fields["iamConfiguration"]
        bucket.iam_configuration.uniform_bucket_level_access_enabled = iam["uniformBucketLevelAccess"]["enabled"]
        bucket.iam_configuration.public_access_prevention = iam["publicAccessPrevention"]
    if "storageClass" in fields:
        bucket.storage_class = fields["storageClass"]


def _info(bucket: storage.Bucket) -> BucketInfo:
    iam = bucket.iam_configuration
    soft = bucket.soft_delete_policy.retention_duration_seconds
    # The library skips a rule of an action type it does not know (with a warning): such a
    # bucket's rules cannot be written back whole, so the rules GCS sent (the resource's
    # JSON as the library holds it) that it did not yield are counted. No warnings filter:
    # that state is process-wide and kopf runs handlers in threads.
    sent = (bucket._properties.get("lifecycle") or {}).get("rule") or []
    rules = [dict(rule) for rule in bucket.lifecycle_rules]
    return BucketInfo(
        name=bucket.name,
        location=bucket.location or "",
        storage_class=bucket.storage_class or "",
        labels=dict(bucket.labels or {}),
        lifecycle_rules=rules,
        unreadable_rules=max(len(sent) - len(rules), 0),
        soft_delete_seconds=int(soft) if soft is not None else None,
        uniform_access=bool(iam.uniform_bucket_level_access_enabled),
        public_access_prevention=str(iam.public_access_prevention or ""),
        metageneration=int(bucket.metageneration or 0),
    )


class GcsClient:
    """Bucket administration and object listing for cache buckets."""

    def __init__(self, *, project: str = "", timeout: float = 30.0, client: storage.Client | None = None) -> None:
        self._project = project or None
        self._timeout = timeout
        self._client = client
        # The library's standard retry (429, 5xx, broken connections) with backoff, for
        # idempotent or conditional calls only; bounded so a reconcile never hangs on it.
        self._retry: Retry = DEFAULT_RETRY.with_timeout(max(4 * timeout, 10.0))

    @property
    def client(self) -> storage.Client:
        # Created lazily: ADC lookup can be slow and must not run at import time.
        if self._client is None:
            self._client = _translate(lambda: storage.Client(project=self._project), "creating GCS client")
        return self._client

    def get_bucket(self, name: str) -> BucketInfo | None:
        """The bucket, or None when it does not exist. Raises GcsError."""
        bucket = _translate(
            lambda: self.client.lookup_bucket(name, timeout=self._timeout, retry=self._retry),
            f"reading bucket {name}",
        )
        return _info(bucket) if bucket is not None else None

    def list_bucket_labels(self) -> Iterator[tuple[str, Mapping[str, str]]]:
        """(name, labels) of every bucket of the operator's project, a page at a time (only
        those fields asked for). Raises GcsError."""
        pages = iter(self.client.list_buckets(project=self._project, fields="items(name,labels),nextPageToken",
                                              timeout=self._timeout, retry=self._retry).pages)
        while True:
            page = _translate(lambda: next((list(p) for p in pages), None), "listing the project's buckets")
            if page is None:
                return
            for bucket in page:
                yield bucket.name, dict(bucket.labels or {})

    def create_bucket(
        self, name: str, *, location: str, storage_class: str, labels: dict[str, str],
        settings: Mapping[str, Any] | None = None,
    ) -> BucketInfo:
        """Create the bucket with uniform access and public access prevention, and with
        `settings` (fields of a builders.bucket.bucket_patch: lifecycle, its labels, soft
        delete) in the same call, so a new bucket needs no PATCH.

        Raises GcsConflict when the name exists (in any project), GcsError otherwise.
        """
        bucket = self.client.bucket(name)
        bucket.storage_class = storage_class
        bucket.labels = labels
        bucket.iam_configuration.uniform_bucket_level_access_enabled = True
        bucket.iam_configuration.public_access_prevention = "enforced"
        _set(bucket, {**(settings or {}), "labels": {**labels, **((settings or {}).get("labels") or {})}})
        created = _translate(
            lambda: self.client.create_bucket(
                bucket, location=location, project=self._project, timeout=self._timeout, retry=None
            ),
            f"creating bucket {name}",
        )
        return _info(created)

    def patch_bucket(self, current: BucketInfo, patch: dict[str, Any]) -> BucketInfo:
        """Apply a patch made by builders.bucket.bucket_patch to the bucket as `current`
        describes it, only if its metageneration is still `current.metageneration`.

        Raises GcsPreconditionFailed when someone changed the bucket since it was read
        (re-read and re-merge), GcsError otherwise.
        """
        name = current.name
        bucket = self.client.bucket(name)
        if "labels" in patch:
            # GCS merges a PATCH's labels into the bucket's; a label is removed by sending it
            # as null. The library sends null for the labels a new map leaves out of the one
            # it knew, so it is first told the labels as read.
            bucket.labels = dict(current.labels)
        _set(bucket, patch)
        _translate(
            lambda: bucket.patch(if_metageneration_match=current.metageneration, timeout=self._timeout,
                                 retry=self._retry),
            f"updating bucket {name}",
        )
        return _info(bucket)

    def list_objects(self, bucket: str, prefix: str, *, glob: str | None = None) -> Iterator[ObjectInfo]:
        """Objects whose names start with `prefix` (and, with `glob`, match that GCS
        matchGlob pattern; the others are left out of the answer, though their pages may
        still be cut and billed). Only the fields ObjectInfo needs are fetched, and one page
        (at most 1000) is held at a time. Raises GcsError."""
        pages = iter(self.client.list_blobs(bucket, prefix=prefix or None, match_glob=glob, fields=LIST_FIELDS,
                                            timeout=self._timeout, retry=self._retry).pages)
        while True:
            # A page may be empty and still not the last (if matchGlob filters after paging).
            page = _translate(lambda: next((list(p) for p in pages), None), f"listing gs://{bucket}/{prefix}")
            if page is None:
                return
            for blob in page:
                yield ObjectInfo(name=blob.name, size=int(blob.size or 0), created=blob.time_created,
                                 custom_time=blob.custom_time, generation=blob.generation,
                                 metageneration=blob.metageneration)

    def set_custom_time(self, bucket: str, obj: ObjectInfo, when: dt.datetime) -> bool:
        """Set an object's customTime (GCS only moves it forward), if the object is still the
        generation and metageneration that was listed. Returns False when it was not (it
        changed meanwhile: a warmer stamped it, or it was replaced or deleted). Raises GcsError."""
        blob = self.client.bucket(bucket).blob(obj.name)
        blob.custom_time = when
        try:
            _translate(
                lambda: blob.patch(if_generation_match=obj.generation, if_metageneration_match=obj.metageneration,
                                   timeout=self._timeout, retry=self._retry),
                f"setting customTime of gs://{bucket}/{obj.name}",
            )
        except (GcsPreconditionFailed, GcsNotFound):
            return False
        return True

    def delete_object(self, bucket: str, obj: ObjectInfo) -> None:
        """Delete the listed generation of one object; an object already gone counts as
        deleted. Raises GcsPreconditionFailed when it was replaced since it was listed
        (list again), GcsError otherwise."""
        blob = self.client.bucket(bucket).blob(obj.name)
        try:
            _translate(
                lambda: blob.delete(if_generation_match=obj.generation, timeout=self._timeout, retry=self._retry),
                f"deleting gs://{bucket}/{obj.name}",
            )
        except GcsNotFound:
            pass

    def delete_bucket(self, name: str) -> bool:
        """Delete an empty bucket; a bucket already gone counts as deleted. Returns False
        when GCS refuses because the bucket is not empty (409: objects were written since
        it was listed); the bucket is then kept. Raises GcsError otherwise."""
        try:
            _translate(lambda: self.client.bucket(name).delete(timeout=self._timeout, retry=self._retry),
                       f"deleting bucket {name}")
        except GcsNotFound:
            pass
        except GcsConflict:
            return False
        return True
