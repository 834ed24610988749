"""One HTTP request's engine requests (a ``Job``), what its response needs to know
(``Meta``, ``Endpoint``), and reading the job's events while watching the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel

from adaserve.server.config import Tenant
from adaserve.server.engine_loop import DISCONNECTED, Handle
from adaserve.server.state import ServerState

if TYPE_CHECKING:
    from adaserve.server.accounting import RowAcc


@dataclass(frozen=True)
class Endpoint:
    """What differs between completions and chat completions in a response.

    logprobs(tok, ids, entries):              the logprobs object (None: not requested)
    choice(index, text, logprobs, finish_reason, metrics): a choice of a whole response
    stream_choice(index, text, finish_reason, logprobs):   a streamed choice (text None:
                                                           no new text)
    opening(index, echo):                     the streamed choice sent before any token,
                                              or None
    tool_stream_choice(index, events, finish_reason, logprobs): a streamed choice of
                                              ``ToolStream`` events (chat), or None
    """

    id_prefix: str
    response: type[BaseModel]
    chunk: type[BaseModel]
    logprobs: Callable[..., Any]
    choice: Callable[..., BaseModel]
    stream_choice: Callable[..., BaseModel]
    opening: Callable[[int, str | None], BaseModel | None]
    tool_stream_choice: Callable[..., BaseModel | None] | None = None


@dataclass(frozen=True)
class Meta:
    id: str
    created: int
    model: str
    endpoint: Endpoint
    prompt_tokens: int
    service_tier: str
    echo: list[str] | None
    stop_holdback: int
    skip_special_tokens: bool = True
    n: int = 1  # the request's n (choices per prompt)
    score_only: bool = False  # max_tokens=0 with echo: the generated token is dropped
    tools: Any = None  # the chat's ``structured.tools.ToolMode`` (None: text output)

    def echo_of(self, index: int, choices: int) -> str | None:
        """The echoed prompt of a choice (choices are prompt-major, n per prompt)."""
        if self.echo is None:
            return None
        return self.echo[index // (choices // len(self.echo))]


class Job:
    """The engine requests of one HTTP request, and their clean-up."""

    def __init__(self, state: ServerState, tenant: Tenant):
        self.state = state
        self.tenant = tenant
        self.sink: asyncio.Queue = asyncio.Queue()
        self.handles: list[Handle] = []
        self._closed = False
        self.acc: RowAcc | None = None  # its ledger row

    async def row_committed(self) -> None:
        """Wait for the request's ledger row (every choice has finished)."""
        if self.acc is not None and self.acc.future is not None:
            t0 = time.perf_counter()
            await self.acc.wait(self.state.cfg.usage.commit_timeout_s)
            self.state.metrics.ledger_wait.labels(self.state.model_name).observe(
                time.perf_counter() - t0
            )

    def close(self, reason: str = DISCONNECTED) -> None:
        """Abort unfinished requests (idempotent; the tenant's concurrency slot is the
        HTTP request's, given back by ``app._Guard`` when the response ends)."""
        if self._closed:
            return
        self._closed = True
        for h in self.handles:
            self.state.loop.abort(h, reason)


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def next_or_disconnect(sink: asyncio.Queue, disc: asyncio.Future):
    """The next sink event, or None when the client disconnected first."""
    if not sink.empty():
        return sink.get_nowait()
    get = asyncio.ensure_future(sink.get())
    try:
        done, _ = await asyncio.wait({get, disc}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        get.cancel()
        raise
    if get in done:
        return get.result()
    get.cancel()
    return None
