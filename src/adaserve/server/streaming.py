"""Server-sent events: a streamed response starts after the first engine event (so an
early failure is still a real HTTP error), then sends one chunk per choice and step,
``data: {"error": ...}`` if the server shuts down mid-stream, and ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from adaserve.server.engine_errors import final_error, finish_reason
from adaserve.server.engine_loop import SHUTDOWN
from adaserve.server.jobs import Job, Meta, next_or_disconnect, wait_disconnect
from adaserve.server.protocol import RequestMetrics, Usage
from adaserve.server.render import dumps
from adaserve.server.state import ServerState
from adaserve.structured.tools import ToolStream

log = logging.getLogger("adaserve.server")


def sse(body) -> str:
    """One event of a dict or a protocol model."""
    return f"data: {dumps(body)}\n\n"


async def stream(state: ServerState, request: Request, job: Job, meta: Meta, include_usage: bool):
    """Wait for the first event (so early failures are real HTTP errors), then SSE."""
    disc = asyncio.ensure_future(wait_disconnect(request))
    try:
        first = await next_or_disconnect(job.sink, disc)
    finally:
        disc.cancel()
    if first is None:
        return Response(status_code=499)
    final = first[2]
    if final is not None:
        ctx = job.handles[0].ctx
        err = final_error(state, final, ctx.cls, ctx.tenant)
        if err is not None:
            raise err
    gen = _events(state, job, meta, first, include_usage)
    return SSE(gen, on_close=job.close)


async def _events(state: ServerState, job: Job, meta: Meta, first, include_usage: bool):
    tok = state.loop.ready_info.tokenizer
    ep = meta.endpoint
    k = len(job.handles)
    detok = [Detok(tok, meta.stop_holdback, meta.skip_special_tokens) for _ in range(k)]
    tools = [ToolStream(meta.tools) for _ in range(k)] if meta.tools is not None else None

    def chunk(choices, **kw) -> str:
        return sse(
            ep.chunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, **kw)
        )

    for i in range(k):
        opening = ep.opening(i, meta.echo_of(i, k))
        if opening is not None:
            yield chunk([opening])
    left = k
    completion_tokens = 0
    cached = 0  # prompt tokens served from the prefix cache (each prompt's first choice)
    most = 0  # the most tokens one choice generated
    ev = first
    while True:
        idx, new, final, lps, plps = ev
        lp_ids, lp_entries = new, lps
        if plps is not None and lps is not None:  # echo: the prompt's logprobs first
            lp_ids, lp_entries = [*job.handles[idx].prompt_ids, *new], (*plps, *lps)
        lp = ep.logprobs(tok, lp_ids, lp_entries) if lp_entries else None
        if final is None:
            delta = detok[idx].push(new)
            if tools is not None:
                assert ep.tool_stream_choice is not None  # tools: a chat request
                c = ep.tool_stream_choice(idx, tools[idx].push(delta), None, lp)
                if c is not None:
                    yield chunk([c])
            elif delta or lp:
                yield chunk([ep.stream_choice(idx, delta, None, lp)])
        else:
            left -= 1
            completion_tokens += final.completion_tokens
            cached += final.cached_tokens if idx % meta.n == 0 else 0
            most = max(most, final.completion_tokens)
            ctx = job.handles[idx].ctx
            err = final_error(state, final, ctx.cls, ctx.tenant)
            if err is not None:
                job.close(SHUTDOWN)
                yield sse(err.body())
                break
            delta = detok[idx].finish(final.text)
            if tools is not None:
                assert ep.tool_stream_choice is not None  # tools: a chat request
                ts = tools[idx]
                events = ts.finish(final.text or "")
                fr = "tool_calls" if ts.calls_sent else finish_reason(final)
                c = ep.tool_stream_choice(idx, events, fr, lp)
            else:
                c = ep.stream_choice(idx, delta or None, finish_reason(final), lp)
            yield chunk([c], metrics=RequestMetrics.of(final.metrics))
            if left == 0:
                break
        ev = await job.sink.get()
    if left == 0:
        state.metrics.observe_request(meta.n, most)
        # the ledger's row is committed before the response's last bytes
        await job.row_committed()
    if include_usage and left == 0:
        yield chunk([], usage=Usage.of(meta.prompt_tokens, completion_tokens, cached))
    yield "data: [DONE]\n\n"


class Detok:
    """Incremental detokenisation (the HF/vLLM scheme): each step decodes only the tokens
    since the last clean boundary (with the previous chunk as left context), so a stream
    costs O(length), not O(length^2). Text that ends in a partial UTF-8 character waits
    for the next token; the last (longest stop string - 1) characters are held back until
    the request finishes, because the engine cuts the output where a stop string starts.
    The final chunk completes the engine's own (full) decode of the output."""

    def __init__(self, tok, holdback: int, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.holdback = max(0, holdback)
        self.ids: list[int] = []
        self.prefix = 0  # start of the left-context tokens
        self.read = 0  # tokens up to here are in self.text
        self.prefix_text = ""
        self.text = ""
        self.emitted = 0

    def push(self, new: list[int]) -> str:
        if self.tok is None or not new:
            return ""
        self.ids.extend(new)
        new_text = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(new_text) > len(self.prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(self.prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        end = len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def finish(self, final_text: str | None) -> str:
        if final_text is None or len(final_text) <= self.emitted:
            return ""
        if not final_text.startswith(self.text[: self.emitted]):
            log.debug("incremental detokenisation diverged from the full decode")
        out = final_text[self.emitted :]
        self.emitted = len(final_text)
        return out


class SSE(StreamingResponse):
    """Server-sent events that always watch for the client going away: on disconnect
    the body task is cancelled and ``on_close`` aborts the requests at once."""

    def __init__(self, gen, on_close):
        super().__init__(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def body() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator
