"""Testbed process handling: a process that dies at start is named with its log tail, and
stopping a process also ends what it spawned; the GCS emulator takes connections at once as
GCS does."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest

from cachewarm_testbed.cluster import Testbed
from cachewarm_testbed.processes import Proc, StartError, start, wait_until

pytestmark = pytest.mark.integration


def test_process_that_exits_at_start_is_named_with_its_log(tmp_path: Path) -> None:
    proc = start("fake-etcd", ["sh", "-c", "echo 'listen tcp: address already in use' >&2; exit 3"],
                 tmp_path / "fake.log")
    with pytest.raises(StartError) as err:
        wait_until(proc, lambda: False, timeout=10, what="healthy")
    text = str(err.value)
    assert text.startswith("fake-etcd exited (code 3) before healthy")
    assert "address already in use" in text


def test_process_that_never_gets_ready_times_out_with_its_log(tmp_path: Path) -> None:
    proc = start("slowpoke", ["sh", "-c", "echo still booting; sleep 30"], tmp_path / "slow.log")
    try:
        with pytest.raises(StartError, match="slowpoke was not ready after 1s") as err:
            wait_until(proc, lambda: False, timeout=1, what="ready")
        assert "still booting" in str(err.value)
    finally:
        proc.stop()


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    proc = start("parent", ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], tmp_path / "p.log")
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = Proc(name="child", pid=int(pidfile.read_text()), log=tmp_path / "none")
    assert child.alive()
    proc.stop(timeout=5)
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while child.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.alive()


def test_the_gcs_emulator_takes_many_connections_at_once_as_gcs_does(storage_bed: Testbed) -> None:
    """The emulator serves one request at a time; connections opened meanwhile must wait in
    its listen backlog, not be dropped (GCS takes any number at once). The first connection
    sends no request, so the emulator blocks reading it and accepts nothing else: with
    socketserver's default backlog of 5, once the queue is full (Linux holds backlog + 1)
    the next connect is never answered (its SYN is dropped) and times out here."""
    target = ("127.0.0.1", storage_bed.state.gcs_emulator_port)
    opened: list[socket.socket] = []
    try:
        for _ in range(32):
            conn = socket.create_connection(target, timeout=5)
            opened.append(conn)
        assert len(opened) == 32
    finally:
        for conn in opened:
            conn.close()
    # And it still answers once they are gone.
    with urllib.request.urlopen(f"{storage_bed.storage_emulator_host}/storage/v1/b?project=testbed", timeout=10) as answer:
        assert answer.status == 200
