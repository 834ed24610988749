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
        cap = asyncio.run(probe_capacity(url, None, "interactive", 4, 8, 1.5, {"tpot_ms": 10.0}))
    finally:
        srv.shutdown()
        srv.server_close()
    assert cap.finished_rps == 0.0 and cap.within_slo_rps == 0.0
    # each of the 4 streams: its first request, and one more after the 1 s Retry-After
    # (the old probe came straight back: hundreds of requests in 1.5 s)
    assert 4 < len(_Refusing.seen) <= 8
    assert _Refusing.seen[:4] == [None] * 4
    assert all(t is not None and t.startswith("seat-") for t in _Refusing.seen[4:])


def test_a_finished_stream_is_judged_by_both_targets():
    from adaserve.bench.overload import Outcome, _met

    # sent at 0, first token at 0.2 s, 11 tokens by 0.4 s: TTFT 200 ms, TPOT 20 ms
    o = Outcome(cls="interactive", sent=0.0, status=200, first=0.2, last=0.4, tokens=11)
    assert _met(o, {"ttft_ms": 250, "tpot_ms": 25}) == (True, True)
    assert _met(o, {"ttft_ms": 150, "tpot_ms": 25}) == (False, True)
    assert _met(o, {"ttft_ms": 250, "tpot_ms": 15}) == (True, False)
    assert _met(o, {}) == (True, True)
