"""``POST /v1/chat/completions``: messages through the model's chat template into a
prompt, and the shape of a chat response (assistant message, streamed deltas)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from adaserve.errors import InvalidRequestError, ModelLoadError
from adaserve.server.errors import ApiError, unsupported
from adaserve.server.generation import generate
from adaserve.server.jobs import Endpoint
from adaserve.server.logprobs import chat_logprobs
from adaserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    FunctionCallDelta,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
)
from adaserve.server.state import ServerState
from adaserve.server.validation import (
    check_body,
    check_ids,
    check_text_size,
    encode,
)
from adaserve.structured.tools import ToolMode, tool_mode


def _choice(index, text, logprobs, finish_reason, metrics, calls=None) -> ChatChoice:
    tool_calls = None
    if calls:
        tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls
        ]
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=text, tool_calls=tool_calls),
        logprobs=logprobs,
        finish_reason=finish_reason,
        metrics=metrics,
    )


def _stream_choice(index, text, finish_reason, logprobs) -> ChatStreamChoice:
    return ChatStreamChoice(
        index=index, delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=finish_reason
    )


def _tool_stream_choice(index, events, finish_reason, logprobs) -> ChatStreamChoice | None:
    """A streamed choice of ``ToolStream`` events: content, then tool-call deltas (a
    call's first delta has its id, type and name; the rest argument fragments)."""
    content = "".join(e[1] for e in events if e[0] == "content") or None
    calls = [
        ToolCallDelta(
            index=e[1],
            id=e[2],
            type="function" if e[2] is not None else None,
            function=FunctionCallDelta(name=e[3], arguments=e[4]),
        )
        for e in events
        if e[0] == "call"
    ]
    if content is None and not calls and finish_reason is None and logprobs is None:
        return None
    return ChatStreamChoice(
        index=index,
        delta=ChatDelta(content=content, tool_calls=calls or None),
        logprobs=logprobs,
        finish_reason=finish_reason,
    )


def _opening(index: int, echo: str | None) -> ChatStreamChoice:
    """Every choice's stream starts with the assistant's role."""
    return ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))


CHAT = Endpoint(
    id_prefix="chatcmpl-",
    response=ChatCompletionResponse,
    chunk=ChatCompletionChunk,
    logprobs=chat_logprobs,
    choice=_choice,
    stream_choice=_stream_choice,
    opening=_opening,
    tool_stream_choice=_tool_stream_choice,
)


# names the template gets from the server, not from chat_template_kwargs
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}


def check_tools(state: ServerState, body: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool mode: "none" (text; the tools still go to the template), a
    named function or "required" (constrained to the tools' schemas), "auto" (parsed
    by ``--tool-call-parser``; refused without ``--enable-auto-tool-choice``). Tools
    without a tool_choice mean "auto", as vLLM and OpenAI read them."""
    choice: Any = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        return tool_mode(
            tools,
            choice,
            body.parallel_tool_calls,
            state.cfg.enable_auto_tool_choice,
            state.cfg.tool_call_parser,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None


def render_kwargs(body: ChatCompletionRequest) -> dict:
    """Template arguments of a request beyond its messages."""
    explicit = "add_generation_prompt" in body.model_fields_set
    if body.continue_final_message and body.add_generation_prompt and explicit:
        raise ApiError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    kw = dict(body.chat_template_kwargs or {})
    bad = sorted(_RESERVED & set(kw))
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {bad}", "chat_template_kwargs")
    if body.tools is not None:
        kw["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.documents is not None:
        kw["documents"] = body.documents
    kw["add_generation_prompt"] = body.add_generation_prompt and not body.continue_final_message
    return kw


def _continue_final(text: str, msgs: list[dict]) -> str:
    """The rendered chat cut after the final message's content (transformers'
    ``continue_final_message``), so the model continues that message."""
    final = msgs[-1].get("content") or ""
    if not final.strip():
        raise ApiError(400, "continue_final_message needs a non-empty final message", "messages")
    at = text.rfind(final.strip())
    if at < 0:
        raise ApiError(
            400,
            "continue_final_message: the template does not render the final message",
            "messages",
        )
    return text[: at + len(final.strip())]


def render_chat(state: ServerState, body: ChatCompletionRequest) -> str:
    """The messages through the model's (or ``--chat-template``'s) chat template."""
    ct = state.chat_template
    if ct is None:
        raise ApiError(
            400, "this model has no tokenizer: chat completions are unavailable", "messages"
        )
    if body.chat_template is not None:
        raise unsupported(
            "chat_template", "a chat_template in the request is not accepted (--chat-template)"
        )
    msgs = [m.template_dict() for m in body.messages]
    # the contents alone bound the prompt's length: no template run for a hopeless one
    check_text_size(
        state, sum(len(m.text().encode("utf-8", "replace")) for m in body.messages), "messages"
    )
    kw = render_kwargs(body)
    try:
        text = ct.render(msgs, **kw)
    except ModelLoadError as e:
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
    if body.continue_final_message:
        text = _continue_final(text, msgs)
    return text


async def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The rendered chat as token ids (the template writes the special tokens itself:
    none are added unless ``add_special_tokens``, as vLLM)."""
    text = await state.off_loop(render_chat, state, body)
    ids = await encode(state, text, "messages", add_special_tokens=body.add_special_tokens)
    return check_ids(state, ids, "messages")


async def create_chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    check_body(state, body)
    tools = check_tools(state, body)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    prompt = await chat_prompt(state, body)
    default_max = state.cfg.default_max_tokens
    gen_max = state.loop.ready_info.sampling_defaults.get("max_tokens")
    if gen_max is not None:  # generation_config.json's max_new_tokens
        default_max = min(default_max or gen_max, gen_max)
    return await generate(
        state,
        request,
        body,
        CHAT,
        [prompt],
        body.max_completion_tokens or body.max_tokens,
        default_max,
        None,
        "messages",
        tools=tools,
    )
