"""OpenAI-compatible request and response models (pydantic), plus SLO extensions.

Request models are strict about types (``strict=True``: no "5" for 5) and about the
shape of nested objects (``extra="forbid"``). Unknown *top-level* fields are kept in
``model_extra`` and rejected by the server when ``strict_fields`` is on (the default),
the way the OpenAI API answers "Unrecognized request argument supplied".

Extensions over the OpenAI API (all optional, sent by clients through ``extra_body``):
``slo`` (explicit targets), ``slo_class``, ``priority`` (vLLM-style integer),
``top_k``, ``seed``, ``stop_token_ids``, ``ignore_eos``. Responses carry a per-request
``metrics`` object.

Response models are what the handlers build and dump (``render.dumps``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from adaserve.sampling import MAX_TOKENS_LIMIT

MAX_SLO_MS = 1e9
INT32 = 2**31 - 1


class _Nested(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TopLevel(BaseModel):
    # unknown fields are kept and refused by the server when strict_fields is on (the
    # documented default, hence additionalProperties: false in the schema)
    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra={"additionalProperties": False}
    )


class SLOSpec(_Nested):
    """Explicit latency targets of one request, in milliseconds."""

    tpot_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description="time per output token")
    ttft_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS, description="time to first token")
    max_queue_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)
    deadline_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)


class StreamOptions(_Nested):
    include_usage: bool = False


class _Sampling(_TopLevel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=1024)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32, description="0 or -1 = off")
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32)]] | None = Field(
        None, max_length=64, description="token ids in [0, vocab size)"
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras (repetition over prompt + output tokens, as vLLM's)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_p: float | None = Field(None, ge=0, le=1)
    user: str | None = Field(None, max_length=1024)
    # --- SLO extensions (see docs/server.md for the precedence)
    slo: SLOSpec | None = None
    slo_class: str | None = Field(None, min_length=1, max_length=128)
    priority: int | None = Field(None, ge=-INT32, le=INT32)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: score the prompt, generate nothing (checked by the handler)
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=64)
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(_Nested):
    type: Literal["text"]
    text: str


class ChatMessage(_Nested):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        """The message content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Nested):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------- responses
# The handlers build every response body from these models (``model_dump``). Fields made
# with ``_omitted_if_none()`` are left out of a body when None; other None fields are
# written as null, as OpenAI does.


def _omitted_if_none(**kw) -> Any:
    return Field(None, exclude_if=lambda v: v is None, **kw)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    reason: str | None = _omitted_if_none(
        description="why a request was refused (429/503): the quota, the shed reason, "
        "server_shutdown"
    )


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class RequestMetrics(BaseModel):
    """Per-request metrics (more fields may be present)."""

    model_config = ConfigDict(extra="allow")
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    queue_ms: float | None = None
    e2e_ms: float | None = None
    slo_class: str
    slo_attained: bool
    accepted_tokens: int = 0
    tree_nodes: int = 0

    @classmethod
    def of(cls, metrics: dict) -> RequestMetrics:
        """The engine's metrics dict as they are (not validated: every key is kept)."""
        return cls.model_construct(**metrics)

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        # a body carries the keys the engine reported, not the declared defaults
        d = handler(self)
        declared = type(self).model_fields
        return {k: v for k, v in d.items() if k in self.model_fields_set or k not in declared}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """An echoed prompt's first token has no logprob (None), as OpenAI's."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    metrics: RequestMetrics | None = None


class _Response(BaseModel):
    """A whole (non-streamed) completion or chat completion, less its choices."""

    id: str
    object: str
    created: int
    model: str
    usage: Usage
    metrics: RequestMetrics | None = None
    service_tier: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    metrics: RequestMetrics | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


# SSE chunks (``stream=true``): one choice each; the last chunk of a choice carries its
# metrics, and with ``stream_options.include_usage`` a final chunk has no choices and
# the usage.


class _Chunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    metrics: RequestMetrics | None = _omitted_if_none()
    usage: Usage | None = _omitted_if_none()


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionStreamChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
