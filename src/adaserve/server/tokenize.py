"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a prompt (``{"model", "prompt", "add_special_tokens": true}``) or a
conversation (``{"model", "messages", "add_generation_prompt", "tools", ...}``, rendered
by the chat template exactly as ``/v1/chat/completions`` renders it) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
``{"model", "tokens"}`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from adaserve.server.chat import render_chat
from adaserve.server.errors import ApiError
from adaserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from adaserve.server.state import ServerState
from adaserve.server.validation import check_body_model, encode, in_vocab


def parse_tokenize(data) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request model of a ``/tokenize`` body: the chat form when it has messages."""
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        ) from None


async def tokenize(state: ServerState, body) -> TokenizeResponse:
    check_body_model(state, body)
    if state.loop.ready_info.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", "prompt")
    if isinstance(body, TokenizeChatRequest):
        text = await state.off_loop(render_chat, state, body)
        param = "messages"
    else:
        text, param = body.prompt, "prompt"
    ids = await encode(state, text, param, add_special_tokens=body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [state.loop.ready_info.tokenizer.id_to_token(t) or "" for t in ids]
    return TokenizeResponse(
        count=len(ids),
        max_model_len=state.loop.ready_info.max_model_len,
        tokens=ids,
        token_strs=strs,
    )


async def detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_body_model(state, body)
    tok = state.loop.ready_info.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer", "tokens")
    ids = in_vocab(state, list(body.tokens), "tokens")
    text = await state.off_loop(tok.decode, ids)
    return DetokenizeResponse(prompt=text)
