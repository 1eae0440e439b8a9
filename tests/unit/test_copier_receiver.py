"""The copier's receiver (issue 30: a download's body read into one reused buffer): an
http.client answer's body, one receive at a time, never past its Content-Length; a chunked
answer through http.client's own decoding. Real http.client answers over a socket pair, the
server's end written by the test; its end is kept open after the body, as a keep-alive
server's would be, so reading past the body would wait (the client's socket timeout turns
such a wait into a failure instead of a hang)."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import pytest

from cachewarm.agents import copier


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    server, client = socket.socketpair()
    client.settimeout(5)  # a receive that would wait for more than was sent fails
    yield server, client
    server.close()
    client.close()


def answer_to(server: socket.socket, client: socket.socket, head: bytes) -> http.client.HTTPResponse:
    server.sendall(head)
    answer = http.client.HTTPResponse(client, method="GET")
    answer.begin()
    return answer


def test_the_body_is_read_to_its_content_length_and_not_past_it(pair: tuple[socket.socket, socket.socket]) -> None:
    server, client = pair
    answer = answer_to(server, client, b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello")
    receive = copier.receiver(answer)
    buffer = memoryview(bytearray(64))
    # What arrived so far comes back without waiting for the rest of the body.
    assert bytes(buffer[:receive(buffer)]) == b"hello"
    server.sendall(b" world" + b"NEXT ANSWER")  # the body's end, then bytes that are not its
    got = b""
    while count := receive(buffer):
        got += bytes(buffer[:count])
    assert got == b" world"
    assert receive(buffer) == 0


def test_a_receive_fills_at_most_the_buffer_given(pair: tuple[socket.socket, socket.socket]) -> None:
    server, client = pair
    answer = answer_to(server, client, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789")
    receive = copier.receiver(answer)
    buffer = memoryview(bytearray(16))
    assert receive(buffer[:4]) == 4 and bytes(buffer[:4]) == b"0123"
    assert receive(buffer[4:]) == 6 and bytes(buffer[:10]) == b"0123456789"


def test_without_content_length_the_body_ends_with_the_connection(pair: tuple[socket.socket, socket.socket]) -> None:
    server, client = pair
    answer = answer_to(server, client, b"HTTP/1.0 200 OK\r\n\r\nall of it")
    server.shutdown(socket.SHUT_WR)
    receive = copier.receiver(answer)
    buffer = memoryview(bytearray(64))
    got = b""
    while count := receive(buffer):
        got += bytes(buffer[:count])
    assert got == b"all of it"


def test_a_chunked_body_is_decoded_by_http_client(pair: tuple[socket.socket, socket.socket]) -> None:
    server, client = pair
    answer = answer_to(server, client, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                       b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nNEXT ANSWER")
    receive = copier.receiver(answer)
    buffer = memoryview(bytearray(64))
    got = b""
    while count := receive(buffer):
        got += bytes(buffer[:count])
    assert got == b"hello world"
