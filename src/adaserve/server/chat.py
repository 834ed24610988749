"""``POST /v1/chat/completions``: messages through the model's chat template into a
prompt, and the shape of a chat response (assistant message, streamed deltas)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from adaserve.errors import ModelLoadError
from adaserve.server.errors import ApiError
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
)
from adaserve.server.state import ServerState
from adaserve.server.validation import (
    ENCODE_IN_THREAD_CHARS,
    check_body,
    check_ids,
    check_text_size,
    encode,
)


def _choice(index, text, logprobs, finish_reason, metrics) -> ChatChoice:
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=text),
        logprobs=logprobs,
        finish_reason=finish_reason,
        metrics=metrics,
    )


def _stream_choice(index, text, finish_reason, logprobs) -> ChatStreamChoice:
    return ChatStreamChoice(
        index=index, delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=finish_reason
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
)


async def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """The messages through the tokenizer's chat template, as token ids."""
    tok = state.loop.info.tokenizer
    if tok is None:
        raise ApiError(
            400, "this model has no tokenizer: chat completions are unavailable", "messages"
        )
    msgs = []
    for m in body.messages:
        d = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        msgs.append(d)
    # the contents alone bound the prompt's length: no template run for a hopeless one
    check_text_size(
        state, sum(len(d["content"].encode("utf-8", "replace")) for d in msgs), "messages"
    )
    try:
        if sum(len(d["content"]) for d in msgs) > ENCODE_IN_THREAD_CHARS:
            text = await asyncio.to_thread(tok.apply_chat_template, msgs)
        else:
            text = tok.apply_chat_template(msgs)
    except ModelLoadError as e:
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
    return check_ids(state, await encode(state, text, "messages"), "messages")


async def create_chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    check_body(state, body)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    prompt = await chat_prompt(state, body)
    return await generate(
        state,
        request,
        body,
        CHAT,
        [prompt],
        body.max_completion_tokens or body.max_tokens,
        state.cfg.default_max_tokens,
        None,
        "messages",
    )
