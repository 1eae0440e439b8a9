"""clients/gcs.py's reading of a bucket resource, without GCS: the JSON the library holds."""

from __future__ import annotations

import threading
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import storage

from cachewarm.clients import gcs

THEIRS = {"action": {"type": "Delete"}, "condition": {"age": 365, "matchesPrefix": ["logs/"]}}
FUTURE = {"action": {"type": "SomeFutureAction"}, "condition": {"age": 1}}


def resource(*rules: dict[str, Any]) -> storage.Bucket:
    bucket = storage.Bucket(client=None, name="b")  # type: ignore[arg-type]
    bucket._set_properties({"name": "b", "location": "US", "metageneration": "3",
                            **({"lifecycle": {"rule": list(rules)}} if rules else {})})
    return bucket


def test_rules_the_library_cannot_read_are_counted_in_every_thread() -> None:
    """Counted from the resource's JSON, not from warnings (process-wide state that threads
    race on): a lifecycle write must never drop a rule of an unknown action type."""
    cases = [(resource(THEIRS, FUTURE), 1), (resource(THEIRS), 0), (resource(FUTURE, FUTURE), 2), (resource(), 0)]
    wrong: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def loop(offset: int) -> None:
        start.wait()
        for i in range(1500):
            bucket, expected = cases[(i + offset) % len(cases)]
            got = gcs._info(bucket)
            if got.unreadable_rules != expected:
                wrong.append((expected, got.unreadable_rules))

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    info = gcs._info(resource(THEIRS, FUTURE))
    assert info.lifecycle_rules == [THEIRS] and info.unreadable_rules == 1 and info.metageneration == 3


class _RefusingBucket:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def delete(self, **kw: Any) -> None:
        raise self.error


class _Client:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def bucket(self, name: str) -> _RefusingBucket:
        return _RefusingBucket(self.error)


def test_deleting_a_bucket_that_is_not_empty_says_so_and_is_not_a_name_conflict() -> None:
    client = gcs.GcsClient(client=_Client(gexc.Conflict("The bucket you tried to delete is not empty.")))  # type: ignore[arg-type]
    assert client.delete_bucket("b") is False
    assert gcs.GcsClient(client=_Client(gexc.NotFound("gone"))).delete_bucket("b") is True  # type: ignore[arg-type]
