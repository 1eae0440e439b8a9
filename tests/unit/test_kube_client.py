"""KubeClient's own promises: every request has a timeout, and a client without a
connection fails with KubeError instead of reaching for a default configuration."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from kubernetes import client

from cachewarm.clients.kube import KubeClient, KubeError


@pytest.fixture
def silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """An HTTP endpoint that accepts connections and never answers (a hung apiserver), and
    the connections it accepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", held
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_request_to_a_hung_apiserver_ends_in_a_kube_error_without_being_sent_again(
        silent_server: tuple[str, list[socket.socket]]) -> None:
    url, connections = silent_server
    kube = KubeClient.for_configuration(client.Configuration(host=url), timeout=0.3)
    with pytest.raises(KubeError, match="reading CompilationCache ml/llama: .*Timeout"):
        kube.get_cache("ml", "llama")
    with pytest.raises(KubeError, match="listing Jobs in ml"):
        kube.list_jobs("ml", "cachewarm.dev/warmer-for=llama")
    # One connection per call: a GET that timed out is not repeated (the reconcile retries).
    assert len(connections) == 2


def test_a_client_without_a_connection_refuses_every_call() -> None:
    with pytest.raises(KubeError, match="no connection"):
        KubeClient().list_pods("ml", "cachewarm.dev/cache=llama")


def test_the_lease_lock_gives_up_on_a_hung_apiserver(silent_server: tuple[str, list[socket.socket]]) -> None:
    """The election library passes no timeout; ours does, so a renewal stuck on a dead
    connection fails (and the replica stops leading) instead of waiting forever."""
    import threading as th

    import urllib3

    from cachewarm.runtime.leader import _FencedLeaseLock

    url, connections = silent_server
    kube = KubeClient.for_configuration(client.Configuration(host=url), timeout=0.3)
    lock = _FencedLeaseLock("cachewarm-operator", "cachewarm-system", "me", th.Event(), kube)
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="Read timed out"):
        lock.get("cachewarm-operator", "cachewarm-system")
    assert len(connections) == 1  # through the operator's client, once


def test_our_configmaps_go_through_the_typed_client_as_built() -> None:
    """create_configmap sends what typed() validated: the env and boot ConfigMaps (immutable,
    binaryData, the content annotation, the controller reference) survive it unchanged."""
    from cachewarm.api.model import parse_spec
    from cachewarm.builders.injection import env_configmap
    from cachewarm.builders.localcopy import BOOT_FILES, boot_configmap
    from cachewarm.clients.kube import typed

    cache = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}})
    owner = {"name": "llama", "uid": "u-1"}
    for body in (env_configmap(cache, "llama", "ml", owner),
                 boot_configmap("llama", "ml", owner, {f: "x = 1\n" for f in BOOT_FILES}, {"copier.pyc": b"\0\1"})):
        assert typed(body).immutable is True
    with pytest.raises(KubeError):
        typed({**env_configmap(cache, "llama", "ml", owner), "immutible": True})  # a field the API does not have
