"""Request checks beyond the pydantic models, and what a valid request turns into:
unknown fields, model and unsupported options; prompt tokens and the context window;
sampling parameters."""

from __future__ import annotations

import json

from adaserve.errors import InvalidRequestError
from adaserve.sampling import SamplingParams
from adaserve.server.errors import ApiError, context_error
from adaserve.server.state import ServerState

MAX_STOP_SEQUENCES = 16


def check_body(state: ServerState, body) -> None:
    """Unknown fields (400 when strict, else ignored with a warning), model, and options
    we do not implement."""
    check_body_model(state, body)
    if body.stop_token_ids:
        in_vocab(state, body.stop_token_ids, "stop_token_ids")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")


# vLLM's request fields that this server does not implement, each with its no-op value
# (what vLLM does without it). Any other value would change the output, so it is refused
# (400 ``unsupported_parameter``), never ignored; the no-op value is accepted silently.
# Fields without an effect on the output stay ordinary unknown fields (a warning).
UNSUPPORTED_VLLM_FIELDS: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "allowed_token_ids": None,
    "logits_processors": None,
    "prompt_embeds": None,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "return_tokens_as_token_ids": False,
    "spaces_between_special_tokens": True,
}


def check_body_model(state: ServerState, body) -> None:
    """vLLM fields that would change the output and are not implemented (400), unknown
    fields (400 when strict, else ignored with a warning) and the model."""
    given = body.model_extra or {}
    for name, noop in UNSUPPORTED_VLLM_FIELDS.items():
        if name in given and given[name] != noop:
            raise ApiError(
                400,
                f"{name} is not supported by this server (it would change the output; "
                f"leave it out or send {json_literal(noop)})",
                param=name,
                code="unsupported_parameter",
            )
    extra = sorted(k for k in given if k not in UNSUPPORTED_VLLM_FIELDS)
    if extra and state.cfg.strict_fields:
        raise ApiError(
            400,
            f"Unrecognized request argument supplied: {', '.join(extra)}",
            param=extra[0],
            code="unknown_parameter",
        )
    if extra:
        state.warn_ignored_fields(extra)
    if body.model is not None and body.model not in state.served_names:
        raise ApiError(
            404,
            f"The model {body.model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def json_literal(v: object) -> str:
    """``v`` as it is spelled in a JSON body (``null``, ``false``, ``1.0``)."""
    return json.dumps(v)


def check_choices(state: ServerState, prompts: int, n: int) -> None:
    if prompts * n > state.cfg.max_choices:
        raise ApiError(
            400, f"{prompts} prompts x n={n} exceeds {state.cfg.max_choices} choices", param="n"
        )


# ---------------------------------------------------------------------- body encoding

# byte order marks of the encodings JSON's old detection (RFC 4627 section 3) accepts
# besides UTF-8, longest first; UTF-8's own BOM is not among them (see below)
_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe\x00\x00", "UTF-32LE"),
    (b"\xfe\xff", "UTF-16BE"),
    (b"\xff\xfe", "UTF-16LE"),
)


def json_encoding_error(data: bytes) -> ApiError | None:
    """400 ``invalid_encoding`` for a JSON body that is not UTF-8 (RFC 8259 section
    8.1: JSON exchanged between systems MUST be UTF-8), as told by a UTF-16/32 byte
    order mark or a NUL byte among the first 4 bytes (JSON's old detection: a JSON text
    starts with two ASCII characters, which UTF-16/32 spell with NULs; a UTF-8 one has
    no raw NUL anywhere). Python's ``json`` would decode such a body and serve it. A
    UTF-8 byte order mark is ignored, as RFC 8259 allows and vLLM does. None: UTF-8 as
    far as this tells (invalid UTF-8 further on is the JSON parser's 400)."""
    head = data[:4]
    kind = next((name for bom, name in _BOMS if head.startswith(bom)), None)
    if kind is None and b"\x00" in head:
        kind = "UTF-16 or UTF-32"
    if kind is None:
        return None
    return ApiError(
        400,
        f"the request body looks like {kind}: JSON bodies must be UTF-8 (RFC 8259)",
        code="invalid_encoding",
    )


def is_json_content(content_type: str | None) -> bool:
    """A body to check as JSON: ``application/json`` or a ``+json`` type (any
    parameters, a charset included, are ignored), or no Content-Type (which FastAPI
    parses as JSON unless its content type is strict, as it is here by default)."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


# ---------------------------------------------------------------------- prompts


async def encode(
    state: ServerState, text: str, param: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of a text prompt (400 without a tokenizer or for invalid UTF-8)."""
    tok = state.loop.ready_info.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer: send prompts as token ids", param=param)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid UTF-8 text", param=param) from None
    check_text_size(state, size, param)
    return await state.off_loop(tok.encode_released, text, add_special_tokens)


def check_text_size(state: ServerState, size: int, param: str) -> None:
    """400 ``context_length_exceeded`` at once for a text of ``size`` UTF-8 bytes that
    cannot fit the context whatever its tokens: it has at least ``size /
    max_token_bytes`` of them. Checked before tokenising, which costs time in
    proportion to the text."""
    tok = state.loop.ready_info.tokenizer
    limit = state.loop.ready_info.max_model_len
    if tok is None or size <= limit:  # every token stands for at least one byte
        return
    least = size // tok.max_token_bytes
    if least >= limit:
        raise context_error(
            f"{param} has {size} bytes, so at least {least} tokens (a token stands for at "
            f"most {tok.max_token_bytes} bytes); the model's context is {limit} tokens",
            param,
        )


def check_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise ApiError(400, f"{param} is empty", param=param)
    return in_vocab(state, ids, param)


def in_vocab(state: ServerState, ids: list[int], param: str) -> list[int]:
    """``ids`` when every one is a token id of the model (400 naming ``param`` else)."""
    V = state.loop.ready_info.vocab_size
    if not all(0 <= t < V for t in ids):
        raise ApiError(400, f"token ids must be integers in [0, {V})", param=param)
    return ids


def max_tokens_per_prompt(
    state: ServerState,
    prompts: list[list[int]],
    max_tokens: int | None,
    default_max: int | None,
    prompt_param: str,
) -> list[int]:
    """Each prompt's token budget; 400 when a prompt or prompt + max_tokens does not fit
    the context, or when prompt + max_tokens can never be in the KV cache at once
    (``kv_cache_exceeded``: the request would never run, whatever the load). No
    max_tokens: the rest of the context, capped at ``default_max`` and at what the KV
    cache can hold."""
    L = state.loop.ready_info.max_model_len
    pool = kv_capacity(state)
    out = []
    for ids in prompts:
        if len(ids) + 1 > L:
            raise context_error(
                f"This model's maximum context length is {L} tokens; the prompt has "
                f"{len(ids)} tokens",
                prompt_param,
            )
        if pool and len(ids) + 1 > pool:
            raise context_error(
                f"the prompt has {len(ids)} tokens; this server's KV cache holds {pool}",
                prompt_param,
            )
        room = L - len(ids)
        # the last decode step holds the prompt and every output token but the last
        kv_room = pool - len(ids) + 1 if pool else room
        if max_tokens is not None:
            if max_tokens > room:
                raise context_error(
                    f"This model's maximum context length is {L} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{max_tokens} in the completion)",
                    "max_tokens",
                )
            if max_tokens > kv_room:
                raise ApiError(
                    400,
                    f"the prompt ({len(ids)} tokens) and max_tokens ({max_tokens}) can "
                    f"never be in this server's KV cache at once ({pool} tokens): at most "
                    f"{kv_room} tokens can be generated for this prompt",
                    "max_tokens",
                    code="kv_cache_exceeded",
                )
            out.append(max_tokens)
        else:
            budget = min(room, kv_room)
            out.append(min(budget, default_max) if default_max else budget)
    return out


def kv_capacity(state: ServerState) -> int:
    """Tokens the engine's KV pool holds (0: unknown)."""
    info = state.loop.ready_info
    return max(0, int(info.kv_blocks) * int(info.block_size))


# ---------------------------------------------------------------------- sampling


def requested_logprobs(body) -> int | None:
    """SamplingParams.logprobs of a request: completions' ``logprobs: N``, chat's
    ``logprobs: true`` with ``top_logprobs: N`` (0 when absent); None when not asked."""
    lp = body.logprobs
    if isinstance(lp, bool):
        return (body.top_logprobs or 0) if lp else None
    return lp


def sampling_params(
    body, max_tokens: int, seed: int | None, defaults: dict | None = None, constraint=None
) -> SamplingParams:
    stop = body.stop
    if isinstance(stop, list) and not stop:
        stop = None
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")
    # a field the request leaves out takes the model's generation_config.json default
    # (``--generation-config``), else OpenAI's
    d = defaults or {}
    explicit_max = getattr(body, "max_completion_tokens", None) or body.max_tokens
    top_k = body.top_k if body.top_k is not None else d.get("top_k", 0)
    top_k = top_k if top_k > 0 else 0
    try:
        return SamplingParams(
            temperature=d.get("temperature", 1.0) if body.temperature is None else body.temperature,
            top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=d.get("min_p", 0.0) if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(
                d.get("repetition_penalty", 1.0)
                if body.repetition_penalty is None
                else body.repetition_penalty
            ),
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            # above an explicit max_tokens: a 400; an implicit budget caps it
            min_tokens=body.min_tokens if explicit_max else min(body.min_tokens, max_tokens),
            logprobs=requested_logprobs(body),
            prompt_logprobs=body.logprobs if getattr(body, "echo", False) else None,
            structured_outputs=constraint,
            logit_bias=body.logit_bias or None,
            bad_words=tuple(body.bad_words) if body.bad_words else None,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None
