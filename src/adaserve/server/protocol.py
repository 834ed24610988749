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

import json
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
    on_overload: Literal["refuse", "degrade"] | None = Field(
        None,
        description="when the class cannot admit the request now: refuse (429) or serve "
        "it in the looser class its class degrades to (default: the tenant's setting)",
    )


class StreamOptions(_Nested):
    include_usage: bool = False


class JsonSchemaFormat(_Nested):
    """``response_format.json_schema`` (OpenAI's): the schema the output must match."""

    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # OpenAI's strict mode takes a subset of JSON schema; here every schema the backend
    # compiles is enforced exactly, strict or not
    strict: bool | None = None


class ResponseFormat(_Nested):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.json_schema is not None:
            d["json_schema"] = {"schema": self.json_schema.schema_ or {"type": "object"}}
        return d


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
    # accepted as OpenAI and vLLM accept them, no effect on the output here: metadata
    # and store (nothing is stored), request_id (responses carry their own id)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    request_id: str | None = Field(None, max_length=256)
    # vLLM's: no EOS or stop token before this many output tokens
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    skip_special_tokens: bool = True
    # vLLM's: the stop string stays in the text; words never generated
    include_stop_str_in_output: bool = False
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=256
    )
    # --- structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # (json, regex, choice, grammar, json_object, ...) and its deprecated guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=4096)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = Field(None, max_length=64)
    # vLLM's: the request's cached prefix is shared only with requests of this salt
    # (within its tenant's prefix-cache group)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)


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


class ToolFunctionCall(_Nested):
    name: str = Field(max_length=256)
    arguments: str


class ToolCall(_Nested):
    """A tool call of an earlier assistant message (passed to the chat template)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolFunctionCall

    def template_dict(self) -> dict:
        """As templates read it: the arguments as a dict when they are a JSON object
        (what transformers' templates expect, as vLLM passes them), else the text."""
        d = self.model_dump()
        try:
            args = json.loads(self.function.arguments)
        except ValueError:
            return d
        if isinstance(args, dict):
            d["function"]["arguments"] = args
        return d


class ChatMessage(_Nested):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    # what reasoning models' templates read back (vLLM accepts it)
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict:
        """The message as a chat template sees it (transformers' message dicts)."""
        d: dict = {"role": self.role, "content": self.text()}
        if self.content is None and self.tool_calls:
            d["content"] = None  # dropped before rendering, as transformers does
        for k in ("name", "tool_call_id", "reasoning_content"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.tool_calls is not None:
            d["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        return d


class FunctionDefinition(BaseModel):
    """A tool's function (its JSON schema is passed to the template as sent)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Nested):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Nested):
    name: str


class NamedToolChoice(_Nested):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # tools go to the chat template; tool_choice "required" and a named function are
    # constrained to the tools' schemas, "auto" is parsed (--tool-call-parser), and
    # tools without a tool_choice mean "auto" (as vLLM)
    tools: list[Tool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = Field(None, max_length=256)
    chat_template: str | None = Field(None, max_length=1 << 20)
    chat_template_kwargs: dict[str, Any] | None = None


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


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: prompt tokens served from the prefix
    cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = _omitted_if_none()


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


class FunctionCallDelta(BaseModel):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    tool_calls: list[ToolCallDelta] | None = _omitted_if_none()


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


# ---------------------------------------------------------------------- vLLM's extras


class TokenizeCompletionRequest(_TopLevel):
    """``POST /tokenize`` of a prompt (vLLM's shape)."""

    model: str | None = Field(None, max_length=1024)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_TopLevel):
    """``POST /tokenize`` of a conversation, through the chat template (vLLM's shape)."""

    model: str | None = Field(None, max_length=1024)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=256)
    documents: list[dict[str, str]] | None = Field(None, max_length=256)
    chat_template: str | None = Field(None, max_length=1 << 20)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_TopLevel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = Field(None, max_length=1024)
    tokens: list[Annotated[int, Field(ge=0, le=INT32)]] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
