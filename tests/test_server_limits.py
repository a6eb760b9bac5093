"""Idle and slow connections against the real uvicorn server (`serve`'s own config) on 127.0.0.1: sockets that
send nothing or dribble their request hold no slot and are closed on their deadlines; the concurrency limit
counts requests being answered, /health is always answered, and every refusal is an OpenAI error object.
Deadlines are shortened (0.5-1 s) so that each test takes a few seconds; socket counts are bounded (300)."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import time

import httpx
import pytest

from test_server_unit import FakeEngine, LiveServer, assert_error, chat_body, expected_chat_reply

HEADERS_S, BODY_S, KEEP_ALIVE_S = 1.0, 0.5, 0.5
DEADLINES = {"timeout_headers": HEADERS_S, "timeout_keep_alive": KEEP_ALIVE_S}


@pytest.fixture(scope="module")
def live():
    with LiveServer(FakeEngine(), limit_concurrency=256, timeout_body=BODY_S, server_options=DEADLINES) as server:
        yield server


def connect(live: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=10)


def seconds_until_closed(sock: socket.socket, limit: float = 10.0) -> float:
    """Seconds until the server closes `sock` (reading and discarding what it sends), at most `limit`."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(65536):
            pass
    return time.monotonic() - t0


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        data += chunk
    return data


def timed(f, *args, **kwargs) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    r = f(*args, **kwargs)
    return time.monotonic() - t0, r


def test_idle_sockets_hold_no_slot_and_are_closed_on_the_headers_deadline(live):
    """Issue 36's attack: more idle sockets than --limit-concurrency. /health and a chat request still
    answer at once, and the sockets are closed once their request heads are overdue."""
    sockets = [connect(live) for _ in range(300)]
    try:
        with httpx.Client(base_url=live.url, timeout=10) as c:
            took, r = timed(c.get, "/health")
            assert r.status_code == 200 and took < 1.0, took
            took, r = timed(c.post, "/v1/chat/completions", json=chat_body())
            assert r.status_code == 200 and took < 1.0, took
            assert r.json()["choices"][0]["message"]["content"] == expected_chat_reply()
        t0 = time.monotonic()
        for sock in sockets:
            seconds_until_closed(sock, limit=10)
        waited = time.monotonic() - t0
        assert waited < HEADERS_S + 3, waited  # all of them, on one deadline
    finally:
        for sock in sockets:
            sock.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_off_on_the_deadline():
    """Slow loris: bytes keep coming, but the head is never complete: closed at HEADERS_S (not reset by
    each byte, as a read timeout would be)."""
    with LiveServer(FakeEngine(), server_options=DEADLINES) as live, connect(live) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(40):  # 4 s of a byte every 0.1 s
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        took = time.monotonic() - t0
        assert closed and HEADERS_S - 0.1 < took < HEADERS_S + 1.5, (closed, took)


def test_keep_alive_idleness_and_the_next_head_are_bounded_too(live):
    """After an answer: an idle connection is closed after KEEP_ALIVE_S; one that begins the next head and
    stalls is closed on the head deadline, counted from the end of the previous answer."""
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        took = seconds_until_closed(sock)
        assert KEEP_ALIVE_S - 0.1 < took < KEEP_ALIVE_S + 1.5, took
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # cancels the keep-alive timer; the head never ends
        took = seconds_until_closed(sock)
        assert HEADERS_S - 0.2 < took < HEADERS_S + 1.5, took


def test_a_head_over_16_kb_is_refused_and_closed_and_pipelined_requests_are_answered(live):
    """The parser keeps no bound of its own on a request's head: past 16 KB of target and headers the
    connection gets a 400 and is closed. Two requests sent in one write are both answered, in order, and the
    second's head, already read, is not cut off by the deadline armed when the first's answer ends."""
    from specdec.server.limits import MAX_HEAD_BYTES

    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 400")
    with connect(live) as sock:  # just under the bound: answered
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (MAX_HEAD_BYTES - 100) + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n"
                     b"Connection: close\r\n\r\n")
        answers = read_until_closed(sock)
    assert answers.startswith(b"HTTP/1.1 200") and answers.count(b"HTTP/1.1 200") == 2, answers[:300]
    assert b'"object":"list"' in answers


def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_closed(live):
    with connect(live) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"messages\": ")
        t0 = time.monotonic()
        answer = read_until_closed(sock)  # the server closes after its answer
        took = time.monotonic() - t0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error", error
    assert BODY_S - 0.1 < took < BODY_S + 1.5, took
    with httpx.Client(base_url=live.url, timeout=10) as c:  # and the server is fine
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_the_concurrency_limit_counts_requests_in_flight_and_spares_health():
    engine = FakeEngine(tokens_per_step=1, step_delay=0.05, max_batch_size=4)
    with LiveServer(engine, limit_concurrency=2, server_options=DEADLINES) as live, \
            httpx.Client(base_url=live.url, timeout=10) as c:
        idle = [connect(live) for _ in range(5)]  # open sockets: no slot taken
        try:
            assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        finally:
            for sock in idle:
                sock.close()
        with contextlib.ExitStack() as streams:
            reading = []  # the streams' line iterators, kept: httpx closes a response whose iterator is dropped
            for _ in range(2):  # two streams in flight: the limit
                r = streams.enter_context(c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)))
                assert r.status_code == 200
                reading.append(r.iter_lines())
                next(reading[-1])
            refused = c.post("/v1/chat/completions", json=chat_body())
            error = assert_error(refused, 503)
            assert error["code"] == "server_overloaded" and refused.headers["retry-after"] == "1", error
            assert_error(c.get("/v1/models"), 503)
            assert c.get("/health").status_code == 200  # exempt
        deadline = time.monotonic() + 10  # the dropped streams' slots come back as their answers end
        while (r := c.post("/v1/chat/completions", json=chat_body())).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected_chat_reply()


def test_the_deadline_flags():
    from specdec.server.cli import add_serve_arguments

    parser = add_serve_arguments(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    assert (defaults.timeout_headers, defaults.timeout_body, defaults.timeout_keep_alive) == (10, 60, 5)
    args = parser.parse_args(["--timeout-headers", "2", "--timeout-body", "3.5", "--timeout-keep-alive", "4"])
    assert (args.timeout_headers, args.timeout_body, args.timeout_keep_alive) == (2, 3.5, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--timeout-headers", "-1"])
