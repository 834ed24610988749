"""The overload bench's capacity probe waits a refusal's Retry-After before its stream
comes back (a client that came straight back would flood the engine it measures)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from adaserve.bench.overload import probe_capacity
from adaserve.errors import RETRY_TOKEN


class _Refusing(BaseHTTPRequestHandler):
    """Answers every completion with 429, Retry-After and a retry token; counts them."""

    seen: list[str | None] = []

    def do_POST(self):  # noqa: N802 - the handler's API
        self.rfile.read(int(self.headers.get("content-length", 0)))
        _Refusing.seen.append(self.headers.get(RETRY_TOKEN))
        body = json.dumps({"error": {"message": "full", "reason": "capacity"}}).encode()
        self.send_response(429)
        self.send_header("Retry-After", "1")
        self.send_header(RETRY_TOKEN, f"seat-{len(_Refusing.seen)}")
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_refused_probe_stream_waits_its_retry_after_and_brings_its_seat():
    _Refusing.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        cap = asyncio.run(probe_capacity(url, None, "interactive", 4, 8, 1.5))
    finally:
        srv.shutdown()
        srv.server_close()
    assert cap == 0.0
    # each of the 4 streams: its first request, and one more after the 1 s Retry-After
    # (the old probe came straight back: hundreds of requests in 1.5 s)
    assert 4 < len(_Refusing.seen) <= 8
    assert _Refusing.seen[:4] == [None] * 4
    assert all(t is not None and t.startswith("seat-") for t in _Refusing.seen[4:])
