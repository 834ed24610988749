"""Slow and idle clients, over raw sockets on loopback: header, body and keep-alive
timeouts, and the connection cap (``ServerConfig.header_timeout_s``, ``body_timeout_s``,
``timeout_keep_alive_s``, ``max_connections``)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import ServerConfig, parse_config
from adaserve.server.config import ConfigError, tomllib

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)

TIMEOUT = 0.5  # every timeout of the test server
CAP = 4  # its connection cap
SLACK = 1.5  # how much later than the timeout a close may come on a busy 2-core box


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    s = LiveServer(
        engine_config(target),
        ServerConfig(
            model_name="m",
            header_timeout_s=TIMEOUT,
            body_timeout_s=TIMEOUT,
            timeout_keep_alive_s=TIMEOUT,
            max_connections=CAP,
        ),
    )
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _no_leftover_connections(srv):
    """Each test starts with no connection open on the server (the cap counts them)."""
    assert wait_for(lambda: not srv.server.server_state.connections, timeout=5.0)


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, limit: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed
    (seconds from the call). Fails if it is still open after ``limit`` seconds."""
    t0 = time.monotonic()
    s.settimeout(limit)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            pytest.fail(f"connection still open after {limit} s (got {data!r})")
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def _trickle(s, piece: bytes, t0: float, limit_s: float) -> tuple[bytes, float]:
    """Send ``piece`` every 0.15 s until the server closes the connection (or
    ``limit_s`` after ``t0``): (what it sent back, seconds from ``t0`` to the close)."""
    s.settimeout(0.15)
    data = b""
    while time.monotonic() - t0 < limit_s:
        try:
            s.sendall(piece)
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def test_idle_connection_that_sends_nothing_is_closed(srv):
    socks = [_connect(srv) for _ in range(3)]
    try:
        for s in socks:
            data, waited = _read_until_closed(s)
            assert data == b""  # nothing came: nothing to answer
        assert waited < TIMEOUT + SLACK
    finally:
        for s in socks:
            s.close()


def test_headers_trickled_slower_than_the_timeout_get_408(srv):
    with _connect(srv) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # a header line every 0.15 s
        data, closed_after = _trickle(s, b"X-Slow: 1\r\n", t0, TIMEOUT + SLACK + 1.0)
    assert closed_after < TIMEOUT + SLACK
    status, headers, body = _parse(data)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_body_shorter_than_its_content_length_gets_408(srv):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    with _connect(srv) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) + 50) + body
        )
        data, waited = _read_until_closed(s)
    assert waited < TIMEOUT + SLACK
    status, headers, raw = _parse(data)
    assert status == 408 and headers["connection"] == "close"
    err = json.loads(raw)["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"


def test_unread_body_trickled_after_the_response_is_cut_off(srv):
    # /health never reads the body; the trickle would otherwise keep the connection open
    with _connect(srv) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        data, closed_after = _trickle(s, b"x", t0, 2 * TIMEOUT + 1.0 + SLACK + 1.0)
    assert closed_after < TIMEOUT + 1.0 + SLACK
    assert _parse(data)[0] == 200


def test_a_complete_body_in_time_is_answered(srv):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    with _connect(srv) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        data, _ = _read_until_closed(s)
    status, _, raw = _parse(data)
    assert status == 200 and json.loads(raw)["object"] == "text_completion"


def test_idle_keep_alive_connection_is_closed(srv):
    with _connect(srv) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, waited = _read_until_closed(s)  # answered, then closed once idle
    assert _parse(data)[0] == 200
    assert waited < TIMEOUT + SLACK


def _busy(srv) -> socket.socket:
    """A connection with a request in flight: a POST's headers, its body not sent."""
    s = _connect(srv)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    return s


def test_connections_past_the_ceiling_get_503_when_all_are_busy(srv):
    """Past 2 x the cap, with every connection busy, a new one is answered 503."""
    held = [_busy(srv) for _ in range(2 * CAP)]
    try:
        assert wait_for(lambda: len(srv.server.server_state.connections) == 2 * CAP, timeout=2)
        with _connect(srv) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, _ = _read_until_closed(s)
        status, headers, body = _parse(data)
        assert status == 503 and headers["connection"] == "close"
        assert int(headers["retry-after"]) >= 1
        err = json.loads(body)["error"]
        assert err["code"] == "server_overloaded" and err["reason"] == "max_connections"
    finally:
        for s in held:
            s.close()
    # once they are gone, new connections are served again
    assert wait_for(lambda: not srv.server.server_state.connections, timeout=5.0)
    with _connect(srv) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = _read_until_closed(s)
    assert _parse(data)[0] == 200


def test_a_connection_beyond_the_cap_is_served_on_probation(srv):
    """Beyond the cap a new connection is served if it sends its request; silent ones
    beyond it are closed after the probation, and nobody else's connection is."""
    held = [_connect(srv) for _ in range(CAP)]
    t0 = time.monotonic()
    try:
        assert wait_for(lambda: len(srv.server.server_state.connections) == CAP, timeout=2)
        with _connect(srv) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data, _ = _read_until_closed(s)
        assert _parse(data)[0] == 200
        if time.monotonic() - t0 < TIMEOUT * 0.8:  # (a slow machine cannot tell)
            for s in held:  # none was closed for it
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize(
    "line",
    [
        "header_timeout_s = 0",
        "body_timeout_s = -1",
        "timeout_keep_alive_s = true",
        "header_timeout_s = inf",
        "max_connections = 0",
        "max_connections = 1.5",
    ],
)
def test_bad_timeouts_and_caps_name_the_key(line):
    with pytest.raises(ConfigError, match=line.split()[0]):
        parse_config(tomllib.loads(f"[server]\n{line}\n"))
