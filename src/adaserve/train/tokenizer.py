"""Byte-level BPE tokenizer (``tokenizers``) trained on the corpus.

Byte-level pre-tokenization makes every string round-trip exactly (indentation, newlines,
any Unicode). ``<|endoftext|>`` is the only special token: end of sequence and document
separator.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "### {{ message['role'] }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Train a byte-level BPE of ``vocab_size`` tokens (the EOS token is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def eos_id(tok) -> int:
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise ValueError("tokenizer has no <|endoftext|> token")
    return i


def load_tokenizer(path: str | Path):
    """``path``: a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 2048) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_documents(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def token_stream(tok, texts: list[str]):
    """All documents concatenated, each followed by EOS -> 1-D int64 tensor."""
    import torch

    eos = eos_id(tok)
    ids: list[int] = []
    for doc in encode_documents(tok, texts):
        ids.extend(doc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
