"""Thin wrapper over a ``tokenizer.json`` (the ``tokenizers`` library), plus the chat
templates of the checkpoint (``adaserve.text.chat_template``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from adaserve.errors import ModelLoadError
from adaserve.text.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate

__all__ = ["DEFAULT_CHAT_TEMPLATE", "Tokenizer", "check_draft_tokenizer", "load_tokenizer"]


class Tokenizer:
    """Encode/decode text; knows EOS and the chat templates of its checkpoint
    (``adaserve.text.chat_template``)."""

    def __init__(self, tok, config: dict, chat: ChatTemplate | None = None):
        self._tok = tok
        self.config = config
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
        self.chat = chat or ChatTemplate({"default": DEFAULT_CHAT_TEMPLATE}, config)

    @property
    def chat_template(self) -> str:
        """The default chat template's text."""
        return self.chat.pick()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode_released(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` through the batch call, which releases the GIL while it runs (the
        single call holds it: a long text run in a worker thread would stall every
        other thread, the engine's included)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the vocabulary stands for: a text of ``b``
        bytes has at least ``b / max_token_bytes`` tokens, which bounds a prompt's
        length before it is tokenised."""
        n = self._tok.get_vocab_size(with_added_tokens=True)
        dec = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max(1, max(len(t.encode("utf-8")) for t in dec))

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (what grammar libraries build their vocabulary
        from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        """Render messages with the checkpoint's template (or the documented default);
        ``kwargs`` as ``ChatTemplate.render`` (``tools``, ``add_generation_prompt``)."""
        return self.chat.render(messages, **kwargs)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    f = path / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        tok = HFTokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ModelLoadError(f"cannot read {f}: {e}") from None
    cfg = {}
    cf = path / "tokenizer_config.json"
    if cf.is_file():
        try:
            cfg = json.loads(cf.read_text())
        except json.JSONDecodeError:
            cfg = {}
    return Tokenizer(tok, cfg, ChatTemplate.of_checkpoint(path, cfg))


def check_draft_tokenizer(target: Tokenizer | None, draft: Tokenizer | None, draft_dir) -> None:
    """Refuse a draft whose tokenizer maps tokens to other ids than the target's (a
    draft of another model family: its proposals would all be rejected). Vocabulary
    *sizes* may differ (padding rows, as between Qwen2.5 sizes); without a tokenizer on
    either side there is nothing to compare and speculation stays lossless anyway."""
    if target is None or draft is None:
        return
    tv = target._tok.get_vocab(with_added_tokens=True)
    dv = draft._tok.get_vocab(with_added_tokens=True)
    if tv != dv:
        shared = sum(1 for t, i in dv.items() if tv.get(t) == i)
        raise ModelLoadError(
            f"the draft {draft_dir} has another tokenizer than the target: {shared} of its "
            f"{len(dv)} tokens have the target's id (the target has {len(tv)} tokens)"
        )
