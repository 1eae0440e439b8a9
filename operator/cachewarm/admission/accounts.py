"""The ServiceAccounts the admission webhook reads: whether a labelled pod that leaves its
own automountServiceAccountToken unset opted out of tokens through its ServiceAccount
(Kubernetes' rule), which decides whether it takes our projected token.

A read is one GET in the admission path, which the apiserver gives 3 s in all: each is
bounded by READ_TIMEOUT_SECONDS; an answer is kept TTL_SECONDS (a failed read
ERROR_TTL_SECONDS), per namespace/name, at most MAX_KEPT of them; admissions of pods of
one ServiceAccount at once share one read. No informer: a watch of every ServiceAccount in
the cluster, held in memory by every replica, for a field a few pods leave to it. So a
change to a ServiceAccount's field takes effect for new pods within TTL_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from cachewarm.admission.admit import ServiceAccountAutomount
from cachewarm.clients.kube import KubeClient, KubeError

READ_TIMEOUT_SECONDS = 1.0
TTL_SECONDS = 10.0
ERROR_TTL_SECONDS = 2.0
MAX_KEPT = 4096

# (namespace, name, timeout seconds) -> the ServiceAccount as stored, None when missing; raises KubeError
Reader = Callable[[str, str, float], Mapping[str, Any] | None]

log = logging.getLogger("cachewarm.webhook")


class ServiceAccounts:
    """What pods' ServiceAccounts say of token automount, read by `read` and kept a while.
    Used on the event loop only (the read itself runs in a thread)."""

    def __init__(self, read: Reader, *, clock: Callable[[], float] = time.monotonic,
                 timeout: float = READ_TIMEOUT_SECONDS, ttl: float = TTL_SECONDS,
                 error_ttl: float = ERROR_TTL_SECONDS, max_kept: int = MAX_KEPT) -> None:
        self._read, self._clock = read, clock
        self.timeout, self.ttl, self.error_ttl, self.max_kept = timeout, ttl, error_ttl, max_kept
        self._kept: dict[tuple[str, str], tuple[float, ServiceAccountAutomount]] = {}  # -> (until, answer)
        self._reading: dict[tuple[str, str], asyncio.Future[ServiceAccountAutomount]] = {}

    @classmethod
    def of(cls, kube: KubeClient) -> ServiceAccounts:
        return cls(lambda ns, name, timeout: kube.read_service_account(ns, name, timeout=timeout))

    async def automount(self, namespace: str, name: str) -> ServiceAccountAutomount:
        """ServiceAccount namespace/name's automountServiceAccountToken, or why it could not
        be read (it does not exist, the read was refused or timed out). Raises nothing."""
        key = (namespace, name)
        kept = self._kept.get(key)
        if kept is not None and kept[0] > self._clock():
            return kept[1]
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read_one(namespace, name))
            self._reading[key] = reading
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        # shield: an admission given up by its caller leaves the shared read to the others.
        return await asyncio.shield(reading)

    async def _read_one(self, namespace: str, name: str) -> ServiceAccountAutomount:
        try:
            # The client's own timeout bounds the GET; wait_for bounds the thread hop too.
            found = await asyncio.wait_for(asyncio.to_thread(self._read, namespace, name, self.timeout),
                                           self.timeout + 0.5)
        except KubeError as exc:
            answer = ServiceAccountAutomount(name, error=str(exc))
        except TimeoutError:
            answer = ServiceAccountAutomount(name, error=f"no answer within {self.timeout:g}s")
        else:
            if found is None:
                answer = ServiceAccountAutomount(name, error="it does not exist")
            else:
                value = found.get("automountServiceAccountToken")
                answer = ServiceAccountAutomount(name, automount=value if isinstance(value, bool) else None)
        if answer.error:
            log.warning("Could not read ServiceAccount %s/%s; its pods that leave automountServiceAccountToken "
                        "unset get no token from cachewarm: %s", namespace, name, answer.error)
        self._keep((namespace, name), answer)
        return answer

    def _keep(self, key: tuple[str, str], answer: ServiceAccountAutomount) -> None:
        now = self._clock()
        if len(self._kept) >= self.max_kept:
            for old in [k for k, (until, _) in self._kept.items() if until <= now]:
                del self._kept[old]
        while len(self._kept) >= self.max_kept:
            del self._kept[next(iter(self._kept))]  # the oldest kept
        self._kept.pop(key, None)
        self._kept[key] = (now + (self.error_ttl if answer.error else self.ttl), answer)
