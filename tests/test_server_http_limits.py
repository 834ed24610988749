"""Issue 32, findings 1 and 3, over real sockets, with each HTTP parser: the request line
and header limits hold whatever parser is installed (an endless header, an endless URL
or a 2 MB header is answered 431 / 414 as soon as the limit is passed), and silent
sockets cannot take the connections that requests with a valid key need."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env, wait_for

from adaserve.server import parse_config
from adaserve.server.config import ConfigError, tomllib
from adaserve.server.http_runtime import PROBATION_S

HEADER_LIMIT = 4096
LINE_LIMIT = 1024
PER_CLIENT = 6  # idle connections one address may hold
CAP = 12

CONFIG = f"""
[server]
model_name = "m"
max_header_bytes = {HEADER_LIMIT}
max_request_line_bytes = {LINE_LIMIT}
max_idle_connections_per_client = {PER_CLIENT}
max_connections = {CAP}
header_timeout_s = 20

[tenants.user]
keys = ["sk-user-secret"]
"""

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module", params=["h11", "httptools"])
def srv(request, tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    text = CONFIG.replace("[server]\n", f'[server]\nhttp = "{request.param}"\n')
    s = LiveServer(engine_config(target), parse_config(tomllib.loads(text)))
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _no_leftover_connections(srv):
    assert wait_for(lambda: not srv.server.server_state.connections, timeout=10.0)


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _stream_until_answered(s: socket.socket, head: bytes, piece: bytes, most: int):
    """Send ``head`` then ``piece`` after ``piece`` until the server answers or closes:
    (what it answered, bytes sent). Fails when ``most`` bytes went unanswered."""
    s.sendall(head)
    sent = len(head)
    s.settimeout(0.05)
    data = b""
    while sent < most:
        try:
            s.sendall(piece)
            sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        if b"\r\n\r\n" in data:
            break
    s.settimeout(5)
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    assert data, f"no answer after {sent} bytes"
    return data, sent


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_endless_header_is_answered_431_at_the_limit(srv):
    with _connect(srv) as s:
        data, sent = _stream_until_answered(
            s, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ", b"a" * 512, 1 << 20
        )
    status, headers, body = _parse(data)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert sent < HEADER_LIMIT + 64 * 1024  # read no further than the limit (and a chunk)


def test_endless_header_lines_are_answered_431(srv):
    """Many small headers add up to the same limit."""
    with _connect(srv) as s:
        data, _ = _stream_until_answered(
            s, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n" * 32, 1 << 20
        )
    assert _parse(data)[0] == 431


def test_endless_url_is_answered_414(srv):
    with _connect(srv) as s:
        data, sent = _stream_until_answered(s, b"GET /health?q=", b"a" * 256, 1 << 20)
    status, _, body = _parse(data)
    assert status == 414 and json.loads(body)["error"]["code"] == "request_line_too_long"
    assert sent < LINE_LIMIT + 64 * 1024


def test_big_header_in_one_piece_is_answered_431(srv):
    with _connect(srv) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2_000_000 + b"\r\n\r\n")
        s.settimeout(10)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert _parse(data)[0] == 431


def test_a_head_within_the_limits_is_served_with_its_body_in_one_piece(srv):
    """A small head and a body larger than the header limit, in one write: the body is
    not taken for headers."""
    body = json.dumps({"model": "m", "prompt": "x" * (4 * HEADER_LIMIT), "max_tokens": 1})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer sk-user-secret\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    with _connect(srv) as s:
        s.sendall(head.encode() + body.encode())
        s.settimeout(30)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert _parse(data)[0] in (200, 400), data[:300]  # 400: a prompt longer than the context


def test_pipelined_requests_are_both_answered(srv):
    with _connect(srv) as s:
        s.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 2


def test_silent_sockets_leave_room_for_requests_with_a_key(srv):
    """One address opening many silent sockets: those beyond PER_CLIENT are on probation
    and closed within PROBATION_S, and a client with a valid key is served while they
    are held, on a kept-alive connection and on new ones."""
    http = srv.http(headers={"Authorization": "Bearer sk-user-secret"})
    assert http.get("/v1/models").status_code == 200  # a trusted, kept-alive connection
    silent = []
    try:
        for _ in range(3 * CAP):
            silent.append(_connect(srv))
        c = srv.client("sk-user-secret")
        for _ in range(3):
            r = c.completions.create(model="m", prompt="hi", max_tokens=2)
            assert r.usage.completion_tokens >= 1
        assert http.get("/v1/models").status_code == 200
        time.sleep(PROBATION_S + 0.5)
        closed = 0
        for s in silent:
            s.settimeout(0.01)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                closed += s.recv(1) == b""
        assert closed >= len(silent) - PER_CLIENT
        assert len(srv.server.server_state.connections) <= PER_CLIENT + 2
    finally:
        for s in silent:
            s.close()
        http.close()


def test_an_upload_answered_early_is_drained_not_reset(srv):
    """A body refused at its headers (413) is answered, then the rest the client still
    sends is read and dropped for a while (a close with unread data would reset the
    connection, and the client could lose the answer), then the connection closes."""
    with _connect(srv) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer sk-user-secret\r\nContent-Length: 2000000000\r\n\r\n"
        )
        data = s.recv(65536)
        assert _parse(data)[0] == 413
        time.sleep(0.2)
        for _ in range(32):  # the server has answered and still reads
            s.sendall(b"x" * 65536)
            time.sleep(0.005)
        s.settimeout(10)
        t0 = time.monotonic()
        while s.recv(65536):  # then it closes (EOF after the answer, no reset)
            pass
        assert time.monotonic() - t0 < 8


@pytest.mark.parametrize(
    "line",
    [
        'http = "hyper"',
        "max_header_bytes = 10",
        "max_request_line_bytes = true",
        "max_idle_connections_per_client = 0",
    ],
)
def test_bad_http_settings_name_the_key(line):
    with pytest.raises(ConfigError, match=line.split()[0]):
        parse_config(tomllib.loads(f"[server]\n{line}\n"))
