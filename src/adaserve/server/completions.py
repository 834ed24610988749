"""``POST /v1/completions``: prompts (text, texts, token ids), echo and prompt scoring
(``max_tokens=0`` with ``echo``), and the shape of a completion response."""

from __future__ import annotations

from fastapi import Request

from adaserve.server.errors import ApiError, unsupported
from adaserve.server.generation import generate
from adaserve.server.jobs import Endpoint
from adaserve.server.logprobs import completion_logprobs
from adaserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
)
from adaserve.server.state import ServerState
from adaserve.server.validation import check_body, check_ids, encode


def _choice(index, text, logprobs, finish_reason, metrics) -> CompletionChoice:
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, metrics=metrics
    )


def _stream_choice(index, text, finish_reason, logprobs) -> CompletionStreamChoice:
    return CompletionStreamChoice(
        index=index, text=text or "", logprobs=logprobs, finish_reason=finish_reason
    )


def _opening(index: int, echo: str | None) -> CompletionStreamChoice | None:
    """With echo, a choice's stream starts with its prompt."""
    return None if echo is None else _stream_choice(index, echo, None, None)


COMPLETION = Endpoint(
    id_prefix="cmpl-",
    response=CompletionResponse,
    chunk=CompletionChunk,
    logprobs=completion_logprobs,
    choice=_choice,
    stream_choice=_stream_choice,
    opening=_opening,
)


async def _prompts(state: ServerState, p) -> list[list[int]]:
    """The token ids of every prompt of the four accepted forms."""
    if isinstance(p, str):
        return [check_ids(state, await encode(state, p, "prompt"), "prompt")]
    if not p:
        raise ApiError(400, "prompt is empty", param="prompt")
    if isinstance(p[0], str):
        return [check_ids(state, await encode(state, s, "prompt"), "prompt") for s in p]
    if isinstance(p[0], int):
        return [check_ids(state, list(p), "prompt")]
    return [check_ids(state, list(ids), "prompt") for ids in p]


async def create_completion(state: ServerState, body: CompletionRequest, request: Request):
    check_body(state, body)
    if body.suffix:
        raise unsupported("suffix", "suffix is not supported")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1 is not supported")
    score_only = body.max_tokens == 0  # OpenAI's scoring form: echo, no completion
    if score_only and not body.echo:
        raise ApiError(
            400, "max_tokens must be at least 1 (0 only with echo=true)", param="max_tokens"
        )
    if score_only and body.stream:
        raise unsupported("max_tokens", "max_tokens=0 (scoring the prompt) is not streamed")
    prompts = await _prompts(state, body.prompt)
    echo = None
    if body.echo:
        tok = state.loop.ready_info.tokenizer
        echo = [await state.off_loop(tok.decode, ids) if tok else "" for ids in prompts]
    return await generate(
        state,
        request,
        body,
        COMPLETION,
        prompts,
        1 if score_only else body.max_tokens,  # one token is generated and dropped
        16,
        echo,
        "prompt",
        score_only=score_only,
    )
