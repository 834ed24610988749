"""An HTTP request as plain data, run through an ASGI app, its response as messages.

The front door sends ``request_data(scope, body)`` across the process boundary; the
replica runs it with ``call_app`` and streams back ``("start", status, headers)`` and
``("body", bytes, more_body)`` (those the app sent at once as one ``("many", [...])``:
a whole JSON response is one item). When the consumer stops (the stream is cancelled: the
client left), the app's ``receive`` answers ``http.disconnect``, as uvicorn would.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


def request_data(scope: dict, body: bytes) -> dict:
    """What of an HTTP scope a replica needs to rebuild it."""
    return {
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": scope.get("raw_path") or scope["path"].encode(),
        "query_string": scope.get("query_string", b""),
        "headers": [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])],
        "http_version": scope.get("http_version", "1.1"),
        "scheme": scope.get("scheme", "http"),
        "client": tuple(scope["client"]) if scope.get("client") else None,
        "server": tuple(scope["server"]) if scope.get("server") else None,
        "body": body,
    }


async def call_app(app, req: dict, extra_headers: dict[str, str] | None = None, context=None):
    """Run ``req`` through ``app``; yield its response messages (see module doc).
    ``context``: the ``contextvars.Context`` the app runs in (default: a copy of the
    caller's)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": req["http_version"],
        "method": req["method"],
        "scheme": req["scheme"],
        "path": req["path"],
        "raw_path": req["raw_path"],
        "root_path": "",
        "query_string": req["query_string"],
        "headers": [tuple(h) for h in req["headers"]],
        "client": req["client"],
        "server": req["server"],
        "state": {},
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False
    extra = [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if gone.is_set():
            raise OSError("client disconnected")
        out.put_nowait(msg)

    task = asyncio.get_running_loop().create_task(app(scope, receive, send), context=context)
    task.add_done_callback(lambda _t: out.put_nowait(None))
    try:
        done = False
        while not done:
            msgs = [await out.get()]
            while not out.empty():  # what the app sent meanwhile goes in one item
                msgs.append(out.get_nowait())
            items: list[tuple[str, Any, Any]] = []
            for msg in msgs:
                if msg is None:
                    done = True
                    break
                kind = msg["type"]
                if kind == "http.response.start":
                    headers = [tuple(h) for h in msg.get("headers", [])] + extra
                    items.append(("start", msg["status"], headers))
                elif kind == "http.response.body":
                    more = bool(msg.get("more_body", False))
                    items.append(("body", bytes(msg.get("body", b"")), more))
                    if not more:
                        done = True
                        break
            if len(items) == 1:
                yield items[0]
            elif items:
                yield ("many", items)
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
        if not task.done():
            task.cancel()
