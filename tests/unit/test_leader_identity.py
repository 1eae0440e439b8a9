"""The leader's identity in the Lease names where it takes reports (`pod@host:port`), and
the lock remembers the holder it read, so followers know where to forward reports."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord

from cachewarm.clients.kube import KubeClient
from cachewarm.runtime.leader import AlwaysLeader, _FencedLeaseLock, address, identity, parse_identity


@pytest.mark.parametrize(("host", "port", "expected"), [
    ("10.4.0.7", 9443, "10.4.0.7:9443"),
    ("fd00:10:244::7", 9443, "[fd00:10:244::7]:9443"),
    ("", 9443, ""),
])
def test_an_address_puts_an_ipv6_host_in_brackets(host: str, port: int, expected: str) -> None:
    assert address(host, port) == expected


@pytest.mark.parametrize(("pod", "where", "holder"), [
    ("cachewarm-operator-7d9f-abcde", "10.4.0.7:9443", "cachewarm-operator-7d9f-abcde@10.4.0.7:9443"),
    ("cachewarm-operator-7d9f-abcde", "[fd00:10:244::7]:9443", "cachewarm-operator-7d9f-abcde@[fd00:10:244::7]:9443"),
    ("cachewarm-operator-7d9f-abcde", "", "cachewarm-operator-7d9f-abcde"),
])
def test_an_identity_is_parsed_back_into_its_pod_and_address(pod: str, where: str, holder: str) -> None:
    assert identity(pod, where) == holder
    assert parse_identity(holder) == (pod, where or None)


def test_without_a_pod_name_the_identity_is_unique_and_still_names_the_address() -> None:
    first, second = identity("", "127.0.0.1:9443"), identity("", "127.0.0.1:9443")
    assert first != second
    assert parse_identity(first)[1] == "127.0.0.1:9443"


@pytest.mark.parametrize(("holder", "parsed"), [
    (None, ("", None)),
    ("", ("", None)),
    # The address follows the last '@'.
    ("odd@name@10.0.0.1:9443", ("odd@name", "10.0.0.1:9443")),
    # Not an address of ours (no port, or nothing before the '@'): all of it is the name.
    ("someone@example.com", ("someone@example.com", None)),
    ("pod@10.0.0.1", ("pod@10.0.0.1", None)),
    ("pod@10.0.0.1:", ("pod@10.0.0.1:", None)),
    ("@10.0.0.1:9443", ("@10.0.0.1:9443", None)),
])
def test_identities_written_otherwise_have_no_address(holder: str | None, parsed: tuple[str, str | None]) -> None:
    assert parse_identity(holder) == parsed


def test_a_process_without_election_is_its_own_holder_with_no_address() -> None:
    assert parse_identity(AlwaysLeader().holder) == ("standalone", None)


class _Leases:
    """read_namespaced_lease answering from `answers` in turn (a Lease, or an exception)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def read_namespaced_lease(self, name: str, namespace: str) -> Any:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def create_namespaced_lease(self, namespace: str, body: client.V1Lease) -> client.V1Lease:
        return body


def _lease(holder: str | None) -> client.V1Lease:
    return client.V1Lease(metadata=client.V1ObjectMeta(name="cachewarm-operator"),
                          spec=client.V1LeaseSpec(holder_identity=holder, lease_duration_seconds=15))


def test_the_lock_remembers_the_holder_it_read() -> None:
    seen: list[str | None] = []
    lock = _FencedLeaseLock("cachewarm-operator", "cachewarm-system", "me@10.0.0.2:9443", threading.Event(),
                            KubeClient.for_configuration(client.Configuration(host="https://127.0.0.1:1")), seen.append)
    lock.api_instance = _Leases(  # type: ignore[assignment]
        _lease("other@10.0.0.1:9443"),
        ApiException(status=500, reason="Internal Server Error"),  # not known now: the last one stands
        _lease(None),                                             # released
        ApiException(status=404, reason="Not Found"),             # gone
    )
    for _ in range(4):
        lock.get("cachewarm-operator", "cachewarm-system")
    assert seen == ["other@10.0.0.1:9443", None, None]
    # ...and the one it wrote itself.
    assert lock.create("cachewarm-operator", "cachewarm-system",
                       LeaderElectionRecord("me@10.0.0.2:9443", "15", "2026-01-01 00:00:00",  # type: ignore[no-untyped-call]
                                            "2026-01-01 00:00:00"))
    assert seen[-1] == "me@10.0.0.2:9443"
