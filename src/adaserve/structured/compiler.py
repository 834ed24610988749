"""Grammar compilation: a backend turns a ``StructuredOutputsParams`` into a compiled
grammar for the model's vocabulary; ``GrammarCompiler`` caches them by content and
times every compile.

Backends: ``llguidance`` (Lark, JSON schema, regex; lazy Earley parsing with a token
trie, masks in tens of microseconds, no compile step worth the name) and ``xgrammar``
(EBNF, JSON schema, regex; a pushdown automaton compiled ahead per grammar), chosen by
``--structured-outputs-backend``. ``auto`` is llguidance: its first mask comes orders
of magnitude sooner and it accepts every kind (docs/results/structured-outputs.md).

Thread safety: ``compile`` may run in any thread (the server runs it in its worker
pool, never on the event loop or the engine thread); concurrent requests for one
grammar wait for a single compile.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from adaserve.errors import InvalidRequestError
from adaserve.structured.params import StructuredOutputsParams

BACKENDS = ("auto", "llguidance", "xgrammar")
# JSON's optional whitespace when the request names no pattern: compact (up to two
# spaces) or pretty-printed (one line break and its indentation) JSON, but never an
# unbounded run, so a sampling model cannot pad an object until max_tokens
DEFAULT_WHITESPACE = r"[ \t]{0,2}|\r?\n[ \t]{0,16}"


@dataclass
class Compiled:
    """A compiled grammar: ``new_matcher()`` gives a fresh matcher at its start."""

    backend: Any
    key: tuple
    handle: Any
    compile_s: float

    def new_matcher(self):
        return self.backend.new_matcher(self.handle)


def _no_extra_props(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that does
    not say (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_extra_props(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_extra_props(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _lark_string(s: str) -> str:
    """A Lark string literal of ``s`` (JSON's escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


class LLGuidanceBackend:
    """llguidance: grammars as its JSON grammar text; matchers ``LLMatcher``."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None
        )

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        M = self._llg.LLMatcher
        k = spec.kind
        if k in ("json", "json_object"):
            schema = spec.schema()
            if spec.disable_additional_properties:
                schema = _no_extra_props(schema)
            opts: Any = {}  # llguidance JsonCompileOptions
            if spec.disable_any_whitespace:
                opts["whitespace_flexible"] = False
            else:
                opts["whitespace_pattern"] = spec.whitespace_pattern or DEFAULT_WHITESPACE
            try:
                return M.grammar_from_json_schema(schema, overrides=opts)
            except (ValueError, TypeError) as e:
                raise _bad(spec, str(e)) from None
        if k == "regex":
            assert spec.regex is not None  # its kind
            return M.grammar_from_regex(spec.regex)
        if k == "choice":
            assert spec.choice is not None  # its kind
            return M.grammar_from_lark("start: " + " | ".join(map(_lark_string, spec.choice)))
        text = spec.grammar
        assert text is not None  # the one kind left
        if "::=" in text:  # GBNF / EBNF (llama.cpp's, xgrammar's) -> Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter's own error types
                raise _bad(spec, f"not a valid GBNF grammar: {e}") from None
        return M.grammar_from_lark(text)

    def compile(self, spec: StructuredOutputsParams):
        g = self.grammar_text(spec)
        M = self._llg.LLMatcher
        bad, msgs = M.validate_grammar_with_warnings(g, self.tokenizer)
        if bad:
            raise _bad(spec, msgs[0] if msgs else "invalid grammar")
        m = M(self.tokenizer, g, log_level=0)
        if m.is_error():
            raise _bad(spec, m.get_error())
        return m

    def new_matcher(self, template) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(template.deep_copy())


class LLGuidanceMatcher:
    """One request's llguidance matcher: consume, rollback, masks into int32 rows."""

    def __init__(self, m):
        self.m = m

    def consume(self, token: int) -> bool:
        return self.m.consume_token(int(token))

    def try_consume(self, tokens: list[int]) -> int:
        """Consume the longest accepted prefix of ``tokens``; returns its length (the
        matcher stays usable: no error state)."""
        return self.m.try_consume_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def fill_mask(self, row) -> None:
        """row: a C-contiguous int32 numpy array of ceil(V / 32) words."""
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def forced(self) -> list[int]:
        return list(self.m.compute_ff_tokens())

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


def _bad(spec: StructuredOutputsParams, why: str) -> InvalidRequestError:
    what = {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }[spec.kind]
    why = " ".join(why.split())
    return InvalidRequestError(f"invalid {what}: {why[:500]}", "structured_outputs")


def make_backend(name: str, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
    if name not in BACKENDS:
        raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}")
    if name == "xgrammar":
        from adaserve.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer_json, vocab_size, eos_ids)
    return LLGuidanceBackend(tokenizer_json, vocab_size, eos_ids)


class GrammarCompiler:
    """Compiled grammars by content (LRU, ``capacity`` entries), one compile per key
    however many requests ask at once; compile times are kept for the metrics."""

    def __init__(self, backend, capacity: int = 256):
        self.backend = backend
        self.capacity = capacity
        self._lock = threading.Lock()
        self._done: OrderedDict[tuple, Compiled] = OrderedDict()
        self._pending: dict[tuple, Future] = {}
        self.compile_times: list[float] = []  # seconds, drained by the metrics
        self.hits = 0
        self.misses = 0
        self.compiled = 0  # totals since start (the report and the dashboard)
        self.compile_s_total = 0.0
        self.compile_s_max = 0.0

    @property
    def name(self) -> str:
        return self.backend.name

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled grammar of ``spec`` (InvalidRequestError naming the problem
        when it does not compile)."""
        key = spec.key()
        with self._lock:
            c = self._done.get(key)
            if c is not None:
                self._done.move_to_end(key)
                self.hits += 1
                return c
            fut = self._pending.get(key)
            mine = fut is None
            if fut is None:
                fut = self._pending[key] = Future()
                self.misses += 1
            else:
                self.hits += 1
        if not mine:
            return fut.result()
        t0 = time.perf_counter()
        try:
            handle = self.backend.compile(spec)
        except InvalidRequestError as e:
            with self._lock:
                del self._pending[key]
            fut.set_exception(e)
            raise
        except Exception as e:  # a backend's own failure is the grammar's problem
            err = _bad(spec, f"{type(e).__name__}: {e}")
            with self._lock:
                del self._pending[key]
            fut.set_exception(err)
            raise err from None
        c = Compiled(self.backend, key, handle, time.perf_counter() - t0)
        with self._lock:
            self._done[key] = c
            while len(self._done) > self.capacity:
                self._done.popitem(last=False)
            del self._pending[key]
            self.compile_times.append(c.compile_s)
            self.compiled += 1
            self.compile_s_total += c.compile_s
            self.compile_s_max = max(self.compile_s_max, c.compile_s)
        fut.set_result(c)
        return c
