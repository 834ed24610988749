"""The messages across the engine thread (``server.engine_loop``), typed.

Commands in (``Command``), put on the engine thread's FIFO inbox by any thread: ``Add``
a request (its ``Handle``; the future resolves to its ``Request`` or the error),
``Abort`` one, ``Drain`` (refuse new requests; abort the rest at a deadline), ``Call``
a function on the engine between steps, ``Stop``.

Events out (``Event``), emitted on the engine thread to the loop's listeners:
``Finished`` (a request's ``Final``, before it is delivered), ``Rejected`` (an add that
never reached the engine: whatever was reserved for it can be given back),
``Stepped`` (the prompt + generated tokens a step processed), ``Traced`` (the step's
``StepTrace``).

The data the HTTP side reads: ``Handle`` (one request as it sees it), ``Final`` (what a
finished request hands back), ``EngineInfo`` and ``EngineSnapshot`` (immutable views).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adaserve.core.slo import SLO, SLOClass
from adaserve.errors import AdaServeError
from adaserve.sampling import SamplingParams

if TYPE_CHECKING:
    from adaserve.core.trace import StepTrace
    from adaserve.engine.engine import Engine
    from adaserve.spec_decode.request import Request

SHUTDOWN = "server_shutdown"
DISCONNECTED = "client_disconnected"
ENGINE_ERROR = "engine_error"


class ShuttingDown(AdaServeError):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about the loaded engine (safe to read from any thread)."""

    model_dir: str
    draft_dir: str | None
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # adaserve.text.tokenizer.Tokenizer | None (encode/decode are thread-safe)
    classes: tuple[SLOClass, ...]
    default_class: str
    policy: str
    flops_per_token_target: float
    device: str = ""
    dtype: str = ""
    kv_blocks: int = 0  # KV pool size in blocks of ``block_size`` tokens
    block_size: int = 0
    kv_bytes: int = 0  # bytes of the pool (target + draft)
    prefix_caching: bool = False  # automatic prefix caching is on
    # SamplingParams field -> the model's generation_config.json default (as vLLM's
    # --generation-config auto; empty with "vllm")
    sampling_defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and counters as of the last step (copied on the engine thread)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    counters: dict = field(default_factory=dict)
    # ``Engine.prefix_cache_stats``: queried and cached prompt tokens, by class
    prefix_cache: dict = field(default_factory=dict)
    time: float = 0.0
    drift: dict = field(default_factory=dict)  # ``DriftMonitor.as_dict``


@dataclass(frozen=True)
class Final:
    """What a finished request hands back."""

    reason: str
    text: str | None
    output_ids: list[int]
    prompt_tokens: int
    metrics: dict
    token_times: tuple[float, ...]
    arrival: float
    finished_at: float
    # per output token (logprob, ((id, logprob), ...)) when the request asked for them
    logprobs: tuple | None = None
    # the same per prompt token, the first None (params.prompt_logprobs)
    prompt_logprobs: tuple | None = None
    # the class the request was served in, and the one it entered the engine in when
    # the scheduler degraded it (``Request.degraded_from``); None: not known / not
    cls: str | None = None
    degraded_from: str | None = None
    # prompt tokens found in the prefix cache (``usage.prompt_tokens_details``)
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


class Handle:
    """One engine request as the HTTP side sees it.

    ``sink`` receives ``(index, new_ids, final, new_logprobs, prompt_logprobs)`` tuples
    (``final`` None until done; ``new_logprobs`` the entries of ``new_ids`` when the
    request asked for logprobs, else None; ``prompt_logprobs`` the prompt's, on the first
    tuple of a request that asked for them); with ``want_tokens`` False only the final
    tuple is sent. ``ctx`` is opaque data
    for the finish callback (tenant, class, price). ``drop_output``: the request only
    scores its prompt (``max_tokens=0``); the token the engine must generate is not
    part of its ``Final``, so it is neither delivered nor counted nor billed.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: SLO,
        *,
        sink: asyncio.Queue,
        index: int = 0,
        want_tokens: bool = True,
        ctx: Any = None,
        drop_output: bool = False,
        grammar: Any = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        retry_token: str | None = None,
    ):
        self.prompt_ids = prompt_ids
        self.tenant = tenant  # whose request (admission's fair share)
        self.retry_token = retry_token  # the seat admission held for it (Retry-Token)
        self.cache_salt = cache_salt  # its prefix-cache salt (the tenant's group and its own)
        self.grammar = grammar  # the GrammarState of params.structured_outputs, or None
        self.drop_output = drop_output
        self.params = params
        self.slo = slo
        self.sink = sink
        self.index = index
        self.want_tokens = want_tokens
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.arrival = time.perf_counter()
        self.req: Request | None = None  # set on the engine thread
        self.sent = 0  # output tokens handed over so far (engine thread)
        self.final: Final | None = None  # set on the event loop when delivered
        self.aborted = False

    @property
    def done(self) -> bool:
        return self.final is not None

    def _deliver(
        self, new_ids: list[int], final: Final | None, new_logprobs=None, prompt_logprobs=None
    ) -> None:
        if final is not None:
            self.final = final
        self.sink.put_nowait((self.index, new_ids, final, new_logprobs, prompt_logprobs))


# ---------------------------------------------------------------------- commands in
@dataclass(frozen=True)
class Add:
    """Queue ``handle``'s request; ``future`` resolves to its ``Request`` or the error."""

    handle: Handle
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Abort:
    """Cancel ``handle``'s request (no-op once finished)."""

    handle: Handle
    reason: str


@dataclass(frozen=True)
class Drain:
    """Refuse new requests; abort those still running at ``deadline`` (monotonic s)."""

    deadline: float


@dataclass(frozen=True)
class Call:
    """Run ``fn(engine)`` between steps; ``future`` resolves to its result."""

    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    """Abort whatever is in flight and end the thread."""


Command = Add | Abort | Drain | Call | Stop


# ---------------------------------------------------------------------- events out
@dataclass(frozen=True)
class Finished:
    """A request finished: its ``Final``, before it is delivered to its handler."""

    handle: Handle
    final: Final


@dataclass(frozen=True)
class Rejected:
    """An add that never reached the engine (refused, cancelled, shutting down)."""

    handle: Handle


@dataclass(frozen=True)
class Stepped:
    """A step ran without error: the prompt + generated tokens it processed."""

    tokens: int


@dataclass(frozen=True)
class Traced:
    """A step ran a pass: its trace."""

    trace: StepTrace


Event = Finished | Rejected | Stepped | Traced
