"""Leader election: of all the operator's replicas, exactly one reconciles caches (and
releases held pods); every replica serves the webhook and keeps its indexes current.

A coordination.k8s.io Lease, through the official client's `kubernetes.leaderelection`
(the same Lease protocol as client-go: the holder renews it every RETRY_PERIOD seconds; a
candidate takes it once it has seen no renewal for LEASE_DURATION seconds). The election
runs in a daemon thread of its own; the controller asks `is_leader` before each reconcile
and is told (on its event loop) when leadership is won or lost. A replica that stops
cleanly clears the Lease's holder, so the next one takes over at its next try instead of
after a whole lease.

The holder's identity also says where it takes reports (`pod@host:port`): followers read
the Lease anyway (every RETRY_PERIOD), so they learn where to forward a report without a
call of their own (receiver.Forwarder).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from cachewarm.clients.kube import KubeClient, KubeError

# client-go's defaults (kube-controller-manager and kube-scheduler use the same).
LEASE_DURATION = 15
RENEW_DEADLINE = 10
RETRY_PERIOD = 2
# Each Lease request gives up well inside the renew deadline: a renewal stuck on a dead
# connection would otherwise keep this replica leading after another took the Lease.
LEASE_REQUEST_TIMEOUT = RENEW_DEADLINE / 2
log = logging.getLogger("cachewarm.leader")
# The library logs every retry of a follower at INFO ("yet to finish lease_duration"):
# every 2 s, forever. Our own lines say when leadership changes.
logging.getLogger("leaderelection").setLevel(logging.WARNING)


def address(host: str, port: int) -> str:
    """`host:port` as a URL's authority wants it (an IPv6 host in brackets); '' without a
    host."""
    if not host:
        return ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def identity(pod_name: str, where: str = "") -> str:
    """This replica's name in the Lease: its Pod's name (stable across container restarts,
    so a restarted leader takes its own Lease back at once), else host and a nonce; then,
    when known, `@host:port` where it takes reports (the Pod's IP, as stable as its name),
    so followers know where to forward them."""
    name = pod_name or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    return f"{name}@{where}" if where else name


def parse_identity(holder: str | None) -> tuple[str, str | None]:
    """(name, address or None) of a Lease holder's identity as `identity` builds it: the
    address follows the last '@' (a Pod name has none) and ends in a port. An identity
    without one (a replica that knew no address, another client's) is all name."""
    name, _, where = (holder or "").rpartition("@")
    host, colon, port = where.rpartition(":")
    if name and host and colon and port.isdigit():
        return name, where
    return holder or "", None


class _FencedLeaseLock(LeaseLock):
    """The Lease lock, which refuses to write once this replica is stopping: the library's
    renew loop then fails its next renewal and stops leading, instead of taking the Lease
    back after `release` gave it up. It tells `seen` the holder's identity each time it
    reads or writes the Lease (None: the Lease is gone or has no holder)."""

    def __init__(self, name: str, namespace: str, identity: str, stopping: threading.Event,
                 kube: KubeClient, seen: Callable[[str | None], None] = lambda holder: None) -> None:
        super().__init__(name, namespace, identity)  # type: ignore[no-untyped-call]
        self.api_instance = _TimedLeases(client.CoordinationV1Api(kube.api_client),
                                         min(kube.timeout, LEASE_REQUEST_TIMEOUT))  # type: ignore[assignment]
        self._stopping = stopping
        self._seen = seen

    def get(self, name: str, namespace: str) -> tuple[bool, Any]:
        """The library's (found, election record or the ApiException). A failure other
        than a missing Lease keeps what was seen last: the holder is likely the same."""
        found, record = super().get(name, namespace)  # type: ignore[no-untyped-call]
        if found:
            self._seen(getattr(record, "holder_identity", None) or None)
        elif getattr(record, "status", None) == 404:
            self._seen(None)
        return bool(found), record

    def create(self, name: str, namespace: str, election_record: object) -> bool:
        if self._stopping.is_set() or not super().create(name, namespace, election_record):  # type: ignore[no-untyped-call]
            return False
        self._seen(getattr(election_record, "holder_identity", None))
        return True

    def update(self, name: str, namespace: str, updated_record: object) -> bool:
        if self._stopping.is_set() or not super().update(name, namespace, updated_record):  # type: ignore[no-untyped-call]
            return False
        self._seen(getattr(updated_record, "holder_identity", None))
        return True


class _TimedLeases:
    """The three Lease calls the library's lock makes, on the operator's connection, each
    with a timeout (the library passes none)."""

    def __init__(self, api: client.CoordinationV1Api, timeout: float) -> None:
        self.read_namespaced_lease = functools.partial(api.read_namespaced_lease, _request_timeout=timeout)
        self.create_namespaced_lease = functools.partial(api.create_namespaced_lease, _request_timeout=timeout)
        self.replace_namespaced_lease = functools.partial(api.replace_namespaced_lease, _request_timeout=timeout)


class Leadership:
    """Whether this replica leads. `on_change(True|False)`, given to `start`, is called
    from the election's thread on every change; the caller hops to its own loop."""

    def __init__(self, kube: KubeClient, namespace: str, name: str, identity: str) -> None:
        self.kube = kube
        self.namespace, self.name, self.identity = namespace, name, identity
        self._on_change: Callable[[bool], None] = lambda leading: None
        self._leading = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder: str | None = None

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set()

    @property
    def holder(self) -> str | None:
        """The Lease's holder identity as this replica last read or wrote it (at most
        RETRY_PERIOD old while the apiserver answers); None before the first read or when
        nobody holds the Lease."""
        return self._holder

    def _seen(self, holder: str | None) -> None:
        self._holder = holder  # one reference written by the election's thread, read anywhere

    def start(self, on_change: Callable[[bool], None]) -> None:
        self._on_change = on_change
        self._thread = threading.Thread(target=self._elect_forever, name="leader-election", daemon=True)
        self._thread.start()

    def _elect_forever(self) -> None:
        while not self._stopping.is_set():
            config = electionconfig.Config(  # type: ignore[no-untyped-call]
                _FencedLeaseLock(self.name, self.namespace, self.identity, self._stopping, self.kube, self._seen),
                lease_duration=LEASE_DURATION, renew_deadline=RENEW_DEADLINE, retry_period=RETRY_PERIOD,
                onstarted_leading=self._started, onstopped_leading=self._stopped,
            )
            try:
                # Returns after this replica led and then failed to renew in time.
                leaderelection.LeaderElection(config).run()  # type: ignore[no-untyped-call]
            except Exception:  # noqa: BLE001 - the election must go on whatever the API answered
                log.exception("Leader election failed; trying again")
                self._stopped()
            threading.Event().wait(RETRY_PERIOD)

    def _started(self) -> None:
        if self._stopping.is_set():
            return
        log.info("Leading: this replica reconciles caches", extra={"lease": f"{self.namespace}/{self.name}",
                                                                   "identity": self.identity})
        self._leading.set()
        self._on_change(True)

    def _stopped(self) -> None:
        if not self._leading.is_set():
            return
        self._leading.clear()
        log.warning("Lost the lead: another replica reconciles caches now",
                    extra={"lease": f"{self.namespace}/{self.name}", "identity": self.identity})
        self._on_change(False)

    def stop(self) -> bool:
        """At shutdown, first: lead no more (no new reconcile starts) and never write the
        Lease again. Returns whether this replica was leading."""
        was_leading = self._leading.is_set()
        self._stopping.set()
        self._leading.clear()
        return was_leading

    def release(self) -> None:
        """At shutdown, once reconciles in flight are done: clear the Lease's holder (best
        effort) so another replica takes over at its next try."""
        try:
            self.kube.release_lease(self.namespace, self.name, self.identity)
        except KubeError as exc:
            log.warning("Could not release the Lease: %s", exc)


class AlwaysLeader:
    """No election (one process, e.g. outside a cluster without CACHEWARM_POD_NAMESPACE):
    this process leads from the start."""

    identity = "standalone"

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def holder(self) -> str:
        """Itself: there is no Lease, and no other replica to forward reports to it."""
        return self.identity

    def start(self, on_change: Callable[[bool], None]) -> None:
        on_change(True)

    def stop(self) -> bool:
        return True

    def release(self) -> None:
        return None
