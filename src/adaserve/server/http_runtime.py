"""The HTTP runtime under the app: uvicorn with its protocol hardened and a graceful drain.

``make_server(app, cfg)`` serves an app made by ``create_app`` (or the Ray front door)
with ``http_protocol(cfg)``: the parser chosen on purpose (``[server] http``), request
line and header size limits enforced before the parser sees the bytes, header and body
timeouts, the connection caps, and JSON errors for what the parser cannot take.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import threading
import time

from adaserve.server.config import ServerConfig

log = logging.getLogger("adaserve.server")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with a graceful drain: new requests get 503 as soon as a signal
        arrives; in-flight ones finish within the grace period or are cancelled."""

        def __init__(self, config, state):
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig, frame) -> None:
            self.state.draining = True  # plain flag: safe inside a signal handler
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            st = self.state
            st.begin_drain()
            # the listener stays open while requests are in flight, so that new ones
            # (new connections too) get the 503 of the drain, not a refused connection
            deadline = time.monotonic() + st.cfg.shutdown_grace_s + 1.0
            idle = 0
            while idle < 2 and not self.force_exit and time.monotonic() < deadline:
                idle = idle + 1 if st.loop.in_flight == 0 else 0
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # like uvicorn's, but does not re-raise the signal after a clean shutdown
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def _raw_response(protocol, err) -> None:
    """Write ``err`` (an ``ApiError``) as a JSON response straight to the transport,
    bypassing the parser's state (so only when no response is under way), and close."""
    from adaserve.server.render import dumps

    body = dumps(err.body()).encode("ascii")
    phrase = http.HTTPStatus(err.status).phrase.encode("ascii")
    head = [b"HTTP/1.1 %d %s\r\n" % (err.status, phrase)]
    head += [n + b": " + v + b"\r\n" for n, v in protocol.server_state.default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    protocol.transport.write(b"".join(head) + body)
    protocol.transport.close()


def _over_capacity_app(limit: int):
    """The ASGI app a connection beyond ``max_connections`` is answered by, when every
    open connection has a request in flight (none can be closed for it): 503 JSON,
    then the connection is closed."""
    from adaserve.server.errors import ApiError, retry_after
    from adaserve.server.render import error_response

    err = ApiError(
        503,
        f"too many open connections (more than {limit}); retry later",
        type="server_error",
        code="server_overloaded",
        reason="max_connections",
        headers={**retry_after(1), "Connection": "close"},
    )

    async def app(scope, receive, send) -> None:
        if scope["type"] == "http":
            await error_response(err)(scope, receive, send)

    return app


# the scope key under which a request reaches its connection's ``ConnectionMark``
CONNECTION_KEY = "adaserve.connection"


class ConnectionMark:
    """What the app tells the HTTP layer about a connection: ``trusted`` once one of
    its requests presented a valid API key. Trusted connections are closed last when
    the connection caps need room."""

    __slots__ = ("trusted",)

    def __init__(self) -> None:
        self.trusted = False


def mark_trusted(scope) -> None:
    """Called by the app when a request's key is valid (see ``ConnectionMark``)."""
    mark = scope.get(CONNECTION_KEY)
    if mark is not None:
        mark.trusted = True


def parser_base(name: str):
    """uvicorn's protocol class for ``[server] http``: ``h11`` (the default: pure
    Python, always installed, strict), ``httptools`` (faster, needs the package) or
    ``auto`` (httptools when installed, as uvicorn picks)."""
    from adaserve.server.config import ConfigError

    if name in ("httptools", "auto"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            if name == "httptools":
                raise ConfigError(
                    "server.http = 'httptools' needs the httptools package (pip install "
                    "httptools), or use 'h11'"
                ) from None
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


# a connection opened beyond a cap (its address's idle connections, the server's) must
# send its request line and headers within this (a real client sends them at once;
# silent sockets are closed this soon, without closing anyone else's, so an attacker
# that reopens what is closed cannot start a chain of closes); past CEILING x
# max_connections an idle connection on probation is closed for a new one, else 503
PROBATION_S = 2.0
CEILING = 2

# a connection closed while its client may still be sending keeps reading (and dropping)
# what comes for this long, or this many bytes, before it closes
LINGER_S = 2.0
LINGER_BYTES = 16 << 20


class _LingeringTransport:
    """The transport as the protocol sees it, with a lingering close: ``close`` while
    the client may still be sending (a body not read yet, a head not finished) sends the
    response and a FIN, then reads and drops what still comes for up to ``LINGER_S`` or
    ``LINGER_BYTES`` before closing. A socket closed with unread data sends a reset,
    which can cost the client the answer it was sent (a 413 for a big upload)."""

    def __init__(self, transport, protocol):
        self._t = transport
        self._protocol = protocol
        self.lingering = False
        self._drained = 0
        self._timer = None

    def __getattr__(self, name):
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self.lingering or self._t.is_closing()

    def close(self) -> None:
        if self.lingering or self._t.is_closing():
            return
        if not self._protocol.may_be_sending() or not self._t.can_write_eof():
            self._t.close()
            return
        self.lingering = True
        self._t.write_eof()
        self._t.resume_reading()
        self._timer = self._protocol.loop.call_later(LINGER_S, self._t.close)

    def close_now(self) -> None:
        self.cancel()
        self._t.close()

    def drop(self, n: int) -> None:
        """``n`` bytes came while lingering: dropped (closed past ``LINGER_BYTES``)."""
        self._drained += n
        if self._drained > LINGER_BYTES:
            self.close_now()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Connections:
    """The open connections of one server by client address, and which to close when
    the ceiling needs room: a connection with no request in flight (opening, sending
    its headers, or idle between requests), untrusted before trusted, oldest first."""

    def __init__(self) -> None:
        self.by_client: dict[str, set] = {}

    def add(self, conn) -> None:
        self.by_client.setdefault(conn.peer, set()).add(conn)

    def discard(self, conn) -> None:
        conns = self.by_client.get(conn.peer)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self.by_client[conn.peer]

    def idle(self, peer: str) -> list:
        return [c for c in self.by_client.get(peer, ()) if c.idle()]

    @staticmethod
    def victim(conns):
        """The connection to close among ``conns`` (None: every one is busy)."""
        idle = [c for c in conns if c.idle()]
        return min(idle, key=lambda c: (c.mark.trusted, c.opened_at), default=None)


def http_protocol(cfg: ServerConfig | None = None):
    """uvicorn's HTTP protocol (the parser of ``[server] http``) with:

    - request line and header limits whatever the parser: the bytes of a request's line
      and headers are counted before the parser sees them, and a line longer than
      ``max_request_line_bytes`` gets 414, headers longer than ``max_header_bytes`` 431
      (JSON, then the connection is closed) as soon as the limit is passed;
    - JSON 400s for the requests the parser cannot take (bad header bytes, a malformed
      request line or header), rather than plain text;
    - a header timeout: a request's line and headers must arrive within
      ``header_timeout_s`` of the connection opening, or of the first byte of the next
      request on a kept-alive connection (408 JSON if some of it came, else just closed);
    - a body backstop: a request whose body is still incomplete ``body_timeout_s`` (+1 s)
      after its headers has its connection closed (the app's body reader answers 408
      first where it reads the body, see ``app._Guard``);
    - connection caps that silent sockets cannot hold: a connection opened beyond
      ``max_idle_connections_per_client`` idle connections of its address, or beyond
      ``max_connections``, is on probation: it must send its request within
      ``PROBATION_S`` (then it is served as any other). Past ``CEILING`` x
      ``max_connections`` an idle connection on probation (untrusted first: see
      ``ConnectionMark``) is closed for a new one; only when none is idle is a new one
      answered 503 JSON.

    uvicorn itself closes idle keep-alive connections (``timeout_keep_alive_s``).
    """
    from adaserve.server.errors import ApiError

    cfg = cfg or ServerConfig()
    base = parser_base(cfg.http)
    header_timeout = cfg.header_timeout_s
    body_timeout = cfg.body_timeout_s + 1.0
    cap = cfg.max_connections
    per_client = cfg.max_idle_connections_per_client
    line_limit = cfg.max_request_line_bytes
    header_limit = cfg.max_header_bytes
    over_capacity = _over_capacity_app(cap) if cap is not None else None
    probation_s = min(header_timeout, PROBATION_S)
    book = _Connections()

    class Protocol(base):  # type: ignore[valid-type,misc]  # uvicorn's protocol class, chosen at run time
        _header_timer = None
        _body_timer = None
        _header_bytes = 0
        probation = False
        # the request head being counted: its bytes so far, whether its line ended,
        # the line's length, and the last bytes of the previous chunk (for a CRLFCRLF
        # split across two chunks)
        _head_bytes = 0
        _line_bytes: int | None = None
        _head_tail = b""

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            self.peer = self.client[0] if self.client else ""
            self.opened_at = self.loop.time()
            self.mark = ConnectionMark()
            app = self.app  # type: ignore[has-type]  # set by uvicorn's protocol

            async def marked(scope, receive, send, mark=self.mark):
                scope[CONNECTION_KEY] = mark
                await app(scope, receive, send)

            self.app = marked
            book.add(self)
            self._admit()
            self._arm_header_timer(probation_s if self.probation else header_timeout)

        def _admit(self) -> None:
            """Probation for a connection beyond a cap; past the hard ceiling, room is
            made by closing an idle one on probation (untrusted first), else 503."""
            over_client = per_client is not None and len(book.idle(self.peer)) > per_client
            self.probation = over_client or (cap is not None and len(self.connections) > cap)
            if cap is None or len(self.connections) <= CEILING * cap:
                return
            victim = book.victim(
                c
                for conns in book.by_client.values()
                for c in conns
                if c is not self and c.probation
            )
            if victim is not None:
                log.warning("more than %d open connections: closed an idle one", CEILING * cap)
                victim.transport.close_now()
                self.connections.discard(victim)
                return
            log.warning("connection refused (503): more than %d open connections", CEILING * cap)
            assert over_capacity is not None  # built with the cap
            self.app = over_capacity

        def idle(self) -> bool:
            """No request in flight: opening, sending its headers, or between requests."""
            return not self.transport.is_closing() and self._between_requests()

        def may_be_sending(self) -> bool:
            """The client may still be sending: a body not all read, or part of a head."""
            cycle = self.cycle
            return (cycle is not None and cycle.more_body) or self._head_bytes > 0

        def eof_received(self):
            if self.transport.lingering:
                self.transport.close_now()
                return None
            return super().eof_received()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                self.transport.drop(len(data))
                return
            cycle = self.cycle
            if self._header_timer is None and self._between_requests():
                self._arm_header_timer()  # the first byte of the next request
            self._header_bytes += len(data)
            if cycle is None or not cycle.more_body:  # not inside a body: a head
                err = self._count_head(data)
                if err is not None:
                    self._refuse(err)
                    return
            super().data_received(data)
            if self.cycle is not cycle:  # a new request's headers are complete
                self.probation = False
                self._cancel(header=True)
                self._arm_body_timer()

        def _count_head(self, data: bytes):
            """The 414 / 431 for a request line or headers over their limits, counted
            up to the blank line that ends them (None: within the limits so far)."""
            tail = self._head_tail
            buf = tail + data
            ends = [i + len(m) for m in (b"\r\n\r\n", b"\n\n") if (i := buf.find(m)) >= 0]
            end = min(ends, default=-1)
            n = (end if end >= 0 else len(buf)) - len(tail)
            if self._line_bytes is None:
                j = buf.find(b"\n")
                line = self._head_bytes + n
                if j >= 0:
                    line = self._line_bytes = self._head_bytes + j + 1 - len(tail)
                if line > line_limit:
                    return ApiError(
                        414,
                        f"request line longer than {line_limit} bytes",
                        code="request_line_too_long",
                    )
            self._head_bytes += n
            if self._head_bytes - (self._line_bytes or 0) > header_limit:
                return ApiError(
                    431,
                    f"request headers larger than {header_limit} bytes",
                    code="headers_too_large",
                )
            if end >= 0:  # this head is complete: the next one starts from nothing
                self._head_bytes, self._line_bytes, self._head_tail = 0, None, b""
            else:
                self._head_tail = buf[-3:]
            return None

        def _refuse(self, err) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.response_started and not cycle.response_complete:
                self.transport.close()  # a response is under way: nothing can be added
                return
            log.warning("request refused (%d): %s", err.status, err.message)
            _raw_response(self, err)

        def connection_lost(self, exc) -> None:
            self._cancel(header=True, body=True)
            self.transport.cancel()
            book.discard(self)
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _cancel(self, header: bool = False, body: bool = False) -> None:
            if header and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if body and self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _arm_header_timer(self, timeout: float | None = None) -> None:
            self._cancel(header=True)
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(
                timeout or header_timeout, self._on_header_timeout, self.cycle
            )

        def _arm_body_timer(self) -> None:
            self._cancel(body=True)
            self._body_timer = self.loop.call_later(body_timeout, self._on_body_timeout, self.cycle)

        def _on_header_timeout(self, cycle) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not cycle:
                return
            if self._header_bytes and self._between_requests():
                err = ApiError(
                    408,
                    f"request headers not received within {header_timeout:g} s",
                    code="request_timeout",
                )
                _raw_response(self, err)
            else:
                self.transport.close()

        def _on_body_timeout(self, cycle) -> None:
            self._body_timer = None
            if self.cycle is cycle and cycle.more_body and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            err = ApiError(400, msg or "Invalid HTTP request received.", code="invalid_http")
            self._refuse(err)

    return Protocol


def make_server(app, cfg: ServerConfig, log_level: str = "info", sockets=None):
    """A uvicorn server (with graceful drain, and JSON errors for requests uvicorn
    cannot parse) for an app made by ``create_app``."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        timeout_graceful_shutdown=cfg.shutdown_grace_s + 5.0,  # type: ignore[arg-type]  # uvicorn takes seconds as float
        timeout_keep_alive=cfg.timeout_keep_alive_s,  # type: ignore[arg-type]  # uvicorn takes seconds as float
        lifespan="on",
        http=http_protocol(cfg),
        # h11's own buffer limit above ours, so that ours answers first (414 / 431)
        h11_max_incomplete_event_size=cfg.max_request_line_bytes + cfg.max_header_bytes + 4096,
    )
    return _server_class()(config, app.state.adaserve)
