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
def silent_server() -> Iterator[str]:
    """An HTTP endpoint that accepts connections and never answers (a hung apiserver)."""
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
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_request_to_a_hung_apiserver_ends_in_a_kube_error(silent_server: str) -> None:
    configuration = client.Configuration(host=silent_server)
    configuration.retries = False
    kube = KubeClient(client.ApiClient(configuration), timeout=0.3)
    with pytest.raises(KubeError, match="reading CompilationCache ml/llama: .*Timeout"):
        kube.get_cache("ml", "llama")
    with pytest.raises(KubeError, match="listing Jobs in ml"):
        kube.list_jobs("ml", "cachewarm.dev/warmer-for=llama")


def test_a_client_without_a_connection_refuses_every_call() -> None:
    with pytest.raises(KubeError, match="no connection"):
        KubeClient().list_pods("ml", "cachewarm.dev/cache=llama")
