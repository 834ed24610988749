"""The OpenAI ``logprobs`` objects of some tokens: chat's ``{"content": [...]}`` and
completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

``entries``: (logprob, ((id, logprob), ...)) per token (None for an echoed prompt's
first token), or None when logprobs were not requested.
"""

from __future__ import annotations

from adaserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def token_text(tok, token_id: int) -> str:
    """The text of one token (``token_id:N`` without a tokenizer, as vLLM writes it)."""
    return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"


def chat_logprobs(tok, ids, entries) -> ChatLogprobs | None:
    if entries is None:
        return None

    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    texts = [token_text(tok, t) for t in list(ids)[: len(entries)]]
    return ChatLogprobs(
        content=[
            TokenLogprob(
                **item(s, lp),
                top_logprobs=[TopLogprob(**item(token_text(tok, t), v)) for t, v in top],
            )
            for s, (lp, top) in zip(texts, entries)
        ]
    )


def completion_logprobs(tok, ids, entries) -> CompletionLogprobs | None:
    if entries is None:
        return None
    texts = [token_text(tok, t) for t in list(ids)[: len(entries)]]
    offsets, pos = [], 0
    for s in texts:
        offsets.append(pos)
        pos += len(s)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[None if e is None else e[0] for e in entries],
        top_logprobs=[
            None if e is None else {token_text(tok, t): v for t, v in e[1]} for e in entries
        ],
        text_offset=offsets,
    )
