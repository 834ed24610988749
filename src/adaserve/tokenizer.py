"""Thin wrapper over a ``tokenizer.json`` (the ``tokenizers`` library), plus chat template."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from adaserve.errors import ModelLoadError

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


class Tokenizer:
    """Encode/decode text; knows EOS and the chat template of its checkpoint."""

    def __init__(self, tok, config: dict):
        self._tok = tok
        self.config = config
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
        self.chat_template = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_released(self, text: str) -> list[int]:
        """``encode`` through the batch call, which releases the GIL while it runs (the
        single call holds it: a long text run in a worker thread would stall every
        other thread, the engine's included)."""
        return self._tok.encode_batch([text])[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the vocabulary stands for: a text of ``b``
        bytes has at least ``b / max_token_bytes`` tokens, which bounds a prompt's
        length before it is tokenised."""
        n = self._tok.get_vocab_size(with_added_tokens=True)
        dec = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max(1, max(len(t.encode("utf-8")) for t in dec))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render messages with the checkpoint's template (or the documented default)."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            tmpl = env.from_string(self.chat_template)
            return tmpl.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.config.get("bos_token") or "",
                eos_token=self.config.get("eos_token") or "",
            )
        except jinja2.TemplateError as e:
            raise ModelLoadError(f"chat template failed: {e}") from None


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
    return Tokenizer(tok, cfg)


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
